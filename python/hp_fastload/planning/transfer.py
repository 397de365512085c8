"""The transfer plan between two live models, in the checkpoint's coordinates: the source side's save plan and the
destination side's load plan intersected region by region (``hf.transfer``).

Owns: each rank's side as ``Runs`` (the exact runs of elements of checkpoint tensors that one of its local shards
holds or needs, each contiguous both in the flat checkpoint tensor and in the shard), the layout check of two
models' released tensors (names, shapes, dtypes), and ``plan_transfer``: every destination run split at the
boundaries of the source holdings, one holder chosen per piece (the destination rank itself when it holds the
piece, else a replica chosen by rotation), the pieces cut into rounds that fit a staging window, and grouped
into messages (one packed message per sender, receiver and round; pieces of at least ``direct_bytes`` sent
from the source shard straight into the destination shard). Pure: arrays only, no process group, no bytes.
Sending and receiving is ``execute.transfer``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hp_fastload.errors import PlanError, TargetError, shown_key
from hp_fastload.planning.items import LoadPlan

__all__ = [
    "ALIGN",
    "LayoutFacts",
    "Runs",
    "TransferPlan",
    "check_layouts",
    "plan_transfer",
    "runs_of_plan",
]

Int64s = np.ndarray[Any, np.dtype[np.int64]]

#: Every checkpoint tensor starts on this byte boundary of the plan's axis, and every key's pieces start on it in
#: a packed message: a typed view of any dtype up to 16 bytes is aligned.
ALIGN = 16

#: One released tensor: (key, shape, dtype name as torch prints it, bytes per element).
LayoutFacts = tuple[tuple[str, tuple[int, ...], str, int], ...]


def _i64(values: Any) -> Int64s:
    return np.ascontiguousarray(values, dtype=np.int64)


def check_layouts(sources: Sequence[LayoutFacts | None], destinations: Sequence[LayoutFacts | None]) -> LayoutFacts:
    """The one released layout both sides share (sorted by key: the order a model lists its tensors in does not
    matter), from every rank's view of its source and destination models (None where a rank holds none).
    ``TargetError`` naming the tensor and the dimension (or the dtype) where two ranks' sources, two ranks'
    destinations, or the sources and the destinations disagree; where one side has a tensor the other lacks;
    where a side has no rank at all."""
    src = [(r, tuple(sorted(f))) for r, f in enumerate(sources) if f is not None]
    dst = [(r, tuple(sorted(f))) for r, f in enumerate(destinations) if f is not None]
    if not src or not dst:
        raise TargetError(
            "hf.transfer needs a source model on some rank and a destination model on some rank "
            f"(source on ranks {[r for r, _ in src]}, destination on ranks {[r for r, _ in dst]})"
        )
    first_rank, first = src[0]
    for side, ranks in (("source", src), ("destination", dst)):
        for rank, facts in ranks:
            _compare(first, facts, f"the source on rank {first_rank}", f"the {side} on rank {rank}")
    return first


def _compare(a: LayoutFacts, b: LayoutFacts, a_name: str, b_name: str) -> None:
    if a == b:
        return
    by_key_a = {f[0]: f for f in a}
    by_key_b = {f[0]: f for f in b}
    only_a = [k for k in by_key_a if k not in by_key_b]
    only_b = [k for k in by_key_b if k not in by_key_a]
    if only_a or only_b:
        parts = []
        if only_a:
            parts.append(f"{len(only_a)} tensors only in {a_name} (first: {', '.join(map(shown_key, only_a[:3]))})")
        if only_b:
            parts.append(f"{len(only_b)} tensors only in {b_name} (first: {', '.join(map(shown_key, only_b[:3]))})")
        raise TargetError(f"hf.transfer: the models' checkpoint layouts differ: {'; '.join(parts)}")
    for key, _, dtype_a, _ in a:
        _, shape_a, _, _ = by_key_a[key]
        _, shape_b, dtype_b, _ = by_key_b[key]
        if len(shape_a) != len(shape_b):
            raise TargetError(
                f"hf.transfer: tensor {shown_key(key)} has {len(shape_a)} dims {shape_a} in {a_name} and "
                f"{len(shape_b)} dims {shape_b} in {b_name}"
            )
        for dim, (x, y) in enumerate(zip(shape_a, shape_b, strict=True)):
            if x != y:
                raise TargetError(
                    f"hf.transfer: tensor {shown_key(key)} dimension {dim} is {x} in {a_name} and {y} in {b_name} "
                    f"(shapes {shape_a} and {shape_b})"
                )
        if dtype_a != dtype_b:
            raise TargetError(
                f"hf.transfer: tensor {shown_key(key)} is {dtype_a} in {a_name} and {dtype_b} in {b_name}; cast "
                "one model first (the transfer copies bytes, it does not convert dtypes)"
            )
    raise TargetError(f"hf.transfer: the models' checkpoint layouts differ in their element sizes ({a_name}, {b_name})")


@dataclass(frozen=True, eq=False)
class Runs:
    """One side of one rank: runs of elements, each contiguous in flat checkpoint tensor ``key`` (from element
    ``start``, ``length`` elements) and in the row-major local shard of target ``names[target]`` (from element
    ``local``); sorted by (key, start), disjoint."""

    key: Int64s
    start: Int64s
    length: Int64s
    target: Int64s
    local: Int64s
    names: tuple[str, ...]

    @property
    def spans(self) -> tuple[Int64s, Int64s, Int64s]:
        """``(key, start, length)``: what the other ranks need to know of this side."""
        return self.key, self.start, self.length

    def __len__(self) -> int:
        return len(self.key)


def _row_major(shape: Sequence[int]) -> list[int]:
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * max(int(shape[d + 1]), 1)
    return strides


def _pattern_runs(lengths: Sequence[int], storage: Sequence[int], local: Sequence[int]) -> tuple[Int64s, Int64s, int]:
    """The runs of one box, relative to its bases: ``(storage starts, local starts, run length)``. A dim joins the
    run while it is the next contiguous one on both sides; the other dims enumerate the runs."""
    dims = [(int(s), int(ls), int(n)) for s, ls, n in zip(storage, local, lengths, strict=True) if int(n) != 1]
    if any(n == 0 for _, _, n in dims):
        return _i64([]), _i64([]), 0
    run = 1
    while True:
        inner = [d for d in dims if d[0] == run and d[1] == run]
        if not inner:
            break
        run *= inner[0][2]
        dims.remove(inner[0])
    s_starts = np.zeros(1, dtype=np.int64)
    l_starts = np.zeros(1, dtype=np.int64)
    for s, ls, n in sorted(dims, reverse=True):
        steps = np.arange(n, dtype=np.int64)
        s_starts = (s_starts[:, None] + steps[None, :] * s).reshape(-1)
        l_starts = (l_starts[:, None] + steps[None, :] * ls).reshape(-1)
    return s_starts, l_starts, run


def runs_of_plan(
    plan: LoadPlan, key_id: Mapping[str, int], local_shapes: Mapping[str, tuple[int, ...]]
) -> tuple[Runs, list[str]]:
    """One side's ``Runs`` from its plan against the released layout (``key_id``: key -> number), with the
    targets whose items are no exact copy (an elementwise post-op, a dequantization) or that the plan defers:
    ``(runs, inexact target names)``. ``local_shapes``: each region target's local shard shape."""
    names = tuple(plan.region_reads)
    inexact = [name for name, reads in plan.region_reads.items() if reads.post is not None or reads.second is not None]
    for group in plan.deferred:
        inexact.extend(group.claims.values())
    skip = set(inexact)
    parts: list[tuple[Int64s, ...]] = []
    for t, name in enumerate(names):
        reads = plan.region_reads[name]
        if name in skip or not len(reads):
            continue
        lstrides = _row_major(local_shapes[name])
        keys = _i64([key_id[k] for k in reads.keys])
        patterns: dict[bytes, list[int]] = {}
        packed = np.concatenate([reads.lengths, reads.storage_strides], axis=1)
        for i, row in enumerate(packed):
            patterns.setdefault(row.tobytes(), []).append(i)
        for rows_list in patterns.values():
            rows = _i64(rows_list)
            r0 = rows_list[0]
            rel_s, rel_l, run = _pattern_runs(reads.lengths[r0].tolist(), reads.storage_strides[r0].tolist(), lstrides)
            if run == 0:
                continue
            local_base = reads.dest_offsets[rows] @ _i64(lstrides) if lstrides else np.zeros(len(rows), np.int64)
            starts = (reads.storage_base[rows][:, None] + rel_s[None, :]).reshape(-1)
            local = (local_base[:, None] + rel_l[None, :]).reshape(-1)
            n = len(starts)
            parts.append(
                (np.repeat(keys[rows], len(rel_s)), starts, np.full(n, run, np.int64), np.full(n, t, np.int64), local)
            )
    if not parts:
        empty = _i64([])
        return Runs(empty, empty, empty, empty, empty, names), inexact
    key, start, length, target, local = (np.concatenate(c) for c in zip(*parts, strict=True))
    order = np.lexsort((start, key))
    key, start, length, target, local = key[order], start[order], length[order], target[order], local[order]
    if len(key) > 1:
        same = key[1:] == key[:-1]
        overlap = same & (start[1:] < start[:-1] + length[:-1])
        if overlap.any():
            i = int(np.flatnonzero(overlap)[0])
            raise PlanError(
                f"hf.transfer: {names[int(target[i])]} and {names[int(target[i + 1])]} both hold element "
                f"{int(start[i + 1])} of checkpoint tensor number {int(key[i])} on this rank"
            )
        join = same & (start[1:] == start[:-1] + length[:-1]) & (target[1:] == target[:-1])
        join &= local[1:] == local[:-1] + length[:-1]
        if join.any():
            first = np.flatnonzero(np.concatenate([[True], ~join]))
            ends = np.append(first[1:], len(key))
            total = np.add.reduceat(length, first)
            key, start, target, local = key[first], start[first], target[first], local[first]
            length = total
            del ends
    return Runs(_i64(key), _i64(start), _i64(length), _i64(target), _i64(local), names), inexact


