"""hp_fastload: load Hugging Face safetensors checkpoints straight into local shards of distributed models.

The Rust engine (``hp_fastload._core``) reads strided boxes of safetensors tensors into caller memory in
parallel threads; the Python layer plans which boxes each rank needs, through the checkpoint's conversion
rules, and writes them into the local shards of the model's DTensors.
"""

from __future__ import annotations

from .engine import SafetensorsFile, read_into, read_many
from .errors import HeaderError, HpFastloadError, PlanError, ReadError, TargetError

__all__ = [
    "HeaderError",
    "HpFastloadError",
    "PlanError",
    "ReadError",
    "SafetensorsFile",
    "TargetError",
    "read_into",
    "read_many",
]
