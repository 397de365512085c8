"""``read_many`` and ``read_into``: batched box reads of safetensors tensors into CPU tensors, one engine call per
batch, the GIL released while it reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hp_fastload.execute.requests import Request, pack_requests
from hp_fastload.runtime import gc_paused
from hp_fastload.source.files import PathOrFile, release_maps


def read_many(
    requests: Sequence[Request],
    threads: int | None = None,
    backend: str | None = None,
    *,
    keep_maps: bool = False,
) -> dict[str, int | str]:
    """Reads many boxes in one engine call.

    Args:
        requests: ``(path_or_file, key, offsets, lengths, out)`` tuples: the box
            ``tensor[offsets[0]:offsets[0]+lengths[0], ...]`` of tensor ``key`` is written into the CPU
            tensor ``out`` of shape ``lengths`` (any strides, any view of a larger tensor), converted to
            ``out.dtype`` when both are floating types. Destinations must not overlap.
        threads: worker threads (default: available parallelism, at most 16).
        backend: ``"auto"`` (default), ``"mmap"`` or ``"pread"``. Use ``"pread"`` for files that may
            change while they are read (network file systems): a mapped file truncated during a read
            faults with SIGBUS, a positioned read reports :class:`~hp_fastload.ReadError`.
        keep_maps: keep the files mapped after the call, for calls that read the same files again (the
            maps are released by :func:`clear_cache`). By default they are released when the call
            returns, so nothing stays mapped (or pins a deleted file) after a read.

    Returns:
        The engine's stats: bytes_copied, bytes_read_from_files, runs, spans, backend, threads.

    Raises:
        RuntimeError: ``out`` requires grad while grad mode is on (like ``torch.Tensor.copy_``).
        PlanError: a request is malformed (unknown key, box outside the tensor, wrong ``out``, impossible
            cast, overlapping destinations); nothing has been written.
        ReadError: a file is shorter than its header says or changed since it was opened.
    """
    from hp_fastload.execute.batch import Batch  # the batch module builds on this one

    with gc_paused():
        files, dests, rows = pack_requests(requests)
    batch = Batch()
    batch.add_records(files, dests, rows)
    try:
        return batch.execute(threads, backend, empty=True)  # type: ignore[return-value]
    finally:
        if not keep_maps:
            release_maps(files)


def read_into(
    path_or_file: PathOrFile,
    key: str,
    offsets: Sequence[int],
    lengths: Sequence[int],
    out: torch.Tensor,
    *,
    threads: int | None = None,
    backend: str | None = None,
    keep_maps: bool = False,
) -> dict[str, int | str]:
    """Reads one box of one tensor into ``out``; see :func:`read_many`."""
    return read_many(
        [(path_or_file, key, offsets, lengths, out)], threads=threads, backend=backend, keep_maps=keep_maps
    )
