"""``transfer(src, dst)``: weights from a live model into another live model of any layout, through the checkpoint's
names, with no storage in between.

Owns the entry point every rank calls, the agreed steps around it (each rank's released layout of each side
compared before any byte moves; the planning of both sides against an index of the released layout; the
message plan; the rounds; the destination's finishing), and the report. The meeting point is the checkpoint:
the source side is planned as ``save`` plans it (which checkpoint elements each local source shard holds, through
the reverse of its conversions), the destination as ``load`` plans it (which elements each local destination
shard needs, through the forward ones); ``planning.transfer`` intersects them and ``execute.transfer`` moves the
bytes point to point.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from hp_fastload.api.request import plan_request
from hp_fastload.dist.agree import agree, exchanging, interrupts_between_steps, wait_work
from hp_fastload.dist.collectives import gather_objects
from hp_fastload.errors import PlanError, TargetError
from hp_fastload.execute.read import execute_stream
from hp_fastload.execute.transfer import Side, TransferStats, axis_base, run_transfer
from hp_fastload.model.finalize import recreate_buffers, retie
from hp_fastload.model.targets import Target
from hp_fastload.model.wrappers import unwrapped
from hp_fastload.planning import front
from hp_fastload.planning.context import LoadContext
from hp_fastload.planning.export import conversions, file_header, forward_rules, released_tensors
from hp_fastload.planning.items import LoadPlan
from hp_fastload.planning.transfer import LayoutFacts, Runs, TransferPlan, check_layouts, plan_transfer, runs_of_plan
from hp_fastload.runtime import dist_active, gc_paused, interrupts_deferred
from hp_fastload.source.index import CheckpointIndex

__all__ = ["DEFAULT_BUDGET_BYTES", "DIRECT_BYTES", "TransferReport", "layout_facts", "layout_index", "transfer"]

#: Each rank's staged bytes per round (packed messages sent and received): the window of the plan.
DEFAULT_BUDGET_BYTES = 256 << 20
#: A piece of at least this many bytes (contiguous on both sides by construction) goes shard to shard, unstaged.
DIRECT_BYTES = 1 << 20

_CALL = "hp_fastload.transfer"


@dataclass(frozen=True)
class TransferReport:
    """What ``transfer`` did. This rank's counts (``bytes_sent`` / ``bytes_received``: payload to and from other
    ranks; ``bytes_copied``: from its own source shards into its own destination shards; ``bytes_needed``: what its
    destination shards hold), every rank's (``*_by_rank``), the messages, rounds and staging window, and the
    checkpoint tensors touched by a conversion without an exact region form (``deferred``, moved whole)."""

    tensors: int
    bytes_needed: int
    bytes_sent: int
    bytes_received: int
    bytes_copied: int
    messages_sent: int
    messages_received: int
    direct_messages: int
    rounds: int
    window_bytes: int
    peak_staging_bytes: int
    needed_by_rank: tuple[int, ...]
    sent_by_rank: tuple[int, ...]
    received_by_rank: tuple[int, ...]
    copied_by_rank: tuple[int, ...]
    deferred: tuple[str, ...] = ()
    seconds: float = 0.0
    seconds_planning: float = 0.0
    #: False when the plan of an earlier call with the same models (same tensors) and options was run again
    planned: bool = True
    unfilled_buffers: tuple[str, ...] = field(default=(), compare=False)

    @property
    def moved_over_needed(self) -> float:
        """Bytes that reached destination shards (received and copied, every rank) over the bytes the destination
        shards hold: 1.0 when each destination byte came once and nothing else moved."""
        needed = sum(self.needed_by_rank)
        return (sum(self.received_by_rank) + sum(self.copied_by_rank)) / needed if needed else 1.0

    def summary(self) -> str:
        return (
            f"transferred {self.tensors} tensors in {self.seconds:.3f} s (planning {self.seconds_planning:.3f} s): "
            f"this rank sent {self.bytes_sent / 1e6:.1f} MB in {self.messages_sent} messages, received "
            f"{self.bytes_received / 1e6:.1f} MB in {self.messages_received}, copied {self.bytes_copied / 1e6:.1f} MB "
            f"of its own; {self.rounds} rounds, window {self.window_bytes / 1e6:.1f} MB; moved / needed "
            f"{self.moved_over_needed:.2f}" + (f"; {len(self.deferred)} deferred" if self.deferred else "")
        )


def layout_facts(model: nn.Module, weights_mapping: Iterable[Any] | None = None) -> LayoutFacts:
    """The released layout of ``model`` as plain data: ``(key, shape, dtype, bytes per element)`` per checkpoint
    tensor, in ``save``'s order (ties removed, conversions reverted by transformers; no data moves)."""
    released = released_tensors(model, weights_mapping)
    return tuple(
        (key, tuple(int(n) for n in meta.shape), str(meta.dtype).removeprefix("torch."), meta.element_size())
        for key, meta in released.items()
    )


