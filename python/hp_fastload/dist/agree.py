"""The agreement protocol: every rank runs a step, the outcomes are all-gathered, and a failure on any rank is raised
on every rank with the failing rank named; a peer missing from the collective is reported as such rather than left
to hang.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from hp_fastload import errors
from hp_fastload.convert.quant import QuantizationError
from hp_fastload.runtime import dist_active
from hp_fastload.source.location import Location, resolve_checkpoint_location

_REBUILDABLE: dict[str, type[BaseException]] = {
    cls.__name__: cls
    for cls in (
        ValueError,
        TypeError,
        RuntimeError,
        KeyError,
        FileNotFoundError,
        PermissionError,
        OSError,
        NotImplementedError,
        errors.HpFastloadError,
        errors.MissingKeysError,
        errors.HeaderError,
        errors.PlanError,
        errors.ReadError,
        errors.TargetError,
        QuantizationError,
        errors.CheckpointMismatchError,
    )
}


def agree(stage: str, fn: Callable[[], Any], call: str = "hp_fastload.load (or from_pretrained)") -> Any:
    """Run ``fn`` on every rank; if it fails on any rank, every rank raises (same type where possible).
    ``call``: the entry point every rank must be in, for the message when a peer is absent."""
    result = None
    failure: BaseException | None = None
    try:
        result = fn()
    except Exception as exc:
        failure = exc
    if not dist_active():
        if failure is not None:
            raise failure
        return result
    payload = None if failure is None else (type(failure).__name__, str(failure))
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    _waiting(stage, lambda: torch.distributed.all_gather_object(gathered, payload), call)
    if failure is not None:
        raise failure
    for rank, item in enumerate(gathered):
        if item is not None:
            name, message = item
            cls = _REBUILDABLE.get(name)
            text = f"{stage} failed on rank {rank}: {name}: {message}"
            if cls is not None and issubclass(cls, Exception):
                raise cls(text)
            raise RuntimeError(text)
    return result


_COLLECTIVE_FAILURES = ("gloo", "nccl", "connection closed", "connection reset", "timed out", "timeout", "processgroup")


def _waiting(stage: str, collective: Callable[[], Any], call: str = "hp_fastload.load (or from_pretrained)") -> Any:
    """Run a collective of ``load``; when it fails because another rank is not there, say so.

    Every rank of the default process group must call ``load`` together: a rank that skipped the call, failed
    before it or exited leaves the others waiting in their first collective until the peer's connection closes
    or the process group's timeout (``init_process_group(timeout=...)``) expires.
    """
    try:
        return collective()
    except RuntimeError as exc:
        distributed = getattr(torch.distributed, "DistError", ())
        if not (isinstance(exc, distributed) or any(m in str(exc).lower() for m in _COLLECTIVE_FAILURES)):
            raise
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        raise RuntimeError(
            f"{call.split()[0]}: rank {rank} of {world} waited for the other ranks while {stage.lower()} and "
            f"the collective failed ({str(exc).splitlines()[0][:300]}). Every rank of the default process group "
            f"must call {call} together; a rank that skipped the call, failed before it or exited makes the "
            "others wait until the process group's timeout"
        ) from exc


def agree_digest(stage: str, digest: str, hint: str) -> None:
    """Every rank compares ``digest`` (one all-gather of a short string): a ``PlanError`` on every rank naming
    the ranks whose value differs from rank 0's, followed by ``hint``."""
    if not dist_active():
        return
    digests: list[Any] = [None] * torch.distributed.get_world_size()
    _waiting(stage, lambda: torch.distributed.all_gather_object(digests, digest))
    differing = [r for r, d in enumerate(digests) if d != digests[0]]
    if differing:
        raise errors.PlanError(f"{stage}: the ranks disagree (rank 0 vs ranks {differing[:8]}): {hint}")


def resolve_location_each(path: str | os.PathLike[str], revision: str | None) -> Location:
    """Every rank resolves its own ``path`` (a relative path against its own working directory): rank 0
    first, then the others, a Hub id from the cache rank 0 has just filled when they share it. A failure on
    any rank makes every rank raise. The ranks' checkpoints are compared later (``_agree_checkpoint``)."""
    if not dist_active() or torch.distributed.get_world_size() == 1:
        return resolve_checkpoint_location(path, revision=revision)
    first = torch.distributed.get_rank() == 0
    location = agree(
        "Resolving the checkpoint on rank 0",
        lambda: resolve_checkpoint_location(path, revision=revision) if first else None,
    )
    resolved: Location = agree(
        "Resolving the checkpoint",
        lambda: location if first else resolve_checkpoint_location(path, revision=revision, cache_first=True),
    )
    return resolved


def raised_on(stage: str, rank: int, name: str, message: str) -> Exception:
    """The exception every rank raises for a step that failed on ``rank`` with ``name: message`` (the same type
    where it is one of the rebuildable types, else ``RuntimeError``)."""
    cls = _REBUILDABLE.get(name)
    text = f"{stage} failed on rank {rank}: {name}: {message}"
    if cls is not None and issubclass(cls, Exception):
        return cls(text)
    return RuntimeError(text)
