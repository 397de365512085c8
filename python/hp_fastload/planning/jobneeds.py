"""One rank's needs for the job-wide plan: every checkpoint tensor placed on one byte axis (``StorageMap``), and
a rank's ``LoadPlan`` turned into the exact element intervals of checkpoint tensors its region reads touch
(``rank_needs``: a strided box is many runs, never its bounding box; the scale rows of FP8 items included).

Pure: arrays over headers, no process group, no bytes. The job plan built from every rank's needs is
``planning.jobwide``; the needs of every rank of a job, computed on one rank, ``planning.jobranks``.
Items the delivery cannot run from memory (MXFP4 nibbles, deferred groups) are not needs: each rank reads
them itself (``delivered_rows``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hp_fastload.errors import PlanError
from hp_fastload.planning.items import LoadPlan, Reads, touched_scale_rows

__all__ = [
    "Int64s",
    "Needs",
    "NeedsByRank",
    "StorageMap",
    "as_int64",
    "check_axis",
    "delivered_rows",
    "item_runs",
    "merge_bounds_by_rank",
    "merge_needs",
    "merge_needs_by_rank",
    "needs_of_pieces",
    "rank_axis_bounds",
    "rank_needs",
    "sorted_pieces",
    "split_at_bounds",
    "union_bytes",
]

Int64s = np.ndarray[Any, np.dtype[np.int64]]


#: Bits of the byte axis per rank in ``merge_needs_by_rank`` (checkpoints up to 4 TiB, 2**20 ranks).
AXIS_BITS = 42


def as_int64(values: Any) -> Int64s:
    return np.ascontiguousarray(values, dtype=np.int64)


@dataclass(frozen=True, eq=False)
class StorageMap:
    """Every checkpoint tensor on one byte axis: file ``f`` occupies ``[file_g0[f], file_g0[f] + size)``;
    tensor ``keys[k]`` starts at ``g0[k]`` (its data, in that file) and holds ``nbytes[k]`` bytes of
    ``itemsize[k]``-byte elements (the dtype it is read as: sub-byte dtypes are their packed bytes)."""

    keys: tuple[str, ...]
    key_id: dict[str, int]
    g0: Int64s
    nbytes: Int64s
    itemsize: Int64s
    file_of: Int64s
    file_g0: Int64s
    file_names: tuple[str, ...]

    @classmethod
    def build(cls, tensors: Sequence[tuple[str, int, int, int, int]], files: Sequence[tuple[str, int]]) -> StorageMap:
        """``tensors``: ``(key, file number, absolute byte offset in the file, nbytes, itemsize)``;
        ``files``: ``(name, size)`` in the order the ranks agree on (the index's)."""
        keys = [t[0] for t in tensors]
        columns = np.array([t[1:] for t in tensors], dtype=np.int64).reshape(len(tensors), 4)
        return cls._of_columns(keys, columns[:, 0], columns[:, 1], columns[:, 2], columns[:, 3], files)

    @classmethod
    def _of_columns(
        cls,
        keys: Sequence[str],
        file_of: Int64s,
        offset: Int64s,
        nbytes: Int64s,
        itemsize: Int64s,
        files: Sequence[tuple[str, int]],
    ) -> StorageMap:
        """``build`` from columns: the tensors ordered by (file, offset, key) with one sort of the numbers (the
        keys compared only where two tensors share a file and an offset: empty tensors)."""
        sizes = as_int64([size for _, size in files])
        file_g0 = as_int64(np.concatenate([[0], np.cumsum(sizes)[:-1]]) if len(files) else [])
        order = np.lexsort((offset, file_of)) if len(keys) else as_int64([])
        f, o = file_of[order], offset[order]
        if len(order) > 1 and bool(((f[1:] == f[:-1]) & (o[1:] == o[:-1])).any()):
            order = as_int64(sorted(range(len(keys)), key=lambda i: (int(file_of[i]), int(offset[i]), keys[i])))
        ordered = tuple(keys[i] for i in order.tolist())
        file_of = as_int64(file_of[order])
        return cls(
            ordered,
            {k: i for i, k in enumerate(ordered)},
            as_int64(file_g0[file_of] + offset[order]) if len(ordered) else as_int64([]),
            as_int64(nbytes[order]),
            as_int64(itemsize[order]),
            file_of,
            file_g0,
            tuple(name for name, _ in files),
        )

    @classmethod
    def of_index(cls, index: Any) -> StorageMap:
        """The map of a ``CheckpointIndex`` (every key of every file, headers only): each file's header records
        taken in one call (``entry_dict``), not a ``locate`` per key (90k keys of DeepSeek-V3); the element size
        of each stored dtype from one key of it (``TensorEntry.dtype``: sub-byte dtypes are read as bytes)."""
        files = list(index.files)
        disjoint = sum(map(len, files)) == len(index)
        keys: list[str] = []
        parts: list[tuple[Int64s, ...]] = []
        for number, file in enumerate(files):
            entries = file.header.entry_dict()
            names = list(entries)
            if not disjoint:  # a key the index takes from another file, or leaves out
                names = [k for k in names if k in index and index.locate(k).file is file]
            if not names:
                continue
            records = [entries[k] for k in names]
            dtypes = [e.dtype for e in records]
            sizes = {name: index.locate(names[dtypes.index(name)]).dtype.itemsize for name in set(dtypes)}
            begin = as_int64([e.begin for e in records])
            end = as_int64([e.end for e in records])
            keys.extend(names)
            parts.append(
                (
                    np.full(len(names), number, dtype=np.int64),
                    begin + int(file.header.data_start),
                    end - begin,
                    as_int64([sizes[d] for d in dtypes]),
                )
            )
        file_of, offset, nbytes, itemsize = (
            as_int64(np.concatenate([p[i] for p in parts]) if parts else []) for i in range(4)
        )
        names_sizes = [(f.path.rsplit("/", 1)[-1], f.file_size) for f in files]
        return cls._of_columns(keys, file_of, offset, nbytes, itemsize, names_sizes)

    def digest(self) -> str:
        h = hashlib.blake2b(digest_size=16)
        h.update("\0".join(self.keys).encode())
        for array in (self.g0, self.nbytes, self.itemsize, self.file_g0):
            h.update(array.tobytes())
        return h.hexdigest()


@dataclass(frozen=True, eq=False)
class Needs:
    """One rank's needs: sorted, disjoint element intervals ``[start, end)`` of checkpoint tensors ``key``
    (``StorageMap`` numbers), merged per tensor."""

    key: Int64s
    start: Int64s
    end: Int64s

    @classmethod
    def empty(cls) -> Needs:
        return cls(as_int64([]), as_int64([]), as_int64([]))

    def g_bounds(self, smap: StorageMap) -> tuple[Int64s, Int64s]:
        """The intervals on the global byte axis."""
        size = smap.itemsize[self.key]
        base = smap.g0[self.key]
        lo = self.start * size
        lo += base
        hi = self.end * size
        hi += base
        return lo, hi

    def nbytes(self, smap: StorageMap) -> int:
        return int(((self.end - self.start) * smap.itemsize[self.key]).sum())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Needs):
            return NotImplemented
        return all(np.array_equal(getattr(self, n), getattr(other, n)) for n in ("key", "start", "end"))

    __hash__ = None  # type: ignore[assignment]


