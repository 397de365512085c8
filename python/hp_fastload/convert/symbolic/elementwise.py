"""Handlers for ops that keep every element where it is: identity-like ops, casts, and arithmetic with Python scalars
(recorded as post-ops).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._C import DisableTorchFunctionSubclass

from hp_fastload.convert.symbolic.block import block_with
from hp_fastload.convert.symbolic.post import SCALAR_TYPES, PostOp
from hp_fastload.convert.symbolic.tensor import (
    HANDLERS,
    Handler,
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


def _h_same_layout(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """contiguous / clone / positive: same values, meta result from torch."""
    r, rest = self_region(func, args, kwargs)
    no_real_tensors(func, [*rest, *kwargs.values()])
    meta = run_meta(func, (meta_of(r), *rest), kwargs)
    return wrap(meta, r._blocks)


def _h_identity(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """detach / cpu / cuda: the values do not change; the region stays on the meta device."""
    r, rest = self_region(func, args, kwargs)
    no_real_tensors(func, [*rest, *kwargs.values()])
    return r


register(
    [torch.Tensor.contiguous, torch.Tensor.clone, torch.clone, torch.Tensor.positive, torch.positive],
    _h_same_layout,
)


register([torch.Tensor.detach, torch.detach, torch.Tensor.cpu, torch.Tensor.cuda], _h_identity)


def _cast(r: RegionTensor, dtype: torch.dtype | None) -> RegionTensor:
    if dtype is None or dtype == r._rdtype:
        return r
    with DisableTorchFunctionSubclass():
        meta = meta_of(r).to(dtype)
    op = PostOp("cast", dtype)
    return wrap(meta, [block_with(b, post=(*b.post, op)) for b in r._blocks])


def _h_to(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    r, rest = self_region(func, args, kwargs)
    if any(isinstance(a, torch.Tensor) for a in (*rest, *kwargs.values())):
        raise UnsupportedRegionOp("RegionTensor.to(other_tensor) is not supported")
    kwargs = dict(kwargs)
    kwargs.pop("copy", None)
    try:
        _device, dtype, _non_blocking, _fmt = torch._C._nn._parse_to(*rest, **kwargs)
    except TypeError as exc:
        raise UnsupportedRegionOp(f"RegionTensor.to: {exc}") from exc
    return _cast(r, dtype)


def _fixed_cast(dtype: torch.dtype) -> Handler:
    def handler(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        r, rest = self_region(func, args, kwargs)
        if rest or any(k != "memory_format" for k in kwargs):
            raise UnsupportedRegionOp(f"{op_name(func)}: unexpected arguments")
        return _cast(r, dtype)

    return handler


HANDLERS[torch.Tensor.to] = _h_to
for _meth, _dt in [
    (torch.Tensor.float, torch.float32),
    (torch.Tensor.double, torch.float64),
    (torch.Tensor.half, torch.float16),
    (torch.Tensor.bfloat16, torch.bfloat16),
    (torch.Tensor.int, torch.int32),
    (torch.Tensor.long, torch.int64),
    (torch.Tensor.short, torch.int16),
    (torch.Tensor.char, torch.int8),
    (torch.Tensor.byte, torch.uint8),
    (torch.Tensor.bool, torch.bool),
]:
    HANDLERS[_meth] = _fixed_cast(_dt)


def _append_post(r: RegionTensor, meta: torch.Tensor, op: PostOp) -> RegionTensor:
    return wrap(meta, [block_with(b, post=(*b.post, op)) for b in r._blocks])


def _scalar_result_dtype(func: Any, r: RegionTensor, rest: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.dtype:
    """Result dtype of an elementwise op, from the same op on a 0-d CPU tensor (torch validates the arguments;
    a meta run of an elementwise op goes through Python decompositions and costs milliseconds)."""
    with DisableTorchFunctionSubclass():
        return func(torch.empty((), dtype=r._rdtype), *rest, **kwargs).dtype


def _elementwise_meta(r: RegionTensor, dtype: torch.dtype) -> torch.Tensor:
    """The meta result of an elementwise op on ``r``: ``empty_like`` gives TensorIterator's output layout."""
    with DisableTorchFunctionSubclass():
        return torch.empty_like(meta_of(r), dtype=dtype)


