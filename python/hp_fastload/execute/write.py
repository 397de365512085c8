"""The write direction: a save plan's regions written from local shards (or staging) into the output files with
positioned writes, the region planning of later targets going on while the first are written (as
``execute.read.execute_stream`` reads), whole tensors for fallback groups, and the output files created,
finished and synced.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hp_fastload.errors import PlanError
from hp_fastload.execute import read
from hp_fastload.execute.batch import Batch
from hp_fastload.execute.read import Overlap
from hp_fastload.execute.staging import DEFAULT_STAGING_BYTES, D2HStager, staging_chunks
from hp_fastload.formats import INDEX_NAME
from hp_fastload.planning.context import LoadContext
from hp_fastload.planning.export import (
    ExportLayout,
    mesh_coordinate_writes,
)
from hp_fastload.planning.items import LoadPlan, Reads
from hp_fastload.runtime import is_rank0
from hp_fastload.source.index import CheckpointIndex


class WriteBatch(Batch):
    """One engine call in the write direction: the load's records, executed the other way."""

    def run(self, threads: int | None, backend: str | None, stats: Any) -> None:
        result = self.execute(threads, backend, direction="write")
        if result is not None:
            stats.bytes_written += int(result["bytes_copied"])
            stats.items += self.count
            stats.files.update(Path(header.path).name for header in self.headers)


@dataclass
class WriteStats:
    bytes_written: int = 0
    items: int = 0
    files: set[str] = field(default_factory=set)  # names of the shard files this rank wrote into


def write_batch(batch: WriteBatch, threads: int | None, stats: WriteStats) -> None:
    batch.run(threads, None, stats)


def writes(name: str, items: Reads, context: LoadContext, skip: Collection[str]) -> bool:
    """Whether this rank writes target ``name``'s ``items`` as region writes: not a torch fallback (a deferred
    group's target, in ``skip``, or items with an elementwise post-op) and this rank the region's writer."""
    return bool(items) and name not in skip and items.post is None and mesh_coordinate_writes(context.target(name))


def write_regions(
    regions: Iterable[tuple[str, Reads]],
    context: LoadContext,
    skip: Collection[str],
    threads: int | None,
    batch_bytes: int,
    stats: WriteStats,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    stage_all: bool = False,
    overlap: Overlap | None = None,
    overlapped: bool = True,
) -> None:
    """The region writes of this rank (``regions``: ``(target name, reads)`` as ``PlanStream.regions`` makes
    them, or a finished plan's ``region_reads.items()``), in engine batches of ``batch_bytes``; the targets
    ``writes`` refuses are left out.

    CPU shards: a planner thread iterates ``regions`` and packs the batches while this thread runs the engine
    on the ones packed (``execute.read.execute_stream``'s design and batch policy: the engine's calls stay on
    the calling thread, where signals are handled); ``overlap`` receives the iterator's time, hidden behind
    writes or not. Device shards (and, with ``stage_all``, CPU ones: the tests' way through this path without
    a GPU) go through ``D2HStager``, planned and written in turn on this thread, as all targets do with
    ``overlapped=False``. Any failure stops the planner before it propagates."""
    timing = overlap if overlap is not None else Overlap()
    with torch.no_grad():
        if overlapped and not stage_all and not any(t.device.type == "cuda" for t in context.targets.values()):
            _write_overlapped(regions, context, skip, threads, batch_bytes, stats, timing)
        else:
            _write_in_turn(regions, context, skip, threads, batch_bytes, stats, staging_bytes, stage_all, timing)


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


_DONE = object()


def _write_overlapped(
    regions: Iterable[tuple[str, Reads]],
    context: LoadContext,
    skip: Collection[str],
    threads: int | None,
    batch_bytes: int,
    stats: WriteStats,
    timing: Overlap,
) -> None:
    """The region writes of CPU shards: planned and packed on a planner thread, written on this one."""
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
            with torch.no_grad():  # (grad mode is per thread)
                it = iter(regions)
                batch, started = WriteBatch(index.locate), time.perf_counter()
                while not stop.is_set():
                    a = time.perf_counter()
                    item = next(it, None)
                    steps.append((a, time.perf_counter()))
                    if item is None:
                        break
                    name, items = item
                    if not writes(name, items, context, skip):
                        continue
                    batch.add_reads(items, context.target(name).local())
                    if batch.nbytes >= batch_bytes or (
                        batch.nbytes >= read.OVERLAP_BYTES  # (load's policy, read when used: one knob)
                        and time.perf_counter() - started >= read.OVERLAP_SECONDS
                        and idle.is_set()
                    ):
                        hand(batch)
                        time.sleep(0)  # the GIL to the writing thread now, not at the next switch interval
                        batch, started = WriteBatch(index.locate), time.perf_counter()
                hand(batch)
                hand(_DONE)
        except BaseException as exc:  # this rank's failure, raised by the writing thread
            hand(_Failed(exc))

    planner = threading.Thread(target=plan_and_pack, name="hp-fastload-plan-save", daemon=True)
    idle.set()
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
            if not got.count:
                continue
            a = time.perf_counter()
            write_batch(got, threads, stats)
            calls.append((a, time.perf_counter()))
    finally:
        stop.set()
        planner.join()
        timing.add(steps, calls)


