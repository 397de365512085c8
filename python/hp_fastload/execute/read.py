"""Execution: a ``LoadPlan`` -> bytes in the targets' local shards. Decides nothing.

Owns: feeding each target's ``Reads`` to ``batch.Batch`` (one ``_core.execute`` call per batch, GIL
released), temporary buffers for items with elementwise post-ops or casts the engine does not do, pinned
staging with non-blocking host-to-device copies for CUDA targets (double-buffered, bounded by a budget),
and the deferred groups (whole sources read by the engine, converted with torch, sliced locally — or, for
the legacy loader, cut with ``distribute_tensor``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
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


#: a batch this large that has waited ``OVERLAP_SECONDS`` for more targets is handed to an idle engine without
#: waiting for ``batch_bytes`` (``execute_stream``): the engine reads the first targets while the next are
#: planned and packed. A plan made faster than that (a dense model's) stays one call.
OVERLAP_BYTES = 1 << 20
OVERLAP_SECONDS = 0.002


@dataclass
class Overlap:
    """Where ``execute_stream`` spent the time of its plan iterator (the region intersections made while
    reading): ``exposed`` with no engine call running (on the critical path), ``hidden`` while one ran."""

    exposed: float = 0.0
    hidden: float = 0.0

    def add(self, steps: Sequence[tuple[float, float]], calls: Sequence[tuple[float, float]]) -> None:
        """Charges each step ``(start, end)`` of the iterator: hidden for as long as an engine call ``(start,
        end)`` ran (both lists in time order, the calls disjoint), exposed for the rest."""
        j = 0
        for a, b in steps:
            while j < len(calls) and calls[j][1] <= a:
                j += 1
            covered = 0.0
            k = j
            while k < len(calls) and calls[k][0] < b:
                covered += max(0.0, min(b, calls[k][1]) - max(a, calls[k][0]))
                k += 1
            self.hidden += covered
            self.exposed += b - a - covered


@dataclass
class _Failed:
    error: BaseException


_DONE = object()


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
    """Fill the plan's targets (``context``: the live side ``planning.front.plan`` returned with it).
    ``progress(nbytes)`` is called after each batch.

    ``skip`` names region targets another replica reads (``share.plan_replicas``); they are left untouched.
    CUDA targets go through the double-buffered ``LoadStager`` (``staging_bytes`` in all); ``stage_all`` sends
    CPU targets through it too (tests exercise the staging path on machines without a GPU).
    """
    return execute_stream(
        plan.region_reads.items(),
        plan.deferred,
        context,
        dequant=plan.dequant,
        legacy=legacy,
        threads=threads,
        backend=backend,
        batch_bytes=batch_bytes,
        staging_bytes=staging_bytes,
        progress=progress,
        skip=skip,
        stage_all=stage_all,
    )


def execute_stream(
    regions: Iterable[tuple[str, Reads]],
    deferred: Sequence[DeferredGroup],
    context: LoadContext,
    *,
    dequant: Mapping[str, Dequant] | None = None,
    legacy: bool = False,
    threads: int | None = None,
    backend: str | None = None,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    progress: Callable[[int], None] | None = None,
    skip: Collection[str] = frozenset(),
    stage_all: bool = False,
    overlap: Overlap | None = None,
) -> ExecStats:
    """``execute_plan`` of region reads that may still be in the making: ``regions`` yields ``(target name,
    reads)`` (``planning.orchestrate.PlanStream.regions``: each target intersected as it is asked for). A
    planner thread iterates it and packs the batches while this thread runs the engine on the ones packed
    (the engine releases the GIL, and its calls stay on the calling thread, where signal handlers run: a
    KeyboardInterrupt stops a stalled read at once). A batch goes to an idle engine once it holds
    ``OVERLAP_BYTES`` and was begun ``OVERLAP_SECONDS`` ago, else at ``batch_bytes``. ``overlap`` receives the
    iterator's time, hidden behind reads or not. With CUDA targets (or ``stage_all``) everything runs on this
    thread through the staging slabs, one call at a time. Any failure (a target that fails to plan, a read, a
    signal) stops the planner before it propagates: nothing reads the maps afterwards.
    """
    stats = ExecStats()
    timing = overlap if overlap is not None else Overlap()
    with torch.no_grad():
        staged = stage_all or any(t.device.type == "cuda" for t in context.targets.values())
        if staged:
            _read_staged(
                regions, context, threads, backend, batch_bytes, staging_bytes, progress, skip, stage_all, stats, timing
            )
        else:
            _read_overlapped(regions, context, threads, backend, batch_bytes, progress, skip, stats, timing)
        for group, compute in zip(deferred, context.computes, strict=True):
            before = stats.bytes_read
            _run_deferred(group, compute, context, legacy, threads, backend, stats, dequant)
            if progress:
                progress(stats.bytes_read - before)
    return stats


def _read_overlapped(
    regions: Iterable[tuple[str, Reads]],
    context: LoadContext,
    threads: int | None,
    backend: str | None,
    batch_bytes: int,
    progress: Callable[[int], None] | None,
    skip: Collection[str],
    stats: ExecStats,
    timing: Overlap,
) -> None:
    """The region reads of CPU targets: planned and packed on a planner thread, read on this one."""
    index = context.index
    handoff: queue.Queue[Any] = queue.Queue(maxsize=1)
    stop = threading.Event()
    idle = threading.Event()  # set while this thread waits for a batch
    steps: list[tuple[float, float]] = []
    calls: list[tuple[float, float]] = []

    def hand(item: Any) -> None:
        while not stop.is_set():
            try:
                handoff.put(item, timeout=0.05)
                return
            except queue.Full:
                continue

    def plan_and_pack() -> None:
        try:
            with torch.no_grad():
                it = iter(regions)
                batch, started = Batch(index.locate), time.perf_counter()
                while not stop.is_set():
                    a = time.perf_counter()
                    item = next(it, None)
                    steps.append((a, time.perf_counter()))
                    if item is None:
                        break
                    name, items = item
                    if not items or name in skip:
                        continue
                    add_target_items(batch, context.target(name), items, None)
                    if batch.nbytes >= batch_bytes or (
                        batch.nbytes >= OVERLAP_BYTES
                        and time.perf_counter() - started >= OVERLAP_SECONDS
                        and idle.is_set()
                    ):
                        hand(batch)
                        time.sleep(0)  # the GIL to the reading thread now, not at the next switch interval
                        batch, started = Batch(index.locate), time.perf_counter()
                hand(batch)
                hand(_DONE)
        except BaseException as exc:  # this rank's failure, raised by the reading thread
            hand(_Failed(exc))

    planner = threading.Thread(target=plan_and_pack, name="hp-fastload-plan", daemon=True)
    idle.set()  # the engine has nothing yet: the first batch goes at once
    planner.start()
    try:
        while True:
            idle.set()
            got = handoff.get()
            idle.clear()
            if got is _DONE:
                break
            if isinstance(got, _Failed):
                raise got.error
            if not (got.count or got.after):
                continue
            a = time.perf_counter()
            got.run(threads, backend, stats)
            calls.append((a, time.perf_counter()))
            if progress and got.nbytes:
                progress(got.nbytes)
    finally:
        stop.set()
        planner.join()
        timing.add(steps, calls)


def _read_staged(
    regions: Iterable[tuple[str, Reads]],
    context: LoadContext,
    threads: int | None,
    backend: str | None,
    batch_bytes: int,
    staging_bytes: int,
    progress: Callable[[int], None] | None,
    skip: Collection[str],
    stage_all: bool,
    stats: ExecStats,
    timing: Overlap,
) -> None:
    """The region reads through the staging slabs (CUDA targets, or all with ``stage_all``), planned and read
    on this thread in turn: the slabs are reused batch by batch."""
    index = context.index
    stager = LoadStager(staging_bytes)
    batch = Batch(index.locate)

    def flush() -> None:
        nonlocal batch
        done = batch.nbytes
        batch.run(threads, backend, stats)
        stager.flip()
        if progress and done:
            progress(done)
        batch = Batch(index.locate)

    it = iter(regions)
    while True:
        a = time.perf_counter()
        item = next(it, None)
        timing.exposed += time.perf_counter() - a
        if item is None:
            break
        name, items = item
        if not items or name in skip:
            continue
        target = context.target(name)
        local = target.local()
        if not stage_all and local.device.type != "cuda":  # a host target beside device ones: read in place
            add_target_items(batch, target, items, stager, local=local)
            if batch.nbytes >= batch_bytes:
                flush()
            continue
        for rows, row_items in staging_chunks(local, items, stager.slab_bytes):
            if not stager.fits(rows):
                flush()
            add_target_items(batch, target, row_items, stager, True, rows)
            if batch.nbytes >= batch_bytes:
                flush()
    flush()
    stats.extra["staging_bytes"] = stager.allocated
    stager.finish()
