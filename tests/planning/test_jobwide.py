"""The job-wide plan's pure parts (issue 24): box runs against a naive enumeration, and ``plan_job`` on
synthetic needs: every needed byte read exactly once, each rank's rows exactly its needs, rounds within the
budget, balanced readers, a deterministic digest, and the cost model's formulas."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import numpy as np
import pytest

from hp_fastload.planning.jobcost import predict
from hp_fastload.planning.jobneeds import Needs, StorageMap, item_runs
from hp_fastload.planning.jobwide import plan_job


def _naive_elements(base: int, lengths: tuple[int, ...], strides: tuple[int, ...]) -> set[int]:
    boxes = itertools.product(*map(range, lengths))
    return {base + sum(i * s for i, s in zip(index, strides, strict=True)) for index in boxes}


@pytest.mark.parametrize("seed", range(40))
def test_item_runs_cover_exactly_the_box(seed: int) -> None:
    rng = random.Random(seed)
    ndim = rng.randint(1, 4)
    shape = [rng.randint(1, 5) for _ in range(ndim)]
    order = list(range(ndim))
    rng.shuffle(order)  # a permuted (transposed) view of a row-major tensor
    row_major = [int(np.prod(shape[d + 1 :])) for d in range(ndim)]
    strides = tuple(row_major[order[d]] for d in range(ndim))
    lengths = tuple(rng.randint(0, shape[order[d]]) for d in range(ndim))
    rel, run = item_runs(lengths, strides)
    got: list[int] = [int(s) + j for s in rel for j in range(run)]
    want = _naive_elements(0, lengths, strides)
    assert sorted(got) == sorted(want)  # every element once (no bounding box, no duplicates)


def _smap(sizes: list[int], files: int = 2) -> StorageMap:
    tensors, offsets = [], [8] * files
    for i, n in enumerate(sizes):
        f = i % files
        tensors.append((f"t{i}", f, offsets[f], n * 2, 2))
        offsets[f] += n * 2
    return StorageMap.build(tensors, [(f"f{f}.safetensors", offsets[f]) for f in range(files)])


def _needs(smap: StorageMap, rows: list[tuple[int, int, int]]) -> Needs:
    k, s, e = (np.array(c, dtype=np.int64) for c in zip(*rows, strict=True)) if rows else ([], [], [])
    from hp_fastload.planning.jobneeds import merge_needs

    return merge_needs(
        smap, np.asarray(k, dtype=np.int64), np.asarray(s, dtype=np.int64), np.asarray(e, dtype=np.int64)
    )


def _bytes_of(smap: StorageMap, needs: Needs) -> set[int]:
    lo, hi = needs.g_bounds(smap)
    return {b for a, z in zip(lo.tolist(), hi.tolist(), strict=True) for b in range(a, z)}


def _random_job(seed: int, world: int = 6) -> tuple[StorageMap, list[Needs]]:
    rng = random.Random(seed)
    sizes = [rng.randint(1, 3000) for _ in range(12)]
    smap = _smap(sizes)
    needs = []
    for _ in range(world):
        rows = []
        for k, n in enumerate(sizes):
            for _ in range(rng.randint(0, 3)):
                a = rng.randint(0, n - 1)
                rows.append((smap.key_id[f"t{k}"], a, rng.randint(a + 1, n)))
        needs.append(_needs(smap, rows))
    return smap, needs


@pytest.mark.parametrize("seed", range(8))
def test_every_needed_byte_is_read_once_and_each_rank_gets_its_own(seed: int) -> None:
    smap, needs = _random_job(seed)
    job = plan_job(needs, smap, ranks_per_node=2, chunk_bytes=1024, budget_bytes=6000)
    union = set().union(*(_bytes_of(smap, n) for n in needs))
    read: list[int] = []
    for c, k, s, e in zip(job.pieces_chunk, job.pieces_key, job.pieces_start, job.pieces_end, strict=True):
        base, size = int(smap.g0[k]), int(smap.itemsize[k])
        assert job.chunk_lo[c] <= base + s * size and base + e * size <= job.chunk_hi[c]
        read.extend(range(base + int(s) * size, base + int(e) * size))
    assert sorted(read) == sorted(union)  # T1 = 1 exactly: nothing twice, nothing missing, no gaps read
    assert int(job.bytes_read().sum()) == len(union)
    for r, n in enumerate(needs):
        _chunk, key, start, end = job.split[r]
        got = Needs(key, start, end)
        assert _bytes_of(smap, got) == _bytes_of(smap, n)  # rows = needs, cut at chunk bounds
        assert int(job.rows_bytes(r).sum()) == n.nbytes(smap)
        received = sum(len(rows) for peer, rows in job.messages(r, 0)[1].items() if peer != r)
        del received
    assert int(job.bytes_sent().sum()) == int(job.bytes_received().sum())
    assert (job.bytes_received() <= np.array([n.nbytes(smap) for n in needs])).all()  # T2 <= 1
    again = plan_job(needs, smap, ranks_per_node=2, chunk_bytes=1024, budget_bytes=6000)
    assert again.digest == job.digest


def test_rounds_keep_each_rank_within_the_budget() -> None:
    smap, needs = _random_job(3, world=4)
    budget = 5000
    job = plan_job(needs, smap, ranks_per_node=2, chunk_bytes=1000, budget_bytes=budget)
    assert job.rounds > 1
    for rnd in range(job.rounds):
        for r in range(job.world):
            sends, receives = job.messages(r, rnd)
            staged = sum(
                int(job.piece_bytes()[job.pieces_chunk == c].sum())
                for c in np.flatnonzero((job.chunk_reader == r) & (job.chunk_round == rnd))
            )
            sent = sum(int(job.rows_bytes(p)[rows].sum()) for p, rows in sends.items())
            got = sum(int(job.rows_bytes(r)[rows].sum()) for p, rows in receives.items() if p != r)
            alone = len(np.flatnonzero(job.chunk_round == rnd)) == 1
            assert alone or staged + sent + got <= budget, (rnd, r, staged, sent, got)


@pytest.mark.parametrize(("seed", "budget"), [(3, 5000), (4, 2500), (5, 9000), (6, 700)])
def test_each_round_closes_only_where_the_next_chunk_would_pass_the_budget(seed: int, budget: int) -> None:
    """With the test above (rounds within the budget), this pins the rounds to adding the chunks one at a
    time in axis order: a round ends only where its next chunk would take some rank past the budget."""
    smap, needs = _random_job(seed, world=5)
    job = plan_job(needs, smap, ranks_per_node=2, chunk_bytes=600, budget_bytes=budget)
    nchunks = len(job.chunk_lo)
    cost = np.zeros((nchunks, job.world), dtype=np.int64)  # each rank's bytes of each chunk: read, sent, received
    np.add.at(cost, (job.pieces_chunk, job.chunk_reader[job.pieces_chunk]), job.piece_bytes())
    remote = job.chunk_reader[job.rows_chunk] != job.rows_rank
    np.add.at(cost, (job.rows_chunk[remote], job.rows_rank[remote]), job.rows_bytes()[remote])
    np.add.at(cost, (job.rows_chunk[remote], job.chunk_reader[job.rows_chunk[remote]]), job.rows_bytes()[remote])
    assert (np.diff(job.chunk_round) >= 0).all() and job.rounds > 1
    for rnd in range(1, job.rounds):
        chunks = np.flatnonzero(job.chunk_round == rnd - 1)
        following = int(np.flatnonzero(job.chunk_round == rnd)[0])
        assert (cost[chunks].sum(axis=0) + cost[following] > budget).any(), (rnd, following)


def test_storage_map_of_index_is_every_key_located(tmp_path: Path) -> None:
    """``StorageMap.of_index`` (each header's records at once) against the map built from ``locate`` of each
    key: two files, several dtypes, two empty tensors at one offset (ordered by name)."""
    import json

    import torch
    from safetensors.torch import save_file

    from hp_fastload.source.index import CheckpointIndex

    first = {
        "b.weight": torch.ones(3, 5, dtype=torch.bfloat16),
        "a.empty": torch.empty(0, dtype=torch.float32),
        "z.empty": torch.empty(0, 4, dtype=torch.float32),
        "a.bias": torch.arange(7, dtype=torch.float32),
    }
    second = {"c.codes": torch.arange(9, dtype=torch.uint8), "c.count": torch.arange(4, dtype=torch.int64)}
    save_file(first, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(second, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {k: "model-00001-of-00002.safetensors" for k in first}
    weight_map.update({k: "model-00002-of-00002.safetensors" for k in second})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    index = CheckpointIndex.open(tmp_path)
    files = list(index.files)
    rows = []
    for key in index:
        entry = index.locate(key)
        rows.append((key, files.index(entry.file), entry.file.offsets(key)[0], entry.nbytes, entry.dtype.itemsize))
    reference = StorageMap.build(rows, [(f.path.rsplit("/", 1)[-1], f.file_size) for f in files])
    fast = StorageMap.of_index(index)
    assert fast.keys == reference.keys and fast.key_id == reference.key_id
    assert fast.keys.index("a.empty") < fast.keys.index("z.empty")
    for name in ("g0", "nbytes", "itemsize", "file_of", "file_g0"):
        assert np.array_equal(getattr(fast, name), getattr(reference, name)), name
    assert fast.file_names == reference.file_names and fast.digest() == reference.digest()


def test_replicated_needs_are_balanced_over_the_nodes() -> None:
    smap = _smap([4096] * 64, files=4)
    everything = _needs(smap, [(k, 0, 4096) for k in range(64)])
    job = plan_job([everything] * 8, smap, ranks_per_node=2, chunk_bytes=8192)
    per_node = job.node_bytes_read()
    assert per_node.sum() == everything.nbytes(smap)
    assert per_node.max() / per_node.mean() <= 1.10  # T3 balance
    assert (job.bytes_received() == everything.nbytes(smap) - job.bytes_read()).all()


def test_a_holder_reads_its_own_bytes() -> None:
    """FSDP-like needs (each byte on one rank): every rank reads exactly its own bytes, nothing is sent."""
    smap = _smap([1000] * 8)
    needs = [_needs(smap, [(k, 250 * r, 250 * (r + 1)) for k in range(8)]) for r in range(4)]
    job = plan_job(needs, smap, ranks_per_node=2, chunk_bytes=600)
    assert int(job.bytes_sent().sum()) == 0
    assert job.bytes_read().tolist() == [n.nbytes(smap) for n in needs]


def test_predict_formulas() -> None:
    smap = _smap([5000] * 4, files=1)
    everything = _needs(smap, [(k, 0, 5000) for k in range(4)])
    job = plan_job([everything] * 4, smap, ranks_per_node=2, chunk_bytes=4000)
    total = everything.nbytes(smap)
    by = {p.strategy: p for p in predict(job, storage_gbps=1.0, network_gbps=2.0)}
    assert by["none"].node_read == (2 * total, 2 * total)  # every rank reads all of it
    assert by["none"].seconds == pytest.approx(2 * total / 1e9)
    assert by["node"].node_read == (total, total)
    job_read = by["job"].node_read
    assert sum(job_read) == total
    out_b, in_b = by["job"].node_out, by["job"].node_in
    assert in_b == (2 * (total - job_read[0]), 2 * (total - job_read[1])) and out_b == (in_b[1], in_b[0])
    # the job's phases run one after another: read, then the exchange (cross-node bytes only, by default)
    read_s = max(job_read) / 1e9
    net_s = max(max(o, i) for o, i in zip(out_b, in_b, strict=True)) / 2e9
    assert dict(by["job"].phases) == pytest.approx({"read": read_s, "network": net_s, "copy": 0.0, "latency": 0.0})
    assert by["job"].seconds == pytest.approx(read_s + net_s)
    # caps, bytes within a node, the receivers' copies and the rounds' latency each add their term
    rates = dict(storage_total_gbps=0.5, network_total_gbps=0.25, intra_node_gbps=0.1, memory_gbps=4.0)
    capped = {p.strategy: p for p in predict(job, storage_gbps=1.0, network_gbps=2.0, round_latency_s=0.01, **rates)}
    assert capped["none"].seconds == pytest.approx(4 * total / 0.5e9)
    intra = job.intra_node()
    assert int(intra.sum()) > 0 and int(intra.sum() + sum(out_b)) == int(job.bytes_sent().sum())
    copied = 2 * job.bytes_through_memory()  # each rank needs everything, shared: placed, then run
    phases = dict(capped["job"].phases)
    assert phases == pytest.approx(
        {
            "read": total / 0.5e9,
            "network": max(net_s, sum(out_b) / 0.25e9, int(intra.max()) / 0.1e9),
            "copy": 2 * total / 4e9,
            "latency": job.rounds * 0.01,
        }
    )
    assert capped["job"].seconds == pytest.approx(sum(phases.values())) and int(copied.max()) == 2 * total
    # one host under the simulated nodes: every byte between ranks is within it, and it reads them all
    host = {
        p.strategy: p for p in predict(job, storage_gbps=1.0, network_gbps=2.0, intra_node_gbps=0.5, ranks_per_host=4)
    }
    assert host["job"].node_read == (total,) and host["none"].node_read == (4 * total,)
    assert dict(host["job"].phases)["network"] == pytest.approx(int(job.bytes_sent().sum()) / 0.5e9)
    with pytest.raises(ValueError, match="memory_gbps"):
        predict(job, storage_gbps=1.0, network_gbps=2.0, memory_gbps=0.0)


def _naive_merge(smap: StorageMap, rows: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Merged intervals per key by sets of elements: a key's elements in order, a new interval at each gap."""
    elements: dict[int, set[int]] = {}
    for k, s, e in rows:
        elements.setdefault(k, set()).update(range(s, e))
    out = []
    for k in sorted(elements, key=lambda k: (int(smap.g0[k]), k)):
        run: list[int] = []
        for x in sorted(elements[k]):
            if run and x != run[1]:
                out.append((k, run[0], run[1]))
                run = []
            run = [run[0] if run else x, x + 1]
        if run:
            out.append((k, run[0], run[1]))
    return out


def _rows_of(needs: Needs) -> list[tuple[int, int, int]]:
    return list(zip(needs.key.tolist(), needs.start.tolist(), needs.end.tolist(), strict=True))


@pytest.mark.parametrize("seed", range(40))
def test_merge_needs_equals_merging_element_sets(seed: int) -> None:
    """Overlapping, nested, touching and empty intervals, in any order; tensors that touch on the axis (an
    interval ending where the next tensor's begins stays apart from it); ``merge_needs_by_rank`` per rank."""
    from hp_fastload.planning.jobneeds import merge_needs, merge_needs_by_rank

    rng = random.Random(seed)
    smap = _smap([rng.randint(1, 40) for _ in range(rng.randint(1, 8))], files=rng.randint(1, 3))
    world = rng.randint(1, 4)
    rows_by_rank: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]
    for _ in range(rng.randint(0, 30)):
        k = rng.randrange(len(smap.keys))
        n = int(smap.nbytes[k] // smap.itemsize[k])
        a = rng.randint(0, n)
        rows_by_rank[rng.randrange(world)].append((k, a, rng.randint(a, n)))  # empty ones included
    everything = [r for rows in rows_by_rank for r in rows]
    rank = np.array([r for r, rows in enumerate(rows_by_rank) for _ in rows], dtype=np.int64)
    order = list(range(len(everything)))
    rng.shuffle(order)
    columns = [np.array([row[i] for row in everything], dtype=np.int64) for i in range(3)]
    shuffled = [c[order] if len(order) else c for c in columns]
    assert _rows_of(merge_needs(smap, *shuffled)) == _naive_merge(smap, everything)
    by_rank = merge_needs_by_rank(smap, world, rank[order] if len(order) else rank, *shuffled)
    assert [_rows_of(n) for n in by_rank] == [_naive_merge(smap, rows) for rows in rows_by_rank]


def test_merge_needs_refuses_tensors_that_share_bytes() -> None:
    """Two names for one tensor's bytes (the index refuses such headers): a position would not name its key."""
    from hp_fastload.errors import PlanError
    from hp_fastload.planning.jobneeds import merge_needs

    smap = StorageMap.build([("a", 0, 8, 8, 2), ("b", 0, 12, 8, 2)], [("f.safetensors", 20)])
    with pytest.raises(PlanError, match="'a' and 'b' share bytes"):
        merge_needs(smap, np.array([0], dtype=np.int64), np.array([0], dtype=np.int64), np.array([2], dtype=np.int64))


def test_needs_out_of_axis_order_give_the_same_chunks_and_readers() -> None:
    """``Needs`` are sorted by contract; a rank's rows given in another order still make the same chunks,
    readers and rounds (the per-(rank, chunk) byte counts are summed the same)."""
    smap, needs = _random_job(5)
    job = plan_job(needs, smap, ranks_per_node=2, chunk_bytes=1024, budget_bytes=6000)
    shuffled = [Needs(n.key[::-1].copy(), n.start[::-1].copy(), n.end[::-1].copy()) for n in needs]
    other = plan_job(shuffled, smap, ranks_per_node=2, chunk_bytes=1024, budget_bytes=6000)
    for name in ("chunk_lo", "chunk_hi", "chunk_reader", "chunk_round", "pieces_key", "pieces_start", "pieces_end"):
        assert np.array_equal(getattr(job, name), getattr(other, name)), name
    assert (job.bytes_received() == other.bytes_received()).all()


@pytest.mark.parametrize("seed", range(6))
def test_self_read_keys_follow_the_rows(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``self_read_keys`` (one rank's rows and the rows of the chunks it reads) and ``bytes_through_memory``
    (the shared pairs in a dense table, or a sorted set) against the rule row by row: a (tensor, rank) pair is
    private when the rank receives none of the tensor from another rank and reads none of it for another."""
    import hp_fastload.planning.jobwide as jobwide

    rng = random.Random(seed)
    sizes = [rng.randint(200, 3000) for _ in range(12)]
    smap = _smap(sizes)
    world = 4
    rows: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]
    for k, n in enumerate(sizes):
        if k < 8:  # whole tensors of one rank each, and a few cut between ranks
            owner = k % world
            rows[owner].append((k, 0, n))
            if rng.random() < 0.3:
                rows[(owner + 1) % world].append((k, 0, rng.randint(1, n)))
        else:  # shared pieces
            for r in range(world):
                a = rng.randint(0, n - 1)
                rows[r].append((k, a, rng.randint(a + 1, n)))
    needs = [_needs(smap, r) for r in rows]
    job = plan_job(needs, smap, ranks_per_node=2, chunk_bytes=512, budget_bytes=6000)
    reader = job.chunk_reader[job.rows_chunk]
    shared = {(int(k), int(r)) for k, r, d in zip(job.rows_key, job.rows_rank, reader, strict=True) if d != r}
    shared |= {(int(k), int(d)) for k, r, d in zip(job.rows_key, job.rows_rank, reader, strict=True) if d != r}
    private = [(int(k), int(r)) not in shared for k, r in zip(job.rows_key, job.rows_rank, strict=True)]
    for r in range(world):
        expected = {int(k) for k, rr, p in zip(job.rows_key, job.rows_rank, private, strict=True) if rr == r and p}
        assert job.self_read_keys(r) == expected, r
    assert any(job.self_read_keys(r) for r in range(world))
    through = (job.rows_bytes() * ~np.array(private)).tolist()
    expected_bytes = [
        sum(b for b, rr in zip(through, job.rows_rank.tolist(), strict=True) if rr == r) for r in range(4)
    ]
    assert job.bytes_through_memory().tolist() == expected_bytes
    monkeypatch.setattr(jobwide, "DENSE_PAIRS", 0)  # the sorted-set path
    assert job.bytes_through_memory().tolist() == expected_bytes


@pytest.mark.parametrize("seed", range(4))
def test_holder_events_merged_block_by_block_give_the_same_plan(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The holder events are merged a block of axis positions at a time (bounded temporaries); blocks of a few
    events give the plan one block gives."""
    import hp_fastload.planning.jobwide as jobwide

    smap, needs = _random_job(seed, world=5)
    whole = plan_job(needs, smap, ranks_per_node=2, chunk_bytes=256, budget_bytes=6000)
    monkeypatch.setattr(jobwide, "EVENT_BLOCK", 2)
    blocks = plan_job(needs, smap, ranks_per_node=2, chunk_bytes=256, budget_bytes=6000)
    assert len(whole.chunk_lo) > 3
    assert blocks.digest == whole.digest
    assert np.array_equal(blocks.chunk_lo, whole.chunk_lo)


def test_needs_made_in_one_piece_plan_as_the_same_needs_in_a_list() -> None:
    """``merge_needs_by_rank`` returns every rank's needs as stretches of one set of arrays, which the plan
    takes without concatenating; a list changed since is concatenated as any list."""
    from hp_fastload.planning.jobneeds import NeedsByRank, merge_needs_by_rank

    smap, needs = _random_job(2, world=4)
    rank = np.repeat(np.arange(4), [len(n.key) for n in needs])
    columns = [np.concatenate([getattr(n, f) for n in needs]) for f in ("key", "start", "end")]
    by_rank = merge_needs_by_rank(smap, 4, rank, *columns)
    assert isinstance(by_rank, NeedsByRank) and by_rank.intact() is not None
    assert plan_job(by_rank, smap, ranks_per_node=2).digest == plan_job(list(needs), smap, ranks_per_node=2).digest
    by_rank[1] = needs[0]
    assert by_rank.intact() is None
    changed = [needs[0], needs[0], needs[2], needs[3]]
    assert plan_job(by_rank, smap, ranks_per_node=2).digest == plan_job(changed, smap, ranks_per_node=2).digest


def test_an_fsdp_shard_in_runs_of_a_few_mib_is_read_by_its_owner() -> None:
    """Experts 0..23 of 4 layers, 6 MiB each, rank r owning experts 6r..6r+5 (an FSDP Shard(0) of the stacked
    experts), stored in the checkpoint's key order (0, 1, 10, 11, ..., 19, 2, 20, ...): one holder's runs are 1-4
    tensors, mostly shorter than a quarter of the default 32 MiB chunk, yet each owner reads its own and (the
    nodes balanced by the layout) nothing is sent; each run is one request."""
    elems = 3 << 20  # 6 MiB of 2-byte elements
    owner = [e // 6 for e in sorted(range(24), key=str)] * 4
    smap = _smap([elems] * len(owner), files=1)
    needs = [_needs(smap, [(k, 0, elems) for k, o in enumerate(owner) if o == r]) for r in range(4)]
    job = plan_job(needs, smap, ranks_per_node=2)
    assert job.chunk_bytes == 32 << 20
    assert int(job.bytes_sent().sum()) == 0
    assert job.bytes_read().tolist() == [n.nbytes(smap) for n in needs]
    runs = [len(list(group)) for _, group in itertools.groupby(owner)]
    assert sorted(job.request_sizes().tolist()) == sorted(n * elems * 2 for n in runs)
    # each owner reads its tensors for itself alone: straight into its shards, nothing through memory
    assert [job.self_read_keys(r) for r in range(4)] == [{k for k, o in enumerate(owner) if o == r} for r in range(4)]
    assert job.bytes_through_memory().tolist() == [0, 0, 0, 0]


def test_bytes_through_memory_are_the_shared_tensors() -> None:
    """A tensor every rank needs goes through memory on every rank (read once, sent to the others); a tensor
    one rank alone needs and reads does not."""
    smap = _smap([1000] * 2, files=1)
    needs = [_needs(smap, [(0, 0, 1000)] + ([(1, 0, 1000)] if r == 0 else [])) for r in range(4)]
    job = plan_job(needs, smap, ranks_per_node=2, chunk_bytes=600)
    assert job.self_read_keys(0) == {1} and all(job.self_read_keys(r) == set() for r in (1, 2, 3))
    assert job.bytes_through_memory().tolist() == [2000] * 4


def test_a_column_slice_stays_in_large_requests() -> None:
    """Holders change every 1 KiB row (a Shard(1) of a [rows, cols] tensor over 4 ranks): no holder cut, chunks
    of the size asked for, whatever each reader reads of the others sent to them."""
    rows, cols = 16384, 16384  # 512 MiB of 2-byte elements (so chunks are not cut small for balance)
    smap = _smap([rows * cols], files=1)
    width = cols // 4
    needs = [
        _needs(smap, [(0, r * cols + q * width, r * cols + (q + 1) * width) for r in range(rows)]) for q in range(4)
    ]
    job = plan_job(needs, smap, ranks_per_node=2, chunk_bytes=8 << 20)
    sizes = job.request_sizes()
    assert int(sizes.sum()) == rows * cols * 2 and int(sizes.min()) >= 4 << 20


def test_packed_keys_are_the_dequantized_keys_read_as_bytes(tmp_path: Path) -> None:
    """``packed_keys`` (a bulk query of the stored dtypes, then ``locate``) against ``locate`` of every
    dequantized key: MXFP4 blocks (U8) are packed, FP8 weights and keys outside the plan's dequant are not."""
    from types import SimpleNamespace

    import torch
    from safetensors.torch import save_file

    from hp_fastload.convert.quant import Dequant
    from hp_fastload.planning.jobranks import packed_keys
    from hp_fastload.source.index import CheckpointIndex

    tensors = {
        "e.blocks": torch.arange(32, dtype=torch.uint8).reshape(2, 16),
        "e.scales": torch.full((2, 1), 127, dtype=torch.uint8),
        "f.blocks": torch.arange(32, dtype=torch.uint8).reshape(2, 16),
        "w.weight": torch.ones(4, 4).to(torch.float8_e4m3fn),
        "w.weight_scale_inv": torch.ones(1, 1),
        "n.weight": torch.ones(4, dtype=torch.bfloat16),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    index = CheckpointIndex.open(tmp_path)
    dequant = {
        "e.blocks": Dequant("e.scales", (2, 32), (1, 32)),
        "w.weight": Dequant("w.weight_scale_inv", (4, 4), (4, 4)),
    }
    plan = SimpleNamespace(dequant=dequant)
    expected = frozenset(k for k in dequant if index.locate(k).dtype == torch.uint8)
    assert packed_keys(plan, index) == expected == frozenset({"e.blocks"})
    assert packed_keys(SimpleNamespace(dequant={}), index) == frozenset()
