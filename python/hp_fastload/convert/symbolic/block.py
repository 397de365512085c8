"""``Block``: a box of a symbolic tensor whose elements come from one checkpoint tensor through an affine index map,
the arithmetic on its base and coefficient columns, and the merging of adjacent blocks.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import torch

from hp_fastload.convert.symbolic.post import PostOp, post_dtype

Vec = tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Block:
    """A box of a RegionTensor whose elements come from one checkpoint tensor through an affine map.

    Attributes:
        offsets: first index of the box, per dim of the region.
        lengths: extent of the box, per dim of the region (all >= 1).
        source: checkpoint key of the tensor the elements are read from.
        base: source index of the box's first element (one entry per source dim).
        coeff: ``[source_ndim][region_ndim]`` non-negative ints; source index of element ``x`` of the box is
            ``base + coeff @ (x - offsets)``.
        post: elementwise ops applied in order to the values read (see :class:`PostOp`).
        src_dtype: dtype of the checkpoint tensor.
        src_shape: shape of the checkpoint tensor (every index the block touches is inside it).
    """

    offsets: Vec
    lengths: Vec
    source: str
    base: Vec
    coeff: tuple[Vec, ...]
    post: tuple[PostOp, ...]
    src_dtype: torch.dtype
    src_shape: Vec

    def __post_init__(self) -> None:
        if __debug__:
            _check_block(self)

    @property
    def ndim(self) -> int:
        return len(self.offsets)

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)

    @property
    def steps(self) -> tuple[Vec, ...]:
        """Columns of ``coeff``: the source-index step for one step along each region dim."""
        return tuple(columns(self))

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the values after ``post``."""
        return post_dtype(self.src_dtype, self.post)

    def source_index(self, index: Sequence[int]) -> Vec:
        """The source index that element ``index`` (region coordinates, inside the box) is read from."""
        rel = [i - o for i, o in zip(index, self.offsets, strict=True)]
        if len(rel) != self.ndim or any(r < 0 or r >= n for r, n in zip(rel, self.lengths, strict=True)):
            raise IndexError(f"{tuple(index)} is outside the block {self.offsets}+{self.lengths}")
        return tuple(
            b + sum(c * r for c, r in zip(row, rel, strict=True)) for b, row in zip(self.base, self.coeff, strict=True)
        )

    def source_strides(self) -> Vec:
        """Element strides into a contiguous (row-major) source tensor, one per region dim."""
        sstr = row_major_strides(self.src_shape)
        return tuple(sum(c * s for c, s in zip(col, sstr, strict=True)) for col in columns(self))

    def source_offset(self) -> int:
        """Flat element offset of ``base`` in a contiguous (row-major) source tensor."""
        return sum(b * s for b, s in zip(self.base, row_major_strides(self.src_shape), strict=True))


def _check_block(b: Block) -> None:
    offsets, lengths, base, shape = b.offsets, b.lengths, b.base, b.src_shape
    nd = len(offsets)
    if len(lengths) != nd or len(base) != len(shape) or len(b.coeff) != len(shape):
        raise ValueError(f"malformed block (rank mismatch): {b}")
    if nd and (min(offsets) < 0 or min(lengths) < 1):
        raise ValueError(f"malformed block (offsets >= 0, lengths >= 1): {b}")
    for s, row in enumerate(b.coeff):
        if len(row) != nd:
            raise ValueError(f"malformed block (coeff rows must have {nd} entries): {b}")
        first = last = base[s]
        for c, n in zip(row, lengths, strict=True):
            if c < 0:
                raise ValueError(f"malformed block (negative coeff): {b}")
            last += c * (n - 1)
        if first < 0 or last >= shape[s]:
            raise ValueError(f"block reads {b.source!r} dim {s} at [{first}, {last}] outside its size {shape[s]}")


_new_block = object.__new__


_set = object.__setattr__


def raw_block(
    offsets: Vec,
    lengths: Vec,
    source: str,
    base: Vec,
    coeff: tuple[Vec, ...],
    post: tuple[PostOp, ...],
    src_dtype: torch.dtype,
    src_shape: Vec,
) -> Block:
    """A Block built without validation, for transformations that cannot change which elements it reads."""
    out = _new_block(Block)
    _set(out, "offsets", offsets)
    _set(out, "lengths", lengths)
    _set(out, "source", source)
    _set(out, "base", base)
    _set(out, "coeff", coeff)
    _set(out, "post", post)
    _set(out, "src_dtype", src_dtype)
    _set(out, "src_shape", src_shape)
    return out


def block_with(
    b: Block, *, offsets: Vec | None = None, source: str | None = None, post: tuple[PostOp, ...] | None = None
) -> Block:
    """``b`` with some fields replaced, unvalidated: moving a block inside the region, renaming its source
    (to a tensor of the same shape) or appending post-ops does not change which source elements it reads."""
    return raw_block(
        b.offsets if offsets is None else offsets,
        b.lengths,
        b.source if source is None else source,
        b.base,
        b.coeff,
        b.post if post is None else post,
        b.src_dtype,
        b.src_shape,
    )


@functools.lru_cache(maxsize=64)
def identity_rows(nd: int) -> tuple[Vec, ...]:
    return tuple(tuple(int(i == j) for j in range(nd)) for i in range(nd))


