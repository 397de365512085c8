"""One rank's rows (Shard(0)) and columns (Shard(1)) of a 512 MiB bf16 file: hp_fastload vs safetensors vs memcpy.

``python benches/slices.py`` prints GB/s of the needed bytes, best of 5 after a warm-up, all measured in the same
run: safetensors ``safe_open(...).get_slice(k)[...]`` + ``copy_`` into preallocated tensors, hp_fastload
``read_many`` with each backend, and a torch ``copy_`` of the same number of bytes (the memcpy anchor).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import hp_fastload as hf

PATH = os.environ.get("HP_FASTLOAD_SLICES_FILE", "bench-out/slices.safetensors")
KEYS = [f"w{i}" for i in range(8)]
RANK, WORLD = 3, 8
ROWS, COLS = 4096, 8192


def _box(kind: str) -> tuple[tuple[int, int], tuple[int, int]]:
    if kind == "cols":
        width = COLS // WORLD
        return (0, RANK * width), (ROWS, width)
    height = ROWS // WORLD
    return (RANK * height, 0), (height, COLS)


def run_hp(kind: str, backend: str) -> float:
    offsets, lengths = _box(kind)
    reqs = [(PATH, k, offsets, lengths, torch.empty(lengths, dtype=torch.bfloat16)) for k in KEYS]
    start = time.perf_counter()
    hf.read_many(reqs, backend=backend)
    return time.perf_counter() - start


def run_safetensors(kind: str) -> float:
    (r0, c0), (h, w) = _box(kind)
    outs = [torch.empty((h, w), dtype=torch.bfloat16) for _ in KEYS]
    start = time.perf_counter()
    with safe_open(PATH, "pt") as f:
        for key, out in zip(KEYS, outs, strict=True):
            out.copy_(f.get_slice(key)[r0 : r0 + h, c0 : c0 + w])
    return time.perf_counter() - start


def main() -> int:
    if not os.path.exists(PATH):
        os.makedirs(os.path.dirname(PATH) or ".", exist_ok=True)
        save_file({k: torch.randn(ROWS, COLS).to(torch.bfloat16) for k in KEYS}, PATH)
    needed = len(KEYS) * ROWS * COLS * 2 // WORLD
    src = torch.empty(needed // 2, dtype=torch.bfloat16)
    dst = torch.empty_like(src)

    def memcpy() -> float:
        start = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - start

    for kind in ("rows", "cols"):
        cases: list[tuple[str, Callable[[], float]]] = [
            ("safetensors", lambda kind=kind: run_safetensors(kind)),
            ("hp mmap", lambda kind=kind: run_hp(kind, "mmap")),
            ("hp pread", lambda kind=kind: run_hp(kind, "pread")),
            ("hp auto", lambda kind=kind: run_hp(kind, "auto")),
            ("memcpy", memcpy),
        ]
        results = {}
        for name, fn in cases:
            fn()
            results[name] = min(fn() for _ in range(5))
        print(kind, "  ".join(f"{name} {needed / t / 1e9:.2f} GB/s" for name, t in results.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
