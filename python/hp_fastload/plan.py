"""Planning: checkpoint headers + rules + model layout -> this rank's read items. Never touches tensor bytes.

Owns: running each load group's conversion symbolically (``region.RegionTensor`` leaves through the real
rule objects), validating it against a meta-tensor run, claiming the outputs for model targets (tied
aliases, shapes, first claim wins), the ``LoadReport`` and the strict check, and intersecting every traced
block with the target's local region to produce exact ``ReadItem``s. Groups whose ops cannot be traced
(they read values or combine tensors elementwise) become ``DeferredGroup``s: read whole, converted with
torch, sliced locally. The legacy loader plans every group as deferred.

A plan is plain data: ``LoadPlan.summary()`` prints it, and ``hp_fastload.plan(...)`` answers what a
(possibly virtual) rank reads without reading anything.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import PlanError, TargetError
from .groups import LoadGroup, build_groups, masked_name
from .index import CheckpointIndex
from .region import Block, RegionTensor, UnsupportedRegionOp
from .rules import dot_natural_key
from .targets import Target

__all__ = ["ConversionError", "DeferredGroup", "LoadPlan", "LoadReport", "ReadItem", "plan_load"]

log = logging.getLogger("hp_fastload")


class ConversionError(PlanError, RuntimeError):
    """A conversion op failed on the checkpoint's shapes (a rule that does not fit the checkpoint)."""


@dataclass(frozen=True)
class LoadReport:
    """What a load did: every name is a model FQN (tied aliases included) or a checkpoint key.

    ``loaded_keys``, ``missing_keys`` and ``unexpected_keys`` are natural-sorted tuples and are the only
    fields compared by ``==`` (both loaders produce equal reports). The rest is measurement.
    """

    loaded_keys: tuple[str, ...]
    missing_keys: tuple[str, ...]
    unexpected_keys: tuple[str, ...]
    bytes_read: int = field(default=0, compare=False)
    bytes_needed: int = field(default=0, compare=False)
    checkpoint_bytes: int = field(default=0, compare=False)
    seconds: float = field(default=0.0, compare=False)
    region_targets: int = field(default=0, compare=False)
    deferred_targets: tuple[str, ...] = field(default=(), compare=False)
    loader: str = field(default="", compare=False)

    def summary(self) -> str:
        rate = self.bytes_read / self.seconds / 1e9 if self.seconds > 0 else 0.0
        return (
            f"{self.loader or 'hp_fastload'}: loaded {len(self.loaded_keys)} tensors, "
            f"missing {len(self.missing_keys)}, unexpected {len(self.unexpected_keys)}; "
            f"read {self.bytes_read / 1e6:.1f} MB of {self.checkpoint_bytes / 1e6:.1f} MB checkpoint "
            f"in {self.seconds:.3f} s ({rate:.2f} GB/s); {self.region_targets} region targets, "
            f"{len(self.deferred_targets)} deferred"
        )


@dataclass(frozen=True)
class ReadItem:
    """One strided box of one checkpoint tensor into one box of a target's local tensor.

    Source element ``i`` (a multi-index over ``lengths``) is ``storage_base + sum(i * storage_strides)`` in
    the flattened checkpoint tensor; it lands at ``dest_offsets + i`` in the target's local tensor.
    ``post`` are elementwise ops applied (in the source dtype, then the traced casts) before the copy.
    """

    source: str
    storage_base: int
    storage_strides: tuple[int, ...]
    lengths: tuple[int, ...]
    dest_offsets: tuple[int, ...]
    post: tuple[Any, ...] = ()

    @property
    def numel(self) -> int:
        n = 1
        for length in self.lengths:
            n *= length
        return n


@dataclass
class DeferredGroup:
    """A group read whole and converted with torch on this rank; ``claims`` maps output name -> target."""

    group: LoadGroup
    claims: dict[str, Target] = field(default_factory=dict)
    reason: str = ""


