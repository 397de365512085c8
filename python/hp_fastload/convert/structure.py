"""Tracing a whole-state-dict conversion (a state-dict adapter's ``from_hf`` or ``to_hf`` with the model's own
hooks) with its block arithmetic done once per layer *structure* instead of once per layer.

An adapter converts a whole state dict, so the rule tracer's per-group cache does not apply. Here the input keys
are cut into layers by their first numeric dotted part (``model.layers.7.self_attn.q_proj.weight`` is in layer
``model.layers.7``, template ``model.layers.#.self_attn.q_proj.weight``), and the conversion runs once over
every key under the op memo (``convert.symbolic.memo``): layer 7's reshape of its q is layer 0's, renamed.
Every layer still runs through the conversion code and every output is that layer's own trace, so nothing about
the adapter is assumed (a layer converted differently misses the memo and is traced afresh).

It does not own: what the conversion is (``convert.adapter`` runs the adapter and hooks), claiming reads.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hp_fastload.convert.symbolic import Block, RegionTensor
from hp_fastload.convert.symbolic.memo import memoized

#: The first numeric dotted part of a key: the layer number.
_LAYER = re.compile(r"(?:^|(?<=\.))(\d+)(?=\.|$)")

ShapeDtype = tuple[tuple[int, ...], torch.dtype]


@dataclass(frozen=True)
class Mapped:
    """One output of a traced conversion: its shape and dtype, and the blocks (over input keys) that tile it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    blocks: tuple[Block, ...]

    def input_keys(self) -> set[str]:
        """The input keys this output reads."""
        return {b.source for b in self.blocks}


def mapped(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with each traced region as a :class:`Mapped` (anything else as it is)."""
    return {
        name: Mapped(tuple(v.shape), v.dtype, v.blocks) if isinstance(v, RegionTensor) else v
        for name, v in values.items()
    }


def layer_of(key: str) -> tuple[tuple[str, str], str] | None:
    """``((prefix, number), template)`` of a key inside a layer (the template has ``#`` for the number); None
    outside any layer."""
    match = _LAYER.search(key)
    if match is None:
        return None
    return (key[: match.start()], match.group(1)), f"{key[: match.start()]}#{key[match.end() :]}"


def trace_by_structure(
    convert: Callable[[dict[str, RegionTensor]], Mapping[str, Any]],
    inputs: Mapping[str, ShapeDtype],
    *,
    memo: bool = True,
) -> dict[str, Any]:
    """Every output of ``convert`` over symbolic leaves of ``inputs`` (key -> (shape, dtype)), as
    :class:`Mapped` (any value that is not a traced region as it is). With ``memo``, under the op memo (the
    block arithmetic once per layer structure); without, every op computed (what tests compare it with)."""
    leaves = {key: RegionTensor.leaf(key, *shape_dtype) for key, shape_dtype in inputs.items()}
    if not memo:
        return mapped(convert(leaves))
    layers: dict[str, tuple[str, Any]] = {}
    for key in inputs:
        found = layer_of(key)
        layers[key] = (key, None) if found is None else (found[1], found[0])
    with memoized(layers):
        return mapped(convert(leaves))
