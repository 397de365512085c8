"""State-dict adapters: any object with torchtitan's ``StateDictAdapter`` protocol (``from_hf``, ``to_hf``), run on
symbolic tensors so that its conversion becomes exact region reads.

An adapter converts a whole state dict at once (renames, RoPE permutes, expert stacking), and the model's own
``load_state_dict`` pre-hooks (torchtitan's fused-QKV merge) and ``state_dict`` post-hooks (its split) finish
the job. This module runs both directions on :class:`RegionTensor` leaves, as torchtitan runs them on real
tensors:

* the **released** direction: the model's state dict (one leaf per model tensor, global shapes) through the
  model's own ``state_dict`` post-hooks, then ``to_hf``: every Hugging Face key the model maps to, with the
  regions of model tensors it is made of (the layout a save writes), or only which model tensors feed it (which
  keys a checkpoint must hold, for a load: :func:`released_sources`, on lighter ``SourceTensor`` leaves);
* the **load** direction: the checkpoint's leaves through ``from_hf``, then the model's own
  ``load_state_dict`` pre-hooks: every model tensor as a region of checkpoint tensors.

Hooks of torch's own wrappers (activation checkpointing, FSDP, DDP, ``torch.compile``) are not run: the names
here are already the canonical ones (``model.wrappers.WRAPPED_CHILDREN`` dropped). The user's adapter is never
mutated: each run uses a private copy.

It does not own: reading, claiming outputs for targets, or deciding what is missing (see ``planning.adapter``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any, Protocol, TypeGuard

import torch
from torch import nn

from hp_fastload.convert.structure import ShapeDtype, trace_by_structure
from hp_fastload.convert.symbolic import RegionTensor
from hp_fastload.convert.symbolic.sources import SourceTensor
from hp_fastload.model.wrappers import WRAPPED_CHILDREN


class StateDictAdapter(Protocol):
    """torchtitan's protocol: whole state dicts between the Hugging Face layout and the model's own."""

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        """The model's state dict from a Hugging Face one."""
        ...

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A Hugging Face state dict from the model's."""
        ...


def is_state_dict_adapter(obj: object) -> TypeGuard[StateDictAdapter]:
    """Whether ``obj`` has callable ``from_hf`` and ``to_hf``."""
    return callable(getattr(obj, "from_hf", None)) and callable(getattr(obj, "to_hf", None))


def check_adapter(obj: object) -> StateDictAdapter:
    """``obj`` when it is an adapter (an adapter class is refused: it needs the model's config to build)."""
    if isinstance(obj, type):
        raise TypeError(
            f"state_dict_adapter={obj.__name__} is a class; pass an instance, e.g. "
            f"{obj.__name__}(model_config, hf_assets_path=None)"
        )
    if not is_state_dict_adapter(obj):
        raise TypeError(
            f"state_dict_adapter must have from_hf(hf_state_dict) and to_hf(state_dict) methods "
            f"(torchtitan's StateDictAdapter protocol); got {type(obj).__name__}"
        )
    return obj


# torchtitan's MoEStateDictAdapter remembers, in to_hf, the DTensor layout of the stacked experts it split, and
# from then on its from_hf stacks only this rank's experts into a DTensor. The traced tensors are whole (global
# shapes), for which its whole-tensor path is the right one: a private copy starts without that memory.
_ONLINE_STATE = ("local_experts_indices", "grouped_expert_weight_placements", "grouped_expert_weight_shape")


def private_copy(adapter: StateDictAdapter) -> Any:
    """A shallow copy whose dict and list attributes are copies (``to_hf`` may pop from them), without the
    per-rank state a previous ``to_hf`` on DTensors left."""
    own = copy.copy(adapter)
    for name, value in list(vars(own).items()) if hasattr(own, "__dict__") else ():
        if isinstance(value, (dict, list)):
            setattr(own, name, copy.copy(value))
    for name in (*_ONLINE_STATE, "grouped_expert_weight_mesh"):
        if isinstance(getattr(own, name, None), dict):
            setattr(own, name, {})
    return own


def canonical_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(prefix, module)`` in pre-order, the prefix without wrapper components and ending in a dot (or empty);
    forwarding wrappers themselves are skipped (their hooks only translate names)."""
    canonical: dict[str, str] = {"": ""}
    for name, module in model.named_modules():
        if name:
            parent, _, leaf = name.rpartition(".")
            above = canonical[parent]
            canonical[name] = above if leaf in WRAPPED_CHILDREN else f"{above}.{leaf}" if above else leaf
        if not WRAPPED_CHILDREN.isdisjoint(module._modules):  # a wrapper: its wrapped child has its name
            continue
        yield (canonical[name] + "." if canonical[name] else ""), module


def _own_hook(hook: Any) -> bool:
    """A hook of the model's own code, not of torch's wrappers (FSDP, checkpointing, DDP, compile)."""
    fn = getattr(hook, "hook", hook)  # load pre-hooks are wrapped in torch's _WrappedHook
    fn = getattr(fn, "__func__", fn)
    module = getattr(fn, "__module__", None) or ""
    return not (module == "torch" or module.startswith("torch."))


def run_save_hooks(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """The model's own ``state_dict`` post-hooks on ``state``, children before parents (as ``state_dict``)."""
    for prefix, module in reversed(list(canonical_modules(model))):
        for hook in list(module._state_dict_hooks.values()):
            if _own_hook(hook):
                result = hook(module, state, prefix, {"version": getattr(module, "_version", 1)})
                if result is not None and not getattr(hook, "_from_public_api", False):
                    state = result
    return state


