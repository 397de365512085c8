"""Export: ``save(model, path)``, the load run backwards, every rank writing its own regions of the output.

Owns the released layout (keys, shapes and dtypes as transformers' ``save_pretrained`` writes them: tied
tensors dropped and the conversions reverted by transformers' own code, run on meta tensors of the global
shapes, so no data moves), the deterministic file layout (transformers' shard split, safetensors' header and
data order), the temporary sibling directory and its atomic rename, the choice of one writer per replicated
region, the write batches (the load plan of each rank's local shards against the virtual checkpoint, handed
to the engine in the write direction; device shards through pinned double-buffered host slabs), the torch
fallback for targets whose conversion has no exact region inverse, and the cross-rank agreement that makes a
failure on any rank leave nothing at ``path``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
import shutil
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from .batch import Batch, Slabs, staging_chunks
from .checkpointer import _agree as _agree_as
from .checkpointer import _dist_active, _plan_at
from .engine import TORCH_TO_SAFETENSORS, gc_paused
from .errors import PlanError, TargetError
from .index import CheckpointIndex
from .plan import LoadContext, LoadPlan
from .targets import Target

__all__ = ["SaveReport", "released_tensors", "save", "shard_files"]

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
DEFAULT_BATCH_BYTES = 1 << 30
DEFAULT_STAGING_BYTES = 512 << 20

# safetensors writes tensor data sorted by dtype, largest enum value first (then by name); this is its enum
# order (safetensors' ``Dtype``), checked against safetensors' own files in tests/test_save.py.
_SAFETENSORS_DTYPE_ORDER = (
    "BOOL",
    "F4",
    "F6_E2M3",
    "F6_E3M2",
    "U8",
    "I8",
    "F8_E5M2",
    "F8_E4M3",
    "F8_E8M0",
    "F8_E4M3FNUZ",
    "F8_E5M2FNUZ",
    "I16",
    "U16",
    "F16",
    "BF16",
    "I32",
    "U32",
    "F32",
    "C64",
    "F64",
    "I64",
    "U64",
)
_DTYPE_RANK = {name: i for i, name in enumerate(_SAFETENSORS_DTYPE_ORDER)}
# every dtype the engine knows a safetensors name for (unsigned, complex and fnuz float8 included)
_TORCH_TO_ST = {dtype: name for dtype, name in TORCH_TO_SAFETENSORS.items() if name in _DTYPE_RANK}


@dataclass
class SaveReport:
    """What ``save`` wrote. ``bytes_written``: this rank's positioned writes (tensor data);
    ``bytes_written_by_rank``: every rank's, indexed by rank. ``fallbacks``: checkpoint keys whose conversion
    had no exact region inverse, computed with torch from the gathered tensor and written by rank 0."""

    path: str
    files: list[str]
    tensors: int
    total_bytes: int
    bytes_written: int
    bytes_written_by_rank: list[int]
    fallbacks: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        return (
            f"saved {self.tensors} tensors in {len(self.files)} files ({self.total_bytes / 1e9:.3f} GB) to "
            f"{self.path} in {self.seconds:.2f} s; this rank wrote {self.bytes_written / 1e9:.3f} GB"
            + (f"; {len(self.fallbacks)} tensors through torch" if self.fallbacks else "")
        )


@dataclass
class _FileLayout:
    name: str
    header: bytes
    size: int
    keys: list[str]


@dataclass
class _Layout:
    """The output every rank derives alike: files with their headers, the index, the key -> meta tensor."""

    files: list[_FileLayout]
    index: dict[str, Any] | None
    released: dict[str, torch.Tensor]  # key -> meta tensor (shape, dtype), in transformers' order


# ---------------------------------------------------------------------------------------------------------
# The released layout


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    from huggingface_hub.serialization._base import parse_size_to_int

    return int(parse_size_to_int(size))


@contextlib.contextmanager
def _conversions(model: nn.Module, rules: list[Any] | None) -> Any:
    """``model._weight_conversions`` set to ``rules`` for transformers' revert (restored after)."""
    if rules is None:
        yield
        return
    missing = object()
    saved = model.__dict__.get("_weight_conversions", missing)
    model._weight_conversions = rules  # type: ignore[assignment]
    try:
        yield
    finally:
        if saved is missing:
            model.__dict__.pop("_weight_conversions", None)
        else:
            model._weight_conversions = saved


