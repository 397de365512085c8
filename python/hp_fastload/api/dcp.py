"""A drop-in ``StorageReader`` for ``torch.distributed.checkpoint`` over Hugging Face safetensors files.

``HuggingFaceStorageReader(path)`` can replace torch's reader of the same name wherever it is used
(``dcp.load(state_dict, storage_reader=...)`` with the default planner and sharded DTensor state dicts, as
torchtitan does). Metadata comes from hp_fastload's strict Rust header parser; every plan is served by ONE
engine call (runs sorted by file offset, coalesced, threaded, GIL released) instead of one ``get_slice`` per
read item. Torch-sharded exports (``DCP_SHARDING_INFO``) are described as several chunks, like torch's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan as DcpLoadPlan
from torch.distributed.checkpoint.planner import LoadPlanner
from torch.futures import Future

from hp_fastload.convert.detect import detect
from hp_fastload.convert.quant import Dequant
from hp_fastload.convert.quant_info import QuantInfo
from hp_fastload.convert.symbolic import row_major_strides
from hp_fastload.errors import HeaderError, shown_key
from hp_fastload.execute.batch import Batch, engine_casts
from hp_fastload.execute.read import ExecStats
from hp_fastload.source.config import read_quant_config
from hp_fastload.source.files import SafetensorsFile, open_file
from hp_fastload.source.index import TensorEntry
from hp_fastload.source.objstore import is_object_url, list_safetensors, open_objects

_SHARDING_KEY = "DCP_SHARDING_INFO"


def _check_inside(root: Path | str, path: str) -> None:
    """Refuses a storage path that names a file outside the checkpoint directory ``root`` (metadata handed to
    ``set_up_storage_reader`` says which file holds each chunk): it must be ``root``/a relative name with no
    ``..`` component. Checked on the name, so symlinks inside the directory (a Hub snapshot) still work. An
    ``s3://`` root takes ``s3://`` object URLs under its prefix only."""
    if isinstance(root, str):  # an object prefix
        inside = path.startswith(root + "/") and "\x00" not in path and "\\" not in path
        name = path[len(root) + 1 :] if inside else ""
        if inside and name and ".." not in name.split("/") and not name.startswith("/"):
            return
        raise HeaderError(f"checkpoint storage path {path!r} is outside the checkpoint prefix {root}; refusing it")
    name = os.path.relpath(path, root) if "\x00" not in path else ""
    if "\x00" in path or os.path.isabs(name) or ".." in Path(name).parts or name in ("", "."):
        raise HeaderError(
            f"checkpoint storage path {path!r} is outside the checkpoint directory {root}; refusing to open it"
        )


def _copier(target: torch.Tensor, temp: torch.Tensor) -> Any:
    def run() -> None:
        target.copy_(temp)

    return run


