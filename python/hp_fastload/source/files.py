"""Safetensors files as the engine sees them: :class:`SafetensorsFile` (one header, parsed and validated by the
Rust engine: keys, dtypes, shapes, byte ranges, the ``__metadata__`` strings), the process-wide cache of opened
files (``open_file``, checked against the file's identity on every hit; ``clear_cache``, ``release_maps``), and
the parse of a checkpoint index's JSON (``parse_index``). Headers only: which boxes a rank needs is planning's,
packing read requests into the engine's item records is ``execute.requests`` / ``execute.batch`` (the record
layout: ``formats``), and no tensor byte passes through here.

Sub-byte dtypes (``F4``, ``F6_E2M3``, ``F6_E3M2``) have no torch dtype here: they are read only into a
contiguous ``torch.uint8`` tensor holding exactly the box's bytes, and only boxes whose rows start and end on
byte boundaries.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Any, TypeAlias

import torch

import hp_fastload._core as _core
from hp_fastload._core import HeaderEntry
from hp_fastload.errors import HeaderError, PlanError, shown_key
from hp_fastload.formats import SAFETENSORS_TO_TORCH, SUB_BYTE_BITS

PathOrFile: TypeAlias = "str | os.PathLike[str] | SafetensorsFile"


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
        #: when asked for (most keys of a big MoE's shard never are).
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


def release_maps(files: Iterable[SafetensorsFile]) -> None:
    """Release the kept maps of ``files`` (a finished load, save or read keeps no page tables of them mapped;
    the parsed headers stay cached)."""
    for file in files:
        file.header.release_map()


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


def parse_index(where: object, text: bytes) -> dict[str, Any]:
    """A checkpoint index (``model.safetensors.index.json``, read from ``where``: its path or URL) as its JSON
    object, whose ``weight_map`` is a non-empty object; else a ``HeaderError`` naming ``where``. Both the local
    and the object-storage index, and ``from_pretrained``'s read of its ``metadata``, parse it here."""
    try:
        index = json.loads(text.decode())
    except ValueError as exc:  # invalid JSON or UTF-8
        raise HeaderError(f"failed to read safetensors index {where}: {exc}") from exc
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise HeaderError(f"safetensors index has no non-empty weight_map: {where}")
    return index