def run_load_hooks(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """The model's own ``load_state_dict`` pre-hooks on ``state``, parents before children (as
    ``load_state_dict``). A hook that reports an error raises it."""
    errors: list[str] = []
    for prefix, module in canonical_modules(model):
        for hook in list(module._load_state_dict_pre_hooks.values()):
            if _own_hook(hook):
                hook(state, prefix, {"version": getattr(module, "_version", 1)}, True, [], [], errors)
    if errors:
        raise ValueError("; ".join(errors))
    return state


def released_regions(
    model: nn.Module, adapter: StateDictAdapter, tensors: Mapping[str, ShapeDtype], *, memo: bool = True
) -> dict[str, Any]:
    """Hugging Face key -> the region of model tensors it is made of (a :class:`Mapped` whose sources are model
    names; any other value is what the adapter gave where it could not be traced), through the model's
    ``state_dict`` post-hooks and ``to_hf``. ``tensors``: model name -> (global shape, dtype). ``memo``: the
    block arithmetic once per layer structure (``convert.structure``)."""

    def convert(state: dict[str, RegionTensor]) -> Mapping[str, Any]:
        return private_copy(adapter).to_hf(run_save_hooks(model, dict(state)))

    return trace_by_structure(convert, tensors, memo=memo)


def released_sources(model: nn.Module, adapter: StateDictAdapter, tensors: Mapping[str, ShapeDtype]) -> dict[str, Any]:
    """Hugging Face key -> the model tensors it is made of (a frozenset of model names; any other value is what
    the adapter gave where it could not be traced), through the model's ``state_dict`` post-hooks and ``to_hf``
    on :class:`SourceTensor` leaves: what a load needs of ``to_hf`` (which keys, from which tensors), without the
    element regions :func:`released_regions` traces."""
    return {
        key: v.sources if isinstance(v, SourceTensor) else v
        for key, v in released_tensors(model, adapter, tensors).items()
    }


def released_tensors(model: nn.Module, adapter: StateDictAdapter, tensors: Mapping[str, ShapeDtype]) -> dict[str, Any]:
    """``to_hf`` (after the model's ``state_dict`` post-hooks) on :class:`SourceTensor` leaves of ``tensors``
    (model name -> (global shape, dtype)): Hugging Face key -> a ``SourceTensor`` with the key's shape, dtype
    and model tensors (any other value as the adapter gave it)."""
    state: dict[str, Any] = {name: SourceTensor.leaf(name, *shape_dtype) for name, shape_dtype in tensors.items()}
    return dict(private_copy(adapter).to_hf(run_save_hooks(model, state)))


def loaded_regions(
    model: nn.Module, adapter: StateDictAdapter, leaves: Mapping[str, ShapeDtype], *, memo: bool = True
) -> dict[str, Any]:
    """Model name -> its value from the checkpoint tensors ``leaves`` (Hugging Face key -> (shape, dtype)): a
    :class:`Mapped` over checkpoint keys (or what the adapter gave where it could not be traced), through
    ``from_hf`` and the model's ``load_state_dict`` pre-hooks."""

    def convert(state: dict[str, RegionTensor]) -> Mapping[str, Any]:
        return run_load_hooks(model, dict(private_copy(adapter).from_hf(dict(state))))

    return trace_by_structure(convert, leaves, memo=memo)


def has_own_state_dict_hooks(model: nn.Module) -> bool:
    """Whether some module of ``model`` (each once; forwarding wrappers skipped, as :func:`canonical_modules`
    skips them) has a ``state_dict`` post-hook of the model's own code. One walk of the module tree without
    building names: planning asks it of every model, and almost none has such a hook."""
    seen: set[int] = set()
    stack = [model]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        children = module._modules
        hooks = module._state_dict_hooks
        if hooks and WRAPPED_CHILDREN.isdisjoint(children) and any(map(_own_hook, hooks.values())):
            return True
        stack.extend(c for c in children.values() if c is not None)
    return False


def hook_renamed(model: nn.Module, tensors: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> list[str]:
    """Model tensors that the model's own ``state_dict`` post-hooks present under other names or layouts
    (torchtitan's fused ``wqkv``, shown as ``wq`` / ``wk`` / ``wv``): a checkpoint holds the hooks' view, and only
    the hooks (through a ``state_dict_adapter``) know how it maps to the tensor. Empty when no module has such a
    hook (nothing is traced then)."""
    if not has_own_state_dict_hooks(model):
        return []
    state: dict[str, Any] = {name: RegionTensor.leaf(name, shape, dtype) for name, (shape, dtype) in tensors.items()}
    try:
        view = run_save_hooks(model, dict(state))
    except Exception:  # a hook that cannot run on traced tensors: no claim about its names
        return []
    return [
        name
        for name, leaf in state.items()
        if not (isinstance(view.get(name), RegionTensor) and view[name].blocks == leaf.blocks)
    ]