class HuggingFaceStorageReader(FileSystemReader):
    """Reads a directory of ``*.safetensors`` files for ``torch.distributed.checkpoint.load``.

    Args:
        path: the checkpoint directory, or an ``s3://bucket/prefix`` whose ``*.safetensors`` objects are read
            with ranged GETs (each rank fetching only the byte ranges its plan reads).
        thread_count: engine threads (None: the machine's cores, capped). Named like torch's argument.
        backend: ``"auto"``, ``"mmap"`` or ``"pread"``.
    """

    def __init__(self, path: str | os.PathLike[str], thread_count: int | None = None, backend: str = "auto") -> None:
        text = os.fspath(path)
        #: The checkpoint's ``s3://`` prefix (no trailing slash), None for a directory. torch's reader keeps
        #: ``path`` as a ``Path``, which would fold the ``//``.
        self._url = text.rstrip("/") if is_object_url(text) else None
        super().__init__(path=text)
        self.thread_count = thread_count
        self.backend = backend
        self._files: dict[str, SafetensorsFile] = {}
        self.last_stats: ExecStats | None = None
        self._quant: QuantInfo | None = None

    def _root(self) -> Path | str:
        """The checkpoint directory, or its ``s3://`` prefix."""
        return self._url if self._url is not None else Path(str(self.path))

    def _file(self, path: str) -> SafetensorsFile:
        file = self._files.get(path)
        if file is None:
            _check_inside(self._root(), path)
            file = self._files[path] = open_objects([path])[0] if self._url is not None else open_file(path)
        return file

    def _stored_paths(self) -> list[str]:
        """The checkpoint's ``*.safetensors`` files (objects: their URLs, headers fetched together)."""
        if self._url is None:
            return sorted(str(p) for p in Path(str(self.path)).glob("*.safetensors"))
        urls = list_safetensors(self._url)
        missing = [u for u in urls if u not in self._files]
        for url in missing:
            _check_inside(self._url, url)
        self._files.update(zip(missing, open_objects(missing), strict=True))
        return urls

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        root = self._root()
        paths = self._stored_paths()
        if not paths:
            raise FileNotFoundError(f"no *.safetensors files under {root}")
        state: dict[str, TensorStorageMetadata] = {}
        storage: dict[MetadataIndex, Any] = {}
        for path in paths:
            file = self._file(path)
            sharding = None
            meta = file.metadata() or {}
            if meta.get(_SHARDING_KEY):
                try:
                    sharding = json.loads(meta[_SHARDING_KEY])
                except ValueError as exc:
                    raise HeaderError(f"{path}: {_SHARDING_KEY} is not JSON: {exc}") from exc
            for key in file:
                shape = tuple(file.shape(key))
                dtype = file.torch_dtype(key)
                offsets = tuple(int(o) for o in sharding[key]["saved_offsets"]) if sharding else (0,) * len(shape)
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(shape))
                md = state.get(key)
                if md is None:
                    state[key] = TensorStorageMetadata(
                        properties=TensorProperties(dtype=dtype),
                        size=torch.Size([o + s for o, s in zip(offsets, shape, strict=True)]),
                        chunks=[chunk],
                    )
                else:
                    if md.properties.dtype != dtype:
                        raise HeaderError(
                            f"tensor {shown_key(key)} has chunks of dtypes {md.properties.dtype} and {dtype}"
                        )
                    md.chunks.append(chunk)
                    md.size = torch.Size([max(a, o + s) for a, o, s in zip(md.size, offsets, shape, strict=True)])
                index = MetadataIndex(fqn=key, offset=torch.Size(offsets))
                if index in storage:
                    raise HeaderError(
                        f"tensor {shown_key(key)} at offsets {offsets} is stored in two files (one is {path})"
                    )
                storage[index] = path
        self._quant = detect(
            state, lambda k: state[k].properties.dtype, read_quant_config(root)
        )  # quantized tensors are refused in read_data unless read into their own dtype
        metadata = Metadata(state_dict_metadata=state, storage_data=storage)  # type: ignore[arg-type]
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # type: ignore[union-attr]
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data
        if self.storage_data is None:
            raise HeaderError("checkpoint metadata has no storage data")

    def read_data(self, plan: DcpLoadPlan, planner: LoadPlanner) -> Future[None]:
        batch = self._batch()
        commits: list[tuple[Any, torch.Tensor]] = []
        quant = self._quant if self._quant is not None else self._detect_quant()
        if quant:  # every request is checked before the engine reads anything
            for req in plan.items:
                key = req.storage_index.fqn
                if self._dequantizes(key):
                    continue
                file = self._file(self.storage_data[req.storage_index])
                quant.check_claim(key, planner.resolve_tensor(req).dtype, [key], lambda k, f=file: f.torch_dtype(k))
        for req in plan.items:
            target = planner.resolve_tensor(req).detach()
            lengths = tuple(req.lengths)
            if tuple(target.shape) != lengths:
                raise AssertionError(f"req {req.storage_index} mismatch sizes {tuple(target.shape)} vs {lengths}")
            self._add_request(batch, req, target)
            commits.append((req, target))
        stats = ExecStats()
        batch.run(self.thread_count, self.backend, stats)
        self.last_stats = stats
        for req, target in commits:
            planner.commit_tensor(req, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _batch(self) -> Batch:
        return Batch()

    def _dequantizes(self, key: str) -> bool:
        """Whether this reader dequantizes ``key`` itself (the quantized reader does)."""
        return False

    def _add_request(self, batch: Batch, req: Any, target: torch.Tensor) -> None:
        """One read item of the plan: the box of the stored tensor into ``target`` (through a temporary when
        the engine cannot write it: another device or a cast it does not do)."""
        path = self.storage_data[req.storage_index]
        file = self._file(path)
        key = req.storage_index.fqn
        strides = row_major_strides(tuple(file.shape(key)))
        base = sum(o * s for o, s in zip(req.storage_offsets, strides, strict=True))
        lengths = tuple(req.lengths)
        src_dtype = file.torch_dtype(key)
        if target.device.type == "cpu" and engine_casts(src_dtype, target.dtype):
            batch.add(key, base, strides, lengths, target, (0,) * len(lengths), file=file)
        else:
            temp = torch.empty(lengths, dtype=src_dtype)
            batch.add(key, base, strides, lengths, temp, (0,) * len(lengths), file=file)
            batch.keep.append(temp)
            batch.after.append(_copier(target, temp))

    def _detect_quant(self) -> QuantInfo:
        """The quantized tensors of the checkpoint, for a reader whose metadata came from elsewhere."""
        root = self._root()
        dtypes: dict[str, torch.dtype] = {}
        for path in self._stored_paths():
            file = self._file(path)
            dtypes.update((key, file.torch_dtype(key)) for key in file)
        self._quant = detect(dtypes, dtypes.__getitem__, read_quant_config(root))
        return self._quant

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return is_object_url(os.fspath(checkpoint_id)) or Path(checkpoint_id).is_dir()


class QuantizedHuggingFaceStorageReader(HuggingFaceStorageReader):
    """A drop-in for torch's ``QuantizedHuggingFaceStorageReader`` (same arguments, same values).

    fp8 ``X.weight`` with ``X.weight_scale_inv`` (fixed ``block_size`` blocks, ragged last ones) is dequantized
    by the engine in the copy pass: each rank reads only the weight bytes of its boxes (and the scale
    tensors), computes ``f32(q) * scale`` and rounds into ``target_dtype`` (then, like torch, copies into the
    state dict's tensor). MXFP4 ``X_blocks`` + ``X_scales`` are served as ``X_blocks`` of the dequantized
    shape ``[..., G * 32]`` (torch's layout, not transposed), dequantized by the engine the same way: each box
    reads only its packed bytes (two e2m1 codes a byte, low nibble first) and its scale is ``2^(e - 127)``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        thread_count: int | None = None,
        target_dtype: torch.dtype = torch.float32,
        block_size: int = 128,
        backend: str = "auto",
    ) -> None:
        super().__init__(path, thread_count=thread_count, backend=backend)
        self.target_dtype = target_dtype
        self.block_size = block_size
        self._scales: dict[str, str] = {}  # quantized key -> its scale key
        self._paths: dict[str, str] = {}  # key -> file path
        self._packed_shapes: dict[str, tuple[int, ...]] = {}  # MXFP4 blocks key -> its stored shape

    def _index_files(self) -> None:
        if self._paths:
            return
        for path in self._stored_paths():
            for key in self._file(path):
                self._paths.setdefault(key, path)
        for key in self._paths:
            if key.endswith(".weight_scale_inv") and key.replace(".weight_scale_inv", ".weight") in self._paths:
                self._scales[key.replace(".weight_scale_inv", ".weight")] = key
            elif key.endswith("_scales") and key.replace("_scales", "_blocks") in self._paths:
                blocks = key.replace("_scales", "_blocks")
                self._scales[blocks] = key
                self._packed_shapes[blocks] = tuple(self._file(self._paths[blocks]).shape(blocks))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = super().read_metadata(*args, **kwargs)
        self._index_files()
        for key, shape in self._packed_shapes.items():
            md = metadata.state_dict_metadata.get(key)
            if isinstance(md, TensorStorageMetadata):
                size = torch.Size([*shape[:-2], shape[-2] * shape[-1] * 2])
                md.size = size
                # the chunk too (torch's reader keeps the packed 4-d chunk, and its planner then asks for
                # one value of every 32)
                md.chunks = [ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=size)]
        return metadata

    def _dequantizes(self, key: str) -> bool:
        self._index_files()
        return key in self._scales

    def _batch(self) -> Batch:
        self._index_files()
        return Batch(self._locate)

    def _locate(self, key: str) -> TensorEntry:
        """Where a scale tensor lives (key -> file, position, dtype): what a batch needs for second sources."""
        file = self._file(self._paths[key])
        return TensorEntry.of(file, key)

    def _dequant(self, key: str) -> Dequant:
        """How the engine dequantizes ``key``: fp8 by its scale over (``block_size``) blocks; MXFP4 blocks as
        their 4-bit elements, one e8m0 exponent per group of 32 along the last dim."""
        shape = self._shape(key)
        packed = self._packed_shapes.get(key)
        if packed is not None:
            return Dequant(self._scales[key], shape, (1,) * (len(shape) - 1) + (packed[-1] * 2,))
        block = (self.block_size,) * min(2, len(shape))
        return Dequant(self._scales[key], shape, (1,) * (len(shape) - len(block)) + block)

    def _shape(self, key: str) -> tuple[int, ...]:
        """The shape the state dict sees: MXFP4 ``*_blocks`` ``[..., G, 16]`` as their 4-bit elements
        ``[..., G * 32]`` (the engine reads them as such, two a byte, low nibble first)."""
        packed = self._packed_shapes.get(key)
        if packed is not None:
            return (*packed[:-2], packed[-2] * packed[-1] * 2)
        return tuple(self._file(self._paths[key]).shape(key))

    def _add_request(self, batch: Batch, req: Any, target: torch.Tensor) -> None:
        key = req.storage_index.fqn
        if key not in self._scales:
            super()._add_request(batch, req, target)
            return
        file = self._file(self._paths[key])
        strides = row_major_strides(self._shape(key))
        base = sum(o * s for o, s in zip(req.storage_offsets, strides, strict=True))
        lengths = tuple(req.lengths)
        direct = target.device.type == "cpu" and target.dtype == self.target_dtype
        dest = target if direct else torch.empty(lengths, dtype=self.target_dtype)
        batch.add(key, base, strides, lengths, dest, (0,) * len(lengths), self._dequant(key), file=file)
        if not direct:
            batch.keep.append(dest)
            batch.after.append(_copier(target, dest))
