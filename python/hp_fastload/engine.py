"""Engine-level API: safetensors headers and batched box reads into CPU tensors.

This module owns the bridge between torch tensors and the Rust engine (``hp_fastload._core``): dtype names,
the :class:`SafetensorsFile` header view, and the validation and packing of read requests into the engine's
int64 item records (run through ``batch.Batch``, which makes every caller's engine call). It does not plan
anything (which boxes a rank needs is the loader's business) and it never touches tensor bytes itself: one
:func:`read_many` call is one Rust call, with the GIL released while it reads.

Item array layout (``int64``, shape ``[n, ITEM_WIDTH]``; all numbers in elements; the ``COL_*`` offsets and
``ITEM_WIDTH`` are the engine's own, exported by ``_core``)::

    COL_FILE       index into the ``files`` list
    COL_TENSOR     index of the tensor in that file's header (``SafetensorsFile.tensor_index``)
    COL_SRC_BASE   element index in the tensor of the box's first element
    COL_DEST       index into the ``dests`` list of (address, nbytes, dtype code)
    COL_DST_BASE   element index in the destination buffer (destination dtype) of the first element
    COL_NDIM       number of dims used (0..MAX_NDIM)
    COL_LENGTHS .. +MAX_NDIM       box extent per dim
    COL_SRC_STRIDES .. +MAX_NDIM   source stride per dim
    COL_DST_STRIDES .. +MAX_NDIM   destination stride per dim (unused slots 0)
    COL_SCALE      0: a plain copy; k: dequantize with entry k-1 of the call's scales (``quant.pack_scale``)

Sub-byte dtypes (``F4``, ``F6_E2M3``, ``F6_E3M2``) have no torch dtype here: they are read only into a
contiguous ``torch.uint8`` tensor holding exactly the box's bytes, and only boxes whose rows start and end on
byte boundaries.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from itertools import chain, compress
from typing import Any, TypeAlias

import numpy as np
import torch

from . import _core
from ._core import HeaderEntry
from .errors import PlanError, shown_key

__all__ = [
    "COL_DEST",
    "COL_DST_BASE",
    "COL_DST_STRIDES",
    "COL_FILE",
    "COL_LENGTHS",
    "COL_NDIM",
    "COL_SCALE",
    "COL_SRC_BASE",
    "COL_SRC_STRIDES",
    "COL_TENSOR",
    "DTYPE_CODES",
    "HeaderEntry",
    "ITEM_WIDTH",
    "MAX_NDIM",
    "SAFETENSORS_TO_TORCH",
    "SUB_BYTE_BITS",
    "TORCH_TO_SAFETENSORS",
    "SafetensorsFile",
    "clear_cache",
    "execute_items",
    "open_file",
    "read_into",
    "read_many",
    "safetensors_dtype_name",
]

MAX_NDIM: int = _core.MAX_NDIM
# The item layout, defined once in the engine (rust/python.rs) and exported by it.
ITEM_WIDTH: int = _core.ITEM_WIDTH
COL_FILE: int = _core.COL_FILE
COL_TENSOR: int = _core.COL_TENSOR
COL_SRC_BASE: int = _core.COL_SRC_BASE
COL_DEST: int = _core.COL_DEST
COL_DST_BASE: int = _core.COL_DST_BASE
COL_NDIM: int = _core.COL_NDIM
COL_LENGTHS: int = _core.COL_LENGTHS
COL_SRC_STRIDES: int = _core.COL_SRC_STRIDES
COL_DST_STRIDES: int = _core.COL_DST_STRIDES
COL_SCALE: int = _core.COL_SCALE

#: safetensors dtype name -> the engine's integer code.
DTYPE_CODES: dict[str, int] = dict(_core.DTYPE_CODES)

#: Bits per element of the dtypes smaller than a byte.
SUB_BYTE_BITS: dict[str, int] = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}

_TORCH_NAMES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "int16": "I16",
    "uint16": "U16",
    "int32": "I32",
    "uint32": "U32",
    "int64": "I64",
    "uint64": "U64",
    "float16": "F16",
    "bfloat16": "BF16",
    "float32": "F32",
    "float64": "F64",
    "complex64": "C64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "float8_e8m0fnu": "F8_E8M0",
}
#: torch dtype -> safetensors dtype name (only the dtypes this torch build has).
TORCH_TO_SAFETENSORS: dict[torch.dtype, str] = {
    getattr(torch, attr): name for attr, name in _TORCH_NAMES.items() if hasattr(torch, attr)
}
#: safetensors dtype name -> torch dtype (sub-byte dtypes are absent: see the module docstring).
SAFETENSORS_TO_TORCH: dict[str, torch.dtype] = {name: dt for dt, name in TORCH_TO_SAFETENSORS.items()}


def safetensors_dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype (``torch.bfloat16`` -> ``"BF16"``)."""
    try:
        return TORCH_TO_SAFETENSORS[dtype]
    except KeyError:
        raise PlanError(f"torch dtype {dtype} has no safetensors equivalent") from None


