"""Two-stage planning of a model whose modules were replaced (fused kernels, merged projections):
``Replacement`` (the replacement modules' rules and the pre-replacement shapes), ``replacement_of`` (the
same read from hyper-parallel's model attributes), the routes from stage-1 outputs into the scoped
replacement converters, and the planning of a completed stage-2 group (composed regions, else deferred).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hp_fastload.convert.groups import LoadGroup, rename_key
from hp_fastload.convert.rules import is_converter, is_renaming
from hp_fastload.convert.symbolic import RegionTensor, UnsupportedRegionOp
from hp_fastload.errors import ConversionError
from hp_fastload.model.targets import Target
from hp_fastload.planning.claims import Claims
from hp_fastload.planning.context import PendingGroup
from hp_fastload.planning.trace import Traced, group_compute, run_converter
from hp_fastload.source.natural import natural_sort_key


class SourceModelView:
    """The pre-replacement model as shape-aware ops see it: ``config``, ``base_model_prefix`` and
    ``get_parameter(name)`` (a meta tensor of the recorded checkpoint-layout shape)."""

    def __init__(self, model: Any, shapes: dict[str, Sequence[int]]) -> None:
        self.config = getattr(model, "config", None)
        self.base_model_prefix = getattr(model, "base_model_prefix", "")
        self.shapes = {k: tuple(int(d) for d in v) for k, v in shapes.items()}

    def get_parameter(self, name: str) -> torch.Tensor:
        shape = self.shapes.get(name)
        if shape is None:
            raise AttributeError(f"source model has no parameter '{name}'")
        return torch.empty(shape, device="meta")


@dataclass(frozen=True)
class Replacement:
    """The second planning stage of a model whose modules were replaced (fused kernels, merged projections).

    ``source_shapes`` are the pre-replacement model's tensor names and global shapes, taken before the
    replacement: stage 1 normalizes the checkpoint to them with the base rules. ``rules`` are the replacement
    modules' scoped converters (and renamings): stage 2 routes the normalized tensors into them, each converter
    firing once all its expected inputs arrived. Rules in ``rules`` that also appear (by identity) in the load's
    rule list are removed from stage 1. In the region loader the two stages compose into one set of region reads.
    """

    rules: Sequence[Any]
    source_shapes: Mapping[str, Sequence[int]]


def replacement_of(model: Any) -> Replacement | None:
    """The model's replacement stage from the attributes hyper-parallel's module replacement sets
    (``_hp_replacement_weight_conversions`` and ``_hp_checkpoint_source_shapes``), or None. ``load`` and
    ``plan`` use it when no ``replacement`` argument is given."""
    rules = list(getattr(model, "_hp_replacement_weight_conversions", None) or [])
    shapes = getattr(model, "_hp_checkpoint_source_shapes", None)
    if not rules or not shapes:
        return None
    return Replacement(rules, dict(shapes))


@dataclass
class ReplacementState:
    """A scoped replacement converter waiting for its stage-1 inputs."""

    target: str
    rule: Any | None  # None: a plain rename of one stage-1 output
    expected: dict[str, int] = field(default_factory=dict)
    received: dict[str, int] = field(default_factory=dict)
    inputs: list[tuple[str, str, LoadGroup, Traced]] = field(default_factory=list)  # pattern, name, stage 1
    completed: bool = False


def replacement_routes(
    shapes: Mapping[str, Sequence[int]], targets: dict[str, Target], replacement: Sequence[Any]
) -> dict[str, tuple[ReplacementState, str]]:
    renamings = [copy.deepcopy(r) for r in replacement if is_renaming(r)]
    converters = [r for r in replacement if is_converter(r)]
    probes = [copy.deepcopy(r) for r in converters]
    routes: dict[str, tuple[ReplacementState, str]] = {}
    states: dict[str, ReplacementState] = {}
    for name in sorted(shapes, key=natural_sort_key):
        renamed, probe, pattern = rename_key(name, renamings, probes, None, targets)
        if (probe is None and renamed == name) or renamed not in targets:
            continue
        rule = converters[probes.index(probe)] if probe is not None else None
        if rule is not None and getattr(rule, "scope_prefix", None) is None:
            raise ValueError(f"No unique replacement WeightConverter found for source '{name}' and target '{renamed}'")
        state = states.get(renamed)
        if state is None:
            state = states[renamed] = ReplacementState(renamed, rule)
        key = pattern if pattern is not None else name
        state.expected[key] = state.expected.get(key, 0) + 1
        routes[name] = (state, key)
    return routes


def plan_replacement_stage(
    state: ReplacementState, model: Any, view: SourceModelView, claims: Claims, trace: bool
) -> None:
    """Convert a complete replacement group: composed regions when every input traced, else deferred."""
    if state.rule is None:
        (_, name, group, traced) = state.inputs[0]
        blocks = traced.outputs[name]
        if blocks is not None:
            claims.region(state.target, traced.shapes[name], blocks, traced.sources)
            return
        pending = PendingGroup(
            state.target,
            group.keys,
            lambda srcs: {state.target: group_compute(group, view)(srcs)[name]},
            reason=traced.reason,
        )
        claims.defer(state.target, traced.shapes[name], pending)
        claims.add_deferred(pending)
        return
    traced_reason = next((t.reason for _, n, _, t in state.inputs if t.outputs.get(n) is None), "")
    reason = traced_reason
    regions = [t.region(n) for _, n, _, t in state.inputs] if trace else [None]
    if trace and all(r is not None for r in regions):
        inputs = ((name, pattern, region) for (pattern, name, _, _), region in zip(state.inputs, regions, strict=True))
        try:
            outputs = run_converter(copy.deepcopy(state.rule), state.target, inputs, model)
        except (UnsupportedRegionOp, TypeError, RuntimeError, ValueError, NotImplementedError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
        else:
            if all(isinstance(v, RegionTensor) for v in outputs.values()):
                for name, region in outputs.items():
                    claims.region(name, tuple(region.shape), region.blocks, None)
                return
            reason = "an op produced a real tensor"
    stage1 = {id(g): g for _, _, g, _ in state.inputs}
    keys = sorted({k for g in stage1.values() for k in g.keys}, key=natural_sort_key)

    rule: Any = state.rule

    def compute(sources: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        normalized: dict[str, torch.Tensor] = {}
        for group in stage1.values():
            normalized.update(group_compute(group, view)(sources))
        inputs = ((name, pattern, normalized[name]) for pattern, name, _, _ in state.inputs)
        return run_converter(copy.deepcopy(rule), state.target, inputs, model)

    try:
        meta = compute(
            {
                k: torch.empty(claims.index.locate(k).shape, dtype=claims.index.locate(k).dtype, device="meta")
                for k in keys
            }
        )
    except Exception as exc:
        raise ConversionError(
            f"Failed to convert checkpoint tensors for {state.target}: {type(exc).__name__}: {exc}"
        ) from exc
    pending = PendingGroup(state.target, keys, compute, reason=reason or traced_reason or "legacy loader")
    for name, value in meta.items():
        claims.defer(name, tuple(value.shape), pending)
    claims.add_deferred(pending)
