"""The process group that carries host-memory messages between the ranks (the job-wide delivery's ``isend`` /
``irecv`` of CPU tensors).

A trainer on GPUs usually starts ``init_process_group("nccl")``: its default group has no backend for CPU
tensors, and a point-to-point of a host buffer on it fails ("No backend type associated with device type cpu").
Torch's object collectives (the agreements) move their bytes to the current GPU and need nothing here. The
delivery's messages are host bytes, so they go over the default group when it carries CPU tensors (gloo, or
``"cpu:gloo,cuda:nccl"``), else over a gloo group of every rank, created once per default group.
"""

from __future__ import annotations

from typing import Any

import torch

#: (default group, its gloo group): the one group made for the current default group.
_made: tuple[Any, Any] | None = None


def _carries_cpu(group: Any) -> bool:
    """Whether ``group`` has a backend for CPU tensors (a group that does not say is assumed to)."""
    types = getattr(group, "_device_types", None)
    return types is None or torch.device("cpu") in types


def host_message_group() -> Any:
    """The group for CPU-tensor messages between every rank of the default group: None (the default group)
    when that group carries CPU tensors, else a gloo group over every rank, made on the first call for this
    default group. Every rank must call it at the same point: making a group is a collective."""
    global _made
    import torch.distributed as dist

    default = dist.distributed_c10d._get_default_group()
    if _carries_cpu(default):
        return None
    if _made is None or _made[0] is not default:  # a group of a destroyed default group is not reused
        _made = (default, dist.new_group(backend="gloo"))
    return _made[1]
