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

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _peers
import hp_fastload
from hp_fastload import engine
from hp_fastload.targets import virtual_rank


def main() -> None:
    checkpoint, world, rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    model = _peers.expert_parallel_model(checkpoint, world, rank)
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
