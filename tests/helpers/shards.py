"""Writing a sharded checkpoint of tiny tensors with ``save_file``: one file per name list, and the index."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file


def write_sharded(root: Path, shards: Sequence[Sequence[str]]) -> None:
    """``s{i}.safetensors`` holding a one-element tensor per name of ``shards[i]``, and the
    ``model.safetensors.index.json`` whose ``weight_map`` names each one's file."""
    weight_map = {}
    for i, shard in enumerate(shards):
        save_file({n: torch.zeros(1) for n in shard}, str(root / f"s{i}.safetensors"))
        weight_map.update(dict.fromkeys(shard, f"s{i}.safetensors"))
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