class NeedsByRank(list[Needs]):
    """Every rank's ``Needs`` in rank order, made as consecutive stretches of one set of arrays (``flat``): a
    job plan takes the columns of every rank's rows as they are, without concatenating them again."""

    def __init__(self, parts: Sequence[Needs], flat: Needs) -> None:
        super().__init__(parts)
        self.flat = flat
        self._parts = tuple(parts)

    def intact(self) -> Needs | None:
        """``flat``, unless the list no longer holds the stretches it was made of."""
        same = len(self) == len(self._parts) and all(a is b for a, b in zip(self, self._parts, strict=True))
        return self.flat if same else None


def sorted_pieces(lo: Int64s, hi: Int64s) -> tuple[Int64s, Int64s]:
    """The union of non-empty half-open intervals given by their starts ``lo`` and their ends ``hi``, each
    array sorted on its own (no pairing kept): its maximal pieces, in order, intervals that only touch kept
    apart. The ``i``-th end closes a piece when exactly ``i + 1`` intervals start before it; with no
    overlap at all (the common case: one rank's disjoint runs), the pieces are the intervals themselves."""
    n = len(lo)
    if n < 2 or bool((lo[1:] >= hi[:-1]).all()):
        return lo, hi
    closes = np.flatnonzero(np.searchsorted(lo, hi, "left") == np.arange(1, n + 1, dtype=np.int64))
    firsts = np.concatenate([as_int64([0]), closes[:-1] + 1])
    return lo[firsts], hi[closes]


