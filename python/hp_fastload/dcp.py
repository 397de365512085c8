"""Public ``hp_fastload.dcp``: drop-in ``torch.distributed.checkpoint`` storage readers over Hugging Face
safetensors files (defined in ``hp_fastload.api.dcp``)."""

from hp_fastload.api.dcp import HuggingFaceStorageReader, QuantizedHuggingFaceStorageReader

__all__ = ["HuggingFaceStorageReader", "QuantizedHuggingFaceStorageReader"]
