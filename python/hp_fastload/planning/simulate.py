"""The job-wide simulator's numbers (``hp-fastload plan CKPT --all-ranks --share job``): from every rank's needs and
the job plan built from them, the measures the issue's targets name: per-node storage bytes and read balance
(max / mean), the job's storage bytes over the bytes it needs (T1), each rank's received bytes over its needs
(T2), the median read request (T3), the time to plan the job (T4, measured by the caller), and ``jobcost.predict``'s
seconds for ``none`` / ``node`` / ``job``. Pure: the caller plans (``api.ranks.simulate``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hp_fastload.planning.jobcost import median, predict
from hp_fastload.planning.jobneeds import Needs
from hp_fastload.planning.jobwide import JobPlan

__all__ = ["measures"]


def measures(
    job: JobPlan,
    needs: Sequence[Needs],
    *,
    checkpoint_bytes: int,
    storage_gbps: float,
    network_gbps: float,
    **rates: float | int | None,
) -> dict[str, Any]:
    """The job's measures and predicted cold starts, as a JSON-ready dict; ``rates``: ``jobcost.predict``'s
    other figures (totals, intra-node, memory, round latency)."""
    smap = job.smap
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
        **rates,  # type: ignore[arg-type]
    )
    out_b, in_b = job.cross_node()
    with np.errstate(divide="ignore", invalid="ignore"):
        t2_ratio = np.where(needed > 0, received / np.maximum(needed, 1), 0.0)
    mean_node = float(node_read.mean()) if len(node_read) else 0.0
    return {
        "world": job.world,
        "ranks_per_node": job.ranks_per_node,
        "nodes": job.nodes,
        "checkpoint_bytes": int(checkpoint_bytes),
        "job_needs_bytes": union,
        "storage_bytes": int(read.sum()),
        "storage_bytes_without_sharing": int(needed.sum()),
        "t1_read_over_needed": float(read.sum() / union) if union else 0.0,
        "t2_max_received_over_needed": float(t2_ratio.max()) if len(t2_ratio) else 0.0,
        "t3_node_read_balance": float(node_read.max() / mean_node) if mean_node else 1.0,
        "t3_median_request_bytes": median(requests.tolist()),
        "chunks": len(requests),
        "rounds": job.rounds,
        "per_node_storage_bytes": [int(x) for x in node_read],
        "per_node_sent_bytes": [int(x) for x in out_b],
        "per_node_received_bytes": [int(x) for x in in_b],
        "per_rank_needed_bytes": [int(x) for x in needed],
        "per_rank_received_bytes": [int(x) for x in received],
        "per_rank_read_bytes": [int(x) for x in read],
        "storage_gbps": storage_gbps,
        "network_gbps": network_gbps,
        **{name: value for name, value in rates.items() if value is not None},
        "predicted_seconds": {p.strategy: p.seconds for p in predictions},
        "predicted_phases": {p.strategy: dict(p.phases) for p in predictions},
        "predicted_node_storage_bytes": {p.strategy: list(p.node_read) for p in predictions},
        "digest": job.digest,
    }
