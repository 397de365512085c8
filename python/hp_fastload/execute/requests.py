"""``read_many`` requests (path, key, box, destination tensor) checked and packed into the engine's int64 item records
in bulk; the per-request path remains for sub-byte dtypes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import chain, compress
from typing import Any, TypeAlias

import numpy as np
import torch

from hp_fastload.errors import PlanError, shown_key
from hp_fastload.formats import (
    COL_DEST,
    COL_DST_BASE,
    COL_DST_STRIDES,
    COL_FILE,
    COL_LENGTHS,
    COL_NDIM,
    COL_SRC_BASE,
    COL_SRC_STRIDES,
    COL_TENSOR,
    DTYPE_CODES,
    ITEM_WIDTH,
    MAX_NDIM,
    SUB_BYTE_BITS,
    TORCH_TO_SAFETENSORS,
)
from hp_fastload.source.files import PathOrFile, SafetensorsFile, open_file

Request: TypeAlias = "tuple[PathOrFile, str, Sequence[int], Sequence[int], torch.Tensor]"


def _ints(values: Sequence[int], what: str, key: str) -> list[int]:
    try:
        return [int(v) for v in values]
    except (TypeError, ValueError):
        raise PlanError(f"tensor {shown_key(key)}: {what} must be a sequence of ints, got {values!r}") from None


def fill_item(
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


def _matrix(rows: Sequence[Sequence[Any]], m: int, ndim: int) -> np.ndarray[Any, np.dtype[np.int64]]:
    """``m`` rows of ``ndim`` ints (every row's length checked by the caller) as an int64 matrix; flattening
    first is several times faster than ``np.array`` on a list of tuples."""
    return np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=m * ndim).reshape(m, ndim)


def pack_requests(
    requests: Sequence[Request],
) -> tuple[list[SafetensorsFile], list[tuple[int, int, int]], np.ndarray[Any, np.dtype[np.int64]]]:
    """``read_many``'s files, destination triples and item rows.

    One Python pass collects each request's fields; the bounds, shape checks and strides are then computed
    per rank with numpy (a per-request Python loop cost more than the copy for many small expert boxes;
    docs/perf-notes.md). A request the bulk checks do not pass — or whose form they do not cover (sub-byte
    dtypes, a non-tensor ``out``, ragged offsets) — goes through ``fill_item``, one by one in request order,
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
        dest = fill_item(rows[k], f, key, offsets, lengths, out)
        dest_id = dest_ids.setdefault(dest, len(dests))
        if dest_id == len(dests):
            dests.append(dest)
        rows[k, COL_FILE] = file_id
        rows[k, COL_TENSOR] = f.tensor_index(key)
        rows[k, COL_DEST] = dest_id
    return files, dests, rows
