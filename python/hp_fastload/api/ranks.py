"""Planning any rank of a job on one machine: a meta model from the checkpoint's config, laid out with a named layout
under torch's ``fake`` process group (``laid_out``), planned for virtual ranks against the checkpoint
(``plan_ranks``: ``hp-fastload plan --all-ranks``), one rank rehearsed (``rehearse_rank``: ``--execute``), or the
job-wide plan of such a layout with its measures (``simulate``: ``hp-fastload plan --all-ranks --share job``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hp_fastload.model.layouts import apply_layout, mesh_shape_for
from hp_fastload.runtime import gc_paused
from hp_fastload.source.location import Location


@dataclass
class RankPlan:
    """What one rank of a planned layout reads."""

    rank: int
    bytes_needed: int
    files: dict[str, int]
    deferred: list[str]
    region_targets: int
    missing: int
    unexpected: int
    seconds: float
    summary: str = field(repr=False, default="")
    #: process CPU seconds of this rank's share (``time.process_time``: every thread; the index open and the
    #: shared work counted in the first rank's)
    cpu_seconds: float = 0.0


def meta_model(checkpoint: Location, auto_class: str | None) -> nn.Module:
    import transformers

    from hp_fastload.source.config import read_config

    config = read_config(checkpoint, {})  # a regular config.json (a FIFO would block the read), or an object
    cls = getattr(transformers, auto_class or "AutoModelForCausalLM", None)
    if cls is None:
        raise ValueError(f"--auto-class {auto_class!r} is not a class of transformers")
    with torch.device("meta"):
        if hasattr(cls, "from_config"):
            return cls.from_config(config, dtype=torch.bfloat16)
        return cls._from_config(config, dtype=torch.bfloat16)


@contextlib.contextmanager
def laid_out(
    checkpoint: str, layout: str, world: int, mesh: Sequence[int] | None = None, auto_class: str | None = None
) -> Iterator[tuple[nn.Module, str, Location, float]]:
    """The checkpoint's model built on meta under a ``fake`` process group of ``world`` ranks and laid out as
    ``layout``: yields ``(model, layout description, resolved location, build seconds)``; the process group is
    destroyed on exit."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hp_fastload.source.location import resolve_checkpoint_location

    shape = mesh_shape_for(layout, world, mesh)
    location = resolve_checkpoint_location(checkpoint)
    if dist.is_initialized():
        raise RuntimeError("planning ranks needs a process without a process group (it starts a fake one)")
    started = time.perf_counter()
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        model = meta_model(location, auto_class)
        description = apply_layout(model, layout, world, shape)
        yield model, description, location, time.perf_counter() - started
    finally:
        dist.destroy_process_group()


def _check_ranks(ranks: Sequence[int], world: int) -> None:
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        raise ValueError(f"--rank {bad[0]} is not a rank of --world {world} (0..{world - 1})")


def rehearse_rank(
    checkpoint: str,
    layout: str,
    world: int,
    rank: int,
    mesh: Sequence[int] | None = None,
    auto_class: str | None = None,
    **kwargs: Any,
) -> tuple[str, Any, float]:
    """Rank ``rank`` of ``layout`` over ``world`` ranks rehearsed in this process (``hp_fastload.rehearse``:
    its local shards allocated for real and read from the checkpoint); ``(description, Rehearsal, build s)``.
    ``kwargs`` go to ``rehearse`` (threads, device, staging_bytes)."""
    from hp_fastload.api.rehearse import rehearse

    mesh_shape_for(layout, world, mesh)
    _check_ranks([rank], world)
    with laid_out(checkpoint, layout, world, mesh, auto_class) as (model, description, location, built):
        report, _ = rehearse(model, str(location), rank=rank, **kwargs)  # a path or an s3:// URL
    return description, report, built


