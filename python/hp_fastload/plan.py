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

import copy
import logging
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from .engine import SafetensorsFile, gc_paused
from .errors import MissingKeysError, PlanError, TargetError, shown_key
from .groups import LoadGroup, build_groups, masked_name, rename_key
from .index import CheckpointIndex
from .quant import MXFP4_LEAF_DTYPE, Dequant, QuantInfo, detect_in_index, source_nbytes
from .region import Block, RegionTensor, UnsupportedRegionOp, row_major_strides
from .rules import is_converter, is_renaming, natural_sort_key
from .targets import Target

__all__ = [
    "ConversionError",
    "DeferredGroup",
    "LoadPlan",
    "LoadReport",
    "ReadItem",
    "Replacement",
    "TemplateReads",
    "plan_load",
    "replacement_of",
]

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
    #: tied weights that reached different tensors and were tied again before planning (``finalize.retie``)
    retied_keys: tuple[str, ...] = field(default=(), compare=False)
    #: non-persistent buffers nothing re-created after the load: after ``to_empty`` they hold garbage until
    #: the caller sets them (``finalize.recreate_buffers`` recomputes those of transformers models)
    unfilled_buffers: tuple[str, ...] = field(default=(), compare=False)

    def summary(self) -> str:
        rate = self.bytes_read / self.seconds / 1e9 if self.seconds > 0 else 0.0
        text = (
            f"{self.loader or 'hp_fastload'}: loaded {len(self.loaded_keys)} tensors, "
            f"missing {len(self.missing_keys)}, unexpected {len(self.unexpected_keys)}; "
            f"read {self.bytes_read / 1e6:.1f} MB of {self.checkpoint_bytes / 1e6:.1f} MB checkpoint "
            f"in {self.seconds:.3f} s ({rate:.2f} GB/s); {self.region_targets} region targets, "
            f"{len(self.deferred_targets)} deferred"
        )
        if self.retied_keys:
            text += f"; re-tied {len(self.retied_keys)} ({', '.join(self.retied_keys[:3])})"
        if self.unfilled_buffers:
            shown = ", ".join(self.unfilled_buffers[:3]) + (", ..." if len(self.unfilled_buffers) > 3 else "")
            text += (
                f"; {len(self.unfilled_buffers)} non-persistent buffers not re-created ({shown}): "
                "set them yourself if the model was materialized with to_empty"
            )
        return text


class ReadItem(NamedTuple):
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


class _Columns(NamedTuple):
    """A template list as arrays, one row per block (blocks of one rank only): what packing and read
    accounting need, built once per shared trace."""

    base: np.ndarray[Any, np.dtype[np.int64]]  # (n,) flat source index of each block's first element
    strides: np.ndarray[Any, np.dtype[np.int64]]  # (n, ndim) source element strides per region dim
    lengths: np.ndarray[Any, np.dtype[np.int64]]  # (n, ndim)
    offsets: np.ndarray[Any, np.dtype[np.int64]]  # (n, ndim) region offsets
    nbytes: np.ndarray[Any, np.dtype[np.int64]]  # (n,) source bytes each block reads


class TemplateReads(Sequence[ReadItem]):
    """The read items of a target that takes whole blocks of a shared trace, held as arrays.

    Item ``i`` is template ``rows[i]`` (all templates when ``rows`` is None) with its source renamed to
    ``keys[i]`` and its destination moved by ``shift``. A stacked-experts target has ~10^3 items per layer,
    all alike but for the key: the arrays are built once per trace and shared by every layer, and packing and
    read accounting use them without a ``ReadItem`` per box. Indexing or iterating builds the ``ReadItem``s,
    equal to what the general intersection makes (tests compare both).
    """

    __slots__ = ("_columns", "_templates", "keys", "rows", "shift")

    def __init__(
        self,
        templates: Sequence[_Template],
        columns: _Columns,
        rows: np.ndarray[Any, np.dtype[np.int64]] | None,
        keys: list[str],
        shift: tuple[int, ...] | None,
    ) -> None:
        self._templates = templates
        self._columns = columns
        self.rows = rows
        self.keys = keys
        self.shift = shift

    def __len__(self) -> int:
        return len(self.keys)

    def _item(self, i: int) -> ReadItem:
        _, base, strides, lengths, offsets, post = self._templates[i if self.rows is None else int(self.rows[i])]
        if self.shift is not None:
            offsets = tuple(o + s for o, s in zip(offsets, self.shift, strict=True))
        return ReadItem(self.keys[i], base, strides, lengths, offsets, post)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self._item(j) for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self._item(i)

    def __iter__(self) -> Iterator[ReadItem]:
        return (self._item(i) for i in range(len(self)))

    def column(self, name: str) -> np.ndarray[Any, np.dtype[np.int64]]:
        """One of ``base``, ``strides``, ``lengths``, ``offsets`` (moved by ``shift``), ``nbytes``: one row
        per item."""
        col = getattr(self._columns, name)
        if self.rows is not None:
            col = col[self.rows]
        if name == "offsets" and self.shift is not None:
            col = col + np.asarray(self.shift, dtype=np.int64)
        return col

    @property
    def nbytes(self) -> int:
        """Source bytes these items read."""
        return int(self.column("nbytes").sum())

    def __repr__(self) -> str:
        return f"TemplateReads({len(self)} items, first {self.keys[0] if self.keys else None!r})"


