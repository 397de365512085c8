"""Handlers for views that keep each dim a strided range of one input dim: transpose/permute, squeeze/unsqueeze,
split/chunk/unbind/narrow/select, expand, basic indexing.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from typing import Any

import torch

from hp_fastload.convert.symbolic.block import Block, Vec, axpy, columns, make_block, row_major_strides, scaled
from hp_fastload.convert.symbolic.tensor import (
    HANDLERS,
    RegionTensor,
    UnsupportedRegionOp,
    meta_of,
    no_real_tensors,
    op_name,
    register,
    run_meta,
    self_region,
    wrap,
)


def _decode_view(
    in_shape: tuple[int, ...], view: torch.Tensor
) -> tuple[list[int], list[tuple[int, int]], tuple[int, ...]]:
    """Returns (start index per input dim, (input dim or -1, step) per output dim, output shape)."""
    strides = row_major_strides(in_shape)
    out_shape = tuple(view.shape)
    off = view.storage_offset()
    start = [int((off // s) % n) for s, n in zip(strides, in_shape, strict=True)]
    if sum(i * s for i, s in zip(start, strides, strict=True)) != off:
        raise UnsupportedRegionOp("view does not start at an element of its input")
    mapping: list[tuple[int, int]] = []
    used: set[int] = set()
    for n, st in zip(out_shape, view.stride(), strict=True):
        if n == 1 or st == 0:
            mapping.append((-1, 0))
            continue
        k = -1
        for d, (s, size) in enumerate(zip(strides, in_shape, strict=True)):
            if size > 1 and s <= st < s * size:
                k = d
                break
        if k < 0 or k in used or st % strides[k] or start[k] + (st // strides[k]) * (n - 1) >= in_shape[k]:
            raise UnsupportedRegionOp("view is not a strided box of its input")
        used.add(k)
        mapping.append((k, st // strides[k]))
    return start, mapping, out_shape


def _ceil_div(a: int, b: int) -> int:
    return -((-a) // b)


class _DimIndex:
    """Blocks sorted by their offset along one dim, for range queries."""

    def __init__(self, blocks: tuple[Block, ...], dim: int) -> None:
        order = sorted(range(len(blocks)), key=lambda i: blocks[i].offsets[dim])
        self.order = order
        self.starts = [blocks[i].offsets[dim] for i in order]
        self.maxlen = max((b.lengths[dim] for b in blocks), default=1)

    def query(self, lo: int, hi: int) -> list[int]:
        """Indices of blocks whose extent along the dim may intersect [lo, hi]."""
        a = bisect.bisect_left(self.starts, lo - self.maxlen + 1)
        z = bisect.bisect_right(self.starts, hi)
        return self.order[a:z]


def _view_blocks(
    r: RegionTensor,
    start: list[int],
    mapping: list[tuple[int, int]],
    out_shape: tuple[int, ...],
    indexes: dict[int, _DimIndex],
) -> list[Block]:
    if math.prod(out_shape) == 0:
        return []
    in_shape = r._rshape
    blocks = r._blocks
    # Range of input indices covered along each input dim (used to preselect blocks).
    mapped = {k: (j, step) for j, (k, step) in enumerate(mapping) if k >= 0}
    candidates: Iterable[int] = range(len(blocks))
    if len(blocks) > 16:
        best = None
        for k in range(len(in_shape)):
            if k in mapped:
                j, step = mapped[k]
                lo, hi = start[k], start[k] + step * (out_shape[j] - 1)
            else:
                lo = hi = start[k]
            frac = (hi - lo + 1) / in_shape[k]
            if best is None or frac < best[0]:
                best = (frac, k, lo, hi)
        if best is not None and best[0] < 1:
            _, k, lo, hi = best
            if k not in indexes:
                indexes[k] = _DimIndex(blocks, k)
            candidates = sorted(indexes[k].query(lo, hi))
    out: list[Block] = []
    for bi in candidates:
        b = blocks[bi]
        cols = columns(b)
        base = b.base
        ok = True
        for k in range(len(in_shape)):
            if k not in mapped:
                y = start[k]
                o = b.offsets[k]
                if not (o <= y < o + b.lengths[k]):
                    ok = False
                    break
                base = axpy(base, y - o, cols[k])
        if not ok:
            continue
        offs: list[int] = []
        lens: list[int] = []
        ncols: list[Vec] = []
        zero = (0,) * len(b.src_shape)
        for j, (k, step) in enumerate(mapping):
            if k < 0:
                offs.append(0)
                lens.append(out_shape[j])
                ncols.append(zero)
                continue
            o, n, s0 = b.offsets[k], b.lengths[k], start[k]
            lo = max(0, _ceil_div(o - s0, step))
            hi = min(out_shape[j] - 1, (o + n - 1 - s0) // step)
            if lo > hi:
                ok = False
                break
            base = axpy(base, s0 + step * lo - o, cols[k])
            offs.append(lo)
            lens.append(hi - lo + 1)
            ncols.append(scaled(cols[k], step))
        if ok:
            out.append(make_block(b, tuple(offs), tuple(lens), base, ncols))
    return out


def _view_result(r: RegionTensor, meta_out: Any, probe_out: Any, indexes: dict[int, _DimIndex]) -> RegionTensor:
    if meta_out.dtype != r._rdtype:
        raise UnsupportedRegionOp("a view that changes the dtype is not supported on RegionTensor")
    if meta_out.numel() == 0:
        return wrap(meta_out, ())
    start, mapping, shape = _decode_view(r._rshape, probe_out)
    return wrap(meta_out, _view_blocks(r, start, mapping, shape, indexes))


def _h_view_op(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    r, rest = self_region(func, args, kwargs)
    if func is torch.Tensor.expand_as:  # the other tensor only lends its shape
        rest = tuple(meta_of(a) if isinstance(a, RegionTensor) else a for a in rest)
        kwargs = {k: meta_of(v) if isinstance(v, RegionTensor) else v for k, v in kwargs.items()}
    else:
        no_real_tensors(func, [*rest, *kwargs.values()])
    if any(isinstance(a, torch.dtype) for a in (*rest, *kwargs.values())):
        raise UnsupportedRegionOp(f"{op_name(func)} with a dtype is not supported on RegionTensor")
    meta_out = run_meta(func, (meta_of(r), *rest), kwargs)
    probe = torch.empty(r._rshape, dtype=r._rdtype, device="meta")
    probe_out = run_meta(func, (probe, *rest), kwargs)
    indexes: dict[int, _DimIndex] = {}
    if isinstance(meta_out, torch.Tensor):
        return _view_result(r, meta_out, probe_out, indexes)
    if isinstance(meta_out, (tuple, list)):
        return type(meta_out)(_view_result(r, m, p, indexes) for m, p in zip(meta_out, probe_out, strict=True))
    raise UnsupportedRegionOp(f"{op_name(func)}: unexpected result type {type(meta_out).__name__}")


def _check_index(idx: Any) -> None:
    items = idx if isinstance(idx, tuple) else (idx,)
    for it in items:
        if it is None or it is Ellipsis:
            continue
        if isinstance(it, (bool, torch.Tensor)):
            raise UnsupportedRegionOp("indexing a RegionTensor with a tensor or bool is not supported")
        if isinstance(it, int):
            continue
        if isinstance(it, slice):
            for part in (it.start, it.stop, it.step):
                if part is not None and (isinstance(part, bool) or not isinstance(part, int)):
                    raise UnsupportedRegionOp("RegionTensor slices must have int bounds")
            if it.step is not None and it.step <= 0:
                raise UnsupportedRegionOp("RegionTensor slices must have a positive step")
            continue
        raise UnsupportedRegionOp(f"indexing a RegionTensor with {type(it).__name__} is not supported")


def _h_getitem(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if len(args) != 2 or kwargs or not isinstance(args[0], RegionTensor):
        raise UnsupportedRegionOp("unexpected __getitem__ call")
    _check_index(args[1])
    return _h_view_op(func, args, kwargs)


register(
    [
        torch.Tensor.transpose,
        torch.transpose,
        torch.Tensor.swapaxes,
        torch.swapaxes,
        torch.Tensor.swapdims,
        torch.swapdims,
        torch.Tensor.t,
        torch.t,
        torch.Tensor.permute,
        torch.permute,
        torch.Tensor.movedim,
        torch.movedim,
        torch.Tensor.moveaxis,
        torch.moveaxis,
        torch.Tensor.mT.__get__,  # type: ignore[attr-defined]
        torch.Tensor.T.__get__,  # type: ignore[attr-defined]
        torch.Tensor.squeeze,
        torch.squeeze,
        torch.Tensor.unsqueeze,
        torch.unsqueeze,
        torch.Tensor.split,
        torch.split,
        torch.Tensor.split_with_sizes,
        torch.split_with_sizes,
        torch.Tensor.chunk,
        torch.chunk,
        torch.Tensor.unbind,
        torch.unbind,
        torch.Tensor.narrow,
        torch.narrow,
        torch.Tensor.select,
        torch.select,
        torch.Tensor.tensor_split,
        torch.tensor_split,
        torch.Tensor.expand,
        torch.Tensor.expand_as,
        torch.broadcast_to,
        torch.Tensor.broadcast_to,
    ],
    _h_view_op,
)
HANDLERS[torch.Tensor.__getitem__] = _h_getitem
