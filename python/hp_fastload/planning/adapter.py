"""Planning a load through a state-dict adapter (torchtitan's ``StateDictAdapter`` protocol): the adapter and the
model's own hooks traced on the checkpoint's leaves (``convert.adapter``), each model tensor claimed as the
exact region reads it traced to.

A save through an adapter (:func:`released_layout`) is the same plan run backwards: the files hold the keys
``to_hf`` gives, with the shapes and dtypes it gives them, and each model tensor's traced region says where in
them its elements go.

Which checkpoint keys are read is decided as torchtitan decides it: the keys ``to_hf`` gives for the model's
state dict. A checkpoint key outside them is unexpected; a model tensor that no key ``to_hf`` gives is made of
(a buffer only the model owns, as torchtitan's ``expert_bias``) is *unmapped*: the model's own initialization
keeps it, and it is not missing.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch

from hp_fastload.convert.adapter import StateDictAdapter, loaded_regions, released_sources, released_tensors
from hp_fastload.convert.structure import Mapped
from hp_fastload.convert.symbolic import UnsupportedRegionOp
from hp_fastload.errors import AdapterError, shown_key
from hp_fastload.model.targets import Target
from hp_fastload.planning.claims import Claims
from hp_fastload.source.index import CheckpointIndex


@dataclass
class AdapterPlan:
    """What tracing the adapter decided: the model tensors it leaves to the model (unmapped) and the checkpoint
    keys it does not read (unexpected)."""

    unmapped: list[str]
    unexpected: list[str]


def _traced(values: dict[str, Any], what: str, kind: type, noun: str) -> dict[str, Any]:
    """``values`` when every one is a ``kind`` (what the tracer gives), else the ``AdapterError`` naming the keys
    whose values an op computed from real data."""
    bad = [k for k, v in values.items() if not isinstance(v, kind)]
    if bad:
        raise AdapterError(
            f"the state_dict_adapter's {what} produced values that are not {noun} for "
            f"{', '.join(map(shown_key, bad[:5]))} (type {type(values[bad[0]]).__name__}): an op that reads values "
            "cannot be planned as region reads; load through torchtitan's own path (dcp_load) instead"
        )
    return values


def released(model: Any, adapter: StateDictAdapter, targets: dict[str, Target]) -> dict[str, frozenset[str]]:
    """Hugging Face key -> the model tensors (by model name) it is made of, for every key ``to_hf`` gives."""
    tensors = {name: (tuple(t.global_shape), t.dtype) for name, t in targets.items()}
    try:
        out = released_sources(model, adapter, tensors)
    except UnsupportedRegionOp as exc:
        raise AdapterError(f"the state_dict_adapter's to_hf (or a state_dict hook) cannot be traced: {exc}") from exc
    return _traced(out, "to_hf", frozenset, "traced tensors")


def released_layout(model: Any, adapter: StateDictAdapter, targets: dict[str, Target]) -> dict[str, torch.Tensor]:
    """Hugging Face key -> a meta tensor of the shape and dtype ``to_hf`` gives it (each its own storage), in
    ``to_hf``'s order: the checkpoint a save through the adapter writes."""
    tensors = {name: (tuple(t.global_shape), t.dtype) for name, t in targets.items()}
    try:
        out = released_tensors(model, adapter, tensors)
    except UnsupportedRegionOp as exc:
        raise AdapterError(f"the state_dict_adapter's to_hf (or a state_dict hook) cannot be traced: {exc}") from exc
    bad = [k for k, v in out.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise AdapterError(
            f"the state_dict_adapter's to_hf produced values that are not traced tensors for "
            f"{', '.join(map(shown_key, bad[:5]))} (type {type(out[bad[0]]).__name__})"
        )
    return {key: torch.empty(tuple(v.shape), dtype=v.dtype, device="meta") for key, v in out.items()}


def plan_adapter(
    model: Any,
    index: CheckpointIndex,
    targets: dict[str, Target],
    adapter: StateDictAdapter,
    claims: Claims,
    keys: Collection[str],
) -> AdapterPlan:
    """Claim every model tensor ``from_hf`` (and the model's load hooks) fill, as region reads."""
    hf = released(model, adapter, targets)
    present = set(keys)
    leaves = {}
    for key in hf:
        if key in present:
            entry = index.locate(key)
            leaves[key] = (tuple(entry.shape), entry.dtype)
    try:
        native = loaded_regions(model, adapter, leaves)
    except UnsupportedRegionOp as exc:
        raise AdapterError(
            f"the state_dict_adapter's from_hf (or a load_state_dict pre-hook of the model) cannot be traced: {exc}"
        ) from exc
    except (KeyError, AssertionError) as exc:
        raise AdapterError(
            f"the state_dict_adapter's from_hf failed on this checkpoint's keys: {type(exc).__name__}: {exc}"
        ) from exc
    for name, region in _traced(native, "from_hf", Mapped, "traced regions").items():
        claims.region(name, region.shape, region.blocks, None)
    mapped = set().union(*hf.values())
    unmapped = [name for name, target in targets.items() if mapped.isdisjoint(target.names)]
    unexpected = [key for key in keys if key not in hf]
    return AdapterPlan(unmapped, unexpected)
