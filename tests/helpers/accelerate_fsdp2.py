"""accelerate's FSDP2 on CPU gloo ranks, as the accelerate and PEFT tests use it."""

from __future__ import annotations

import os
from typing import Any

import torch


def fsdp2_accelerator() -> Any:
    """This process's ``Accelerator``, set to FSDP2 for real: on CPU accelerate would otherwise pick DDP. A second
    call in the same process returns an ``Accelerator`` over the state the first one set."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    if AcceleratorState._shared_state.get("distributed_type") == DistributedType.FSDP:
        return Accelerator()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    accelerator = Accelerator(fsdp_plugin=plugin, cpu=True)
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    assert accelerator.is_fsdp2
    return accelerator
