"""One engine call's worth of work, for every caller of ``_core.execute``: ``Batch`` packs ``planning.items.Reads``
(the one read type) into the engine's item records with numpy — headers, destinations and the scale records
of items with a second source (a dequantized weight's scale) — and runs them in either direction. Also the
pieces both directions' stagers share: ``Slabs`` (two reusable host slabs and a side stream) and
``staging_chunks`` (a target cut into row blocks that fit a slab, its reads clipped to them).

Users: ``execute.read`` (a plan's region reads and whole-tensor reads), ``execute.deliver`` (a job-wide
delivery's reader ranks), ``execute.write`` (``save``: the same reads executed dest -> storage), ``api.dcp``
(torch DCP read requests), ``api.read`` (``read_many`` / ``read_into``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

import hp_fastload._core as _core
from hp_fastload.convert.quant import Dequant
from hp_fastload.errors import PlanError
from hp_fastload.formats import (
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
    MAX_NDIM,
    SAFETENSORS_TO_TORCH,
    safetensors_dtype_name,
)
from hp_fastload.planning.items import Int64s, Reads, ScaleRows, scale_read_nbytes, touched_scale_rows
from hp_fastload.source.files import SafetensorsFile
from hp_fastload.source.index import TensorEntry

#: The float dtypes the engine casts between while copying (its own table, ``_core.CAST_FLOATS``).
ENGINE_FLOATS = frozenset(SAFETENSORS_TO_TORCH[n] for n in _core.CAST_FLOATS if n in SAFETENSORS_TO_TORCH)


#: Where a checkpoint tensor lives (its file, its position in the file's header, its dtype) and what it is.
Located = TensorEntry


def engine_casts(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether the engine copies ``src`` elements into a ``dst`` buffer itself (same dtype, or both floats it
    casts between)."""
    return src == dst or (src in ENGINE_FLOATS and dst in ENGINE_FLOATS)


