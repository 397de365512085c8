"""Optional sharing of replicated regions: one replica reads, the others receive a broadcast.

Owns the choice, per region target, of the replica group that shares it (the first mesh dim on which the
DTensor is ``Replicate``, of size > 1), the reader in each group (its first rank), and the batched broadcast
after the read phase: every target of a group is packed into byte buffers of at most ``bucket_bytes`` and each
buffer is one ``broadcast`` (no collective per tensor). Off by default (``load(..., share="replicated")``, or the
older ``share_replicated=True``): on one node the replicas share the page cache and a local copy beats a broadcast
(docs/perf-notes.md); it pays when replicas sit on different nodes and storage, not memory, is the bottleneck.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hp_fastload.model.targets import Target

DEFAULT_BUCKET_BYTES = 256 << 20


@dataclass
class ReplicaGroup:
    """Targets replicated along one mesh dim; ``reader`` is the global rank that reads them."""

    group: Any
    reader: int
    targets: list[Target] = field(default_factory=list)


@dataclass
class ReplicaPlan:
    """Which region targets this rank skips (another replica reads them) and the groups to broadcast in."""

    skip: set[str] = field(default_factory=set)
    groups: list[ReplicaGroup] = field(default_factory=list)


def _replica_dim(target: Target) -> int | None:
    from torch.distributed.tensor import Replicate

    if not target.is_dtensor or target.placements is None or target.mesh_shape is None:
        return None
    for i, (placement, size) in enumerate(zip(target.placements, target.mesh_shape, strict=True)):
        if isinstance(placement, Replicate) and size > 1:
            return i
    return None


def plan_replicas(targets: Iterable[Target]) -> ReplicaPlan:
    """Group replicated targets by (mesh, replicate dim); every rank of a group builds the same list.

    Targets come in planning order, which is the same on every rank (model order), so the groups' target lists
    agree without any exchange.
    """
    plan = ReplicaPlan()
    by_key: dict[tuple[int, int], ReplicaGroup] = {}
    rank = dist.get_rank()
    for target in targets:
        dim = _replica_dim(target)
        if dim is None or target.region.is_empty:
            continue
        mesh = target.tensor.device_mesh  # type: ignore[attr-defined]
        key = (id(mesh), dim)
        entry = by_key.get(key)
        if entry is None:
            group = mesh.get_group(dim)
            entry = by_key[key] = ReplicaGroup(group, dist.get_process_group_ranks(group)[0])
            plan.groups.append(entry)
        entry.targets.append(target)
        if entry.reader != rank:
            plan.skip.add(target.names[0])
    return plan


def _buckets(targets: list[Target], bucket_bytes: int) -> Iterable[list[Target]]:
    bucket: list[Target] = []
    size = 0
    for target in targets:
        nbytes = target.local().numel() * target.local().element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append(target)
        size += nbytes
    if bucket:
        yield bucket


def broadcast_replicas(plan: ReplicaPlan, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
    """Broadcast each group's targets from its reader; returns the bytes this rank received."""
    rank = dist.get_rank()
    received = 0
    with torch.no_grad():
        for entry in plan.groups:
            for bucket in _buckets(entry.targets, bucket_bytes):
                locals_ = [t.local() for t in bucket]
                device = locals_[0].device
                flats = [t.contiguous().view(-1).view(torch.uint8) for t in locals_]
                buffer = (
                    torch.cat(flats)
                    if rank == entry.reader
                    else torch.empty(sum(f.numel() for f in flats), dtype=torch.uint8, device=device)
                )
                dist.broadcast(buffer, src=entry.reader, group=entry.group)
                if rank != entry.reader:
                    offset = 0
                    for local, flat in zip(locals_, flats, strict=True):
                        piece = buffer[offset : offset + flat.numel()]
                        dense = local if local.is_contiguous() else torch.empty_like(local)
                        dense.view(-1).view(torch.uint8).copy_(piece)  # bytes: no alignment needed
                        if dense is not local:
                            local.copy_(dense)
                        offset += flat.numel()
                    received += buffer.numel()
    return received