@dataclass
class LoadPlan:
    """This rank's plan: region reads per target, deferred groups, the report, the rules that fired."""

    index: CheckpointIndex
    targets: dict[str, Target]
    region_reads: dict[str, tuple[Target, list[ReadItem]]]
    deferred: list[DeferredGroup]
    report: LoadReport
    used_rules: list[Any]
    model: Any = None

    def read_bytes_by_file(self) -> dict[str, int]:
        """Bytes of source data this rank's region reads need, per checkpoint file."""
        out: dict[str, int] = {}
        for _, items in self.region_reads.values():
            for item in items:
                entry = self.index.entry(item.source)
                out[entry.file.path] = out.get(entry.file.path, 0) + item.numel * entry.dtype.itemsize
        for deferred in self.deferred:
            for key in deferred.group.keys:
                entry = self.index.entry(key)
                begin, end = entry.file.offsets(key)
                out[entry.file.path] = out.get(entry.file.path, 0) + end - begin
        return out

    def read_bytes_by_target(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for name, (_, items) in self.region_reads.items():
            out[name] = sum(i.numel * self.index.entry(i.source).dtype.itemsize for i in items)
        return out

    @property
    def bytes_needed(self) -> int:
        return sum(self.read_bytes_by_file().values())

    def summary(self) -> str:
        lines = [
            f"{len(self.region_reads)} targets as region reads, {len(self.deferred)} deferred groups; "
            f"{self.bytes_needed / 1e6:.2f} MB of {self.index.total_bytes / 1e6:.2f} MB"
        ]
        for path, nbytes in sorted(self.read_bytes_by_file().items()):
            lines.append(f"  {path}: {nbytes} bytes")
        for d in self.deferred:
            lines.append(f"  deferred {d.group.target}: {d.reason}")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# Symbolic conversion


def _convert(group: LoadGroup, model: Any, make_leaf: Callable[[str], Any]) -> dict[str, Any]:
    transform = group.fresh_transform()
    for pattern, key in group.sources:
        transform.add_tensor(group.target, key, pattern, make_leaf(key))
    outputs = transform.convert(group.target, model=model, config=getattr(model, "config", None))
    return {name: (value[0] if isinstance(value, list) else value) for name, value in outputs.items()}


@dataclass
class _Traced:
    outputs: dict[str, Any]  # name -> RegionTensor, or None where deferred
    shapes: dict[str, tuple[int, ...]]  # name -> global shape of the converted tensor
    reason: str = ""


class _Tracer:
    """Runs groups symbolically, caching traces of groups that differ only in layer numbers."""

    def __init__(self, index: CheckpointIndex, model: Any, trace: bool) -> None:
        self.index = index
        self.model = model
        self.trace = trace
        self.cache: dict[Any, tuple[list[str], list[RegionTensor] | None, str]] = {}

    def _meta(self, key: str) -> torch.Tensor:
        entry = self.index.entry(key)
        return torch.empty(entry.shape, dtype=entry.dtype, device="meta")

    def run(self, group: LoadGroup) -> _Traced:
        if group.rule is None:
            key = group.sources[0][1]
            entry = self.index.entry(key)
            leaf = RegionTensor.leaf(key, entry.shape, entry.dtype) if self.trace else None
            return _Traced({group.target: leaf}, {group.target: tuple(entry.shape)})
        try:
            meta = _convert(group, self.model, self._meta)
        except Exception as exc:
            raise ConversionError(
                f"Failed to convert checkpoint tensors for {group.target} "
                f"(keys {', '.join(group.keys[:4])}{', ...' if len(group.keys) > 4 else ''}): "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        names = list(meta)
        shapes = {n: tuple(v.shape) for n, v in meta.items()}
        if not self.trace:
            return _Traced(dict.fromkeys(names), shapes, "legacy loader")
        signature = (
            id(group.rule),
            tuple((p, self.index.entry(k).shape, self.index.entry(k).dtype) for p, k in group.sources),
            tuple((masked_name(n), tuple(v.shape), v.dtype) for n, v in meta.items()),
        )
        cached = self.cache.get(signature)
        if cached is None:
            placeholders = {k: f"#{i}" for i, (_, k) in enumerate(group.sources)}
            traced: dict[str, Any] | None
            reason = ""
            try:
                traced = _convert(
                    group,
                    self.model,
                    lambda k: RegionTensor.leaf(placeholders[k], self.index.entry(k).shape, self.index.entry(k).dtype),
                )
            except (UnsupportedRegionOp, TypeError, RuntimeError, ValueError, NotImplementedError) as exc:
                traced, reason = None, f"{type(exc).__name__}: {exc}"
            regions: list[RegionTensor] | None = None
            if traced is not None:
                if list(traced) != names:
                    reason = "traced outputs differ from the meta run"
                elif not all(isinstance(v, RegionTensor) for v in traced.values()):
                    reason = "an op produced a real tensor"
                elif any(tuple(v.shape) != tuple(meta[n].shape) or v.dtype != meta[n].dtype for n, v in traced.items()):
                    reason = "traced shapes or dtypes differ from the meta run"
                else:
                    regions = list(traced.values())
            cached = (names, regions, reason)
            self.cache[signature] = cached
        _, regions, reason = cached
        if regions is None:
            log.debug("deferring %s: %s", group.target, reason)
            return _Traced(dict.fromkeys(names), shapes, reason)
        mapping = {f"#{i}": k for i, (_, k) in enumerate(group.sources)}
        return _Traced({n: r.rename_sources(mapping) for n, r in zip(names, regions, strict=True)}, shapes)


# ---------------------------------------------------------------------------------------------------------
# Regions -> read items


def _row_major(shape: Sequence[int]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return tuple(strides)


def region_items(target: Target, region: RegionTensor, index: CheckpointIndex) -> list[ReadItem]:
    """Exact read items for the part of ``region`` (the converted global tensor) this rank holds."""
    items: list[ReadItem] = []
    boxes = list(target.region.boxes())
    if not boxes:
        return items
    blocks: Iterable[Block] = region.blocks
    src_strides_cache: dict[str, tuple[int, ...]] = {}
    for block in blocks:
        src_st = src_strides_cache.get(block.source)
        if src_st is None:
            src_st = src_strides_cache[block.source] = _row_major(index.entry(block.source).shape)
        ndim = len(block.offsets)
        strides = tuple(sum(block.coeff[s][d] * src_st[s] for s in range(len(src_st))) for d in range(ndim))
        base0 = sum(b * st for b, st in zip(block.base, src_st, strict=True))
        for goff, glen, loff in boxes:
            lo = []
            lengths = []
            empty = False
            for d in range(ndim):
                a = max(block.offsets[d], goff[d])
                b = min(block.offsets[d] + block.lengths[d], goff[d] + glen[d])
                if b <= a:
                    empty = True
                    break
                lo.append(a)
                lengths.append(b - a)
            if empty:
                continue
            rel = [lo[d] - block.offsets[d] for d in range(ndim)]
            base = base0 + sum(rel[d] * strides[d] for d in range(ndim))
            dest = tuple(loff[d] + lo[d] - goff[d] for d in range(ndim))
            items.append(ReadItem(block.source, base, strides, tuple(lengths), dest, tuple(block.post)))
    return items


# ---------------------------------------------------------------------------------------------------------
# The plan


def _check_claim(name: str, target: Target, shape: Sequence[int]) -> None:
    err = getattr(target, "error", None)
    if err:
        raise TargetError(err)
    if tuple(shape) != tuple(target.global_shape):
        raise TargetError(
            f"Shape mismatch for {name}: checkpoint {tuple(shape)} vs target {tuple(target.global_shape)}"
        )


def plan_load(
    model: Any,
    index: CheckpointIndex,
    targets: dict[str, Target],
    rules: Sequence[Any],
    *,
    strict: bool = True,
    trace: bool = True,
    claimed_source_keys: Collection[str] = frozenset(),
    map_key: Callable[[str], str | None] | None = None,
    loader: str = "dcp",
) -> LoadPlan:
    """Plan one rank's load. Raises (before any byte is read) on strict misses and bad targets."""
    keys = [k for k in index if k not in claimed_source_keys]
    groups, unexpected = build_groups(
        keys,
        targets,
        rules,
        base_model_prefix=getattr(model, "base_model_prefix", None) or None,
        map_key=map_key,
    )
    tracer = _Tracer(index, model, trace)
    claimed: set[int] = set()
    loaded: set[str] = set()
    region_reads: dict[str, tuple[Target, list[ReadItem]]] = {}
    deferred: list[DeferredGroup] = []
    for group in groups:
        traced = tracer.run(group)
        pending: DeferredGroup | None = None
        for name, region in traced.outputs.items():
            target = targets.get(name)
            if target is None:
                unexpected.append(name)
                continue
            if id(target) in claimed:
                loaded.update(target.names)
                continue
            _check_claim(name, target, traced.shapes[name])
            claimed.add(id(target))
            loaded.update(target.names)
            if region is not None:
                region_reads[target.names[0]] = (target, region_items(target, region, index))
            else:
                if pending is None:
                    pending = DeferredGroup(group, reason=traced.reason or "legacy loader")
                pending.claims[name] = target
        if pending is not None:
            deferred.append(pending)
    all_names = set(targets)
    missing = sorted(all_names - loaded, key=dot_natural_key)
    if strict and missing:
        shown = ", ".join(missing[:10])
        raise RuntimeError(f"Checkpoint did not load {len(missing)} owned model tensors; first keys: {shown}")
    report = LoadReport(
        loaded_keys=tuple(sorted(loaded, key=dot_natural_key)),
        missing_keys=tuple(missing),
        unexpected_keys=tuple(sorted(set(unexpected), key=dot_natural_key)),
        checkpoint_bytes=index.total_bytes,
        region_targets=len(region_reads),
        deferred_targets=tuple(n for d in deferred for n in d.claims),
        loader=loader,
    )
    used = [r for r in rules if getattr(r, "was_used", lambda: False)()]
    plan = LoadPlan(index, targets, region_reads, deferred, report, used, model)
    log.debug(
        "planned %d model tensors as region reads and %d through %d deferred conversions",
        len(region_reads),
        sum(len(d.claims) for d in deferred),
        len(deferred),
    )
    return plan
