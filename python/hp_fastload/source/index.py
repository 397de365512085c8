"""The checkpoint index: where each tensor of a Hugging Face checkpoint lives.

Owns: turning a resolved location (``source.location``: a ``.safetensors`` file of any name, a directory with
``model.safetensors.index.json`` or ``model.safetensors``, a directory of shards without an index; an object
checkpoint through ``source.objstore.open_index``) into a ``CheckpointIndex``, whose one lookup ``locate(key)``
gives a :class:`TensorEntry` (file, header position, dtypes, shape, bytes), and the index's ``metadata``
(``index_metadata``). Only headers and the index are read. It does not plan or read tensor bytes; key order is
``natural``'s.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Collection, Iterable, Iterator
from itertools import chain, repeat
from pathlib import Path
from typing import Any, NamedTuple

import torch

import hp_fastload._core as _core
from hp_fastload.errors import HeaderError, shown_key
from hp_fastload.formats import INDEX_NAME, SAFETENSORS_TO_TORCH, SINGLE_NAME, SUB_BYTE_BITS
from hp_fastload.source import objstore
from hp_fastload.source.files import SafetensorsFile, open_file, parse_index, release_maps
from hp_fastload.source.natural import KeyOrder, dot_natural_key


class TensorEntry(NamedTuple):
    """One checkpoint tensor as :meth:`CheckpointIndex.locate` finds it: the file the index takes it from,
    where it is in that file's header, and its header facts."""

    file: SafetensorsFile
    #: Position in the file's header (an item's ``COL_TENSOR``).
    position: int
    #: The torch dtype it is read as (``torch.uint8`` for sub-byte dtypes: their packed bytes).
    dtype: torch.dtype
    shape: tuple[int, ...]
    #: The safetensors dtype name (``"BF16"``, ``"F4"``): sub-byte dtypes differ here, not in ``dtype``.
    dtype_name: str
    nbytes: int
    key: str

    @classmethod
    def of(cls, file: SafetensorsFile, key: str) -> TensorEntry:
        """The entry of ``key`` in ``file`` (``KeyError`` naming both when the file has no such tensor)."""
        header = file.entry(key)
        name = header.dtype
        dtype = _READ_AS.get(name)
        if dtype is None:
            dtype = file.torch_dtype(key)  # raises: a dtype this torch lacks
        return cls(file, header.position, dtype, header.shape, name, header.nbytes, key)


#: safetensors dtype name -> the torch dtype a tensor of it is read as.
_READ_AS = {**SAFETENSORS_TO_TORCH, **dict.fromkeys(SUB_BYTE_BITS, torch.uint8)}


_new_tuple = tuple.__new__