@dataclass
class DeferredGroup:
    """Work done on whole tensors on this rank: read ``keys`` whole, ``compute`` the converted outputs with
    torch, and copy each claimed output's local part into its target (``claims``: output name -> target)."""

    label: str
    keys: list[str]
    compute: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
    claims: dict[str, Target] = field(default_factory=dict)
    reason: str = ""


@dataclass
class LoadPlan:
    """This rank's plan: region reads per target, deferred groups, the report, the rules that fired."""

    index: CheckpointIndex
    targets: dict[str, Target]
    region_reads: dict[str, tuple[Target, Sequence[ReadItem]]]  # a list, or TemplateReads
    deferred: list[DeferredGroup]
    report: LoadReport
    used_rules: list[Any]
    model: Any = None
    used_base_rules: list[Any] = field(default_factory=list)
    used_replacement_rules: list[Any] = field(default_factory=list)
    dequant: dict[str, Dequant] = field(default_factory=dict)  # quantized keys read dequantized (quant.py)

    def read_bytes_by_file(self) -> dict[str, int]:
        """Bytes of source data this rank's region reads need, per checkpoint file."""
        by_file: dict[SafetensorsFile, int] = {}
        locate = self.index.locate
        for _, items in self.region_reads.values():
            if isinstance(items, TemplateReads):
                for key, n in zip(items.keys, items.column("nbytes").tolist(), strict=True):
                    file = locate(key)[0]
                    by_file[file] = by_file.get(file, 0) + n
                continue
            for item in items:
                file, _, dtype = locate(item.source)
                by_file[file] = by_file.get(file, 0) + source_nbytes(item.numel, dtype, item.source in self.dequant)
        out: dict[str, int] = {}
        for file, n in by_file.items():
            out[file.path] = out.get(file.path, 0) + n
        scales = {key: entry for per_target in self._scale_reads().values() for key, entry in per_target.items()}
        for entry in scales.values():  # each scale tensor once
            out[entry.file.path] = out.get(entry.file.path, 0) + entry.nbytes
        for path, n in self._deferred_bytes():
            out[path] = out.get(path, 0) + n
        return out

    def _deferred_bytes(self) -> Iterator[tuple[str, int]]:
        for deferred in self.deferred:
            for key in deferred.keys:
                entry = self.index.entry(key)
                yield entry.file.path, entry.nbytes

    def _scale_reads(self) -> dict[str, dict[str, Any]]:
        """Per region target, the scale tensors of its dequantized keys (``TensorEntry`` by key): the engine
        reads each of them whole."""
        out: dict[str, dict[str, Any]] = {}
        if not self.dequant:
            return out
        for name, (_, items) in self.region_reads.items():
            keys = items.keys if isinstance(items, TemplateReads) else [item.source for item in items]
            scales = {self.dequant[k].scale for k in set(keys) if k in self.dequant}
            if scales:
                out[name] = {scale: self.index.entry(scale) for scale in sorted(scales)}
        return out

    def read_bytes_by_target(self) -> dict[str, int]:
        """Source bytes of each region target's reads, the whole scale tensors of its dequantized keys
        included."""
        out: dict[str, int] = {}
        locate = self.index.locate
        for name, (_, items) in self.region_reads.items():
            if isinstance(items, TemplateReads):
                out[name] = items.nbytes
            else:
                out[name] = sum(source_nbytes(i.numel, locate(i.source)[2], i.source in self.dequant) for i in items)
        for name, scales in self._scale_reads().items():
            out[name] += sum(entry.nbytes for entry in scales.values())
        return out

    @property
    def bytes_needed(self) -> int:
        """Source bytes of the region reads plus the deferred groups' whole tensors."""
        return sum(self.read_bytes_by_target().values()) + sum(n for _, n in self._deferred_bytes())

    def summary(self) -> str:
        lines = [
            f"{len(self.region_reads)} targets as region reads, {len(self.deferred)} deferred groups; "
            f"{self.bytes_needed / 1e6:.2f} MB of {self.index.total_bytes / 1e6:.2f} MB"
        ]
        for path, nbytes in sorted(self.read_bytes_by_file().items()):
            lines.append(f"  {path}: {nbytes} bytes")
        for d in self.deferred:
            lines.append(f"  deferred {d.label}: {d.reason}")
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
class _CacheEntry:
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


