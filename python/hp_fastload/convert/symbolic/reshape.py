"""The reshape/view handler: dims grouped where the old and new shapes agree, each block cut into the pieces that stay
affine in the source.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch

import hp_fastload.convert.symbolic.tensor as tensor_module  # MAX_BLOCKS is read at call time (tests lower it)
from hp_fastload.convert.symbolic.block import (
    Block,
    Vec,
    axpy,
    coalesce_blocks,
    columns,
    row_major_strides,
    scaled,
    sub_block,
)
from hp_fastload.convert.symbolic.tensor import (
    RegionTensor,
    UnsupportedRegionOp,
    meta_of,
    op_name,
    register,
    run_meta,
    self_region,
    wrap,
)


def _match_groups(old: list[int], new: list[int]) -> list[tuple[int, int, int, int]]:
    """Pairs of dim runs (old[i0:i1], new[j0:j1]) with equal element counts (no size-1 dims in either)."""
    groups = []
    i = j = 0
    while i < len(old):
        i0, j0 = i, j
        p, q = old[i], new[j]
        i += 1
        j += 1
        while p != q:
            if p < q:
                p *= old[i]
                i += 1
            else:
                q *= new[j]
                j += 1
        groups.append((i0, i, j0, j))
    if j != len(new):
        raise AssertionError("reshape groups do not cover the new shape")
    return groups


def _decompose(a: int, n: int, sizes: list[int], strides: Vec, m: int = 0) -> list[tuple[Vec, Vec, int]]:
    """Cut flat range [a, a+n) of a row-major box of ``sizes[m:]`` into (offsets, lengths, start) boxes."""
    if m == len(sizes) - 1:
        return [((a,), (n,), a)]
    tm = strides[m]
    q, rem = divmod(a, tm)
    if rem + n <= tm:
        return [((q, *o), (1, *ln), q * tm + s) for o, ln, s in _decompose(rem, n, sizes, strides, m + 1)]
    out: list[tuple[Vec, Vec, int]] = []
    if rem:
        head = tm - rem
        out += [((q, *o), (1, *ln), q * tm + s) for o, ln, s in _decompose(rem, head, sizes, strides, m + 1)]
        n -= head
        q += 1
    full = n // tm
    if full:
        out.append(((q,) + (0,) * (len(sizes) - m - 1), (full, *sizes[m + 1 :]), q * tm))
        q += full
        n -= full * tm
    if n:
        out += [((q, *o), (1, *ln), q * tm + s) for o, ln, s in _decompose(0, n, sizes, strides, m + 1)]
    return out


# A block restricted to one dim group, after reshape: (offsets, lengths, base delta or None, columns).
_Piece = tuple[Vec, Vec, "Vec | None", tuple[Vec, ...]]


def _group_pieces(
    o: list[int],
    ln: list[int],
    c: list[Vec],
    old_sizes: list[int],
    old_strides: Vec,
    new_sizes: list[int],
    new_strides: Vec,
    budget: int,
) -> list[_Piece]:
    last = len(old_sizes) - 1
    n = ln[last]
    gamma = c[last]
    full = n == old_sizes[last]
    k = last - 1
    while k >= 0:
        if ln[k] == 1:
            full = False
        elif full and c[k] == scaled(gamma, n):
            n *= ln[k]
            full = ln[k] == old_sizes[k]
        else:
            break
        k -= 1
    outer = [d for d in range(k + 1) if ln[d] > 1]
    runs = math.prod(ln[d] for d in outer)
    if runs > budget:
        raise UnsupportedRegionOp(
            f"reshape would cut a block into more than MAX_BLOCKS={tensor_module.MAX_BLOCKS} pieces"
        )
    a0 = sum(oo * s for oo, s in zip(o, old_strides, strict=True))
    new_cols = tuple(scaled(gamma, t) for t in new_strides)
    pieces: list[_Piece] = []
    for ts in itertools.product(*(range(ln[d]) for d in outer)):
        a = a0
        delta: Vec | None = None
        for d, t in zip(outer, ts, strict=True):
            if t:
                a += t * old_strides[d]
                delta = axpy(delta or (0,) * len(gamma), t, c[d])
        for offs, lens, st in _decompose(a, n, new_sizes, new_strides):
            dl = delta
            if st != a:
                dl = axpy(dl or (0,) * len(gamma), st - a, gamma)
            pieces.append((offs, lens, dl, new_cols))
        if len(pieces) > budget:
            raise UnsupportedRegionOp(
                f"reshape would cut a block into more than MAX_BLOCKS={tensor_module.MAX_BLOCKS} pieces"
            )
    return pieces


def _reshape_blocks(r: RegionTensor, new_shape: tuple[int, ...]) -> list[Block]:
    old_shape = r._rshape
    if math.prod(new_shape) == 0:
        return []
    if old_shape == new_shape:
        return list(r._blocks)
    keep_old = [i for i, s in enumerate(old_shape) if s != 1]
    keep_new = [j for j, s in enumerate(new_shape) if s != 1]
    old_s = [old_shape[i] for i in keep_old]
    new_s = [new_shape[j] for j in keep_new]
    groups = _match_groups(old_s, new_s)
    info = [
        (old_s[i0:i1], row_major_strides(old_s[i0:i1]), new_s[j0:j1], row_major_strides(new_s[j0:j1]))
        for i0, i1, j0, j1 in groups
    ]
    new_nd = len(new_shape)
    pos_new = {j: p for p, j in enumerate(keep_new)}
    out: list[Block] = []
    for b in r._blocks:
        cols_all = columns(b)
        o = [b.offsets[i] for i in keep_old]
        ln = [b.lengths[i] for i in keep_old]
        c = [cols_all[i] for i in keep_old]
        per_group: list[list[_Piece]] = []
        count = 1
        for (i0, i1, j0, j1), (os_, ost, ns, nst) in zip(groups, info, strict=True):
            if i1 - i0 == 1 and j1 - j0 == 1:
                per_group.append([((o[i0],), (ln[i0],), None, (c[i0],))])
                continue
            budget = tensor_module.MAX_BLOCKS - len(out)
            pieces = _group_pieces(o[i0:i1], ln[i0:i1], c[i0:i1], os_, ost, ns, nst, budget)
            per_group.append(pieces)
            count *= len(pieces)
        if len(out) + count > tensor_module.MAX_BLOCKS:
            raise UnsupportedRegionOp(f"reshape would need more than MAX_BLOCKS={tensor_module.MAX_BLOCKS} blocks")
        zero = (0,) * len(b.src_shape)
        for combo in itertools.product(*per_group):
            offs_k: list[int] = []
            lens_k: list[int] = []
            cols_k: list[Vec] = []
            base = b.base
            for offs, lens, dl, ncols in combo:
                offs_k.extend(offs)
                lens_k.extend(lens)
                cols_k.extend(ncols)
                if dl is not None:
                    base = tuple(x + y for x, y in zip(base, dl, strict=True))
            if len(keep_new) == new_nd:
                offsets, lengths, cols = tuple(offs_k), tuple(lens_k), cols_k
            else:
                offsets = tuple(offs_k[pos_new[j]] if j in pos_new else 0 for j in range(new_nd))
                lengths = tuple(lens_k[pos_new[j]] if j in pos_new else 1 for j in range(new_nd))
                cols = [cols_k[pos_new[j]] if j in pos_new else zero for j in range(new_nd)]
            out.append(sub_block(b, offsets, lengths, base, cols))
    return coalesce_blocks(out, new_nd)


def _h_reshape(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    r, rest = self_region(func, args, kwargs)
    if any(isinstance(a, torch.dtype) for a in (*rest, *kwargs.values())):
        raise UnsupportedRegionOp(f"{op_name(func)} with a dtype (reinterpreting bytes) is not supported")
    others = [a for a in (*rest, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if others and func not in (torch.Tensor.reshape_as, torch.Tensor.view_as):
        raise UnsupportedRegionOp(f"{op_name(func)}: tensor arguments are not supported on RegionTensor")
    rest = tuple(meta_of(a) if isinstance(a, RegionTensor) else a for a in rest)
    kw = {k: meta_of(v) if isinstance(v, RegionTensor) else v for k, v in kwargs.items()}
    meta = run_meta(func, (meta_of(r), *rest), kw)
    if not isinstance(meta, torch.Tensor) or meta.dtype != r._rdtype:
        raise UnsupportedRegionOp(f"{op_name(func)}: unexpected result")
    return wrap(meta, _reshape_blocks(r, tuple(meta.shape)))


register(
    [
        torch.Tensor.reshape,
        torch.reshape,
        torch.Tensor.view,
        torch.Tensor.reshape_as,
        torch.Tensor.view_as,
        torch.Tensor.flatten,
        torch.flatten,
        torch.Tensor.unflatten,
        torch.unflatten,
        torch.Tensor.ravel,
        torch.ravel,
    ],
    _h_reshape,
)