@dataclass(frozen=True, eq=False)
class TransferPlan:
    """Every piece every rank moves, the same on every rank.

    Pieces (one row each): element range ``[start, start + length)`` of checkpoint tensor ``key`` goes from
    rank ``src`` to rank ``dst`` in round ``rnd``, as message ``msg`` (-1: a copy within one rank) at byte
    ``offset`` of that message's buffer (-1: a direct message, the piece alone, shard to shard). Messages (one
    row each, numbered by ``msg``, in the order both ends post them): ``msg_src``, ``msg_dst``, ``msg_rnd``,
    ``msg_nbytes`` (buffer bytes, the padding between tensors included), ``msg_direct``."""

    src: Int64s
    dst: Int64s
    rnd: Int64s
    key: Int64s
    start: Int64s
    length: Int64s
    msg: Int64s
    offset: Int64s
    msg_src: Int64s
    msg_dst: Int64s
    msg_rnd: Int64s
    msg_nbytes: Int64s
    msg_direct: np.ndarray[Any, np.dtype[np.bool_]]
    itemsize: Int64s
    rounds: int
    window_bytes: int
    world: int
    needed_by_rank: Int64s
    #: the pieces ordered by message, made on first use (``_by_message``)
    _memo: dict[str, tuple[Int64s, Int64s]] = field(default_factory=dict, init=False, repr=False, compare=False)

    def piece_bytes(self) -> Int64s:
        return self.length * self.itemsize[self.key]

    def sent_by_rank(self) -> Int64s:
        """Payload bytes each rank sends to other ranks."""
        moved = self.msg >= 0
        return _i64(np.bincount(self.src[moved], self.piece_bytes()[moved], minlength=self.world))

    def received_by_rank(self) -> Int64s:
        moved = self.msg >= 0
        return _i64(np.bincount(self.dst[moved], self.piece_bytes()[moved], minlength=self.world))

    def copied_by_rank(self) -> Int64s:
        """Bytes each rank copies from its own source shards into its own destination shards."""
        kept = self.msg < 0
        return _i64(np.bincount(self.dst[kept], self.piece_bytes()[kept], minlength=self.world))

    def messages_of(self, rank: int, rnd: int) -> tuple[Int64s, Int64s]:
        """``(messages this rank sends, messages it receives)`` in round ``rnd``, in posting order."""
        in_round = self.msg_rnd == rnd
        return (
            _i64(np.flatnonzero(in_round & (self.msg_src == rank))),
            _i64(np.flatnonzero(in_round & (self.msg_dst == rank))),
        )

    def pieces_of(self, msg: int) -> Int64s:
        """The pieces of message ``msg``, in buffer order."""
        order, bounds = self._by_message()
        return order[bounds[msg + 1] : bounds[msg + 2]]

    def local_pieces(self, rank: int, rnd: int) -> Int64s:
        """The pieces rank ``rank`` copies from its own source into its own destination in round ``rnd``."""
        order, bounds = self._by_message()
        kept = order[bounds[0] : bounds[1]]
        return _i64(kept[(self.dst[kept] == rank) & (self.rnd[kept] == rnd)])

    def _by_message(self) -> tuple[Int64s, Int64s]:
        """Pieces ordered by message (copies within a rank first, as message -1) and each message's bounds in that
        order: message ``m``'s pieces are ``order[bounds[m + 1] : bounds[m + 2]]``."""
        cached = self._memo.get("by_message")
        if cached is None:
            order = _i64(np.argsort(self.msg, kind="stable"))
            bounds = _i64(np.searchsorted(self.msg[order], np.arange(-1, len(self.msg_src) + 1), "left"))
            cached = (order, bounds)
            self._memo["by_message"] = cached
        return cached

    def staging_by_rank(self) -> Int64s:
        """The largest packed bytes each rank holds in one round (sent and received messages together)."""
        out = np.zeros(self.world, dtype=np.int64)
        packed = ~self.msg_direct
        for rnd in range(self.rounds):
            sel = packed & (self.msg_rnd == rnd)
            held = np.bincount(self.msg_src[sel], self.msg_nbytes[sel], minlength=self.world)
            held += np.bincount(self.msg_dst[sel], self.msg_nbytes[sel], minlength=self.world)
            out = np.maximum(out, held.astype(np.int64))
        return _i64(out)

    def table(self) -> str:
        """One line per sender and receiver: bytes, messages (direct ones counted apart), rounds; then totals."""
        lines = [f"{'src':>5} {'dst':>5} {'bytes':>14} {'messages':>9} {'direct':>7} {'rounds':>6}"]
        nbytes = self.piece_bytes()
        moved = self.msg >= 0
        pairs = sorted({(int(s), int(d)) for s, d in zip(self.src.tolist(), self.dst.tolist(), strict=True)})
        for s, d in pairs:
            sel = (self.src == s) & (self.dst == d)
            m = (self.msg_src == s) & (self.msg_dst == d)
            label = "local" if s == d else ""
            lines.append(
                f"{s:>5} {d:>5} {int(nbytes[sel].sum()):>14} {int(m.sum()):>9} {int((m & self.msg_direct).sum()):>7} "
                f"{len(np.unique(self.rnd[sel])):>6} {label}".rstrip()
            )
        needed = int(self.needed_by_rank.sum())
        sent = int(nbytes[moved].sum())
        lines.append(
            f"total: {sent} bytes in {len(self.msg_src)} messages over {self.rounds} rounds (window "
            f"{self.window_bytes} bytes), {int(nbytes[~moved].sum())} bytes copied within ranks; the destination "
            f"needs {needed} bytes: moved / needed = {(sent + int(nbytes[~moved].sum())) / max(needed, 1):.2f}"
        )
        return "\n".join(lines)


