"""Time (and optionally profile) ``hp_fastload.plan`` for one expert-parallel rank of a virtual world, as the
compare bench's planning row does: the model is built on meta from the checkpoint's config, stacked experts
sharded on dim 0 over ``WORLD`` ranks, everything else replicated (torch's fake process group).

Usage: ``python benches/plan_profile.py CHECKPOINT WORLD RANK [prof]``: the wall seconds of 5 plans and their
median over plans 2-5; with ``prof``, a cProfile of one more plan, by cumulative time.
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _peers
import hp_fastload
from hp_fastload import engine
from hp_fastload.targets import virtual_rank


def expert_parallel_model(checkpoint: str, world: int, rank: int) -> torch.nn.Module:
    """The checkpoint's model on meta, its stacked experts ``Shard(0)`` over ``world`` ranks (rank ``rank``)."""
    mesh = _peers.fake_world(world, rank)
    config = AutoConfig.from_pretrained(checkpoint)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    for name, module in list(model.named_modules()):
        for pname, p in list(module.named_parameters(recurse=False)):
            dim = 0 if pname in ("gate_up_proj", "down_proj") and name.endswith("experts") else None
            local_shape = list(p.shape)
            if dim is not None:
                local_shape[0] //= world
            local = torch.empty(local_shape, dtype=p.dtype, device="meta")
            dtensor = _peers.as_dtensor(local, mesh, dim, tuple(p.shape))
            setattr(module, pname, torch.nn.Parameter(dtensor, requires_grad=False))
    return model


def main() -> None:
    checkpoint, world, rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    model = expert_parallel_model(checkpoint, world, rank)
    times = []
    for _ in range(5):
        engine.clear_cache()
        started = time.perf_counter()
        hp_fastload.plan(model, checkpoint, mesh_override=virtual_rank(rank))
        times.append(time.perf_counter() - started)
    print("wall", [round(t, 3) for t in times], "median", round(statistics.median(times[1:]), 3))
    if len(sys.argv) > 4:
        engine.clear_cache()
        profile = cProfile.Profile()
        profile.runcall(hp_fastload.plan, model, checkpoint, mesh_override=virtual_rank(rank))
        pstats.Stats(profile).sort_stats("cumtime").print_stats(35)


if __name__ == "__main__":
    main()
