"""What a load finishes that the checkpoint does not hold: weight ties and non-persistent buffers.

Owns the two steps around ``load``'s planning and reading:

- :func:`retie` (before planning): a transformers model whose config ties weights (``tie_word_embeddings``,
  the model's ``_tied_weights_keys``) but whose tied names now reach different tensors (``parallelize_module``
  replaced the embedding's parameter, ``to_empty`` swapped tensors) is tied again with transformers' own
  ``tie_weights()``, so the planner sees one target under both names and the checkpoint's one copy fills it.
  Under FSDP2 a tie cannot be made after ``fully_shard`` (each copy is its own sharded parameter): that is a
  ``TargetError`` saying to tie before sharding.
- :func:`recreate_buffers` (after reading): non-persistent buffers are not in a checkpoint, and
  ``to_empty`` leaves them uninitialized (rotary ``inv_freq``, ``position_ids``...). For a transformers model
  they are recomputed exactly as ``from_pretrained`` does after its meta-device load: ``initialize_weights()``
  with every loaded tensor marked ``_is_hf_initialized``, so the model's own ``_init_weights`` writes only what
  nothing loaded (the same code on the same config: bit-equal buffers). Parameters and persistent buffers the
  checkpoint did not fill are marked too for that call, so nothing the user holds is overwritten; they stay in
  ``LoadReport.missing_keys``. A buffer that nothing re-created (its version counter did not move) is returned,
  and ``LoadReport`` lists it.

It does not read checkpoint bytes or decide what the checkpoint fills.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from hp_fastload.errors import TargetError

log = logging.getLogger("hp_fastload")


_FLAG = "_is_hf_initialized"


def _pretrained_model_class() -> Any:
    if "transformers" not in sys.modules:  # a PreTrainedModel implies transformers is imported
        return None
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - depends on the environment
        return None
    return PreTrainedModel


def is_transformers_model(model: nn.Module) -> bool:
    cls = _pretrained_model_class()
    return cls is not None and isinstance(model, cls)


def non_persistent_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every non-persistent buffer of ``model`` under its first name (shared buffers once)."""
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for name in sorted(module._non_persistent_buffers_set):
            buffer = module._buffers.get(name)
            if buffer is None or id(buffer) in seen:
                continue
            seen.add(id(buffer))
            yield (f"{module_name}.{name}" if module_name else name), buffer


def _tensor_at(model: nn.Module, name: str) -> torch.Tensor | None:
    module_name, _, leaf = name.rpartition(".")
    try:
        module = model.get_submodule(module_name) if module_name else model
    except AttributeError:
        return None
    value = getattr(module, leaf, None)
    return value if isinstance(value, torch.Tensor) else None


def retie(model: nn.Module) -> list[str]:
    """Tie again the tied weights of a transformers model that reach different tensors; return their names.

    Ties come from the model itself (``get_expanded_tied_weights_keys``, which honours the config's
    ``tie_word_embeddings``). Other modules are left as they are.
    """
    if not is_transformers_model(model):
        return []
    tied_keys = getattr(model, "get_expanded_tied_weights_keys", None)
    if tied_keys is None:
        return []
    broken = []
    for target, source in tied_keys(all_submodels=True).items():
        a, b = _tensor_at(model, target), _tensor_at(model, source)
        if a is not None and b is not None and a is not b:
            broken.append(target)
    if broken and _fsdp_managed(model):
        raise TargetError(
            f"{', '.join(broken)}: tied to {', '.join(tied_keys(all_submodels=True)[t] for t in broken)} by the "
            "model's config, but they are different tensors and fully_shard manages them (FSDP2 would keep "
            "gathering the untied copy): tie them before fully_shard (model.tie_weights()) and keep both in one "
            "FSDP unit (the root, or fully_shard([embedding, head])), or untie them in the config "
            "(tie_word_embeddings=False) and load a checkpoint that holds both. transformers' DistributedConfig "
            "fsdp plan wraps the embedding alone: for a tied model, pass from_pretrained(parallelize=...)"
        )
    if broken:
        model.tie_weights()  # type: ignore[operator]
        log.info("re-tied %d tied weights that no longer shared a tensor: %s", len(broken), ", ".join(broken))
    return sorted(broken)


