"""What the two-rank benchmark scripts share (``accelerate_bench.py``, ``peft_bench.py``, ``save_bench.py``): the
model sizes, accelerate's FSDP2 on CPU, a digest of every rank's local shards, and the spawn of the ranks."""

from __future__ import annotations

import hashlib
import os
import socket
import time
from collections.abc import Callable
from typing import Any


def model_config(quick: bool) -> dict[str, Any]:
    """A Llama's sizes: tiny for the smoke runs, else 106M parameters (424 MB fp32, untied embedding and head)."""
    if quick:
        return dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    return dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=12)


def fsdp2_accelerator(rank: int, world: int) -> Any:
    """accelerate's ``Accelerator`` with its FSDP2 plugin, on CPU ranks (where it would fall back to DDP)."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    accelerator = Accelerator(fsdp_plugin=plugin, cpu=True)
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    assert accelerator.is_fsdp2
    return accelerator


def shard_digest(model: Any) -> str:
    """A digest of every parameter's name and local bytes (a DTensor's local shard): equal across two routes only
    when every rank holds the same shards."""
    import torch

    digest = hashlib.blake2b(digest_size=16)
    for name, p in sorted(model.named_parameters()):
        digest.update(name.encode())
        local = p.to_local() if hasattr(p, "to_local") else p
        digest.update(local.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def run_ranks(target: Callable[..., None], world: int, *args: Any, timeout: float = 900) -> list[dict[str, Any]]:
    """``target(rank, world, port, *args, queue)`` on ``world`` spawned processes, each putting ``(rank, result)``
    on the queue; the results by rank (``{"error": ...}`` for a rank that died or ran past ``timeout``)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=target, args=(r, world, port, *args, q)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    while len(results) < world and time.monotonic() < deadline:
        try:
            rank, value = q.get(timeout=1)
            results[rank] = value
        except Exception:  # nothing yet: stop early where a rank died (a rank that raised put its error first)
            if any(p.exitcode not in (None, 0) for p in procs) or (not any(p.is_alive() for p in procs) and q.empty()):
                break
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    return [results.get(r, {"error": "no result (died or timed out)"}) for r in range(world)]


def run_alternated(
    methods: list[str], repeats: int, run: Callable[[str], list[dict[str, Any]]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, dict[str, float]], bool]:
    """Each method ``repeats`` times, the order flipped every repeat (drift on a shared host hits both alike):
    ``(rows, the rows with a failed rank, per method the median slowest-rank seconds and peak RSS growth per rank,
    whether every rank's shards were bit-equal across every run)``."""
    import statistics
    import sys

    rows: list[dict[str, Any]] = []
    for repeat in range(repeats):
        for method in methods if repeat % 2 == 0 else methods[::-1]:
            ranks = run(method)
            rows.append({"method": method, "repeat": repeat, "ranks": ranks})
            print(f"{method} repeat {repeat}: {ranks}", file=sys.stderr, flush=True)
    errors = [r for r in rows for rank in r["ranks"] if "error" in rank]
    medians: dict[str, dict[str, float]] = {}
    for method in methods:
        mine = [r for r in rows if r["method"] == method and all("error" not in x for x in r["ranks"])]
        if mine:
            medians[method] = {
                "seconds_median": statistics.median(max(x["seconds"] for x in r["ranks"]) for r in mine),
                "rss_growth_median_per_rank": statistics.median(max(x["rss_growth"] for x in r["ranks"]) for r in mine),
            }
    digests = {tuple(x.get("digest") for x in r["ranks"]) for r in rows}
    return rows, errors, medians, not errors and len(digests) == 1
