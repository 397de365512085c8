"""hp_fastload: load Hugging Face safetensors checkpoints straight into local shards of distributed models,
and save them back (``save``: every rank writes its own shards into the released layout).

The Rust engine (``hp_fastload._core``) reads strided boxes of safetensors tensors into caller memory in
parallel threads; the Python layer plans which boxes each rank needs, through the checkpoint's conversion
rules, and writes them into the local shards of the model's DTensors.
"""

from __future__ import annotations

from .api.rehearse import Rehearsal, as_rank, plan_each, rehearse
from .checkpointer import HF_LOADER_ENV, HuggingFaceCheckpointer, load, plan, resolve_hf_loader
from .engine import HeaderEntry, SafetensorsFile, clear_cache, read_into, read_many
from .errors import (
    CheckpointMismatchError,
    HeaderError,
    HpFastloadError,
    MissingKeysError,
    PlanError,
    ReadError,
    TargetError,
)
from .plan import ConversionError, LoadPlan, LoadReport, Replacement
from .pretrained import from_pretrained
from .quant import QuantizationError
from .save import SaveReport, save

__all__ = [
    "HF_LOADER_ENV",
    "CheckpointMismatchError",
    "ConversionError",
    "HeaderEntry",
    "HeaderError",
    "HpFastloadError",
    "HuggingFaceCheckpointer",
    "LoadPlan",
    "LoadReport",
    "MissingKeysError",
    "PlanError",
    "QuantizationError",
    "ReadError",
    "Rehearsal",
    "Replacement",
    "SafetensorsFile",
    "SaveReport",
    "TargetError",
    "as_rank",
    "clear_cache",
    "from_pretrained",
    "load",
    "plan",
    "plan_each",
    "read_into",
    "read_many",
    "rehearse",
    "resolve_hf_loader",
    "save",
]
