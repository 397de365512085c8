"""The one way into planning: ``plan(model, index, request)`` -> this rank's ``LoadPlan`` and its live
``LoadContext``; ``groundwork`` for many ranks of one model; ``whole_plan`` for the job-wide plan.

Every caller comes through here with a :class:`~hp_fastload.planning.request.PlanRequest` built once at the API
edge: ``load`` and ``plan`` (a checkpoint into a model), ``save`` (the model's shards into the released layout,
planned as a load of that layout), the rehearsal of one rank, ``plan_each`` (many ranks, the rank-independent
groundwork done once), the job-wide plan (every rank's needs from one whole plan) and the transfer between two
live models (both directions' plans side by side). What each plan is made of lives in the sibling modules:
``orchestrate`` (groups, traces, claims, the strict check), ``intersect`` (regions), ``claims``,
``replacement``, ``adapter``; this module only decides the targets a request names and passes them on.
"""

from __future__ import annotations

from typing import Any

from hp_fastload.model.targets import Target, build_targets
from hp_fastload.planning.context import LoadContext
from hp_fastload.planning.items import LoadPlan
from hp_fastload.planning.orchestrate import Groundwork, PlanStream, groundwork_of, plan_load, plan_stream
from hp_fastload.planning.request import PlanRequest
from hp_fastload.runtime import gc_paused
from hp_fastload.source.index import CheckpointIndex

__all__ = [
    "Groundwork",
    "PlanRequest",
    "PlanStream",
    "groundwork",
    "plan",
    "streamed",
    "targets_of",
    "whole_mesh",
    "whole_plan",
]


def targets_of(model: Any, request: PlanRequest, tensors: Any = None) -> dict[str, Target]:
    """The targets of the rank ``request`` plans (its ``view``), with its external targets. ``tensors``: the
    model's tensors when the caller listed them already (``model.targets.model_tensors``; many ranks)."""
    return build_targets(
        model, external_target_fqns=request.external_target_fqns, mesh_override=request.view, tensors=tensors
    )


@gc_paused()
def plan(
    model: Any,
    index: CheckpointIndex,
    request: PlanRequest,
    *,
    targets: dict[str, Target] | None = None,
    groundwork: Groundwork | None = None,
) -> tuple[LoadPlan, LoadContext]:
    """This rank's plan (and what executing it needs live) for ``request`` against ``index``'s headers;
    nothing is read. Raises before any byte is read on a strict miss or a bad target.

    ``targets``: the request's targets when the caller built them already (:func:`targets_of`).
    ``groundwork``: the rank-independent work of the same model, checkpoint and request for another rank
    (:func:`groundwork`): groups, traces and the quantization scan are then not redone."""
    if targets is None:
        targets = targets_of(model, request)
    return plan_load(model, index, targets, request, groundwork=groundwork)


@gc_paused()
def streamed(
    model: Any,
    index: CheckpointIndex,
    request: PlanRequest,
    *,
    targets: dict[str, Target] | None = None,
    groundwork: Groundwork | None = None,
) -> PlanStream:
    """:func:`plan` whose key-level part only is done (every claim, name and shape checked, the strict check
    passed, the report final; it raises where ``plan`` raises before any byte is read): the region reads are
    made as ``PlanStream.regions`` is iterated, so a load reads the first targets while the rest are
    intersected; ``PlanStream.plan()`` is ``plan``'s ``LoadPlan``. ``targets`` and ``groundwork`` as for
    :func:`plan` (a job-wide load makes the groundwork once for its own plan and the whole plan)."""
    if targets is None:
        targets = targets_of(model, request)
    return plan_stream(model, index, targets, request, groundwork=groundwork)


@gc_paused()
def groundwork(
    model: Any, index: CheckpointIndex, request: PlanRequest, targets: dict[str, Target]
) -> Groundwork | None:
    """The rank-independent part of :func:`plan` for ``request`` (``targets``: any rank's, for their names and
    global shapes); None when the model has a replacement stage or the request an adapter (planned per rank)."""
    return groundwork_of(model, index, targets, request)


def whole_mesh(mesh: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A ``view`` under which every rank holds every DTensor whole (each mesh dim seen as of size 1)."""
    return (1,) * mesh.ndim, (0,) * mesh.ndim


def whole_plan(
    model: Any, index: CheckpointIndex, request: PlanRequest, *, groundwork: Groundwork | None = None
) -> tuple[LoadPlan, dict[str, Target]]:
    """The plan of a rank holding every target whole (traced, not strict: the ranks' own plans are checked),
    and its targets (their regions whole, their meshes and placements the model's). Every rank's items are
    the whole plan's cut by that rank's boxes (``planning.jobranks``), for rules and state-dict adapters
    alike: a trace depends only on the global shapes. ``groundwork``: that of a traced plan of the same model,
    checkpoint and request for any rank (:func:`groundwork`; the groups, traces and quantization scan are then
    not redone)."""
    whole_request = PlanRequest(
        rules=request.rules,
        adapter=request.adapter,
        trace=True,
        strict=False,
        external_target_fqns=request.external_target_fqns,
        claimed_source_keys=request.claimed_source_keys,
        replacement=request.replacement,
        ignore_missing=request.ignore_missing,
        view=whole_mesh,
    )
    whole = targets_of(model, whole_request)
    planned, _ = plan(model, index, whole_request, targets=whole, groundwork=groundwork)
    return planned, whole