def _layout_of(model: nn.Module, rules: list[Any] | None) -> LayoutFacts:
    """``layout_facts`` of ``model``, remembered on the model while its tensors (names, shapes, dtypes) and its
    rules (the same rule objects) stay the same: a sync every training step asks the same question each time,
    and transformers' reverse conversion is most of the naming's cost."""
    tensors = itertools.chain(
        model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)
    )
    signature = (
        None if rules is None else tuple(map(id, rules)),
        tuple((name, tuple(t.shape), t.dtype) for name, t in tensors),
    )
    cached = model.__dict__.get(_LAYOUT_MEMO)
    if cached is not None and cached[0] == signature:
        return cached[1]
    facts = layout_facts(model, rules)
    model.__dict__[_LAYOUT_MEMO] = (signature, facts)
    return facts


_LAYOUT_MEMO = "_hp_transfer_layout"


@contextlib.contextmanager
def layout_index(facts: LayoutFacts, data: dict[str, torch.Tensor] | None = None) -> Iterator[CheckpointIndex]:
    """An index of the released layout with no data: one safetensors header in a file whose data is a hole
    (nothing written, nothing read; the planner only reads headers). ``data``: tensors whose bytes are written
    at their places (the deferred path's whole tensors); the rest stays a hole. Removed on exit."""
    parent = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    root = Path(tempfile.mkdtemp(prefix="hp_transfer-", dir=parent))
    try:
        metas = [
            (key, torch.empty(shape, dtype=getattr(torch, dtype), device="meta")) for key, shape, dtype, _ in facts
        ]
        header, size, order = file_header(metas)
        with open(root / "model.safetensors", "wb") as f:
            f.write(header)
            f.truncate(len(header) + size)
            if data:
                nbytes = {key: meta.numel() * meta.element_size() for key, meta in metas}
                offset = len(header)
                for key in order:
                    if key in data:
                        f.seek(offset)
                        f.write(data[key].detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
                    offset += nbytes[key]
        index = CheckpointIndex.open(root)
        try:
            yield index
        finally:
            for file in index.files:
                file.header.release_map()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _planned(model: nn.Module, index: CheckpointIndex, weights_mapping: Any) -> tuple[LoadPlan, LoadContext]:
    """The one call into planning: ``model`` planned as a load of the released layout ``index`` (its targets'
    regions in the checkpoint's coordinates, through the model's forward conversions; not strict: the transfer
    checks both sides' coverage itself)."""
    return front.plan(model, index, plan_request(model, weights_mapping=weights_mapping, strict=False))


@dataclass
class _PlannedSide:
    runs: Runs
    shards: list[torch.Tensor]
    inexact: list[str]
    used_rules: Any
    #: each target's checkpoint keys (its region reads' and its deferred groups')
    target_keys: dict[str, set[str]]
    targets: dict[str, Target]

    @property
    def inexact_keys(self) -> set[str]:
        return {key for name in self.inexact for key in self.target_keys.get(name, ())}


def _plan_side(model: nn.Module, role: str, index: CheckpointIndex, facts: LayoutFacts, mapping: Any) -> _PlannedSide:
    plan, context = _planned(model, index, mapping)
    report = plan.report
    if role == "source" and report.unexpected_keys:
        raise TargetError(
            f"hf.transfer: {len(report.unexpected_keys)} checkpoint tensors are held by no source tensor (first: "
            f"{', '.join(report.unexpected_keys[:3])}); the source's forward rules do not invert its reverse conversion"
        )
    if report.missing_keys:
        raise TargetError(
            f"hf.transfer: {len(report.missing_keys)} {role} tensors have no place in the checkpoint layout (first: "
            f"{', '.join(report.missing_keys[:3])})"
        )
    key_id = {f[0]: i for i, f in enumerate(facts)}
    shapes = {name: tuple(context.target(name).local().shape) for name in plan.region_reads}
    runs, inexact = runs_of_plan(plan, key_id, shapes)
    shards = [context.target(name).local() for name in runs.names]
    target_keys: dict[str, set[str]] = {name: set(reads.keys) for name, reads in plan.region_reads.items()}
    for group in plan.deferred:
        for name in group.claims.values():
            target_keys.setdefault(name, set()).update(group.keys)
    targets = {name: context.target(name) for name in target_keys}
    return _PlannedSide(runs, shards, inexact, context.used_rules, target_keys, targets)


def _device_of(*sides: _PlannedSide | None) -> torch.device:
    devices = {s.device for side in sides if side is not None for s in side.shards}
    if len({d.type for d in devices}) > 1:
        raise TargetError(
            f"hf.transfer: this rank's shards are on several kinds of device ({sorted(map(str, devices))})"
        )
    return next(iter(devices), torch.device("cpu"))


@interrupts_between_steps()
@gc_paused()
def transfer(
    src: nn.Module | None,
    dst: nn.Module | None,
    *,
    src_weights_mapping: Iterable[Any] | None = None,
    dst_weights_mapping: Iterable[Any] | None = None,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
    direct_bytes: int = DIRECT_BYTES,
    finalize: bool = True,
    timeout_s: float | None = None,
) -> TransferReport:
    """Fill ``dst`` (this rank's piece of the destination model, or None) from ``src`` (this rank's piece of a live
    source model, or None), through the checkpoint's names. Every rank of the default process group calls it
    together; the two models may be of different classes and layouts (FSDP2, TP, EP, 2-D meshes; on the same
    ranks or on disjoint ones) as long as they save to the same checkpoint layout (names, shapes, dtypes).

    The result is what ``save(src)`` then ``load(dst, that)`` gives, bit for bit, without storage: each destination
    byte is sent once, from one rank holding it (replicas take turns; a rank holding a byte it needs copies it
    itself), straight from the source shard into the destination shard where the piece is large
    (``direct_bytes``), else packed per sender, receiver and round, each rank's packed messages within
    ``budget_bytes`` per round. Host tensors travel over the group's backend as they are (gloo); device tensors in
    ``batch_isend_irecv`` batches (NCCL), with no host copy.

    A checkpoint tensor touched by a conversion without an exact region form (an elementwise op) goes whole:
    gathered on the source ranks and reverted by transformers as ``save`` falls back, then loaded into the
    destination by ``load``'s own plan (``TransferReport.deferred`` lists them).

    Layouts that disagree raise ``TargetError`` (naming the tensor and the dimension or dtype) on every rank
    before any byte moves; a failure or an interrupt on any rank raises on every rank (``PeerInterrupted`` on
    the others for an interrupt). ``src_weights_mapping`` / ``dst_weights_mapping``: the sides' conversion rules
    as ``save`` / ``load`` take them (default: what each model was loaded with, else its transformers mapping).
    ``finalize``: the destination's tied weights tied again first, its non-persistent buffers recomputed after
    (as ``load`` does). Returns a :class:`TransferReport`.
    """
    for name, model in (("src", src), ("dst", dst)):
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"transfer: {name} must be an nn.Module or None, got {type(model).__name__}")
    if budget_bytes < 1 or direct_bytes < 1:
        raise ValueError(f"transfer: budget_bytes and direct_bytes must be positive ({budget_bytes}, {direct_bytes})")
    start = time.perf_counter()
    src = unwrapped(src) if src is not None else None
    dst = unwrapped(dst) if dst is not None else None
    rank = torch.distributed.get_rank() if dist_active() else 0

    def agreed(stage: str, fn: Callable[[], Any]) -> Any:
        return agree(stage, fn, _CALL)

    src_rules = forward_rules(src, src_weights_mapping) if src is not None else None
    dst_rules = forward_rules(dst, dst_weights_mapping) if dst is not None else None
    options = (budget_bytes, direct_bytes, _rules_id(src_rules), _rules_id(dst_rules))

    def name_tensors() -> tuple[str | None, LayoutFacts | None, LayoutFacts | None]:
        if finalize and dst is not None:
            retie(dst)
        reusable = _reusable(src, dst, options)
        return (
            reusable.token if reusable is not None else None,
            _layout_of(src, src_rules) if src is not None else None,
            _layout_of(dst, dst_rules) if dst is not None else None,
        )

    every = gather_objects(agreed("Naming the checkpoint tensors of both models", name_tensors))
    tokens = {e[0] for e in every}
    prepared = _reusable(src, dst, options) if len(tokens) == 1 and None not in tokens else None
    if prepared is None:  # some rank's models or options changed since the last call: plan again, every rank
        prepared = _prepare(src, dst, every, src_rules, dst_rules, options, agreed)
    plan = prepared.plan
    planned_at = time.perf_counter()
    stats: TransferStats = run_transfer(
        plan,
        rank,
        prepared.base,
        prepared.sides[0],
        prepared.sides[1],
        device=prepared.device,
        agree=agreed,
        wait=wait_work,
        exchange=exchanging,
        timeout_s=timeout_s,
    )
    if prepared.deferred:
        _run_deferred(prepared, src, dst, src_rules, dst_rules, rank, agreed)
    facts = prepared.facts
    unfilled: list[str] = []
    if dst is not None:
        _record_rules(dst, prepared.used_rules)
    if finalize:
        unfilled = agreed(
            "Recomputing the destination's buffers", lambda: recreate_buffers(dst) if dst is not None else []
        )
    seconds = time.perf_counter() - start
    return TransferReport(
        tensors=len(facts),
        bytes_needed=int(plan.needed_by_rank[rank]),
        bytes_sent=stats.bytes_sent,
        bytes_received=stats.bytes_received,
        bytes_copied=stats.bytes_copied,
        messages_sent=stats.messages_sent,
        messages_received=stats.messages_received,
        direct_messages=stats.direct_sent + stats.direct_received,
        rounds=plan.rounds,
        window_bytes=plan.window_bytes,
        peak_staging_bytes=stats.peak_staging_bytes,
        needed_by_rank=_ints(plan.needed_by_rank),
        sent_by_rank=_ints(plan.sent_by_rank()),
        received_by_rank=_ints(plan.received_by_rank()),
        copied_by_rank=_ints(plan.copied_by_rank()),
        seconds=seconds,
        seconds_planning=planned_at - start,
        planned=prepared.fresh,
        deferred=prepared.deferred,
        unfilled_buffers=tuple(unfilled),
    )


