"""Symbolic tensors that record, for every element, which checkpoint element it comes from.

A :class:`RegionTensor` stands in for a real tensor while a checkpoint conversion (transformers'
``ConversionOps`` or any similar code) runs: it has the shape, dtype and strides torch would give the real
result, no data, and a tuple of :class:`Block` s that tile it.  Each block is a box of the tensor whose
elements are read from one checkpoint tensor through an affine index map, followed by elementwise
post-ops (casts and arithmetic with Python scalars)::

    source_index = block.base + block.coeff @ (x - block.offsets)     for x in the box
    value        = apply_post(source[source_index], block.post)

``source_index`` is a multi-index in the checkpoint tensor's own shape and every index a block touches is in
bounds, dim by dim.  A map that is affine only in the source's *flat* offset (flattening several source dims
into one) is therefore cut into one block per contiguous run, e.g. ``leaf(8, 6).reshape(48)`` has 8 blocks.

This module owns:

* the representation (:class:`RegionTensor`, :class:`Block`, :class:`PostOp`);
* tracing of layout ops through ``__torch_function__`` (reshape/view, transpose/permute, squeeze/unsqueeze,
  split/chunk/unbind/narrow/select, basic indexing, expand, cat/stack, casts, scalar arithmetic). torch itself
  validates the arguments and fixes the result's shape, dtype and strides: views and reshapes run on meta
  tensors, elementwise ops on a 0-d CPU tensor (their meta kernels cost milliseconds), and cat/stack apply
  torch's shape and promotion rules directly (their meta kernels cost ~8 us per input);
* the reference evaluation of a region (:func:`materialize`, :func:`apply_post`).

It does not own: reading bytes, intersecting blocks with a rank's local shard, deciding when a conversion is
deferred (the planner does that when an op raises :class:`UnsupportedRegionOp`), or turning blocks into
contiguous byte runs.

``RegionTensor`` subclasses ``torch.Tensor`` (a data-less meta tensor underneath) so that
``isinstance(x, torch.Tensor)`` checks in conversion code take the same branch as with real tensors (e.g.
``PermuteForRope`` after ``Chunk``).  Anything not known to be describable raises :class:`UnsupportedRegionOp`
(a ``TypeError``): ops between two tensors, value-dependent ops, in-place ops, reductions, advanced indexing.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch._C import DisableTorchFunctionSubclass

__all__ = [
    "MAX_BLOCKS",
    "Block",
    "PostOp",
    "RegionTensor",
    "UnsupportedRegionOp",
    "apply_post",
    "materialize",
    "row_major_strides",
    "post_dtype",
]

MAX_BLOCKS = 65536
"""Most blocks one RegionTensor may hold; more raises :class:`UnsupportedRegionOp` (read at call time)."""


class UnsupportedRegionOp(TypeError):
    """An operation a RegionTensor cannot describe; the conversion must run on real tensors instead."""


# ------------------------------------------------------------------------------------------------------------
# Post-ops
# ------------------------------------------------------------------------------------------------------------

_SCALAR_TYPES = (bool, int, float)


def _op_cast(t: torch.Tensor, v: Any) -> torch.Tensor:
    return t.to(v)


def _op_rdiv(t: torch.Tensor, v: Any) -> torch.Tensor:
    # Exactly what ``Tensor.__rdiv__`` / ``__rtruediv__`` does.
    return t.reciprocal() * v


_POST_FUNCS: dict[str, Callable[[torch.Tensor, Any], torch.Tensor]] = {
    "cast": _op_cast,
    "add": lambda t, v: t.add(v),
    "sub": lambda t, v: t.sub(v),
    "rsub": lambda t, v: torch.rsub(t, v),
    "mul": lambda t, v: t.mul(v),
    "div": lambda t, v: t.div(v),
    "div_floor": lambda t, v: t.div(v, rounding_mode="floor"),
    "div_trunc": lambda t, v: t.div(v, rounding_mode="trunc"),
    "rdiv": _op_rdiv,
    "floordiv": lambda t, v: torch.floor_divide(t, v),
    "rfloordiv": lambda t, v: torch.floor_divide(v, t),
    "neg": lambda t, v: t.neg(),
}


@dataclasses.dataclass(frozen=True, eq=False)
class PostOp:
    """One elementwise operation applied to the values read from the checkpoint.

    ``kind`` is one of ``cast`` (``value`` is a ``torch.dtype``), ``add`` / ``sub`` / ``mul`` / ``div``
    (``t op value``), ``rsub`` (``value - t``), ``rdiv`` (``t.reciprocal() * value``, which is what torch's
    ``value / t`` computes), ``div_floor`` / ``div_trunc`` (``t.div(value, rounding_mode=...)``),
    ``floordiv`` (``torch.floor_divide(t, value)``), ``rfloordiv`` (``torch.floor_divide(value, t)``) and
    ``neg`` (``-t``, no value).  ``value`` keeps its Python type (``1`` and ``1.0`` promote differently), and
    equality takes the type into account.
    """

    kind: str
    value: Any = None

    def __post_init__(self) -> None:
        if self.kind not in _POST_FUNCS:
            raise ValueError(f"unknown post-op kind {self.kind!r}")
        if self.kind == "cast":
            if not isinstance(self.value, torch.dtype):
                raise ValueError(f"cast post-op needs a torch.dtype, got {self.value!r}")
        elif self.kind == "neg":
            if self.value is not None:
                raise ValueError("neg post-op takes no value")
        elif not isinstance(self.value, _SCALAR_TYPES):
            raise ValueError(f"{self.kind} post-op needs a Python bool/int/float, got {self.value!r}")

    def _key(self) -> tuple[str, type, str]:
        return (self.kind, type(self.value), repr(self.value))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PostOp) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        """Apply this op to a real tensor with the torch call the traced program made."""
        return _POST_FUNCS[self.kind](t, self.value)


def apply_post(tensor: torch.Tensor, post: Iterable[PostOp]) -> torch.Tensor:
    """Apply ``post`` in order with real torch ops.

    The result is bit-identical to what the traced program computed for these elements: each op runs in the
    dtype torch's promotion gives at that point (values are computed in the source dtype, then cast).
    Elementwise ops on a sub-box give the same values as on the whole tensor.
    """
    for op in post:
        tensor = op.apply(tensor)
    return tensor


_POST_DTYPE_CACHE: dict[tuple[torch.dtype, tuple[PostOp, ...]], torch.dtype] = {}


def post_dtype(src_dtype: torch.dtype, post: tuple[PostOp, ...]) -> torch.dtype:
    """The dtype that ``apply_post`` produces from a tensor of ``src_dtype``."""
    if not post:
        return src_dtype
    key = (src_dtype, post)
    got = _POST_DTYPE_CACHE.get(key)
    if got is None:
        got = apply_post(torch.empty((), dtype=src_dtype, device="meta"), post).dtype
        if len(_POST_DTYPE_CACHE) < 4096:
            _POST_DTYPE_CACHE[key] = got
    return got


# ------------------------------------------------------------------------------------------------------------
# Blocks
# ------------------------------------------------------------------------------------------------------------

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
        return tuple(_cols(self))

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
        return tuple(sum(c * s for c, s in zip(col, sstr, strict=True)) for col in _cols(self))

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


def _raw(
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


def _with(
    b: Block, *, offsets: Vec | None = None, source: str | None = None, post: tuple[PostOp, ...] | None = None
) -> Block:
    """``b`` with some fields replaced, unvalidated: moving a block inside the region, renaming its source
    (to a tensor of the same shape) or appending post-ops does not change which source elements it reads."""
    return _raw(
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
def _identity(nd: int) -> tuple[Vec, ...]:
    return tuple(tuple(int(i == j) for j in range(nd)) for i in range(nd))


@functools.lru_cache(maxsize=256)
def _leaf_meta(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A meta tensor of ``shape`` and ``dtype``, for leaves to wrap (never handed out itself)."""
    return torch.empty(shape, dtype=dtype, device="meta")


