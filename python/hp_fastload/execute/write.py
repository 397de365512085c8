"""The write direction: a save plan's regions written from local shards (or staging) into the output files with
positioned writes, whole tensors for fallback groups, and the output files created, finished and synced.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hp_fastload.errors import PlanError
from hp_fastload.execute.batch import Batch
from hp_fastload.execute.staging import DEFAULT_STAGING_BYTES, D2HStager, staging_chunks
from hp_fastload.formats import INDEX_NAME
from hp_fastload.planning.context import LoadContext
from hp_fastload.planning.export import (
    ExportLayout,
    mesh_coordinate_writes,
)
from hp_fastload.planning.items import LoadPlan
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


def write_regions(
    save_plan: LoadPlan,
    context: LoadContext,
    fallback: set[str],
    threads: int | None,
    batch_bytes: int,
    stats: WriteStats,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    stage_all: bool = False,
) -> None:
    """The region writes of this rank, in engine batches of ``batch_bytes``. Device shards (and, with
    ``stage_all``, CPU ones: the tests' way through this path without a GPU) go through ``D2HStager``."""
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

    for name, items in save_plan.region_reads.items():
        target = context.target(name)
        if not items or name in fallback or not mesh_coordinate_writes(target):
            continue
        local = target.local()
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
