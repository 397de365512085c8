"""The job-wide cost model: per-node storage bytes, cross-node network bytes and the predicted cold-start time of
three strategies (``none``: every rank reads its own needs; ``node``: each node reads the union of its ranks'
needs once; ``job``: the job plan), with the formulas in docs/job-wide.md. Pure arithmetic over a ``JobPlan``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hp_fastload.planning.jobneeds import union_bytes
from hp_fastload.planning.jobwide import JobPlan

__all__ = ["Prediction", "median", "predict", "ratio"]


@dataclass(frozen=True)
class Prediction:
    """One strategy's predicted cold start: per-node storage bytes and cross-node bytes, and the time."""

    strategy: str
    node_read: tuple[int, ...]
    node_out: tuple[int, ...]
    node_in: tuple[int, ...]
    seconds: float

    @property
    def total_read(self) -> int:
        return sum(self.node_read)

    @property
    def read_balance(self) -> float:
        mean = self.total_read / max(1, len(self.node_read))
        return max(self.node_read) / mean if mean else 1.0


def predict(
    plan: JobPlan,
    *,
    storage_gbps: float,
    network_gbps: float,
    storage_total_gbps: float | None = None,
    round_latency_s: float = 0.0,
) -> list[Prediction]:
    """Predicted cold start of the strategies ``none``, ``node`` and ``job`` (docs/job-wide.md).

    Per node ``n``: ``t_n = max(read_n / S, out_n / N, in_n / N)`` with ``S`` the storage bandwidth a node
    gets and ``N`` its network bandwidth (GB/s, each direction); the job takes ``max_n t_n``, and at least
    ``sum(read) / S_total`` when the file system caps the aggregate (``storage_total_gbps``). ``job`` adds
    ``rounds x round_latency_s`` (one agreement per round). Only cross-node bytes cost network time.
    """
    if storage_gbps <= 0 or network_gbps <= 0:
        raise ValueError("storage and network bandwidths must be positive")
    rpn, nodes = plan.ranks_per_node, plan.nodes
    per_node = [plan.needs[n * rpn : (n + 1) * rpn] for n in range(nodes)]
    zeros = (0,) * nodes

    def seconds(read: Sequence[int], out: Sequence[int], inn: Sequence[int], extra: float = 0.0) -> float:
        t = max(
            max(r / (storage_gbps * 1e9), o / (network_gbps * 1e9), i / (network_gbps * 1e9))
            for r, o, i in zip(read, out, inn, strict=True)
        )
        if storage_total_gbps:
            t = max(t, sum(read) / (storage_total_gbps * 1e9))
        return t + extra

    none_read = tuple(sum(n.nbytes(plan.smap) for n in group) for group in per_node)
    node_read = tuple(union_bytes(group, plan.smap) for group in per_node)
    job_read = tuple(int(x) for x in plan.node_bytes_read())
    out_b, in_b = plan.cross_node()
    job_out, job_in = tuple(int(x) for x in out_b), tuple(int(x) for x in in_b)
    return [
        Prediction("none", none_read, zeros, zeros, seconds(none_read, zeros, zeros)),
        Prediction("node", node_read, zeros, zeros, seconds(node_read, zeros, zeros)),
        Prediction("job", job_read, job_out, job_in, seconds(job_read, job_out, job_in, plan.rounds * round_latency_s)),
    ]


def median(values: Iterable[int]) -> float:
    data = sorted(values)
    if not data:
        return 0.0
    mid = len(data) // 2
    return float(data[mid]) if len(data) % 2 else (data[mid - 1] + data[mid]) / 2


def ratio(a: float, b: float) -> float:
    return a / b if b else math.nan