PathOrFile: TypeAlias = "str | os.PathLike[str] | SafetensorsFile"
Request: TypeAlias = "tuple[PathOrFile, str, Sequence[int], Sequence[int], torch.Tensor]"


#: Headers with at most this many tensors get every HeaderEntry built when parsed (a few hundred microseconds
#: at most); bigger ones build an entry when it is asked for (see ``SafetensorsFile._entries``).
EAGER_ENTRIES = 2048


class SafetensorsFile:
    """The header of one safetensors file: keys, dtypes, shapes, byte ranges.

    Args:
        path: the ``.safetensors`` file. The header is parsed and validated (strictly) once; every read
            re-checks the file's size and identity, so a file that shrank or was replaced since raises
            :class:`~hp_fastload.ReadError` instead of returning wrong bytes.
    """

    def __init__(self, path: str | os.PathLike[str], header: _core.SafetensorsHeader | None = None) -> None:
        self.path = os.fspath(path)
        #: ``header``: one already parsed (an object's, fetched by ``source.objstore``; its path is the URL).
        self.header = header if header is not None else _core.SafetensorsHeader(self.path)
        #: Every HeaderEntry, built with the header when it has at most EAGER_ENTRIES tensors (``read_many``
        #: asks for most of a small file's, one dict lookup each); else empty: a big file's entries are built
        #: when asked for (most keys of a big MoE's shard never are: ~28 ms for DeepSeek-V3's 90k).
        self._entries: dict[str, HeaderEntry] = {}
        if len(self.header) <= EAGER_ENTRIES:
            self._entries = self.header.entry_dict()
            self._names: list[str] = list(self._entries)
        else:
            self._names = self.header.names()

    def entry(self, key: str) -> HeaderEntry:
        """The header's record of ``key`` (position, dtype name, shape, byte range); KeyError naming the file
        and key when it has none."""
        entry = self._entries.get(key) or self.header.get(key)
        if entry is None:
            raise KeyError(f"{self.path}: no tensor named {shown_key(key)}")
        return entry

    def keys(self) -> list[str]:
        """Tensor names in file (data offset) order."""
        return list(self._names)

    def metadata(self) -> dict[str, str] | None:
        """The ``__metadata__`` strings, or None when the file has none."""
        return self.header.metadata()

    def dtype(self, key: str) -> str:
        """The safetensors dtype name of ``key`` (``"BF16"``, ``"F8_E4M3"``, ...)."""
        return self.entry(key).dtype

    def torch_dtype(self, key: str) -> torch.dtype:
        """The torch dtype of ``key``; ``torch.uint8`` for sub-byte dtypes (their bytes, packed)."""
        name = self.dtype(key)
        if name in SUB_BYTE_BITS:
            return torch.uint8
        try:
            return SAFETENSORS_TO_TORCH[name]
        except KeyError:
            raise PlanError(f"{self.path}: tensor {shown_key(key)} has dtype {name}, which this torch lacks") from None

    def shape(self, key: str) -> tuple[int, ...]:
        """The shape of ``key``."""
        return self.entry(key).shape

    def offsets(self, key: str) -> tuple[int, int]:
        """The absolute byte range ``[begin, end)`` of ``key`` in the file."""
        entry = self.entry(key)
        start = self.header.data_start
        return start + entry.begin, start + entry.end

    def tensor_index(self, key: str) -> int:
        """Position of ``key`` in the header (the ``COL_TENSOR`` value of an item)."""
        return self.entry(key).position

    @property
    def file_size(self) -> int:
        """Size of the file when the header was read."""
        return self.header.file_size

    def __contains__(self, key: object) -> bool:
        return key in self._entries or key in self.header

    def __len__(self) -> int:
        return len(self._names)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __repr__(self) -> str:
        return f"SafetensorsFile({self.path!r}, tensors={len(self)})"


