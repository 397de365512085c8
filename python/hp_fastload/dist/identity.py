"""Checkpoint identity across ranks: each rank's view of the files (names, sizes, header digests) and a sample of data
blocks, compared once per load so ranks reading different copies raise ``CheckpointMismatchError`` instead of
loading different values. The ranks exchange a fixed-size digest of their identity; the identities themselves
travel only when the digests differ, to say what differs.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch

from hp_fastload import errors
from hp_fastload.dist.agree import agree, gather_digests
from hp_fastload.runtime import dist_active, interrupts_deferred
from hp_fastload.source.index import CheckpointIndex
from hp_fastload.source.location import Location
from hp_fastload.source.objstore import ObjectLocation, checkpoint_identity

#: Blocks of data the ranks compare (``_content_sample``), and their size.
SAMPLE_BLOCKS = 64


SAMPLE_BYTES = 4096

#: Size of the identity digest the ranks exchange.
DIGEST_BYTES = 16


def _content_sample(index: CheckpointIndex, root: Path) -> str:
    """A digest of :data:`SAMPLE_BLOCKS` blocks of :data:`SAMPLE_BYTES` spread evenly over the data
    sections of every file (in name order): two fine-tunes of one architecture have equal headers and
    sizes, and differ in every block. 64 small reads per rank, whatever the checkpoint's size."""
    files = sorted(index.files, key=lambda f: os.path.relpath(f.path, root))
    spans = [(f.path, f.header.data_start, f.file_size) for f in files if f.file_size > f.header.data_start]
    total = sum(end - start for _, start, end in spans)
    digest = hashlib.blake2b(digest_size=16)
    if total == 0:
        return digest.hexdigest()
    wanted = sorted(total * (2 * k + 1) // (2 * SAMPLE_BLOCKS) for k in range(SAMPLE_BLOCKS))
    seen, k = 0, 0
    for path, start, end in spans:
        size = end - start
        positions = []
        while k < len(wanted) and wanted[k] < seen + size:
            positions.append(start + wanted[k] - seen)
            k += 1
        seen += size
        if not positions:
            continue
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a regular file: its header was just read
        try:
            for at in positions:
                digest.update(os.pread(fd, min(SAMPLE_BYTES, end - at), at))
        finally:
            os.close(fd)
    return digest.hexdigest()


def _checkpoint_identity(location: Location, index: CheckpointIndex) -> tuple[list[tuple[str, int, int]], str]:
    """What makes two resolved checkpoints the same one: each file's name relative to the location, its
    size and its header digest (computed by the header parser from the bytes it read), and a digest of a
    sample of the data (``_content_sample``). Where the files are is not part of it: node-local copies of
    one checkpoint agree. Objects compare their ETags instead of a data sample (an ETag names the content)."""
    if isinstance(location, ObjectLocation):
        return checkpoint_identity(location, index.files)
    root = location if location.is_dir() else location.parent
    files = sorted((os.path.relpath(f.path, root), f.file_size, f.header.digest) for f in index.files)
    return files, _content_sample(index, root)


def identity_of(location: Location, index: CheckpointIndex) -> Any:
    """This rank's checkpoint identity (``_checkpoint_identity``) for :func:`agree_checkpoint`, None without
    peers to compare with. Reads the data sample: call it inside an agreement's step (``load`` computes it in
    the step that opens the index), so a rank whose read fails makes every rank raise there."""
    if not dist_active() or torch.distributed.get_world_size() == 1:
        return None
    return _checkpoint_identity(location, index)


def agree_checkpoint(location: Location, index: CheckpointIndex, identity: Any = None) -> None:
    """Every rank raises :class:`~hp_fastload.CheckpointMismatchError` unless all ranks' checkpoints have the
    same identity (``_checkpoint_identity``), naming rank 0's location and each other rank's.

    One all-gather of a 16-byte digest per rank when they agree (the common case: a job of 1,024 ranks over a
    163-file checkpoint would otherwise send every rank every other rank's 163 names and digests); the
    identities are gathered only to word the error. ``identity``: this rank's, from :func:`identity_of` in an
    agreement already made (else computed here, in an agreement of its own)."""
    if not dist_active() or torch.distributed.get_world_size() == 1:
        return
    stage = "Comparing the ranks' checkpoints"
    if identity is None:  # computed under agree: a rank whose sample read fails must not leave the others waiting
        identity = agree(stage, lambda: _checkpoint_identity(location, index))
    digest = hashlib.blake2b(repr(identity).encode(), digest_size=DIGEST_BYTES).digest()
    if len(set(gather_digests(stage, digest))) == 1:
        return
    mine = (str(location.absolute()), identity)
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    with interrupts_deferred():
        torch.distributed.all_gather_object(gathered, mine)
    reference_location, reference = gathered[0]
    differing = [(rank, where, ident) for rank, (where, ident) in enumerate(gathered) if ident != reference]
    if not differing:
        return
    lines = []
    for rank, where, ident in differing[:4]:
        ours, theirs = ({n: (s, d) for n, s, d in files} for files in (reference[0], ident[0]))
        what = next(
            (
                f"{n}: {'missing' if n not in theirs else 'absent on rank 0' if n not in ours else 'differs'}"
                for n in sorted(ours.keys() | theirs.keys())
                if ours.get(n) != theirs.get(n)
            ),
            "the tensor data",
        )
        lines.append(f"rank {rank} resolved {where} (first difference: {what})")
    more = f" and {len(differing) - 4} more ranks" if len(differing) > 4 else ""
    raise errors.CheckpointMismatchError(
        f"the ranks resolved different checkpoints: rank 0 resolved {reference_location}, "
        + "; ".join(lines)
        + more
        + " (files, sizes, headers or sampled data differ). Pass every rank the same checkpoint (an absolute "
        "path, or identical node-local copies)"
    )
