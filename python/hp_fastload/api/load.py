"""The user-facing loaders: ``load``, ``plan``, ``as_rank``; the report's phase clock.

Owns the seed's contract (hyper-parallel's ``HuggingFaceCheckpointer``): argument checks, the two loaders
(``legacy``: whole tensors, converted on the host, sliced; ``dcp``: exact region reads), cross-rank agreement
on failures (every rank raises when one fails, nobody hangs), the report, progress and the one summary log
line. The arguments become one ``PlanRequest`` (``api.request``); planning is ``planning.front.plan``,
reading ``execute``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from hp_fastload import errors
from hp_fastload.api.request import HF_LOADER_ENV, plan_request, resolve_hf_loader, resolve_share
from hp_fastload.dist.agree import agree, interrupts_between_steps, resolve_location_each
from hp_fastload.dist.identity import agree_checkpoint, identity_of
from hp_fastload.errors import HeaderError
from hp_fastload.execute.job import agree_job_plan, run_job
from hp_fastload.execute.read import ExecStats, Overlap, execute_stream
from hp_fastload.execute.threads import threads_per_rank
from hp_fastload.model.finalize import mark_loaded, non_persistent_buffers, recreate_buffers, retie
from hp_fastload.model.peft import BaseView, base_view, fill_copies, inner_model, is_peft_model, refuse_quantized_base
from hp_fastload.model.regions import virtual_rank
from hp_fastload.model.wrappers import unwrapped
from hp_fastload.planning import front
from hp_fastload.planning.context import LoadContext
from hp_fastload.planning.front import PlanStream
from hp_fastload.planning.items import PHASES, CriticalPath, LoadPlan, LoadReport
from hp_fastload.planning.replacement import Replacement
from hp_fastload.planning.request import PlanRequest
from hp_fastload.runtime import dist_active, gc_paused, is_rank0
from hp_fastload.source.config import read_config_json
from hp_fastload.source.index import CheckpointIndex
from hp_fastload.source.location import Location, folder_of, resolve_checkpoint_location

__all__ = ["HF_LOADER_ENV", "PhaseClock", "as_rank", "load", "plan", "planned", "resolve_hf_loader"]

log = logging.getLogger("hp_fastload")


class PhaseClock:
    """Charges the wall time since the last lap to a phase of :class:`CriticalPath`: laps are contiguous, so
    the phases add up to the time since the clock started."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.spent = dict.fromkeys(PHASES, 0.0)
        self.hidden = 0.0  # region planning done while an engine call read (``overlapped``)

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.spent[phase] += now - self.last
        self.last = now

    def agreed(self, phase: str, stage: str, fn: Callable[[], Any]) -> Any:
        """``agree(stage, fn)``: ``fn``'s own time charged to ``phase``; the rest of the agreement (the outcome
        collective, in which this rank waits for its slowest peer) to ``waiting``."""

        def step() -> Any:
            self.lap("waiting")
            try:
                return fn()
            finally:
                self.lap(phase)

        try:
            return agree(stage, step)
        finally:
            self.lap("waiting")

    def moved(self, source: str, phase: str, seconds: float) -> None:
        """Re-charge ``seconds`` of ``source``'s time to ``phase`` (work measured inside another phase)."""
        seconds = min(seconds, self.spent[source])
        self.spent[source] -= seconds
        self.spent[phase] += seconds

    def overlapped(self, overlap: Overlap) -> None:
        """The region planning made while reading (``execute_stream``'s ``overlap``): what no engine call
        covered was on the critical path, re-charged from reading to planning; the rest is reported as
        ``CriticalPath.planning_hidden``."""
        self.moved("reading", "planning", overlap.exposed)
        self.hidden += overlap.hidden

    def skip(self) -> None:
        """Charge the time since the last lap to nothing (work that is not the load's, as a rehearsal's
        allocation of the shards a model would already hold)."""
        self.last = time.perf_counter()

    def done(self) -> tuple[float, CriticalPath]:
        """The seconds charged (since the start, less what was skipped) and the phases."""
        return sum(self.spent.values()), CriticalPath(**self.spent, planning_hidden=self.hidden)


def _progress_wanted(enabled: bool | None) -> bool:
    """Whether ``_progress_bar`` would show a bar (it needs the plan's total before reading)."""
    return enabled is not False and is_rank0() and (enabled is True or sys.stderr.isatty())


def _progress_bar(total: int, enabled: bool | None) -> tuple[Callable[[int], None] | None, Callable[[], None]]:
    rank0 = is_rank0()
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