class CheckpointIndex:
    """Key -> tensor entry over every file of a checkpoint (headers only)."""

    def __init__(self, files: list[SafetensorsFile], key_files: dict[str, SafetensorsFile]) -> None:
        self.files = files
        self._files = key_files
        # The one lookup's memo, filled on first use: most keys of a big MoE are never located.
        self._located: dict[str, TensorEntry] = {}
        self._order = KeyOrder.of_headers(
            list(chain.from_iterable(f._names for f in files)), [f.header for f in files], key_files
        )
        self._keys = self._order.keys
        # Every key of every file is indexed, each in its own file: nothing a file has is taken from another
        # file or left out (the index's keys are among the files', so counting them tells it).
        self._disjoint = sum(map(len, files)) == len(key_files)
        self._headers = [f.header for f in files]

    @classmethod
    def open(cls, location: str | os.PathLike[str] | objstore.ObjectLocation) -> CheckpointIndex:
        """Index a resolved location (see ``resolve_checkpoint_location``): files, or objects (``s3://``)."""
        if isinstance(location, objstore.ObjectLocation):
            object_files, object_keys = objstore.open_index(location)
            for file in object_files:
                _refuse_torch_sharded(file)
            return cls(object_files, object_keys)
        path = Path(location)
        if path.is_file():
            file = open_file(path)
            _refuse_torch_sharded(file)
            return cls([file], dict.fromkeys(file.keys(), file))
        index_path = path / INDEX_NAME
        if index_path.is_file():
            return cls._from_index_json(path, index_path)
        if index_path.exists():  # a FIFO or a device: reading it could block forever
            raise HeaderError(
                f"{index_path} is a FIFO, socket or device, not a regular file; a safetensors index must be one"
            )
        single = path / SINGLE_NAME
        if single.is_file():
            file = open_file(single)
            _refuse_torch_sharded(file)
            return cls([file], dict.fromkeys(file.keys(), file))
        shards = sorted(path.glob("*.safetensors"), key=lambda p: dot_natural_key(p.name))
        if not shards:
            raise FileNotFoundError(f"no {INDEX_NAME}, {SINGLE_NAME} or *.safetensors under {path}")
        files = _open_all(shards)
        key_files: dict[str, SafetensorsFile] = {}
        for file in files:
            _refuse_torch_sharded(file)
            for key in file:
                if key in key_files:
                    raise HeaderError(
                        f"tensor {shown_key(key)} is stored in two files: {key_files[key].path} and {file.path}"
                    )
                key_files[key] = file
        return cls(files, key_files)

    @classmethod
    def _from_index_json(cls, root: Path, index_path: Path) -> CheckpointIndex:
        text = _read_index(index_path)
        # The usual layout is parsed and checked against the headers in Rust (json.loads of a 90k-tensor
        # index, and comparing it with the headers in Python, was a quarter of indexing it).
        fast = _core.WeightMap.parse(text)
        weight_map = None
        if fast is not None:
            names = fast.files()
        else:
            weight_map = _weight_map(index_path, text)
            names = sorted(set(weight_map.values()), key=str)
        for name in names:  # every name is checked before any shard is opened
            _check_shard_name(index_path, name, text)
        for name in names:
            file_path = root / name
            try:
                present = file_path.exists()
            except OSError as exc:  # ENAMETOOLONG...: the message would quote the whole (huge) name
                raise HeaderError(
                    f"index {index_path} names shard {shown_key(name)}, which cannot be looked up under {root}: "
                    f"{exc.strerror}"
                ) from None
            if not present:  # a FIFO or device exists: the header reader refuses it unopened
                raise FileNotFoundError(
                    f"safetensors shard {shown_key(name)} named by {index_path} does not exist under {root}"
                )
        opened = dict(zip(names, _open_all([root / name for name in names]), strict=True))
        for file in opened.values():
            _refuse_torch_sharded(file)
        key_files: dict[str, SafetensorsFile] = {}
        if fast is not None and fast.agrees([f.header for f in opened.values()]):
            files = list(opened.values())
            # one dict built from two C-level chains (no per-file dict merged in)
            key_files = dict(
                zip(
                    chain.from_iterable(f._names for f in files),
                    chain.from_iterable(repeat(f, len(f._names)) for f in files),
                    strict=True,
                )
            )
            return cls(files, key_files)
        if weight_map is None:
            weight_map = _weight_map(index_path, text)
        for key, name in weight_map.items():
            file = opened[name]
            if key not in file:
                raise HeaderError(f"index {index_path} puts {shown_key(key)} in {name}, whose header does not have it")
            key_files[key] = file
        return cls(list(opened.values()), key_files)

    def natural_sorted(self, names: Iterable[str]) -> list[str]:
        """``names`` in natural order (see :meth:`hp_fastload.natural.KeyOrder.sorted`)."""
        return self._order.sorted(names)

    def keys(self) -> list[str]:
        """Every key, in natural order."""
        return list(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._files

    @property
    def membership(self) -> Collection[str]:
        """The indexed keys as a container whose ``in`` runs in C (``filter(index.membership.__contains__,
        ...)`` over 10^4 keys costs no Python call per key, unlike ``index.__contains__``)."""
        return self._files.keys()

    def __len__(self) -> int:
        return len(self._files)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def locate(self, key: str) -> TensorEntry:
        """Where ``key`` is and what it is: the one lookup of a checkpoint tensor (file, header position,
        dtypes, shape, bytes), remembered, since packing, tracing and read accounting ask for the same keys
        more than once. ``KeyError`` naming the key when the index does not have it."""
        entry = self._located.get(key)
        return entry if entry is not None else self._locate_new(key)

    def facts_many(self, keys: list[str]) -> tuple[int, ...]:
        """One small int per key, equal for two keys exactly when their ``(locate(k).dtype_name,
        locate(k).shape)`` are equal: the bulk form of asking each key's stored dtype and shape, read from the
        headers in Rust without locating (building a :class:`TensorEntry` for) any key. The ids are
        process-wide, so they compare across files and indexes. The trace cache's signatures ask it for every
        source of every group (~45k keys of DeepSeek-V3, most of them never read by this rank). ``KeyError``
        naming the first key the index does not have."""
        try:
            if self._disjoint:
                return _core.SafetensorsHeader.facts(self._headers, keys)
            # Some key is in several files: ask each key's own file (slow, but only for odd indexes).
            return tuple(_core.SafetensorsHeader.facts([self._files[k].header], [k])[0] for k in keys)
        except KeyError as exc:
            raise KeyError(f"checkpoint key is not indexed: {shown_key(exc.args[0])}") from None

    def release_maps(self) -> None:
        """Release every file's kept map (``source.files.release_maps``): called when a load or save ends."""
        release_maps(self.files)

    def paths_of(self, keys: Iterable[str]) -> dict[str, str]:
        """Each key's file path (``locate(k).file.path``), in bulk: taken from the index's key -> file map
        without locating any key (a plan names the file of each of its reads; a rank reads thousands).
        ``KeyError`` naming the first key the index does not have."""
        listed = keys if isinstance(keys, list) else list(keys)
        try:
            files = list(map(self._files.__getitem__, listed))
        except KeyError as exc:
            raise KeyError(f"checkpoint key is not indexed: {shown_key(exc.args[0])}") from None
        return dict(zip(listed, (f.path for f in files), strict=True))

    def keys_not_stored_as(self, dtype_names: Collection[str]) -> list[str]:
        """The keys whose stored safetensors dtype name (``locate(k).dtype_name``) is not in ``dtype_names``,
        in no particular order: the bulk form of asking every key's dtype, read from the parsed headers in Rust
        without locating (building a :class:`TensorEntry` or a ``HeaderEntry`` for) any key. Quantization
        detection asks it once for the non-float tensors of a 90k-tensor checkpoint."""
        names = frozenset(dtype_names)
        out: list[str] = []
        for file in self.files:
            found = list(map(file._names.__getitem__, file.header.positions_not_of(list(names))))
            if not self._disjoint:  # a key the index takes from another file, or leaves out
                found = [k for k in found if self._files.get(k) is file]
            out.extend(found)
        return out

    def keys_stored_as(self, dtype_names: Collection[str]) -> list[str]:
        """The keys whose stored safetensors dtype name is in ``dtype_names``, in no particular order: the
        complement of :meth:`keys_not_stored_as` (every header's dtype is one of ``_core.DTYPE_CODES``; an
        unknown one is refused when the header is parsed). Quantization planning asks it for the target's
        float dtype: a few hundred bf16 keys of DeepSeek-V3, against the ~90k it does not store as bf16."""
        wanted = frozenset(dtype_names)
        return self.keys_not_stored_as([name for name in _core.DTYPE_CODES if name not in wanted])

    def _locate_new(self, key: str) -> TensorEntry:
        file = self._files.get(key)
        if file is None:
            raise KeyError(f"checkpoint key is not indexed: {shown_key(key)}")
        # TensorEntry.of, inlined and built with tuple.__new__ (no Python __new__ frame): a plan locates each
        # key it reads, and the traced groups' sources.
        header = file.entry(key)
        name = header.dtype
        dtype = _READ_AS.get(name) or file.torch_dtype(key)
        entry = self._located[key] = _new_tuple(
            TensorEntry, (file, header.position, dtype, header.shape, name, header.nbytes, key)
        )
        return entry

    @property
    def total_bytes(self) -> int:
        """Data bytes of every file: the parser checked that each file's tensors tile its data section."""
        return sum(f.file_size - f.header.data_start for f in self.files)


def _check_shard_name(index_path: Path, name: object, text: bytes) -> None:
    """Refuses a ``weight_map`` file name that could leave the checkpoint directory: not a string, empty,
    with a NUL, absolute, or with a ``..`` component. The check is on the name, not on where it leads: a
    shard that is a symlink inside the directory (the Hub cache's ``snapshots/<sha>/x -> ../../blobs/<hash>``)
    is fine. Raised before any shard is opened."""
    if not isinstance(name, str):
        raise HeaderError(f"weight_map of {index_path} maps a key to {shown_key(name)}, not a file name")
    if name and "\x00" not in name and not os.path.isabs(name) and ".." not in name.split("/"):
        return
    keys = [k for k, v in _weight_map(index_path, text).items() if v == name][:1]
    entry = f"{shown_key(keys[0])}: {shown_key(name)}" if keys else shown_key(name)
    raise HeaderError(
        f"index {index_path} has weight_map entry {entry}, a shard path outside the checkpoint directory "
        f"{index_path.parent} (shard names must be relative paths inside it: not empty, no NUL, not absolute, "
        "no '..' component); refusing to open it"
    )


def _weight_map(index_path: Path, text: bytes) -> dict[Any, Any]:
    """The ``weight_map`` of an index, parsed by Python's ``json`` (the route that names what is wrong)."""
    weight_map: dict[Any, Any] = parse_index(index_path, text)["weight_map"]
    return weight_map


def _read_index(index_path: Path) -> bytes:
    try:
        return index_path.read_bytes()
    except OSError as exc:
        raise HeaderError(f"failed to read safetensors index {index_path}: {exc}") from exc


def index_metadata(folder: Path) -> dict[str, Any]:
    """The ``metadata`` object of the index in the checkpoint directory ``folder`` (``total_size``, a ``dtype``
    that transformers' ``from_pretrained`` takes when the config names none); empty without an index or without
    that object. A bad index: ``HeaderError`` naming it."""
    index_path = folder / INDEX_NAME
    if not index_path.is_file():
        return {}
    metadata = parse_index(index_path, _read_index(index_path)).get("metadata")
    return metadata if isinstance(metadata, dict) else {}


#: Header bytes (all shards together) above which ``_open_all`` parses in threads: below it, starting a pool
#: costs more than the parse (docs/perf-notes.md); a dense checkpoint's headers are a few KB each.
PARALLEL_HEADER_BYTES = 1 << 20


def _header_bytes(path: Path) -> int:
    """The header length a safetensors file declares in its first 8 bytes (0 when unreadable: the parse
    reports the error)."""
    try:  # non-blocking open, then fstat: a FIFO must not block here (the header reader refuses it)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return 0
    try:
        head = os.read(fd, 8) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    except OSError:
        return 0
    finally:
        os.close(fd)
    return int.from_bytes(head, "little") if len(head) == 8 else 0


def _open_all(paths: list[Path]) -> list[SafetensorsFile]:
    """Open (parse) several shard headers at once: the Rust parser runs without the GIL, so a
    many-shard checkpoint's big headers are parsed in parallel. Order and the first error are kept."""
    workers = min(len(paths), len(os.sched_getaffinity(0)), 8)
    if workers < 2 or sum(_header_bytes(p) for p in paths) < PARALLEL_HEADER_BYTES:
        return [open_file(p) for p in paths]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hp_fastload-header") as pool:
        return list(pool.map(open_file, paths))


def _refuse_torch_sharded(file: SafetensorsFile) -> None:
    meta = file.metadata() or {}
    info = meta.get("DCP_SHARDING_INFO")
    if not info:
        return
    try:
        sharding = json.loads(info)
    except ValueError as exc:
        raise HeaderError(f"{file.path}: DCP_SHARDING_INFO is not JSON: {exc}") from exc
    for key, record in (sharding or {}).items():
        offsets = (record or {}).get("saved_offsets") or []
        if any(int(o) != 0 for o in offsets):
            raise HeaderError(
                f"{file.path} is a torch-sharded export (DCP_SHARDING_INFO gives {shown_key(key)} offsets {offsets}): "
                "load it with torch.distributed.checkpoint.load(..., "
                "storage_reader=hp_fastload.dcp.HuggingFaceStorageReader(dir)) or consolidate it first "
                "(torch.distributed.checkpoint consolidate_safetensors_files)"
            )