class Batch:
    """Items of one engine call: headers, destination buffers, scale records and the packed item array.

    ``locate(key)`` finds a checkpoint tensor (``CheckpointIndex.locate``); readers without an index give the
    file with each item (``add(..., file=)``) and need it only for the scale tensors of second sources.
    """

    def __init__(self, locate: Callable[[str], Located] | None = None) -> None:
        self.locate = locate
        self.scales: list[int] = []  # packed scale records (quant.Dequant -> the engine's SCALE_WIDTH fields)
        self._scale_pos: dict[Dequant, int] = {}
        self._scale_whole: dict[Dequant, int] = {}  # each scale tensor's bytes
        self._scale_rows: ScaleRows = {}  # the grid rows of each scale the items touch: what the engine reads
        self.headers: list[Any] = []
        self._header_pos: dict[int, int] = {}
        self.dests: list[int] = []
        self._dest_pos: dict[tuple[int, torch.dtype], int] = {}
        self.items: list[np.ndarray[Any, np.dtype[np.int64]]] = []  # packed records, one array per pack
        # one-box packs as plain rows, turned into one array when the next array pack or the call comes (a
        # dense model's targets are one box each: a dozen numpy column writes per box cost more than the box)
        self._rows: list[list[int]] = []
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

    def _scale(self, key: str, spec: Dequant | None) -> int:
        """The ``COL_SCALE`` value of an item: 0 for a plain read, else its scale record + 1."""
        if spec is None:
            return 0
        pos = self._scale_pos.get(spec)
        if pos is None:
            if self.locate is None:
                raise PlanError(f"{key}: a dequantizing read in a batch that cannot locate its scale {spec.scale}")
            scale = self.locate(spec.scale)
            file, tensor = scale.file, scale.position
            ndim = len(spec.shape)
            if ndim > MAX_NDIM:
                raise PlanError(f"{key}: a quantized tensor of {ndim} dims exceeds the engine's {MAX_NDIM}")
            record = [self._file(file), tensor, ndim]
            record += list(spec.shape) + [1] * (MAX_NDIM - ndim) + list(spec.block) + [1] * (MAX_NDIM - ndim)
            self.scales.extend(record)
            pos = self._scale_pos[spec] = len(self._scale_pos) + 1
            self._scale_whole[spec] = scale.nbytes
        return pos

    def _count_scale_rows(self, reads: Reads) -> None:
        """Adds to ``nbytes`` the scale bytes ``reads`` make the engine read beyond the rows it reads already
        (``touched_scale_rows``: each scale's hull of touched grid rows, once per call)."""
        for spec, rows in touched_scale_rows(reads).items():
            whole = self._scale_whole[spec]
            seen = self._scale_rows.get(spec)
            if seen is not None:
                self.nbytes -= scale_read_nbytes(spec, seen, whole)
                rows = (min(seen[0], rows[0]), max(seen[1], rows[1]))
            self._scale_rows[spec] = rows
            self.nbytes += scale_read_nbytes(spec, rows, whole)

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
        second: Dequant | None = None,
        *,
        file: SafetensorsFile | None = None,
    ) -> None:
        """One strided box of checkpoint tensor ``key`` into ``dest`` at ``dest_offsets`` (``second``: the
        engine dequantizes it with that scale). ``file``: where ``key`` is, for readers without an index."""
        if file is not None:
            where = TensorEntry.of(file, key)  # KeyError if unknown
        elif self.locate is None:
            raise PlanError(f"{key}: a batch without an index needs the file of each read")
        else:
            where = self.locate(key)
        reads = Reads.one(key, storage_base, storage_strides, lengths, dest_offsets, where.dtype, second)
        self.add_reads(reads, dest, [where])

    def add_reads(self, reads: Reads, dest: torch.Tensor, located: Sequence[Located] | None = None) -> None:
        """Packs ``reads`` into ``dest`` (a target's local tensor or a staging buffer; their ``post`` is not
        applied here); ``located`` gives each item's (file, position in its header, dtype) when the caller
        has them. The records are built column by column with numpy: a stacked-experts target has ~10^3
        boxes, too many for a Python loop building one record each."""
        n = len(reads)
        ndim = dest.dim()
        if ndim > MAX_NDIM:
            raise PlanError(f"{reads.keys[0] if n else dest}: a read of {ndim} dims exceeds the engine's {MAX_NDIM}")
        if not n:
            return
        if reads.ndim != ndim:
            if reads.ndim > MAX_NDIM:
                raise PlanError(f"{reads.keys[0]}: a read of {reads.ndim} dims exceeds the engine's {MAX_NDIM}")
            raise PlanError(f"{reads.keys[0]}: a read of {reads.ndim} dims into a {ndim}-d destination")
        if located is None:
            if self.locate is None:
                raise PlanError(f"{reads.keys[0]}: a batch without an index needs each read's file")
            located = list(map(self.locate, reads.keys))
        dest_pos = self._dest(dest)
        dest_strides = tuple(dest.stride())
        if n == 1 and reads.second is None:
            self._add_row(reads, located[0], dest, dest_pos, dest_strides)
            return
        files, positions, *_ = zip(*located, strict=True)  # the columns, transposed in C
        distinct = dict(zip(map(id, files), files, strict=True))
        file_pos = {i: self._file(f) for i, f in distinct.items()}
        records = np.zeros((n, ITEM_WIDTH), dtype=np.int64)
        if len(file_pos) == 1:
            records[:, COL_FILE] = next(iter(file_pos.values()))
        else:
            records[:, COL_FILE] = list(map(file_pos.__getitem__, map(id, files)))
        records[:, COL_TENSOR] = positions
        records[:, COL_SRC_BASE] = reads.storage_base
        records[:, COL_DEST] = dest_pos
        records[:, COL_DST_BASE] = reads.dest_offsets @ np.array(dest_strides, dtype=np.int64) + int(
            dest.storage_offset()
        )
        records[:, COL_NDIM] = ndim
        records[:, COL_LENGTHS : COL_LENGTHS + ndim] = reads.lengths
        records[:, COL_SRC_STRIDES : COL_SRC_STRIDES + ndim] = reads.storage_strides
        records[:, COL_DST_STRIDES : COL_DST_STRIDES + ndim] = dest_strides
        if reads.second is not None:
            records[:, COL_SCALE] = [self._scale(k, s) for k, s in zip(reads.keys, reads.second, strict=True)]
            self._count_scale_rows(reads)
        self.nbytes += reads.total_nbytes
        self._flush_rows()
        self.items.append(records)
        self.count += n

    def _add_row(
        self, reads: Reads, where: Located, dest: torch.Tensor, dest_pos: int, dest_strides: tuple[int, ...]
    ) -> None:
        """``add_reads`` of one plain box: the same record, built as a list."""
        ndim = len(dest_strides)
        row = [0] * ITEM_WIDTH
        row[COL_FILE] = self._file(where.file)
        row[COL_TENSOR] = where.position
        row[COL_SRC_BASE] = int(reads.storage_base[0])
        row[COL_DEST] = dest_pos
        offsets = reads.dest_offsets[0].tolist()
        row[COL_DST_BASE] = sum(o * st for o, st in zip(offsets, dest_strides, strict=True)) + dest.storage_offset()
        row[COL_NDIM] = ndim
        row[COL_LENGTHS : COL_LENGTHS + ndim] = reads.lengths[0].tolist()
        row[COL_SRC_STRIDES : COL_SRC_STRIDES + ndim] = reads.storage_strides[0].tolist()
        row[COL_DST_STRIDES : COL_DST_STRIDES + ndim] = dest_strides
        self._rows.append(row)
        self.nbytes += reads.total_nbytes
        self.count += 1

    def records(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """Every packed item record, in the order added (``[count, ITEM_WIDTH]``)."""
        self._flush_rows()
        return np.concatenate(self.items) if self.items else np.zeros((0, ITEM_WIDTH), dtype=np.int64)

    def _flush_rows(self) -> None:
        """The pending one-box rows as one array pack (item order is kept)."""
        if self._rows:
            self.items.append(np.array(self._rows, dtype=np.int64))
            self._rows = []

    def add_records(
        self, files: Sequence[SafetensorsFile], dests: Sequence[tuple[int, int, int]], records: Int64s
    ) -> None:
        """Item records packed and validated elsewhere (``api.read.read_many``'s requests, one destination per
        request: user input, checked request by request), whose ``COL_FILE`` / ``COL_DEST`` index ``files`` /
        ``dests``; they join this batch's tables."""
        if not len(records):
            return
        file_pos = np.array([self._file(f) for f in files], dtype=np.int64)
        records = np.array(records, dtype=np.int64)
        records[:, COL_FILE] = file_pos[records[:, COL_FILE]]
        records[:, COL_DEST] += len(self.dests) // 3
        self.dests.extend(value for dest in dests for value in dest)
        self._flush_rows()
        self.items.append(records)
        self.count += len(records)

    def execute(
        self, threads: int | None, backend: str | None, direction: str = "read", *, empty: bool = False
    ) -> dict[str, Any] | None:
        """One ``_core.execute`` call over the packed items (None when there are none, unless ``empty``: the
        engine's stats of doing nothing); the ``after`` work is the caller's (``run`` does both for loads)."""
        if not self.count and not empty:
            return None
        kwargs: dict[str, Any] = {"threads": threads, "direction": direction}
        if direction == "read":
            kwargs["backend"] = backend or "auto"
            kwargs["scales"] = np.array(self.scales, dtype=np.int64).tobytes() if self.scales else None
        return dict(
            _core.execute(
                self.headers,
                np.array(self.dests, dtype=np.int64).tobytes(),
                self.records().tobytes(),
                **kwargs,
            )
        )

    def run(self, threads: int | None, backend: str | None, stats: Any) -> None:
        """Reads the batch (``stats``: an ``execute.read.ExecStats``), then runs the ``after`` work."""
        if self.execute(threads, backend) is not None:
            stats.engine_calls += 1
            stats.items += self.count
            stats.bytes_read += self.nbytes
        for fn in self.after:
            fn()