@gc_paused()
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
    state_dict_adapter: Any = None,
    ignore_missing: Iterable[str] = (),
    rank: int | None = None,
) -> LoadPlan:
    """Dry run: what this rank (or a virtual rank, see ``targets.build_targets``'s ``mesh_override``) reads.

    Reads headers only. ``LoadPlan.read_bytes_by_file()`` / ``read_bytes_by_target()`` / ``summary()``.
    The arguments are ``load``'s. The plan is plain data (picklable, comparable); its live side is dropped.
    A PEFT model is planned as ``load`` reads its base checkpoint.

    ``rank=r`` plans global rank ``r`` of the model's meshes (:func:`as_rank`): one process that laid the model
    out for the whole job (torch's ``fake`` process group of the job's size) plans any rank. A model with
    tensors on the meta device is planned as this process's own rank (nothing is written, so nothing needs
    to be materialized).
    """
    mesh_override = _rank_override(model, mesh_override, rank)
    model = unwrapped(model)
    owner = model  # whose rules
    if is_peft_model(model):  # the base checkpoint of a PEFT model, as load reads it
        owner = inner_model(model)
        model = _peft_base(model).skeleton
    request = plan_request(
        owner,
        weights_mapping=weights_mapping,
        key_mapping=key_mapping,
        state_dict_adapter=state_dict_adapter,
        loader=loader,
        strict=strict,
        external_target_fqns=external_target_fqns,
        claimed_source_keys=claimed_source_keys,
        replacement=replacement,
        ignore_missing=ignore_missing,
        view=mesh_override,
    )
    location = resolve_checkpoint_location(path, revision=revision)
    plan_only, _ = planned(model, location, CheckpointIndex.open(location), request)
    return plan_only


def as_rank(rank: int) -> Any:
    """A ``mesh_override`` that plans (or rehearses) global rank ``rank`` of the model's meshes: every DTensor's
    coordinate is the one ``rank`` holds in the world the model was laid out for (a real process group, or
    torch's ``fake`` one of the job's size). ``hp_fastload.plan(model, path, rank=r)`` is the short form."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be a non-negative int, got {rank!r}")
    return virtual_rank(rank)


def _rank_override(model: nn.Module, mesh_override: Any, rank: int | None) -> Any:
    """``plan``'s ``mesh_override``: the given one, else ``as_rank(rank)``, else (a model with meta tensors)
    ``as_rank`` of this process's rank."""
    if rank is not None:
        if mesh_override is not None:
            raise ValueError("plan: pass rank or mesh_override, not both")
        return as_rank(rank)
    if mesh_override is None and _has_meta(model):
        return as_rank(torch.distributed.get_rank() if dist_active() else 0)
    return mesh_override


def _has_meta(model: nn.Module) -> bool:
    for tensor in (*model.parameters(), *model.buffers()):
        local = getattr(tensor, "_local_tensor", tensor)
        if local.device.type == "meta":
            return True
    return False


def planned(
    model: nn.Module, location: Location, index: CheckpointIndex, request: PlanRequest
) -> tuple[LoadPlan, LoadContext]:
    """``planning.front.plan`` of ``request``, a strict miss told with where the checkpoint's ``config.json``
    and the model's config disagree (architecture, depth, size) when they do."""
    with _hinted(model, location):
        return front.plan(model, index, request)


@contextlib.contextmanager
def _hinted(model: nn.Module, location: Location) -> Iterator[None]:
    """A strict miss raised inside told with where the checkpoint's and the model's configs disagree."""
    try:
        yield
    except errors.MissingKeysError as exc:
        hint = _config_mismatch(model, location)
        if not hint:
            raise
        raise errors.MissingKeysError(f"{exc} {hint}", exc.missing_keys, exc.unexpected_keys) from None


_COMPARED_CONFIG_FIELDS = ("model_type", "num_hidden_layers", "hidden_size", "vocab_size")