def _meta_state_dict(model: nn.Module, meta_ok: bool = False) -> dict[str, torch.Tensor]:
    """The model's state dict as meta tensors of the global shapes (what ``save_pretrained`` would see
    gathered), refusing tensors without data unless ``meta_ok`` (a dry run of the layout)."""
    out: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):
            continue
        local = value.to_local() if hasattr(value, "to_local") else value
        if local.device.type == "meta" and not meta_ok:
            raise TargetError(f"{name}: still on the meta device (materialize the model before saving)")
        out[name] = torch.empty(tuple(value.shape), dtype=value.dtype, device="meta")
    ignore = getattr(model, "_keys_to_ignore_on_save", None) or ()
    for key in ignore:
        out.pop(key, None)
    return out


def _released(model: nn.Module, rules: list[Any] | None, meta_ok: bool = False) -> dict[str, torch.Tensor]:
    """Released key -> meta tensor, by transformers' own tie removal and reverse conversion (for a module that
    is not a transformers model: aliases dropped by name, and the rules reverted when there are any)."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import PreTrainedModel, remove_tied_weights_from_state_dict

    if rules is None and getattr(model, "_hp_used_replacement_weight_conversions", None):
        raise NotImplementedError(
            "the model was loaded through replacement conversions (model._hp_used_replacement_weight_conversions); "
            "their two-stage reverse is not supported by save: pass weights_mapping explicitly"
        )
    if getattr(model, "hf_quantizer", None) is not None:
        raise NotImplementedError(
            f"{type(model).__name__} is quantized ({type(model.hf_quantizer).__name__}); saving quantized models is "
            "not supported (save_pretrained writes its quantizer's own state dict and metadata)"
        )
    state = _meta_state_dict(model, meta_ok)
    pretrained = isinstance(model, PreTrainedModel)
    state = (
        remove_tied_weights_from_state_dict(state, cast(Any, model)) if pretrained else _drop_plain_ties(model, state)
    )
    if not pretrained and rules is None and getattr(model, "_weight_conversions", None) is None:
        return state
    for rule in rules or getattr(model, "_weight_conversions", None) or ():
        if not callable(getattr(rule, "reverse_transform", None)):
            raise PlanError(
                f"rule {type(rule).__module__}.{type(rule).__name__} {getattr(rule, 'source_patterns', '')} has no "
                "reverse_transform(); saving needs transformers' WeightRenaming / WeightConverter rules"
            )
    with _conversions(model, rules):
        reverted = revert_weight_conversion(cast(Any, model), state)
    return {key: value for key, value in reverted.items() if isinstance(value, torch.Tensor)}


def _drop_plain_ties(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """For a model that is not a transformers model: aliases of one tensor keep the first name in sort order."""
    seen: set[int] = set()
    params: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    params.update(model.named_buffers(remove_duplicate=False))
    out = {}
    for key in sorted(state):
        ident = id(params[key]) if key in params else id(state[key])
        if ident in seen:
            continue
        seen.add(ident)
        out[key] = state[key]
    return {key: out[key] for key in state if key in out}


def _file_header(tensors: Sequence[tuple[str, torch.Tensor]]) -> tuple[bytes, int, list[str]]:
    """safetensors' header for ``tensors`` ({"format": "pt"} metadata), its data size and the data order."""
    entries = []
    for key, meta in tensors:
        code = _TORCH_TO_ST.get(meta.dtype)
        if code is None:
            raise PlanError(f"{key}: dtype {meta.dtype} has no safetensors encoding")
        entries.append((key, code, tuple(meta.shape), meta.numel() * meta.element_size()))
    entries.sort(key=lambda e: (-_DTYPE_RANK[e[1]], e[0].encode()))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, code, shape, nbytes in entries:
        header[key] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, offset, [e[0] for e in entries]


def released_tensors(model: nn.Module, weights_mapping: Iterable[Any] | None = None) -> dict[str, torch.Tensor]:
    """The released layout of ``model`` without data: key -> meta tensor (global shape, dtype), as ``save``
    derives it (ties removed, conversions reverted by transformers). Works on a model on the meta device."""
    return _released(model, _forward_rules(model, weights_mapping), meta_ok=True)


