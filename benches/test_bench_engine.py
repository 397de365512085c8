"""pytest-benchmark: one rank-of-4's rows (Shard(0)) and columns (Shard(1)) of a 256 MiB bf16 checkpoint.

hp_fastload (``read_many``, one engine call) against safetensors (``safe_open(...).get_slice(k)[...]`` then
``copy_`` into preallocated tensors) and against a plain torch memcpy of the same number of bytes. The file is
warm in the page cache. Skipped by default; run with::

    .venv/bin/python -m pytest benches -q --benchmark-only --benchmark-enable

Each result records the delivered bandwidth in ``extra_info["GB/s"]`` (shard bytes / mean time).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import hp_fastload as hf

ROWS, COLS, TENSORS, RANKS = 4096, 8192, 4, 4  # 4 x 64 MiB of bf16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("bench") / "model.safetensors"
    gen = torch.Generator().manual_seed(0)
    tensors = {f"layers.{i}.weight": torch.randn(ROWS, COLS, generator=gen).to(torch.bfloat16) for i in range(TENSORS)}
    save_file(tensors, str(path))
    return str(path)


def shard(columns: bool) -> tuple[list[int], list[int]]:
    """Rank 0's box of one tensor."""
    if columns:
        return [0, 0], [ROWS, COLS // RANKS]
    return [0, 0], [ROWS // RANKS, COLS]


def run(benchmark: Any, fn: Callable[[], object], nbytes: int) -> None:
    benchmark.pedantic(fn, rounds=5, iterations=1, warmup_rounds=1)
    benchmark.extra_info["bytes"] = nbytes
    benchmark.extra_info["GB/s"] = round(nbytes / benchmark.stats.stats.mean / 1e9, 3)


@pytest.mark.parametrize("columns", [False, True], ids=["rows", "cols"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("backend", ["auto", "mmap", "pread"])
def test_hp_fastload(benchmark: Any, checkpoint: str, columns: bool, dtype: torch.dtype, backend: str) -> None:
    offsets, lengths = shard(columns)
    outs = [torch.empty(lengths, dtype=dtype) for _ in range(TENSORS)]
    f = hf.SafetensorsFile(checkpoint)
    requests = [(f, f"layers.{i}.weight", offsets, lengths, outs[i]) for i in range(TENSORS)]
    run(benchmark, lambda: hf.read_many(requests, backend=backend), sum(o.numel() * 2 for o in outs))
    with safe_open(checkpoint, "pt") as ref:
        want = ref.get_slice("layers.3.weight")[: lengths[0], : lengths[1]]
    assert torch.equal(outs[3], want.to(dtype))


@pytest.mark.parametrize("columns", [False, True], ids=["rows", "cols"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_safetensors(benchmark: Any, checkpoint: str, columns: bool, dtype: torch.dtype) -> None:
    _, lengths = shard(columns)
    outs = [torch.empty(lengths, dtype=dtype) for _ in range(TENSORS)]

    def read() -> None:
        with safe_open(checkpoint, "pt") as f:
            for i, out in enumerate(outs):
                out.copy_(f.get_slice(f"layers.{i}.weight")[: lengths[0], : lengths[1]])

    run(benchmark, read, sum(o.numel() * 2 for o in outs))


def test_memcpy(benchmark: Any) -> None:
    nbytes = TENSORS * ROWS * COLS * 2 // RANKS
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    run(benchmark, lambda: dst.copy_(src), nbytes)