def plan_ranks(
    checkpoint: str,
    layout: str,
    world: int,
    ranks: Sequence[int],
    mesh: Sequence[int] | None = None,
    auto_class: str | None = None,
) -> tuple[str, list[RankPlan], float]:
    """Plan ``ranks`` of ``world`` under ``layout`` in this process; ``(layout description, plans, build s)``.

    The model is built once from the checkpoint's config on meta under a ``fake`` process group of ``world``
    ranks and parallelized with :func:`apply_layout`; the ranks are planned by ``hp_fastload.plan_each`` (the
    headers, groups and traces made once). A rank's ``seconds`` is its own share (the first rank's includes
    the shared work).
    """
    from hp_fastload.api.rehearse import plan_each

    mesh_shape_for(layout, world, mesh)
    _check_ranks(ranks, world)
    with (
        laid_out(checkpoint, layout, world, mesh, auto_class) as (model, description, location, built),
        gc_paused(),  # once for every rank (a pause per rank ends in a full collection of the model per rank)
    ):
        plans = []
        t0, c0 = time.perf_counter(), time.process_time()
        for rank, p in plan_each(model, str(location), ranks):  # a path or an s3:// URL
            seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
            plans.append(
                RankPlan(
                    rank=rank,
                    bytes_needed=p.bytes_needed,
                    files=dict(sorted(p.read_bytes_by_file().items())),
                    deferred=[d.label for d in p.deferred],
                    region_targets=len(p.region_reads),
                    missing=len(p.report.missing_keys),
                    unexpected=len(p.report.unexpected_keys),
                    seconds=seconds,
                    summary=p.summary() if len(ranks) == 1 else "",
                    cpu_seconds=cpu_seconds,
                )
            )
            t0, c0 = time.perf_counter(), time.process_time()
    return description, plans, built


def simulate(
    checkpoint: str,
    layout: str,
    world: int,
    *,
    mesh: Sequence[int] | None = None,
    auto_class: str | None = None,
    ranks_per_node: int = 8,
    storage_gbps: float = 2.0,
    network_gbps: float = 12.5,
    storage_total_gbps: float | None = None,
    network_total_gbps: float | None = None,
    intra_node_gbps: float | None = None,
    memory_gbps: float | None = None,
    ranks_per_host: int | None = None,
    budget_bytes: int | None = None,
    chunk_bytes: int | None = None,
    round_latency_s: float = 0.0,
) -> dict[str, Any]:
    """The job-wide plan of ``layout`` over ``world`` ranks, planned in this process as one rank of the job
    would (headers only, under a ``fake`` process group), and its measures (``planning.simulate.measures``),
    with the seconds of each planning phase (``t4_plan_seconds``: T4 is their total)."""
    from hp_fastload.api.request import plan_request
    from hp_fastload.planning.front import whole_plan
    from hp_fastload.planning.jobneeds import StorageMap
    from hp_fastload.planning.jobranks import needs_from_whole_plan
    from hp_fastload.planning.jobwide import DEFAULT_BUDGET_BYTES, DEFAULT_CHUNK_BYTES, plan_job
    from hp_fastload.planning.simulate import measures
    from hp_fastload.source.index import CheckpointIndex

    with laid_out(checkpoint, layout, world, mesh, auto_class) as (model, description, location, built):
        marks = [(time.perf_counter(), time.process_time())]
        index = CheckpointIndex.open(location)
        smap = StorageMap.of_index(index)
        marks.append((time.perf_counter(), time.process_time()))
        whole, targets = whole_plan(model, index, plan_request(model, loader="dcp", strict=False))
        marks.append((time.perf_counter(), time.process_time()))
        needs = needs_from_whole_plan(whole, targets, index, smap, world)
        marks.append((time.perf_counter(), time.process_time()))
        job = plan_job(
            needs,
            smap,
            ranks_per_node=ranks_per_node,
            budget_bytes=budget_bytes or DEFAULT_BUDGET_BYTES,
            chunk_bytes=chunk_bytes or DEFAULT_CHUNK_BYTES,
        )
        marks.append((time.perf_counter(), time.process_time()))
    out = measures(
        job,
        needs,
        checkpoint_bytes=index.total_bytes,
        storage_gbps=storage_gbps,
        network_gbps=network_gbps,
        storage_total_gbps=storage_total_gbps,
        network_total_gbps=network_total_gbps,
        intra_node_gbps=intra_node_gbps,
        memory_gbps=memory_gbps,
        round_latency_s=round_latency_s,
        ranks_per_host=ranks_per_host,
    )
    out["layout"] = description
    out["model_build_seconds"] = built
    phases = ("headers", "whole_plan", "all_ranks_needs", "job_plan")
    for name, clock in (("t4_plan_seconds", 0), ("t4_plan_cpu_seconds", 1)):
        spans = {p: marks[i + 1][clock] - marks[i][clock] for i, p in enumerate(phases)}
        spans["total"] = marks[-1][clock] - marks[0][clock]
        spans["t4"] = spans["whole_plan"] + spans["all_ranks_needs"] + spans["job_plan"]
        out[name] = spans
    return out