def _fsdp_managed(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def _flagged(tensor: torch.Tensor) -> bool:
    return bool(getattr(tensor, _FLAG, False))


def mark_loaded(tensors: Iterable[torch.Tensor]) -> None:
    """Mark tensors a load filled as transformers marks what ``from_pretrained`` loaded (``_is_hf_initialized``),
    so a later ``initialize_weights()`` of the user's leaves them as they are."""
    for tensor in tensors:
        setattr(tensor, _FLAG, True)


@torch.no_grad()
def recreate_buffers(model: nn.Module) -> list[str]:
    """Recompute ``model``'s non-persistent buffers after a load; return the names nothing re-created.

    A transformers model goes through its own ``initialize_weights()`` (as ``from_pretrained`` does), with every
    parameter and persistent buffer marked initialized for the call, so only the unmarked non-persistent
    buffers are written. Any other module has no way to recompute them: all its non-persistent buffers are
    returned.
    """
    buffers = list(non_persistent_buffers(model))
    if not buffers:
        return []
    if not is_transformers_model(model) or not hasattr(model, "initialize_weights"):
        return [name for name, _ in buffers]
    versions = {id(b): b._version for _, b in buffers}
    marked: list[torch.Tensor] = []
    for tensor in model.state_dict(keep_vars=True).values():  # parameters and persistent buffers
        if not _flagged(tensor):
            setattr(tensor, _FLAG, True)
            marked.append(tensor)
    # A module's own flag, in its own __dict__: a forwarding wrapper (activation checkpointing's
    # CheckpointWrapper, torch.compile's OptimizedModule) answers getattr with its inner module's.
    modules_before = {id(m) for m in model.modules() if m.__dict__.get(_FLAG, False)}
    try:
        if not _initialize_owners(model) or any(b._version == versions[id(b)] for _, b in buffers):
            model.initialize_weights()  # type: ignore[operator]
    except Exception as exc:  # an init that cannot run on this layout (a buffer made a DTensor...)
        log.warning("could not re-create the non-persistent buffers with initialize_weights(): %s", exc)
    finally:
        for tensor in marked:
            delattr(tensor, _FLAG)
        for module in model.modules():  # leave a later initialize_weights() of the user's free to run
            if id(module) not in modules_before and _FLAG in module.__dict__:
                delattr(module, _FLAG)
    live = dict(non_persistent_buffers(model))
    return [name for name, b in buffers if live.get(name) is b and b._version == versions[id(b)]]


def _initialize_owners(model: nn.Module) -> bool:
    """The model's own init applied to just the modules that hold a non-persistent buffer, each through the
    ``PreTrainedModel`` that ``initialize_weights()`` would dispatch it to (its nearest ``PreTrainedModel``,
    itself included), under transformers' guard of the ``torch.nn.init`` functions, as ``initialize_weights()``
    runs it. Same writes for those modules; the walk through every other module (all marked initialized, so
    their init writes nothing) is skipped: that walk was most of ``recreate_buffers``, ~40 us a module (3.5 ms of
    a 20 ms warm load of an 85-module Llama; tens of thousands of modules in a large MoE). False when this
    transformers has no such per-module entry point (the caller then runs ``initialize_weights()``); the caller
    also falls back when some buffer was not written (an init that fills a child's buffer from its parent)."""
    cls = _pretrained_model_class()
    try:
        from transformers import initialization
    except ImportError:  # pragma: no cover - depends on the environment
        return False
    guard = getattr(initialization, "guard_torch_init_functions", None)
    if cls is None or guard is None or not hasattr(cls, "_initialize_weights") or not hasattr(cls, "is_custom_code"):
        return False
    owners: list[tuple[Any, nn.Module]] = []

    def walk(module: nn.Module, owner: Any) -> None:
        if isinstance(module, cls):
            owner = module
        for child in module.children():
            walk(child, owner)
        if any(module._buffers.get(name) is not None for name in module._non_persistent_buffers_set):
            owners.append((owner, module))  # children first, as initialize_weights() goes

    walk(model, model)
    with torch.no_grad(), guard():
        for owner, module in owners:
            owner._initialize_weights(module, owner.is_custom_code())
    return True


@torch.no_grad()
def initialize_missing(model: nn.Module) -> None:
    """Initialize what no load filled in a model that nobody else initialized (``from_pretrained``'s, fresh from
    ``to_empty``): the model's own ``initialize_weights()`` writes every parameter and buffer without the
    ``_is_hf_initialized`` flag that ``load`` sets on what it filled, as transformers' ``from_pretrained``
    initializes its missing keys. The flags it leaves on modules are removed (a later call of the user's runs
    in full). Not for ``load`` into a user's model: what the user holds there is theirs."""
    if not is_transformers_model(model) or not hasattr(model, "initialize_weights"):
        return
    before = {id(m) for m in model.modules() if m.__dict__.get(_FLAG, False)}
    try:
        model.initialize_weights()  # type: ignore[operator]
    finally:
        for module in model.modules():
            if id(module) not in before and _FLAG in module.__dict__:
                delattr(module, _FLAG)