def _config_mismatch(model: nn.Module, location: Location) -> str:
    """Where the checkpoint's ``config.json`` and the model's config disagree (architecture, depth, size)."""
    config = getattr(model, "config", None)
    if config is None:
        return ""
    try:
        saved = read_config_json(folder_of(location))
    except (HeaderError, OSError):  # a FIFO (or an object store error) there only loses the hint
        return ""
    if saved is None:
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
# objects, and each full collection walks everything the trainer holds (docs/perf-notes.md).
@interrupts_between_steps()
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
    state_dict_adapter: Any = None,
    ignore_missing: Iterable[str] = (),
    share: str | None = None,
    ranks_per_node: int | None = None,
    share_budget_bytes: int | None = None,
) -> LoadReport:
    """Fill ``model``'s parameters and persistent buffers (DTensor shards or plain) from a HF checkpoint.

    Every rank of the default process group must call it together. Writes in place (parameter identity is
    preserved). ``strict`` raises ``MissingKeysError`` (a ``RuntimeError``) before any byte is read when model
    tensors would stay missing; unexpected checkpoint keys are only logged. ``share_replicated=True`` (region
    loader, several ranks) has one replica of each replicated DTensor read it and broadcast it to the others
    (``dist.share``). ``share="job"`` reads every checkpoint byte once per job and sends each rank only the bytes
    its shards need (``execute.job``; ``ranks_per_node`` defaults to ``$LOCAL_WORLD_SIZE``,
    ``share_budget_bytes`` bounds each rank's staging and messages per round); ``"auto"`` picks ``"job"`` or
    ``"none"`` from the cost model; ``"none"`` (default) is every rank reading its own regions.
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

    A PEFT model (``peft.get_peft_model``, wrapped by ``fully_shard`` or laid out by TP as any model) takes its
    *base* checkpoint here: every ``base_layer`` and untouched module is filled through the inner transformers
    model's own conversion rules, ties and buffers (``model.peft``); the adapters are left to their
    initialization and listed in ``LoadReport.adapter_keys``, the ``modules_to_save`` copies are filled from
    their originals, as peft copies them. The adapter itself: :func:`hp_fastload.load_adapter`.

    ``state_dict_adapter`` (instead of ``weights_mapping`` / ``key_mapping``): any object with torchtitan's
    ``StateDictAdapter`` protocol (``from_hf``, ``to_hf``), e.g. ``Llama3StateDictAdapter(model_config, None)``.
    Its ``from_hf`` and the model's own ``load_state_dict`` pre-hooks (torchtitan's fused-QKV merge) are traced on
    symbolic tensors into exact region reads, as torchtitan applies them; the keys read are those ``to_hf``
    gives for the model, and model tensors it does not map (torchtitan's ``expert_bias``) are left as they are,
    not missing. ``ignore_missing`` (regexes searched in model names) names further tensors no checkpoint
    holds, so ``strict=True`` stays usable; both are listed in ``LoadReport.ignored_missing_keys``.
    ``share="job"`` plans through the adapter too (every rank's needs from one whole plan traced through it).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"load() needs a live nn.Module to write into, got {type(model).__name__}")
    model = unwrapped(model)  # torch.compile / DDP: the wrapped module's names and rules (same tensors)
    peft_model = model if is_peft_model(model) else None
    if peft_model is not None and state_dict_adapter is not None:
        raise ValueError("state_dict_adapter= is for torchtitan models; a PEFT model's base follows transformers")
    owner = inner_model(peft_model) if peft_model is not None else model  # whose ties, buffers and rules
    resolve_hf_loader(loader)  # an unknown loader is refused before anything is opened
    sharing = resolve_share(share, share_replicated)
    clock = PhaseClock()
    if threads is None:
        threads = threads_per_rank()

    clock.lap("other")
    location = resolve_location_each(path, revision)
    clock.lap("index")
    # the identity the ranks compare is computed in the same step (one agreement fewer; its sample reads are
    # charged to the index phase)
    index, identity = clock.agreed("index", "Reading the checkpoint headers", lambda: _opened(location))
    agree_checkpoint(location, index, identity)
    clock.lap("agreement")
    retied: list[str] = (
        clock.agreed("finishing", "Tying the model's tied weights", lambda: retie(owner)) if finalize else []
    )
    view: BaseView | None = None
    if peft_model is not None:  # the base tensors under the base checkpoint's names, the rules of the inner model
        view = clock.agreed("planning", "Naming the PEFT model's base tensors", lambda: _peft_base(peft_model))
        model = view.skeleton

    multi = dist_active() and torch.distributed.get_world_size() > 1

    def planning() -> tuple[PlanRequest, PlanStream, front.Groundwork | None]:
        request = plan_request(
            owner,
            weights_mapping=weights_mapping,
            key_mapping=key_mapping,
            state_dict_adapter=state_dict_adapter,
            loader=loader,
            strict=strict,
            external_target_fqns=external_target_fqns,
            claimed_source_keys=claimed_source_keys,
            replacement=replacement,
            ignore_missing=ignore_missing,
        )
        with _hinted(model, location):
            if not (sharing in ("job", "auto") and request.trace and multi):
                return request, front.streamed(model, index, request), None
            # the job-wide plan's whole plan reuses this plan's groups, traces and quantization scan
            targets = front.targets_of(model, request)
            work = front.groundwork(model, index, request, targets)
            return request, front.streamed(model, index, request, targets=targets, groundwork=work), work

    # The key-level plan (every claim, name and shape; the strict check), agreed before any byte is read; the
    # region reads are made while the engine reads the first ones (execute_stream), unless a sharing strategy
    # needs the whole plan first.
    request, stream, work = clock.agreed("planning", "Planning the pretrained load", planning)
    context = stream.context
    replicated = sharing == "replicated" and request.trace and multi
    job_wide = sharing in ("job", "auto") and request.trace and multi
    load_plan: LoadPlan | None = None
    if replicated or job_wide:
        load_plan = clock.agreed("planning", "Planning the pretrained load's regions", stream.plan)
    replicas = None
    if replicated:
        from hp_fastload.dist.share import plan_replicas

        assert load_plan is not None
        replicas = plan_replicas(map(context.target, load_plan.region_reads))
    clock.lap("planning")
    job = None
    if job_wide:  # docs/job-wide.md
        assert load_plan is not None
        job = agree_job_plan(
            model, index, load_plan, request, sharing, ranks_per_node, share_budget_bytes, work, clock.lap
        )
        clock.lap("agreement")
    update, close = _progress_bar(load_plan.bytes_needed if load_plan is not None else 0, progress)
    overlap = Overlap()

    def reading() -> ExecStats:
        nonlocal update, close, load_plan
        if load_plan is None and _progress_wanted(progress):  # (rank 0, inside the agreed step) its total first
            load_plan = stream.plan()
            update, close = _progress_bar(load_plan.bytes_needed, progress)
        return execute_stream(
            load_plan.region_reads.items() if load_plan is not None else stream.regions(),
            stream.deferred,
            context,
            dequant=stream.dequant,
            legacy=not request.trace,
            threads=threads,
            backend=backend,
            progress=update,
            skip=replicas.skip if replicas is not None else frozenset(),
            overlap=overlap,
        )

    clock.lap("other")
    try:
        stats: ExecStats
        if job is not None:
            assert load_plan is not None
            stats = run_job(
                job,
                torch.distributed.get_rank(),
                load_plan,
                context,
                threads=threads,
                backend=backend,
                progress=update,
            )
            clock.lap("reading")
        else:
            stats = clock.agreed(
                "reading",
                "Reading the pretrained checkpoint",
                reading,
            )
    finally:
        close()
        context.index.release_maps()  # a finished load keeps no page tables of the checkpoint mapped
        clock.lap("finishing")
    clock.overlapped(overlap)
    if load_plan is None:
        load_plan = stream.plan()  # (every region made: the plan's totals)
        clock.lap("planning")
    total = load_plan.bytes_needed
    if replicas is not None:  # every rank's reads succeeded (agreed above): safe to enter the broadcasts
        from hp_fastload.dist.share import broadcast_replicas

        stats.bytes_received = broadcast_replicas(replicas)
        clock.lap("reading")
    mark_loaded(context.target(n).tensor for n in load_plan.target_names())
    clock.lap("other")
    if view is not None and view.copies:
        clock.agreed("finishing", "Filling the modules_to_save copies", lambda: fill_copies(view))
    _record_used_rules(owner, context)
    unfilled = recreate_buffers(owner) if finalize else [name for name, _ in non_persistent_buffers(owner)]
    clock.lap("finishing")
    seconds, critical_path = clock.done()
    # The plan's report (keys, checkpoint bytes, the loader) with what executing it measured.
    report = dataclasses.replace(
        load_plan.report,
        bytes_read=stats.bytes_read,
        bytes_needed=total,
        seconds=seconds,
        retied_keys=tuple(retied),
        unfilled_buffers=tuple(unfilled),
        bytes_received=stats.bytes_received,
        bytes_sent=stats.bytes_sent,
        share="job" if job is not None else ("replicated" if replicas is not None else "none"),
        stragglers=tuple(stats.extra.get("stragglers", ())),
        adapter_keys=view.adapter_keys if view is not None else (),
        critical_path=critical_path,
    )
    if report.unexpected_keys:
        log.warning(
            "Ignored %d checkpoint tensors not owned by this model; first keys: %s",
            len(report.unexpected_keys),
            ", ".join(map(errors.shown_key, report.unexpected_keys[:10])),
        )
    log.info(report.summary())
    return report


def _opened(location: Location) -> tuple[CheckpointIndex, Any]:
    index = CheckpointIndex.open(location)
    return index, identity_of(location, index)


def _peft_base(peft_model: nn.Module) -> BaseView:
    refuse_quantized_base(peft_model)
    return base_view(peft_model)


def _record_used_rules(model: nn.Module, context: LoadContext) -> None:
    """``model._weight_conversions`` (and, with replacements, the per-stage lists) for reverse conversion."""
    with contextlib.suppress(AttributeError, TypeError):  # modules that refuse new attributes
        model._weight_conversions = context.used_rules  # type: ignore[assignment]
        if context.used_replacement_rules:
            model._hp_used_base_weight_conversions = context.used_base_rules  # type: ignore[assignment]
            model._hp_used_replacement_weight_conversions = context.used_replacement_rules  # type: ignore[assignment]
