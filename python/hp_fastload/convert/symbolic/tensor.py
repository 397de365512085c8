"""``RegionTensor``: the data-less tensor subclass that stands in for a real tensor while a conversion runs, the
dispatcher that routes each torch call to its handler (or refuses it with ``UnsupportedRegionOp``), the queries
answered from the meta tensor underneath, and ``materialize``, the reference evaluation of a region from whole
source tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextvars import ContextVar
from typing import Any

import torch
from torch._C import DisableTorchFunctionSubclass

from hp_fastload.convert.symbolic.block import Block, columns, identity_rows, leaf_meta, raw_block
from hp_fastload.convert.symbolic.post import apply_post

MAX_BLOCKS = 65536


"""Most blocks one RegionTensor may hold; more raises :class:`UnsupportedRegionOp` (read at call time)."""


class UnsupportedRegionOp(TypeError):
    """An operation a RegionTensor cannot describe; the conversion must run on real tensors instead."""


class RegionTensor(torch.Tensor):
    """A data-less tensor whose elements are described by :class:`Block` s (see the module docstring).

    Build leaves with :meth:`leaf` and run conversion code on them; supported ops return RegionTensors, and
    anything else raises :class:`UnsupportedRegionOp`.  Shape, dtype, strides and device (``meta``) are those
    of a meta tensor that went through the same ops.
    """

    _blocks: tuple[Block, ...]
    _rshape: tuple[int, ...]
    _rdtype: torch.dtype
    #: set by the op memo on its results: (the memo, the layer, the key part); see ``convert.symbolic.memo``
    _memo_frozen: tuple[Any, Any, Any]

    @staticmethod
    def leaf(source: str, shape: Sequence[int], dtype: torch.dtype) -> RegionTensor:
        """A region equal to the whole checkpoint tensor ``source`` (one block, identity map)."""
        shp = tuple(int(s) for s in shape)
        # Shared by leaves of one shape (each wrap is a new tensor object); raises on a negative size, as
        # torch.empty does.
        meta = leaf_meta(shp, dtype)
        if math.prod(shp) == 0:
            return wrap(meta, ())
        zeros = (0,) * len(shp)
        # The identity block of a valid shape is valid by construction: no per-leaf check (a stacked-experts
        # trace builds ~10^3 leaves).
        return wrap(meta, (raw_block(zeros, shp, source, zeros, identity_rows(len(shp)), (), dtype, shp),))

    @staticmethod
    def from_blocks(shape: Sequence[int], dtype: torch.dtype, blocks: Iterable[Block]) -> RegionTensor:
        """A region from explicit blocks; checks that they tile ``shape`` and produce ``dtype``."""
        shp = tuple(int(s) for s in shape)
        blocks = tuple(blocks)
        region = wrap(torch.empty(shp, dtype=dtype, device="meta"), blocks)
        region.validate()
        return region

    @property
    def blocks(self) -> tuple[Block, ...]:
        """The blocks tiling this tensor (sorted by offsets after a reshape, cat or stack)."""
        return self._blocks

    @property
    def sources(self) -> tuple[str, ...]:
        """Checkpoint keys this region reads, in first-use order."""
        return tuple(dict.fromkeys(b.source for b in self._blocks))

    def validate(self) -> None:
        """Check that the blocks tile the tensor exactly and each produces this tensor's dtype."""
        shape = self._rshape
        total = 0
        for b in self._blocks:
            if b.ndim != len(shape) or any(o + n > s for o, n, s in zip(b.offsets, b.lengths, shape, strict=True)):
                raise ValueError(f"block {b} does not fit in shape {shape}")
            if b.dtype != self._rdtype:
                raise ValueError(f"block {b} produces {b.dtype}, tensor is {self._rdtype}")
            total += b.numel
        if total != math.prod(shape):
            raise ValueError(f"blocks cover {total} elements, tensor has {math.prod(shape)}")
        if len(self._blocks) <= 4096 and math.prod(shape) <= 1 << 22:
            seen = torch.zeros(shape, dtype=torch.int32)
            for b in self._blocks:
                seen[tuple(slice(o, o + n) for o, n in zip(b.offsets, b.lengths, strict=True))] += 1
            if not bool((seen == 1).all()):
                raise ValueError("blocks overlap")

    def materialize(self, sources: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """See :func:`materialize`."""
        return materialize(self, sources)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        srcs = self.sources
        shown = ", ".join(repr(s) for s in srcs[:3]) + (", ..." if len(srcs) > 3 else "")
        return (
            f"RegionTensor(shape={self._rshape}, dtype={self._rdtype}, blocks={len(self._blocks)}, sources=[{shown}])"
        )

    def __format__(self, format_spec: str) -> str:
        return format(repr(self), format_spec)

    def __deepcopy__(self, memo: dict[int, Any]) -> RegionTensor:
        return wrap(meta_of(self), self._blocks)

    def __reduce_ex__(self, proto: Any) -> tuple[Any, ...]:
        return (_rebuild, (self._rshape, self._rdtype, self._blocks))

    @classmethod
    def __torch_function__(
        cls,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return _dispatch(func, tuple(args), kwargs or {})


def _operator(name: str) -> Callable[[RegionTensor, Any], Any]:
    base = getattr(torch.Tensor, name)

    def method(self: RegionTensor, other: Any) -> Any:
        return _dispatch(base, (self, other), {})

    method.__name__ = method.__qualname__ = name
    return method


# torch turns a TypeError raised inside a binary operator into NotImplemented, so Python would answer with
# its own "unsupported operand" TypeError, or silently fall back (identity for ==, ``x = x + 1`` for +=).
# Route the operators straight to the dispatcher so that a refusal surfaces as UnsupportedRegionOp.
OPERATORS = [
    *("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__"),
    *(
        "__rdiv__",
        "__floordiv__",
        "__rfloordiv__",
        "__mod__",
        "__rmod__",
        "__pow__",
        "__rpow__",
        "__matmul__",
    ),
    *("__rmatmul__", "__and__", "__rand__", "__or__", "__ror__", "__xor__", "__rxor__", "__lshift__"),
    *("__rlshift__", "__rshift__", "__rrshift__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__"),
    # In-place forms: without these, Python would fall back to ``x = x + 1`` and silently drop the aliasing.
    *(
        "__iadd__",
        "__isub__",
        "__imul__",
        "__itruediv__",
        "__idiv__",
        "__ifloordiv__",
        "__imod__",
        "__ipow__",
    ),
    *("__imatmul__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"),
]


for _op_name in OPERATORS:
    if hasattr(torch.Tensor, _op_name):
        setattr(RegionTensor, _op_name, _operator(_op_name))
RegionTensor.__hash__ = torch.Tensor.__hash__  # type: ignore[method-assign]


def _rebuild(shape: tuple[int, ...], dtype: torch.dtype, blocks: tuple[Block, ...]) -> RegionTensor:
    return wrap(torch.empty(shape, dtype=dtype, device="meta"), blocks)


def wrap(meta: torch.Tensor, blocks: Iterable[Block]) -> RegionTensor:
    blocks = tuple(blocks)
    if len(blocks) > MAX_BLOCKS:
        raise UnsupportedRegionOp(f"a RegionTensor would need {len(blocks)} blocks (MAX_BLOCKS={MAX_BLOCKS})")
    with DisableTorchFunctionSubclass():
        out = torch.Tensor._make_subclass(RegionTensor, meta)
        out._rshape = tuple(meta.shape)
        out._rdtype = meta.dtype
    out._blocks = blocks
    return out


def meta_of(r: RegionTensor) -> torch.Tensor:
    """A plain meta tensor with ``r``'s shape, dtype and strides."""
    with DisableTorchFunctionSubclass():
        return r.as_strided(r.size(), r.stride(), r.storage_offset())


def op_name(func: Any) -> str:
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    return str(name)


def run_meta(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    with DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


Handler = Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]


HANDLERS: dict[Any, Handler] = {}


PASSTHROUGH: set[Any] = set()


#: The op memo in effect (``convert.symbolic.memo``), or None.
OP_MEMO: ContextVar[Any] = ContextVar("hp_fastload_op_memo", default=None)


def _dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    memo = OP_MEMO.get()
    if memo is None or func in PASSTHROUGH:
        return _run(func, args, kwargs)
    found = memo.key(func, args, kwargs)
    if found is None:
        return _run(func, args, kwargs)
    hit = memo.get(*found)
    if hit is not None:
        return hit
    out = _run(func, args, kwargs)
    memo.put(*found, out)
    return out


def _run(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if func in PASSTHROUGH:
        out = run_meta(func, args, kwargs)
        if isinstance(out, torch.Tensor):
            raise UnsupportedRegionOp(f"{op_name(func)} would expose the meta tensor under a RegionTensor")
        return out
    handler = HANDLERS.get(func)
    if handler is None:
        raise UnsupportedRegionOp(f"{op_name(func)} is not supported on RegionTensor")
    if kwargs.get("out") is not None:
        raise UnsupportedRegionOp(f"{op_name(func)}(out=...) is not supported on RegionTensor")
    return handler(func, args, kwargs)


def register(funcs: Iterable[Any], handler: Handler) -> None:
    for f in funcs:
        HANDLERS[f] = handler


def self_region(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[RegionTensor, tuple[Any, ...]]:
    """Split ``args`` into the region operated on and the other positional args."""
    if args and isinstance(args[0], RegionTensor):
        return args[0], args[1:]
    for key in ("input", "self"):
        if isinstance(kwargs.get(key), RegionTensor):
            return kwargs.pop(key), args
    raise UnsupportedRegionOp(f"{op_name(func)}: a RegionTensor must be the tensor operated on")


def no_real_tensors(func: Any, values: Iterable[Any]) -> None:
    for v in values:
        if isinstance(v, torch.Tensor) or (
            isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v)
        ):
            raise UnsupportedRegionOp(f"{op_name(func)}: tensor arguments are not supported on RegionTensor")


for _name in (
    "shape",
    "dtype",
    "device",
    "ndim",
    "layout",
    "requires_grad",
    "is_cuda",
    "is_cpu",
    "is_meta",
    "is_sparse",
    "is_quantized",
    "is_nested",
    "is_mkldnn",
    "is_leaf",
    "grad",
    "grad_fn",
    "itemsize",
    "nbytes",
    "names",
    "_base",
):
    _attr = getattr(torch.Tensor, _name, None)
    if _attr is not None and hasattr(_attr, "__get__"):
        PASSTHROUGH.add(_attr.__get__)


PASSTHROUGH.update(
    [
        torch.Tensor.size,
        torch.Tensor.dim,
        torch.Tensor.ndimension,
        torch.Tensor.numel,
        torch.numel,
        torch.Tensor.nelement,
        torch.Tensor.element_size,
        torch.Tensor.stride,
        torch.Tensor.storage_offset,
        torch.Tensor.is_contiguous,
        torch.Tensor.is_floating_point,
        torch.is_floating_point,
        torch.Tensor.is_complex,
        torch.is_complex,
        torch.Tensor.is_signed,
        torch.Tensor.get_device,
        torch.Tensor.__len__,
        torch.Tensor.__hash__,
        torch.is_tensor,
    ]
)


def materialize(region: RegionTensor, sources: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The value ``region`` describes, computed from whole source tensors (a new CPU-or-source-device tensor).

    Args:
        region: the traced tensor.
        sources: checkpoint key -> the whole checkpoint tensor (any strides; shape and dtype must match the
            blocks).

    Each block is read with an ``as_strided`` view of its source, run through :func:`apply_post`, and copied
    into an output of ``region.dtype``.
    """
    shape = region._rshape
    device = None
    for b in region._blocks:
        device = sources[b.source].device
        break
    out = torch.empty(shape, dtype=region._rdtype, device=device)
    with DisableTorchFunctionSubclass():
        for b in region._blocks:
            src = sources[b.source]
            if tuple(src.shape) != b.src_shape or src.dtype != b.src_dtype:
                raise ValueError(
                    f"source {b.source!r} is {tuple(src.shape)} {src.dtype}, block expects {b.src_shape} {b.src_dtype}"
                )
            sstr = src.stride()
            strides = [sum(c * s for c, s in zip(col, sstr, strict=True)) for col in columns(b)]
            offset = src.storage_offset() + sum(x * s for x, s in zip(b.base, sstr, strict=True))
            view = apply_post(src.as_strided(b.lengths, strides, offset), b.post)
            if view.dtype != out.dtype:
                raise AssertionError(f"block produces {view.dtype}, region is {out.dtype}")
            out[tuple(slice(o, o + n) for o, n in zip(b.offsets, b.lengths, strict=True))] = view
    return out