_CACHE_SIZE = 256
#: (dev, inode, size, mtime, ctime) of a cached file when it was parsed, and whether that ctime was settled.
_Stamp: TypeAlias = "tuple[int, int, int, int, int]"
_cache: OrderedDict[str, tuple[_Stamp, bool, SafetensorsFile]] = OrderedDict()
_cache_lock = threading.Lock()
#: A ctime at least this old when a file is parsed is "settled": any later change of the file gives it a
#: newer ctime even on file systems with coarse (up to 2 s) timestamps.
SETTLED_NS = 3_000_000_000


def clear_cache() -> None:
    """Forget every cached header and release every kept file map (page tables freed, pages evictable again).

    :func:`read_many` and :func:`read_into` release the maps of their files when they return (unless asked
    to keep them), and :func:`hp_fastload.load` when it returns; this also drops maps kept with
    ``keep_maps=True`` and the parsed headers, so a deleted checkpoint is no longer pinned.
    """
    with _cache_lock:
        cached = [opened for _, _, opened in _cache.values()]
        _cache.clear()
    for opened in cached:
        opened.header.release_map()


def open_file(path_or_file: PathOrFile) -> SafetensorsFile:
    """A :class:`SafetensorsFile` for a path, reusing a cached one while the file is unchanged.

    The cache is keyed by path and checked against (device, inode, size, mtime, ctime) on every call, so a
    file that was rewritten is parsed again, also when its old mtime was restored (``cp -p``, ``touch -d``):
    nothing sets a ctime back. A file whose ctime was recent when it was parsed (within :data:`SETTLED_NS`:
    a rewrite within one tick of a coarse clock could keep it) has its header bytes re-read and compared
    on every hit instead, until it is parsed with a settled ctime.
    """
    if isinstance(path_or_file, SafetensorsFile):
        return path_or_file
    path = os.fspath(path_or_file)
    st = os.stat(path)
    stamp = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    with _cache_lock:
        hit = _cache.get(path)
    settled = time.time_ns() - st.st_ctime_ns >= SETTLED_NS
    if hit is not None and hit[0] == stamp and (hit[1] or hit[2].header.still_current()):
        with _cache_lock:
            if _cache.get(path) is hit:
                # Its header bytes were just found unchanged: once the ctime has settled, a later change
                # shows in the stamp, and the bytes need not be compared again.
                _cache[path] = (stamp, settled, hit[2]) if settled and not hit[1] else hit
                _cache.move_to_end(path)
        return hit[2]
    opened = SafetensorsFile(path)
    with _cache_lock:
        _cache[path] = (stamp, settled, opened)
        _cache.move_to_end(path)
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return opened


def _ints(values: Sequence[int], what: str, key: str) -> list[int]:
    try:
        return [int(v) for v in values]
    except (TypeError, ValueError):
        raise PlanError(f"tensor {shown_key(key)}: {what} must be a sequence of ints, got {values!r}") from None


