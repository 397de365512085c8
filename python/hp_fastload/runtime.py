"""Facts about the running process that every layer may ask: whether a default process group is up, whether
this is its rank 0, and the one pause of the cyclic garbage collector around bulk work.

Owns no policy: what to do with several ranks (agreement, sharing) lives in ``hp_fastload.dist``.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import torch

__all__ = ["dist_active", "gc_paused", "is_rank0", "world_size"]


def dist_active() -> bool:
    """A default process group with real peers is initialized. torch's ``fake`` backend (one process
    standing in for a rank of a large job, as dry runs and rehearsals use) has no peers to agree with."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    return torch.distributed.get_backend() != "fake"


def world_size() -> int:
    """Ranks of the default process group; 1 without one."""
    return torch.distributed.get_world_size() if dist_active() else 1


def is_rank0() -> bool:
    """True on rank 0 of the default process group, and in a process without one."""
    return not dist_active() or torch.distributed.get_rank() == 0


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector, restored to its previous state on exit (so nested pauses are free).

    Packing or planning tens of thousands of tensors allocates ~10^5 small objects, and each full collection
    they trigger walks everything the process holds (a model, torch's modules) for nothing. The public entry
    points (``load``, ``plan``, ``save``, ``read_many``) pause once; the layers below do not pause again.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
