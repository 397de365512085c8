"""hp_fastload: load Hugging Face safetensors checkpoints straight into local shards of distributed models.

The Rust engine (``hp_fastload._core``) reads strided boxes of safetensors tensors into caller memory in
parallel threads; the Python layer plans which boxes each rank needs, through the checkpoint's conversion
rules, and writes them into the local shards of the model's DTensors.
"""

from __future__ import annotations

from .checkpointer import HF_LOADER_ENV, HuggingFaceCheckpointer, load, plan, resolve_hf_loader
from .engine import SafetensorsFile, read_into, read_many
from .errors import HeaderError, HpFastloadError, MissingKeysError, PlanError, ReadError, TargetError
from .plan import ConversionError, LoadPlan, LoadReport, Replacement
from .pretrained import from_pretrained
from .quant import QuantizationError

__all__ = [
    "HF_LOADER_ENV",
    "ConversionError",
    "HeaderError",
    "HpFastloadError",
    "HuggingFaceCheckpointer",
    "LoadPlan",
    "LoadReport",
    "MissingKeysError",
    "PlanError",
    "QuantizationError",
    "ReadError",
    "Replacement",
    "SafetensorsFile",
    "TargetError",
    "from_pretrained",
    "load",
    "plan",
    "read_into",
    "read_many",
    "resolve_hf_loader",
]
