"""The export plan's data: the released checkpoint a model saves to (keys, dtypes and shapes through the inverse of the
rules, files split as ``save_pretrained`` splits them, their headers), which rank writes which region, and the
checks that the ranks' writes cover every byte exactly once.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from hp_fastload.errors import PlanError, TargetError
from hp_fastload.formats import SAFETENSORS_DTYPE_ORDER, TORCH_TO_SAFETENSORS
from hp_fastload.model.targets import Target
from hp_fastload.planning.context import LoadContext
from hp_fastload.planning.items import LoadPlan
from hp_fastload.runtime import is_rank0

# where safetensors writes each dtype's data (its enum order, largest first)
_DTYPE_RANK = {name: i for i, name in enumerate(SAFETENSORS_DTYPE_ORDER)}


# every dtype the engine knows a safetensors name for (unsigned, complex and fnuz float8 included)
_TORCH_TO_ST = {dtype: name for dtype, name in TORCH_TO_SAFETENSORS.items() if name in _DTYPE_RANK}


@dataclass
class FileLayout:
    name: str
    header: bytes
    size: int
    keys: list[str]


@dataclass
class ExportLayout:
    """The output every rank derives alike: files with their headers, the index, the key -> meta tensor."""

    files: list[FileLayout]
    index: dict[str, Any] | None
    released: dict[str, torch.Tensor]  # key -> meta tensor (shape, dtype), in transformers' order


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    from huggingface_hub.serialization._base import parse_size_to_int

    return int(parse_size_to_int(size))


@contextlib.contextmanager
def conversions(model: nn.Module, rules: list[Any] | None) -> Any:
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
    if not pretrained and not rules and not getattr(model, "_weight_conversions", None):
        return state  # no rules to revert (load records an empty list on a plain module)
    for rule in rules or getattr(model, "_weight_conversions", None) or ():
        if not callable(getattr(rule, "reverse_transform", None)):
            raise PlanError(
                f"rule {type(rule).__module__}.{type(rule).__name__} {getattr(rule, 'source_patterns', '')} has no "
                "reverse_transform(); saving needs transformers' WeightRenaming / WeightConverter rules"
            )
    with conversions(model, rules):
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


def file_header(tensors: Sequence[tuple[str, torch.Tensor]]) -> tuple[bytes, int, list[str]]:
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
    return _released(model, forward_rules(model, weights_mapping), meta_ok=True)


def shard_files(
    released: dict[str, torch.Tensor], max_shard_size: int | str = "5GB", total_parameters: int | None = None
) -> tuple[list[tuple[str, bytes, int, list[str]]], dict[str, Any] | None]:
    """The files ``save`` writes for ``released`` (key -> meta tensor): ``(name, header, size, data order)``
    per file, split as transformers does, and the index (None for a single file)."""
    layout = _split(released, max_shard_size, total_parameters)
    return [(f.name, f.header, f.size, f.keys) for f in layout.files], layout.index


def export_layout(
    model: nn.Module,
    rules: list[Any] | None,
    max_shard_size: int | str,
    released: dict[str, torch.Tensor] | None = None,
    stem: str = "model",
) -> ExportLayout:
    """The files of ``model``'s export: ``released`` (key -> meta tensor) when given (a state-dict adapter's
    ``to_hf`` layout), else the one transformers' reverse conversion of ``rules`` gives. ``stem`` names the
    files (``adapter_model`` for a PEFT adapter)."""
    if released is None:
        released = _released(model, rules)
    if not released:
        raise PlanError("the model has no tensors to save")
    count = getattr(model, "num_parameters", None)
    total = count() if callable(count) else sum(p.numel() for p in model.parameters())
    return _split(released, max_shard_size, total, stem)


def _split(
    released: dict[str, torch.Tensor], max_shard_size: int | str, total: int | None, stem: str = "model"
) -> ExportLayout:
    from huggingface_hub import split_state_dict_into_shards_factory

    # transformers splits the reverted state dict with huggingface_hub, which counts a storage once and keeps
    # tensors sharing one (experts unbound from a stacked tensor) in one file. The meta tensors keep the
    # views' storage identity, so the same rule gives the same files without data.
    split = split_state_dict_into_shards_factory(
        released,
        get_storage_size=lambda t: t.untyped_storage().nbytes(),
        get_storage_id=lambda t: (t.untyped_storage()._cdata, t.untyped_storage().nbytes()),
        filename_pattern=stem + "{suffix}.safetensors",
        max_shard_size=_parse_size(max_shard_size),
    )
    files = []
    for name, keys in split.filename_to_tensors.items():
        header, data, order = file_header([(key, released[key]) for key in keys])
        files.append(FileLayout(name, header, len(header) + data, order))
    index = None
    if split.is_sharded:
        if total is None:
            total = sum(t.numel() for t in released.values())
        index = {
            "metadata": {"total_parameters": total, **split.metadata},
            "weight_map": split.tensor_to_filename,
        }
    return ExportLayout(files, index, released)


def mesh_coordinate_writes(target: Target) -> bool:
    """Whether this rank writes ``target``'s region: plain tensors on rank 0; a DTensor on the replica whose
    coordinate is 0 along every mesh dim it is replicated on (Partial cannot be saved without a reduction)."""
    from torch.distributed.tensor import Partial, Replicate

    if not target.is_dtensor:
        return is_rank0()
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


def planned_bytes(
    save_plan: LoadPlan, context: LoadContext, fallback: set[str], groups: list[tuple[list[str], list[Target]]]
) -> int:
    """The data bytes this rank is about to write (its region writes, and on rank 0 the fallback tensors)."""
    total = 0
    for name, items in save_plan.region_reads.items():
        if not items or name in fallback or not mesh_coordinate_writes(context.target(name)):
            continue
        total += items.total_nbytes
    if is_rank0():
        total += sum(context.index.locate(key).nbytes for keys, _ in groups for key in keys)
    return total


def check_writers(planned: list[int], layout: ExportLayout) -> None:
    """Every data byte has exactly one writer, as far as sums tell: a replica that also writes, or a region no
    rank writes, changes the sum (checked before any byte is written)."""
    data = sum(f.size - len(f.header) for f in layout.files)
    if sum(planned) != data:
        raise PlanError(
            f"the ranks would write {sum(planned)} bytes ({planned} by rank) of {data} bytes of tensor data: some "
            "region has no writer or several (replicas this rank cannot tell apart from its mesh)"
        )


def check_coverage(save_plan: LoadPlan) -> None:
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


def forward_rules(model: nn.Module, weights_mapping: Iterable[Any] | None) -> list[Any] | None:
    """The rules ``load`` uses for this model: the explicit list, else the ones the model was loaded with
    (``model._weight_conversions``), else None (the model's transformers mapping)."""
    if weights_mapping is not None:
        return list(weights_mapping)
    used = getattr(model, "_weight_conversions", None)
    return list(used) if used else None
