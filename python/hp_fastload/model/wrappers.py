"""Module wrappers that hide a model's own class or names: ``torch.compile`` (``_orig_mod``), activation checkpointing
(``_checkpoint_wrapped_module``) and FSDP2's dynamic subclasses; ``unwrapped`` and ``own_class`` see through them.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

#: Child names of forwarding wrappers that no checkpoint has, dropped from target names as torch's own
#: ``get_model_state_dict`` drops them: ``torch.compile``'s ``_orig_mod`` (torchtitan compiles each block) and
#: activation checkpointing's ``_checkpoint_wrapped_module``. Both wrappers forward attribute lookups, so
#: ``model.get_parameter`` of the name without them still reaches the tensor.
WRAPPED_CHILDREN = frozenset({"_orig_mod", "_checkpoint_wrapped_module"})


def own_class(module: Any) -> type:
    """The class ``module`` was built as, under any class-swapping wrapper.

    ``fully_shard`` (FSDP2) and the composable ``replicate`` replace a module's class with a generated
    ``type(f"FSDP{cls.__name__}", (FSDPModule, cls), ...)``. Such a class is recognized by its shape (two bases,
    the first from ``torch.distributed``, its name the second's name behind a prefix) and peeled off, as many
    times as the wrappers were stacked. Any other class is returned as it is.
    """
    cls = type(module)
    while True:
        bases = cls.__bases__
        if len(bases) != 2:
            return cls
        wrapper, inner = bases
        if not (
            getattr(wrapper, "__module__", "").startswith("torch.distributed")
            and cls.__name__ != inner.__name__
            and cls.__name__.endswith(inner.__name__)
        ):
            return cls
        cls = inner


def unwrapped(model: Any) -> Any:
    """The module a forwarding wrapper holds, under any number of them: ``torch.compile``'s ``OptimizedModule``
    (``_orig_mod``) and ``DistributedDataParallel`` (``module``). Their parameters are the inner module's own
    tensors under a prefix (``_orig_mod.``, ``module.``) that no checkpoint has, and the inner module is what
    the conversion rules are looked up on; loading into it writes the same tensors. Class-swapping wrappers
    (``fully_shard``) keep the names and are handled by :func:`own_class`."""
    from torch.nn.parallel import DistributedDataParallel

    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # never imported: nothing was compiled
    compiled: Any = getattr(eval_frame, "OptimizedModule", None)
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif compiled is not None and isinstance(model, compiled) and isinstance(model._orig_mod, torch.nn.Module):
            model = model._orig_mod
        else:
            return model
