"""What key templates would save in ``build_groups`` (a measurement; the planner does not use templates).

A template is a checkpoint key with each all-digit dotted part (layer and expert numbers) replaced by a marker;
renaming and grouping once per template, then expanding to the keys, is the idea measured here. This script holds
an unguarded prototype of that path (``template_build_groups``: it assumes every rule treats numbers alike, which
holds for the two layouts here, and checks nothing else) and times it against ``hp_fastload.groups.build_groups``
in the same process, interleaved, on the key lists of ``compare.py``'s MoE and DeepSeek-V3 layouts (no files):

- ``current``: ``build_groups`` as shipped;
- ``template``: the prototype, computing the templates itself (two regex passes over the joined keys);
- ``tmpl-free``: the prototype handed precomputed templates: what it would cost if the header parser, which
  already scans every key's digit runs for the natural order, returned them.

The script fails (exit 1) unless the prototype's groups and unexpected keys equal ``build_groups``'. With
``--checkpoint DIR`` it also times the whole ``hp_fastload.plan`` for a fake-world expert-parallel rank with each
implementation patched in (``--world``, ``--rank``; ``--plan-only`` skips the key-list timings). CPU times
(``time.process_time``); the key-list timings pause the GC, as the planner does.

    python benches/template_grouping.py [--quick] [--reps 7]
    python benches/template_grouping.py --checkpoint bench-data/moe-12x576 --world 8 --rank 3
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import importlib
import re
import statistics
import sys
import time
from collections.abc import Callable, Collection, Sequence
from itertools import accumulate, repeat
from operator import contains
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compare

groups_mod = importlib.import_module("hp_fastload.groups")
plan_mod = importlib.import_module("hp_fastload.plan.orchestrate")  # where plan_load calls build_groups

_NUMBER = re.compile(r"\.\d+(?=[.\n])")  # an all-digit dotted part, in keys joined as "\n.key1\n.key2\n"
_NUMBER_TEXT = re.compile(r"\.(\d+)(?=[.\n])")
_MARK = "\x00"
_PLACES = [chr(0x660 + i) for i in range(10)]  # distinct Unicode digits: \d and \w match them, literals do not


def templates_of(keys: Sequence[str]) -> tuple[list[str], list[str]]:
    """Each key's template (numbers -> one marker each; keys starting with a number are left whole) and all
    numbers in key order."""
    joined = "\n." + "\n.".join(keys) + "\n"
    return _NUMBER.sub("." + _MARK, joined)[2:-1].split("\n."), _NUMBER_TEXT.findall(joined)


def template_build_groups(
    keys: Sequence[str],
    targets: Collection[str],
    rules: Sequence[Any],
    *,
    base_model_prefix: str | None = None,
    map_key: Callable[[str], str | None] | None = None,
    pre: tuple[list[str], list[str]] | None = None,
) -> tuple[list[Any], list[str]]:
    """``build_groups`` through templates, without any exactness guard (a lower bound on the path's cost)."""
    assert map_key is None
    keys = list(keys)
    templates, numbers = pre if pre is not None else templates_of(keys)
    members: dict[str, list[int]] = {}
    for i, template in enumerate(templates):
        members.setdefault(template, []).append(i)
    counts = {t: t.count(_MARK) for t in members}
    offsets = [0, *accumulate(map(counts.__getitem__, templates))]
    renamings = [groups_mod._Prefiltered(r) for r in rules if groups_mod.is_renaming(r)]
    converters = [groups_mod._Prefiltered(r) for r in rules if groups_mod.is_converter(r)]
    renamed: list[Any] = [None] * len(keys)
    matched: list[Any] = [None] * len(keys)
    for template, indices in members.items():
        k = counts[template]
        probe = template
        for j in range(k):
            probe = probe.replace(_MARK, _PLACES[j], 1)
        name = probe
        for renaming in renamings:
            name, _ = renaming.rename(name)
        hit = None
        for converter in converters:
            candidate, pattern = converter.rename(name)
            if pattern is not None:
                name, hit = candidate, (converter.rule, pattern)
                break
        if name == probe:
            for i in indices:
                renamed[i] = keys[i]
            continue
        live = [j for j in range(k) if _PLACES[j] in name]
        fmt = name.replace("{", "{{").replace("}", "}}")
        for n, j in enumerate(live):
            fmt = fmt.replace(_PLACES[j], f"{{{n}}}")
        if len(live) == 1:
            seen: dict[str, str] = {}
            picked = [numbers[offsets[i] + live[0]] for i in indices]
            for i, number in zip(indices, picked, strict=True):
                full = seen.get(number)
                if full is None:
                    full = seen[number] = fmt.format(number)
                renamed[i], matched[i] = full, hit
        else:
            for i in indices:
                o = offsets[i]
                renamed[i], matched[i] = fmt.format(*[numbers[o + j] for j in live]), hit
    # From here on the same per-key grouping as build_groups.
    found: dict[str, Any] = {}
    unexpected: list[str] = []
    finals = groups_mod._normalized(renamed, base_model_prefix, targets)
    for key, target, hit, here in zip(keys, finals, matched, map(contains, repeat(targets), finals), strict=True):
        if not here:
            if key in targets:
                target, hit = groups_mod._prefix_normalize(key, base_model_prefix, targets), None
                here = target in targets
            if not here and (hit is None or len(hit[0].target_patterns) == 1):
                unexpected.append(key)
                continue
        rule, pattern = hit if hit is not None else (None, None)
        group = found.get(target)
        if group is None:
            group = found[target] = groups_mod.LoadGroup(target, rule)
        group.sources.append((pattern if pattern is not None else key, key))
    return list(found.values()), unexpected


def _summary(out: tuple[list[Any], list[str]]) -> tuple[Any, ...]:
    groups, unexpected = out
    return tuple((g.target, g.rule is None or type(g.rule).__name__, tuple(g.sources)) for g in groups), tuple(
        unexpected
    )


def _meta_model(config: dict[str, Any]) -> Any:
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
    from hp_fastload import rules as rules_mod
    from hp_fastload.natural import natural_sorted

    model = _meta_model(config)
    targets = dict.fromkeys(model.state_dict())
    rules = rules_mod.resolve_mapping(model, None)
    keys = natural_sorted(keys)
    prefix = getattr(model, "base_model_prefix", None) or None
    impls = {
        "current": groups_mod.build_groups,
        "template": template_build_groups,
        "tmpl-free": functools.partial(template_build_groups, pre=templates_of(keys)),
    }
    expected = _summary(groups_mod.build_groups(keys, targets, copy.deepcopy(rules), base_model_prefix=prefix))
    same = all(
        _summary(f(keys, targets, copy.deepcopy(rules), base_model_prefix=prefix)) == expected for f in impls.values()
    )
    times: dict[str, list[float]] = {n: [] for n in impls}
    for _ in range(reps):
        for n, f in impls.items():
            fresh = copy.deepcopy(rules)
            times[n].append(_cpu_ms(lambda f=f, fresh=fresh: f(keys, targets, fresh, base_model_prefix=prefix)))
    t_ms = _cpu_ms(lambda: templates_of(keys))
    print(f"{name}: {len(keys)} keys, {len(set(templates_of(keys)[0]))} templates, outputs identical: {same}")
    for n, ts in times.items():
        print(f"  {n:9s} build_groups CPU ms: median {statistics.median(ts):6.1f}  min {min(ts):6.1f}")
    print(f"  computing the templates alone: {t_ms:.1f} ms")
    return same


def bench_plan(checkpoint: str, world: int, rank: int, reps: int) -> None:
    """The whole ``hp_fastload.plan`` of a fake-world EP rank, each implementation patched into the planner."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import _peers
    import hp_fastload
    from hp_fastload import engine
    from hp_fastload.targets import virtual_rank

    mesh = _peers.fake_world(world, rank)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint), dtype=torch.bfloat16)
    for module_name, module in list(model.named_modules()):
        for pname, p in list(module.named_parameters(recurse=False)):
            expert = pname in ("gate_up_proj", "down_proj") and module_name.endswith("experts")
            shape = [p.shape[0] // world, *p.shape[1:]] if expert else list(p.shape)
            local = torch.empty(shape, dtype=p.dtype, device="meta")
            dt = _peers.as_dtensor(local, mesh, 0 if expert else None, tuple(p.shape))
            setattr(module, pname, torch.nn.Parameter(dt, requires_grad=False))
    original = plan_mod.build_groups
    from hp_fastload.index import CheckpointIndex

    handed_in = templates_of(list(CheckpointIndex.open(checkpoint)))  # the planner groups the index's key list
    impls = {
        "current": original,
        "template": template_build_groups,
        "tmpl-free": functools.partial(template_build_groups, pre=handed_in),
    }
    times: dict[str, list[float]] = {n: [] for n in impls}
    try:
        for _ in range(reps + 1):
            for n, f in impls.items():
                plan_mod.build_groups = f
                engine._cache.clear()
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
