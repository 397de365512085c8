"""The job-wide plan: every checkpoint byte any rank needs is read from storage once per job, by one reader
rank, and each rank is sent exactly the bytes its own read items touch.

Owns ``plan_job``: all ranks' needs (``planning.jobneeds``) -> ``JobPlan``: the union cut into chunks (large
coalesced read requests that never cross a file, cut where the set of ranks needing the bytes changes), one
reader per chunk (a rank that needs it where that keeps the nodes' read bytes balanced, else the least-loaded
node's least-loaded rank), rounds that keep each rank's staging and message memory within a budget, and per
round the messages ``reader -> receiver`` (the receiver's intervals within the reader's chunks, in axis
order). Deterministic: every rank computes the same plan from the same needs, and ``JobPlan.digest`` is the one
value the ranks compare. Pure: no process group, no bytes.

What it does not own: planning a rank (``planning.front.plan``), the cost model (``jobcost``), moving bytes
(``execute.deliver``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hp_fastload.errors import PlanError
from hp_fastload.planning.jobneeds import (
    Int64s,
    Needs,
    NeedsByRank,
    StorageMap,
    as_int64,
    needs_of_pieces,
    sorted_pieces,
    split_at_bounds,
)

FIELDS = ("key", "start", "end")

__all__ = ["DEFAULT_BUDGET_BYTES", "DEFAULT_CHUNK_BYTES", "MIN_CHUNK_BYTES", "JobPlan", "plan_job"]

#: Target size of one read request (a chunk): Run:ai's object-store default is 8 MiB, Orbax uses 128 MiB.
DEFAULT_CHUNK_BYTES = 32 << 20
#: The smallest chunk ``plan_job`` cuts for balance's sake (smaller tensors still make smaller pieces).
MIN_CHUNK_BYTES = 4096
#: A run of bytes with one set of holders at least this long (or a quarter chunk, if less) becomes a chunk of
#: its own, read by a holder: below it, runs stay inside larger chunks and their bytes are sent. An FSDP shard
#: cut by the checkpoint's key order into pieces of a few MiB (expert tensors sorted 0, 1, 10, 11, ..., 2) is
#: still read by its owner; a column slice (holders change every row) stays in large requests.
HOLDER_RUN_BYTES = 4 << 20
#: Per-rank memory of one round: chunks read (staging) + messages sent + messages received.
DEFAULT_BUDGET_BYTES = 512 << 20
#: ``JobPlan._self_read_rows`` marks the shared (tensor, rank) pairs in a dense table up to this many pairs.
DENSE_PAIRS = 1 << 27


@dataclass(eq=False, frozen=True)
class JobPlan:
    """The job-wide plan (see the module docstring). Per chunk ``c``: its axis range ``[chunk_lo, chunk_hi)``,
    its reader, its round. ``pieces_*``: what the reader reads, the union of every rank's needs within each
    chunk (per tensor: ``(chunk, key, element start, element end)``). ``rows_*``: every rank's needs cut at
    chunk boundaries, ``(rank, chunk, key, start, end)`` sorted by rank, then in axis order; ``split[r]`` is
    rank ``r``'s stretch of them, ``(chunk, key, start, end)``: the rows it receives."""

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
    rows_rank: Int64s
    rows_chunk: Int64s
    rows_key: Int64s
    rows_start: Int64s
    rows_end: Int64s
    rank_bounds: Int64s
    budget_bytes: int
    chunk_bytes: int
    digest: str = ""
    split: list[tuple[Int64s, Int64s, Int64s, Int64s]] = field(init=False, repr=False, compare=False)
    #: each rank's sends, made on first ask (``messages``): a memo, not part of the plan
    _sends: dict[int, tuple[Int64s, Int64s, Int64s]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        b = self.rank_bounds.tolist()
        split = [
            (
                self.rows_chunk[b[r] : b[r + 1]],
                self.rows_key[b[r] : b[r + 1]],
                self.rows_start[b[r] : b[r + 1]],
                self.rows_end[b[r] : b[r + 1]],
            )
            for r in range(self.world)
        ]
        object.__setattr__(self, "split", split)

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

    def rows_bytes(self, rank: int | None = None) -> Int64s:
        """Bytes of each row of ``split[rank]`` (of every rank's rows when ``rank`` is None)."""
        if rank is None:
            return (self.rows_end - self.rows_start) * self.smap.itemsize[self.rows_key]
        _chunk, key, start, end = self.split[rank]
        return (end - start) * self.smap.itemsize[key]

    def messages(self, rank: int, rnd: int) -> tuple[dict[int, Int64s], dict[int, Int64s]]:
        """Round ``rnd``'s messages of ``rank``: ``(sends, receives)``, each ``peer -> rows`` (of the peer's
        ``split`` for sends, of this rank's for receives), in axis order; a rank's own chunks appear in its
        receives under its own number (copied, not sent)."""
        sent = self._sends.get(rank)
        if sent is None:  # every row this rank sends, once: (round, peer, row within the peer's split)
            rows = np.flatnonzero((self.chunk_reader[self.rows_chunk] == rank) & (self.rows_rank != rank))
            peers = self.rows_rank[rows]
            sent = self._sends[rank] = (self.chunk_round[self.rows_chunk[rows]], peers, rows - self.rank_bounds[peers])
        in_rnd = np.flatnonzero(sent[0] == rnd)
        sends: dict[int, Int64s] = {}
        if len(in_rnd):
            peers, positions = sent[1][in_rnd], sent[2][in_rnd]
            for peer in np.unique(peers).tolist():
                sends[int(peer)] = as_int64(positions[peers == peer])
        chunk = self.split[rank][0]
        in_round = np.flatnonzero(self.chunk_round[chunk] == rnd) if len(chunk) else as_int64([])
        receives: dict[int, Int64s] = {}
        if len(in_round):
            readers = self.chunk_reader[chunk[in_round]]
            for reader in np.unique(readers).tolist():
                receives[int(reader)] = as_int64(in_round[readers == reader])
        return sends, receives

    # -- measures ----------------------------------------------------------------------------------------

    def _remote(self) -> tuple[Int64s, Int64s, Int64s]:
        """Rows received from another rank: ``(receiver, reader, bytes)``."""
        reader = self.chunk_reader[self.rows_chunk]
        remote = reader != self.rows_rank
        return self.rows_rank[remote], reader[remote], self.rows_bytes()[remote]

    def _per(self, index: Int64s, weights: Int64s, size: int) -> Int64s:
        out = np.zeros(size, dtype=np.int64)
        np.add.at(out, index, weights)
        return out

    def bytes_read(self) -> Int64s:
        """Storage bytes each rank reads."""
        return self._per(self.chunk_reader[self.pieces_chunk], self.piece_bytes(), self.world)

    def bytes_received(self) -> Int64s:
        """Bytes each rank receives from other ranks."""
        receiver, _, nbytes = self._remote()
        return self._per(receiver, nbytes, self.world)

    def bytes_sent(self) -> Int64s:
        _, reader, nbytes = self._remote()
        return self._per(reader, nbytes, self.world)

    def _grouping(self, per: int | None) -> tuple[int, int]:
        """``(ranks per group, groups)``: the plan's nodes, or hosts of ``per`` ranks."""
        per = per or self.ranks_per_node
        return per, -(-self.world // per)

    def node_bytes_read(self, per: int | None = None) -> Int64s:
        """Storage bytes each node reads (``per``: group the ranks ``per`` to a host instead of the plan's nodes)."""
        per, groups = self._grouping(per)
        return self._per(np.arange(self.world) // per, self.bytes_read(), groups)

    def cross_node(self, per: int | None = None) -> tuple[Int64s, Int64s]:
        """Bytes each node sends to and receives from other nodes."""
        per, groups = self._grouping(per)
        receiver, reader, nbytes = self._remote()
        rn, sn = receiver // per, reader // per
        across = rn != sn
        return self._per(sn[across], nbytes[across], groups), self._per(rn[across], nbytes[across], groups)

    def _self_read_rows(self) -> np.ndarray:
        """Per row of ``split``: its rank reads it itself and the rank's pairing with the row's tensor is
        private (every byte of that tensor the rank needs it reads itself, and it reads none of that tensor for
        another rank). The shared (tensor, rank) pairs are flags in one dense table when it is small (tensors x
        ranks up to ``DENSE_PAIRS``), else a sorted set (``np.isin``: seconds at millions of rows)."""
        reader = self.chunk_reader[self.rows_chunk]
        world = max(1, self.world)
        pair = self.rows_key * world + self.rows_rank
        remote = reader != self.rows_rank
        others = self.rows_key[remote] * world + reader[remote]
        size = len(self.smap.keys) * world
        if size <= DENSE_PAIRS:
            shared = np.zeros(size, dtype=bool)
            shared[pair[remote]] = True
            shared[others] = True
            return ~shared[pair]
        return ~np.isin(pair, np.union1d(pair[remote], others))

    def self_read_keys(self, rank: int) -> set[int]:
        """Tensors ``rank`` reads for itself alone: it reads every byte of them it needs, and sends none of them
        (``deliver`` runs their items straight from the file, not from memory). From this rank's rows and the
        rows of the chunks it reads (``_self_read_rows``' rule for one rank, without every rank's pairs)."""
        b0, b1 = int(self.rank_bounds[rank]), int(self.rank_bounds[rank + 1])
        keys = self.rows_key[b0:b1]
        received = self.chunk_reader[self.rows_chunk[b0:b1]] != rank
        sent = (self.chunk_reader[self.rows_chunk] == rank) & (self.rows_rank != rank)
        shared = np.union1d(keys[received], self.rows_key[sent])
        return set(np.setdiff1d(keys, shared).tolist())

    def bytes_through_memory(self) -> Int64s:
        """Per rank, the needed bytes that go through host memory (received, or read for itself beside bytes
        it sends): all but those of ``self_read_keys``."""
        return self._per(self.rows_rank, self.rows_bytes() * ~self._self_read_rows(), self.world)

    def intra_node(self, per: int | None = None) -> Int64s:
        """Bytes each node's ranks send to ranks of the same node."""
        per, groups = self._grouping(per)
        receiver, reader, nbytes = self._remote()
        node = reader // per
        inside = node == receiver // per
        return self._per(node[inside], nbytes[inside], groups)

    def request_sizes(self) -> Int64s:
        """Bytes of each read request: a reader's chunks of one round are read in one engine call, in which
        chunks that touch in one file make one request."""
        per_chunk = self._per(self.pieces_chunk, self.piece_bytes(), len(self.chunk_lo))
        if len(per_chunk) < 2:
            return per_chunk
        file = np.searchsorted(self.smap.file_g0, self.chunk_lo, "right")
        order = np.lexsort((self.chunk_lo, self.chunk_round, self.chunk_reader))
        joins = (
            (self.chunk_lo[order[1:]] == self.chunk_hi[order[:-1]])
            & (self.chunk_reader[order[1:]] == self.chunk_reader[order[:-1]])
            & (self.chunk_round[order[1:]] == self.chunk_round[order[:-1]])
            & (file[order[1:]] == file[order[:-1]])
        )
        firsts = np.flatnonzero(np.concatenate([[True], ~joins]))
        return as_int64(np.add.reduceat(per_chunk[order], firsts))


#: Events merged at a time by ``_holder_cuts`` (bounded temporaries, reused between blocks).
EVENT_BLOCK = 1 << 18
_HASH_MUL, _HASH_ADD = np.uint64(0x9E3779B97F4A7C15), np.uint64(0x632BE59BD9B4E019)


def _holder_cuts(starts: Int64s, ends: Int64s, rbits: int, min_run: int) -> Int64s:
    """Axis positions where the set of ranks needing the bytes changes and both sides are runs of at least
    ``min_run`` bytes with one holder set: cutting a chunk there lets a rank that needs a run read it (no send),
    while a strided layout (a column slice changes holders every row) stays in large chunks.

    ``starts``, ``ends``: every rank's intervals (disjoint within a rank), packed and sorted as ``_events``
    makes them. Merged in position order (a block of positions at a time), the running XOR of the events'
    rank hashes is the holder set's signature of each segment between event positions (the XOR up to a
    position does not depend on the order of the events at it)."""
    if not len(starts):
        return as_int64([])
    shift = rbits + 1
    # blocks of the axis, each starting at the position of every EVENT_BLOCK-th start: a position's events
    # all fall in one block
    firsts = np.unique(starts[EVENT_BLOCK::EVENT_BLOCK] >> shift) << shift
    s_at = [0, *np.searchsorted(starts, firsts).tolist(), len(starts)]
    e_at = [0, *np.searchsorted(ends, firsts).tolist(), len(ends)]
    edge_parts, signature_parts = [], []
    carry = np.uint64(0)
    for j in range(len(s_at) - 1):
        events = np.concatenate([starts[s_at[j] : s_at[j + 1]], ends[e_at[j] : e_at[j + 1]]])
        if not len(events):
            continue
        events.sort(kind="stable")  # two sorted runs: one merge
        acc = (events >> 1).view(np.uint64)  # each event's rank hash, then the running XOR (in place)
        acc &= np.uint64((1 << rbits) - 1)
        acc *= _HASH_MUL
        acc += _HASH_ADD
        acc[0] ^= carry
        np.bitwise_xor.accumulate(acc, out=acc)
        carry = acc[-1]
        events >>= shift
        last = np.flatnonzero(np.append(events[1:] != events[:-1], True))  # the last event at each position
        edge_parts.append(events[last])
        signature_parts.append(acc[last])
    edges, signature = np.concatenate(edge_parts), np.concatenate(signature_parts)
    if len(edges) < 2:
        return as_int64([])
    seg_lo, seg_hi, signature = edges[:-1], edges[1:], signature[:-1]
    live = signature != 0
    seg_lo, seg_hi, signature = seg_lo[live], seg_hi[live], signature[live]
    if not len(seg_lo):
        return as_int64([])
    change = np.flatnonzero(signature[1:] != signature[:-1]) + 1
    run_first = np.concatenate([[0], change]).astype(np.int64)
    run_bytes = np.add.reduceat(seg_hi - seg_lo, run_first)
    big = run_bytes >= min_run
    return as_int64(seg_lo[run_first[1:][big[1:] & big[:-1]]])


def _events(rank: Int64s, glo: Int64s, ghi: Int64s, world: int) -> tuple[Int64s, Int64s, int]:
    """Every rank's intervals ``[glo, ghi)`` as sorted values, packed ``position << (b + 1) | rank << 1 | end``
    (``b`` bits hold a rank): ``(sorted starts, sorted ends, b)``. Sorting packed values, not the rows: no
    permutation is gathered."""
    rbits = max(1, (max(world, 1) - 1).bit_length())
    top = int(ghi.max()) if len(ghi) else 0
    if top.bit_length() + rbits + 1 > 63:
        raise PlanError(f"a checkpoint of {top} bytes on {world} ranks is past the job plan's axis")
    tag = rank << 1
    starts = glo << (rbits + 1)
    starts |= tag
    starts.sort(kind="stable")
    ends = ghi << (rbits + 1)
    ends |= tag
    ends |= 1
    ends.sort(kind="stable")
    return starts, ends, rbits


def _chunk_bounds(union: Needs, smap: StorageMap, chunk_bytes: int, cuts: Int64s | None = None) -> Int64s:
    """Chunk starts on the axis: a new chunk at each file start, at each of ``cuts`` (holder changes), and
    wherever the current one would pass ``chunk_bytes`` of needed data; cuts fall on element boundaries of the
    tensor they cut."""
    glo, ghi = union.g_bounds(smap)
    forced = sorted(set(cuts.tolist())) if cuts is not None else []
    starts: list[int] = []
    filled = 0
    current_file = -1
    f_i = 0
    # one pass over the union's rows as Python ints (a numpy scalar per row and column cost 5x the loop)
    columns = (glo, ghi, smap.file_of[union.key], smap.itemsize[union.key], smap.g0[union.key])
    for lo, hi, f, size, base in zip(*(c.tolist() for c in columns), strict=True):
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


def _choose_readers(
    holders: Int64s, offsets: Int64s, sizes: Int64s, world: int, ranks_per_node: int, slack: float
) -> Int64s:
    """One reader per chunk, in two passes. First, largest chunks first, a holder: the one on the least-loaded
    node (then the least-loaded rank, then the lowest), so a layout that already spreads its bytes over the
    nodes (FSDP, and every replicated chunk going to its least-loaded holder) sends nothing. Then, while some
    node reads more than ``1 + slack`` x the mean, its chunks (largest first) move to the least-loaded node when
    they fit there under that limit: to a holder on that node if there is one, else to its least-loaded rank
    (one more send, better balance). ``holders[offsets[c] : offsets[c + 1]]``: the ranks that need chunk ``c``,
    ascending."""
    nodes = -(-world // ranks_per_node)
    node_load = np.zeros(nodes, dtype=np.int64)
    rank_load = np.zeros(world, dtype=np.int64)
    reader = np.full(len(sizes), -1, dtype=np.int64)
    bounds = offsets.tolist()
    order = np.lexsort((np.arange(len(sizes)), -sizes)).tolist()
    for c in order:
        a, b = bounds[c], bounds[c + 1]
        if a == b:
            continue
        if b - a == 1:
            best = int(holders[a])
        else:
            h = holders[a:b]
            best = int(h[np.lexsort((h, rank_load[h], node_load[h // ranks_per_node]))[0]])
        reader[c] = best
        node_load[best // ranks_per_node] += int(sizes[c])
        rank_load[best] += int(sizes[c])
    limit = (1.0 + slack) * float(node_load.sum()) / nodes
    if nodes < 2 or node_load.max() <= limit:
        return reader
    for c in order:
        best = int(reader[c])
        if best < 0 or node_load[best // ranks_per_node] <= limit:
            continue
        size, low = int(sizes[c]), int(np.argmin(node_load))
        if node_load[low] + size > limit:
            continue
        h = holders[bounds[c] : bounds[c + 1]]
        members = h[h // ranks_per_node == low]
        if not len(members):
            members = np.arange(low * ranks_per_node, min(world, (low + 1) * ranks_per_node))
        moved = int(members[np.lexsort((members, rank_load[members]))[0]])
        reader[c] = moved
        node_load[best // ranks_per_node] -= size
        rank_load[best] -= size
        node_load[low] += size
        rank_load[moved] += size
        if node_load.max() <= limit:
            break
    return reader


def _rounds(
    reader: Int64s, sizes: Int64s, pair_chunk: Int64s, pair_rank: Int64s, pair_bytes: Int64s, world: int, budget: int
) -> Int64s:
    """Rounds in axis order: a round closes before a chunk that would take some rank past ``budget`` bytes
    (its reads + sends + receives in the round); a chunk alone over the budget is a round of its own.
    ``pair_*``: the bytes each rank needs of each chunk, sorted by chunk (each rank once per chunk)."""
    n = len(sizes)
    remote = pair_rank != reader[pair_chunk]
    sent = np.zeros(n, dtype=np.int64)
    np.add.at(sent, pair_chunk[remote], pair_bytes[remote])
    # per chunk: the receivers' costs, then the reader's (its read and its sends)
    cost_chunk = np.concatenate([pair_chunk[remote], np.arange(n, dtype=np.int64)])
    cost_rank = np.concatenate([pair_rank[remote], reader])
    cost_bytes = np.concatenate([pair_bytes[remote], sizes + sent])
    order = np.argsort(cost_chunk, kind="stable")
    cost_rank, cost_bytes, cost_chunk_sorted = cost_rank[order], cost_bytes[order], cost_chunk[order]
    bounds = np.searchsorted(cost_chunk_sorted, np.arange(n + 1))
    out = np.zeros(n, dtype=np.int64)
    # A round from chunk ``first`` ends at the first later chunk at which some rank's total since ``first``
    # passes the budget (as adding one chunk at a time): per-rank running totals over a window of chunks (one
    # stable sort by rank), the window doubled until it holds the round's end.
    first, rnd, width = 0, 0, 16
    while first < n:
        stop = min(n, first + width)
        a, b = int(bounds[first]), int(bounds[stop])
        ranks, costs = cost_rank[a:b], cost_bytes[a:b]
        order = np.argsort(ranks.astype(np.uint16) if world <= 1 << 16 else ranks, kind="stable")  # 16 bits: radix
        running = np.cumsum(costs[order])
        sorted_ranks = ranks[order]
        starts = np.flatnonzero(np.concatenate([[True], sorted_ranks[1:] != sorted_ranks[:-1]]))
        before = np.repeat(np.concatenate([[0], running[starts[1:] - 1]]), np.diff(np.append(starts, len(order))))
        over = order[running - before > budget] + a  # pairs whose rank's total passes the budget there
        chunks = cost_chunk_sorted[over]
        chunks = chunks[chunks > first]
        if len(chunks):
            end = int(chunks.min())
        elif stop == n:
            end = n
        else:
            width *= 2
            continue
        out[first:end] = rnd
        rnd += 1
        width = max(16, (end - first) * 5 // 4)
        first = end
    return out


def _pairs(rank: Int64s, chunk: Int64s, nbytes: Int64s, world: int, nchunks: int) -> tuple[Int64s, Int64s, Int64s]:
    """Each rank's bytes of each chunk, ``(chunk, rank, bytes)`` sorted by chunk then rank (each pair once),
    from rows sorted by rank then chunk (a rank's needs in axis order, cut at chunk bounds): the pairs are
    the runs of equal (rank, chunk), then one stable sort by chunk."""
    if not len(rank):
        return as_int64([]), as_int64([]), as_int64([])
    pair = rank * max(nchunks, 1) + chunk
    if not bool((pair[1:] >= pair[:-1]).all()):  # rows out of order: sort them (the same pairs)
        order = np.argsort(pair, kind="stable")
        rank, chunk, nbytes, pair = rank[order], chunk[order], nbytes[order], pair[order]
    first = np.flatnonzero(np.concatenate([[True], pair[1:] != pair[:-1]]))
    pair_bytes = np.add.reduceat(nbytes, first)
    pair_rank, pair_chunk = rank[first], chunk[first]
    by_chunk = np.argsort(pair_chunk, kind="stable")
    return as_int64(pair_chunk[by_chunk]), as_int64(pair_rank[by_chunk]), as_int64(pair_bytes[by_chunk])


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
    counts = [len(n.key) for n in needs]
    rank = np.repeat(np.arange(world, dtype=np.int64), counts)
    flat = needs.intact() if isinstance(needs, NeedsByRank) else None
    if flat is not None:  # every rank's rows already in one set of arrays
        key, start, end = flat.key, flat.start, flat.end
    else:
        key, start, end = (as_int64(np.concatenate([getattr(n, f) for n in needs]) if world else []) for f in FIELDS)
    glo, ghi = Needs(key, start, end).g_bounds(smap)
    # one sort of the starts and one of the ends (values, rank packed in): the union and the holder events
    live = ghi > glo
    every = bool(live.all())
    starts, ends, rbits = _events(
        rank if every else rank[live], glo if every else glo[live], ghi if every else ghi[live], world
    )
    del live
    union = (
        needs_of_pieces(smap, *sorted_pieces(starts >> rbits + 1, ends >> rbits + 1))[1]
        if len(starts)
        else Needs.empty()
    )
    nodes = -(-world // ranks_per_node) if world else 1
    # chunks small enough that each node's share is many chunks (balance), never below MIN_CHUNK_BYTES
    chunk_bytes = min(chunk_bytes, max(MIN_CHUNK_BYTES, union.nbytes(smap) // (8 * nodes)))
    cuts = _holder_cuts(starts, ends, rbits, max(1, min(HOLDER_RUN_BYTES, chunk_bytes // 4)))
    del starts, ends
    bounds = _chunk_bounds(union, smap, chunk_bytes, cuts)
    pc, pk, ps, pe = split_at_bounds(smap, bounds, union.key, union.start, union.end)
    rc, rk, rs, re_, rr = split_at_bounds(smap, bounds, key, start, end, rank, axis=(glo, ghi))
    del glo, ghi
    nchunks = len(bounds)
    sizes = np.zeros(nchunks, dtype=np.int64)
    np.add.at(sizes, pc, (pe - ps) * smap.itemsize[pk])
    pair_chunk, pair_rank, pair_bytes = _pairs(rr, rc, (re_ - rs) * smap.itemsize[rk], world, nchunks)
    offsets = as_int64(np.searchsorted(pair_chunk, np.arange(nchunks + 1)))
    reader = _choose_readers(pair_rank, offsets, sizes, world, ranks_per_node, slack)
    hi = np.append(bounds[1:], bounds[-1] if nchunks else 0)
    if nchunks:  # each chunk ends at its last piece's end
        last_piece = np.searchsorted(pc, np.arange(nchunks), "right") - 1
        hi = smap.g0[pk[last_piece]] + pe[last_piece] * smap.itemsize[pk[last_piece]]
    chunk_round = _rounds(reader, sizes, pair_chunk, pair_rank, pair_bytes, world, budget_bytes)
    h = hashlib.blake2b(digest_size=16)
    h.update(smap.digest().encode())
    h.update(f"{world}/{ranks_per_node}/{chunk_bytes}/{budget_bytes}".encode())
    hashed = (bounds, reader, chunk_round, pc, pk, ps, pe, as_int64(counts), key, start, end)
    for array in hashed:
        h.update(as_int64(array).data)  # the bytes of ``tobytes()``, without a copy
    return JobPlan(
        world=world,
        ranks_per_node=ranks_per_node,
        smap=smap,
        needs=list(needs),
        chunk_lo=bounds,
        chunk_hi=as_int64(hi),
        chunk_reader=reader,
        chunk_round=chunk_round,
        rounds=int(chunk_round.max()) + 1 if nchunks else 0,
        pieces_chunk=pc,
        pieces_key=pk,
        pieces_start=ps,
        pieces_end=pe,
        rows_rank=rr,
        rows_chunk=rc,
        rows_key=rk,
        rows_start=rs,
        rows_end=re_,
        rank_bounds=as_int64(np.searchsorted(rr, np.arange(world + 1))),
        budget_bytes=budget_bytes,
        chunk_bytes=chunk_bytes,
        digest=h.hexdigest(),
    )
