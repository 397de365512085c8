"""What key templates save in ``build_groups``: the template path (``hp_fastload.convert.templates``) against
the per-key path (``build_groups(..., templates=False)``), timed in the same process, interleaved, on the key lists of
``compare.py``'s MoE and DeepSeek-V3 layouts (no files), and, with ``--checkpoint DIR``, the whole
``hp_fastload.plan`` of a fake-world expert-parallel rank through each path (``--world``, ``--rank``;
``--plan-only`` skips the key-list timings). CPU times (``time.process_time``); the key-list timings pause the
GC, as the planner does. The script fails (exit 1) unless both paths give the same groups and unexpected keys.

    python benches/template_grouping.py [--quick] [--reps 7]
    python benches/template_grouping.py --checkpoint <data>/moe-12x576 --world 8 --rank 3
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import importlib
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compare

groups_mod = importlib.import_module("hp_fastload.convert.groups")
plan_mod = importlib.import_module("hp_fastload.planning.orchestrate")  # where plan_load calls build_groups
PATHS: dict[str, Callable[..., Any]] = {
    "templates": groups_mod.build_groups,
    "per-key": functools.partial(groups_mod.build_groups, templates=False),
}


def _summary(out: tuple[list[Any], list[str]]) -> tuple[Any, ...]:
    groups, unexpected = out
    return tuple((g.target, g.rule is None or type(g.rule).__name__, tuple(g.sources)) for g in groups), tuple(
        unexpected
    )


def meta_model(config: dict[str, Any]) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "torch_dtype")}
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **fields))


def _cpu_ms(fn: Callable[[], Any]) -> float:
    gc.disable()
    try:
        start = time.process_time()
        fn()
        return (time.process_time() - start) * 1e3
    finally:
        gc.enable()


def bench_groups(name: str, config: dict[str, Any], keys: list[str], reps: int) -> bool:
    from hp_fastload import _core
    from hp_fastload import rules as rules_mod
    from hp_fastload.source.natural import natural_sorted

    model = meta_model(config)
    targets = dict.fromkeys(model.state_dict())
    rules = rules_mod.resolve_mapping(model, None)
    keys = natural_sorted(keys)
    prefix = getattr(model, "base_model_prefix", None) or None
    outs = [_summary(f(keys, targets, copy.deepcopy(rules), base_model_prefix=prefix)) for f in PATHS.values()]
    same = outs[0] == outs[1]
    times: dict[str, list[float]] = {n: [] for n in PATHS}
    for _ in range(reps):
        for n, f in PATHS.items():
            fresh = copy.deepcopy(rules)
            times[n].append(_cpu_ms(lambda f=f, fresh=fresh: f(keys, targets, fresh, base_model_prefix=prefix)))
    made = _core.key_templates(keys)
    t_ms = _cpu_ms(lambda: _core.key_templates(keys))
    print(f"{name}: {len(keys)} keys, {len(made[0]) if made else '-'} templates, outputs identical: {same}")
    for n, ts in times.items():
        print(f"  {n:9s} build_groups CPU ms: median {statistics.median(ts):6.1f}  min {min(ts):6.1f}")
    print(f"  computing the templates alone (rust/keys.rs): {t_ms:.1f} ms")
    return same


def bench_plan(checkpoint: str, world: int, rank: int, reps: int) -> None:
    """The whole ``hp_fastload.plan`` of a fake-world EP rank through each path."""
    import _peers
    import hp_fastload
    from hp_fastload.model.regions import virtual_rank
    from hp_fastload.source import files as engine

    model = _peers.expert_parallel_model(checkpoint, world, rank)
    original = plan_mod.build_groups
    times: dict[str, list[float]] = {n: [] for n in PATHS}
    try:
        for _ in range(reps + 1):
            for n, f in PATHS.items():
                plan_mod.build_groups = f
                engine.clear_cache()
                start = time.process_time()
                hp_fastload.plan(model, checkpoint, mesh_override=virtual_rank(rank))
                times[n].append(time.process_time() - start)
    finally:
        plan_mod.build_groups = original
    print(f"plan {checkpoint} world {world} rank {rank}:")
    for n, ts in times.items():
        print(f"  {n:9s} whole plan CPU s: median {statistics.median(ts[1:]):.3f}  min {min(ts[1:]):.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny layouts (a smoke run)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--checkpoint", help="also time the whole plan of this checkpoint")
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--rank", type=int, default=3)
    parser.add_argument("--plan-only", action="store_true", help="with --checkpoint: only the whole-plan timings")
    args = parser.parse_args()
    if args.checkpoint and args.plan_only:
        bench_plan(args.checkpoint, args.world, args.rank, args.reps)
        return 0
    moe = compare.moe_config(args.quick, None, None)
    deepseek = compare.deepseek_config(args.quick)
    ok = bench_groups("MoE", moe, [k for k, *_ in compare.moe_keys(moe)], args.reps)
    ok &= bench_groups("DeepSeek-V3", deepseek, [k for k, *_ in compare.deepseek_keys(deepseek)], args.reps)
    if args.checkpoint:
        bench_plan(args.checkpoint, args.world, args.rank, args.reps)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
