"""``load(..., share=...)``: choosing the sharing strategy and running the job-wide one.

Owns: resolving ``share`` (``"none"``, ``"job"``, ``"auto"``, and the older ``share_replicated=True``,
which stays the replica broadcast of ``share``), the number of ranks per node (``ranks_per_node``, else
``$LOCAL_WORLD_SIZE`` as torchrun sets it, else the whole world is one node), planning every rank's needs on
every rank (``all_rank_needs``: the model's targets re-placed for each rank with ``virtual_rank``, ranks
whose regions are all equal planned once), the one agreement on the job plan's digest, and running a job
plan: MXFP4 items and deferred groups read by each rank itself, everything else delivered (``deliver``).

The plan and the delivery are ``planning.jobwide`` and ``deliver``; the checks and the report stay in
``checkpointer.load``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .errors import PlanError
from .index import CheckpointIndex
from .plan import LoadContext, LoadPlan, Replacement
from .planning.jobwide import (
    JobPlan,
    Needs,
    StorageMap,
    delivered_rows,
    plan_job,
    predict,
    rank_needs,
)

__all__ = ["SHARES", "JobStats", "all_rank_needs", "packed_keys", "ranks_per_node", "resolve_share", "run_job"]

SHARES = ("none", "job", "auto", "replicated")
#: Bandwidths ``share="auto"`` assumes (GB/s per node) unless the environment says otherwise.
STORAGE_GBPS_ENV = "HP_FASTLOAD_STORAGE_GBPS"
NETWORK_GBPS_ENV = "HP_FASTLOAD_NETWORK_GBPS"
DEFAULT_STORAGE_GBPS = 2.0
DEFAULT_NETWORK_GBPS = 12.5


def resolve_share(share: str | None, share_replicated: bool) -> str:
    """The strategy: ``share`` when given, ``"replicated"`` for the older ``share_replicated=True``, else
    ``"none"``. ``ValueError`` for an unknown name or a contradiction."""
    if share is None:
        return "replicated" if share_replicated else "none"
    name = str(share).strip().lower()
    if name not in SHARES:
        raise ValueError(f"Unknown share {share!r}; expected one of {', '.join(SHARES)}")
    if share_replicated and name != "replicated":
        raise ValueError(f"share={share!r} and share_replicated=True disagree: pass one of them")
    return name


def ranks_per_node(given: int | None, world: int) -> int:
    """``given``, else ``$LOCAL_WORLD_SIZE``, else ``world`` (one node)."""
    if given is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        given = int(env) if env and env.isdigit() and int(env) > 0 else world
    if given < 1:
        raise ValueError(f"ranks_per_node must be at least 1, got {given}")
    return min(given, world)


def packed_keys(plan: LoadPlan, index: CheckpointIndex) -> frozenset[str]:
    """The MXFP4 keys a plan dequantizes (their items stay with each rank: ``jobwide.delivered_rows``)."""
    return frozenset(k for k in plan.dequant if index.locate(k).dtype == torch.uint8)


def all_rank_needs(
    model: Any,
    index: CheckpointIndex,
    smap: StorageMap,
    world: int,
    *,
    rules: Any,
    loader: str,
    external_target_fqns: Collection[str],
    claimed_source_keys: Collection[str],
    replacement: Replacement | None,
) -> list[Needs]:
    """Every rank's needs, computed here: the targets re-placed for each rank (``virtual_rank``) and planned;
    ranks whose targets all have the same regions share one planning."""
    from .plan import plan_load
    from .targets import build_targets, virtual_rank

    seen: dict[Any, Needs] = {}
    out: list[Needs] = []
    for r in range(world):
        targets = build_targets(
            model, external_target_fqns=frozenset(external_target_fqns), mesh_override=virtual_rank(r)
        )
        signature = tuple((name, t.region if t.error is None else t.error) for name, t in targets.items())
        needs = seen.get(signature)
        if needs is None:
            planned, _ = plan_load(
                model,
                index,
                targets,
                rules,
                strict=False,
                trace=True,
                claimed_source_keys=frozenset(claimed_source_keys),
                loader=loader,
                replacement=replacement,
            )
            needs = seen[signature] = rank_needs(planned, smap, packed_keys(planned, index))
        out.append(needs)
    return out


@dataclass
class JobStats:
    """What a job-wide load did on this rank (``ExecStats``-shaped: ``bytes_read``, ``extra``)."""

    bytes_read: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def plan_for_load(
    model: Any,
    index: CheckpointIndex,
    own: LoadPlan,
    rank: int,
    world: int,
    *,
    rules: Any,
    loader: str,
    external_target_fqns: Collection[str],
    claimed_source_keys: Collection[str],
    replacement: Replacement | None,
    per_node: int,
    budget_bytes: int,
    chunk_bytes: int,
) -> JobPlan:
    """The job plan on this rank; ``PlanError`` when this rank's own plan needs other bytes than the plan
    computed for it (every rank must derive the same layouts)."""
    smap = StorageMap.of_index(index)
    needs = all_rank_needs(
        model,
        index,
        smap,
        world,
        rules=rules,
        loader=loader,
        external_target_fqns=external_target_fqns,
        claimed_source_keys=claimed_source_keys,
        replacement=replacement,
    )
    mine = rank_needs(own, smap, packed_keys(own, index))
    if mine != needs[rank]:
        raise PlanError(
            f"rank {rank}: its own plan reads {mine.nbytes(smap)} bytes but the job-wide plan computed "
            f"{needs[rank].nbytes(smap)} for it (a layout that cannot be derived for other ranks); use share='none'"
        )
    return plan_job(needs, smap, ranks_per_node=per_node, budget_bytes=budget_bytes, chunk_bytes=chunk_bytes)


def auto_prefers_job(job: JobPlan) -> bool:
    """``share="auto"``: the job plan when the cost model predicts it faster than every rank reading alone."""
    storage = float(os.environ.get(STORAGE_GBPS_ENV, DEFAULT_STORAGE_GBPS))
    network = float(os.environ.get(NETWORK_GBPS_ENV, DEFAULT_NETWORK_GBPS))
    by_name = {p.strategy: p.seconds for p in predict(job, storage_gbps=storage, network_gbps=network)}
    return by_name["job"] < by_name["none"]


def run_job(
    job: JobPlan,
    rank: int,
    plan: LoadPlan,
    context: LoadContext,
    *,
    agree: Callable[[str, Callable[[], Any]], Any],
    threads: int | None,
    backend: str | None,
    progress: Callable[[int], None] | None,
    legacy: bool = False,
) -> JobStats:
    """Run ``job`` on this rank: first what stays local (MXFP4 items, deferred groups; agreed), then the
    delivery."""
    from .deliver import deliver
    from .execute import execute_plan

    packed = packed_keys(plan, context.index)
    local: dict[str, Any] = {}
    for name, reads in plan.region_reads.items():
        keep = delivered_rows(reads, packed)
        if len(keep) != len(reads):
            rest = np.setdiff1d(np.arange(len(reads)), keep)
            local[name] = reads.take(rest)
    stats = JobStats()
    if local or plan.deferred:
        sub = LoadPlan(local, plan.deferred, plan.report, plan.files, plan.dequant, plan.scale_nbytes)
        done = agree(
            "Reading the tensors each rank reads itself",
            lambda: execute_plan(sub, context, legacy=legacy, threads=threads, backend=backend, progress=progress),
        )
        stats.bytes_read += done.bytes_read
    delivered = deliver(
        job, rank, plan, context, threads=threads, backend=backend, packed=packed, agree=agree, progress=progress
    )
    stats.bytes_read += delivered.bytes_read
    stats.bytes_sent = delivered.bytes_sent
    stats.bytes_received = delivered.bytes_received
    stats.extra.update(rounds=delivered.rounds, read_retries=delivered.read_retries, items_from_memory=delivered.items)
    return stats
