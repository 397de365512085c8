"""``plan_load``: one rank's plan from the checkpoint index, the rank's targets and a ``PlanRequest``: groups
the keys, traces each group, claims the outputs (with the replacement stage when there is one), adds the
dequantization fallbacks, runs the strict check and builds the ``LoadPlan`` and its ``LoadReport``.
``Groundwork``: what that is the same for every rank of one model. Callers come through ``planning.front``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from hp_fastload.convert.adapter import has_own_state_dict_hooks, hook_renamed
from hp_fastload.convert.detect import detect_in_index
from hp_fastload.convert.groups import LoadGroup, build_groups
from hp_fastload.convert.quant import Dequant
from hp_fastload.convert.quant_info import QuantInfo
from hp_fastload.errors import MissingKeysError, PlanError
from hp_fastload.model.targets import Target
from hp_fastload.planning.adapter import plan_adapter
from hp_fastload.planning.claims import Claims
from hp_fastload.planning.context import LoadContext, PendingGroup
from hp_fastload.planning.intersect import BlockCache
from hp_fastload.planning.items import DeferredGroup, LoadPlan, LoadReport, Reads
from hp_fastload.planning.replacement import (
    SourceModelView,
    plan_replacement_stage,
    replacement_of,
    replacement_routes,
)
from hp_fastload.planning.request import PlanRequest
from hp_fastload.planning.trace import Traced, Tracer
from hp_fastload.runtime import gc_paused
from hp_fastload.source.index import CheckpointIndex
from hp_fastload.source.natural import natural_sort_key

__all__ = ["Groundwork", "PlanStream", "groundwork_of", "plan_load", "plan_stream"]

log = logging.getLogger("hp_fastload")


def _missing_keys_error(missing: Sequence[str], unexpected: Sequence[str]) -> MissingKeysError:
    text = f"Checkpoint did not load {len(missing)} owned model tensors; first keys: {', '.join(missing[:10])}"
    if unexpected:
        text += (
            f". The checkpoint also holds {len(unexpected)} tensors this model does not own (first: "
            f"{', '.join(unexpected[:5])}): is it a checkpoint of another architecture, depth or size, or does it "
            "need a weights_mapping / key_mapping?"
        )
    return MissingKeysError(text, missing, unexpected)


@dataclass(eq=False)
class Groundwork:
    """What planning one model against one checkpoint does the same for every rank: the quantized tensors
    found, the load groups with their traces (global shapes only), the unexpected keys and the per-block caches.
    Ranks of one laid-out model differ only in their targets' regions: ``plan_load(..., groundwork=...)`` then
    claims and intersects, and nothing else (``groundwork_of`` makes it; ``hp_fastload.plan_each`` uses it).
    The fields below the first six are memos the first rank planned with it fills for the next ones.
    """

    quant: QuantInfo
    groups: list[LoadGroup]
    traced: list[Traced]
    unexpected: list[str]
    blocks: BlockCache
    trace: bool
    #: the quantized claims (``QuantInfo.claimed``) after the first rank planned with it: the same for every rank
    claimed: dict[str, tuple[str, Any]] | None = None
    #: (loaded names, unexpected keys, sorted loaded names) of the first rank: ranks claiming the same names
    #: have the same unexpected keys (claims and quantized companions do not depend on the region)
    outcome: tuple[set[str], list[str], tuple[str, ...]] | None = None
    #: the targets whose checkpoint layout the model's own hooks define (``convert.adapter.hook_renamed``:
    #: names, global shapes and dtypes only, so the same for every rank), after the first rank asked
    hooked: list[str] | None = None


def _replacement(model: Any, request: PlanRequest) -> Any:
    """The request's replacement stage, else the model's own; None unless it has rules and source shapes."""
    replacement = request.replacement if request.replacement is not None else replacement_of(model)
    if replacement is not None and replacement.rules and replacement.source_shapes:
        return replacement
    return None


def _keys(index: CheckpointIndex, request: PlanRequest) -> list[str]:
    claimed = request.claimed_source_keys
    return [k for k in index if k not in claimed] if claimed else index.keys()


@gc_paused()
def groundwork_of(
    model: Any, index: CheckpointIndex, targets: dict[str, Target], request: PlanRequest
) -> Groundwork | None:
    """The rank-independent part of :func:`plan_load` for ``targets`` (any rank's: names and global shapes are
    what it uses); None when the model has a replacement stage or the request an adapter (planned per rank
    from scratch)."""
    if request.adapter is not None or _replacement(model, request) is not None:
        return None
    prefix = getattr(model, "base_model_prefix", None) or None
    groups, unexpected = build_groups(_keys(index, request), targets, request.rules, base_model_prefix=prefix)
    tracer = Tracer(index, model, lambda n: targets[n].global_shape if n in targets else None, request.trace)
    traced = [tracer.run(group) for group in groups]
    return Groundwork(detect_in_index(index), groups, traced, list(unexpected), BlockCache(), request.trace)


def _hooked(model: Any, targets: dict[str, Target], shared: Groundwork | None) -> list[str]:
    if shared is not None and shared.hooked is not None:
        return shared.hooked
    hooked = (
        hook_renamed(model, {n: (tuple(t.global_shape), t.dtype) for n, t in targets.items()})
        if has_own_state_dict_hooks(model)
        else []
    )
    if shared is not None:
        shared.hooked = hooked
    return hooked


def _refuse_hooked(hooked: list[str], loaded: Collection[str]) -> None:
    """Rules writing straight into a tensor whose checkpoint layout the model's own hooks define would bypass
    them (a plain concatenation into torchtitan's per-KV-group fused ``wqkv`` loads wrong values silently)."""
    bad = [n for n in hooked if n in loaded]
    if bad:
        raise PlanError(
            f"{len(bad)} model tensors have their checkpoint layout defined by the model's own state_dict / "
            f"load_state_dict hooks (first: {', '.join(bad[:3])}), which a weights_mapping load bypasses: pass "
            "state_dict_adapter= (torchtitan's StateDictAdapter, e.g. Llama3StateDictAdapter(model_config, None)), "
            "which applies the hooks as torchtitan does"
        )


def plan_load(
    model: Any,
    index: CheckpointIndex,
    targets: dict[str, Target],
    request: PlanRequest,
    *,
    groundwork: Groundwork | None = None,
) -> tuple[LoadPlan, LoadContext]:
    """:func:`plan_stream`'s whole plan (every region intersected) and its context."""
    stream = plan_stream(model, index, targets, request, groundwork=groundwork)
    return stream.plan(), stream.context


def plan_stream(
    model: Any,
    index: CheckpointIndex,
    targets: dict[str, Target],
    request: PlanRequest,
    *,
    groundwork: Groundwork | None = None,
) -> PlanStream:
    """Plan one rank's load (``targets``: the rank's) as ``request`` asks: the plain ``LoadPlan`` and the
    ``LoadContext`` that executes it (a :class:`PlanStream`: the region intersections are made as its reads
    are asked for). Raises (before any byte is read) on strict misses and bad targets.

    ``request.trace=False`` plans every group as deferred (the legacy loader). The replacement stage is the
    request's, else the model's (``replacement_of``). The cyclic garbage collector is paused: planning a
    100k-tensor checkpoint allocates a few hundred thousand small objects, which would trigger several full
    collections of everything the process holds (a model, torch's modules) for nothing.

    ``groundwork`` (:func:`groundwork_of` of the same model, checkpoint and request; ``targets`` may be
    another rank's) skips the rank-independent work: groups, traces and quantization detection.

    ``request.adapter`` (a state-dict adapter, ``convert.adapter``) replaces the rules: the model tensors are
    what its ``from_hf`` and the model's load hooks trace to (``planning.adapter``); the tensors it does not map
    are not missing. ``request.ignore_missing`` (regexes searched in model names) names more tensors no
    checkpoint holds. Both kinds are listed in ``LoadReport.ignored_missing_keys``.
    """
    shared = groundwork
    trace, strict, adapter = request.trace, request.strict, request.adapter
    rules: Sequence[Any] = request.rules
    replacement = _replacement(model, request)
    keys = _keys(index, request)
    prefix = getattr(model, "base_model_prefix", None) or None
    quant = shared.quant.for_rank() if shared is not None else detect_in_index(index)
    claims = Claims(index, targets, quant)
    used_replacements: list[Any] = []
    ignored: list[str] = []
    if adapter is not None:
        decided = plan_adapter(model, index, targets, adapter, claims, keys)
        claims.unexpected.extend(decided.unexpected)
        ignored.extend(decided.unmapped)
        rules = []
    elif shared is not None:
        if shared.trace != trace:
            raise ValueError("plan_load: the groundwork was made with another trace setting")
        claims.blocks = shared.blocks
        claims.unexpected.extend(shared.unexpected)
        if shared.claimed is not None:
            quant.claimed.update(shared.claimed)
            claims.quant_checked = True
        for group, traced in zip(shared.groups, shared.traced, strict=True):
            claims.direct(group, traced, model)
        if shared.claimed is None:
            shared.claimed = dict(quant.claimed)
    elif replacement is not None:
        base_rules = [r for r in rules if not any(r is x for x in replacement.rules)]
        view = SourceModelView(model, dict(replacement.source_shapes))
        groups, unexpected = build_groups(keys, view.shapes, base_rules, base_model_prefix=prefix)
        claims.unexpected.extend(unexpected)
        routes = replacement_routes(view.shapes, targets, replacement.rules)
        tracer = Tracer(index, view, view.shapes.get, trace)
        for group in groups:
            traced = tracer.run(group)
            direct = []
            for name in traced.outputs:
                route = routes.get(name)
                if route is None:
                    direct.append(name)
                    continue
                state, pattern = route
                state.inputs.append((pattern, name, group, traced))
                state.received[pattern] = state.received.get(pattern, 0) + 1
                if not state.completed and state.received == state.expected:
                    state.completed = True
                    plan_replacement_stage(state, model, view, claims, trace)
                    if state.rule is not None and not any(state.rule is u for u in used_replacements):
                        used_replacements.append(state.rule)
            claims.direct(group, traced, view, direct)
        rules = base_rules
    else:
        groups, unexpected = build_groups(keys, targets, rules, base_model_prefix=prefix)
        claims.unexpected.extend(unexpected)
        tracer = Tracer(index, model, lambda n: targets[n].global_shape if n in targets else None, trace)
        for group in groups:
            claims.direct(group, tracer.run(group), model)
    if quant and trace:  # MXFP4 into float experts: region reads the engine dequantizes (quant.mxfp4_region)
        unloaded = set(targets) - claims.loaded
        for name, packed in quant.packed_regions(
            unloaded,
            claims.unexpected,
            lambda n: targets[n].dtype,
            lambda k: index.locate(k).shape,
            lambda k: index.locate(k).dtype,
        ):
            target = claims.claim(name, tuple(packed.shape))
            if target is not None:
                claims.queued.append((target, packed.blocks, None))
    if quant:  # the legacy loader: MXFP4 dequantized with torch on whole tensors, deferred groups of their own
        unloaded = set(targets) - claims.loaded
        fallbacks = quant.fallbacks(
            unloaded, claims.unexpected, lambda n: targets[n].dtype, lambda k: index.locate(k).shape
        )
        for name, keys, compute, shape in fallbacks:
            pending = PendingGroup(name, keys, compute, reason="MXFP4 dequantized with torch (whole tensors)")
            target = claims.claim(name, shape)
            if target is not None:
                pending.claims[name] = target
            claims.add_deferred(pending)
    if adapter is None:
        _refuse_hooked(_hooked(model, targets, shared), claims.loaded)
    if request.ignore_missing:
        patterns = [re.compile(p) for p in request.ignore_missing]
        ignored.extend(n for n in set(targets) - claims.loaded if any(p.search(n) for p in patterns))
    ignored_set = set(ignored) - claims.loaded
    missing = sorted(set(targets) - claims.loaded - ignored_set, key=natural_sort_key)
    if (
        shared is not None
        and shared.outcome is not None
        and shared.outcome[0] == claims.loaded
        and all(k in quant.claimed for k in quant.dequantized)
    ):
        # another rank of the same model: the same claims, so the same unexpected keys and loaded names
        _, unexpected, loaded_keys = shared.outcome
    else:
        unexpected_names = set(claims.unexpected)  # (sorted once, from a set)
        if quant:
            quant.check_missing(missing, claims.unexpected)
            unexpected_names.difference_update(quant.consumed())  # the scales of dequantized tensors: read with them
        unexpected = index.natural_sorted(unexpected_names)
        loaded_keys = tuple(sorted(claims.loaded, key=natural_sort_key))
        # consumed() includes the companions of this rank's dequantized keys: when all of them are claimed keys
        # (whose companions are counted already), the outcome holds for every rank whose dequantized keys are too
        if shared is not None and all(k in quant.claimed for k in quant.dequantized):
            shared.outcome = (set(claims.loaded), unexpected, loaded_keys)
    if strict and missing:
        raise _missing_keys_error(missing, unexpected)
    report = LoadReport(
        loaded_keys=loaded_keys,
        missing_keys=tuple(missing),
        unexpected_keys=tuple(unexpected),
        checkpoint_bytes=index.total_bytes,
        region_targets=claims.region_count,
        deferred_targets=tuple(n for d in claims.deferred for n in d.claims),
        loader=request.loader,
        ignored_missing_keys=tuple(sorted(ignored_set, key=natural_sort_key)),
    )
    used = [r for r in rules if getattr(r, "was_used", lambda: False)()]
    context = LoadContext(
        model,
        index,
        targets,
        [d.compute for d in claims.deferred],
        used + used_replacements,
        used_base_rules=used,
        used_replacement_rules=used_replacements,
    )
    log.debug(
        "planned %d model tensors as region reads and %d through %d deferred conversions",
        claims.region_count,
        sum(len(d.claims) for d in claims.deferred),
        len(claims.deferred),
    )
    return PlanStream(report, context, claims, quant)


@dataclass(eq=False)
class PlanStream:
    """A rank's plan whose key-level part is decided (every claim, name and shape checked, the strict check
    passed: ``report`` is final) and whose region reads are made as they are asked for (``regions``), so that
    reading the first targets can start while the rest are intersected (``execute.read.execute_stream``).
    ``plan()`` is the whole ``LoadPlan``, equal to ``plan_load``'s (the rest of the regions made first)."""

    report: LoadReport
    context: LoadContext
    claims: Claims
    quant: QuantInfo
    #: the region reads made so far, in claim order
    made: dict[str, Reads] = field(default_factory=dict)

    @property
    def deferred(self) -> list[DeferredGroup]:
        """The deferred groups (decided with the claims), as the plan lists them."""
        return [d.plain(self.context.index) for d in self.claims.deferred]

    @property
    def dequant(self) -> dict[str, Dequant]:
        """The dequantized keys' layouts (those of the deferred groups all there; the regions' as made)."""
        return self.quant.dequantized

    def target_names(self) -> Iterator[str]:
        """Every target the stream fills (``plan().target_names()``), known from the claims before any region
        is made: the region targets (made or queued), then the deferred groups' claimed ones."""
        yield from self.claims.region_reads
        for target, _, _ in self.claims.queued:
            yield target.names[0]
        for deferred in self.claims.deferred:
            for target in deferred.claims.values():
                yield target.names[0]

    def regions(self) -> Iterator[tuple[str, Reads]]:
        """Each region target's reads (its scales attached where its keys are dequantized), in claim order;
        a target whose reads fail to plan raises here, from the iteration."""
        specs = self.quant.dequantized  # built for the keys this rank reads (QuantInfo.read), not every claimed
        for target, reads in self.claims.intersected():
            if specs and any(k in specs for k in reads.keys):  # a dequantized weight's scale: a second source
                reads = reads.with_second([specs.get(k) for k in reads.keys])
            name = target.names[0]
            self.made[name] = reads
            yield name, reads

    def plan(self) -> LoadPlan:
        """The whole plan: the regions not asked for yet are made now."""
        for _ in self.regions():
            pass
        claims, index, specs = self.claims, self.context.index, self.quant.dequantized
        region_reads = dict(self.made)
        read_keys = {k for reads in region_reads.values() for k in reads.keys}
        read_keys.update(k for d in claims.deferred for k in d.keys)
        dequant = {k: spec for k, spec in specs.items() if k in read_keys}
        scales = {s.scale for reads in region_reads.values() for s in reads.second or () if s is not None}
        read_keys.update(scales)
        return LoadPlan(
            region_reads,
            [d.plain(index) for d in claims.deferred],
            self.report,
            index.paths_of(read_keys),
            dequant,
            {s: index.locate(s).nbytes for s in sorted(scales)},
        )