def shard_files(
    released: dict[str, torch.Tensor], max_shard_size: int | str = "5GB", total_parameters: int | None = None
) -> tuple[list[tuple[str, bytes, int, list[str]]], dict[str, Any] | None]:
    """The files ``save`` writes for ``released`` (key -> meta tensor): ``(name, header, size, data order)``
    per file, split as transformers does, and the index (None for a single file)."""
    layout = _split(released, max_shard_size, total_parameters)
    return [(f.name, f.header, f.size, f.keys) for f in layout.files], layout.index


def _layout(model: nn.Module, rules: list[Any] | None, max_shard_size: int | str) -> _Layout:
    released = _released(model, rules)
    if not released:
        raise PlanError("the model has no tensors to save")
    count = getattr(model, "num_parameters", None)
    total = count() if callable(count) else sum(p.numel() for p in model.parameters())
    return _split(released, max_shard_size, total)


def _split(released: dict[str, torch.Tensor], max_shard_size: int | str, total: int | None) -> _Layout:
    from huggingface_hub import split_state_dict_into_shards_factory

    # transformers splits the reverted state dict with huggingface_hub, which counts a storage once and keeps
    # tensors sharing one (experts unbound from a stacked tensor) in one file. The meta tensors keep the
    # views' storage identity, so the same rule gives the same files without data.
    split = split_state_dict_into_shards_factory(
        released,
        get_storage_size=lambda t: t.untyped_storage().nbytes(),
        get_storage_id=lambda t: (t.untyped_storage()._cdata, t.untyped_storage().nbytes()),
        filename_pattern="model{suffix}.safetensors",
        max_shard_size=_parse_size(max_shard_size),
    )
    files = []
    for name, keys in split.filename_to_tensors.items():
        header, data, order = _file_header([(key, released[key]) for key in keys])
        files.append(_FileLayout(name, header, len(header) + data, order))
    index = None
    if split.is_sharded:
        if total is None:
            total = sum(t.numel() for t in released.values())
        index = {
            "metadata": {"total_parameters": total, **split.metadata},
            "weight_map": split.tensor_to_filename,
        }
    return _Layout(files, index, released)


# ---------------------------------------------------------------------------------------------------------
# Directory handling


def _fsync_dir(path: Path) -> None:
    _fsync(path)


def _check_destination(path: Path, overwrite: bool) -> None:
    if path.is_symlink():  # the swap would replace the link, not what it points to
        raise FileExistsError(
            f"{path} is a symbolic link (to {os.readlink(path)}); refusing to replace it: pass the directory it "
            "points to"
        )
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} exists and is not a directory; refusing to replace it")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise FileExistsError(f"{path} is a non-empty directory; pass overwrite=True to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)  # as save_pretrained's makedirs


_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swaps two directory entries (Linux ``renameat2(RENAME_EXCHANGE)``); False if unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    rc = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    if rc != 0:
        errno = ctypes.get_errno()
        if errno in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: the file system cannot exchange
            return False
        raise OSError(errno, os.strerror(errno), str(b))
    return True


def _publish(tmp: Path, path: Path, overwrite: bool) -> None:
    """Moves the finished ``tmp`` to ``path``: a plain rename, or, over an existing directory, an atomic
    exchange (the old directory is removed only once the new one is in place and its entry synced).

    Without ``RENAME_EXCHANGE`` the old directory is moved aside first; if moving the new one in then fails,
    the old one is put back before the error propagates. Once the new directory is at ``path`` the save has
    succeeded: an old directory that cannot be removed is left (hidden, next to ``path``) with a warning."""
    _check_destination(path, overwrite)  # again: something may have appeared there while the ranks wrote
    if not path.exists() or not any(path.iterdir()):
        os.rename(tmp, path)  # over an empty directory too: rename(2) replaces it atomically
        _fsync_dir(path.parent)
        return
    if _exchange(tmp, path):
        old = tmp  # tmp now holds the previous directory
    else:
        old = path.with_name(f".{path.name}.hp_old-{secrets.token_hex(4)}")
        os.rename(path, old)
        try:
            os.rename(tmp, path)
        except BaseException:
            os.rename(old, path)  # the user's directory back at path
            raise
    _fsync_dir(path.parent)  # the new entry durable before the previous directory goes
    try:
        shutil.rmtree(old)
    except OSError as exc:
        warnings.warn(
            f"hp_fastload.save: the checkpoint is at {path}, but its previous directory could not be removed "
            f"and is left at {old} ({exc})",
            stacklevel=3,
        )