def _cols(b: Block) -> list[Vec]:
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


def _axpy(base: Vec, k: int, col: Vec) -> Vec:
    if k == 0:
        return base
    return tuple(x + k * c for x, c in zip(base, col, strict=True))


def _scale(col: Vec, k: int) -> Vec:
    return tuple(k * c for c in col)


def _mk(
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


# ------------------------------------------------------------------------------------------------------------
# RegionTensor
# ------------------------------------------------------------------------------------------------------------


class RegionTensor(torch.Tensor):
    """A data-less tensor whose elements are described by :class:`Block` s (see the module docstring).

    Build leaves with :meth:`leaf` and run conversion code on them; supported ops return RegionTensors, and
    anything else raises :class:`UnsupportedRegionOp`.  Shape, dtype, strides and device (``meta``) are those
    of a meta tensor that went through the same ops.
    """

    _blocks: tuple[Block, ...]
    _rshape: tuple[int, ...]
    _rdtype: torch.dtype

    @staticmethod
    def leaf(source: str, shape: Sequence[int], dtype: torch.dtype) -> RegionTensor:
        """A region equal to the whole checkpoint tensor ``source`` (one block, identity map)."""
        shp = tuple(int(s) for s in shape)
        # Shared by leaves of one shape (each wrap is a new tensor object); raises on a negative size, as
        # torch.empty does.
        meta = _leaf_meta(shp, dtype)
        if math.prod(shp) == 0:
            return _wrap(meta, ())
        zeros = (0,) * len(shp)
        # The identity block of a valid shape is valid by construction: no per-leaf check (a stacked-experts
        # trace builds ~10^3 leaves).
        return _wrap(meta, (_raw(zeros, shp, source, zeros, _identity(len(shp)), (), dtype, shp),))

    @staticmethod
    def from_blocks(shape: Sequence[int], dtype: torch.dtype, blocks: Iterable[Block]) -> RegionTensor:
        """A region from explicit blocks; checks that they tile ``shape`` and produce ``dtype``."""
        shp = tuple(int(s) for s in shape)
        blocks = tuple(blocks)
        region = _wrap(torch.empty(shp, dtype=dtype, device="meta"), blocks)
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

    def rename_sources(self, mapping: Mapping[str, str]) -> RegionTensor:
        """A copy whose blocks read ``mapping[source]`` instead of ``source`` (other sources unchanged).

        Lets a trace made for one layer be reused for another layer whose tensors have the same shapes.
        """
        blocks = tuple(_with(b, source=mapping[b.source]) if b.source in mapping else b for b in self._blocks)
        return _wrap(_meta(self), blocks)

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
        return _wrap(_meta(self), self._blocks)

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
_OPERATORS = [
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
for _op_name in _OPERATORS:
    if hasattr(torch.Tensor, _op_name):
        setattr(RegionTensor, _op_name, _operator(_op_name))
RegionTensor.__hash__ = torch.Tensor.__hash__  # type: ignore[method-assign]


def _rebuild(shape: tuple[int, ...], dtype: torch.dtype, blocks: tuple[Block, ...]) -> RegionTensor:
    return _wrap(torch.empty(shape, dtype=dtype, device="meta"), blocks)


def _wrap(meta: torch.Tensor, blocks: Iterable[Block]) -> RegionTensor:
    blocks = tuple(blocks)
    if len(blocks) > MAX_BLOCKS:
        raise UnsupportedRegionOp(f"a RegionTensor would need {len(blocks)} blocks (MAX_BLOCKS={MAX_BLOCKS})")
    with DisableTorchFunctionSubclass():
        out = torch.Tensor._make_subclass(RegionTensor, meta)
        out._rshape = tuple(meta.shape)
        out._rdtype = meta.dtype
    out._blocks = blocks
    return out


def _meta(r: RegionTensor) -> torch.Tensor:
    """A plain meta tensor with ``r``'s shape, dtype and strides."""
    with DisableTorchFunctionSubclass():
        return r.as_strided(r.size(), r.stride(), r.storage_offset())


def _fname(func: Any) -> str:
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    return str(name)


def _run_meta(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    with DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


# ------------------------------------------------------------------------------------------------------------
# Dispatch
# ------------------------------------------------------------------------------------------------------------

Handler = Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]
_HANDLERS: dict[Any, Handler] = {}
_PASSTHROUGH: set[Any] = set()


def _dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if func in _PASSTHROUGH:
        out = _run_meta(func, args, kwargs)
        if isinstance(out, torch.Tensor):
            raise UnsupportedRegionOp(f"{_fname(func)} would expose the meta tensor under a RegionTensor")
        return out
    handler = _HANDLERS.get(func)
    if handler is None:
        raise UnsupportedRegionOp(f"{_fname(func)} is not supported on RegionTensor")
    if kwargs.get("out") is not None:
        raise UnsupportedRegionOp(f"{_fname(func)}(out=...) is not supported on RegionTensor")
    return handler(func, args, kwargs)


def _register(funcs: Iterable[Any], handler: Handler) -> None:
    for f in funcs:
        _HANDLERS[f] = handler


def _self_region(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[RegionTensor, tuple[Any, ...]]:
    """Split ``args`` into the region operated on and the other positional args."""
    if args and isinstance(args[0], RegionTensor):
        return args[0], args[1:]
    for key in ("input", "self"):
        if isinstance(kwargs.get(key), RegionTensor):
            return kwargs.pop(key), args
    raise UnsupportedRegionOp(f"{_fname(func)}: a RegionTensor must be the tensor operated on")


def _no_real_tensors(func: Any, values: Iterable[Any]) -> None:
    for v in values:
        if isinstance(v, torch.Tensor) or (
            isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v)
        ):
            raise UnsupportedRegionOp(f"{_fname(func)}: tensor arguments are not supported on RegionTensor")


# ---- identity-like ops -------------------------------------------------------------------------------------


def _h_same_layout(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """contiguous / clone / positive: same values, meta result from torch."""
    r, rest = _self_region(func, args, kwargs)
    _no_real_tensors(func, [*rest, *kwargs.values()])
    meta = _run_meta(func, (_meta(r), *rest), kwargs)
    return _wrap(meta, r._blocks)


def _h_identity(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """detach / cpu / cuda: the values do not change; the region stays on the meta device."""
    r, rest = _self_region(func, args, kwargs)
    _no_real_tensors(func, [*rest, *kwargs.values()])
    return r


_register(
    [torch.Tensor.contiguous, torch.Tensor.clone, torch.clone, torch.Tensor.positive, torch.positive],
    _h_same_layout,
)
_register([torch.Tensor.detach, torch.detach, torch.Tensor.cpu, torch.Tensor.cuda], _h_identity)


# ---- casts -------------------------------------------------------------------------------------------------


def _cast(r: RegionTensor, dtype: torch.dtype | None) -> RegionTensor:
    if dtype is None or dtype == r._rdtype:
        return r
    with DisableTorchFunctionSubclass():
        meta = _meta(r).to(dtype)
    op = PostOp("cast", dtype)
    return _wrap(meta, [_with(b, post=(*b.post, op)) for b in r._blocks])


def _h_to(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    r, rest = _self_region(func, args, kwargs)
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
        r, rest = _self_region(func, args, kwargs)
        if rest or any(k != "memory_format" for k in kwargs):
            raise UnsupportedRegionOp(f"{_fname(func)}: unexpected arguments")
        return _cast(r, dtype)

    return handler


_HANDLERS[torch.Tensor.to] = _h_to
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
    _HANDLERS[_meth] = _fixed_cast(_dt)


# ---- elementwise ops with Python scalars -------------------------------------------------------------------


def _append_post(r: RegionTensor, meta: torch.Tensor, op: PostOp) -> RegionTensor:
    return _wrap(meta, [_with(b, post=(*b.post, op)) for b in r._blocks])


def _scalar_result_dtype(func: Any, r: RegionTensor, rest: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.dtype:
    """Result dtype of an elementwise op, from the same op on a 0-d CPU tensor (torch validates the arguments;
    a meta run of an elementwise op goes through Python decompositions and costs milliseconds)."""
    with DisableTorchFunctionSubclass():
        return func(torch.empty((), dtype=r._rdtype), *rest, **kwargs).dtype


def _elementwise_meta(r: RegionTensor, dtype: torch.dtype) -> torch.Tensor:
    """The meta result of an elementwise op on ``r``: ``empty_like`` gives TensorIterator's output layout."""
    with DisableTorchFunctionSubclass():
        return torch.empty_like(_meta(r), dtype=dtype)


def _scalar_handler(kind: str, *, reflected: bool = False) -> Handler:
    def handler(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not args or not isinstance(args[0], RegionTensor):
            raise UnsupportedRegionOp(f"{_fname(func)}: a RegionTensor must be the first operand")
        r = args[0]
        if len(args) == 2 and "other" not in kwargs:
            other = args[1]
        elif len(args) == 1 and "other" in kwargs:
            other = kwargs["other"]
        else:
            raise UnsupportedRegionOp(f"{_fname(func)}: unexpected arguments")
        extra = {k: v for k, v in kwargs.items() if k != "other"}
        if isinstance(other, torch.Tensor):
            raise UnsupportedRegionOp(f"{_fname(func)}: elementwise ops between tensors are not supported")
        if not isinstance(other, _SCALAR_TYPES):
            raise UnsupportedRegionOp(f"{_fname(func)}: only Python bool/int/float scalars are supported")
        k = kind
        alpha = extra.pop("alpha", 1)
        if alpha != 1 or type(alpha) is float:
            raise UnsupportedRegionOp(f"{_fname(func)}(alpha=...) is not supported on RegionTensor")
        if "rounding_mode" in extra:
            mode = extra.pop("rounding_mode")
            if mode is not None:
                if kind != "div" or mode not in ("floor", "trunc"):
                    raise UnsupportedRegionOp(f"{_fname(func)}(rounding_mode={mode!r}) is not supported")
                k = f"div_{mode}"
        if extra:
            raise UnsupportedRegionOp(f"{_fname(func)}: unexpected arguments {sorted(extra)}")
        dtype = _scalar_result_dtype(func, r, (other,), {k2: v for k2, v in kwargs.items() if k2 != "other"})
        return _append_post(r, _elementwise_meta(r, dtype), PostOp(k, other))

    return handler


def _h_neg(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    r, rest = _self_region(func, args, kwargs)
    if rest or kwargs:
        raise UnsupportedRegionOp(f"{_fname(func)}: unexpected arguments")
    dtype = _scalar_result_dtype(func, r, (), {})
    return _append_post(r, _elementwise_meta(r, dtype), PostOp("neg"))


_register(
    [torch.Tensor.add, torch.add, torch.Tensor.__add__, torch.Tensor.__radd__],
    _scalar_handler("add"),
)
_register(
    [torch.Tensor.sub, torch.sub, torch.Tensor.subtract, torch.subtract, torch.Tensor.__sub__],
    _scalar_handler("sub"),
)
_register([torch.rsub, torch.Tensor.__rsub__], _scalar_handler("rsub"))
_register(
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
_register(
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
_register([torch.Tensor.__rdiv__], _scalar_handler("rdiv"))
_register(
    [torch.Tensor.__floordiv__, torch.Tensor.floor_divide, torch.floor_divide],
    _scalar_handler("floordiv"),
)
_register([torch.Tensor.__rfloordiv__], _scalar_handler("rfloordiv"))
_register(
    [torch.Tensor.neg, torch.neg, torch.Tensor.negative, torch.negative, torch.Tensor.__neg__],
    _h_neg,
)


# ---- views that keep each dim a strided range of one input dim ---------------------------------------------
#
# The op is run on a contiguous meta "probe" with the input's shape.  Its output is a view: storage offset and
# strides, decoded against the contiguous strides, give for every output dim the input dim it walks (and the
# step) and the start index of every input dim.  The decoding is exact storage semantics, so any view that
# decodes this way is described correctly whatever op made it.


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
        cols = _cols(b)
        base = b.base
        ok = True
        for k in range(len(in_shape)):
            if k not in mapped:
                y = start[k]
                o = b.offsets[k]
                if not (o <= y < o + b.lengths[k]):
                    ok = False
                    break
                base = _axpy(base, y - o, cols[k])
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
            base = _axpy(base, s0 + step * lo - o, cols[k])
            offs.append(lo)
            lens.append(hi - lo + 1)
            ncols.append(_scale(cols[k], step))
        if ok:
            out.append(_mk(b, tuple(offs), tuple(lens), base, ncols))
    return out


def _view_result(r: RegionTensor, meta_out: Any, probe_out: Any, indexes: dict[int, _DimIndex]) -> RegionTensor:
    if meta_out.dtype != r._rdtype:
        raise UnsupportedRegionOp("a view that changes the dtype is not supported on RegionTensor")
    if meta_out.numel() == 0:
        return _wrap(meta_out, ())
    start, mapping, shape = _decode_view(r._rshape, probe_out)
    return _wrap(meta_out, _view_blocks(r, start, mapping, shape, indexes))


def _h_view_op(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    r, rest = _self_region(func, args, kwargs)
    if func is torch.Tensor.expand_as:  # the other tensor only lends its shape
        rest = tuple(_meta(a) if isinstance(a, RegionTensor) else a for a in rest)
        kwargs = {k: _meta(v) if isinstance(v, RegionTensor) else v for k, v in kwargs.items()}
    else:
        _no_real_tensors(func, [*rest, *kwargs.values()])
    if any(isinstance(a, torch.dtype) for a in (*rest, *kwargs.values())):
        raise UnsupportedRegionOp(f"{_fname(func)} with a dtype is not supported on RegionTensor")
    meta_out = _run_meta(func, (_meta(r), *rest), kwargs)
    probe = torch.empty(r._rshape, dtype=r._rdtype, device="meta")
    probe_out = _run_meta(func, (probe, *rest), kwargs)
    indexes: dict[int, _DimIndex] = {}
    if isinstance(meta_out, torch.Tensor):
        return _view_result(r, meta_out, probe_out, indexes)
    if isinstance(meta_out, (tuple, list)):
        return type(meta_out)(_view_result(r, m, p, indexes) for m, p in zip(meta_out, probe_out, strict=True))
    raise UnsupportedRegionOp(f"{_fname(func)}: unexpected result type {type(meta_out).__name__}")


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


_register(
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
_HANDLERS[torch.Tensor.__getitem__] = _h_getitem


# ---- reshape -----------------------------------------------------------------------------------------------


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
        elif full and c[k] == _scale(gamma, n):
            n *= ln[k]
            full = ln[k] == old_sizes[k]
        else:
            break
        k -= 1
    outer = [d for d in range(k + 1) if ln[d] > 1]
    runs = math.prod(ln[d] for d in outer)
    if runs > budget:
        raise UnsupportedRegionOp(f"reshape would cut a block into more than MAX_BLOCKS={MAX_BLOCKS} pieces")
    a0 = sum(oo * s for oo, s in zip(o, old_strides, strict=True))
    new_cols = tuple(_scale(gamma, t) for t in new_strides)
    pieces: list[_Piece] = []
    for ts in itertools.product(*(range(ln[d]) for d in outer)):
        a = a0
        delta: Vec | None = None
        for d, t in zip(outer, ts, strict=True):
            if t:
                a += t * old_strides[d]
                delta = _axpy(delta or (0,) * len(gamma), t, c[d])
        for offs, lens, st in _decompose(a, n, new_sizes, new_strides):
            dl = delta
            if st != a:
                dl = _axpy(dl or (0,) * len(gamma), st - a, gamma)
            pieces.append((offs, lens, dl, new_cols))
        if len(pieces) > budget:
            raise UnsupportedRegionOp(f"reshape would cut a block into more than MAX_BLOCKS={MAX_BLOCKS} pieces")
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
        cols_all = _cols(b)
        o = [b.offsets[i] for i in keep_old]
        ln = [b.lengths[i] for i in keep_old]
        c = [cols_all[i] for i in keep_old]
        per_group: list[list[_Piece]] = []
        count = 1
        for (i0, i1, j0, j1), (os_, ost, ns, nst) in zip(groups, info, strict=True):
            if i1 - i0 == 1 and j1 - j0 == 1:
                per_group.append([((o[i0],), (ln[i0],), None, (c[i0],))])
                continue
            budget = MAX_BLOCKS - len(out)
            pieces = _group_pieces(o[i0:i1], ln[i0:i1], c[i0:i1], os_, ost, ns, nst, budget)
            per_group.append(pieces)
            count *= len(pieces)
        if len(out) + count > MAX_BLOCKS:
            raise UnsupportedRegionOp(f"reshape would need more than MAX_BLOCKS={MAX_BLOCKS} blocks")
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
            out.append(_mk(b, offsets, lengths, base, cols))
    return _coalesce(out, new_nd)


def _h_reshape(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    r, rest = _self_region(func, args, kwargs)
    if any(isinstance(a, torch.dtype) for a in (*rest, *kwargs.values())):
        raise UnsupportedRegionOp(f"{_fname(func)} with a dtype (reinterpreting bytes) is not supported")
    others = [a for a in (*rest, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if others and func not in (torch.Tensor.reshape_as, torch.Tensor.view_as):
        raise UnsupportedRegionOp(f"{_fname(func)}: tensor arguments are not supported on RegionTensor")
    rest = tuple(_meta(a) if isinstance(a, RegionTensor) else a for a in rest)
    kw = {k: _meta(v) if isinstance(v, RegionTensor) else v for k, v in kwargs.items()}
    meta = _run_meta(func, (_meta(r), *rest), kw)
    if not isinstance(meta, torch.Tensor) or meta.dtype != r._rdtype:
        raise UnsupportedRegionOp(f"{_fname(func)}: unexpected result")
    return _wrap(meta, _reshape_blocks(r, tuple(meta.shape)))


_register(
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


# ---- cat / stack -------------------------------------------------------------------------------------------


def _cat_args(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[RegionTensor], int]:
    kwargs = dict(kwargs)
    kwargs.pop("out", None)
    if args:
        tensors, rest = args[0], args[1:]
    elif "tensors" in kwargs:
        tensors, rest = kwargs.pop("tensors"), ()
    else:
        raise UnsupportedRegionOp(f"{_fname(func)}: missing tensors")
    dim: Any = 0
    if rest:
        if len(rest) > 1:
            raise UnsupportedRegionOp(f"{_fname(func)}: unexpected arguments")
        dim = rest[0]
    for key in ("dim", "axis"):
        if key in kwargs:
            dim = kwargs.pop(key)
    if kwargs or isinstance(dim, bool) or not isinstance(dim, int):
        raise UnsupportedRegionOp(f"{_fname(func)}: unsupported arguments")
    if not isinstance(tensors, (list, tuple)):
        raise UnsupportedRegionOp(f"{_fname(func)}: expected a list of tensors")
    if not all(isinstance(t, RegionTensor) for t in tensors):
        raise UnsupportedRegionOp(f"{_fname(func)} mixing RegionTensors with other tensors is not supported")
    return list(tensors), dim


def _shift(b: Block, dim: int, by: int, post: tuple[PostOp, ...]) -> Block:
    if by == 0 and post is b.post:
        return b
    offs = list(b.offsets)
    offs[dim] += by
    return _with(b, offsets=tuple(offs), post=post)


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


# torch.cat / torch.stack on meta tensors run Python meta kernels that cost ~8 us per input, so their (simple)
# shape and dtype rules are applied here instead, raising the errors torch raises.


def _h_cat(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    tensors, dim = _cat_args(func, args, kwargs)
    if not tensors:
        raise RuntimeError("torch.cat(): expected a non-empty list of Tensors")
    dtype = _promoted(tensors)
    parts = [t for t in tensors if t._rshape != (0,)]  # legacy 1-D empty inputs are skipped by torch
    if not parts:
        return _wrap(torch.empty((0,), dtype=dtype, device="meta"), ())
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
            if len(out) > MAX_BLOCKS:
                raise UnsupportedRegionOp(f"cat would need more than MAX_BLOCKS={MAX_BLOCKS} blocks")
    return _wrap(meta, _coalesce(out, nd))


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
                    _raw(
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
            if len(out) > MAX_BLOCKS:
                raise UnsupportedRegionOp(f"stack would need more than MAX_BLOCKS={MAX_BLOCKS} blocks")
    return _wrap(meta, _coalesce(out, nd))


_register([torch.cat, torch.concat, torch.concatenate], _h_cat)
_register([torch.stack], _h_stack)


# ---- merging adjacent blocks -------------------------------------------------------------------------------


def _try_merge(a: Block, b: Block, d: int) -> Block | None:
    """``a`` followed by ``b`` along dim ``d`` as one block, if one affine map describes both."""
    la, lb = a.lengths[d], b.lengths[d]
    ca, cb = _cols(a)[d], _cols(b)[d]
    diff = tuple(y - x for x, y in zip(a.base, b.base, strict=True))
    if la > 1:
        step = ca
        if diff != _scale(step, la) or (lb > 1 and cb != step):
            return None
    elif lb > 1:
        step = cb
        if diff != step:
            return None
    else:
        step = diff
        if any(x < 0 for x in step):
            return None
    cols = _cols(a)
    cols[d] = step
    lens = list(a.lengths)
    lens[d] = la + lb
    return _mk(a, a.offsets, tuple(lens), a.base, cols)


def _coalesce(blocks: list[Block], ndim: int) -> list[Block]:
    """Merge neighbouring blocks that one affine map describes; result sorted by offsets."""
    if len(blocks) < 2:
        return blocks
    if len({(b.source, b.post) for b in blocks}) == len(blocks):
        return sorted(blocks, key=lambda b: b.offsets)
    changed = True
    while changed:
        changed = False
        for d in range(ndim):
            groups: dict[Any, list[Block]] = {}
            for b in blocks:
                cols = _cols(b)
                key = (
                    b.source,
                    b.post,
                    b.offsets[:d] + b.offsets[d + 1 :],
                    b.lengths[:d] + b.lengths[d + 1 :],
                    tuple(
                        col if n > 1 else None for i, (col, n) in enumerate(zip(cols, b.lengths, strict=True)) if i != d
                    ),
                )
                groups.setdefault(key, []).append(b)
            if len(groups) == len(blocks):
                continue
            merged: list[Block] = []
            for members in groups.values():
                if len(members) == 1:
                    merged.append(members[0])
                    continue
                members.sort(key=lambda b: b.offsets[d])
                cur = members[0]
                for nxt in members[1:]:
                    m = None
                    if nxt.offsets[d] == cur.offsets[d] + cur.lengths[d]:
                        m = _try_merge(cur, nxt, d)
                    if m is None:
                        merged.append(cur)
                        cur = nxt
                    else:
                        cur = m
                        changed = True
                merged.append(cur)
            blocks = merged
    return sorted(blocks, key=lambda b: b.offsets)


# ---- queries that return plain values ----------------------------------------------------------------------

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
        _PASSTHROUGH.add(_attr.__get__)
_PASSTHROUGH.update(
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


# ------------------------------------------------------------------------------------------------------------
# Evaluation
# ------------------------------------------------------------------------------------------------------------


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
            strides = [sum(c * s for c, s in zip(col, sstr, strict=True)) for col in _cols(b)]
            offset = src.storage_offset() + sum(x * s for x, s in zip(b.base, sstr, strict=True))
            view = apply_post(src.as_strided(b.lengths, strides, offset), b.post)
            if view.dtype != out.dtype:
                raise AssertionError(f"block produces {view.dtype}, region is {out.dtype}")
            out[tuple(slice(o, o + n) for o, n in zip(b.offsets, b.lengths, strict=True))] = view
    return out
