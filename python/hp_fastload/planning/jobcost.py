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
    """One strategy's predicted cold start: per-node storage bytes and cross-node bytes, the time, and the
    time's phases (``read``, ``network``, ``copy``, ``latency``: their sum for ``job``)."""

    strategy: str
    node_read: tuple[int, ...]
    node_out: tuple[int, ...]
    node_in: tuple[int, ...]
    seconds: float
    phases: tuple[tuple[str, float], ...] = ()

    @property
    def total_read(self) -> int:
        return sum(self.node_read)

    @property
    def read_balance(self) -> float:
        mean = self.total_read / max(1, len(self.node_read))
        return max(self.node_read) / mean if mean else 1.0


def _rate(gbps: float | None) -> float:
    """Bytes per second of a GB/s figure; None: unlimited."""
    return math.inf if gbps is None else gbps * 1e9


def predict(
    plan: JobPlan,
    *,
    storage_gbps: float,
    network_gbps: float,
    storage_total_gbps: float | None = None,
    network_total_gbps: float | None = None,
    intra_node_gbps: float | None = None,
    memory_gbps: float | None = None,
    round_latency_s: float = 0.0,
    ranks_per_host: int | None = None,
) -> list[Prediction]:
    """Predicted cold start of the strategies ``none``, ``node`` and ``job`` (docs/job-wide.md, "Cost model").

    ``S`` = ``storage_gbps``: the storage bandwidth one node reads at; ``N`` = ``network_gbps``: one node's
    network bandwidth per direction; the ``*_total`` caps: the file system's and the network's aggregate (None:
    no cap); ``I`` = ``intra_node_gbps``: bytes between ranks of one node (None: free, as over NVLink);
    ``M`` = ``memory_gbps``: the rate one rank copies into freshly allocated memory (None: free). GB/s, 1e9
    bytes.
    ``ranks_per_host``: the hardware's grouping when it is not the plan's nodes (a job whose simulated nodes
    share one host: ``world``); the storage and network terms then run per host.

    ``none`` / ``node``: ``max(max_n read_n / S, sum(read) / S_total)`` (the engine reads straight into the
    shards). ``job`` runs its phases one after another in every round (read, agree, exchange, run the items
    from memory), so its time is their sum::

        read    = max(max_n read_n / S, sum(read) / S_total)
        network = max(max_n max(out_n, in_n) / N, sum(out) / N_total, max_n intra_n / I)
        copy    = max_r 2 x memory_r / M      (place the bytes in per-tensor buffers, then run their items)

    ``memory_r``: the bytes rank ``r`` runs from memory (``JobPlan.bytes_through_memory``); the tensors it reads
    for itself alone go straight into its shards as in ``none``. A sender packs its messages while earlier ones
    travel: its copies are inside the exchange.
        T       = read + network + copy + rounds x round_latency_s
    """
    if storage_gbps <= 0 or network_gbps <= 0:
        raise ValueError("storage and network bandwidths must be positive")
    for name, value in (
        ("storage_total_gbps", storage_total_gbps),
        ("network_total_gbps", network_total_gbps),
        ("intra_node_gbps", intra_node_gbps),
        ("memory_gbps", memory_gbps),
    ):
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be positive (or None: unlimited)")
    s_node, s_total = _rate(storage_gbps), _rate(storage_total_gbps)
    n_node, n_total = _rate(network_gbps), _rate(network_total_gbps)
    rpn = ranks_per_host or plan.ranks_per_node
    nodes = -(-plan.world // rpn)
    per_node = [plan.needs[n * rpn : (n + 1) * rpn] for n in range(nodes)]
    zeros = (0,) * nodes

    def read_seconds(read: Sequence[int]) -> float:
        return max(max((r / s_node for r in read), default=0.0), sum(read) / s_total)

    none_read = tuple(sum(n.nbytes(plan.smap) for n in group) for group in per_node)
    node_read = tuple(union_bytes(group, plan.smap) for group in per_node)
    job_read = tuple(int(x) for x in plan.node_bytes_read(rpn))
    out_b, in_b = plan.cross_node(rpn)
    job_out, job_in = tuple(int(x) for x in out_b), tuple(int(x) for x in in_b)
    intra = plan.intra_node(rpn)
    copied = 2 * plan.bytes_through_memory()
    phases = (
        ("read", read_seconds(job_read)),
        (
            "network",
            max(
                max((max(o, i) / n_node for o, i in zip(job_out, job_in, strict=True)), default=0.0),
                sum(job_out) / n_total,
                float(intra.max(initial=0)) / _rate(intra_node_gbps),
            ),
        ),
        ("copy", float(copied.max(initial=0)) / _rate(memory_gbps)),
        ("latency", plan.rounds * round_latency_s),
    )
    none_s, node_s = read_seconds(none_read), read_seconds(node_read)
    return [
        Prediction("none", none_read, zeros, zeros, none_s, (("read", none_s),)),
        Prediction("node", node_read, zeros, zeros, node_s, (("read", node_s),)),
        Prediction("job", job_read, job_out, job_in, sum(t for _, t in phases), phases),
    ]


def median(values: Iterable[int]) -> float:
    data = sorted(values)
    if not data:
        return 0.0
    mid = len(data) // 2
    return float(data[mid]) if len(data) % 2 else (data[mid - 1] + data[mid]) / 2


def ratio(a: float, b: float) -> float:
    return a / b if b else math.nan
