"""Post-ops: the elementwise steps a block applies after reading its source (casts, arithmetic with Python scalars),
applied in the source dtype and then cast, exactly as torch would; ``apply_post`` and the dtype they produce.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch

SCALAR_TYPES = (bool, int, float)


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
        elif not isinstance(self.value, SCALAR_TYPES):
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
