"""The cat/stack handlers: inputs' blocks shifted along the joined dim, casts to the promoted dtype as post-ops."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

import hp_fastload.convert.symbolic.tensor as tensor_module  # MAX_BLOCKS is read at call time (tests lower it)
from hp_fastload.convert.symbolic.block import Block, block_with, coalesce_blocks, raw_block
from hp_fastload.convert.symbolic.post import PostOp
from hp_fastload.convert.symbolic.tensor import RegionTensor, UnsupportedRegionOp, op_name, register, wrap


def _cat_args(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[RegionTensor], int]:
    kwargs = dict(kwargs)
    kwargs.pop("out", None)
    if args:
        tensors, rest = args[0], args[1:]
    elif "tensors" in kwargs:
        tensors, rest = kwargs.pop("tensors"), ()
    else:
        raise UnsupportedRegionOp(f"{op_name(func)}: missing tensors")
    dim: Any = 0
    if rest:
        if len(rest) > 1:
            raise UnsupportedRegionOp(f"{op_name(func)}: unexpected arguments")
        dim = rest[0]
    for key in ("dim", "axis"):
        if key in kwargs:
            dim = kwargs.pop(key)
    if kwargs or isinstance(dim, bool) or not isinstance(dim, int):
        raise UnsupportedRegionOp(f"{op_name(func)}: unsupported arguments")
    if not isinstance(tensors, (list, tuple)):
        raise UnsupportedRegionOp(f"{op_name(func)}: expected a list of tensors")
    if not all(isinstance(t, RegionTensor) for t in tensors):
        raise UnsupportedRegionOp(f"{op_name(func)} mixing RegionTensors with other tensors is not supported")
    return list(tensors), dim


def _shift(b: Block, dim: int, by: int, post: tuple[PostOp, ...]) -> Block:
    if by == 0 and post is b.post:
        return b
    offs = list(b.offsets)
    offs[dim] += by
    return block_with(b, offsets=tuple(offs), post=post)


def _cast_post(b: Block, cast: PostOp | None) -> tuple[PostOp, ...]:
    return b.post if cast is None else (*b.post, cast)


def _promoted(tensors: Sequence[RegionTensor]) -> torch.dtype:
    dtype = tensors[0]._rdtype
    for t in tensors[1:]:
        if t._rdtype != dtype:
            dtype = torch.promote_types(dtype, t._rdtype)
    return dtype


def _norm_dim(dim: int, nd: int) -> int:
    if not -nd <= dim < nd:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-nd}, {nd - 1}], but got {dim})")
    return dim % nd


def _h_cat(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    tensors, dim = _cat_args(func, args, kwargs)
    if not tensors:
        raise RuntimeError("torch.cat(): expected a non-empty list of Tensors")
    dtype = _promoted(tensors)
    parts = [t for t in tensors if t._rshape != (0,)]  # legacy 1-D empty inputs are skipped by torch
    if not parts:
        return wrap(torch.empty((0,), dtype=dtype, device="meta"), ())
    ref = parts[0]._rshape
    nd = len(ref)
    if nd == 0:
        raise RuntimeError("zero-dimensional tensor (at position 0) cannot be concatenated")
    dim = _norm_dim(dim, nd)
    total = 0
    for i, t in enumerate(parts):
        shape = t._rshape
        if len(shape) != nd:
            raise RuntimeError(
                f"Tensors must have same number of dimensions: got {nd} and {len(shape)} (tensor number {i})"
            )
        if shape[:dim] != ref[:dim] or shape[dim + 1 :] != ref[dim + 1 :]:
            raise RuntimeError(f"Sizes of tensors must match except in dimension {dim}: {ref} and {shape}")
        total += shape[dim]
    out_shape = (*ref[:dim], total, *ref[dim + 1 :])
    meta = torch.empty(out_shape, dtype=dtype, device="meta")
    out: list[Block] = []
    pos = 0
    if meta.numel():
        for t in parts:
            cast = PostOp("cast", dtype) if t._rdtype != dtype else None
            for b in t._blocks:
                out.append(_shift(b, dim, pos, _cast_post(b, cast)))
            pos += t._rshape[dim]
            if len(out) > tensor_module.MAX_BLOCKS:
                raise UnsupportedRegionOp(f"cat would need more than MAX_BLOCKS={tensor_module.MAX_BLOCKS} blocks")
    return wrap(meta, coalesce_blocks(out, nd))


def _h_stack(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    tensors, dim = _cat_args(func, args, kwargs)
    if not tensors:
        raise RuntimeError("stack expects a non-empty TensorList")
    ref = tensors[0]._rshape
    for i, t in enumerate(tensors):
        if t._rshape != ref:
            raise RuntimeError(
                f"stack expects each tensor to be equal size, but got {list(ref)} at entry 0 and "
                f"{list(t._rshape)} at entry {i}"
            )
    nd = len(ref) + 1
    dim = _norm_dim(dim, nd)
    dtype = _promoted(tensors)
    meta = torch.empty((*ref[:dim], len(tensors), *ref[dim:]), dtype=dtype, device="meta")
    out: list[Block] = []
    if meta.numel():
        for i, t in enumerate(tensors):
            cast = PostOp("cast", dtype) if t._rdtype != dtype else None
            for b in t._blocks:
                # A new size-1 dim with a zero coefficient reads the same elements: no validation needed.
                out.append(
                    raw_block(
                        (*b.offsets[:dim], i, *b.offsets[dim:]),
                        (*b.lengths[:dim], 1, *b.lengths[dim:]),
                        b.source,
                        b.base,
                        tuple((*row[:dim], 0, *row[dim:]) for row in b.coeff),
                        _cast_post(b, cast),
                        b.src_dtype,
                        b.src_shape,
                    )
                )
            if len(out) > tensor_module.MAX_BLOCKS:
                raise UnsupportedRegionOp(f"stack would need more than MAX_BLOCKS={tensor_module.MAX_BLOCKS} blocks")
    return wrap(meta, coalesce_blocks(out, nd))


register([torch.cat, torch.concat, torch.concatenate], _h_cat)


register([torch.stack], _h_stack)
