"""The job-wide simulator behind ``hp-fastload plan CKPT --all-ranks --share job``: a layout's every rank
planned on this machine (``layouts``' fake process group, headers only), the job plan built from their needs
(``planning.jobwide``), and its measures and predicted cold starts per strategy.

Owns the numbers the issue's targets name: per-node storage bytes and read balance (max / mean), the job's
storage bytes over the bytes it needs (T1), each rank's received bytes over its needs (T2), the median read
request (T3), the time to plan the job (T4), and ``jobwide.predict``'s seconds for ``none`` / ``node`` / ``job``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from .planning.jobwide import DEFAULT_BUDGET_BYTES, DEFAULT_CHUNK_BYTES, median, plan_job, predict

__all__ = ["simulate"]


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
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    round_latency_s: float = 0.0,
) -> dict[str, Any]:
    """Plan every rank of ``layout`` over ``world`` and the job; a JSON-ready dict of the measures."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from .index import CheckpointIndex, resolve_checkpoint_location
    from .jobload import all_rank_needs
    from .layouts import _meta_model, apply_layout, mesh_shape_for
    from .planning.jobwide import StorageMap
    from .rules import resolve_mapping

    shape = mesh_shape_for(layout, world, mesh)
    location = resolve_checkpoint_location(checkpoint)
    if dist.is_initialized():
        raise RuntimeError("simulate needs a process without a process group (it starts a fake one)")
    started = time.perf_counter()
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        model = _meta_model(str(location), auto_class)
        description = apply_layout(model, layout, world, shape)
        built = time.perf_counter() - started
        t0 = time.perf_counter()
        index = CheckpointIndex.open(location)
        smap = StorageMap.of_index(index)
        needs = all_rank_needs(
            model,
            index,
            smap,
            world,
            rules=resolve_mapping(model, None, None),
            loader="dcp",
            external_target_fqns=frozenset(),
            claimed_source_keys=frozenset(),
            replacement=None,
        )
        t1 = time.perf_counter()
        job = plan_job(needs, smap, ranks_per_node=ranks_per_node, budget_bytes=budget_bytes, chunk_bytes=chunk_bytes)
        t2 = time.perf_counter()
    finally:
        dist.destroy_process_group()
    needed = np.array([n.nbytes(smap) for n in needs], dtype=np.int64)
    received = job.bytes_received()
    read = job.bytes_read()
    node_read = job.node_bytes_read()
    union = int(job.piece_bytes().sum())
    requests = job.request_sizes()
    predictions = predict(
        job,
        storage_gbps=storage_gbps,
        network_gbps=network_gbps,
        storage_total_gbps=storage_total_gbps,
        round_latency_s=round_latency_s,
    )
    out_b, in_b = job.cross_node()
    with np.errstate(divide="ignore", invalid="ignore"):
        t2_ratio = np.where(needed > 0, received / np.maximum(needed, 1), 0.0)
    mean_node = float(node_read.mean()) if len(node_read) else 0.0
    return {
        "layout": description,
        "world": world,
        "ranks_per_node": ranks_per_node,
        "nodes": job.nodes,
        "checkpoint_bytes": int(index.total_bytes),
        "job_needs_bytes": union,
        "storage_bytes": int(read.sum()),
        "storage_bytes_without_sharing": int(needed.sum()),
        "t1_read_over_needed": float(read.sum() / union) if union else 0.0,
        "t2_max_received_over_needed": float(t2_ratio.max()) if len(t2_ratio) else 0.0,
        "t3_node_read_balance": float(node_read.max() / mean_node) if mean_node else 1.0,
        "t3_median_request_bytes": median(requests.tolist()),
        "chunks": len(requests),
        "rounds": job.rounds,
        "t4_plan_seconds": {"all_ranks_needs": t1 - t0, "job_plan": t2 - t1, "total": t2 - t0},
        "model_build_seconds": built,
        "per_node_storage_bytes": [int(x) for x in node_read],
        "per_node_sent_bytes": [int(x) for x in out_b],
        "per_node_received_bytes": [int(x) for x in in_b],
        "per_rank_needed_bytes": [int(x) for x in needed],
        "per_rank_received_bytes": [int(x) for x in received],
        "per_rank_read_bytes": [int(x) for x in read],
        "storage_gbps": storage_gbps,
        "network_gbps": network_gbps,
        "predicted_seconds": {p.strategy: p.seconds for p in predictions},
        "predicted_node_storage_bytes": {p.strategy: list(p.node_read) for p in predictions},
        "digest": job.digest,
    }
