"""Small checkpoints and runners shared by the tests: ``TinyModule`` (one ``Linear``) with its tensors
(``tiny_tensors``, written by safetensors' ``save_file``), ``write_sharded_pair`` (a two-shard checkpoint whose index
can point a tensor at the wrong shard), ``load_file_tensors`` (a checkpoint loaded into a ``TinyModule``) and
``run_child`` (code in a fresh interpreter, with a timeout that fails the test instead of hanging)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import hp_fastload as hf
from hp_fastload.formats import INDEX_NAME


def load_file_tensors(path: str | os.PathLike[str], **kwargs: Any) -> dict[str, torch.Tensor]:
    model = TinyModule()
    report = hf.load(model, path, weights_mapping=[], **kwargs)
    assert not report.missing_keys
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def write_sharded_pair(root: Path, seed: int = 1, bias_file: str = "model-00002-of-00002.safetensors") -> Path:
    """A two-shard checkpoint under ``root`` (weight in shard 1, bias in shard 2) whose index puts the bias
    in ``bias_file``."""
    root.mkdir(parents=True, exist_ok=True)
    t = tiny_tensors(seed)
    save_file({"lin.weight": t["lin.weight"]}, str(root / "model-00001-of-00002.safetensors"))
    save_file({"lin.bias": t["lin.bias"]}, str(root / "model-00002-of-00002.safetensors"))
    index = {"metadata": {}, "weight_map": {"lin.weight": "model-00001-of-00002.safetensors", "lin.bias": bias_file}}
    (root / INDEX_NAME).write_text(json.dumps(index))
    return root


def run_child(code: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """Runs ``code`` in a fresh interpreter (same environment); a hang fails the test."""
    try:
        return subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"child process hung and was killed after {timeout} s: {exc.stdout!r} {exc.stderr!r}")


def tiny_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"lin.weight": torch.randn(6, 4, generator=g), "lin.bias": torch.randn(6, generator=g)}


class TinyModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)