def _fill_item(
    row: np.ndarray[Any, np.dtype[np.int64]],
    f: SafetensorsFile,
    key: str,
    offsets: Sequence[int],
    lengths: Sequence[int],
    out: torch.Tensor,
) -> tuple[int, int, int]:
    """Validates one request and writes its item row; returns the destination triple."""
    if key not in f:
        raise PlanError(f"{f.path}: no tensor named {shown_key(key)}")
    entry = f.entry(key)
    name, shape = entry.dtype, entry.shape
    where = f"{f.path}: tensor {shown_key(key)} (shape {list(shape)}, {name})"
    offs, lens = _ints(offsets, "offsets", key), _ints(lengths, "lengths", key)
    if len(offs) != len(shape) or len(lens) != len(shape):
        raise PlanError(
            f"{where}: offsets ({len(offs)} entries) and lengths ({len(lens)} entries) must have one entry "
            f"per dim ({len(shape)})"
        )
    if len(shape) > MAX_NDIM:
        raise PlanError(f"{where}: {len(shape)} dims, the engine reads at most {MAX_NDIM}")
    for d, (o, n, size) in enumerate(zip(offs, lens, shape, strict=True)):
        if o < 0 or n < 0 or o + n > size:
            raise PlanError(f"{where}: dim {d}: offset {o} + length {n} is outside the dim's size {size}")
    if not isinstance(out, torch.Tensor):
        raise PlanError(f"{where}: out must be a torch.Tensor, got {type(out).__name__}")
    if out.device.type != "cpu":
        raise PlanError(
            f"{where}: out is on {out.device}; the engine writes CPU memory, so read into a CPU (pinned) "
            "tensor and copy it to the device"
        )
    if out.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(f"{where}: {_grad_refusal(out)}")
    src_strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    src_base = sum(o * s for o, s in zip(offs, src_strides, strict=True))
    storage = out.untyped_storage()
    row[COL_SRC_BASE] = src_base
    row[COL_NDIM] = len(shape)
    row[COL_LENGTHS : COL_LENGTHS + len(shape)] = lens
    row[COL_SRC_STRIDES : COL_SRC_STRIDES + len(shape)] = src_strides
    bits = SUB_BYTE_BITS.get(name)
    if bits is not None:
        box_bits = math.prod(lens) * bits
        if out.dtype != torch.uint8 or not out.is_contiguous() or out.numel() * 8 != box_bits:
            raise PlanError(
                f"{where}: {name} elements are smaller than a byte; read them into a contiguous torch.uint8 "
                f"tensor of {box_bits / 8:g} bytes (got {out.dtype}, shape {list(out.shape)})"
            )
        row[COL_DST_BASE] = out.storage_offset() * 8 // bits
        row[COL_DST_STRIDES : COL_DST_STRIDES + len(shape)] = [math.prod(lens[d + 1 :]) for d in range(len(shape))]
        return storage.data_ptr(), storage.nbytes(), DTYPE_CODES[name]
    if tuple(out.shape) != tuple(lens):
        raise PlanError(f"{where}: out has shape {list(out.shape)} but the box has lengths {lens}")
    dst_name = TORCH_TO_SAFETENSORS.get(out.dtype)
    if dst_name is None:
        raise PlanError(f"{where}: cannot read into a tensor of dtype {out.dtype}")
    row[COL_DST_BASE] = out.storage_offset()
    row[COL_DST_STRIDES : COL_DST_STRIDES + len(shape)] = list(out.stride())
    return storage.data_ptr(), storage.nbytes(), DTYPE_CODES[dst_name]


def _grad_refusal(out: torch.Tensor) -> str:
    """torch's words for an in-place write into ``out`` (which requires grad) while grad mode is on."""
    if out.is_leaf:
        what = "a leaf Variable that requires grad"
    elif out._base is not None and out._base.is_leaf:
        what = "a view of a leaf Variable that requires grad"
    else:  # torch would record the copy in the graph; the engine writes memory behind autograd's back
        what = "a tensor that requires grad (the engine's writes are not recorded by autograd)"
    return (
        f"{what} is being used in an in-place operation; read inside torch.no_grad() (as hp_fastload.load "
        "does) or into a tensor that does not require grad"
    )