def _axis(nbytes: Int64s) -> Int64s:
    """Each tensor's first byte on the plan's axis: tensors in key order, each on an ``ALIGN`` boundary."""
    padded = -(-nbytes // ALIGN) * ALIGN
    return _i64(np.concatenate([[0], np.cumsum(padded)[:-1]])) if len(nbytes) else _i64([])


def _bounds(spans: tuple[Int64s, Int64s, Int64s], base: Int64s, itemsize: Int64s) -> tuple[Int64s, Int64s]:
    key, start, length = spans
    lo = base[key] + start * itemsize[key]
    return _i64(lo), _i64(lo + length * itemsize[key])


def _split_at(lo: Int64s, hi: Int64s, cuts: Int64s) -> tuple[Int64s, Int64s, Int64s]:
    """Intervals ``[lo, hi)`` cut at every value of sorted ``cuts`` strictly inside them: ``(row, lo, hi)``."""
    i0 = np.searchsorted(cuts, lo, "right")
    i1 = np.searchsorted(cuts, hi, "left")
    inner = np.maximum(i1 - i0, 0)
    count = inner + 1
    row = np.repeat(np.arange(len(lo), dtype=np.int64), count)
    first = np.concatenate([[0], np.cumsum(count)[:-1]]).astype(np.int64)
    pos = np.arange(len(row), dtype=np.int64) - np.repeat(first, count)
    cut_at = np.clip(i0[row] + pos - 1, 0, max(len(cuts) - 1, 0))
    cut_next = np.clip(i0[row] + pos, 0, max(len(cuts) - 1, 0))
    cuts_or_zero = cuts if len(cuts) else np.zeros(1, dtype=np.int64)
    piece_lo = np.where(pos == 0, lo[row], cuts_or_zero[cut_at])
    piece_hi = np.where(pos == inner[row], hi[row], cuts_or_zero[cut_next])
    return _i64(row), _i64(piece_lo), _i64(piece_hi)


def plan_transfer(
    nbytes: Sequence[int] | Int64s,
    itemsize: Sequence[int] | Int64s,
    sources: Sequence[tuple[Int64s, Int64s, Int64s] | None],
    destinations: Sequence[tuple[Int64s, Int64s, Int64s] | None],
    *,
    budget_bytes: int,
    direct_bytes: int,
    keys: Sequence[str] = (),
) -> TransferPlan:
    """The pieces and messages of a transfer.

    ``nbytes`` / ``itemsize``: each checkpoint tensor's bytes and bytes per element (key numbers index them);
    ``sources[r]`` / ``destinations[r]``: rank ``r``'s ``Runs.spans`` of each side (None: no such side there).
    Each destination run is split at the source holdings' boundaries; each piece is taken from the destination
    rank itself when it holds it, else from one of its holders, chosen by rotation over the piece's segment and the
    destination rank (replicas share the sending). Pieces are cut into rounds at multiples of the window (the
    widest, halved from the budget, in which no rank's staged bytes of a round, sent and received, pass
    ``budget_bytes``); pieces of ``direct_bytes`` or more go as messages of their
    own (shard to shard, not staged, not cut) in the first round, with every rank's copies of its own pieces.
    ``PlanError`` naming the tensor when a destination needs bytes that no source holds."""
    world = len(sources)
    if len(destinations) != world:
        raise ValueError(f"{len(sources)} source sides and {len(destinations)} destination sides")
    nb = _i64(nbytes)
    size = _i64(itemsize)
    base = _axis(nb)
    src_bounds = {r: _bounds(s, base, size) for r, s in enumerate(sources) if s is not None}
    edges = np.unique(np.concatenate([np.concatenate(b) for b in src_bounds.values()] or [_i64([])]))
    edges = _i64(edges)
    segments = max(len(edges) - 1, 0)
    # who holds each segment, as sorted (segment, rank) pairs: a rank's run covers the segments between its ends
    pair_seg, pair_rank = [], []
    for r, (lo, hi) in src_bounds.items():
        if not len(lo) or not segments:
            continue
        first_seg, end_seg = np.searchsorted(edges, lo), np.searchsorted(edges, hi)
        count = end_seg - first_seg
        starts = np.concatenate([[0], np.cumsum(count)[:-1]])
        pair_seg.append(np.repeat(first_seg - starts, count) + np.arange(int(count.sum()), dtype=np.int64))
        pair_rank.append(np.full(int(count.sum()), r, dtype=np.int64))
    seg_all = _i64(np.concatenate(pair_seg) if pair_seg else [])
    rank_all = _i64(np.concatenate(pair_rank) if pair_rank else [])
    order = np.lexsort((rank_all, seg_all))
    seg_all, rank_all = seg_all[order], rank_all[order]
    first_holder = _i64(np.searchsorted(seg_all, np.arange(segments + 1)))
    holders = np.diff(first_holder)
    codes = seg_all * world + rank_all  # sorted: by segment, then rank
    cols_src, cols_dst, cols_lo, cols_hi = [], [], [], []
    needed = np.zeros(world, dtype=np.int64)
    for d, spans in enumerate(destinations):
        if spans is None or not len(spans[0]):
            continue
        lo, hi = _bounds(spans, base, size)
        needed[d] = int((hi - lo).sum())
        _, plo, phi = _split_at(lo, hi, edges)
        seg = np.searchsorted(edges, plo, "right") - 1
        bad = (seg < 0) | (seg >= segments)
        segc = np.clip(seg, 0, max(segments - 1, 0))
        if segments:
            bad |= holders[segc] == 0
            bad |= edges[np.clip(segc + 1, 0, len(edges) - 1)] < phi
        if bad.any():
            at = int(plo[np.flatnonzero(bad)[0]])
            k = int(np.searchsorted(base, at, "right") - 1)
            name = shown_key(keys[k]) if k < len(keys) else f"number {k}"
            raise PlanError(
                f"hf.transfer: rank {d}'s destination needs bytes of checkpoint tensor {name} (from element "
                f"{(at - int(base[k])) // int(size[k])}) that no source rank holds"
            )
        turn = (seg + d) % holders[seg]
        holder = rank_all[first_holder[seg] + turn]
        if d in src_bounds:  # the destination rank holds the piece itself: a copy, not a message
            mine = seg * world + d
            found = np.clip(np.searchsorted(codes, mine), 0, max(len(codes) - 1, 0))
            holder = np.where(codes[found] == mine, d, holder)
        cols_src.append(holder)
        cols_dst.append(np.full(len(plo), d, dtype=np.int64))
        cols_lo.append(plo)
        cols_hi.append(phi)
    if cols_src:
        p_src, p_dst, p_lo, p_hi = (_i64(np.concatenate(c)) for c in (cols_src, cols_dst, cols_lo, cols_hi))
    else:
        p_src = p_dst = p_lo = p_hi = _i64([])
    remote = p_src != p_dst
    direct = remote & (p_hi - p_lo >= direct_bytes)
    # the widest window (halved from the budget) in which no rank's staged bytes of one round, sent and received,
    # pass the budget; staged pieces are cut at its multiples (on element boundaries: tensors start on ALIGN)
    window = max(ALIGN, int(budget_bytes) // ALIGN * ALIGN)
    while True:
        cut = _cut_at_windows(p_src, p_dst, p_lo, p_hi, direct, window)
        if window <= ALIGN or _round_load(*cut, window, world) <= budget_bytes:
            break
        window = max(ALIGN, window // 2 // ALIGN * ALIGN)
    p_src, p_dst, p_lo, p_hi, direct = cut
    # rounds are the staged pieces' windows; direct pieces and a rank's own copies stage nothing: the first round
    staged = (p_src != p_dst) & ~direct
    window_id = p_lo // window
    window_id[~staged] = int(window_id[staged].min()) if staged.any() else 0
    _, rnd = np.unique(window_id, return_inverse=True)
    rnd = _i64(rnd.reshape(-1))
    rounds = int(rnd.max()) + 1 if len(rnd) else 0
    key = _i64(np.searchsorted(base, p_lo, "right") - 1)
    start = (p_lo - base[key]) // size[key]
    length = (p_hi - p_lo) // size[key]
    order = np.lexsort((p_lo, direct, p_dst, p_src, rnd))
    p_src, p_dst, rnd, key, start, length, direct, p_lo, p_hi = (
        a[order] for a in (p_src, p_dst, rnd, key, start, length, direct, p_lo, p_hi)
    )
    remote = p_src != p_dst
    msg, offset, m_src, m_dst, m_rnd, m_nbytes, m_direct = _messages(
        p_src, p_dst, rnd, key, p_hi - p_lo, remote, direct
    )
    return TransferPlan(
        src=p_src,
        dst=p_dst,
        rnd=rnd,
        key=key,
        start=_i64(start),
        length=_i64(length),
        msg=msg,
        offset=offset,
        msg_src=m_src,
        msg_dst=m_dst,
        msg_rnd=m_rnd,
        msg_nbytes=m_nbytes,
        msg_direct=m_direct,
        itemsize=size,
        rounds=rounds,
        window_bytes=window,
        world=world,
        needed_by_rank=_i64(needed),
    )


def _cut_at_windows(
    p_src: Int64s, p_dst: Int64s, p_lo: Int64s, p_hi: Int64s, direct: Any, window: int
) -> tuple[Int64s, Int64s, Int64s, Int64s, Any]:
    """The staged pieces (remote, not direct) cut at multiples of ``window``; the others as they are."""
    staged = (p_src != p_dst) & ~direct
    s_idx = np.flatnonzero(staged)
    if not len(s_idx):
        return p_src, p_dst, p_lo, p_hi, direct
    lo, hi = p_lo[s_idx], p_hi[s_idx]
    first_w, last_w = lo // window, (hi - 1) // window
    if not (last_w > first_w).any():
        return p_src, p_dst, p_lo, p_hi, direct
    counts = last_w - first_w + 1
    row = np.repeat(np.arange(len(lo)), counts)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    w = first_w[row] + np.arange(len(row)) - np.repeat(first, counts)
    keep = np.flatnonzero(~staged)
    return (
        _i64(np.concatenate([p_src[keep], p_src[s_idx][row]])),
        _i64(np.concatenate([p_dst[keep], p_dst[s_idx][row]])),
        _i64(np.concatenate([p_lo[keep], np.maximum(lo[row], w * window)])),
        _i64(np.concatenate([p_hi[keep], np.minimum(hi[row], (w + 1) * window)])),
        np.concatenate([direct[keep], np.zeros(len(row), dtype=bool)]),
    )


def _round_load(p_src: Int64s, p_dst: Int64s, p_lo: Int64s, p_hi: Int64s, direct: Any, window: int, world: int) -> int:
    """The most staged bytes one rank sends and receives in one window."""
    staged = (p_src != p_dst) & ~direct
    if not staged.any():
        return 0
    w = p_lo[staged] // window
    nbytes = (p_hi - p_lo)[staged]
    _, slot = np.unique(np.concatenate([w * world + p_src[staged], w * world + p_dst[staged]]), return_inverse=True)
    return int(np.bincount(slot.reshape(-1), np.concatenate([nbytes, nbytes])).max())


def _messages(
    src: Int64s, dst: Int64s, rnd: Int64s, key: Int64s, nbytes: Int64s, remote: Any, direct: Any
) -> tuple[Int64s, Int64s, Int64s, Int64s, Int64s, Int64s, Any]:
    """Message numbers and buffer offsets of pieces sorted by (round, sender, receiver, direct, axis): one packed
    message per (round, sender, receiver) for the staged pieces, each key's pieces on an ``ALIGN`` boundary;
    one message per direct piece."""
    n = len(src)
    msg = np.full(n, -1, dtype=np.int64)
    offset = np.full(n, -1, dtype=np.int64)
    staged = np.flatnonzero(remote & ~direct)
    m_src: list[Any] = []
    m_dst: list[Any] = []
    m_rnd: list[Any] = []
    m_nbytes: list[Any] = []
    m_direct: list[Any] = []
    if len(staged):
        s, d, r, k, b = src[staged], dst[staged], rnd[staged], key[staged], nbytes[staged]
        new_msg = np.concatenate([[True], (s[1:] != s[:-1]) | (d[1:] != d[:-1]) | (r[1:] != r[:-1])])
        new_group = new_msg | np.concatenate([[True], k[1:] != k[:-1]])
        group = np.cumsum(new_group) - 1
        mid = np.cumsum(new_msg) - 1
        group_bytes = np.bincount(group, b).astype(np.int64)
        group_msg = mid[np.flatnonzero(new_group)]
        padded = -(-group_bytes // ALIGN) * ALIGN
        ends = np.cumsum(padded)
        starts = ends - padded
        msg_first_group = np.flatnonzero(np.concatenate([[True], group_msg[1:] != group_msg[:-1]]))
        msg_base = starts[msg_first_group]
        group_offset = starts - msg_base[group_msg]
        within = np.cumsum(b) - b
        within -= within[np.flatnonzero(new_group)][group]
        local_id = mid
        offset[staged] = group_offset[group] + within
        msg_last_group = np.append(msg_first_group[1:], len(group_bytes)) - 1
        m_nb = group_offset[msg_last_group] + group_bytes[msg_last_group]
        first_piece = np.flatnonzero(new_msg)
        m_src = s[first_piece].tolist()
        m_dst = d[first_piece].tolist()
        m_rnd = r[first_piece].tolist()
        m_nbytes = m_nb.tolist()
        m_direct = [False] * len(first_piece)
        msg[staged] = local_id
    base_id = len(m_src)
    d_idx = np.flatnonzero(remote & direct)
    msg[d_idx] = base_id + np.arange(len(d_idx))
    offset[d_idx] = -1
    m_src += src[d_idx].tolist()
    m_dst += dst[d_idx].tolist()
    m_rnd += rnd[d_idx].tolist()
    m_nbytes += nbytes[d_idx].tolist()
    m_direct += [True] * len(d_idx)
    return (
        _i64(msg),
        _i64(offset),
        _i64(m_src),
        _i64(m_dst),
        _i64(m_rnd),
        _i64(m_nbytes),
        np.asarray(m_direct, dtype=bool),
    )
