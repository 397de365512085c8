"""``planning.transfer`` without processes: the runs of a plan's items, the layout check, and ``plan_transfer`` on
synthetic holdings (every destination element delivered exactly once, from a rank that holds it; a rank's own
elements copied, not sent; replicas sharing the sending; rounds within the window; a hole refused)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hp_fastload.errors import PlanError, TargetError
from hp_fastload.planning.items import LoadPlan, LoadReport, Reads
from hp_fastload.planning.transfer import check_layouts, plan_transfer, runs_of_plan


def _spans(rows: list[tuple[int, int, int]]) -> tuple[Any, Any, Any]:
    key, start, length = (np.array(c, dtype=np.int64) for c in zip(*rows, strict=True)) if rows else ([],) * 3
    return np.asarray(key, np.int64), np.asarray(start, np.int64), np.asarray(length, np.int64)


def _delivered(plan: Any, world: int, numel: list[int]) -> dict[int, np.ndarray]:
    """Per destination rank, how many times each element of each tensor arrived (as one flat count array)."""
    offsets = np.concatenate([[0], np.cumsum(numel)])
    out = {r: np.zeros(int(offsets[-1]), dtype=np.int64) for r in range(world)}
    for d, k, s, n in zip(plan.dst.tolist(), plan.key.tolist(), plan.start.tolist(), plan.length.tolist(), strict=True):
        out[d][offsets[k] + s : offsets[k] + s + n] += 1
    return out


def _holds(spans: Any, key: int, start: int, length: int) -> bool:
    if spans is None:
        return False
    k, s, n = spans
    return bool(((k == key) & (s <= start) & (s + n >= start + length)).any())


# two bf16 tensors of 100 and 60 elements; rank 0 and 1 split tensor 0 by halves, both hold tensor 1 (replicas)
NUMEL = [100, 60]
SOURCES = [_spans([(0, 0, 50), (1, 0, 60)]), _spans([(0, 50, 50), (1, 0, 60)]), None, None]
#: destinations: ranks 0-3 each a quarter of tensor 0 and a strided pattern of tensor 1 (5 of every 20 elements)
DESTINATIONS = [_spans([(0, 25 * r, 25), *[(1, 5 * r + 20 * i, 5) for i in range(3)]]) for r in range(4)]


def _plan(**kwargs: Any) -> Any:
    options = {"budget_bytes": 1 << 20, "direct_bytes": 1 << 20, **kwargs}
    return plan_transfer([n * 2 for n in NUMEL], [2, 2], SOURCES, DESTINATIONS, **options)


def test_every_destination_element_arrives_once_from_a_holder() -> None:
    plan = _plan()
    counts = _delivered(plan, 4, NUMEL)
    for rank, spans in enumerate(DESTINATIONS):
        expected = np.zeros_like(counts[rank])
        offsets = [0, NUMEL[0]]
        for k, s, n in zip(*(a.tolist() for a in spans), strict=True):
            expected[offsets[k] + s : offsets[k] + s + n] = 1
        assert np.array_equal(counts[rank], expected), rank
    for s, k, start, n in zip(
        plan.src.tolist(), plan.key.tolist(), plan.start.tolist(), plan.length.tolist(), strict=True
    ):
        assert _holds(SOURCES[s], k, start, n), (s, k, start, n)
    assert plan.needed_by_rank.tolist() == [int(sum(spans[2]) * 2) for spans in DESTINATIONS]
    assert int(plan.received_by_rank().sum() + plan.copied_by_rank().sum()) == int(plan.needed_by_rank.sum())


def test_a_rank_copies_what_it_holds_and_replicas_share_the_rest() -> None:
    plan = _plan()
    local = plan.msg < 0
    assert (plan.src[local] == plan.dst[local]).all() and local.any()
    # rank 0 needs [0, 25) of tensor 0, which it holds: none of it is sent to it
    to_zero = (plan.dst == 0) & (plan.key == 0)
    assert (plan.src[to_zero] == 0).all()
    # tensor 1 is held by ranks 0 and 1: ranks 2 and 3 get it from both, not all from one
    senders = set(plan.src[(plan.key == 1) & (plan.dst >= 2)].tolist())
    assert senders == {0, 1}, senders


def test_rounds_keep_each_rank_within_the_window() -> None:
    plan = _plan(budget_bytes=64)
    assert plan.rounds > 1
    assert int(plan.staging_by_rank().max()) <= 64 + 16 * 4  # the packed bytes, plus each tensor's alignment
    counts = _delivered(plan, 4, NUMEL)
    assert all(int(c.max()) <= 1 for c in counts.values())


def test_large_pieces_are_direct_messages_of_their_own() -> None:
    plan = _plan(direct_bytes=40)
    direct = np.flatnonzero(plan.msg_direct)
    assert len(direct)
    for m in direct.tolist():
        rows = plan.pieces_of(m)
        assert len(rows) == 1 and int(plan.length[rows[0]]) * 2 >= 40


def test_bytes_no_source_holds_are_refused_naming_the_tensor() -> None:
    sources = [_spans([(0, 0, 50)]), None]
    with pytest.raises(
        PlanError, match=r"rank 1's destination needs bytes of checkpoint tensor 'a' \(from element 50\)"
    ):
        plan_transfer(
            [200, 120],
            [2, 2],
            sources,
            [None, _spans([(0, 40, 20)])],
            budget_bytes=1024,
            direct_bytes=1024,
            keys=["a", "b"],
        )


def test_layout_check_names_the_tensor_and_dimension() -> None:
    a = (("w", (4, 8), "bfloat16", 2), ("b", (4,), "bfloat16", 2))
    wider = (("w", (4, 9), "bfloat16", 2), ("b", (4,), "bfloat16", 2))
    half = (("w", (4, 8), "float16", 2), ("b", (4,), "bfloat16", 2))
    assert check_layouts([a, None], [None, a[::-1]]) == tuple(sorted(a))  # the order a model lists them in is free
    with pytest.raises(
        TargetError, match=r"'w' dimension 1 is 8 in the source on rank 0 and 9 in the destination on rank 1"
    ):
        check_layouts([a, None], [None, wider])
    with pytest.raises(TargetError, match=r"float16"):
        check_layouts([a, a], [half, None])
    with pytest.raises(TargetError, match=r"only in the source"):
        check_layouts([a], [a[:1]])
    with pytest.raises(TargetError, match=r"needs a source model"):
        check_layouts([None], [a])


def test_runs_follow_the_items_and_merge_what_is_contiguous_on_both_sides() -> None:
    # a [4, 6] checkpoint tensor; the target's local [4, 3] shard holds columns 3..5 (a row-wise TP shard)
    reads = Reads(["w"], [3], [[6, 1]], [[4, 3]], [[0, 0]], [24])
    # a second target holds the whole [2, 6] tensor "v" as one box: rows contiguous on both sides, one run
    whole = Reads(["v"], [0], [[6, 1]], [[2, 6]], [[0, 0]], [24])
    scaled = Reads(["u"], [0], [[1]], [[4]], [[0]], [8], post=[("scale",)])
    plan = LoadPlan({"t": reads, "s": whole, "p": scaled}, [], LoadReport((), (), ()), {})
    runs, inexact = runs_of_plan(plan, {"w": 0, "v": 1, "u": 2}, {"t": (4, 3), "s": (2, 6), "p": (4,)})
    assert inexact == ["p"]
    rows = list(zip(runs.key.tolist(), runs.start.tolist(), runs.length.tolist(), runs.local.tolist(), strict=True))
    assert rows == [(0, 3, 3, 0), (0, 9, 3, 3), (0, 15, 3, 6), (0, 21, 3, 9), (1, 0, 12, 0)]
    assert [runs.names[t] for t in runs.target.tolist()] == ["t"] * 4 + ["s"]
