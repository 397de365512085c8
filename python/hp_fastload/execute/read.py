"""Execution: a ``LoadPlan`` -> bytes in the targets' local shards. Decides nothing.

Owns: feeding each target's ``Reads`` to ``batch.Batch`` (one ``_core.execute`` call per batch, GIL
released), temporary buffers for items with elementwise post-ops or casts the engine does not do, pinned
staging with non-blocking host-to-device copies for CUDA targets (double-buffered, bounded by a budget),
and the deferred groups (whole sources read by the engine, converted with torch, sliced locally — or, for
the legacy loader, cut with ``distribute_tensor``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import torch

from hp_fastload.convert.quant import Dequant
from hp_fastload.convert.symbolic import apply_post
from hp_fastload.errors import PlanError
from hp_fastload.execute.batch import ENGINE_FLOATS, Batch, engine_casts
from hp_fastload.execute.staging import DEFAULT_BATCH_BYTES, DEFAULT_STAGING_BYTES, LoadStager, staging_chunks
from hp_fastload.model.targets import Target
from hp_fastload.planning.context import LoadContext
from hp_fastload.planning.items import DeferredGroup, LoadPlan, Reads
from hp_fastload.source.index import CheckpointIndex


@dataclass
class ExecStats:
    """What executing a plan did on this rank: bytes its reads took from storage, engine calls, items; with
    sharing (``execute.job``, ``dist.share``), the bytes it sent to and received from its peers."""

    bytes_read: int = 0
    engine_calls: int = 0
    items: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _box_view(tensor: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    view = tensor
    for d, (o, n) in enumerate(zip(offsets, lengths, strict=True)):
        view = view.narrow(d, o, n)
    return view


def add_target_items(
    batch: Batch,
    target: Target,
    reads: Reads,
    stager: LoadStager | None,
    stage: bool = False,
    local: torch.Tensor | None = None,
) -> None:
    """Packs ``reads`` into ``local`` (the target's local tensor, or a block of its rows for staging)."""
    if local is None:
        local = target.local()
    dest = local
    if local.device.type == "cuda" or stage:
        assert stager is not None
        staging = stager.staging_for(local)
        dest = staging
        batch.keep.append(staging)
        batch.after.append(lambda: stager.copy(local, staging))
    elif local.device.type != "cpu":
        raise PlanError(f"{target.names[0]}: targets on {local.device} are not supported (cpu or cuda)")
    assert batch.locate is not None
    located = list(map(batch.locate, reads.keys))
    casts = {dtype: engine_casts(dtype, dest.dtype) for dtype in set(map(attrgetter("dtype"), located))}
    seconds = reads.second if reads.second is not None else (None,) * len(reads)
    # a source with a second source is dequantized by the engine into any float destination (MXFP4 blocks
    # are uint8 as stored: no plain cast covers them)
    dequantizes = dest.dtype in ENGINE_FLOATS
    if reads.post is None and (
        all(casts.values())
        or (dequantizes and all(casts[w.dtype] or s is not None for w, s in zip(located, seconds, strict=True)))
    ):  # the usual case: every box straight into the destination
        batch.add_reads(reads, dest, located)
        return
    posts = reads.post if reads.post is not None else ((),) * len(reads)
    direct: list[int] = []
    for i, (item, where, second) in enumerate(zip(reads, located, seconds, strict=True)):
        if not posts[i] and (casts[where.dtype] or (second is not None and dequantizes)):
            direct.append(i)
            continue
        # a dequantized source is read as float32 (the engine applies its scale), then post-ops, then cast
        temp = torch.empty(item.lengths, dtype=torch.float32 if second is not None else where.dtype)
        batch.add(
            item.source, item.storage_base, item.storage_strides, item.lengths, temp, (0,) * len(item.lengths), second
        )
        batch.keep.append(temp)
        view = _box_view(dest, item.dest_offsets, item.lengths)

        def finish(view: torch.Tensor = view, temp: torch.Tensor = temp, post: tuple[Any, ...] = item.post) -> None:
            view.copy_(apply_post(temp, post) if post else temp)

        # post-ops must run before a device copy of the same staging buffer: insert ahead of it
        batch.after.insert(len(batch.after) - (1 if dest is not local else 0), finish)
    if direct:
        batch.add_reads(reads.take(direct), dest, [located[i] for i in direct])


def read_whole(
    index: CheckpointIndex,
    keys: Sequence[str],
    threads: int | None,
    backend: str | None,
    stats: ExecStats,
    dequant: Mapping[str, Dequant] | None = None,
) -> dict[str, torch.Tensor]:
    """Whole checkpoint tensors as fresh CPU tensors, in one engine call; the ``dequant`` keys dequantized
    into float32 (the converter's layout ops then run on exact values, rounded once into the target)."""
    batch = Batch(index.locate)
    dequant = dequant or {}
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        if key in out:
            continue
        entry = index.locate(key)
        second = dequant.get(key)
        tensor = torch.empty(entry.shape, dtype=torch.float32 if second is not None else entry.dtype)
        out[key] = tensor
        strides = tuple(tensor.stride())
        batch.add(key, 0, strides, entry.shape, tensor, (0,) * len(entry.shape), second)
    batch.run(threads, backend, stats)
    return out


def _copy_local_from_full(target: Target, full: torch.Tensor, legacy: bool) -> None:
    local = target.local()
    if legacy and target.is_dtensor:
        from torch.distributed.tensor import distribute_tensor

        dt: Any = target.tensor
        shard = distribute_tensor(full, dt.device_mesh, dt.placements, src_data_rank=None).to_local()
        if tuple(shard.shape) != tuple(local.shape):
            raise PlanError(
                f"Local shape mismatch for {target.names[0]}: checkpoint shard {tuple(shard.shape)} "
                f"vs target {tuple(local.shape)}"
            )
        local.copy_(shard)
        return
    for goff, glen, loff in target.region.boxes():
        _box_view(local, loff, glen).copy_(_box_view(full, goff, glen))


def _run_deferred(
    deferred: DeferredGroup,
    compute: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
    context: LoadContext,
    legacy: bool,
    threads: int | None,
    backend: str | None,
    stats: ExecStats,
    dequant: Mapping[str, Dequant] | None = None,
) -> None:
    sources = read_whole(context.index, deferred.keys, threads, backend, stats, dequant)
    outputs = compute(sources)
    for name, target_name in deferred.claims.items():
        with torch.no_grad():
            _copy_local_from_full(context.target(target_name), outputs[name], legacy)


def execute_plan(
    plan: LoadPlan,
    context: LoadContext,
    *,
    legacy: bool = False,
    threads: int | None = None,
    backend: str | None = None,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    progress: Callable[[int], None] | None = None,
    skip: Collection[str] = frozenset(),
    stage_all: bool = False,
) -> ExecStats:
    """Fill the plan's targets (``context``: the live side ``plan_load`` returned with it). ``progress(nbytes)``
    is called after each batch.

    ``skip`` names region targets another replica reads (``share.plan_replicas``); they are left untouched.
    CUDA targets go through the double-buffered ``LoadStager`` (``staging_bytes`` in all); ``stage_all`` sends
    CPU targets through it too (tests exercise the staging path on machines without a GPU).
    """
    stats = ExecStats()
    index = context.index
    targets = {name: context.target(name) for name in plan.region_reads}
    with torch.no_grad():
        staged = stage_all or any(t.local().device.type == "cuda" for t in targets.values())
    stager = LoadStager(staging_bytes) if staged else None
    batch = Batch(index.locate)

    def flush() -> None:
        nonlocal batch
        done = batch.nbytes
        batch.run(threads, backend, stats)
        if stager is not None:
            stager.flip()
        if progress and done:
            progress(done)
        batch = Batch(index.locate)

    with torch.no_grad():
        for name, items in plan.region_reads.items():
            if not items or name in skip:
                continue
            target = targets[name]
            stage = stager is not None and (stage_all or target.local().device.type == "cuda")
            if not stage or stager is None:
                add_target_items(batch, target, items, stager)
                if batch.nbytes >= batch_bytes:
                    flush()
                continue
            for rows, row_items in staging_chunks(target.local(), items, stager.slab_bytes):
                if not stager.fits(rows):
                    flush()
                add_target_items(batch, target, row_items, stager, True, rows)
                if batch.nbytes >= batch_bytes:
                    flush()
        flush()
        if stager is not None:
            stats.extra["staging_bytes"] = stager.allocated
        for deferred, compute in zip(plan.deferred, context.computes, strict=True):
            before = stats.bytes_read
            _run_deferred(deferred, compute, context, legacy, threads, backend, stats, plan.dequant)
            if progress:
                progress(stats.bytes_read - before)
    if stager is not None:
        stager.finish()
    return stats