def _tensor_starts(smap: StorageMap) -> tuple[Int64s, Int64s]:
    """The non-empty tensors in axis order and their starts ``(key numbers, g0)``: a position on the axis
    names its tensor. ``PlanError`` when two tensors share a byte (the index refuses such headers, as
    ``safetensors`` does)."""
    keys = np.flatnonzero(smap.nbytes > 0)
    starts = smap.g0[keys]
    if len(keys) > 1:
        clash = np.flatnonzero(starts[1:] < (starts + smap.nbytes[keys])[:-1])
        if len(clash):
            a, b = (smap.keys[int(keys[i])] for i in (clash[0], clash[0] + 1))
            raise PlanError(f"checkpoint tensors {a!r} and {b!r} share bytes: the job plan needs disjoint tensors")
    return as_int64(keys), starts


def needs_of_pieces(smap: StorageMap, lo: Int64s, hi: Int64s, shift: int = 0) -> tuple[Int64s, Needs]:
    """Pieces ``[lo, hi)`` on the axis (``sorted_pieces``; each within one tensor; bits from ``shift`` up name
    a rank) as merged intervals per tensor: pieces of one rank that touch within one tensor become one.
    Returns ``(rank of each, Needs)`` (all ranks 0 when ``shift`` is 0). ``lo`` and ``hi`` are consumed: they
    become the intervals' starts and ends in place (fresh pages of arrays this large cost as much as the
    arithmetic)."""
    keys, starts = _tensor_starts(smap)
    rank = lo >> shift if shift else np.zeros(len(lo), dtype=np.int64)
    if shift:
        np.bitwise_and(lo, (1 << shift) - 1, out=lo)
        np.bitwise_and(hi, (1 << shift) - 1, out=hi)
    at = np.searchsorted(starts, lo, "right")
    at -= 1
    key = keys[at]
    del at
    if len(key) > 1:
        join = (hi[:-1] == lo[1:]) & (key[:-1] == key[1:]) & (rank[:-1] == rank[1:])
        if join.any():
            first = np.flatnonzero(np.concatenate([[True], ~join]))
            last = np.append(first[1:], len(key)) - 1
            lo, hi, key, rank = lo[first], hi[last], key[first], rank[first]
    base = smap.g0[key]
    lo -= base
    hi -= base
    del base
    size = smap.itemsize[key]
    lo //= size
    hi //= size
    return as_int64(rank), Needs(as_int64(key), lo, hi)


def _sorted_bounds(
    smap: StorageMap, key: Int64s, start: Int64s, end: Int64s, offset: Int64s | None = None
) -> tuple[Int64s, Int64s]:
    """The intervals' starts and ends on the axis (plus ``offset``), each sorted on its own (in place: the
    arrays are large, and fresh pages cost as much as the sort)."""
    size = smap.itemsize[key]
    base = smap.g0[key]
    if offset is not None:
        base += offset
    lo = start * size
    lo += base
    lo.sort(kind="stable")
    hi = end * size
    hi += base
    hi.sort(kind="stable")
    return lo, hi


def merge_needs(smap: StorageMap, key: Int64s, start: Int64s, end: Int64s) -> Needs:
    """Sorted, merged intervals per key (touching or overlapping intervals of one key become one). The
    starts and the ends on the global axis are sorted each on its own (values only, no permutation of the
    rows: ``sorted_pieces``); a piece's position names its tensor (``_tensor_starts``)."""
    keep = end > start
    if not keep.all():
        key, start, end = key[keep], start[keep], end[keep]
    if not len(key):
        return Needs.empty()
    lo, hi = _sorted_bounds(smap, key, start, end)
    return needs_of_pieces(smap, *sorted_pieces(lo, hi))[1]


def check_axis(smap: StorageMap, world: int) -> None:
    """``PlanError`` when the job's ranks and the checkpoint's bytes do not fit one axis (``AXIS_BITS``)."""
    total = int((smap.g0 + smap.nbytes).max()) if len(smap.g0) else 0
    if total >= 1 << AXIS_BITS or world >= 1 << (62 - AXIS_BITS):
        raise PlanError(f"a checkpoint of {total} bytes on {world} ranks is past the job plan's axis")