@dataclass(eq=False)
class _Prepared:
    """A transfer planned on this rank, kept on its models for the next call with the same models and options:
    ``token`` (the same on every rank: a digest of the whole plan), the signatures of this rank's models (their
    tensors' identities, storages, shapes and dtypes), the plan and this rank's sides."""

    token: str
    signatures: tuple[Any, Any]
    options: tuple[Any, ...]
    facts: LayoutFacts
    plan: TransferPlan
    sides: list[Side | None]
    base: np.ndarray
    device: torch.device
    used_rules: Any
    #: checkpoint keys moved whole (a conversion of some target touching them has no exact region form)
    deferred: tuple[str, ...] = ()
    #: this rank's source targets touching them (gathered whole, reverted by transformers on the first source rank)
    deferred_sources: list[Target] = field(default_factory=list)
    #: this rank's destination targets touching them (loaded from the whole tensors by ``load``'s own plan)
    deferred_destinations: frozenset[str] = frozenset()
    first_source: int = 0
    fresh: bool = True


_PREPARED_MEMO = "_hp_transfer_prepared"
#: the last plan of this process as a rank holding neither model (kept here: it has no model to keep it on)
_bystander: list[_Prepared | None] = [None]


def _rules_id(rules: list[Any] | None) -> tuple[int, ...] | None:
    return None if rules is None else tuple(map(id, rules))


