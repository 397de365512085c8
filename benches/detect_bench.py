"""Time quantization detection (``hp_fastload.convert.detect``), GC paused as planning does.

Usage:
  ``python benches/detect_bench.py CHECKPOINT [CALLS]``: ``detect_in_index`` on the checkpoint's index, CALLS
  times (default 21); prints the median and the best.
  ``python benches/detect_bench.py --fp8-keys LAYERS EXPERTS [CALLS]``: ``detect`` over a DeepSeek-V3 FP8-shaped
  key list (no file: per layer EXPERTS x 3 fp8 expert weights, each with its fp32 ``weight_scale_inv``, and one
  bf16 norm), under a ``quantization_config`` with ``quant_method: fp8``, so the config scan runs over the
  non-float keys too.

To compare two trees, run it with ``PYTHONPATH`` at each tree's ``python/`` (the same Rust extension).
"""

from __future__ import annotations

import gc
import inspect
import statistics
import sys
import time
from typing import Any

import torch

from hp_fastload.convert import detect as quant
from hp_fastload.source.index import CheckpointIndex


def _fp8_keys(layers: int, experts: int) -> tuple[list[str], dict[str, torch.dtype]]:
    keys: list[str] = []
    dtypes: dict[str, torch.dtype] = {}
    for layer in range(layers):
        for expert in range(experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                key = f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"
                keys += [key, key + "_scale_inv"]
                dtypes[key], dtypes[key + "_scale_inv"] = torch.float8_e4m3fn, torch.float32
        key = f"model.layers.{layer}.input_layernorm.weight"
        keys.append(key)
        dtypes[key] = torch.bfloat16
    return keys, dtypes


def _timed(call: Any, calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        result = call()
        times.append(time.perf_counter() - started)
        del result
    return times


def main() -> None:
    args = sys.argv[1:]
    gc.disable()
    if args[0] == "--fp8-keys":
        keys, dtypes = _fp8_keys(int(args[1]), int(args[2]))
        calls = int(args[3]) if len(args) > 3 else 21
        nonfloat = [k for k in keys if dtypes[k] not in (torch.float32, torch.bfloat16)]
        config = {"quant_method": "fp8", "weight_block_size": [128, 128]}
        extra: dict[str, Any] = {}
        if "present" in inspect.signature(quant.detect).parameters:  # (a tree without it builds its own set)
            extra["present"] = set(keys)

        def detect() -> Any:
            return quant.detect(keys, dtypes.__getitem__, config, None, nonfloat, **extra)

        times = _timed(detect, calls)
        label = f"detect, {len(keys)} keys ({len(detect().tensors)} quantized)"
    else:
        index = CheckpointIndex.open(args[0])
        calls = int(args[1]) if len(args) > 1 else 21
        times = _timed(lambda: quant.detect_in_index(index), calls)
        label = f"detect_in_index, {len(index)} keys ({len(quant.detect_in_index(index).tensors)} quantized)"
    print(f"{label}: median {statistics.median(times) * 1e3:.1f} ms, best {min(times) * 1e3:.1f} ms, {calls} calls")


if __name__ == "__main__":
    main()
