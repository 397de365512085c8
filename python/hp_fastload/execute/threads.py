"""Engine threads per rank: the cores this process may run on, shared by the ranks of its node."""

from __future__ import annotations

import os

import hp_fastload._core as _core


def threads_per_rank() -> int:
    """Engine threads for one rank of a job: the cores this process may run on, shared by the ranks of its
    node (``LOCAL_WORLD_SIZE``, set by torchrun), at least 1 and at most ``_core.DEFAULT_THREADS``.

    Ranks on one node share the cores; two ranks with a thread per core each oversubscribe them.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        cores = os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, min(_core.DEFAULT_THREADS, cores // local))
