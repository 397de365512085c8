"""hp_fastload: load Hugging Face safetensors checkpoints straight into local shards of distributed models,
and save them back (``save``: every rank writes its own shards into the released layout).

The Rust engine (``hp_fastload._core``) reads strided boxes of safetensors tensors into caller memory in
parallel threads; the Python layer plans which boxes each rank needs, through the checkpoint's conversion
rules, and writes them into the local shards of the model's DTensors.
"""

from __future__ import annotations

# ``hf.rules.WeightConverter`` etc. (the rule classes users pass as weights_mapping), as before the layers.
from hp_fastload import rules
from hp_fastload.api.checkpointer import HuggingFaceCheckpointer
from hp_fastload.api.load import HF_LOADER_ENV, load, plan, resolve_hf_loader
from hp_fastload.api.peft import load_adapter
from hp_fastload.api.pretrained import from_pretrained
from hp_fastload.api.read import read_into, read_many
from hp_fastload.api.rehearse import Rehearsal, as_rank, plan_each, rehearse
from hp_fastload.api.save import SaveReport, save
from hp_fastload.api.transfer import TransferReport, transfer
from hp_fastload.errors import (
    AdapterMismatchError,
    CheckpointMismatchError,
    ConversionError,
    HeaderError,
    HpFastloadError,
    MissingKeysError,
    PeerInterrupted,
    PeerLost,
    PlanError,
    QuantizationError,
    ReadError,
    TargetError,
)
from hp_fastload.planning.items import LoadPlan, LoadReport
from hp_fastload.planning.replacement import Replacement
from hp_fastload.source.files import HeaderEntry, SafetensorsFile, clear_cache
from hp_fastload.support import info

__all__ = [
    "AdapterMismatchError",
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
    "PeerInterrupted",
    "PeerLost",
    "PlanError",
    "QuantizationError",
    "ReadError",
    "Rehearsal",
    "Replacement",
    "SafetensorsFile",
    "SaveReport",
    "TargetError",
    "TransferReport",
    "as_rank",
    "clear_cache",
    "from_pretrained",
    "info",
    "load",
    "load_adapter",
    "plan",
    "plan_each",
    "read_into",
    "read_many",
    "rehearse",
    "resolve_hf_loader",
    "rules",
    "save",
    "transfer",
]


def __getattr__(name: str) -> object:
    """``hp_fastload.integrations`` on first use: it imports transformers, which ``import hp_fastload`` does not."""
    if name == "integrations":
        import importlib

        return importlib.import_module("hp_fastload.integrations")
    raise AttributeError(f"module 'hp_fastload' has no attribute {name!r}")