class _Tracer:
    """Runs groups symbolically, caching traces of groups that differ only in layer or expert numbers."""

    def __init__(self, index: CheckpointIndex, model: Any, shape_of: Callable[[str], Any], trace: bool) -> None:
        self.index = index
        self.model = model
        self.shape_of = shape_of
        self.trace = trace
        self.cache: dict[Any, _CacheEntry] = {}
        self.leaves: dict[tuple[tuple[int, ...], torch.dtype], tuple[Block, ...]] = {}

    def _meta(self, key: str) -> torch.Tensor:
        entry = self.index.entry(key)
        return torch.empty(entry.shape, dtype=entry.dtype, device="meta")

    def _placeholder_leaf(self, placeholders: dict[str, str]) -> Callable[[str], RegionTensor]:
        index = self.index

        def leaf(key: str) -> RegionTensor:
            file, _, dtype = index.locate(key)  # no TensorEntry: a stacked-experts trace has ~10^3 leaves
            return RegionTensor.leaf(placeholders[key], file._entries[key][2], dtype)

        return leaf

    def run(self, group: LoadGroup) -> _Traced:
        if group.rule is None:
            key = group.sources[0][1]
            entry = self.index.entry(key)
            blocks = None
            if self.trace:  # a plain rename's trace depends only on shape and dtype (its source is "#0")
                blocks = self.leaves.get((entry.shape, entry.dtype))
                if blocks is None:
                    blocks = RegionTensor.leaf("#0", entry.shape, entry.dtype).blocks
                    self.leaves[(entry.shape, entry.dtype)] = blocks
            return _Traced(
                {group.target: blocks}, {group.target: tuple(entry.shape)}, {group.target: entry.dtype}, {"#0": key}
            )
        keys = [k for _, k in group.sources]
        sources = dict(zip(_placeholders(len(keys)), keys, strict=True))
        facts = self.index.facts_of(keys)  # (shape, dtype name) per source, looked up in bulk
        signature = (
            id(group.rule),
            self.trace,
            tuple(p for p, _ in group.sources),
            facts,
            masked_name(group.target),
            self.shape_of(group.target),
        )
        cached = self.cache.get(signature)
        names = _derive_names(cached.target, cached.names, group.target) if cached is not None else None
        if cached is None or names is None:
            cached = self._trace(group)
            self.cache[signature] = cached
            names = cached.names
        shapes = dict(zip(names, cached.shapes, strict=True))
        dtypes = dict(zip(names, cached.dtypes, strict=True))
        if cached.blocks is None:
            log.debug("deferring %s: %s", group.target, cached.reason)
            return _Traced(dict.fromkeys(names), shapes, dtypes, sources, cached.reason)
        return _Traced(dict(zip(names, cached.blocks, strict=True)), shapes, dtypes, sources)

    def _trace(self, group: LoadGroup) -> _CacheEntry:
        reason = "legacy loader"
        if self.trace:
            placeholders = {k: f"#{i}" for i, (_, k) in enumerate(group.sources)}
            try:
                traced = _convert(group, self.model, self._placeholder_leaf(placeholders))
            except (UnsupportedRegionOp, TypeError, RuntimeError, ValueError, NotImplementedError) as exc:
                reason = f"{type(exc).__name__}: {exc}"
            else:
                if all(isinstance(v, RegionTensor) for v in traced.values()):
                    return _CacheEntry(
                        group.target,
                        list(traced),
                        [tuple(v.shape) for v in traced.values()],
                        [v.dtype for v in traced.values()],
                        [v.blocks for v in traced.values()],
                        "",
                    )
                reason = "an op produced a real tensor"
        try:
            meta = _convert(group, self.model, self._meta)
        except Exception as exc:
            raise ConversionError(
                f"Failed to convert checkpoint tensors for {group.target} "
                f"(keys {', '.join(map(shown_key, group.keys[:4]))}{', ...' if len(group.keys) > 4 else ''}): "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        return _CacheEntry(
            group.target,
            list(meta),
            [tuple(v.shape) for v in meta.values()],
            [v.dtype for v in meta.values()],
            None,
            reason,
        )


# ---------------------------------------------------------------------------------------------------------
# Regions -> read items


_PLACEHOLDERS: list[str] = []


def _placeholders(n: int) -> list[str]:
    """``["#0", ..., "#{n-1}"]`` (shared: stacked-experts groups have hundreds of sources)."""
    while len(_PLACEHOLDERS) < n:
        _PLACEHOLDERS.append(f"#{len(_PLACEHOLDERS)}")
    return _PLACEHOLDERS[:n]


#: Block lists at least this long are filtered against a rank's bounding box with numpy.
_VECTOR_BLOCKS = 32

#: What a block reads, independent of the rank: (source, storage base, storage strides, lengths, offsets, post).
_Template = tuple[str, int, tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[Any, ...]]


class _BlockEntry:
    """What ``_BlockCache`` keeps per block list (built on first use)."""

    __slots__ = ("blocks", "bounds", "built", "columns", "templates")

    def __init__(self, blocks: Sequence[Block]) -> None:
        self.blocks = blocks  # held, so the id stays this list's
        self.templates = _templates(blocks)
        self.bounds: Any = None
        self.columns: _Columns | None = None
        self.built = False  # whether ``columns`` was built (None then: post-ops or mixed ranks)


class _BlockCache:
    """Per shared block list (a cached trace's, reused by every layer's group; held by identity): the blocks'
    read templates, their bounds as arrays for long lists, and their read columns (``TemplateReads``). A
    stacked-experts trace has ~10^3 blocks; computing each block's strides and base once per plan instead of
    once per layer, and filtering an expert-parallel rank's few experts in one vector test, keeps planning
    near linear in the items made."""

    def __init__(self) -> None:
        self._lists: dict[int, _BlockEntry] = {}

    def _entry(self, blocks: Sequence[Block]) -> _BlockEntry:
        entry = self._lists.get(id(blocks))
        if entry is None or entry.blocks is not blocks:
            entry = self._lists[id(blocks)] = _BlockEntry(blocks)
        return entry

    def templates(self, blocks: Sequence[Block]) -> list[_Template]:
        return self._entry(blocks).templates

    def _bounds(self, entry: _BlockEntry) -> Any:
        if entry.bounds is None:
            starts = np.array([b.offsets for b in entry.blocks], dtype=np.int64)
            entry.bounds = (starts, starts + np.array([b.lengths for b in entry.blocks], dtype=np.int64))
        return entry.bounds

    def columns(self, blocks: Sequence[Block]) -> _Columns | None:
        """The blocks' reads as arrays; None when some block has post-ops (read through temporaries) or the
        blocks differ in rank."""
        entry = self._entry(blocks)
        if not entry.built:
            entry.built = True
            templates = entry.templates
            if not templates or any(t[5] for t in templates) or len({len(t[4]) for t in templates}) != 1:
                entry.columns = None
            else:
                lengths = np.array([t[3] for t in templates], dtype=np.int64)
                itemsize = np.array([b.src_dtype.itemsize for b in blocks], dtype=np.int64)
                nbytes = lengths.prod(axis=1) * itemsize
                packed = np.array([b.src_dtype == MXFP4_LEAF_DTYPE for b in blocks])  # two 4-bit elements a byte
                if packed.any():
                    nbytes = np.where(packed, (nbytes + 1) // 2, nbytes)
                entry.columns = _Columns(
                    np.array([t[1] for t in templates], dtype=np.int64),
                    np.array([t[2] for t in templates], dtype=np.int64),
                    lengths,
                    np.array([t[4] for t in templates], dtype=np.int64),
                    nbytes,
                )
        return entry.columns

    def meeting(self, blocks: Sequence[Block], lo: Sequence[int], hi: Sequence[int]) -> list[int]:
        """Positions of the blocks that meet the box ``[lo, hi)``."""
        if len(blocks) < _VECTOR_BLOCKS:
            return [
                i
                for i, b in enumerate(blocks)
                if all(o < h and o + n > l_ for o, n, l_, h in zip(b.offsets, b.lengths, lo, hi, strict=True))
            ]
        starts, ends = self._bounds(self._entry(blocks))
        return np.flatnonzero(((starts < np.asarray(hi)) & (ends > np.asarray(lo))).all(axis=1)).tolist()

    def inside(self, blocks: Sequence[Block], rows: list[int], lo: Sequence[int], hi: Sequence[int]) -> bool:
        """Whether the blocks at ``rows`` lie wholly inside the box ``[lo, hi)``."""
        starts, ends = self._bounds(self._entry(blocks))
        return bool(((starts[rows] >= np.asarray(lo)) & (ends[rows] <= np.asarray(hi))).all())


def _templates(blocks: Sequence[Block]) -> list[_Template]:
    """Each block's read: its source, the flat storage index of its first element and its element strides in
    the (contiguous) source, per region dim."""
    out: list[_Template] = []
    strides_by_shape: dict[tuple[int, ...], tuple[int, ...]] = {}
    strides_by_map: dict[Any, tuple[int, ...]] = {}
    for block in blocks:
        src_shape = block.src_shape
        src_st = strides_by_shape.get(src_shape)
        if src_st is None:
            src_st = strides_by_shape[src_shape] = row_major_strides(src_shape)
        coeff = block.coeff
        strides = strides_by_map.get((src_shape, coeff))
        if strides is None:
            nsrc = len(src_st)
            strides = tuple(sum(coeff[s][d] * src_st[s] for s in range(nsrc)) for d in range(len(block.offsets)))
            strides_by_map[(src_shape, coeff)] = strides
        base0 = 0
        for b, st in zip(block.base, src_st, strict=True):
            base0 += b * st
        out.append((block.source, base0, strides, tuple(block.lengths), tuple(block.offsets), tuple(block.post)))
    return out


def region_items(
    target: Target,
    blocks: Sequence[Block],
    index: CheckpointIndex,
    sources: dict[str, str] | None = None,
    cache: _BlockCache | None = None,
) -> Sequence[ReadItem]:
    """Exact read items for the part of the converted global tensor (``blocks``) this rank holds.

    ``sources`` maps the blocks' source names to checkpoint keys (placeholders of a shared trace); ``cache``
    keeps per-block work across calls that share a block list (see ``_BlockCache``).
    """
    region = target.region
    boxes = list(region.boxes())
    if not boxes:
        return []
    if cache is None:
        cache = _BlockCache()
    templates = cache.templates(blocks)
    key = sources.__getitem__ if sources is not None else str
    if region.is_full:  # the whole tensor is local: one item per block, no intersection
        columns = cache.columns(blocks)
        if columns is not None:
            return TemplateReads(templates, columns, None, [key(t[0]) for t in templates], None)
        return [ReadItem(key(src), base, st, n, off, post) for src, base, st, n, off, post in templates]
    # The region's bounding box: blocks outside it (other ranks' experts, rows, ...) are dropped before any
    # per-block arithmetic, which keeps planning linear in the blocks this rank actually reads.
    ndim_t = len(target.global_shape)
    bb_lo = [min(b[0][d] for b in boxes) for d in range(ndim_t)]
    bb_hi = [max(b[0][d] + b[1][d] for b in boxes) for d in range(ndim_t)]
    rows = cache.meeting(blocks, bb_lo, bb_hi)
    if len(boxes) == 1 and rows and len(blocks) >= _VECTOR_BLOCKS:
        # One local box that holds whole blocks (an expert-parallel rank's experts): templates moved by the
        # box's offset, as arrays.
        columns = cache.columns(blocks)
        if columns is not None and cache.inside(blocks, rows, bb_lo, bb_hi):
            goff, _, loff = boxes[0]
            return TemplateReads(
                templates,
                columns,
                np.asarray(rows, dtype=np.int64),
                [key(templates[i][0]) for i in rows],
                tuple(int(lo) - int(go) for lo, go in zip(loff, goff, strict=True)),
            )
    items: list[ReadItem] = []
    for i in rows:
        src, base0, strides, lengths, offsets, post = templates[i]
        source = key(src)
        ndim = len(offsets)
        for goff, glen, loff in boxes:
            lo = []
            sub = []
            for d in range(ndim):
                a = offsets[d] if offsets[d] > goff[d] else goff[d]
                end_block = offsets[d] + lengths[d]
                end_box = goff[d] + glen[d]
                b = end_block if end_block < end_box else end_box
                if b <= a:
                    break
                lo.append(a)
                sub.append(b - a)
            else:
                base = base0
                for d in range(ndim):
                    base += (lo[d] - offsets[d]) * strides[d]
                dest = tuple(loff[d] + lo[d] - goff[d] for d in range(ndim))
                items.append(ReadItem(source, base, strides, tuple(sub), dest, post))
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


def _group_compute(group: LoadGroup, model: Any) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    def compute(sources: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if group.rule is None:
            return {group.target: sources[group.keys[0]]}
        return _convert(group, model, sources.__getitem__)

    return compute


class _Claims:
    """Claiming converted outputs for model targets: first claim of a physical tensor wins, aliases load."""

    def __init__(self, index: CheckpointIndex, targets: dict[str, Target], quant: QuantInfo | None = None) -> None:
        self.index = index
        self.targets = targets
        self.quant = quant  # the checkpoint's quantized tensors (None or empty: none)
        self.claimed: set[int] = set()
        self.loaded: set[str] = set()
        self.unexpected: list[str] = []
        self.region_reads: dict[str, tuple[Target, Sequence[ReadItem]]] = {}
        self.deferred: list[DeferredGroup] = []
        self.blocks = _BlockCache()  # per-block work on shared traces (see _BlockCache)

    def claim(self, name: str, shape: Sequence[int]) -> Target | None:
        target = self.targets.get(name)
        if target is None:
            self.unexpected.append(name)
            return None
        if id(target) in self.claimed:
            self.loaded.update(target.names)
            return None
        _check_claim(name, target, shape)
        self.claimed.add(id(target))
        self.loaded.update(target.names)
        return target

    def region(self, name: str, shape: Sequence[int], blocks: Sequence[Block], sources: dict[str, str] | None) -> None:
        if self.quant:
            srcs = {b.source for b in blocks}
            self._check_quant(name, [sources[s] for s in srcs] if sources is not None else srcs)
        target = self.claim(name, shape)
        if target is not None:
            items = region_items(target, blocks, self.index, sources, self.blocks)
            self.region_reads[target.names[0]] = (target, items)

    def defer(self, name: str, shape: Sequence[int], pending: DeferredGroup) -> None:
        if self.quant:
            self._check_quant(name, pending.keys)
        target = self.claim(name, shape)
        if target is not None:
            pending.claims[name] = target

    def _check_quant(self, name: str, sources: Iterable[str]) -> None:
        """A quantized source converted into a target of another dtype is refused (before shapes are checked:
        a packed layout has other shapes than the float tensor it encodes)."""
        target = self.targets.get(name)
        if target is None or id(target) in self.claimed or self.quant is None:
            return
        self.quant.check_claim(name, target.dtype, sources, lambda k: self.index.source(k)[1])

    def add_deferred(self, pending: DeferredGroup | None) -> None:
        if pending is not None and pending.claims:
            self.deferred.append(pending)

    def direct(self, group: LoadGroup, traced: _Traced, model: Any, names: Sequence[str] | None = None) -> None:
        """Claim a stage's outputs as they are (region reads, or one deferred group for the rest)."""
        pending: DeferredGroup | None = None
        for name in names if names is not None else traced.outputs:
            blocks = traced.outputs[name]
            if blocks is not None:
                self.region(name, traced.shapes[name], blocks, traced.sources)
                continue
            if pending is None:
                pending = DeferredGroup(group.target, group.keys, _group_compute(group, model), reason=traced.reason)
            self.defer(name, traced.shapes[name], pending)
        self.add_deferred(pending)


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
class _ReplacementState:
    """A scoped replacement converter waiting for its stage-1 inputs."""

    target: str
    rule: Any | None  # None: a plain rename of one stage-1 output
    expected: dict[str, int] = field(default_factory=dict)
    received: dict[str, int] = field(default_factory=dict)
    inputs: list[tuple[str, str, LoadGroup, _Traced]] = field(default_factory=list)  # pattern, name, stage 1
    completed: bool = False


def _replacement_routes(
    shapes: Mapping[str, Sequence[int]], targets: dict[str, Target], replacement: Sequence[Any]
) -> dict[str, tuple[_ReplacementState, str]]:
    renamings = [copy.deepcopy(r) for r in replacement if is_renaming(r)]
    converters = [r for r in replacement if is_converter(r)]
    probes = [copy.deepcopy(r) for r in converters]
    routes: dict[str, tuple[_ReplacementState, str]] = {}
    states: dict[str, _ReplacementState] = {}
    for name in sorted(shapes, key=natural_sort_key):
        renamed, probe, pattern = rename_key(name, renamings, probes, None, targets)
        if (probe is None and renamed == name) or renamed not in targets:
            continue
        rule = converters[probes.index(probe)] if probe is not None else None
        if rule is not None and getattr(rule, "scope_prefix", None) is None:
            raise ValueError(f"No unique replacement WeightConverter found for source '{name}' and target '{renamed}'")
        state = states.get(renamed)
        if state is None:
            state = states[renamed] = _ReplacementState(renamed, rule)
        key = pattern if pattern is not None else name
        state.expected[key] = state.expected.get(key, 0) + 1
        routes[name] = (state, key)
    return routes


def _plan_replacement_stage(
    state: _ReplacementState, model: Any, view: SourceModelView, claims: _Claims, trace: bool
) -> None:
    """Convert a complete replacement group: composed regions when every input traced, else deferred."""
    if state.rule is None:
        (_, name, group, traced) = state.inputs[0]
        blocks = traced.outputs[name]
        if blocks is not None:
            claims.region(state.target, traced.shapes[name], blocks, traced.sources)
            return
        pending = DeferredGroup(
            state.target,
            group.keys,
            lambda srcs: {state.target: _group_compute(group, view)(srcs)[name]},
            reason=traced.reason,
        )
        claims.defer(state.target, traced.shapes[name], pending)
        claims.add_deferred(pending)
        return
    config = getattr(model, "config", None)
    traced_reason = next((t.reason for _, n, _, t in state.inputs if t.outputs.get(n) is None), "")
    reason = traced_reason
    regions = [t.region(n) for _, n, _, t in state.inputs] if trace else [None]
    if trace and all(r is not None for r in regions):
        transform = copy.deepcopy(state.rule)
        for (pattern, name, _, _), region in zip(state.inputs, regions, strict=True):
            transform.add_tensor(state.target, name, pattern, region)
        try:
            outputs = transform.convert(state.target, model=model, config=config)
            outputs = {n: (v[0] if isinstance(v, list) else v) for n, v in outputs.items()}
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
            normalized.update(_group_compute(group, view)(sources))
        transform = copy.deepcopy(rule)
        for pattern, name, _, _ in state.inputs:
            transform.add_tensor(state.target, name, pattern, normalized[name])
        out = transform.convert(state.target, model=model, config=config)
        return {n: (v[0] if isinstance(v, list) else v) for n, v in out.items()}

    try:
        meta = compute(
            {
                k: torch.empty(claims.index.entry(k).shape, dtype=claims.index.entry(k).dtype, device="meta")
                for k in keys
            }
        )
    except Exception as exc:
        raise ConversionError(
            f"Failed to convert checkpoint tensors for {state.target}: {type(exc).__name__}: {exc}"
        ) from exc
    pending = DeferredGroup(state.target, keys, compute, reason=reason or traced_reason or "legacy loader")
    for name, value in meta.items():
        claims.defer(name, tuple(value.shape), pending)
    claims.add_deferred(pending)


def _missing_keys_error(missing: Sequence[str], unexpected: Sequence[str]) -> MissingKeysError:
    text = f"Checkpoint did not load {len(missing)} owned model tensors; first keys: {', '.join(missing[:10])}"
    if unexpected:
        text += (
            f". The checkpoint also holds {len(unexpected)} tensors this model does not own (first: "
            f"{', '.join(unexpected[:5])}): is it a checkpoint of another architecture, depth or size, or does it "
            "need a weights_mapping / key_mapping?"
        )
    return MissingKeysError(text, missing, unexpected)


@gc_paused()
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
    replacement: Replacement | None = None,
) -> LoadPlan:
    """Plan one rank's load. Raises (before any byte is read) on strict misses and bad targets.

    ``trace=False`` plans every group as deferred (the legacy loader). ``replacement`` (default:
    ``replacement_of(model)``) adds the replacement modules' second stage. The cyclic garbage collector is
    paused: planning a 100k-tensor checkpoint allocates a few hundred thousand small objects, which would
    trigger several full collections of everything the process holds (a model, torch's modules) for nothing.
    """
    if replacement is None:
        replacement = replacement_of(model)
    keys = [k for k in index if k not in claimed_source_keys]
    prefix = getattr(model, "base_model_prefix", None) or None
    quant = detect_in_index(index)
    claims = _Claims(index, targets, quant)
    used_replacements: list[Any] = []
    if replacement is not None and replacement.rules and replacement.source_shapes:
        base_rules = [r for r in rules if not any(r is x for x in replacement.rules)]
        view = SourceModelView(model, dict(replacement.source_shapes))
        groups, unexpected = build_groups(keys, view.shapes, base_rules, base_model_prefix=prefix, map_key=map_key)
        claims.unexpected.extend(unexpected)
        routes = _replacement_routes(view.shapes, targets, replacement.rules)
        tracer = _Tracer(index, view, view.shapes.get, trace)
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
                    _plan_replacement_stage(state, model, view, claims, trace)
                    if state.rule is not None and not any(state.rule is u for u in used_replacements):
                        used_replacements.append(state.rule)
            claims.direct(group, traced, view, direct)
        rules = base_rules
    else:
        groups, unexpected = build_groups(keys, targets, rules, base_model_prefix=prefix, map_key=map_key)
        claims.unexpected.extend(unexpected)
        tracer = _Tracer(index, model, lambda n: targets[n].global_shape if n in targets else None, trace)
        for group in groups:
            claims.direct(group, tracer.run(group), model)
    if quant and trace:  # MXFP4 into float experts: region reads the engine dequantizes (quant.mxfp4_region)
        unloaded = set(targets) - claims.loaded
        for name, packed in quant.packed_regions(
            unloaded,
            claims.unexpected,
            lambda n: targets[n].dtype,
            lambda k: index.entry(k).shape,
            lambda k: index.source(k)[1],
        ):
            target = claims.claim(name, tuple(packed.shape))
            if target is not None:
                items = region_items(target, packed.blocks, index, None, claims.blocks)
                claims.region_reads[target.names[0]] = (target, items)
    if quant:  # the legacy loader: MXFP4 dequantized with torch on whole tensors, deferred groups of their own
        unloaded = set(targets) - claims.loaded
        fallbacks = quant.fallbacks(
            unloaded, claims.unexpected, lambda n: targets[n].dtype, lambda k: index.entry(k).shape
        )
        for name, keys, compute, shape in fallbacks:
            pending = DeferredGroup(name, keys, compute, reason="MXFP4 dequantized with torch (whole tensors)")
            target = claims.claim(name, shape)
            if target is not None:
                pending.claims[name] = target
            claims.add_deferred(pending)
    missing = sorted(set(targets) - claims.loaded, key=natural_sort_key)
    if quant:
        quant.check_missing(missing, claims.unexpected)
        consumed = quant.consumed()  # the scales of dequantized tensors are read with them
        claims.unexpected = [k for k in claims.unexpected if k not in consumed]
    if strict and missing:
        raise _missing_keys_error(missing, index.natural_sorted(claims.unexpected))
    report = LoadReport(
        loaded_keys=tuple(sorted(claims.loaded, key=natural_sort_key)),
        missing_keys=tuple(missing),
        unexpected_keys=tuple(index.natural_sorted(claims.unexpected)),
        checkpoint_bytes=index.total_bytes,
        region_targets=len(claims.region_reads),
        deferred_targets=tuple(n for d in claims.deferred for n in d.claims),
        loader=loader,
    )
    used = [r for r in rules if getattr(r, "was_used", lambda: False)()]
    plan = LoadPlan(
        index,
        targets,
        claims.region_reads,
        claims.deferred,
        report,
        used + used_replacements,
        model,
        used_base_rules=used,
        used_replacement_rules=used_replacements,
        dequant=dict(quant.dequantized),
    )
    log.debug(
        "planned %d model tensors as region reads and %d through %d deferred conversions",
        len(claims.region_reads),
        sum(len(d.claims) for d in claims.deferred),
        len(claims.deferred),
    )
    return plan
