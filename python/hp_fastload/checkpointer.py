"""The user-facing loaders: ``load``, ``plan``, ``HuggingFaceCheckpointer``, ``resolve_hf_loader``.

Owns the seed's contract (hyper-parallel's ``HuggingFaceCheckpointer``): loader resolution, argument checks,
the two loaders (``legacy``: whole tensors, converted on the host, sliced; ``dcp``: exact region reads),
cross-rank agreement on failures (every rank raises when one fails, nobody hangs), the report, progress and
the one summary log line. Planning lives in ``plan``, reading in ``execute``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import errors
from .engine import threads_per_rank
from .execute import execute_plan
from .finalize import non_persistent_buffers, recreate_buffers, retie
from .index import CheckpointIndex, read_regular_file, resolve_checkpoint_location
from .plan import LoadContext, LoadPlan, LoadReport, Replacement, gc_paused, plan_load
from .quant import QuantizationError
from .rules import resolve_mapping, unwrapped
from .targets import build_targets

__all__ = ["HF_LOADER_ENV", "LOADERS", "HuggingFaceCheckpointer", "load", "plan", "resolve_hf_loader"]

log = logging.getLogger("hp_fastload")

HF_LOADER_ENV = "HYPER_PARALLEL_HF_LOADER"
LOADERS = ("legacy", "dcp")
DEFAULT_LOADER = "dcp"


def resolve_hf_loader(loader: str | None = None) -> str:
    """The loader name: the argument, else ``$HYPER_PARALLEL_HF_LOADER``, else ``"dcp"`` (case-insensitive)."""
    value = loader if loader is not None else os.environ.get(HF_LOADER_ENV) or DEFAULT_LOADER
    name = str(value).strip().lower()
    if name not in LOADERS:
        raise ValueError(
            f"Unknown pretrained loader {value!r}; expected one of {', '.join(LOADERS)} "
            f"(set through the loader argument or {HF_LOADER_ENV})"
        )
    return name


# ---------------------------------------------------------------------------------------------------------
# Cross-rank agreement


def _dist_active() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


_REBUILDABLE: dict[str, type[BaseException]] = {
    cls.__name__: cls
    for cls in (
        ValueError,
        TypeError,
        RuntimeError,
        KeyError,
        FileNotFoundError,
        PermissionError,
        OSError,
        NotImplementedError,
        errors.HpFastloadError,
        errors.MissingKeysError,
        errors.HeaderError,
        errors.PlanError,
        errors.ReadError,
        errors.TargetError,
        QuantizationError,
        errors.CheckpointMismatchError,
    )
}


def _agree(stage: str, fn: Callable[[], Any], call: str = "hp_fastload.load (or from_pretrained)") -> Any:
    """Run ``fn`` on every rank; if it fails on any rank, every rank raises (same type where possible).
    ``call``: the entry point every rank must be in, for the message when a peer is absent."""
    result = None
    failure: BaseException | None = None
    try:
        result = fn()
    except Exception as exc:
        failure = exc
    if not _dist_active():
        if failure is not None:
            raise failure
        return result
    payload = None if failure is None else (type(failure).__name__, str(failure))
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    _waiting(stage, lambda: torch.distributed.all_gather_object(gathered, payload), call)
    if failure is not None:
        raise failure
    for rank, item in enumerate(gathered):
        if item is not None:
            name, message = item
            cls = _REBUILDABLE.get(name)
            text = f"{stage} failed on rank {rank}: {name}: {message}"
            if cls is not None and issubclass(cls, Exception):
                raise cls(text)
            raise RuntimeError(text)
    return result


_COLLECTIVE_FAILURES = ("gloo", "nccl", "connection closed", "connection reset", "timed out", "timeout", "processgroup")


def _waiting(stage: str, collective: Callable[[], Any], call: str = "hp_fastload.load (or from_pretrained)") -> Any:
    """Run a collective of ``load``; when it fails because another rank is not there, say so.

    Every rank of the default process group must call ``load`` together: a rank that skipped the call, failed
    before it or exited leaves the others waiting in their first collective until the peer's connection closes
    or the process group's timeout (``init_process_group(timeout=...)``) expires.
    """
    try:
        return collective()
    except RuntimeError as exc:
        distributed = getattr(torch.distributed, "DistError", ())
        if not (isinstance(exc, distributed) or any(m in str(exc).lower() for m in _COLLECTIVE_FAILURES)):
            raise
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        raise RuntimeError(
            f"{call.split()[0]}: rank {rank} of {world} waited for the other ranks while {stage.lower()} and "
            f"the collective failed ({str(exc).splitlines()[0][:300]}). Every rank of the default process group "
            f"must call {call} together; a rank that skipped the call, failed before it or exited makes the "
            "others wait until the process group's timeout"
        ) from exc


def _resolve_location_each(path: str | os.PathLike[str], revision: str | None) -> Path:
    """Every rank resolves its own ``path`` (a relative path against its own working directory): rank 0
    first, then the others, a Hub id from the cache rank 0 has just filled when they share it. A failure on
    any rank makes every rank raise. The ranks' checkpoints are compared later (``_agree_checkpoint``)."""
    if not _dist_active() or torch.distributed.get_world_size() == 1:
        return resolve_checkpoint_location(path, revision=revision)
    first = torch.distributed.get_rank() == 0
    location = _agree(
        "Resolving the checkpoint on rank 0",
        lambda: resolve_checkpoint_location(path, revision=revision) if first else None,
    )
    resolved: Path = _agree(
        "Resolving the checkpoint",
        lambda: location if first else resolve_checkpoint_location(path, revision=revision, cache_first=True),
    )
    return resolved