def _scalar_handler(kind: str, *, reflected: bool = False) -> Handler:
    def handler(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not args or not isinstance(args[0], RegionTensor):
            raise UnsupportedRegionOp(f"{op_name(func)}: a RegionTensor must be the first operand")
        r = args[0]
        if len(args) == 2 and "other" not in kwargs:
            other = args[1]
        elif len(args) == 1 and "other" in kwargs:
            other = kwargs["other"]
        else:
            raise UnsupportedRegionOp(f"{op_name(func)}: unexpected arguments")
        extra = {k: v for k, v in kwargs.items() if k != "other"}
        if isinstance(other, torch.Tensor):
            raise UnsupportedRegionOp(f"{op_name(func)}: elementwise ops between tensors are not supported")
        if not isinstance(other, SCALAR_TYPES):
            raise UnsupportedRegionOp(f"{op_name(func)}: only Python bool/int/float scalars are supported")
        k = kind
        alpha = extra.pop("alpha", 1)
        if alpha != 1 or type(alpha) is float:
            raise UnsupportedRegionOp(f"{op_name(func)}(alpha=...) is not supported on RegionTensor")
        if "rounding_mode" in extra:
            mode = extra.pop("rounding_mode")
            if mode is not None:
                if kind != "div" or mode not in ("floor", "trunc"):
                    raise UnsupportedRegionOp(f"{op_name(func)}(rounding_mode={mode!r}) is not supported")
                k = f"div_{mode}"
        if extra:
            raise UnsupportedRegionOp(f"{op_name(func)}: unexpected arguments {sorted(extra)}")
        dtype = _scalar_result_dtype(func, r, (other,), {k2: v for k2, v in kwargs.items() if k2 != "other"})
        return _append_post(r, _elementwise_meta(r, dtype), PostOp(k, other))

    return handler


def _h_neg(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    r, rest = self_region(func, args, kwargs)
    if rest or kwargs:
        raise UnsupportedRegionOp(f"{op_name(func)}: unexpected arguments")
    dtype = _scalar_result_dtype(func, r, (), {})
    return _append_post(r, _elementwise_meta(r, dtype), PostOp("neg"))


register(
    [torch.Tensor.add, torch.add, torch.Tensor.__add__, torch.Tensor.__radd__],
    _scalar_handler("add"),
)


register(
    [torch.Tensor.sub, torch.sub, torch.Tensor.subtract, torch.subtract, torch.Tensor.__sub__],
    _scalar_handler("sub"),
)


register([torch.rsub, torch.Tensor.__rsub__], _scalar_handler("rsub"))


register(
    [
        torch.Tensor.mul,
        torch.mul,
        torch.Tensor.multiply,
        torch.multiply,
        torch.Tensor.__mul__,
        torch.Tensor.__rmul__,
    ],
    _scalar_handler("mul"),
)


register(
    [
        torch.Tensor.div,
        torch.div,
        torch.Tensor.divide,
        torch.divide,
        torch.Tensor.true_divide,
        torch.true_divide,
        torch.Tensor.__truediv__,
    ],
    _scalar_handler("div"),
)


register([torch.Tensor.__rdiv__], _scalar_handler("rdiv"))


register(
    [torch.Tensor.__floordiv__, torch.Tensor.floor_divide, torch.floor_divide],
    _scalar_handler("floordiv"),
)


register([torch.Tensor.__rfloordiv__], _scalar_handler("rfloordiv"))


register(
    [torch.Tensor.neg, torch.neg, torch.Tensor.negative, torch.negative, torch.Tensor.__neg__],
    _h_neg,
)
