"""Integrations with the training frameworks over the public calls: a transformers ``Trainer`` callback that
fills the model after accelerate has prepared it, and an accelerate helper that builds, prepares and fills a
model in one call (re-exported as ``hp_fastload.integrations``).

Owns what each framework needs around ``load`` / ``from_pretrained``: when to load (after ``prepare``, not
over a resumed checkpoint), which settings to refuse (a model still on the meta device, accelerate's
``cpu_ram_efficient_loading``), and the optimizer's parameters after accelerate's FSDP2 ``prepare`` of a meta
model (accelerate maps them by data pointer, which every meta parameter shares). Reads nothing itself.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from hp_fastload.api.load import load
from hp_fastload.api.pretrained import from_pretrained, refuse_rank0_broadcast
from hp_fastload.errors import TargetError
from hp_fastload.model.wrappers import unwrapped
from hp_fastload.planning.items import LoadReport
from hp_fastload.runtime import is_rank0

try:
    from transformers import TrainerCallback
except ImportError:  # transformers is an optional extra; the callback needs it, the accelerate helper does not
    TrainerCallback = object  # type: ignore[assignment,misc]

__all__ = ["HpFastloadCallback", "prepare_pretrained"]

logger = logging.getLogger(__name__)

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class HpFastloadCallback(TrainerCallback):
    """Fill the Trainer's model from ``path_or_hub_id`` once accelerate has prepared it (``on_train_begin``:
    after FSDP2's ``fully_shard``, before the first step), every rank reading only its own shards.

    ``strict`` as :func:`hp_fastload.load`; the :class:`~hp_fastload.LoadReport` is logged on rank 0 (logger
    ``hp_fastload.api.integrations``, level INFO) and kept as ``callback.report``. A run resumed from a
    checkpoint (``state.global_step > 0``) is left as the Trainer restored it. The model handed to the Trainer
    must hold real memory (``from_config``, or uninitialized under ``transformers.initialization.no_init_weights``):
    on the meta device, accelerate's FSDP2 ``prepare`` would bind every optimizer entry to one parameter.
    """

    def __init__(
        self, path_or_hub_id: str | os.PathLike[str], *, strict: bool = True, revision: str | None = None
    ) -> None:
        self.path = path_or_hub_id
        self.strict = strict
        self.revision = revision
        self.report: LoadReport | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kwargs: Any) -> Any:
        if model is None:
            raise TargetError("HpFastloadCallback: the Trainer passed no model to on_train_begin")
        if getattr(state, "global_step", 0) > 0:
            logger.info("hp_fastload: resumed at step %d, the checkpoint's weights are kept", state.global_step)
            return control
        refuse_rank0_broadcast()
        meta = [name for name, p in unwrapped(model).named_parameters() if p.device.type == "meta"]
        if meta:
            raise TargetError(
                f"{meta[0]}: on the meta device after the Trainer prepared the model ({len(meta)} parameters). "
                "accelerate's FSDP2 prepare maps the optimizer's parameters by data pointer, which every meta "
                "parameter shares, so the optimizer would update one parameter. Give the Trainer a model with "
                "memory (from_config under transformers.initialization.no_init_weights() skips the random init), "
                "or build it with hp_fastload.integrations.prepare_pretrained"
            )
        kwargs_load: dict[str, Any] = {"strict": self.strict}
        if self.revision is not None:
            kwargs_load["revision"] = self.revision
        self.report = load(model, self.path, **kwargs_load)
        if is_rank0():
            logger.info("hp_fastload: %s", self.report.summary())
        return control


def prepare_pretrained(
    accelerator: Any, path_or_hub_id: str | os.PathLike[str], optimizer: OptimizerFactory, **kwargs: Any
) -> tuple[nn.Module, Any]:
    """``(model, optimizer)`` as ``accelerator.prepare(from_pretrained(path), optimizer)`` gives them, without
    any rank holding the full model: under FSDP2 the model is built on the meta device, prepared (sharded) by
    ``accelerator.prepare``, materialized, and each rank reads only its shards.

    ``optimizer``: a factory called with the model's parameters (``lambda params: torch.optim.AdamW(params,
    lr=1e-5)``); its parameters are rebound to the sharded ones by name (accelerate's own mapping goes by data
    pointer, which meta parameters share). ``kwargs`` go to :func:`hp_fastload.from_pretrained` (``dtype``,
    ``auto_class``, ``strict``, config overrides, ...); the model is on ``accelerator.device``, in eval mode as
    transformers' ``from_pretrained`` leaves it; ``peft_config=`` / ``adapter=`` give a PEFT model, prepared by
    accelerate as TRL's ``SFTTrainer(peft_config=...)`` prepares it. Other accelerate setups: DDP and a single
    process load the whole checkpoint on each rank, then ``prepare``; FSDP1, DeepSpeed and Megatron-LM are
    refused.
    """
    from accelerate.utils import DistributedType

    for reserved in ("parallelize", "distributed_config", "device", "output_loading_info"):
        if reserved in kwargs:
            raise TypeError(f"prepare_pretrained sets {reserved} itself")
    refuse_rank0_broadcast()
    kind = accelerator.distributed_type
    if accelerator.is_fsdp2:
        prepared: dict[str, Any] = {}

        def parallelize(model: nn.Module) -> nn.Module:
            opt = optimizer(model.parameters())
            names = _optimizer_names(model, opt)
            model, opt = accelerator.prepare(model, opt)
            _rebind(model, opt, names)
            prepared["optimizer"] = opt
            return model

        model = from_pretrained(path_or_hub_id, parallelize=parallelize, device=accelerator.device, **kwargs)
        return model, prepared["optimizer"]
    if kind in (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        raise ValueError(
            f"prepare_pretrained: accelerate's {kind} is not supported (FSDP1, DeepSpeed and Megatron-LM own the "
            "model's construction); use FSDP2 (FullyShardedDataParallelPlugin(fsdp_version=2))"
        )
    model = from_pretrained(path_or_hub_id, device=accelerator.device, **kwargs)
    model, opt = accelerator.prepare(model, optimizer(model.parameters()))
    return model, opt


def _canonical(model: nn.Module) -> dict[str, nn.Parameter]:
    """The model's parameters by name, without the wrappers' prefixes (activation checkpointing, compile)."""
    from accelerate.utils.fsdp_utils import fsdp2_canonicalize_names

    named: dict[str, nn.Parameter] = fsdp2_canonicalize_names(dict(unwrapped(model).named_parameters()))
    return named


def _optimizer_names(model: nn.Module, opt: torch.optim.Optimizer) -> list[list[str]]:
    name_of = {id(p): name for name, p in _canonical(model).items()}
    names = []
    for group in opt.param_groups:
        unknown = [p for p in group["params"] if id(p) not in name_of]
        if unknown:
            raise ValueError(
                f"prepare_pretrained: the optimizer holds {len(unknown)} tensors that are not the model's parameters"
            )
        names.append([name_of[id(p)] for p in group["params"]])
    return names


def _rebind(model: nn.Module, opt: Any, names: list[list[str]]) -> None:
    """Point each optimizer group at the sharded parameters of the same names."""
    sharded = _canonical(model)
    missing = sorted({name for group in names for name in group} - set(sharded))
    if missing:
        raise TargetError(f"{missing[0]}: not a parameter of the prepared model ({len(missing)} missing)")
    for group, group_names in zip(opt.param_groups, names, strict=True):
        group["params"] = [sharded[name] for name in group_names]
