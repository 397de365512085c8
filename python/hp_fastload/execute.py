"""Execution: a ``LoadPlan`` -> bytes in the targets' local shards. Decides nothing.

Owns: packing read items into the Rust engine's item array (one ``_core.execute`` call per batch, GIL
released), temporary buffers for items with elementwise post-ops or casts the engine does not do, pinned
staging with non-blocking host-to-device copies for CUDA targets (double-buffered, bounded by a budget),
and the deferred groups (whole sources read by the engine, converted with torch, sliced locally — or, for
the legacy loader, cut with ``distribute_tensor``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

import numpy as np
import torch

from . import _core
from .engine import (
    COL_DEST,
    COL_DST_BASE,
    COL_DST_STRIDES,
    COL_FILE,
    COL_LENGTHS,
    COL_NDIM,
    COL_SCALE,
    COL_SRC_BASE,
    COL_SRC_STRIDES,
    COL_TENSOR,
    ITEM_WIDTH,
    SAFETENSORS_TO_TORCH,
    SafetensorsFile,
    safetensors_dtype_name,
)
from .errors import PlanError
from .index import CheckpointIndex
from .plan import DeferredGroup, LoadPlan, ReadItem, TemplateReads
from .quant import Dequant, source_nbytes
from .region import apply_post
from .targets import Target

__all__ = ["ExecStats", "execute_plan", "read_whole"]

MAX_NDIM: int = _core.MAX_NDIM
#: The float dtypes the engine casts between while copying (its own table, ``_core.CAST_FLOATS``).
_ENGINE_FLOATS = frozenset(SAFETENSORS_TO_TORCH[n] for n in _core.CAST_FLOATS if n in SAFETENSORS_TO_TORCH)
DEFAULT_BATCH_BYTES = 1 << 30
DEFAULT_STAGING_BYTES = 512 << 20


def _engine_casts(src: torch.dtype, dst: torch.dtype) -> bool:
    return src == dst or (src in _ENGINE_FLOATS and dst in _ENGINE_FLOATS)


@dataclass
class ExecStats:
    bytes_read: int = 0
    engine_calls: int = 0
    items: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class _Batch:
    """Items of one engine call: headers, destination buffers and the packed item array."""

    def __init__(self, index: CheckpointIndex | None, dequant: Mapping[str, Dequant] | None = None) -> None:
        self.index = index
        self.dequant = dequant or {}  # key -> its scale: items of these keys are dequantized by the engine
        self.scales: list[int] = []  # packed scale records (quant.Dequant -> the engine's SCALE_WIDTH fields)
        self._scale_pos: dict[str, int] = {}
        self.headers: list[Any] = []
        self._header_pos: dict[int, int] = {}
        self.dests: list[int] = []
        self._dest_pos: dict[tuple[int, torch.dtype], int] = {}
        self.items: list[np.ndarray[Any, np.dtype[np.int64]]] = []  # packed records, one array per _pack
        self.keep: list[torch.Tensor] = []  # tensors whose memory the engine writes: keep them alive
        self.after: list[Callable[[], None]] = []  # work after the engine call (post-ops, H2D copies)
        self.nbytes = 0
        self.count = 0

    def _file(self, file: SafetensorsFile) -> int:
        header = file.header
        pos = self._header_pos.get(id(header))
        if pos is None:
            pos = self._header_pos[id(header)] = len(self.headers)
            self.headers.append(header)
        return pos

    def _scale(self, key: str) -> int:
        """The ``COL_SCALE`` value of items of ``key``: 0 for a plain read, else its scale record + 1."""
        spec = self.dequant.get(key)
        if spec is None:
            return 0
        pos = self._scale_pos.get(key)
        if pos is None:
            assert self.index is not None
            file, tensor, _ = self.index.locate(spec.scale)
            ndim = len(spec.shape)
            if ndim > MAX_NDIM:
                raise PlanError(f"{key}: a quantized tensor of {ndim} dims exceeds the engine's {MAX_NDIM}")
            record = [self._file(file), tensor, ndim]
            record += list(spec.shape) + [1] * (MAX_NDIM - ndim) + list(spec.block) + [1] * (MAX_NDIM - ndim)
            self.scales.extend(record)
            pos = self._scale_pos[key] = len(self._scale_pos) + 1
            self.nbytes += math.prod(file.shape(spec.scale)) * file.torch_dtype(spec.scale).itemsize  # read whole
        return pos

    def _dest(self, tensor: torch.Tensor) -> int:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        key = (ptr, tensor.dtype)
        pos = self._dest_pos.get(key)
        if pos is None:
            pos = self._dest_pos[key] = len(self._dest_pos)
            code = _core.DTYPE_CODES[safetensors_dtype_name(tensor.dtype)]
            self.dests.extend((ptr, storage.nbytes(), code))
            self.keep.append(tensor)
        return pos

    def add(
        self,
        key: str,
        storage_base: int,
        storage_strides: Sequence[int],
        lengths: Sequence[int],
        dest: torch.Tensor,
        dest_offsets: Sequence[int],
    ) -> None:
        """One strided box of checkpoint tensor ``key`` into ``dest`` at ``dest_offsets``."""
        assert self.index is not None
        entry = self.index.entry(key)
        self.add_from(entry.file, key, storage_base, storage_strides, lengths, dest, dest_offsets)

    def add_from(
        self,
        file: SafetensorsFile,
        key: str,
        storage_base: int,
        storage_strides: Sequence[int],
        lengths: Sequence[int],
        dest: torch.Tensor,
        dest_offsets: Sequence[int],
    ) -> None:
        """Like ``add`` with the file given, for readers without an index."""
        item = ReadItem(key, storage_base, tuple(storage_strides), tuple(lengths), tuple(dest_offsets), ())
        self._pack([item], dest, [(file, file.tensor_index(key), file.torch_dtype(key))])  # KeyError if unknown

    def add_boxes(
        self,
        items: Sequence[ReadItem],
        dest: torch.Tensor,
        located: Sequence[tuple[SafetensorsFile, int, torch.dtype]] | None = None,
    ) -> None:
        """Many boxes into one destination (a target's local tensor or its staging buffer), no casts to
        finish in torch: the per-destination work is done once (a stacked-experts target has ~10^3 boxes).
        ``located``: each item's ``CheckpointIndex.locate`` result, when the caller has them."""
        assert self.index is not None
        if located is None:
            keys = items.keys if isinstance(items, TemplateReads) else [item.source for item in items]
            located = list(map(self.index.locate, keys))
        self._pack(items, dest, located)

    def _pack(
        self,
        items: Sequence[ReadItem],
        dest: torch.Tensor,
        located: Sequence[tuple[SafetensorsFile, int, torch.dtype]],
    ) -> None:
        """Packs ``items`` (their ``post`` is not applied here) into ``dest``; ``located`` gives each item's
        (file, position in its header, dtype). The records are built column by column with numpy: a
        stacked-experts target has ~10^3 boxes, and a Python loop building each 30-field record was ~5 us a
        box (a fifth of a 20k-tensor MoE load). ``TemplateReads`` bring their columns ready-made."""
        ndim = dest.dim()
        if ndim > MAX_NDIM:
            raise PlanError(
                f"{items[0].source if items else dest}: a read of {ndim} dims exceeds the engine's {MAX_NDIM}"
            )
        n = len(items)
        if not n:
            return
        if isinstance(items, TemplateReads):
            columns = [items.column(name) for name in ("lengths", "strides", "offsets")]
            base: Any = items.column("base")
        else:
            try:
                columns = [
                    np.array([getattr(item, name) for item in items], dtype=np.int64)
                    for name in ("lengths", "storage_strides", "dest_offsets")
                ]
            except ValueError:  # ragged: some item has another rank (named below)
                columns = []
            base = [item.storage_base for item in items]
        if len(columns) != 3 or any(c.shape != (n, ndim) for c in columns):
            for item in items:
                ranks = (len(item.lengths), len(item.storage_strides), len(item.dest_offsets))
                if ranks != (ndim,) * 3:
                    if ranks[0] > MAX_NDIM:
                        raise PlanError(f"{item.source}: a read of {ranks[0]} dims exceeds the engine's {MAX_NDIM}")
                    raise PlanError(
                        f"{item.source}: a read with {ranks[0]} lengths, {ranks[1]} strides and {ranks[2]} "
                        f"destination offsets into a {ndim}-d destination"
                    )
        lengths, storage_strides, offsets = columns
        dest_pos = self._dest(dest)
        dest_strides = tuple(dest.stride())
        files, positions, dtypes = zip(*located, strict=True)  # the columns, transposed in C
        distinct = dict(zip(map(id, files), files, strict=True))
        file_pos = {i: self._file(f) for i, f in distinct.items()}
        records = np.zeros((n, ITEM_WIDTH), dtype=np.int64)
        if len(file_pos) == 1:
            records[:, COL_FILE] = next(iter(file_pos.values()))
        else:
            records[:, COL_FILE] = list(map(file_pos.__getitem__, map(id, files)))
        records[:, COL_TENSOR] = positions
        records[:, COL_SRC_BASE] = base
        records[:, COL_DEST] = dest_pos
        records[:, COL_DST_BASE] = offsets @ np.array(dest_strides, dtype=np.int64) + int(dest.storage_offset())
        records[:, COL_NDIM] = ndim
        records[:, COL_LENGTHS : COL_LENGTHS + ndim] = lengths
        records[:, COL_SRC_STRIDES : COL_SRC_STRIDES + ndim] = storage_strides
        records[:, COL_DST_STRIDES : COL_DST_STRIDES + ndim] = dest_strides
        if self.dequant:
            keys = items.keys if isinstance(items, TemplateReads) else [item.source for item in items]
            records[:, COL_SCALE] = [self._scale(key) for key in keys]
        numel = lengths.prod(axis=1)
        kinds = set(dtypes)
        if torch.uint8 in kinds and self.dequant:  # MXFP4 blocks: two 4-bit elements a byte
            keys = items.keys if isinstance(items, TemplateReads) else [item.source for item in items]
            self.nbytes += sum(map(source_nbytes, numel.tolist(), dtypes, (k in self.dequant for k in keys)))
        elif len(kinds) == 1:
            self.nbytes += int(numel.sum()) * kinds.pop().itemsize
        else:
            self.nbytes += int(numel @ np.array([dtype.itemsize for dtype in dtypes], dtype=np.int64))
        self.items.append(records)
        self.count += n

    def run(self, threads: int | None, backend: str | None, stats: ExecStats) -> None:
        if self.count:
            _core.execute(
                self.headers,
                np.array(self.dests, dtype=np.int64).tobytes(),
                b"".join(records.tobytes() for records in self.items),
                threads=threads,
                backend=backend or "auto",
                scales=np.array(self.scales, dtype=np.int64).tobytes() if self.scales else None,
            )
            stats.engine_calls += 1
            stats.items += self.count
            stats.bytes_read += self.nbytes
        for fn in self.after:
            fn()


def _box_view(tensor: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    view = tensor
    for d, (o, n) in enumerate(zip(offsets, lengths, strict=True)):
        view = view.narrow(d, o, n)
    return view


class _Slabs:
    """Two reusable host slabs of ``budget // 2`` bytes (pinned when CUDA is there) and a side stream: the
    double buffering that staging uses in both directions (``_Stager`` for loads, ``save._D2HStager`` for
    exports). Only a request larger than a slab gets a slab of its own size."""

    ALIGN = 64

    def __init__(self, budget: int) -> None:
        self.slab_bytes = max(budget // 2, self.ALIGN)
        self.pin = torch.cuda.is_available()
        self.stream = torch.cuda.Stream() if self.pin else None
        self.slabs: list[torch.Tensor | None] = [None, None]
        self.current = 0
        self.used = 0

    def _slab(self, nbytes: int) -> torch.Tensor:
        """The current slab, replaced by a larger one when it holds fewer than ``nbytes`` bytes (views handed
        out of the previous one keep it alive)."""
        slab = self.slabs[self.current]
        if slab is None or slab.numel() < nbytes:
            slab = torch.empty(max(nbytes, self.slab_bytes), dtype=torch.uint8, pin_memory=self.pin)
            self.slabs[self.current] = slab
        return slab

    def fits(self, local: torch.Tensor) -> bool:
        """Whether ``local`` still fits the current slab (an empty slab takes anything)."""
        nbytes = local.numel() * local.element_size()
        return self.used == 0 or self.used + nbytes <= self.slab_bytes


class _Stager(_Slabs):
    """Host staging for device targets: two reusable slabs of ``budget // 2`` bytes (pinned when CUDA is there).

    Each engine batch reads into one slab; its host-to-device copies are then queued on a side stream and the
    next batch reads into the other slab while they run (double buffering). A slab is reused only after the
    copies out of it have finished, so staging memory stays at ``budget`` however large the checkpoint. A target
    larger than a slab is staged in row blocks that fit one (``_staging_chunks``); only a single row larger than
    a slab gets a slab of its own size.
    """

    def __init__(self, budget: int) -> None:
        super().__init__(budget)
        self.events: list[Any] = [None, None]

    def staging_for(self, local: torch.Tensor) -> torch.Tensor:
        """A host tensor shaped like ``local``, carved from the current slab."""
        nbytes = local.numel() * local.element_size()
        if self.used == 0 and self.events[self.current] is not None:
            self.events[self.current].synchronize()  # the copies out of this slab's last batch are done
            self.events[self.current] = None
        slab = self._slab(self.used + nbytes)
        view = slab[self.used : self.used + nbytes].view(local.dtype).view(local.shape)
        self.used += -(-nbytes // self.ALIGN) * self.ALIGN
        return view

    def copy(self, local: torch.Tensor, staging: torch.Tensor) -> None:
        if self.stream is None:
            local.copy_(staging)
            return
        with torch.cuda.stream(self.stream):
            local.copy_(staging, non_blocking=True)

    def flip(self) -> None:
        """The current slab's batch was read and its copies queued: mark it and switch slabs."""
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record(self.stream)
            self.events[self.current] = event
        self.current = 1 - self.current
        self.used = 0

    def finish(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    @property
    def allocated(self) -> int:
        """Bytes of staging memory held (both slabs)."""
        return sum(slab.numel() for slab in self.slabs if slab is not None)


def _staging_chunks(
    local: torch.Tensor, items: Sequence[ReadItem], slab_bytes: int
) -> Iterator[tuple[torch.Tensor, Sequence[ReadItem]]]:
    """``(rows of local, items clipped to them)`` in blocks of whole rows that fit a staging slab.

    An item's boxes map element for element onto the destination (post-ops are elementwise), so clipping its
    destination rows clips its source by the same rows of its first stride.
    """
    nbytes = local.numel() * local.element_size()
    if nbytes <= slab_bytes or local.dim() == 0 or local.shape[0] < 2:
        yield local, items
        return
    total_rows = local.shape[0]
    rows = max(1, slab_bytes // (nbytes // total_rows))
    for r0 in range(0, total_rows, rows):
        r1 = min(r0 + rows, total_rows)
        clipped = []
        for item in items:
            d0 = item.dest_offsets[0]
            a = max(d0, r0)
            b = min(d0 + item.lengths[0], r1)
            if b > a:
                clipped.append(
                    item._replace(
                        storage_base=item.storage_base + (a - d0) * item.storage_strides[0],
                        lengths=(b - a, *item.lengths[1:]),
                        dest_offsets=(a - r0, *item.dest_offsets[1:]),
                    )
                )
        if clipped:
            yield local[r0:r1], clipped


def _add_target_items(
    batch: _Batch,
    target: Target,
    items: Sequence[ReadItem],
    stager: _Stager | None,
    stage: bool = False,
    local: torch.Tensor | None = None,
) -> None:
    """Packs ``items`` into ``local`` (the target's local tensor, or a block of its rows for staging)."""
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
    index = batch.index
    assert index is not None
    if isinstance(items, TemplateReads):  # no post-ops by construction
        keys, post = items.keys, False
    else:
        keys, post = [item.source for item in items], any(item.post for item in items)
    located = list(map(index.locate, keys))
    dtypes = set(map(itemgetter(2), located))
    if not post and (
        all(_engine_casts(dtype, dest.dtype) for dtype in dtypes)
        or (  # MXFP4 blocks the engine dequantizes: uint8 sources of dequantized keys
            torch.uint8 in dtypes
            and dest.dtype.is_floating_point
            and all(
                _engine_casts(d, dest.dtype) or (d == torch.uint8 and k in batch.dequant)
                for k, (_, _, d) in zip(keys, located, strict=True)
            )
        )
    ):  # the usual case: the engine reads every box straight into the destination
        batch.add_boxes(items, dest, located)
        return
    casts: dict[torch.dtype, bool] = {}
    direct: list[ReadItem] = []
    direct_located: list[tuple[SafetensorsFile, int, torch.dtype]] = []
    for item, where in zip(items, located, strict=True):
        src_dtype = where[2]
        engine_casts = casts.get(src_dtype)
        if engine_casts is None:
            engine_casts = casts[src_dtype] = _engine_casts(src_dtype, dest.dtype)
        if not item.post and engine_casts:
            direct.append(item)
            direct_located.append(where)
            continue
        # a dequantized source is read as float32 (the engine applies its scale), then post-ops, then cast
        temp = torch.empty(item.lengths, dtype=torch.float32 if item.source in batch.dequant else src_dtype)
        batch.add(item.source, item.storage_base, item.storage_strides, item.lengths, temp, (0,) * len(item.lengths))
        batch.keep.append(temp)
        view = _box_view(dest, item.dest_offsets, item.lengths)

        def finish(view: torch.Tensor = view, temp: torch.Tensor = temp, post: tuple[Any, ...] = item.post) -> None:
            view.copy_(apply_post(temp, post) if post else temp)

        # post-ops must run before a device copy of the same staging buffer: insert ahead of it
        batch.after.insert(len(batch.after) - (1 if dest is not local else 0), finish)
    if direct:
        batch.add_boxes(direct, dest, direct_located)


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
    batch = _Batch(index, dequant)
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        if key in out:
            continue
        entry = index.entry(key)
        tensor = torch.empty(entry.shape, dtype=torch.float32 if key in batch.dequant else entry.dtype)
        out[key] = tensor
        strides = tuple(tensor.stride())
        batch.add(key, 0, strides, entry.shape, tensor, (0,) * len(entry.shape))
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
    index: CheckpointIndex,
    legacy: bool,
    threads: int | None,
    backend: str | None,
    stats: ExecStats,
    dequant: Mapping[str, Dequant] | None = None,
) -> None:
    sources = read_whole(index, deferred.keys, threads, backend, stats, dequant)
    outputs = deferred.compute(sources)
    for name, target in deferred.claims.items():
        with torch.no_grad():
            _copy_local_from_full(target, outputs[name], legacy)


def execute_plan(
    plan: LoadPlan,
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
    """Fill the plan's targets. ``progress(nbytes)`` is called after each batch.

    ``skip`` names region targets another replica reads (``share.plan_replicas``); they are left untouched.
    CUDA targets go through the double-buffered ``_Stager`` (``staging_bytes`` in all); ``stage_all`` sends
    CPU targets through it too (tests exercise the staging path on machines without a GPU).
    """
    stats = ExecStats()
    index = plan.index
    staged = stage_all or any(t.local().device.type == "cuda" for t, _ in plan.region_reads.values())
    stager = _Stager(staging_bytes) if staged else None
    batch = _Batch(index, plan.dequant)

    def flush() -> None:
        nonlocal batch
        done = batch.nbytes
        batch.run(threads, backend, stats)
        if stager is not None:
            stager.flip()
        if progress and done:
            progress(done)
        batch = _Batch(index, plan.dequant)

    with torch.no_grad():
        for name, (target, items) in plan.region_reads.items():
            if not items or name in skip:
                continue
            stage = stager is not None and (stage_all or target.local().device.type == "cuda")
            if not stage or stager is None:
                _add_target_items(batch, target, items, stager)
                if batch.nbytes >= batch_bytes:
                    flush()
                continue
            for rows, row_items in _staging_chunks(target.local(), items, stager.slab_bytes):
                if not stager.fits(rows):
                    flush()
                _add_target_items(batch, target, row_items, stager, True, rows)
                if batch.nbytes >= batch_bytes:
                    flush()
        flush()
        if stager is not None:
            stats.extra["staging_bytes"] = stager.allocated
        for deferred in plan.deferred:
            before = stats.bytes_read
            _run_deferred(deferred, index, legacy, threads, backend, stats, plan.dequant)
            if progress:
                progress(stats.bytes_read - before)
    if stager is not None:
        stager.finish()
    return stats