# ---------------------------------------------------------------------------------------------------------
# Writers and fallbacks


def _mesh_coordinate_writes(target: Target) -> bool:
    """Whether this rank writes ``target``'s region: plain tensors on rank 0; a DTensor on the replica whose
    coordinate is 0 along every mesh dim it is replicated on (Partial cannot be saved without a reduction)."""
    from torch.distributed.tensor import Partial, Replicate

    if not target.is_dtensor:
        return not _dist_active() or torch.distributed.get_rank() == 0
    assert target.placements is not None
    if target.coordinate is None or not _first_instance(target.tensor.device_mesh):  # type: ignore[attr-defined]
        return False
    for placement, coord in zip(target.placements, target.coordinate, strict=True):
        if isinstance(placement, Partial):
            raise TargetError(f"{target.name}: a Partial DTensor holds partial sums; reduce it before saving")
        if isinstance(placement, Replicate) and coord != 0:
            return False
    return True


def _first_instance(mesh: Any) -> bool:
    """Whether ``mesh`` is the first of the copies of a sub-mesh (``mesh["dp"]`` of a (dp, tp) mesh exists once
    per tp coordinate, each copy holding the same shards): the copy holding the root mesh's lowest rank. A
    mesh that is not a sub-mesh has no copies."""
    get_root = getattr(mesh, "_get_root_mesh", None)
    if get_root is None:
        from torch.distributed.device_mesh import _mesh_resources

        root = _mesh_resources.get_root_mesh(mesh)
    else:
        root = get_root()
    if root is None or root is mesh:
        return True
    return int(root.mesh.min()) in set(mesh.mesh.flatten().tolist())


class _WriteBatch(Batch):
    """One engine call in the write direction: the load's records, executed the other way."""

    def run(self, threads: int | None, backend: str | None, stats: Any) -> None:
        result = self.execute(threads, backend, direction="write")
        if result is not None:
            stats.bytes_written += int(result["bytes_copied"])
            stats.items += self.count
            stats.files.update(Path(header.path).name for header in self.headers)


@dataclass
class _Stats:
    bytes_written: int = 0
    items: int = 0
    files: set[str] = field(default_factory=set)  # names of the shard files this rank wrote into


def _write_batch(batch: _WriteBatch, threads: int | None, stats: _Stats) -> None:
    batch.run(threads, None, stats)


def _planned_bytes(
    save_plan: LoadPlan, context: LoadContext, fallback: set[str], groups: list[tuple[list[str], list[Target]]]
) -> int:
    """The data bytes this rank is about to write (its region writes, and on rank 0 the fallback tensors)."""
    total = 0
    for name, items in save_plan.region_reads.items():
        if not items or name in fallback or not _mesh_coordinate_writes(context.target(name)):
            continue
        total += items.total_nbytes
    if _rank0():
        total += sum(context.index.locate(key).nbytes for keys, _ in groups for key in keys)
    return total


def _check_writers(planned: list[int], layout: _Layout) -> None:
    """Every data byte has exactly one writer, as far as sums tell: a replica that also writes, or a region no
    rank writes, changes the sum (checked before any byte is written)."""
    data = sum(f.size - len(f.header) for f in layout.files)
    if sum(planned) != data:
        raise PlanError(
            f"the ranks would write {sum(planned)} bytes ({planned} by rank) of {data} bytes of tensor data: some "
            "region has no writer or several (replicas this rank cannot tell apart from its mesh)"
        )


def _check_fallbacks_agree(by_rank: list[list[list[str]]]) -> None:
    """Every rank runs the fallback groups' gathers in the same order: the ranks must have planned the same
    groups, else they would sit in different collectives (checked before any byte is written)."""
    differing = [rank for rank, groups in enumerate(by_rank) if groups != by_rank[0]]
    if differing:
        raise PlanError(
            f"the ranks planned different tensors to convert with torch: rank 0 {by_rank[0]}, rank "
            f"{differing[0]} {by_rank[differing[0]]}; every rank must save the same model with the same rules"
        )