def _signature(model: nn.Module | None) -> Any:
    """What a prepared transfer depends on in ``model``: each tensor's name, object, storage, shape and dtype."""
    if model is None:
        return None
    out = []
    for name, t in itertools.chain(
        model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)
    ):
        local = t.to_local() if hasattr(t, "to_local") else t
        out.append((name, id(t), local.data_ptr(), tuple(local.shape), t.dtype))
    return tuple(out)


def _reusable(src: nn.Module | None, dst: nn.Module | None, options: tuple[Any, ...]) -> _Prepared | None:
    """The transfer this rank prepared for the same models and options, if nothing they depend on changed."""
    entries = [m.__dict__.get(_PREPARED_MEMO) for m in (src, dst) if m is not None]
    if not entries:  # a rank of the group with neither model: what it planned last time (no shards of its own)
        entries = [_bystander[0]]
    if entries[0] is None or any(e is not entries[0] for e in entries):
        return None
    prepared: _Prepared = entries[0]
    if prepared.options != options or prepared.signatures != (_signature(src), _signature(dst)):
        return None
    if (prepared.sides[0] is None) != (src is None) or (prepared.sides[1] is None) != (dst is None):
        return None
    prepared.fresh = False
    return prepared


def _prepare(
    src: nn.Module | None,
    dst: nn.Module | None,
    every: list[Any],
    src_rules: list[Any] | None,
    dst_rules: list[Any] | None,
    options: tuple[Any, ...],
    agreed: Callable[[str, Callable[[], Any]], Any],
) -> _Prepared:
    """Plans the transfer on every rank (each rank's sides, then the message plan from every rank's runs) and
    keeps it on this rank's models."""
    budget_bytes, direct_bytes = options[0], options[1]
    # the same gathered lists on every rank: every rank raises here, or none (no agreement needed)
    facts = check_layouts([e[1] for e in every], [e[2] for e in every])
    nbytes = np.array([int(np.prod(shape, dtype=np.int64)) * size for _, shape, _, size in facts], dtype=np.int64)
    itemsize = np.array([size for *_, size in facts], dtype=np.int64)

    def plan_sides() -> tuple[_PlannedSide | None, _PlannedSide | None, torch.device]:
        with layout_index(facts) as index:
            source = _plan_side(src, "source", index, facts, src_rules) if src is not None else None
            destination = _plan_side(dst, "destination", index, facts, dst_rules) if dst is not None else None
        return source, destination, _device_of(source, destination)

    src_side, dst_side, device = agreed("Planning both sides of the transfer", plan_sides)
    spans = gather_objects(
        (
            src_side.runs.spans if src_side is not None else None,
            dst_side.runs.spans if dst_side is not None else None,
            sorted(set().union(*(side.inexact_keys for side in (src_side, dst_side) if side is not None))),
        )
    )
    # the same gathered lists on every rank from here on: every rank decides alike, or raises alike
    key_id = {f[0]: i for i, f in enumerate(facts)}
    deferred = sorted({key for _, _, keys in spans for key in keys})
    holders = [rank for rank, (held, _, _) in enumerate(spans) if held is not None]
    deferred_ids = np.array([key_id[k] for k in deferred], dtype=np.int64)
    if len(deferred_ids):  # those tensors go whole (the deferred path), on every side, for every rank
        spans = [(_without(a, deferred_ids), _without(b, deferred_ids), c) for a, b, c in spans]
        src_side, dst_side = (_side_without(side, deferred_ids) for side in (src_side, dst_side))
    plan = plan_transfer(
        nbytes,
        itemsize,
        [s[0] for s in spans],
        [s[1] for s in spans],
        budget_bytes=budget_bytes,
        direct_bytes=direct_bytes,
        keys=[f[0] for f in facts],
    )
    base = axis_base(nbytes)
    sides = [
        Side(side.runs, side.shards, base, itemsize) if side is not None else None for side in (src_side, dst_side)
    ]
    digest = hashlib.blake2b(
        repr((facts, options[:2], plan.rounds, plan.window_bytes, deferred)).encode(), digest_size=16
    )
    for column in (plan.src, plan.dst, plan.key, plan.start, plan.length, plan.msg, plan.offset):
        digest.update(column.tobytes())
    prepared = _Prepared(
        token=digest.hexdigest(),
        signatures=(_signature(src), _signature(dst)),
        options=options,
        facts=facts,
        plan=plan,
        sides=sides,
        base=base,
        device=device,
        used_rules=dst_side.used_rules if dst_side is not None else None,
        deferred=tuple(deferred),
        deferred_sources=_touching(src_side, deferred),
        deferred_destinations=frozenset(t.name for t in _touching(dst_side, deferred)),
        first_source=holders[0] if holders else 0,
    )
    for model in (src, dst):
        if model is not None:
            model.__dict__[_PREPARED_MEMO] = prepared
    if src is None and dst is None:
        _bystander[0] = prepared
    return prepared