def rank_axis_bounds(
    smap: StorageMap, rank: Int64s, key: Int64s, start: Int64s, end: Int64s, shift: Int64s | None = None
) -> tuple[Int64s, Int64s]:
    """Rows ``(rank, key, start, end)`` as bounds on the ranks' axis (``rank << AXIS_BITS`` plus the global
    byte position; ``shift``: ``rank << AXIS_BITS`` when already made), empty rows dropped: the input of
    ``merge_bounds_by_rank`` (``check_axis`` first)."""
    keep = end > start
    if not keep.all():
        rank, key, start, end = rank[keep], key[keep], start[keep], end[keep]
        shift = None
    size = smap.itemsize[key]
    base = smap.g0[key]
    base += rank << AXIS_BITS if shift is None else shift
    lo = start * size
    lo += base
    hi = end * size
    hi += base
    return lo, hi


def merge_bounds_by_rank(smap: StorageMap, world: int, lo: Int64s, hi: Int64s) -> list[Needs]:
    """``merge_needs_by_rank`` of rows given as bounds on the ranks' axis (``rank_axis_bounds``, any order);
    ``lo`` and ``hi`` are consumed (sorted, then overwritten in place). One sort of the starts and one of
    the ends, values only: no permutation of the rows is gathered."""
    out = [Needs.empty() for _ in range(world)]
    if not len(lo):
        return out
    lo.sort(kind="stable")
    hi.sort(kind="stable")
    r, needs = needs_of_pieces(smap, *sorted_pieces(lo, hi), shift=AXIS_BITS)
    bounds = np.searchsorted(r, np.arange(world + 1)).tolist()
    for i in range(world):
        a, b = bounds[i], bounds[i + 1]
        out[i] = Needs(needs.key[a:b], needs.start[a:b], needs.end[a:b])
    return NeedsByRank(out, needs)


def merge_needs_by_rank(
    smap: StorageMap, world: int, rank: Int64s, key: Int64s, start: Int64s, end: Int64s
) -> list[Needs]:
    """``merge_needs`` of every rank at once: rows ``(rank, key, start, end)`` of any order -> one ``Needs`` per
    rank (equal to ``merge_needs`` of that rank's rows). Each rank's intervals are moved to their own stretch
    of one axis (``rank << AXIS_BITS``), then merged as ``merge_needs`` merges (``merge_bounds_by_rank``)."""
    check_axis(smap, world)
    return merge_bounds_by_rank(smap, world, *rank_axis_bounds(smap, rank, key, start, end))


def item_runs(lengths: Sequence[int], strides: Sequence[int]) -> tuple[Int64s, int]:
    """The element runs of one strided box, relative to its base: ``(run starts, run length)``.

    Dims are ordered by stride; the innermost contiguous dims collapse into the run (the engine's "longest
    contiguous span"), the others enumerate run starts. Length-1 and stride-0 dims add nothing. Negative
    strides are refused (the engine refuses them too)."""
    dims = [(int(s), int(n)) for s, n in zip(strides, lengths, strict=True) if int(n) != 1]
    if any(n == 0 for _, n in dims):
        return as_int64([]), 0
    if any(s < 0 for s, _ in dims):
        raise PlanError(f"a read with negative strides {tuple(strides)}")
    dims = sorted((s, n) for s, n in dims if s != 0)
    run = 1
    while dims and dims[0][0] == run:
        run *= dims[0][1]
        dims.pop(0)
    starts = np.zeros(1, dtype=np.int64)
    for s, n in dims:
        starts = (starts[:, None] + np.arange(n, dtype=np.int64)[None, :] * s).reshape(-1)
    return np.sort(starts), run


def delivered_rows(reads: Reads, dequantized_packed: Iterable[str] = ()) -> Int64s:
    """The rows of ``reads`` the job-wide delivery runs from memory: all but MXFP4 items (nibble codes
    dequantized by the engine), which each rank reads itself."""
    if reads.second is None:
        return np.arange(len(reads), dtype=np.int64)
    packed = set(dequantized_packed)
    keep = [i for i, (k, s) in enumerate(zip(reads.keys, reads.second, strict=True)) if s is None or k not in packed]
    return as_int64(keep)


