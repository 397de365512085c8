"""Traced blocks -> this rank's read items: each block's read template (storage base and strides),
the per-block-list cache shared by every layer of a trace (``BlockCache``), and ``region_items``, which
intersects the blocks with the target's local region into the target's ``Reads`` (whole blocks of one box are
the shared rows renamed and moved; anything else is the general block/box intersection, made into columns once).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from hp_fastload.convert.quant import MXFP4_LEAF_DTYPE
from hp_fastload.convert.symbolic import Block, row_major_strides
from hp_fastload.model.targets import Target
from hp_fastload.planning.items import Reads
from hp_fastload.source.index import CheckpointIndex

#: Block lists at least this long are filtered against a rank's bounding box with numpy.
VECTOR_BLOCKS = 32


#: What a block reads, independent of the rank: (source, storage base, storage strides, lengths, offsets, post).
Template = tuple[str, int, tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[Any, ...]]


class BlockEntry:
    """What ``BlockCache`` keeps per block list (built on first use)."""

    __slots__ = ("blocks", "bounds", "built", "columns", "templates")

    def __init__(self, blocks: Sequence[Block]) -> None:
        self.blocks = blocks  # held, so the id stays this list's
        self.templates = _templates(blocks)
        self.bounds: Any = None
        self.columns: Reads | None = None
        self.built = False  # whether ``columns`` was built (None then: the blocks differ in rank)


class BlockCache:
    """Per shared block list (a cached trace's, reused by every layer's group; held by identity): the blocks'
        read templates, their bounds as arrays for long lists, and their reads as columns (``Reads`` over the
    trace's source names, renamed per layer). A
        stacked-experts trace has ~10^3 blocks; computing each block's strides and base once per plan instead of
        once per layer, and filtering an expert-parallel rank's few experts in one vector test, keeps planning
        near linear in the items made."""

    def __init__(self) -> None:
        self._lists: dict[int, BlockEntry] = {}

    def _entry(self, blocks: Sequence[Block]) -> BlockEntry:
        entry = self._lists.get(id(blocks))
        if entry is None or entry.blocks is not blocks:
            entry = self._lists[id(blocks)] = BlockEntry(blocks)
        return entry

    def templates(self, blocks: Sequence[Block]) -> list[Template]:
        return self._entry(blocks).templates

    def _bounds(self, entry: BlockEntry) -> Any:
        if entry.bounds is None:
            starts = np.array([b.offsets for b in entry.blocks], dtype=np.int64)
            entry.bounds = (starts, starts + np.array([b.lengths for b in entry.blocks], dtype=np.int64))
        return entry.bounds

    def columns(self, blocks: Sequence[Block]) -> Reads | None:
        """The blocks' reads as columns, keyed by the blocks' own source names; None when the blocks differ in
        rank (no target's blocks do: it is the guard of the array form)."""
        entry = self._entry(blocks)
        if not entry.built:
            entry.built = True
            templates = entry.templates
            if not templates or len({len(t[4]) for t in templates}) != 1:
                entry.columns = None
            else:
                lengths = np.array([t[3] for t in templates], dtype=np.int64)
                itemsize = np.array([b.src_dtype.itemsize for b in blocks], dtype=np.int64)
                nbytes = lengths.prod(axis=1) * itemsize
                packed = np.array([b.src_dtype == MXFP4_LEAF_DTYPE for b in blocks])  # two 4-bit elements a byte
                if packed.any():
                    nbytes = np.where(packed, (nbytes + 1) // 2, nbytes)
                entry.columns = Reads(
                    [t[0] for t in templates],
                    [t[1] for t in templates],
                    np.array([t[2] for t in templates], dtype=np.int64),
                    lengths,
                    np.array([t[4] for t in templates], dtype=np.int64),
                    nbytes,
                    [t[5] for t in templates],
                )
        return entry.columns

    def meeting(self, blocks: Sequence[Block], lo: Sequence[int], hi: Sequence[int]) -> list[int]:
        """Positions of the blocks that meet the box ``[lo, hi)``."""
        if len(blocks) < VECTOR_BLOCKS:
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


def _templates(blocks: Sequence[Block]) -> list[Template]:
    """Each block's read: its source, the flat storage index of its first element and its element strides in
    the (contiguous) source, per region dim."""
    out: list[Template] = []
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
    cache: BlockCache | None = None,
    memo: dict[tuple[int, int], tuple[Any, Any, Reads]] | None = None,
) -> Reads:
    """Exact reads for the part of the converted global tensor (``blocks``) this rank holds.

    ``sources`` maps the blocks' source names to checkpoint keys (placeholders of a shared trace); ``cache``
    keeps per-block work across calls that share a block list (see ``BlockCache``). ``memo`` (one plan's: the
    targets of one rank) keeps the intersection of a block list with a region object, keyed by both identities:
    the targets of one layout share their region object (``build_targets``), and the layers of a model share
    their traced block lists, so each (trace, layout) pair is intersected once and renamed per target.
    """
    region = target.region
    if memo is None:
        return _region_reads(region, len(target.global_shape), blocks, sources, cache)
    memo_key = (id(blocks), id(region))
    hit = memo.get(memo_key)
    if hit is None or hit[0] is not blocks or hit[1] is not region:
        hit = memo[memo_key] = (blocks, region, _region_reads(region, len(target.global_shape), blocks, None, cache))
    raw = hit[2]
    if sources is None or not len(raw):
        return raw.renamed(raw.keys)  # (a Reads of its own per target, as without the memo)
    return raw.renamed(list(map(sources.__getitem__, raw.keys)))


def _region_reads(
    region: Any, ndim_t: int, blocks: Sequence[Block], sources: dict[str, str] | None, cache: BlockCache | None
) -> Reads:
    """``region_items`` without the memo."""
    boxes = list(region.boxes())
    if not boxes:
        return Reads.empty(ndim_t)
    if cache is None:
        cache = BlockCache()
    key = sources.__getitem__ if sources is not None else str
    if region.is_full:  # the whole tensor is local: one item per block, no intersection
        columns = cache.columns(blocks)
        if columns is not None:
            return columns.renamed(list(map(key, columns.keys))) if sources is not None else columns
        return intersect(cache.templates(blocks), range(len(blocks)), boxes, blocks, key, ndim_t)
    # The region's bounding box: blocks outside it (other ranks' experts, rows, ...) are dropped before any
    # per-block arithmetic, which keeps planning linear in the blocks this rank actually reads.
    bb_lo = [min(b[0][d] for b in boxes) for d in range(ndim_t)]
    bb_hi = [max(b[0][d] + b[1][d] for b in boxes) for d in range(ndim_t)]
    rows = cache.meeting(blocks, bb_lo, bb_hi)
    if len(boxes) == 1 and rows and len(blocks) >= VECTOR_BLOCKS:
        # One local box that holds whole blocks (an expert-parallel rank's experts): the shared rows, moved
        # by the box's offset.
        columns = cache.columns(blocks)
        if columns is not None and cache.inside(blocks, rows, bb_lo, bb_hi):
            goff, _, loff = boxes[0]
            picked = columns.take(rows)
            if sources is not None:
                picked = picked.renamed(list(map(key, picked.keys)))
            return picked.moved([int(lo) - int(go) for lo, go in zip(loff, goff, strict=True)])
    return intersect(cache.templates(blocks), rows, boxes, blocks, key, ndim_t)


def intersect(
    templates: Sequence[Template],
    rows: Iterable[int],
    boxes: Sequence[tuple[Sequence[int], Sequence[int], Sequence[int]]],
    blocks: Sequence[Block],
    key: Callable[[str], str],
    ndim: int,
) -> Reads:
    """The general case: every block at ``rows`` cut by every local box (global offset, lengths, local
    offset), one read per non-empty intersection, made into columns once."""
    keys: list[str] = []
    bases: list[int] = []
    all_strides: list[tuple[int, ...]] = []
    all_lengths: list[list[int]] = []
    dests: list[list[int]] = []
    nbytes: list[int] = []
    posts: list[tuple[Any, ...]] = []
    for i in rows:
        src, base0, strides, lengths, offsets, post = templates[i]
        source = key(src)
        itemsize = blocks[i].src_dtype.itemsize
        packed = blocks[i].src_dtype == MXFP4_LEAF_DTYPE  # 4-bit elements, two a byte
        for goff, glen, loff in boxes:
            lo = []
            sub = []
            numel = itemsize
            for d in range(ndim):
                a = offsets[d] if offsets[d] > goff[d] else goff[d]
                end_block = offsets[d] + lengths[d]
                end_box = goff[d] + glen[d]
                b = end_block if end_block < end_box else end_box
                if b <= a:
                    break
                lo.append(a)
                sub.append(b - a)
                numel *= b - a
            else:
                base = base0
                for d in range(ndim):
                    base += (lo[d] - offsets[d]) * strides[d]
                keys.append(source)
                bases.append(base)
                all_strides.append(strides)
                all_lengths.append(sub)
                dests.append([loff[d] + lo[d] - goff[d] for d in range(ndim)])
                nbytes.append((numel + 1) // 2 if packed else numel)
                posts.append(post)
    if not keys:
        return Reads.empty(ndim)
    return Reads(keys, bases, all_strides, all_lengths, dests, nbytes, posts)
