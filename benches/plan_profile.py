"""Time (and optionally profile) ``hp_fastload.plan`` for one expert-parallel rank of a virtual world, as the
compare bench's planning row does: the model is built on meta from the checkpoint's config, stacked experts
sharded on dim 0 over ``WORLD`` ranks, everything else replicated (torch's fake process group).

Usage: ``python benches/plan_profile.py CHECKPOINT WORLD RANK [prof|phases]``: the wall seconds of 5 plans and
their median over plans 2-5; with ``prof``, a cProfile of one more plan, by cumulative time; with ``phases``, the
median wall seconds of each planning phase over 5 more plans (index open, targets, quantization detection,
``build_groups``, ``Tracer.run``, claims), each timed around the function the planner calls.
"""

from __future__ import annotations

import cProfile
import inspect
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _peers
import hp_fastload
from hp_fastload.model.regions import virtual_rank
from hp_fastload.source import files as engine


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
    if len(sys.argv) > 4 and sys.argv[4] == "phases":
        phases(model, checkpoint, rank)
    elif len(sys.argv) > 4:
        engine.clear_cache()
        profile = cProfile.Profile()
        profile.runcall(hp_fastload.plan, model, checkpoint, mesh_override=virtual_rank(rank))
        pstats.Stats(profile).sort_stats("cumtime").print_stats(35)


def phases(model: Any, checkpoint: str, rank: int) -> None:
    """Median seconds per phase: each planner function wrapped by a timer for the runs, then restored."""
    from hp_fastload.planning import claims, front, orchestrate, trace
    from hp_fastload.source import index

    spent: dict[str, float] = {}

    def timed(owner: Any, name: str, label: str, wrap: Callable[[Any], Any] = lambda f: f) -> None:
        original = owner.__dict__[name]
        inner = original.__func__ if isinstance(original, classmethod) else original

        def run(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - started

        def steps(*args: Any, **kwargs: Any) -> Any:  # a generator: the time of each step, not of its creation
            it = inner(*args, **kwargs)
            while True:
                started = time.perf_counter()
                try:
                    item = next(it)
                except StopIteration:
                    return
                finally:
                    spent[label] = spent.get(label, 0.0) + time.perf_counter() - started
                yield item

        setattr(owner, name, wrap(steps if inspect.isgeneratorfunction(inner) else run))
        restore.append((owner, name, original))

    restore: list[tuple[Any, str, Any]] = []
    timed(index.CheckpointIndex, "open", "index open", classmethod)
    timed(front, "build_targets", "targets")
    timed(orchestrate, "detect_in_index", "quantization detection")
    timed(orchestrate, "build_groups", "build_groups")
    timed(trace.Tracer, "run", "Tracer.run")
    timed(claims.Claims, "direct", "claims")
    timed(claims.Claims, "intersected", "claims")  # the regions of what direct claimed (made as a stream asks)
    runs: list[dict[str, float]] = []
    try:
        for _ in range(5):
            engine.clear_cache()
            spent.clear()
            started = time.perf_counter()
            hp_fastload.plan(model, checkpoint, mesh_override=virtual_rank(rank))
            runs.append(dict(spent, **{"whole plan": time.perf_counter() - started}))
    finally:
        for owner, name, original in restore:
            setattr(owner, name, original)
    for label in runs[0]:
        print(f"{label:24s} {statistics.median(r.get(label, 0.0) for r in runs):.4f}")


if __name__ == "__main__":
    main()