#: Blocks of data the ranks compare (``_content_sample``), and their size.
SAMPLE_BLOCKS = 64
SAMPLE_BYTES = 4096


def _content_sample(index: CheckpointIndex, root: Path) -> str:
    """A digest of :data:`SAMPLE_BLOCKS` blocks of :data:`SAMPLE_BYTES` spread evenly over the data
    sections of every file (in name order): two fine-tunes of one architecture have equal headers and
    sizes, and differ in every block. 64 small reads per rank, whatever the checkpoint's size."""
    files = sorted(index.files, key=lambda f: os.path.relpath(f.path, root))
    spans = [(f.path, f.header.data_start, f.file_size) for f in files if f.file_size > f.header.data_start]
    total = sum(end - start for _, start, end in spans)
    digest = hashlib.blake2b(digest_size=16)
    if total == 0:
        return digest.hexdigest()
    wanted = sorted(total * (2 * k + 1) // (2 * SAMPLE_BLOCKS) for k in range(SAMPLE_BLOCKS))
    seen, k = 0, 0
    for path, start, end in spans:
        size = end - start
        positions = []
        while k < len(wanted) and wanted[k] < seen + size:
            positions.append(start + wanted[k] - seen)
            k += 1
        seen += size
        if not positions:
            continue
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a regular file: its header was just read
        try:
            for at in positions:
                digest.update(os.pread(fd, min(SAMPLE_BYTES, end - at), at))
        finally:
            os.close(fd)
    return digest.hexdigest()


def _checkpoint_identity(location: Path, index: CheckpointIndex) -> tuple[list[tuple[str, int, int]], str]:
    """What makes two resolved checkpoints the same one: each file's name relative to the location, its
    size and its header digest (computed by the header parser from the bytes it read), and a digest of a
    sample of the data (``_content_sample``). Where the files are is not part of it: node-local copies of
    one checkpoint agree."""
    from .source import objstore

    if isinstance(location, objstore.ObjectLocation):  # ETags name the content: no data sample
        return objstore.checkpoint_identity(location, index.files)
    root = location if location.is_dir() else location.parent
    files = sorted((os.path.relpath(f.path, root), f.file_size, f.header.digest) for f in index.files)
    return files, _content_sample(index, root)


def _agree_checkpoint(location: Path, index: CheckpointIndex) -> None:
    """Every rank raises :class:`~hp_fastload.CheckpointMismatchError` unless all ranks' checkpoints have the
    same identity (``_checkpoint_identity``), naming rank 0's location and each other rank's."""
    if not _dist_active() or torch.distributed.get_world_size() == 1:
        return
    # Computed under _agree: a rank whose sample read fails must not leave the others in all_gather.
    mine = _agree(
        "Comparing the ranks' checkpoints", lambda: (str(location.absolute()), _checkpoint_identity(location, index))
    )
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine)
    reference_location, reference = gathered[0]
    differing = [(rank, where, ident) for rank, (where, ident) in enumerate(gathered) if ident != reference]
    if not differing:
        return
    lines = []
    for rank, where, ident in differing[:4]:
        ours, theirs = ({n: (s, d) for n, s, d in files} for files in (reference[0], ident[0]))
        what = next(
            (
                f"{n}: {'missing' if n not in theirs else 'absent on rank 0' if n not in ours else 'differs'}"
                for n in sorted(ours.keys() | theirs.keys())
                if ours.get(n) != theirs.get(n)
            ),
            "the tensor data",
        )
        lines.append(f"rank {rank} resolved {where} (first difference: {what})")
    more = f" and {len(differing) - 4} more ranks" if len(differing) > 4 else ""
    raise errors.CheckpointMismatchError(
        f"the ranks resolved different checkpoints: rank 0 resolved {reference_location}, "
        + "; ".join(lines)
        + more
        + " (files, sizes, headers or sampled data differ). Pass every rank the same checkpoint (an absolute "
        "path, or identical node-local copies)"
    )