def threads_per_rank() -> int:
    """Engine threads for one rank of a job: the cores this process may run on, shared by the ranks of its
    node (``LOCAL_WORLD_SIZE``, set by torchrun), at least 1 and at most ``_core.DEFAULT_THREADS``.

    Ranks on one node share the cores; two ranks with a thread per core each oversubscribe them.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        cores = os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, min(_core.DEFAULT_THREADS, cores // local))


def execute_items(
    files: Sequence[SafetensorsFile | _core.SafetensorsHeader],
    dests: Sequence[tuple[int, int, int]] | np.ndarray[Any, Any],
    items: np.ndarray[Any, Any],
    threads: int | None = None,
    backend: str | None = None,
) -> dict[str, int | str]:
    """Runs a prebuilt item array (layout in the module docstring) in one engine call.

    Args:
        files: the files that ``COL_FILE`` indexes.
        dests: (address, nbytes, dtype code) per destination; the caller keeps that memory alive and
            untouched until this returns.
        items: ``int64`` array of shape ``[n, ITEM_WIDTH]``.
        threads: worker threads (default: available parallelism, at most 16).
        backend: ``"auto"`` (default), ``"mmap"`` or ``"pread"``.

    Returns:
        The engine's stats: bytes_copied, bytes_read_from_files, runs, spans, backend, threads.
    """
    headers = [f.header if isinstance(f, SafetensorsFile) else f for f in files]
    dest_array = np.ascontiguousarray(np.asarray(dests, dtype="<i8").reshape(-1, 3))
    item_array = np.ascontiguousarray(np.asarray(items, dtype="<i8"))
    if item_array.ndim != 2 or item_array.shape[1] != ITEM_WIDTH:
        raise PlanError(f"items must have shape [n, {ITEM_WIDTH}], got {list(item_array.shape)}")
    return _core.execute(
        headers, dest_array.tobytes(), item_array.tobytes(), threads=threads, backend=backend or "auto"
    )


def read_many(
    requests: Sequence[Request],
    threads: int | None = None,
    backend: str | None = None,
    *,
    keep_maps: bool = False,
) -> dict[str, int | str]:
    """Reads many boxes in one engine call.

    Args:
        requests: ``(path_or_file, key, offsets, lengths, out)`` tuples: the box
            ``tensor[offsets[0]:offsets[0]+lengths[0], ...]`` of tensor ``key`` is written into the CPU
            tensor ``out`` of shape ``lengths`` (any strides, any view of a larger tensor), converted to
            ``out.dtype`` when both are floating types. Destinations must not overlap.
        threads: worker threads (default: available parallelism, at most 16).
        backend: ``"auto"`` (default), ``"mmap"`` or ``"pread"``. Use ``"pread"`` for files that may
            change while they are read (network file systems): a mapped file truncated during a read
            faults with SIGBUS, a positioned read reports :class:`~hp_fastload.ReadError`.
        keep_maps: keep the files mapped after the call, for calls that read the same files again (the
            maps are released by :func:`clear_cache`). By default they are released when the call
            returns, so nothing stays mapped (or pins a deleted file) after a read.

    Returns:
        The engine's stats: bytes_copied, bytes_read_from_files, runs, spans, backend, threads.

    Raises:
        RuntimeError: ``out`` requires grad while grad mode is on (like ``torch.Tensor.copy_``).
        PlanError: a request is malformed (unknown key, box outside the tensor, wrong ``out``, impossible
            cast, overlapping destinations); nothing has been written.
        ReadError: a file is shorter than its header says or changed since it was opened.
    """
    from .batch import Batch  # the batch module builds on this one

    with gc_paused():
        files, dests, rows = _pack_requests(requests)
    batch = Batch()
    batch.add_records(files, dests, rows)
    try:
        return batch.execute(threads, backend, empty=True)  # type: ignore[return-value]
    finally:
        if not keep_maps:
            for f in files:
                f.header.release_map()


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector (restored to its previous state on exit): packing or planning tens
    of thousands of tensors allocates ~10^5 small objects, and each full collection they trigger walks
    everything the process holds (a model, torch's modules) for nothing."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _matrix(rows: Sequence[Sequence[Any]], m: int, ndim: int) -> np.ndarray[Any, np.dtype[np.int64]]:
    """``m`` rows of ``ndim`` ints (every row's length checked by the caller) as an int64 matrix; flattening
    first is several times faster than ``np.array`` on a list of tuples."""
    return np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=m * ndim).reshape(m, ndim)


def _pack_requests(
    requests: Sequence[Request],
) -> tuple[list[SafetensorsFile], list[tuple[int, int, int]], np.ndarray[Any, np.dtype[np.int64]]]:
    """``read_many``'s files, destination triples and item rows.

    One Python pass collects each request's fields; the bounds, shape checks and strides are then computed
    per rank with numpy (~3 us a request instead of ~15: 20k expert boxes were 0.3 s of Python against
    0.15 s of copying). A request the bulk checks do not pass — or whose form they do not cover (sub-byte
    dtypes, a non-tensor ``out``, ragged offsets) — goes through ``_fill_item``, one by one in request order,
    which names what is wrong or packs the odd case; so errors are those of the per-request checks, the
    first in request order.
    """
    if not isinstance(requests, list | tuple):
        requests = list(requests)  # any iterable, as before; the per-request pass below indexes it
    n = len(requests)
    files: list[SafetensorsFile] = []
    file_ids: dict[int, int] = {}
    opened: dict[Any, tuple[SafetensorsFile, int]] = {}
    dests: list[tuple[int, int, int]] = []
    dest_ids: dict[tuple[int, int, int], int] = {}
    codes: dict[torch.dtype, int | None] = {}
    rows = np.zeros((n, ITEM_WIDTH), dtype=np.int64)
    slow: list[int] = []
    grad = torch.is_grad_enabled()  # an out that requires grad is refused (per request) unless it is off
    # per rank: request indices and their fields
    by_rank: dict[int, list[tuple[Any, ...]]] = {}
    for k, request in enumerate(requests):
        try:
            source, key, offsets, lengths, out = request
            where = opened.get(source)
            if where is None:
                f = open_file(source)
                file_id = file_ids.setdefault(id(f), len(files))
                if file_id == len(files):
                    files.append(f)
                where = opened[source] = (f, file_id)
            entry = where[0]._entries.get(key) or where[0].header.get(key)
        except Exception:  # malformed, unopenable, unhashable: the per-request path says what
            slow.append(k)
            continue
        if entry is None or not isinstance(out, torch.Tensor) or not out.is_cpu or (grad and out.requires_grad):
            slow.append(k)
            continue
        code = codes.get(out.dtype, -1)
        if code == -1:
            name = TORCH_TO_SAFETENSORS.get(out.dtype)
            code = codes[out.dtype] = None if name is None or name in SUB_BYTE_BITS else DTYPE_CODES[name]
        shape = entry.shape
        if code is None or entry.dtype in SUB_BYTE_BITS or len(shape) > MAX_NDIM:
            slow.append(k)
            continue
        try:  # a sparse or otherwise storage-less tensor: the per-request path raises, in request order
            storage = out.untyped_storage()
            dest = (storage.data_ptr(), storage.nbytes(), code)
            layout = (out.shape, out.stride(), out.storage_offset())
        except Exception:
            slow.append(k)
            continue
        dest_id = dest_ids.setdefault(dest, len(dests))
        if dest_id == len(dests):
            dests.append(dest)
        record = (k, where[1], entry.position, dest_id, shape, offsets, lengths, *layout)
        group = by_rank.get(len(shape))
        if group is None:
            by_rank[len(shape)] = [record]
        else:
            group.append(record)
    for ndim, records in by_rank.items():
        ks, fids, poss, dids, shapes, offs, lens, out_shapes, dst_strides, dst_bases = zip(*records, strict=True)
        idx = np.array(ks, dtype=np.int64)
        m = len(ks)
        try:
            if {*map(len, offs), *map(len, lens)} != {ndim}:
                raise ValueError("ragged")
            o, length = _matrix(offs, m, ndim), _matrix(lens, m, ndim)
        except (TypeError, ValueError, OverflowError):  # ragged or not integers: one by one
            slow.extend(ks)
            continue
        size = _matrix(shapes, m, ndim)
        # o <= size - length rather than o + length <= size: no int64 overflow for offsets near 2**63
        good = ((o >= 0) & (length >= 0) & (length <= size) & (o <= size - length)).all(axis=1)
        if set(map(len, out_shapes)) != {ndim}:  # an out of another rank: its row is checked one by one
            right = [len(s) == ndim for s in out_shapes]
            good &= np.array(right)
            out_shapes = tuple(s if ok else (-1,) * ndim for s, ok in zip(out_shapes, right, strict=True))
            dst_strides = tuple(s if ok else (0,) * ndim for s, ok in zip(dst_strides, right, strict=True))
        good &= (_matrix(out_shapes, m, ndim) == length).all(axis=1)
        dst = _matrix(dst_strides, m, ndim)
        if not good.all():
            slow.extend(idx[~good].tolist())
            idx, o, length, size, dst = idx[good], o[good], length[good], size[good], dst[good]
            keep = good.tolist()
            fids, poss, dids, dst_bases = (tuple(compress(c, keep)) for c in (fids, poss, dids, dst_bases))
        strides = np.ones_like(size)
        if ndim > 1:
            strides[:, :-1] = np.cumprod(size[:, :0:-1], axis=1)[:, ::-1]
        rows[idx, COL_FILE] = fids
        rows[idx, COL_TENSOR] = poss
        rows[idx, COL_SRC_BASE] = (o * strides).sum(axis=1)
        rows[idx, COL_DEST] = dids
        rows[idx, COL_DST_BASE] = dst_bases
        rows[idx, COL_NDIM] = ndim
        if ndim:
            rows[idx, COL_LENGTHS : COL_LENGTHS + ndim] = length
            rows[idx, COL_SRC_STRIDES : COL_SRC_STRIDES + ndim] = strides
            rows[idx, COL_DST_STRIDES : COL_DST_STRIDES + ndim] = dst
    for k in sorted(slow):
        request = requests[k]
        try:
            source, key, offsets, lengths, out = request
        except (TypeError, ValueError):
            raise PlanError(
                f"request {k} must be (path_or_file, key, offsets, lengths, out), got {request!r}"
            ) from None
        f = open_file(source)
        file_id = file_ids.setdefault(id(f), len(files))
        if file_id == len(files):
            files.append(f)
        dest = _fill_item(rows[k], f, key, offsets, lengths, out)
        dest_id = dest_ids.setdefault(dest, len(dests))
        if dest_id == len(dests):
            dests.append(dest)
        rows[k, COL_FILE] = file_id
        rows[k, COL_TENSOR] = f.tensor_index(key)
        rows[k, COL_DEST] = dest_id
    return files, dests, rows


def read_into(
    path_or_file: PathOrFile,
    key: str,
    offsets: Sequence[int],
    lengths: Sequence[int],
    out: torch.Tensor,
    *,
    threads: int | None = None,
    backend: str | None = None,
    keep_maps: bool = False,
) -> dict[str, int | str]:
    """Reads one box of one tensor into ``out``; see :func:`read_many`."""
    return read_many(
        [(path_or_file, key, offsets, lengths, out)], threads=threads, backend=backend, keep_maps=keep_maps
    )
