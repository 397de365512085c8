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
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from .engine import SafetensorsFile, open_file
from .errors import HeaderError
from .execute import ExecStats, _Batch, _engine_casts
from .quant import QuantInfo, detect, read_quant_config

__all__ = ["HuggingFaceStorageReader"]

_SHARDING_KEY = "DCP_SHARDING_INFO"


def _copier(target: torch.Tensor, temp: torch.Tensor) -> Any:
    def run() -> None:
        target.copy_(temp)

    return run


class HuggingFaceStorageReader(FileSystemReader):
    """Reads a directory of ``*.safetensors`` files for ``torch.distributed.checkpoint.load``.

    Args:
        path: the checkpoint directory.
        thread_count: engine threads (None: the machine's cores, capped). Named like torch's argument.
        backend: ``"auto"``, ``"mmap"`` or ``"pread"``.
    """

    def __init__(self, path: str | os.PathLike[str], thread_count: int | None = None, backend: str = "auto") -> None:
        super().__init__(path=str(path))
        self.thread_count = thread_count
        self.backend = backend
        self._files: dict[str, SafetensorsFile] = {}
        self.last_stats: ExecStats | None = None
        self._quant: QuantInfo | None = None

    def _file(self, path: str) -> SafetensorsFile:
        file = self._files.get(path)
        if file is None:
            file = self._files[path] = open_file(path)
        return file

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        root = Path(str(self.path))
        paths = sorted(str(p) for p in root.glob("*.safetensors"))
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
                        raise HeaderError(f"tensor {key!r} has chunks of dtypes {md.properties.dtype} and {dtype}")
                    md.chunks.append(chunk)
                    md.size = torch.Size([max(a, o + s) for a, o, s in zip(md.size, offsets, shape, strict=True)])
                index = MetadataIndex(fqn=key, offset=torch.Size(offsets))
                if index in storage:
                    raise HeaderError(f"tensor {key!r} at offsets {offsets} is stored in two files (one is {path})")
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

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        batch = _Batch(None)
        commits: list[tuple[Any, torch.Tensor]] = []
        quant = self._quant if self._quant is not None else self._detect_quant()
        if quant:  # every request is checked before the engine reads anything
            for req in plan.items:
                key = req.storage_index.fqn
                file = self._file(self.storage_data[req.storage_index])
                quant.check_claim(key, planner.resolve_tensor(req).dtype, [key], lambda k, f=file: f.torch_dtype(k))
        for req in plan.items:
            path = self.storage_data[req.storage_index]
            file = self._file(path)
            key = req.storage_index.fqn
            shape = tuple(file.shape(key))
            strides = [1] * len(shape)
            for d in range(len(shape) - 2, -1, -1):
                strides[d] = strides[d + 1] * shape[d + 1]
            base = sum(o * s for o, s in zip(req.storage_offsets, strides, strict=True))
            target = planner.resolve_tensor(req).detach()
            lengths = tuple(req.lengths)
            if tuple(target.shape) != lengths:
                raise AssertionError(f"req {req.storage_index} mismatch sizes {tuple(target.shape)} vs {lengths}")
            src_dtype = file.torch_dtype(key)
            if target.device.type == "cpu" and _engine_casts(src_dtype, target.dtype):
                batch.add_from(file, key, base, strides, lengths, target, (0,) * len(lengths))
            else:
                temp = torch.empty(lengths, dtype=src_dtype)
                batch.add_from(file, key, base, strides, lengths, temp, (0,) * len(lengths))
                batch.keep.append(temp)
                batch.after.append(_copier(target, temp))
            commits.append((req, target))
        stats = ExecStats()
        batch.run(self.thread_count, self.backend, stats)
        self.last_stats = stats
        for req, target in commits:
            planner.commit_tensor(req, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _detect_quant(self) -> QuantInfo:
        """The quantized tensors of the checkpoint, for a reader whose metadata came from elsewhere."""
        root = Path(str(self.path))
        dtypes: dict[str, torch.dtype] = {}
        for path in sorted(str(p) for p in root.glob("*.safetensors")):
            file = self._file(path)
            dtypes.update((key, file.torch_dtype(key)) for key in file)
        self._quant = detect(dtypes, dtypes.__getitem__, read_quant_config(root))
        return self._quant

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return Path(checkpoint_id).is_dir()