def _reads_intervals(reads: Reads, smap: StorageMap, out: list[tuple[Int64s, Int64s, Int64s]]) -> None:
    """Appends the element intervals of every item of ``reads`` (grouped by box pattern: the items of one
    pattern share their relative runs)."""
    if not len(reads):
        return
    keys = as_int64([smap.key_id[k] for k in reads.keys])
    patterns: dict[bytes, list[int]] = {}
    packed = np.concatenate([reads.lengths, reads.storage_strides], axis=1)
    for i, row in enumerate(packed):
        patterns.setdefault(row.tobytes(), []).append(i)
    ndim = reads.ndim
    for rows_list in patterns.values():
        rows = as_int64(rows_list)
        r0 = int(rows[0])
        rel, run = item_runs(reads.lengths[r0].tolist(), reads.storage_strides[r0].tolist())
        if run == 0 or not len(rel):
            continue
        starts = (reads.storage_base[rows][:, None] + rel[None, :]).reshape(-1)
        key = np.repeat(keys[rows], len(rel))
        out.append((key, starts, starts + run))
    del ndim


def rank_needs(plan: LoadPlan, smap: StorageMap, packed: Iterable[str] = ()) -> Needs:
    """What one rank's region reads touch, as merged element intervals per checkpoint tensor: each item's
    exact runs, and for dequantized FP8 items the scale rows the engine reads (``touched_scale_rows``).
    ``packed``: MXFP4 keys, left to the rank itself (``delivered_rows``); deferred groups are not needs."""
    packed = set(packed)
    parts: list[tuple[Int64s, Int64s, Int64s]] = []
    for reads in plan.region_reads.values():
        rows = delivered_rows(reads, packed)
        part = reads if len(rows) == len(reads) else reads.take(rows)
        _reads_intervals(part, smap, parts)
        for spec, (lo, hi) in touched_scale_rows(part).items():
            k = smap.key_id[spec.scale]
            grid_rows = -(-spec.shape[0] // spec.block[0]) if spec.shape else 1
            per_row = int(smap.nbytes[k] // smap.itemsize[k]) // grid_rows
            parts.append((as_int64([k]), as_int64([lo * per_row]), as_int64([(hi + 1) * per_row])))
    if not parts:
        return Needs.empty()
    return merge_needs(smap, *(np.concatenate(column) for column in zip(*parts, strict=True)))


def union_bytes(needs: Sequence[Needs], smap: StorageMap) -> int:
    """Bytes of the union of ``needs`` (what one reader per byte reads)."""
    if not needs:
        return 0
    merged = merge_needs(smap, *(np.concatenate([getattr(n, f) for n in needs]) for f in ("key", "start", "end")))
    return merged.nbytes(smap)


def split_at_bounds(
    smap: StorageMap,
    bounds: Int64s,
    key: Int64s,
    start: Int64s,
    end: Int64s,
    *extra: Int64s,
    axis: tuple[Int64s, Int64s] | None = None,
) -> tuple[Int64s, ...]:
    """Intervals ``(key, start, end)`` cut at the chunk boundaries ``bounds`` (sorted axis positions, the
    chunks' starts), as ``(chunk, key, start, end, *extra)`` (``extra``: columns repeated with their row);
    every interval lies inside some chunk's range once cut. ``axis``: the intervals' ``g_bounds``, when known."""
    if not len(key):
        return tuple(as_int64([]) for _ in range(4 + len(extra)))
    if axis is None:
        size = smap.itemsize[key]
        glo = smap.g0[key] + start * size
        ghi = smap.g0[key] + end * size
    else:
        glo, ghi = axis
    c0 = np.searchsorted(bounds, glo, "right") - 1
    nxt = np.append(bounds[1:], np.iinfo(np.int64).max)  # each chunk's end on the axis
    over = np.flatnonzero(ghi > nxt[c0])  # the intervals that pass their first chunk's end
    if not len(over):
        return (as_int64(c0), key, start, end, *extra)
    count = np.ones(len(glo), dtype=np.int64)
    count[over] = np.searchsorted(bounds, ghi[over] - 1, "right") - c0[over]
    first = np.cumsum(count) - count  # each interval's first piece
    chunk = np.repeat(c0 - first, count)
    chunk += np.arange(len(chunk), dtype=np.int64)
    k = np.repeat(key, count)
    cut_start, cut_end = np.repeat(start, count), np.repeat(end, count)
    later = np.ones(len(chunk), dtype=bool)
    later[first] = False
    later = np.flatnonzero(later)  # pieces after an interval's first: they start at their chunk's start
    size, base = smap.itemsize[k[later]], smap.g0[k[later]]
    cut_start[later] = (bounds[chunk[later]] - base) // size
    cut_end[later - 1] = (bounds[chunk[later]] - base) // size  # ... where the piece before them ends
    return (as_int64(chunk), as_int64(k), as_int64(cut_start), as_int64(cut_end), *(np.repeat(x, count) for x in extra))
