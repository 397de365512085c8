"""Facts about the running process that every layer may ask: whether a default process group is up, whether
this is its rank 0, the one pause of the cyclic garbage collector around bulk work, and the deferral of SIGINT
around collectives that must not be left half done.

Owns no policy: what to do with several ranks (agreement, sharing) lives in ``hp_fastload.dist``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["dist_active", "gc_paused", "interrupts_deferred", "is_rank0", "node_of", "world_size"]


def dist_active() -> bool:
    """A default process group with real peers is initialized. torch's ``fake`` backend (one process
    standing in for a rank of a large job, as dry runs and rehearsals use) has no peers to agree with."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    return torch.distributed.get_backend() != "fake"


def world_size() -> int:
    """Ranks of the default process group; 1 without one."""
    return torch.distributed.get_world_size() if dist_active() else 1


def node_of(rank: int) -> int:
    """The node of ``rank`` as torchrun lays ranks out: ``rank // $LOCAL_WORLD_SIZE`` (0 without it)."""
    env = os.environ.get("LOCAL_WORLD_SIZE", "")
    per = int(env) if env.isdigit() and int(env) > 0 else 0
    return rank // per if per else 0


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


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold a SIGINT that arrives inside the block and raise its ``KeyboardInterrupt`` when the block is done.

    For work that must not stop half way: an object collective (``all_gather_object`` is two collectives; a
    ``KeyboardInterrupt`` between them would leave this rank one collective behind its peers for good) and the
    renames that publish a save. Only on the main thread with Python's default SIGINT handler (elsewhere, or
    under a handler of the user's, the block runs as it is)."""
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    held: list[Any] = []
    signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if held:
        raise KeyboardInterrupt


def env_seconds(name: str, default: float) -> float:
    """The environment variable ``name`` as a positive number of seconds, ``default`` where it is unset or empty;
    a ``ValueError`` naming the variable otherwise."""
    raw = os.environ.get(name, "")
    try:
        value = float(raw) if raw else default
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from None
    if not value > 0:
        raise ValueError(f"{name}={raw!r} must be a positive number of seconds")
    return value
