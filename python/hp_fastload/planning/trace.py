"""Running load groups symbolically: ``convert.symbolic.RegionTensor`` leaves through the real rule objects, the
trace cache (groups that differ only in layer or expert numbers share one trace, its sources named by
placeholder), the meta-tensor run that validates an untraceable group, and the torch compute of deferred
groups. Produces traced blocks; claiming and read items are elsewhere.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from hp_fastload.convert.groups import LoadGroup, masked_name
from hp_fastload.convert.symbolic import Block, RegionTensor, UnsupportedRegionOp
from hp_fastload.errors import ConversionError, shown_key
from hp_fastload.source.index import CheckpointIndex

log = logging.getLogger("hp_fastload")


def run_converter(transform: Any, target: str, inputs: Iterable[tuple[str, str, Any]], model: Any) -> dict[str, Any]:
    """One conversion, as transformers runs it: ``add_tensor`` each ``(source name, pattern, value)``, then
    ``convert``; single-element lists (a converter's per-output lists) unwrapped."""
    for name, pattern, value in inputs:
        transform.add_tensor(target, name, pattern, value)
    outputs = transform.convert(target, model=model, config=getattr(model, "config", None))
    return {name: (value[0] if isinstance(value, list) else value) for name, value in outputs.items()}


def convert_group(group: LoadGroup, model: Any, make_leaf: Callable[[str], Any]) -> dict[str, Any]:
    inputs = ((key, pattern, make_leaf(key)) for pattern, key in group.sources)
    return run_converter(group.fresh_transform(), group.target, inputs, model)


@dataclass
class Traced:
    """A group's outputs: name -> traced blocks (or None where deferred), shapes, dtypes, and the source map.

    Blocks name their sources by placeholder (``#i`` = the group's i-th source); ``sources`` maps them to
    this group's checkpoint keys, so one trace serves every layer with the same structure.
    """

    outputs: dict[str, tuple[Block, ...] | None]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    sources: dict[str, str]
    reason: str = ""

    def region(self, name: str) -> RegionTensor | None:
        """The output as a region over real checkpoint keys (to feed a second conversion stage)."""
        blocks = self.outputs[name]
        if blocks is None:
            return None
        renamed = [
            Block(b.offsets, b.lengths, self.sources[b.source], b.base, b.coeff, b.post, b.src_dtype, b.src_shape)
            for b in blocks
        ]
        return RegionTensor.from_blocks(self.shapes[name], self.dtypes[name], renamed)


@dataclass
class CacheEntry:
    target: str
    names: list[str]
    shapes: list[tuple[int, ...]]
    dtypes: list[torch.dtype]
    blocks: list[tuple[Block, ...]] | None
    reason: str


def _derive_names(cached_target: str, cached_names: list[str], target: str) -> list[str] | None:
    """Output names of a group whose target differs from ``cached_target`` only in numeric parts.

    Converters name outputs ``prefix + pattern + suffix`` around the layer name, so the layer's numeric parts
    sit in the outputs' leading parts; where that does not hold, None (the group is traced afresh).
    """
    old, new = cached_target.split("."), target.split(".")
    if len(old) != len(new):
        return None
    diffs = [i for i, (a, b) in enumerate(zip(old, new, strict=True)) if a != b]
    out = []
    for name in cached_names:
        parts = name.split(".")
        for i in diffs:
            if i >= len(parts) or parts[: i + 1] != old[: i + 1]:
                return None
            parts[i] = new[i]
        out.append(".".join(parts))
    return out


class Tracer:
    """Runs groups symbolically, caching traces of groups that differ only in layer or expert numbers."""

    def __init__(self, index: CheckpointIndex, model: Any, shape_of: Callable[[str], Any], trace: bool) -> None:
        self.index = index
        self.model = model
        self.shape_of = shape_of
        self.trace = trace
        self.cache: dict[Any, CacheEntry] = {}
        self.leaves: dict[tuple[tuple[int, ...], torch.dtype], tuple[Block, ...]] = {}

    def _meta(self, key: str) -> torch.Tensor:
        entry = self.index.locate(key)
        return torch.empty(entry.shape, dtype=entry.dtype, device="meta")

    def _placeholder_leaf(self, placeholders: dict[str, str], facts: dict[str, int]) -> Callable[[str], RegionTensor]:
        """Leaves named by placeholder; each source's shape and dtype from the first source with its facts id
        (a stacked-experts group has ~10^3 sources of one shape: one is located, not all)."""
        index = self.index
        known: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}

        def leaf(key: str) -> RegionTensor:
            fid = facts[key]
            shape_dtype = known.get(fid)
            if shape_dtype is None:
                entry = index.locate(key)
                shape_dtype = known[fid] = (entry.shape, entry.dtype)
            return RegionTensor.leaf(placeholders[key], *shape_dtype)

        return leaf

    def run(self, group: LoadGroup) -> Traced:
        if group.rule is None:
            key = group.sources[0][1]
            entry = self.index.locate(key)
            blocks = None
            if self.trace:  # a plain rename's trace depends only on shape and dtype (its source is "#0")
                blocks = self.leaves.get((entry.shape, entry.dtype))
                if blocks is None:
                    blocks = RegionTensor.leaf("#0", entry.shape, entry.dtype).blocks
                    self.leaves[(entry.shape, entry.dtype)] = blocks
            return Traced(
                {group.target: blocks}, {group.target: tuple(entry.shape)}, {group.target: entry.dtype}, {"#0": key}
            )
        patterns, keys_t = zip(*group.sources, strict=True) if group.sources else ((), ())
        keys = list(keys_t)
        sources = dict(zip(placeholders(len(keys)), keys, strict=True))
        facts = self.index.facts_many(keys)  # each source's dtype name and shape, as ids: nothing is located
        signature = (
            id(group.rule),
            self.trace,
            patterns,
            facts,
            masked_name(group.target),
            self.shape_of(group.target),
        )
        cached = self.cache.get(signature)
        names = _derive_names(cached.target, cached.names, group.target) if cached is not None else None
        if cached is None or names is None:
            cached = self._trace(group, dict(zip(keys, facts, strict=True)))
            self.cache[signature] = cached
            names = cached.names
        shapes = dict(zip(names, cached.shapes, strict=True))
        dtypes = dict(zip(names, cached.dtypes, strict=True))
        if cached.blocks is None:
            log.debug("deferring %s: %s", group.target, cached.reason)
            return Traced(dict.fromkeys(names), shapes, dtypes, sources, cached.reason)
        return Traced(dict(zip(names, cached.blocks, strict=True)), shapes, dtypes, sources)

    def _trace(self, group: LoadGroup, facts: dict[str, int]) -> CacheEntry:
        reason = "legacy loader"
        if self.trace:
            placeholders = {k: f"#{i}" for i, (_, k) in enumerate(group.sources)}
            try:
                traced = convert_group(group, self.model, self._placeholder_leaf(placeholders, facts))
            except (UnsupportedRegionOp, TypeError, RuntimeError, ValueError, NotImplementedError) as exc:
                reason = f"{type(exc).__name__}: {exc}"
            else:
                if all(isinstance(v, RegionTensor) for v in traced.values()):
                    return CacheEntry(
                        group.target,
                        list(traced),
                        [tuple(v.shape) for v in traced.values()],
                        [v.dtype for v in traced.values()],
                        [v.blocks for v in traced.values()],
                        "",
                    )
                reason = "an op produced a real tensor"
        try:
            meta = convert_group(group, self.model, self._meta)
        except Exception as exc:
            raise ConversionError(
                f"Failed to convert checkpoint tensors for {group.target} "
                f"(keys {', '.join(map(shown_key, group.keys[:4]))}{', ...' if len(group.keys) > 4 else ''}): "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        return CacheEntry(
            group.target,
            list(meta),
            [tuple(v.shape) for v in meta.values()],
            [v.dtype for v in meta.values()],
            None,
            reason,
        )


_PLACEHOLDERS: list[str] = []


def placeholders(n: int) -> list[str]:
    """``["#0", ..., "#{n-1}"]`` (shared: stacked-experts groups have hundreds of sources)."""
    while len(_PLACEHOLDERS) < n:
        _PLACEHOLDERS.append(f"#{len(_PLACEHOLDERS)}")
    return _PLACEHOLDERS[:n]


def group_compute(group: LoadGroup, model: Any) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    def compute(sources: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if group.rule is None:
            return {group.target: sources[group.keys[0]]}
        return convert_group(group, model, sources.__getitem__)

    return compute