@functools.lru_cache(maxsize=256)
def leaf_meta(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A meta tensor of ``shape`` and ``dtype``, for leaves to wrap (never handed out itself)."""
    return torch.empty(shape, dtype=dtype, device="meta")


def columns(b: Block) -> list[Vec]:
    if not b.coeff:
        return [()] * len(b.offsets)
    return list(zip(*b.coeff, strict=True))


def _rows(cols: Sequence[Vec], src_nd: int) -> tuple[Vec, ...]:
    if not cols:
        return ((),) * src_nd
    return tuple(zip(*cols, strict=True))


def row_major_strides(shape: Sequence[int]) -> Vec:
    """Element strides of a contiguous tensor of ``shape``, as torch gives them (a 0-sized dim counts as 1)."""
    strides = [1] * len(shape)
    acc = 1
    for i in range(len(shape) - 1, -1, -1):
        strides[i] = acc
        acc *= max(shape[i], 1)
    return tuple(strides)


def axpy(base: Vec, k: int, col: Vec) -> Vec:
    if k == 0:
        return base
    return tuple(x + k * c for x, c in zip(base, col, strict=True))


def scaled(col: Vec, k: int) -> Vec:
    return tuple(k * c for c in col)


def make_block(
    b: Block,
    offsets: Vec,
    lengths: Vec,
    base: Vec,
    cols: Sequence[Vec],
    post: tuple[PostOp, ...] | None = None,
) -> Block:
    return Block(
        offsets=offsets,
        lengths=lengths,
        source=b.source,
        base=base,
        coeff=_rows(cols, len(b.src_shape)),
        post=b.post if post is None else post,
        src_dtype=b.src_dtype,
        src_shape=b.src_shape,
    )


def sub_block(b: Block, offsets: Vec, lengths: Vec, base: Vec, cols: Sequence[Vec]) -> Block:
    """A block that reads a subset of ``b``'s source elements (a reshape piece of ``b``, or ``b`` merged with a
    neighbour it continues): in bounds because ``b`` is, so built without the bounds check."""
    return raw_block(offsets, lengths, b.source, base, _rows(cols, len(b.src_shape)), b.post, b.src_dtype, b.src_shape)


def _try_merge(a: Block, b: Block, d: int) -> Block | None:
    """``a`` followed by ``b`` along dim ``d`` as one block, if one affine map describes both."""
    la, lb = a.lengths[d], b.lengths[d]
    ca, cb = columns(a)[d], columns(b)[d]
    diff = tuple(y - x for x, y in zip(a.base, b.base, strict=True))
    if la > 1:
        step = ca
        if diff != scaled(step, la) or (lb > 1 and cb != step):
            return None
    elif lb > 1:
        step = cb
        if diff != step:
            return None
    else:
        step = diff
        if any(x < 0 for x in step):
            return None
    cols = columns(a)
    cols[d] = step
    lens = list(a.lengths)
    lens[d] = la + lb
    return sub_block(a, a.offsets, tuple(lens), a.base, cols)  # a's elements and b's: both in bounds


def coalesce_blocks(blocks: list[Block], ndim: int) -> list[Block]:
    """Merge neighbouring blocks that one affine map describes; result sorted by offsets."""
    if len(blocks) < 2:
        return blocks
    if len({(b.source, b.post) for b in blocks}) == len(blocks):
        return sorted(blocks, key=lambda b: b.offsets)
    changed = True
    while changed:
        changed = False
        # Per block, once per pass: its columns where its box has more than one element along them (a merge
        # along d needs these equal on every other dim).
        shapes = [tuple(col if n > 1 else None for col, n in zip(columns(b), b.lengths, strict=True)) for b in blocks]
        for d in range(ndim):
            groups: dict[Any, list[int]] = {}
            for i, b in enumerate(blocks):
                sig = shapes[i]
                key = (
                    b.source,
                    b.post,
                    b.offsets[:d] + b.offsets[d + 1 :],
                    b.lengths[:d] + b.lengths[d + 1 :],
                    sig[:d] + sig[d + 1 :],
                )
                groups.setdefault(key, []).append(i)
            if len(groups) == len(blocks):
                continue
            merged: list[Block] = []
            merged_shapes: list[Any] = []
            for members in groups.values():
                if len(members) == 1:
                    merged.append(blocks[members[0]])
                    merged_shapes.append(shapes[members[0]])
                    continue
                members.sort(key=lambda i: blocks[i].offsets[d])
                cur, cur_shape = blocks[members[0]], shapes[members[0]]
                for i in members[1:]:
                    nxt = blocks[i]
                    m = None
                    if nxt.offsets[d] == cur.offsets[d] + cur.lengths[d]:
                        m = _try_merge(cur, nxt, d)
                    if m is None:
                        merged.append(cur)
                        merged_shapes.append(cur_shape)
                        cur, cur_shape = nxt, shapes[i]
                    else:
                        cur = m
                        cur_shape = tuple(col if n > 1 else None for col, n in zip(columns(m), m.lengths, strict=True))
                        changed = True
                merged.append(cur)
                merged_shapes.append(cur_shape)
            blocks, shapes = merged, merged_shapes
    return sorted(blocks, key=lambda b: b.offsets)
