"""The job-wide plan: every checkpoint byte any rank needs is read from storage once per job, by one reader
rank, and each rank is sent exactly the bytes its own read items touch.

Owns ``plan_job``: all ranks' needs (``planning.jobneeds``) -> ``JobPlan``: the union cut into chunks (large
coalesced read requests that never cross a file, cut where the set of ranks needing the bytes changes), one
reader per chunk (a rank that needs it where that keeps the nodes' read bytes balanced, else the least-loaded
node's least-loaded rank), rounds that keep each rank's staging and message memory within a budget, and per
round the messages ``reader -> receiver`` (the receiver's intervals within the reader's chunks, in axis
order). Deterministic: every rank computes the same plan from the same needs, and ``JobPlan.digest`` is the one
value the ranks compare. Pure: no process group, no bytes.

What it does not own: planning a rank (``plan_load``), the cost model (``jobcost``), moving bytes
(``execute.deliver``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hp_fastload.planning.jobneeds import Int64s, Needs, StorageMap, as_int64, merge_needs

__all__ = ["DEFAULT_BUDGET_BYTES", "DEFAULT_CHUNK_BYTES", "MIN_CHUNK_BYTES", "JobPlan", "plan_job"]

#: Target size of one read request (a chunk): Run:ai's object-store default is 8 MiB, Orbax uses 128 MiB.
DEFAULT_CHUNK_BYTES = 32 << 20
#: The smallest chunk ``plan_job`` cuts for balance's sake (smaller tensors still make smaller pieces).
MIN_CHUNK_BYTES = 4096
#: Per-rank memory of one round: chunks read (staging) + messages sent + messages received.
DEFAULT_BUDGET_BYTES = 512 << 20

# ---------------------------------------------------------------------------------------------------------
# The job plan


@dataclass(eq=False)
class JobPlan:
    """The job-wide plan (see the module docstring). Per chunk ``c``: its axis range ``[chunk_lo, chunk_hi)``,
    its reader, its round. ``pieces_*``: what the reader reads, the union of every rank's needs within each
    chunk (per tensor: ``(chunk, key, element start, element end)``). ``split[r]``: rank ``r``'s needs cut at
    chunk boundaries, as ``(chunk, key, start, end)`` in axis order: the rows it receives."""

    world: int
    ranks_per_node: int
    smap: StorageMap
    needs: list[Needs]
    chunk_lo: Int64s
    chunk_hi: Int64s
    chunk_reader: Int64s
    chunk_round: Int64s
    rounds: int
    pieces_chunk: Int64s
    pieces_key: Int64s
    pieces_start: Int64s
    pieces_end: Int64s
    split: list[tuple[Int64s, Int64s, Int64s, Int64s]]
    budget_bytes: int
    chunk_bytes: int
    digest: str = ""
    _node_of: Int64s = field(default_factory=lambda: as_int64([]))

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    @property
    def nodes(self) -> int:
        return -(-self.world // self.ranks_per_node)

    def pieces_of(self, chunks: Int64s) -> Int64s:
        """Rows of the pieces of ``chunks`` (sorted chunk numbers)."""
        lo = np.searchsorted(self.pieces_chunk, chunks, "left")
        hi = np.searchsorted(self.pieces_chunk, chunks, "right")
        return as_int64(np.concatenate([np.arange(a, b) for a, b in zip(lo, hi, strict=True)]) if len(chunks) else [])

    def piece_bytes(self) -> Int64s:
        return (self.pieces_end - self.pieces_start) * self.smap.itemsize[self.pieces_key]

    def rows_bytes(self, rank: int) -> Int64s:
        _chunk, key, start, end = self.split[rank]
        return (end - start) * self.smap.itemsize[key]

    def messages(self, rank: int, rnd: int) -> tuple[dict[int, Int64s], dict[int, Int64s]]:
        """Round ``rnd``'s messages of ``rank``: ``(sends, receives)``, each ``peer -> rows`` (of the peer's
        ``split`` for sends, of this rank's for receives), in axis order; a rank's own chunks appear in its
        receives under its own number (copied, not sent)."""
        sends: dict[int, list[Int64s]] = {}
        mine = np.flatnonzero((self.chunk_reader == rank) & (self.chunk_round == rnd))
        if len(mine):
            for peer in range(self.world):
                chunk = self.split[peer][0]
                rows = np.flatnonzero(np.isin(chunk, mine))
                if len(rows) and peer != rank:
                    sends[peer] = [rows]
        chunk = self.split[rank][0]
        in_round = np.flatnonzero(self.chunk_round[chunk] == rnd) if len(chunk) else as_int64([])
        receives: dict[int, list[Int64s]] = {}
        if len(in_round):
            readers = self.chunk_reader[chunk[in_round]]
            for reader in np.unique(readers).tolist():
                receives[int(reader)] = [in_round[readers == reader]]
        return ({p: as_int64(r[0]) for p, r in sends.items()}, {p: as_int64(r[0]) for p, r in receives.items()})

    # -- measures ----------------------------------------------------------------------------------------

    def bytes_read(self) -> Int64s:
        """Storage bytes each rank reads."""
        out = np.zeros(self.world, dtype=np.int64)
        np.add.at(out, self.chunk_reader[self.pieces_chunk], self.piece_bytes())
        return out

    def bytes_received(self) -> Int64s:
        """Bytes each rank receives from other ranks."""
        out = np.zeros(self.world, dtype=np.int64)
        for r in range(self.world):
            chunk = self.split[r][0]
            out[r] = int(self.rows_bytes(r)[self.chunk_reader[chunk] != r].sum())
        return out

    def bytes_sent(self) -> Int64s:
        out = np.zeros(self.world, dtype=np.int64)
        for r in range(self.world):
            chunk = self.split[r][0]
            remote = self.chunk_reader[chunk] != r
            np.add.at(out, self.chunk_reader[chunk[remote]], self.rows_bytes(r)[remote])
        return out

    def node_bytes_read(self) -> Int64s:
        per_rank = self.bytes_read()
        out = np.zeros(self.nodes, dtype=np.int64)
        np.add.at(out, np.arange(self.world) // self.ranks_per_node, per_rank)
        return out

    def cross_node(self) -> tuple[Int64s, Int64s]:
        """Bytes each node sends to and receives from other nodes."""
        out_b = np.zeros(self.nodes, dtype=np.int64)
        in_b = np.zeros(self.nodes, dtype=np.int64)
        for r in range(self.world):
            chunk = self.split[r][0]
            reader_node = self.chunk_reader[chunk] // self.ranks_per_node
            remote = reader_node != r // self.ranks_per_node
            nbytes = self.rows_bytes(r)[remote]
            in_b[r // self.ranks_per_node] += int(nbytes.sum())
            np.add.at(out_b, reader_node[remote], nbytes)
        return out_b, in_b

    def request_sizes(self) -> Int64s:
        """Bytes read per chunk (one coalesced request each)."""
        out = np.zeros(len(self.chunk_lo), dtype=np.int64)
        np.add.at(out, self.pieces_chunk, self.piece_bytes())
        return out


def _split_at_chunks(needs: Needs, smap: StorageMap, bounds: Int64s) -> tuple[Int64s, Int64s, Int64s, Int64s]:
    """``needs`` cut at the chunk boundaries ``bounds`` (sorted axis positions, the chunks' starts), as
    ``(chunk, key, start, end)``; every interval lies inside some chunk's range once cut."""
    if not len(needs.key):
        return as_int64([]), as_int64([]), as_int64([]), as_int64([])
    glo, ghi = needs.g_bounds(smap)
    c0 = np.searchsorted(bounds, glo, "right") - 1
    c1 = np.searchsorted(bounds, ghi - 1, "right") - 1
    count = c1 - c0 + 1
    rows = np.repeat(np.arange(len(glo)), count)
    chunk = np.repeat(c0, count) + (np.arange(len(rows)) - np.repeat(np.cumsum(count) - count, count))
    size = smap.itemsize[needs.key[rows]]
    base = smap.g0[needs.key[rows]]
    lo = np.maximum(glo[rows], bounds[chunk])
    nxt = np.append(bounds, np.iinfo(np.int64).max)[chunk + 1]
    hi = np.minimum(ghi[rows], nxt)
    return as_int64(chunk), as_int64(needs.key[rows]), as_int64((lo - base) // size), as_int64((hi - base) // size)


def _holder_cuts(union: Needs, needs: Sequence[Needs], smap: StorageMap, min_run: int) -> Int64s:
    """Axis positions where the set of ranks needing the bytes changes and both sides are runs of at least
    ``min_run`` bytes with one holder set: cutting a chunk there lets a rank that needs a run read it (no send),
    while a strided layout (a column slice changes holders every row) stays in large chunks."""
    points = [np.concatenate(n.g_bounds(smap)) for n in needs if len(n.key)]
    if not points:
        return as_int64([])
    edges = np.unique(np.concatenate(points))
    if len(edges) < 2:
        return as_int64([])
    seg_lo, seg_hi = edges[:-1], edges[1:]
    signature = np.zeros(len(seg_lo), dtype=np.uint64)
    for r, n in enumerate(needs):
        if not len(n.key):
            continue
        lo, hi = n.g_bounds(smap)
        a = np.searchsorted(seg_lo, lo, "left")
        b = np.searchsorted(seg_lo, hi, "left")
        cover = np.zeros(len(seg_lo) + 1, dtype=np.int64)
        np.add.at(cover, a, 1)
        np.add.at(cover, b, -1)
        held = np.cumsum(cover[:-1]) > 0
        signature[held] ^= np.uint64((r * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & 0xFFFFFFFFFFFFFFFF)
    live = signature != 0
    seg_lo, seg_hi, signature = seg_lo[live], seg_hi[live], signature[live]
    if not len(seg_lo):
        return as_int64([])
    change = np.flatnonzero(signature[1:] != signature[:-1]) + 1
    run_first = np.concatenate([[0], change])
    run_last = np.concatenate([change, [len(seg_lo)]]) - 1
    run_bytes = np.add.reduceat(seg_hi - seg_lo, run_first)
    big = run_bytes >= min_run
    cuts = [int(seg_lo[run_first[i]]) for i in range(1, len(run_first)) if big[i] and big[i - 1]]
    del run_last, union
    return as_int64(cuts)


def _chunk_bounds(union: Needs, smap: StorageMap, chunk_bytes: int, cuts: Int64s | None = None) -> Int64s:
    """Chunk starts on the axis: a new chunk at each file start, at each of ``cuts`` (holder changes), and
    wherever the current one would pass ``chunk_bytes`` of needed data; cuts fall on element boundaries of the
    tensor they cut."""
    glo, ghi = union.g_bounds(smap)
    file_of = smap.file_of[union.key]
    forced = sorted(set(cuts.tolist())) if cuts is not None else []
    starts: list[int] = []
    filled = 0
    current_file = -1
    f_i = 0
    for i in range(len(glo)):
        lo, hi, f = int(glo[i]), int(ghi[i]), int(file_of[i])
        size = int(smap.itemsize[union.key[i]])
        base = int(smap.g0[union.key[i]])
        if f != current_file or filled >= chunk_bytes:
            starts.append(lo)
            filled = 0
            current_file = f
        while f_i < len(forced) and forced[f_i] <= lo:
            if forced[f_i] == lo and starts[-1] != lo:
                starts.append(lo)
                filled = 0
            f_i += 1
        while True:
            nxt_forced = forced[f_i] if f_i < len(forced) and forced[f_i] < hi else None
            limit = lo + max(chunk_bytes - filled, size)
            if nxt_forced is not None and nxt_forced <= limit:
                cut = nxt_forced
                f_i += 1
            elif filled + (hi - lo) > chunk_bytes:
                cut = base + (limit - base) // size * size
            else:
                break
            if cut <= lo:
                cut = lo + size
            if cut >= hi:
                break
            starts.append(cut)
            lo, filled = cut, 0
        filled += hi - lo
    return as_int64(sorted(set(starts)))


def _choose_readers(holders: list[Int64s], sizes: Int64s, world: int, ranks_per_node: int, slack: float) -> Int64s:
    """One reader per chunk, largest chunks first: the holder on the least-loaded node (then the least-loaded
    rank, then the lowest); when every holder's node is more than ``slack`` x the ideal per-node share above the
    least-loaded node, that node's least-loaded rank reads it instead (one more send, better balance)."""
    nodes = -(-world // ranks_per_node)
    node_load = np.zeros(nodes, dtype=np.int64)
    rank_load = np.zeros(world, dtype=np.int64)
    reader = np.full(len(sizes), -1, dtype=np.int64)
    share = max(1.0, float(sizes.sum()) / nodes)
    for c in np.lexsort((np.arange(len(sizes)), -sizes)).tolist():
        h = holders[c]
        size = int(sizes[c])
        if not len(h):
            continue
        hn = h // ranks_per_node
        best = int(h[np.lexsort((h, rank_load[h], node_load[hn]))[0]])
        low_node = int(np.argmin(node_load))
        if node_load[best // ranks_per_node] - node_load[low_node] > slack * share + size:
            members = np.arange(low_node * ranks_per_node, min(world, (low_node + 1) * ranks_per_node))
            best = int(members[np.lexsort((members, rank_load[members]))[0]])
        reader[c] = best
        node_load[best // ranks_per_node] += size
        rank_load[best] += size
    return reader


def _rounds(plan: JobPlan, sizes: Int64s, budget: int) -> Int64s:
    """Rounds in axis order: a round closes before a chunk that would take some rank past ``budget`` bytes
    (its reads + sends + receives in the round); a chunk alone over the budget is a round of its own."""
    n = len(sizes)
    per_rank_chunk: list[dict[int, int]] = [{} for _ in range(n)]
    for r in range(plan.world):
        chunk = plan.split[r][0]
        if not len(chunk):
            continue
        nbytes = plan.rows_bytes(r)
        totals = np.zeros(n, dtype=np.int64)
        np.add.at(totals, chunk, nbytes)
        for c in np.flatnonzero(totals).tolist():
            reader = int(plan.chunk_reader[c])
            amount = int(totals[c])
            if reader != r:  # received by r, sent by the reader
                per_rank_chunk[c][r] = per_rank_chunk[c].get(r, 0) + amount
                per_rank_chunk[c][reader] = per_rank_chunk[c].get(reader, 0) + amount
    out = np.zeros(n, dtype=np.int64)
    used: dict[int, int] = {}
    rnd = 0
    for c in range(n):
        cost = dict(per_rank_chunk[c])
        reader = int(plan.chunk_reader[c])
        cost[reader] = cost.get(reader, 0) + int(sizes[c])
        if used and any(used.get(r, 0) + b > budget for r, b in cost.items()):
            rnd += 1
            used = {}
        for r, b in cost.items():
            used[r] = used.get(r, 0) + b
        out[c] = rnd
    return out


def plan_job(
    needs: Sequence[Needs],
    smap: StorageMap,
    *,
    ranks_per_node: int,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
    slack: float = 0.05,
) -> JobPlan:
    """The job-wide plan for ``needs`` (one per rank, in rank order); see the module docstring."""
    world = len(needs)
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be at least 1, got {ranks_per_node}")
    chunk_bytes = max(1, min(chunk_bytes, budget_bytes // 4 or 1))
    if world:
        union = merge_needs(smap, *(np.concatenate([getattr(n, f) for n in needs]) for f in ("key", "start", "end")))
    else:
        union = Needs.empty()
    nodes = -(-world // ranks_per_node) if world else 1
    # chunks small enough that each node's share is many chunks (balance), never below MIN_CHUNK_BYTES
    chunk_bytes = min(chunk_bytes, max(MIN_CHUNK_BYTES, union.nbytes(smap) // (8 * nodes)))
    cuts = _holder_cuts(union, needs, smap, max(1, chunk_bytes // 4))
    bounds = _chunk_bounds(union, smap, chunk_bytes, cuts)
    pc, pk, ps, pe = _split_at_chunks(union, smap, bounds)
    split = [_split_at_chunks(n, smap, bounds) for n in needs]
    nchunks = len(bounds)
    sizes = np.zeros(nchunks, dtype=np.int64)
    np.add.at(sizes, pc, (pe - ps) * smap.itemsize[pk])
    holder_lists: list[list[int]] = [[] for _ in range(nchunks)]
    for r, (chunk, *_rest) in enumerate(split):
        for c in np.unique(chunk).tolist():
            holder_lists[c].append(r)
    holders = [as_int64(h) for h in holder_lists]
    reader = _choose_readers(holders, sizes, world, ranks_per_node, slack)
    hi = np.append(bounds[1:], bounds[-1] if nchunks else 0)
    if nchunks:  # each chunk ends at its last piece's end
        last_piece = np.searchsorted(pc, np.arange(nchunks), "right") - 1
        hi = smap.g0[pk[last_piece]] + pe[last_piece] * smap.itemsize[pk[last_piece]]
    plan = JobPlan(
        world=world,
        ranks_per_node=ranks_per_node,
        smap=smap,
        needs=list(needs),
        chunk_lo=bounds,
        chunk_hi=as_int64(hi),
        chunk_reader=reader,
        chunk_round=np.zeros(nchunks, dtype=np.int64),
        rounds=0,
        pieces_chunk=pc,
        pieces_key=pk,
        pieces_start=ps,
        pieces_end=pe,
        split=split,
        budget_bytes=budget_bytes,
        chunk_bytes=chunk_bytes,
    )
    plan.chunk_round = _rounds(plan, sizes, budget_bytes)
    plan.rounds = int(plan.chunk_round.max()) + 1 if nchunks else 0
    h = hashlib.blake2b(digest_size=16)
    h.update(smap.digest().encode())
    h.update(f"{world}/{ranks_per_node}/{chunk_bytes}/{budget_bytes}".encode())
    for array in (plan.chunk_lo, plan.chunk_reader, plan.chunk_round, pc, pk, ps, pe):
        h.update(array.tobytes())
    for n in needs:
        for array in (n.key, n.start, n.end):
            h.update(array.tobytes())
    plan.digest = h.hexdigest()
    return plan