# ---------------------------------------------------------------------------------------------------------
# load / plan


def _progress_bar(total: int, enabled: bool | None) -> tuple[Callable[[int], None] | None, Callable[[], None]]:
    rank0 = not _dist_active() or torch.distributed.get_rank() == 0
    if enabled is False or not rank0 or total <= 0:
        return None, lambda: None
    if enabled is None and not sys.stderr.isatty():
        return None, lambda: None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None, lambda: None
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="Loading weights", leave=False)
    return bar.update, bar.close


def plan(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    weights_mapping: Iterable[Any] | None = None,
    key_mapping: Mapping[str, str] | None = None,
    strict: bool = False,
    loader: str | None = None,
    external_target_fqns: Collection[str] = frozenset(),
    claimed_source_keys: Collection[str] = frozenset(),
    mesh_override: Any = None,
    revision: str | None = None,
    replacement: Replacement | None = None,
) -> LoadPlan:
    """Dry run: what this rank (or a virtual rank, see ``targets.build_targets``'s ``mesh_override``) reads.

    Reads headers only. ``LoadPlan.read_bytes_by_file()`` / ``read_bytes_by_target()`` / ``summary()``.
    The arguments are ``load``'s. The plan is plain data (picklable, comparable); its live side is dropped.
    """
    plan_only, _ = _plan_at(
        unwrapped(model),
        resolve_checkpoint_location(path, revision=revision),
        resolve_hf_loader(loader),
        weights_mapping=weights_mapping,
        key_mapping=key_mapping,
        strict=strict,
        external_target_fqns=external_target_fqns,
        claimed_source_keys=claimed_source_keys,
        mesh_override=mesh_override,
        replacement=replacement,
    )
    return plan_only