def _write_in_turn(
    regions: Iterable[tuple[str, Reads]],
    context: LoadContext,
    skip: Collection[str],
    threads: int | None,
    batch_bytes: int,
    stats: WriteStats,
    staging_bytes: int,
    stage_all: bool,
    timing: Overlap,
) -> None:
    """Planned and written in turn on this thread: device shards through the double-buffered host slabs (a
    full slab's batch written once the next slab's copies are queued), CPU shards in place."""
    index = context.index
    batch = WriteBatch(index.locate)
    stager: D2HStager | None = None
    pending: tuple[WriteBatch, Any] | None = None  # a full slab's batch, written once the next one is queued

    def run_pending() -> None:
        nonlocal pending
        if pending is not None:
            done, event = pending
            if event is not None:
                event.synchronize()
            write_batch(done, threads, stats)
            pending = None

    def flush(staged: bool) -> None:
        nonlocal batch, pending
        if staged:
            assert stager is not None
            event = stager.event()
            run_pending()  # the previous slab, while this one's copies run
            pending = (batch, event)
        else:
            write_batch(batch, threads, stats)
        batch = WriteBatch(index.locate)

    it = iter(regions)
    while True:
        a = time.perf_counter()
        item = next(it, None)
        timing.exposed += time.perf_counter() - a
        if item is None:
            break
        name, items = item
        if not writes(name, items, context, skip):
            continue
        local = context.target(name).local()
        if local.device.type == "cpu" and not stage_all:
            batch.add_reads(items, local)
            if batch.nbytes >= batch_bytes:
                flush(staged=stager is not None)  # a batch holding staged views waits for their copies
            continue
        if stager is None:
            if batch.count:
                flush(staged=False)
            stager = D2HStager(staging_bytes)
        for rows, row_items in staging_chunks(local, items, stager.slab_bytes):
            if not stager.fits(rows):
                flush(staged=True)
            view = stager.stage(rows)
            batch.keep.append(view)
            batch.add_reads(row_items, view)
    if stager is not None:
        flush(staged=True)
        run_pending()
    else:
        write_batch(batch, threads, stats)


def write_whole(
    index: CheckpointIndex, tensors: dict[str, torch.Tensor], threads: int | None, stats: WriteStats
) -> None:
    batch = WriteBatch(index.locate)
    for key, tensor in tensors.items():
        entry = index.locate(key)
        if tuple(tensor.shape) != tuple(entry.shape) or tensor.dtype != entry.dtype:
            raise PlanError(
                f"{key}: the reverse conversion gave {tuple(tensor.shape)} {tensor.dtype}, the released layout "
                f"says {tuple(entry.shape)} {entry.dtype}"
            )
        tensor = tensor.contiguous()
        batch.add(key, 0, tuple(tensor.stride()), tuple(tensor.shape), tensor, (0,) * tensor.dim())
    write_batch(batch, threads, stats)


def create_files(tmp: Path, layout: ExportLayout) -> None:
    tmp.mkdir()
    for file in layout.files:
        with open(tmp / file.name, "wb") as f:
            f.write(file.header)
            f.truncate(file.size)


def finish_files(tmp: Path, layout: ExportLayout, model: nn.Module) -> None:
    """Rank 0, after every rank wrote: index, config files, fsync of every file and the directory."""
    if layout.index is not None:
        with open(tmp / INDEX_NAME, "w", encoding="utf-8") as f:
            f.write(json.dumps(layout.index, indent=2, sort_keys=True) + "\n")
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        # as save_pretrained does: the model's dtype and class (an FSDP2 class keeps its "FSDP" prefix off)
        dtype = getattr(model, "dtype", None)
        if isinstance(dtype, torch.dtype):
            config.dtype = str(dtype).split(".")[1]
        config.architectures = [type(model).__name__.removeprefix("FSDP")]
        config.save_pretrained(tmp)
        can_generate = getattr(model, "can_generate", None)
        generation = getattr(model, "generation_config", None)
        if callable(can_generate) and can_generate() and generation is not None:
            generation.save_pretrained(tmp)
    for entry in tmp.iterdir():
        if entry.suffix != ".safetensors":  # the writers synced the shards (sync_written)
            _fsync(entry)
    fsync_dir(tmp)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_written(save_plan: LoadPlan, written: set[str], tmp: Path) -> None:
    """Each rank syncs the shard files it wrote into (rank 0 all of them: it created them), in parallel with
    the other ranks; on a file system shared by several nodes a rank's dirty pages are its own to flush."""
    names = {f.name for f in tmp.iterdir() if f.suffix == ".safetensors"} if is_rank0() else written
    for name in sorted(names):
        _fsync(tmp / name)


def fsync_dir(path: Path) -> None:
    _fsync(path)
