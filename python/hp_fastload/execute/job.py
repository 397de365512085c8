"""``load(..., share="job")`` on this rank: the job plan of a load, agreed, and run.

Owns the number of ranks per node (``ranks_per_node``, else ``$LOCAL_WORLD_SIZE`` as torchrun sets it, else the
whole world is one node), the job plan of a load (every rank's needs from ``planning.jobranks`` for the load's
own ``PlanRequest``, this rank's own plan checked against the one computed for it, the plan's digest agreed in
one fixed-size all-gather, ``dist.agree.agree_digest``; ``share="auto"``'s choice through the cost model), and running
it: MXFP4 items and deferred groups read by each rank itself, everything else delivered (``execute.deliver``).

Choosing the strategy (``share=``) is the API's (``api.request.resolve_share``); the checks and the report
stay in ``api.load``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hp_fastload.dist.agree import agree, agree_digest, gather_floats
from hp_fastload.dist.groups import host_message_group
from hp_fastload.errors import PlanError
from hp_fastload.execute.deliver import deliver
from hp_fastload.execute.read import ExecStats, execute_plan
from hp_fastload.planning.context import LoadContext
from hp_fastload.planning.front import Groundwork
from hp_fastload.planning.items import LoadPlan
from hp_fastload.planning.jobcost import predict
from hp_fastload.planning.jobneeds import StorageMap, delivered_rows, rank_needs
from hp_fastload.planning.jobranks import all_rank_needs, packed_keys
from hp_fastload.planning.jobwide import DEFAULT_BUDGET_BYTES, DEFAULT_CHUNK_BYTES, JobPlan, plan_job
from hp_fastload.planning.request import PlanRequest
from hp_fastload.runtime import node_of
from hp_fastload.source.index import CheckpointIndex

__all__ = ["agree_job_plan", "ranks_per_node", "run_job"]

#: Bandwidths ``share="auto"`` assumes (GB/s per node) unless the environment says otherwise.
STORAGE_GBPS_ENV = "HP_FASTLOAD_STORAGE_GBPS"
NETWORK_GBPS_ENV = "HP_FASTLOAD_NETWORK_GBPS"
DEFAULT_STORAGE_GBPS = 2.0
DEFAULT_NETWORK_GBPS = 12.5


def ranks_per_node(given: int | None, world: int) -> int:
    """``given``, else ``$LOCAL_WORLD_SIZE``, else ``world`` (one node)."""
    if given is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        given = int(env) if env and env.isdigit() and int(env) > 0 else world
    if given < 1:
        raise ValueError(f"ranks_per_node must be at least 1, got {given}")
    return min(given, world)


def plan_for_load(
    model: Any,
    index: CheckpointIndex,
    own: LoadPlan,
    request: PlanRequest,
    rank: int,
    world: int,
    *,
    per_node: int,
    budget_bytes: int,
    chunk_bytes: int,
    groundwork: Groundwork | None = None,
) -> JobPlan:
    """The job plan on this rank; ``PlanError`` when this rank's own plan needs other bytes than the plan
    computed for it (every rank must derive the same layouts). ``groundwork``: that of this rank's own plan
    (``planning.front.groundwork``), reused by the whole plan."""
    smap = StorageMap.of_index(index)
    needs = all_rank_needs(model, index, smap, world, request, groundwork=groundwork)
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
    threads: int | None,
    backend: str | None,
    progress: Callable[[int], None] | None,
    legacy: bool = False,
) -> ExecStats:
    """Run ``job`` on this rank: first what it reads straight into its shards (MXFP4 items, deferred groups, and
    the items whose tensors it reads for itself alone: ``JobPlan.self_read_keys``; agreed), then the delivery of
    the rest through memory."""
    packed = packed_keys(plan, context.index)
    smap = job.smap
    alone = {smap.keys[k] for k in job.self_read_keys(rank)}
    local: dict[str, Any] = {}
    through_memory: dict[str, np.ndarray] = {}
    used: set[str] = set()  # tensors the delivered items read from memory
    for name, reads in plan.region_reads.items():
        keep = delivered_rows(reads, packed).tolist()
        seconds = reads.second
        rows: list[int] = []
        for i in keep:
            spec = seconds[i] if seconds is not None else None
            sources = (reads.keys[i],) if spec is None else (reads.keys[i], spec.scale)
            if not all(k in alone for k in sources):  # else: read straight into the shard, below
                rows.append(i)
                used.update(sources)
        through_memory[name] = np.asarray(rows, dtype=np.int64)
        if len(rows) != len(reads):
            local[name] = reads.take(np.setdiff1d(np.arange(len(reads)), np.asarray(rows, dtype=np.int64)))
    stats = ExecStats()
    # every rank enters this step (the agreement is a collective), with or without tensors of its own
    sub = LoadPlan(local, plan.deferred, plan.report, plan.files, plan.dequant, plan.scale_nbytes)
    done = agree(
        "Reading the tensors each rank reads itself",
        lambda: (
            execute_plan(sub, context, legacy=legacy, threads=threads, backend=backend, progress=progress)
            if local or plan.deferred
            else None
        ),
    )
    stats.bytes_read += done.bytes_read if done is not None else 0
    # host bytes travel over a group that carries CPU tensors (an NCCL-only default group does not); made here,
    # where every rank is, since making a group is a collective
    messages = host_message_group()
    delivered = deliver(
        job,
        rank,
        plan,
        context,
        threads=threads,
        backend=backend,
        memory_rows=through_memory,
        skip=frozenset(smap.key_id[k] for k in alone - used),
        progress=progress,
        group=messages,
    )
    stats.bytes_read += delivered.bytes_read
    stats.bytes_sent = delivered.bytes_sent
    stats.bytes_received = delivered.bytes_received
    stats.extra.update(rounds=delivered.rounds, read_retries=delivered.read_retries, items_from_memory=delivered.items)
    timings = gather_floats("Comparing the ranks' reads", [float(delivered.bytes_read), delivered.seconds_read])
    stats.extra["stragglers"] = stragglers([(int(b), t) for b, t in timings])
    return stats


#: A reader is a straggler when its seconds per byte are this many times the (lower) median reader's ...
STRAGGLER_RATIO = 3.0
#: ... and that costs it this many seconds more than the median rate would (below it: timing noise).
STRAGGLER_EXCESS_S = 0.25


def stragglers(reads: list[tuple[int, float]]) -> tuple[str, ...]:
    """The ranks whose job-wide reads (``(bytes, seconds)`` per rank) took far longer per byte than the lower
    median reader's (of 2k readers the k-th fastest: with half the nodes slow, the fast half is the norm): a
    slow link to the storage, or a slow disk, on their node. Each as "rank r (node n): ..."."""
    rates = sorted(t / b for b, t in reads if b > 0 and t > 0)
    if len(rates) < 2:
        return ()
    median = rates[(len(rates) - 1) // 2]
    out = []
    for rank, (b, t) in enumerate(reads):
        if b > 0 and t / b > STRAGGLER_RATIO * median and t - b * median > STRAGGLER_EXCESS_S:
            out.append(
                f"rank {rank} (node {node_of(rank)}) read {b / 1e6:.2f} MB in {t:.2f} s ({b / t / 1e6:.2f} MB/s; "
                f"the median reader {1 / median / 1e6:.2f} MB/s)"
            )
    return tuple(out)


def agree_job_plan(
    model: Any,
    index: CheckpointIndex,
    load_plan: LoadPlan,
    request: PlanRequest,
    sharing: str,
    per_node: int | None,
    budget: int | None,
    groundwork: Groundwork | None = None,
    lap: Callable[[str], None] = lambda phase: None,
) -> JobPlan | None:
    """The job-wide plan of ``request`` (the load's own), computed on every rank and agreed by its digest (one
    all-gather of a hash); None when ``share="auto"`` prefers every rank reading its own regions (the same
    choice on every rank). ``groundwork``: that of ``load_plan`` (``planning.front.groundwork``), if made.
    ``lap``: the load's phase clock (``api.load.PhaseClock.lap``): the plan's making is charged to planning,
    the wait for the slowest rank to waiting, the digest's agreement to the caller's next lap."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    budget_bytes = budget or DEFAULT_BUDGET_BYTES

    def planned() -> JobPlan:
        try:
            return plan_for_load(
                model,
                index,
                load_plan,
                request,
                rank,
                world,
                per_node=ranks_per_node(per_node, world),
                budget_bytes=budget_bytes,
                chunk_bytes=min(DEFAULT_CHUNK_BYTES, budget_bytes // 4),
                groundwork=groundwork,
            )
        finally:
            lap("planning")

    job: JobPlan = agree("Planning the job-wide reads", planned)
    lap("waiting")
    agree_digest(
        "Agreeing on the job-wide plan",
        bytes.fromhex(job.digest),
        "the model's layout or the checkpoint differs between ranks; use share='none'",
    )
    if sharing == "auto" and not auto_prefers_job(job):
        return None
    return job
