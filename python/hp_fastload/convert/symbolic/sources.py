"""``SourceTensor``: a lighter stand-in than :class:`RegionTensor` for when only *which* inputs feed each output
matters, not which elements: every supported op runs on the meta tensors underneath and its tensor results carry
the union of its tensor arguments' sources.

Planning a load through a state-dict adapter needs, from ``to_hf``, only the keys it gives and the model
tensors each is made of (what the checkpoint must hold, which model tensors the adapter maps); the element-exact
trace of ``to_hf`` costs as much as the one of ``from_hf`` that decides the reads. The same ops are accepted as
on a ``RegionTensor`` (its handlers' and pass-through queries' keys): anything else, and any op whose meta run
fails, raises :class:`UnsupportedRegionOp`, so a conversion traced here is one the region tracer also accepts
by op (not necessarily by argument: a reshape with a dtype passes here).

It does not own: element regions (``tensor``), what the sources mean (``convert.adapter``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._C import DisableTorchFunctionSubclass

from hp_fastload.convert.symbolic.block import leaf_meta
from hp_fastload.convert.symbolic.tensor import HANDLERS, OPERATORS, PASSTHROUGH, UnsupportedRegionOp, op_name


class SourceTensor(torch.Tensor):
    """A data-less tensor (meta underneath) with the set of input keys its value is computed from."""

    _sources: frozenset[str]

    @staticmethod
    def leaf(source: str, shape: Sequence[int], dtype: torch.dtype) -> SourceTensor:
        """A tensor of ``shape`` and ``dtype`` made of ``source`` only."""
        return _wrap(leaf_meta(tuple(int(s) for s in shape), dtype), frozenset((source,)))

    @property
    def sources(self) -> frozenset[str]:
        """The input keys this tensor is made of."""
        return self._sources

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"SourceTensor(shape={tuple(self.shape)}, dtype={self.dtype}, sources={sorted(self._sources)})"

    def __format__(self, format_spec: str) -> str:
        return format(repr(self), format_spec)

    def __deepcopy__(self, memo: dict[int, Any]) -> SourceTensor:
        return _wrap(_meta(self), self._sources)

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        return _dispatch(func, tuple(args), kwargs or {})


def _wrap(meta: torch.Tensor, sources: frozenset[str]) -> SourceTensor:
    with DisableTorchFunctionSubclass():
        out = torch.Tensor._make_subclass(SourceTensor, meta)
    out._sources = sources
    return out


def _meta(t: SourceTensor) -> torch.Tensor:
    with DisableTorchFunctionSubclass():
        return t.as_strided(t.size(), t.stride(), t.storage_offset())


def _unwrap(x: Any, found: list[frozenset[str]]) -> Any:
    if isinstance(x, SourceTensor):
        found.append(x._sources)
        return _meta(x)
    if isinstance(x, torch.Tensor):
        raise UnsupportedRegionOp("ops between a traced tensor and a real tensor are not supported")
    if type(x) in (list, tuple):
        return type(x)(_unwrap(v, found) for v in x)
    return x


def _rewrap(x: Any, sources: frozenset[str]) -> Any:
    if isinstance(x, torch.Tensor):
        return _wrap(x, sources)
    if type(x) in (list, tuple):
        return type(x)(_rewrap(v, sources) for v in x)
    return x


def _dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    passthrough = func in PASSTHROUGH
    if not passthrough and func not in HANDLERS:
        raise UnsupportedRegionOp(f"{op_name(func)} is not supported on a traced tensor")
    if kwargs.get("out") is not None:
        raise UnsupportedRegionOp(f"{op_name(func)}(out=...) is not supported on a traced tensor")
    found: list[frozenset[str]] = []
    margs = _unwrap(args, found)
    mkw = {k: _unwrap(v, found) for k, v in kwargs.items()}
    try:
        with DisableTorchFunctionSubclass():
            out = func(*margs, **mkw)
    except UnsupportedRegionOp:
        raise
    except Exception as exc:  # the meta run refused the arguments (or read values): not traceable
        raise UnsupportedRegionOp(f"{op_name(func)}: {type(exc).__name__}: {exc}") from exc
    if passthrough:
        if isinstance(out, torch.Tensor):
            raise UnsupportedRegionOp(f"{op_name(func)} would expose the meta tensor under a traced tensor")
        return out
    return _rewrap(out, frozenset().union(*found))


def _operator(name: str) -> Callable[[SourceTensor, Any], Any]:
    base = getattr(torch.Tensor, name)

    def method(self: SourceTensor, other: Any) -> Any:
        return _dispatch(base, (self, other), {})

    method.__name__ = method.__qualname__ = name
    return method


# As on RegionTensor: torch would turn a refusal inside a binary operator into NotImplemented.
for _op_name in OPERATORS:
    if hasattr(torch.Tensor, _op_name):
        setattr(SourceTensor, _op_name, _operator(_op_name))
SourceTensor.__hash__ = torch.Tensor.__hash__  # type: ignore[method-assign]