def _plan_at(
    model: nn.Module,
    location: Path,
    loader: str,
    *,
    weights_mapping: Iterable[Any] | None,
    key_mapping: Mapping[str, str] | None,
    strict: bool,
    external_target_fqns: Collection[str],
    claimed_source_keys: Collection[str],
    mesh_override: Any = None,
    replacement: Replacement | None = None,
    index: CheckpointIndex | None = None,
) -> tuple[LoadPlan, LoadContext]:
    """Headers, targets and rules of one (possibly virtual) rank, planned (the plan and its live side);
    nothing is read. The cyclic GC is
    paused throughout (indexing a 90k-tensor header allocates ~10^5 objects; every full collection would
    walk the whole model)."""
    with gc_paused():
        if index is None:
            index = CheckpointIndex.open(location)
        targets = build_targets(
            model, external_target_fqns=frozenset(external_target_fqns), mesh_override=mesh_override
        )
        rules = resolve_mapping(model, weights_mapping, key_mapping)
    try:
        return plan_load(
            model,
            index,
            targets,
            rules,
            strict=strict,
            trace=loader == "dcp",
            claimed_source_keys=frozenset(claimed_source_keys),
            loader=loader,
            replacement=replacement,
        )
    except errors.MissingKeysError as exc:
        hint = _config_mismatch(model, location)
        if not hint:
            raise
        raise errors.MissingKeysError(f"{exc} {hint}", exc.missing_keys, exc.unexpected_keys) from None


_COMPARED_CONFIG_FIELDS = ("model_type", "num_hidden_layers", "hidden_size", "vocab_size")


def _config_mismatch(model: nn.Module, location: Path) -> str:
    """Where the checkpoint's ``config.json`` and the model's config disagree (architecture, depth, size)."""
    from .source import objstore

    if isinstance(location, objstore.ObjectLocation):
        return ""  # an object checkpoint's config is not fetched for a hint
    config_path = (location if location.is_dir() else location.parent) / "config.json"
    config = getattr(model, "config", None)
    if config is None:
        return ""
    try:
        raw = read_regular_file(config_path)
        saved = json.loads(raw) if raw is not None else None
    except (OSError, ValueError):  # a FIFO there (HeaderError) only loses the hint
        return ""
    if not isinstance(saved, dict):
        return ""
    ours = config.to_dict() if hasattr(config, "to_dict") else vars(config)
    text_saved, text_ours = saved.get("text_config") or {}, ours.get("text_config") or {}
    differences = []
    for key in _COMPARED_CONFIG_FIELDS:
        theirs = saved.get(key, text_saved.get(key))
        mine = ours.get(key, text_ours.get(key) if isinstance(text_ours, dict) else None)
        if theirs is not None and mine is not None and theirs != mine:
            differences.append(f"{key} {theirs!r} in the checkpoint, {mine!r} in the model")
    return f"The checkpoint's config.json disagrees: {'; '.join(differences)}." if differences else ""