def _without(spans: Any, keys: np.ndarray) -> Any:
    """``spans`` without the rows of checkpoint tensors ``keys``."""
    if spans is None:
        return None
    keep = ~np.isin(spans[0], keys)
    return tuple(column[keep] for column in spans)


def _side_without(side: _PlannedSide | None, keys: np.ndarray) -> _PlannedSide | None:
    if side is None:
        return None
    runs = side.runs
    keep = ~np.isin(runs.key, keys)
    trimmed = Runs(runs.key[keep], runs.start[keep], runs.length[keep], runs.target[keep], runs.local[keep], runs.names)
    return dataclasses.replace(side, runs=trimmed)


def _touching(side: _PlannedSide | None, keys: Sequence[str]) -> list[Target]:
    """The side's targets whose checkpoint keys meet ``keys``, by name (the same order on every rank)."""
    if side is None or not keys:
        return []
    wanted = set(keys)
    return [side.targets[name] for name in sorted(side.target_keys) if side.target_keys[name] & wanted]


def _run_deferred(
    prepared: _Prepared,
    src: nn.Module | None,
    dst: nn.Module | None,
    src_rules: list[Any] | None,
    dst_rules: list[Any] | None,
    rank: int,
    agreed: Callable[[str, Callable[[], Any]], Any],
) -> None:
    """The deferred path: the source targets touching the deferred keys gathered whole on the source ranks and
    reverted into those checkpoint tensors by transformers on the first source rank (as ``save`` falls back),
    sent to every rank, and the destination targets touching them loaded from them by ``load``'s own plan and
    engine (their bytes alone written into the layout's file, in memory under ``/dev/shm``)."""
    from transformers.core_model_loading import revert_weight_conversion

    keys = list(prepared.deferred)

    def convert() -> dict[str, torch.Tensor] | None:
        with torch.no_grad():  # every collective first (the targets' meshes), then the local work that may fail
            full = [t.tensor.full_tensor() if t.is_dtensor else t.tensor.detach() for t in prepared.deferred_sources]  # type: ignore[attr-defined]
        if rank != prepared.first_source:
            return None
        assert src is not None
        state = {alias: f.cpu() for t, f in zip(prepared.deferred_sources, full, strict=True) for alias in t.names}
        with conversions(src, src_rules):
            reverted = revert_weight_conversion(cast(Any, src), state)
        missing = [key for key in keys if key not in reverted]
        if missing:
            raise PlanError(f"hf.transfer: the source's reverse conversion did not give {missing[:5]}")
        return {key: reverted[key].contiguous() for key in keys}

    whole = agreed("Converting the deferred tensors on the source", convert)
    box = [whole]
    with interrupts_deferred():
        torch.distributed.broadcast_object_list(box, src=prepared.first_source)
    tensors: dict[str, torch.Tensor] = box[0]

    def load_them() -> None:
        if dst is None or not prepared.deferred_destinations:
            return
        names = prepared.deferred_destinations
        with layout_index(prepared.facts, tensors) as index:
            plan, context = _planned(dst, index, dst_rules)
            reads = [(name, r) for name, r in plan.region_reads.items() if name in names]
            groups = [g for g in plan.deferred if set(g.claims.values()) & names]
            execute_stream(reads, groups, context, dequant=plan.dequant)

    agreed("Loading the deferred tensors into the destination", load_them)


def _ints(values: Sequence[int] | np.ndarray) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


def _record_rules(model: nn.Module, rules: Any) -> None:
    """``model._weight_conversions`` as ``load`` records it (a later ``save`` of the destination reverts them)."""
    with contextlib.suppress(AttributeError, TypeError):
        model._weight_conversions = rules