class _D2HStager(Slabs):
    """Host staging for device shards: two reusable slabs of ``budget // 2`` bytes (pinned when CUDA is there).

    A shard's rows are copied into the current slab on a side stream (non-blocking); when a slab is full its
    batch waits, and it is written only after the next slab's copies have been queued, so the device-to-host
    copies of one slab overlap the positioned writes of the other. Memory stays at ``budget`` (a block of rows
    larger than a slab gets a slab of its own size); rows are cut as the load's staging cuts them.
    """

    def stage(self, rows: torch.Tensor) -> torch.Tensor:
        """A host copy of ``rows`` in the current slab (queued, not finished: see ``event``)."""
        nbytes = rows.numel() * rows.element_size()
        slab = self._slab(self.used + nbytes)
        view = slab[self.used : self.used + nbytes].view(rows.dtype).view(rows.shape)
        if self.stream is not None and rows.device.type == "cuda":
            self.stream.wait_stream(torch.cuda.current_stream(rows.device))
            with torch.cuda.stream(self.stream):
                view.copy_(rows, non_blocking=True)
        else:
            view.copy_(rows)
        self.used += -(-nbytes // self.ALIGN) * self.ALIGN
        return view

    def event(self) -> Any:
        """Marks the copies queued so far (None without CUDA: they are done) and switches slabs."""
        event = None
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record(self.stream)
        self.current = 1 - self.current
        self.used = 0
        return event


def _write_regions(
    save_plan: LoadPlan,
    context: LoadContext,
    fallback: set[str],
    threads: int | None,
    batch_bytes: int,
    stats: _Stats,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    stage_all: bool = False,
) -> None:
    """The region writes of this rank, in engine batches of ``batch_bytes``. Device shards (and, with
    ``stage_all``, CPU ones: the tests' way through this path without a GPU) go through ``_D2HStager``."""
    index = context.index
    batch = _WriteBatch(index.locate)
    stager: _D2HStager | None = None
    pending: tuple[_WriteBatch, Any] | None = None  # a full slab's batch, written once the next one is queued

    def run_pending() -> None:
        nonlocal pending
        if pending is not None:
            done, event = pending
            if event is not None:
                event.synchronize()
            _write_batch(done, threads, stats)
            pending = None

    def flush(staged: bool) -> None:
        nonlocal batch, pending
        if staged:
            assert stager is not None
            event = stager.event()
            run_pending()  # the previous slab, while this one's copies run
            pending = (batch, event)
        else:
            _write_batch(batch, threads, stats)
        batch = _WriteBatch(index.locate)

    for name, items in save_plan.region_reads.items():
        target = context.target(name)
        if not items or name in fallback or not _mesh_coordinate_writes(target):
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
            stager = _D2HStager(staging_bytes)
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
        _write_batch(batch, threads, stats)


def _write_whole(index: CheckpointIndex, tensors: dict[str, torch.Tensor], threads: int | None, stats: _Stats) -> None:
    batch = _WriteBatch(index.locate)
    for key, tensor in tensors.items():
        entry = index.locate(key)
        if tuple(tensor.shape) != tuple(entry.shape) or tensor.dtype != entry.dtype:
            raise PlanError(
                f"{key}: the reverse conversion gave {tuple(tensor.shape)} {tensor.dtype}, the released layout "
                f"says {tuple(entry.shape)} {entry.dtype}"
            )
        tensor = tensor.contiguous()
        batch.add(key, 0, tuple(tensor.stride()), tuple(tensor.shape), tensor, (0,) * tensor.dim())
    _write_batch(batch, threads, stats)


def _fallback_groups(
    save_plan: LoadPlan, context: LoadContext
) -> tuple[list[tuple[list[str], list[Target]]], set[str]]:
    """Targets the region writes cannot invert exactly: deferred groups (untraceable conversions) and
    region reads with an elementwise post-op. Each entry: (checkpoint keys, targets), in plan order."""
    groups: list[tuple[list[str], list[Target]]] = []
    names: set[str] = set()
    for deferred in save_plan.deferred:
        targets = list({id(t): t for t in map(context.target, deferred.claims.values())}.values())
        groups.append((list(dict.fromkeys(deferred.keys)), targets))
        names.update(t.names[0] for t in targets)
    for name, items in save_plan.region_reads.items():
        if items.post is not None:  # some item has an elementwise post-op
            groups.append((sorted(set(items.keys)), [context.target(name)]))
            names.add(name)
    return groups, names


def _run_fallbacks(
    model: nn.Module,
    rules: list[Any] | None,
    index: CheckpointIndex,
    groups: list[tuple[list[str], list[Target]]],
    threads: int | None,
    stats: _Stats,
) -> list[str]:
    """Gathers each fallback group's targets (every rank, same order), reverts them with transformers on rank
    0 and writes the checkpoint tensors whole there. Returns the keys written this way (on rank 0; [] on the others).

    One agreement per group: the gathers of a group are collectives, so a rank whose revert or write of a
    group failed must not go on to the next group's gathers while the others wait in the agreement (the
    ranks would sit in different collectives: gloo aborts the process, NCCL hangs)."""
    from transformers.core_model_loading import revert_weight_conversion

    rank0 = _rank0()

    def one_group(keys: list[str], targets: list[Target]) -> list[str]:
        with torch.no_grad():  # every collective of the group first, then the local work that may fail
            gathered = [t.tensor.full_tensor() if t.is_dtensor else t.tensor.detach() for t in targets]  # type: ignore[attr-defined]
        if not rank0:
            return []
        state = {alias: full.cpu() for target, full in zip(targets, gathered, strict=True) for alias in target.names}
        with _conversions(model, rules):
            reverted = revert_weight_conversion(cast(Any, model), state)
        missing = [key for key in keys if key not in reverted]
        if missing:
            raise PlanError(f"the reverse conversion of {', '.join(t.name for t in targets)} did not give {missing}")
        _write_whole(index, {key: reverted[key] for key in keys}, threads, stats)
        return keys

    written: list[str] = []
    for keys, targets in groups:
        written.extend(_agree(f"Writing {keys[0]} (converted with torch)", lambda k=keys, t=targets: one_group(k, t)))
    return written


def _check_coverage(save_plan: LoadPlan) -> None:
    report = save_plan.report
    if report.missing_keys:
        raise PlanError(
            f"{len(report.missing_keys)} model tensors have no place in the released layout (first: "
            f"{', '.join(report.missing_keys[:5])}); the forward rules do not invert the reverse conversion"
        )
    if report.unexpected_keys:
        raise PlanError(
            f"{len(report.unexpected_keys)} released tensors would stay unwritten (first: "
            f"{', '.join(report.unexpected_keys[:5])}); no model tensor loads from them"
        )


# ---------------------------------------------------------------------------------------------------------
# Collectives (small metadata only)


def _agree(stage: str, fn: Any) -> Any:
    """``checkpointer._agree`` for save: a peer that is not in ``save`` is named as such."""
    return _agree_as(stage, fn, "hp_fastload.save")


def _broadcast(value: Any) -> Any:
    if not _dist_active() or torch.distributed.get_world_size() == 1:
        return value
    box = [value if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _gather(value: Any) -> list[Any]:
    if not _dist_active():
        return [value]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, value)
    return out


def _rank0() -> bool:
    return not _dist_active() or torch.distributed.get_rank() == 0


# ---------------------------------------------------------------------------------------------------------
# save


def _create_files(tmp: Path, layout: _Layout) -> None:
    tmp.mkdir()
    for file in layout.files:
        with open(tmp / file.name, "wb") as f:
            f.write(file.header)
            f.truncate(file.size)


def _check_visible(tmp: Path, path: Path, first_path: str) -> None:
    """Each rank must see the temporary directory rank 0 created: else the ranks name different directories
    (a relative ``path`` resolved against different working directories) or do not share a file system."""
    if not tmp.is_dir():
        raise FileNotFoundError(
            f"{tmp} (the temporary directory for {path}) does not exist on this rank: rank 0 created it for "
            f"{first_path}. Every rank must name the same directory on a file system they all see (a relative "
            "path resolves against each rank's own working directory)"
        )


def _finish_files(tmp: Path, layout: _Layout, model: nn.Module) -> None:
    """Rank 0, after every rank wrote: index, config files, fsync of every file and the directory."""
    if layout.index is not None:
        with open(tmp / SAFE_WEIGHTS_INDEX_NAME, "w", encoding="utf-8") as f:
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
        if entry.suffix != ".safetensors":  # the writers synced the shards (_sync_written)
            _fsync(entry)
    _fsync_dir(tmp)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_written(save_plan: LoadPlan, written: set[str], tmp: Path) -> None:
    """Each rank syncs the shard files it wrote into (rank 0 all of them: it created them), in parallel with
    the other ranks; on a file system shared by several nodes a rank's dirty pages are its own to flush."""
    names = {f.name for f in tmp.iterdir() if f.suffix == ".safetensors"} if _rank0() else written
    for name in sorted(names):
        _fsync(tmp / name)


def _forward_rules(model: nn.Module, weights_mapping: Iterable[Any] | None) -> list[Any] | None:
    """The rules ``load`` uses for this model: the explicit list, else the ones the model was loaded with
    (``model._weight_conversions``), else None (the model's transformers mapping)."""
    if weights_mapping is not None:
        return list(weights_mapping)
    used = getattr(model, "_weight_conversions", None)
    return list(used) if used else None


@gc_paused()
def save(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    weights_mapping: Iterable[Any] | None = None,
    overwrite: bool = False,
    threads: int | None = None,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
) -> SaveReport:
    """Write ``model`` as a Hugging Face checkpoint at ``path``: what ``save_pretrained`` of the gathered
    model writes, without gathering. Every rank of the default process group calls it together.

    Keys, shapes and dtypes are the released ones (ties removed, conversions reverted by transformers, from
    ``weights_mapping``, else ``model._weight_conversions``, else the model's transformers mapping); the
    files are split by ``max_shard_size`` as transformers does. Every rank writes the bytes of its own local
    shards into a temporary sibling directory (one replica per replicated region); the directory is renamed
    into place only when every rank succeeded. A failure on any rank raises on every rank and leaves nothing
    at ``path``. An existing non-empty directory is refused unless ``overwrite=True`` (then swapped
    atomically). Returns a :class:`SaveReport`.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"save() needs an nn.Module, got {type(model).__name__}")
    start = time.perf_counter()
    path = Path(os.path.abspath(os.fspath(path)))
    rules = _forward_rules(model, weights_mapping)
    _agree("Checking the save destination", lambda: _check_destination(path, overwrite))
    layout: _Layout = _agree("Planning the save layout", lambda: _layout(model, rules, max_shard_size))
    token, first_path = _broadcast((secrets.token_hex(6), str(path)))
    tmp = path.with_name(f".{path.name}.hp_save-{token}")
    stats = _Stats()
    created = done = False
    try:
        created = True
        _agree("Creating the output files", lambda: _create_files(tmp, layout) if _rank0() else None)
        _agree("Finding the output files", lambda: _check_visible(tmp, path, first_path))
        planned_pair: tuple[LoadPlan, LoadContext] = _agree(
            "Planning the save",
            lambda: _plan_at(
                model,
                tmp,
                "dcp",
                weights_mapping=rules,
                key_mapping=None,
                strict=False,
                external_target_fqns=frozenset(),
                claimed_source_keys=frozenset(),
            ),
        )
        save_plan, context = planned_pair
        try:
            _agree("Checking the save plan", lambda: _check_coverage(save_plan))
            groups, fallback = _fallback_groups(save_plan, context)
            planned = _gather(
                _agree("Planning the writers", lambda: _planned_bytes(save_plan, context, fallback, groups))
            )
            _check_writers(planned, layout)  # the same list on every rank: all raise or none
            _check_fallbacks_agree(_gather([keys for keys, _ in groups]))  # likewise
            _agree(
                "Writing the checkpoint",
                lambda: _write_regions(save_plan, context, fallback, threads, batch_bytes, stats),
            )
            fallbacks = _broadcast(_run_fallbacks(model, rules, context.index, groups, threads, stats))
            _agree("Syncing the written files", lambda: _sync_written(save_plan, stats.files, tmp))
        finally:
            for file in context.index.files:
                file.header.release_map()
        _agree("Finishing the checkpoint", lambda: _finish_files(tmp, layout, model) if _rank0() else None)
        _agree("Publishing the checkpoint", lambda: _publish(tmp, path, overwrite) if _rank0() else None)
        done = True
    finally:
        if created and not done and _rank0():
            shutil.rmtree(tmp, ignore_errors=True)
    by_rank = _gather(stats.bytes_written)
    return SaveReport(
        path=str(path),
        files=[f.name for f in layout.files] + ([SAFE_WEIGHTS_INDEX_NAME] if layout.index is not None else []),
        tensors=len(layout.released),
        total_bytes=sum(f.size for f in layout.files),
        bytes_written=stats.bytes_written,
        bytes_written_by_rank=[int(b) for b in by_rank],
        fallbacks=list(fallbacks),
        seconds=time.perf_counter() - start,
    )