# The cyclic GC is paused for the whole load: planning and packing a 20k-tensor MoE allocate ~10^5 small
# objects, and each full collection walks everything the trainer holds (0.3 s of a 0.7 s load).
@gc_paused()
def load(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    weights_mapping: Iterable[Any] | None = None,
    key_mapping: Mapping[str, str] | None = None,
    strict: bool = True,
    loader: str | None = None,
    threads: int | None = None,
    progress: bool | None = None,
    external_target_fqns: Collection[str] = frozenset(),
    claimed_source_keys: Collection[str] = frozenset(),
    backend: str | None = None,
    revision: str | None = None,
    share_replicated: bool = False,
    replacement: Replacement | None = None,
    finalize: bool = True,
) -> LoadReport:
    """Fill ``model``'s parameters and persistent buffers (DTensor shards or plain) from a HF checkpoint.

    Every rank of the default process group must call it together. Writes in place (parameter identity is
    preserved). ``strict`` raises ``MissingKeysError`` (a ``RuntimeError``) before any byte is read when model
    tensors would stay missing; unexpected checkpoint keys are only logged. ``share_replicated=True`` (region
    loader, several ranks) has one replica of each replicated DTensor read it and broadcast it to the others
    (``share``).
    ``threads`` defaults to this process's cores divided by the ranks on its node (``LOCAL_WORLD_SIZE``).
    ``replacement`` (an ``hp_fastload.Replacement``) is the second stage of a model whose modules were
    replaced after the checkpoint's layout was fixed; None takes it from the model's
    ``_hp_replacement_weight_conversions`` / ``_hp_checkpoint_source_shapes`` when both are set.

    ``finalize`` (default) also finishes what a checkpoint does not hold (``finalize``): tied weights that
    parallelization or ``to_empty`` untied are tied again before planning (transformers models, through
    ``tie_weights()``), and non-persistent buffers (rotary ``inv_freq``...) are recomputed after reading
    through the model's own ``initialize_weights()``, as ``from_pretrained`` does; buffers nothing re-created
    are listed in ``LoadReport.unfilled_buffers``.

    A model wrapped by ``torch.compile`` or ``DistributedDataParallel`` is loaded through the module it wraps
    (``rules.unwrapped``): the same tensors, under the checkpoint's names.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"load() needs a live nn.Module to write into, got {type(model).__name__}")
    model = unwrapped(model)  # torch.compile / DDP: the wrapped module's names and rules (same tensors)
    name = resolve_hf_loader(loader)
    start = time.perf_counter()
    if threads is None:
        threads = threads_per_rank()

    location = _resolve_location_each(path, revision)
    index = _agree("Reading the checkpoint headers", lambda: CheckpointIndex.open(location))
    _agree_checkpoint(location, index)
    retied: list[str] = _agree("Tying the model's tied weights", lambda: retie(model)) if finalize else []
    planned_pair: tuple[LoadPlan, LoadContext] = _agree(
        "Planning the pretrained load",
        lambda: _plan_at(
            model,
            location,
            name,
            index=index,
            weights_mapping=weights_mapping,
            key_mapping=key_mapping,
            strict=strict,
            external_target_fqns=external_target_fqns,
            claimed_source_keys=claimed_source_keys,
            replacement=replacement,
        ),
    )
    load_plan, context = planned_pair
    replicas = None
    if share_replicated and name == "dcp" and _dist_active() and torch.distributed.get_world_size() > 1:
        from .share import plan_replicas

        replicas = plan_replicas(map(context.target, load_plan.region_reads))
    total = load_plan.bytes_needed
    update, close = _progress_bar(total, progress)
    try:
        stats = _agree(
            "Reading the pretrained checkpoint",
            lambda: execute_plan(
                load_plan,
                context,
                legacy=name == "legacy",
                threads=threads,
                backend=backend,
                progress=update,
                skip=replicas.skip if replicas is not None else frozenset(),
            ),
        )
    finally:
        close()
        for file in context.index.files:  # a finished load keeps no page tables of the checkpoint mapped
            file.header.release_map()
    if replicas is not None:  # every rank's reads succeeded (agreed above): safe to enter the broadcasts
        from .share import broadcast_replicas

        stats.extra["bytes_received"] = broadcast_replicas(replicas)
    for name in load_plan.region_reads:
        context.target(name).tensor._is_hf_initialized = True  # type: ignore[attr-defined]
    for deferred in load_plan.deferred:
        for name in deferred.claims.values():
            context.target(name).tensor._is_hf_initialized = True  # type: ignore[attr-defined]
    _record_used_rules(model, context)
    unfilled = recreate_buffers(model) if finalize else [name for name, _ in non_persistent_buffers(model)]
    seconds = time.perf_counter() - start
    report = LoadReport(
        loaded_keys=load_plan.report.loaded_keys,
        missing_keys=load_plan.report.missing_keys,
        unexpected_keys=load_plan.report.unexpected_keys,
        bytes_read=stats.bytes_read,
        bytes_needed=total,
        checkpoint_bytes=load_plan.report.checkpoint_bytes,
        seconds=seconds,
        region_targets=load_plan.report.region_targets,
        deferred_targets=load_plan.report.deferred_targets,
        loader=name,
        retied_keys=tuple(retied),
        unfilled_buffers=tuple(unfilled),
    )
    if report.unexpected_keys:
        log.warning(
            "Ignored %d checkpoint tensors not owned by this model; first keys: %s",
            len(report.unexpected_keys),
            ", ".join(map(errors.shown_key, report.unexpected_keys[:10])),
        )
    log.info(report.summary())
    return report


def _record_used_rules(model: nn.Module, context: LoadContext) -> None:
    """``model._weight_conversions`` (and, with replacements, the per-stage lists) for reverse conversion."""
    with contextlib.suppress(AttributeError, TypeError):  # modules that refuse new attributes
        model._weight_conversions = context.used_rules  # type: ignore[assignment]
        if context.used_replacement_rules:
            model._hp_used_base_weight_conversions = context.used_base_rules  # type: ignore[assignment]
            model._hp_used_replacement_weight_conversions = context.used_replacement_rules  # type: ignore[assignment]


# ---------------------------------------------------------------------------------------------------------
# The seed's checkpointer


class HuggingFaceCheckpointer:
    """Checkpointer for Hugging Face safetensors checkpoints (hyper-parallel's contract): ``load`` fills a
    model, ``save`` exports it (``hp_fastload.save``).

    Args:
        loader: ``"dcp"`` (exact region reads) or ``"legacy"`` (whole tensors, sliced on the host); None
            reads ``$HYPER_PARALLEL_HF_LOADER``, default ``"dcp"``. Resolved here, so a bad value fails
            before any file is opened.
        weights_mapping: the rule list; None uses the model's transformers conversion mapping.
    """

    def __init__(self, *, loader: str | None = None, weights_mapping: Iterable[Any] | None = None) -> None:
        self.loader = resolve_hf_loader(loader)
        self.weights_mapping = list(weights_mapping) if weights_mapping is not None else None

    def save(
        self,
        path: str | os.PathLike[str],
        state: dict[str, Any] | nn.Module,
        *,
        global_step: int | None = None,
        save_async: bool = False,
        **save_kwargs: Any,
    ) -> Any:
        """Export ``state["model"]`` (or a module) as a Hugging Face checkpoint: ``hp_fastload.save`` with this
        checkpointer's ``weights_mapping``; every rank calls it. Returns the ``SaveReport``. The seed's
        ``global_step`` is accepted and not stored (the format has no place for it); ``save_async`` is refused."""
        from .save import save

        if save_async:
            raise NotImplementedError("save_async: the Hugging Face export is synchronous (it returns once published)")

        model = state.get("model") if isinstance(state, dict) else state
        if not isinstance(model, nn.Module):
            raise TypeError(f"state['model'] must be an nn.Module to export, got {type(model).__name__}")
        save_kwargs.setdefault("weights_mapping", self.weights_mapping)
        return save(model, path, **save_kwargs)

    def load(
        self,
        path: str | os.PathLike[str],
        state: dict[str, Any],
        *,
        strict_model: bool = True,
        extra_state_skeleton: Any = None,
        external_target_fqns: Collection[str] = frozenset(),
        claimed_source_keys: Collection[str] = frozenset(),
        **load_kwargs: Any,
    ) -> dict[str, Any]:
        """Fill ``state["model"]`` in place; sets and returns ``state`` with ``state["load_report"]``."""
        if extra_state_skeleton is not None:
            raise ValueError(
                "a pretrained Hugging Face checkpoint carries no training state: extra_state_skeleton must be None"
            )
        if not path:
            raise ValueError("pretrained_path must be provided when load_base_model=True")
        model = state.get("model")
        if not isinstance(model, nn.Module):
            raise TypeError(
                "state['model'] must be a live nn.Module (loading writes into its distributed parameters in "
                f"place), got {type(model).__name__}"
            )
        state["load_report"] = load(
            model,
            path,
            weights_mapping=self.weights_mapping,
            strict=strict_model,
            loader=self.loader,
            external_target_fqns=external_target_fqns,
            claimed_source_keys=claimed_source_keys,
            **load_kwargs,
        )
        return state
