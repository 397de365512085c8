"""The op memo: inside :func:`memoized`, an op on regions whose sources are one layer's keys (and keys outside any
layer) is computed once per layer *structure*; the same op on another layer's regions (equal blocks once each
source is replaced by its key template) is answered with the first result, its sources renamed to this layer's.

Exact, not assumed: every op of every layer still runs through the conversion code (so a conversion that treats
a layer differently calls a different op or passes different arguments, and misses the memo); only the block
arithmetic of a repeated op is skipped. The handlers never look at source names except to compare them, so
renaming the sources of an op's inputs one-to-one renames the sources of its result and changes nothing else.

It does not own: which keys form a layer (the caller passes each source's template and layer), the handlers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch._C import DisableTorchFunctionSubclass

from hp_fastload.convert.symbolic.block import Block, block_with
from hp_fastload.convert.symbolic.tensor import OP_MEMO, RegionTensor, meta_of, wrap

#: Argument types whose value (with its type) decides an op's result; any other argument disables the memo.
_PLAIN = (int, float, bool, str, type(None), type(Ellipsis), torch.dtype, torch.device, torch.memory_format)


class _NoMemo(Exception):
    """An argument the memo cannot key on (a real tensor, an arbitrary object, a region mixing layers)."""


class OpMemo:
    """Results of ops keyed by (op, arguments with each source replaced by its template)."""

    def __init__(self, layers: Mapping[str, tuple[str, Any]]) -> None:
        # source key -> (template, layer); keys outside any layer are their own template, layer None
        self.layers = layers
        self.by_template: dict[tuple[Any, str], str] = {(lay, t): k for k, (t, lay) in layers.items()}
        self.results: dict[Any, tuple[Any, Any, list[tuple[Any, Any]]]] = {}
        self.hits = 0
        self.misses = 0

    def key(self, func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, Any] | None:
        """``(key, layer)`` of a call, or None when it cannot be memoized."""
        seen: list[Any] = []
        try:
            kw = tuple(sorted((k, self._freeze(v, seen)) for k, v in kwargs.items()))
            frozen = (func, self._freeze(args, seen), kw)
            hash(frozen)
        except (_NoMemo, TypeError):
            return None
        return frozen, (seen[0] if seen else None)

    def _freeze(self, x: Any, seen: list[Any]) -> Any:
        if isinstance(x, RegionTensor):
            known = getattr(x, "_memo_frozen", None)
            if known is not None and known[0] is self:  # a result of this memo: its key part was kept with it
                _, layer, frozen = known
                if layer is not None:
                    if not seen:
                        seen.append(layer)
                    elif seen[0] != layer:
                        raise _NoMemo
                return frozen
            return self._region(x, seen)
        if isinstance(x, torch.Tensor):
            raise _NoMemo
        if isinstance(x, (tuple, list)):
            return (type(x).__name__, *(self._freeze(v, seen) for v in x))
        if isinstance(x, slice):
            return ("slice", self._freeze(x.start, seen), self._freeze(x.stop, seen), self._freeze(x.step, seen))
        if isinstance(x, _PLAIN):
            return (type(x), x)
        raise _NoMemo

    def _region(self, x: RegionTensor, seen: list[Any]) -> Any:
        with DisableTorchFunctionSubclass():
            stride, offset = tuple(x.stride()), x.storage_offset()
        return ("R", x._rshape, stride, offset, x._rdtype, self._blocks(x._blocks, seen))

    def _keep(self, x: Any) -> None:
        """Keep with each region of a result its key part (template form and layer), for the next op's key."""
        for r in (x,) if isinstance(x, RegionTensor) else x:
            seen: list[Any] = []
            try:
                frozen = self._region(r, seen)
            except _NoMemo:
                continue
            r._memo_frozen = (self, seen[0] if seen else None, frozen)

    def _blocks(self, blocks: tuple[Block, ...], seen: list[Any]) -> tuple[Any, ...]:
        layers = self.layers
        out = []
        for b in blocks:
            found = layers.get(b.source)
            if found is None:
                raise _NoMemo
            template, layer = found
            if layer is not None:
                if not seen:
                    seen.append(layer)
                elif seen[0] != layer:
                    raise _NoMemo  # two layers in one op: computed, not memoized
            out.append((template, b.offsets, b.lengths, b.base, b.coeff, b.post, b.src_dtype, b.src_shape))
        return tuple(out)

    def get(self, key: Any, layer: Any) -> Any:
        """The memoized result for ``key``, its sources renamed to ``layer``'s keys (new tensor objects); None."""
        found = self.results.get(key)
        if found is None:
            return None
        self.hits += 1
        result, cached_layer, kept = found
        out = self._rebuild(result, {} if cached_layer != layer else None, layer)
        for r, (template_layer, frozen) in zip((out,) if isinstance(out, RegionTensor) else out, kept, strict=True):
            if frozen is not None:  # the same template form; its layer is this call's where it had one
                r._memo_frozen = (self, layer if template_layer is not None else None, frozen)
        return out

    def put(self, key: Any, layer: Any, result: Any) -> None:
        self.misses += 1
        if _regions_only(result):
            self._keep(result)
            kept = []
            for r in (result,) if isinstance(result, RegionTensor) else result:
                known = getattr(r, "_memo_frozen", None)
                kept.append((known[1], known[2]) if known is not None and known[0] is self else (None, None))
            self.results[key] = (_frozen_result(result), layer, kept)

    def _rebuild(self, x: Any, rename: dict[str, str] | None, layer: Any) -> Any:
        if isinstance(x, _Region):
            blocks = x.blocks
            if rename is not None:
                blocks = tuple(block_with(b, source=self._renamed(b.source, rename, layer)) for b in blocks)
            return wrap(x.meta, blocks)
        return type(x)(self._rebuild(v, rename, layer) for v in x)

    def _renamed(self, source: str, rename: dict[str, str], layer: Any) -> str:
        new = rename.get(source)
        if new is None:
            template, old_layer = self.layers[source]
            new = source if old_layer is None else self.by_template[(layer, template)]
            rename[source] = new
        return new


class _Region:
    """A memoized region: its meta tensor (shape, dtype, strides) and blocks; each hit wraps a new tensor."""

    __slots__ = ("blocks", "meta")

    def __init__(self, r: RegionTensor) -> None:
        self.meta = meta_of(r)
        self.blocks = r._blocks


def _frozen_result(x: Any) -> Any:
    return _Region(x) if isinstance(x, RegionTensor) else type(x)(_Region(v) for v in x)


def _regions_only(x: Any) -> bool:
    if isinstance(x, RegionTensor):
        return True
    return type(x) in (tuple, list) and bool(x) and all(isinstance(v, RegionTensor) for v in x)


@contextlib.contextmanager
def memoized(layers: Mapping[str, tuple[str, Any]]) -> Iterator[OpMemo]:
    """Ops on regions inside the block are memoized across layers (see the module docstring). ``layers``: every
    source key -> (its template, its layer or None outside any layer)."""
    memo = OpMemo(dict(layers))
    token = OP_MEMO.set(memo)
    try:
        yield memo
    finally:
        OP_MEMO.reset(token)
