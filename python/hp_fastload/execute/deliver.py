"""Rank-to-rank delivery of a ``JobPlan``: each chunk read once by its reader, each rank sent exactly the bytes
its own read items touch, and each rank's items run from those bytes in memory.

Owns, per round of the plan (``planning.jobwide``): reading this rank's chunks with the engine into a host
staging buffer (one engine call per chunk, transient ``EINTR`` / ``EAGAIN`` / ``EIO`` retried per chunk a
bounded number of times; a permanent failure names the file and byte range), one agreement that every
reader's chunks were read (a failure on any rank makes every rank raise naming it, before any message is
posted), the messages (``isend`` / ``irecv`` of host buffers on the caller's group, by default the default
process group: one message per reader and receiver and round, raw source bytes in axis order), and
``MemoryStorage``: the received intervals of each checkpoint tensor, packed, from which the rank's own items
are run (casts, post-ops and FP8 dequantization in torch, exactly as the engine computes them:
``float32(q) * float32(scale)``, rounded once). A tensor's bytes are freed after the last item that uses them
ran.

Memory per rank: the round's staging, messages sent and received stay within the plan's budget
(``JobPlan.budget_bytes``; rounds are cut to fit it, and a rank waits for its round's messages before the
next round is read: the backpressure), plus the packed bytes of the tensors whose items are still waiting for
a later round (at most one tensor's needs per chunk boundary).

It decides nothing: who reads what is the plan's.
"""

from __future__ import annotations

import errno
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hp_fastload.convert.symbolic import apply_post
from hp_fastload.dist.agree import agree, exchanging, wait_work
from hp_fastload.errors import PeerInterrupted, PeerLost, ReadError
from hp_fastload.execute.batch import Batch
from hp_fastload.planning.items import LoadPlan, Reads
from hp_fastload.planning.jobneeds import Needs, delivered_rows
from hp_fastload.planning.jobwide import JobPlan
from hp_fastload.runtime import node_of

__all__ = ["DeliveryStats", "MemoryStorage", "deliver", "read_chunk"]

#: Transient errors retried per chunk, and how often.
TRANSIENT_ERRNOS = frozenset({errno.EINTR, errno.EAGAIN, errno.EIO})
READ_ATTEMPTS = 4
RETRY_SLEEP_S = 0.05
#: Seconds a rank waits for one round's messages before it names the peer it waits for (None: the process
#: group's timeout).
WAIT_TIMEOUT_S: float | None = None
ALIGN = 16


@dataclass
class DeliveryStats:
    bytes_read: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    items: int = 0
    rounds: int = 0
    read_retries: int = 0
    # where a rank's time went (wall seconds, summed over rounds): its engine reads, the read agreement (waiting
    # for the slowest reader), packing its sends, waiting for the messages, placing received bytes, its items
    seconds_read: float = 0.0
    seconds_agree: float = 0.0
    seconds_pack: float = 0.0
    seconds_wait: float = 0.0
    seconds_place: float = 0.0
    seconds_items: float = 0.0


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def read_chunk(batch: Batch, threads: int | None, backend: str | None, stats: Any) -> None:
    """One chunk's engine call (the seam tests wrap to inject faults)."""
    batch.run(threads, backend, stats)


class _Counter:
    bytes_read = 0
    engine_calls = 0
    items = 0


def _read_round(
    job: JobPlan,
    rank: int,
    rnd: int,
    index: Any,
    threads: int | None,
    backend: str | None,
    stats: DeliveryStats,
    skip: np.ndarray | None = None,
) -> tuple[np.ndarray, Any, Any, Any]:
    """Reads this rank's chunks of round ``rnd`` (but the pieces of the tensors in ``skip``, smap ids) into one staging
    buffer; returns ``(staging as uint8 numpy, piece axis starts, piece axis ends, piece staging offsets)``
    (pieces in axis order)."""
    smap = job.smap
    chunks = np.flatnonzero((job.chunk_reader == rank) & (job.chunk_round == rnd))
    rows = job.pieces_of(chunks)
    if skip is not None and len(skip) and len(rows):
        rows = rows[~np.isin(job.pieces_key[rows], skip)]
    keys, starts, ends = job.pieces_key[rows], job.pieces_start[rows], job.pieces_end[rows]
    size = smap.itemsize[keys]
    nbytes = (ends - starts) * size
    offsets = np.zeros(len(rows), dtype=np.int64)
    if len(rows):
        padded = -(-nbytes // ALIGN) * ALIGN
        offsets[1:] = np.cumsum(padded)[:-1]
        total = int(offsets[-1] + padded[-1])
    else:
        total = 0
    staging = torch.empty(_aligned(max(total, ALIGN)), dtype=torch.uint8)
    views: dict[torch.dtype, torch.Tensor] = {}
    piece_chunk = job.pieces_chunk[rows]

    def batch_of(pieces: list[int]) -> Batch:
        batch = Batch(index.locate)
        for i in pieces:
            key = smap.keys[int(keys[i])]
            entry = index.locate(key)
            view = views.get(entry.dtype)
            if view is None:
                view = views[entry.dtype] = staging.view(entry.dtype)
            n = int(ends[i] - starts[i])
            batch.add(key, int(starts[i]), (1,), (n,), view, (int(offsets[i]) // int(size[i]),))
        return batch

    t0 = time.perf_counter()
    # the round's chunks in one engine call (adjacent chunks coalesce into one request, the threads share the
    # whole round); after an error, chunk by chunk, each retried and named on its own
    counter = _Counter()
    try:
        if len(rows):
            read_chunk(batch_of(list(range(len(rows)))), threads, backend, counter)
            stats.bytes_read += counter.bytes_read
    except OSError:
        for c in chunks.tolist():
            pieces = np.flatnonzero(piece_chunk == c).tolist()
            if pieces:
                _read_with_retries(job, rank, c, batch_of(pieces), threads, backend, stats)
    stats.seconds_read += time.perf_counter() - t0
    glo = smap.g0[keys] + starts * size
    return staging.numpy(), glo, glo + nbytes, offsets


def _read_with_retries(
    job: JobPlan, rank: int, chunk: int, batch: Batch, threads: int | None, backend: str | None, stats: DeliveryStats
) -> None:
    counter = _Counter()
    for attempt in range(READ_ATTEMPTS):
        try:
            read_chunk(batch, threads, backend, counter)
            stats.bytes_read += counter.bytes_read
            return
        except OSError as exc:
            code = exc.errno
            if code not in TRANSIENT_ERRNOS or attempt == READ_ATTEMPTS - 1:
                smap = job.smap
                lo, hi = int(job.chunk_lo[chunk]), int(job.chunk_hi[chunk])
                f = int(np.searchsorted(smap.file_g0, lo, "right") - 1)
                base = int(smap.file_g0[f])
                tried = f" after {attempt + 1} attempts" if code in TRANSIENT_ERRNOS else ""
                raise ReadError(
                    f"rank {rank}: {smap.file_names[f]}: reading bytes [{lo - base}, {hi - base}) failed{tried}: {exc}"
                ) from exc
            stats.read_retries += 1
            time.sleep(RETRY_SLEEP_S * (attempt + 1))


#: Bytes copied per numpy call when packing and placing messages: a signal's handler runs between two.
COPY_PIECE = 2 << 20


def copy_bytes(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:] = src`` in pieces of at most ``COPY_PIECE`` bytes (one numpy copy cannot be interrupted)."""
    for at in range(0, len(src), COPY_PIECE):
        dst[at : at + COPY_PIECE] = src[at : at + COPY_PIECE]


def _gather(src: np.ndarray, pos: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """The bytes ``src[pos[i] : pos[i] + lens[i]]``, concatenated (one run: a view of ``src``, not a copy)."""
    if len(lens) == 1:
        p = int(pos[0])
        return src[p : p + int(lens[0])]
    out = np.empty(int(lens.sum()), dtype=np.uint8)
    at = 0
    for p, n in zip(pos.tolist(), lens.tolist(), strict=True):
        copy_bytes(out[at : at + n], src[p : p + n])
        at += n
    return out


class MemoryStorage:
    """A rank's received bytes, per checkpoint tensor: its needed intervals packed in order (``Needs`` rows of
    that tensor), in one buffer allocated when the first bytes arrive and dropped by ``release``."""

    def __init__(self, job: JobPlan, needs: Needs) -> None:
        self.smap = job.smap
        self.needs = needs
        size = self.smap.itemsize[needs.key]
        nbytes = (needs.end - needs.start) * size
        # per interval: its byte offset in its tensor's buffer
        self.offset = np.zeros(len(needs.key), dtype=np.int64)
        self.key_rows: dict[int, tuple[int, int]] = {}
        self.key_bytes: dict[int, int] = {}
        if len(needs.key):  # each tensor's rows are consecutive: offsets are running sums restarted per tensor
            change = np.flatnonzero(np.diff(needs.key)) + 1
            firsts = np.concatenate([[0], change])
            lasts = np.concatenate([change, [len(needs.key)]])
            running = np.cumsum(nbytes)
            before = np.concatenate([[0], running[lasts[:-1] - 1]])  # bytes of the tensors before each one
            self.offset = running - nbytes - np.repeat(before, lasts - firsts)
            keys = needs.key[firsts].tolist()
            self.key_rows = dict(zip(keys, zip(firsts.tolist(), lasts.tolist(), strict=True), strict=True))
            self.key_bytes = dict(zip(keys, (running[lasts - 1] - before).tolist(), strict=True))
        self.buffers: dict[int, torch.Tensor] = {}
        self.dtypes: dict[int, torch.dtype] = {}  # the dtype each tensor is read as

    def buffer(self, key: int) -> torch.Tensor:
        buf = self.buffers.get(key)
        if buf is None:
            buf = self.buffers[key] = torch.empty(_aligned(max(self.key_bytes[key], ALIGN)), dtype=torch.uint8)
        return buf

    def place(self, keys: np.ndarray, starts: np.ndarray, data: np.ndarray, nbytes: np.ndarray) -> None:
        """Rows ``(key, element start, nbytes)`` whose bytes follow one another in ``data`` land in their
        tensors' buffers."""
        smap = self.smap
        a = 0
        for k, s, n in zip(keys.tolist(), starts.tolist(), nbytes.tolist(), strict=True):
            lo, hi = self.key_rows[k]
            j = lo + int(np.searchsorted(self.needs.start[lo:hi], s, "right")) - 1
            off = int(self.offset[j]) + (s - int(self.needs.start[j])) * int(smap.itemsize[k])
            copy_bytes(self.buffer(k).numpy()[off : off + n], data[a : a + n])
            a += n

    def packed_index(self, key: int, elements: np.ndarray) -> np.ndarray:
        """The packed element positions (in the tensor's buffer viewed as its dtype) of ``elements``."""
        lo, hi = self.key_rows[key]
        starts = self.needs.start[lo:hi]
        j = np.searchsorted(starts, elements, "right") - 1
        if (j < 0).any() or (elements >= self.needs.end[lo:hi][j]).any():
            raise ReadError(f"{self.smap.keys[key]}: an item reads elements this rank was not sent")
        size = int(self.smap.itemsize[key])
        return (self.offset[lo:hi][j] // size) + (elements - starts[j])

    def typed(self, key: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self.buffer(key)
        return buf.view(dtype)

    def release(self, key: int) -> None:
        self.buffers.pop(key, None)


def _box_elements(base: int, strides: tuple[int, ...], lengths: tuple[int, ...]) -> np.ndarray:
    """Flat storage element index of every element of a box, in C order over ``lengths``."""
    idx = np.full((), base, dtype=np.int64)
    for s, n in zip(strides, lengths, strict=True):
        idx = idx[..., None] + np.arange(n, dtype=np.int64) * s
    return idx.reshape(-1)


def _packed_view(storage: MemoryStorage, key: int, dtype: torch.dtype, item: Any) -> torch.Tensor:
    """The item's source elements as a strided view of its tensor's packed buffer when the packing keeps the
    box affine (the usual case: rows cut the same way), else a gathered copy.

    Checked per contiguous run of the box, not per element: the dims that collapse into the run (as
    ``jobneeds.item_runs`` collapses them) must keep their strides, each run must be packed without a gap (its
    last element ``run - 1`` after its first), and the runs' first elements must follow the affine map."""
    lengths, strides, base = tuple(item.lengths), tuple(item.storage_strides), int(item.storage_base)
    typed = storage.typed(key, dtype)
    if math.prod(lengths) == 0:
        return typed[:0].reshape(lengths)
    p0 = int(storage.packed_index(key, np.array([base], dtype=np.int64))[0])
    steps = np.array([base + s for s, n in zip(strides, lengths, strict=True) if n != 1], dtype=np.int64)
    moved = iter((storage.packed_index(key, steps) - p0).tolist() if len(steps) else [])
    new_strides = tuple(next(moved) if n != 1 else 0 for n in lengths)
    dims = sorted((s, d) for d, (s, n) in enumerate(zip(strides, lengths, strict=True)) if n != 1 and s != 0)
    run, collapsed = 1, set()
    for s, d in dims:
        if s != run:
            break
        run *= lengths[d]
        collapsed.add(d)
    reduced = tuple(1 if d in collapsed else n for d, n in enumerate(lengths))
    starts = _box_elements(base, strides, reduced)
    expected = _box_elements(p0, new_strides, reduced)
    affine = all(new_strides[d] == strides[d] for d in collapsed)
    if affine:
        first = storage.packed_index(key, starts)
        last = storage.packed_index(key, starts + (run - 1))
        affine = bool(np.array_equal(first, expected) and np.array_equal(last - first, np.full_like(first, run - 1)))
    if affine and int(expected.max()) + run - 1 < typed.numel():
        return typed.as_strided(lengths, new_strides, p0)
    elements = _box_elements(base, strides, lengths)
    return typed[torch.from_numpy(storage.packed_index(key, elements))].reshape(lengths)


def _scales_of(storage: MemoryStorage, item: Any, spec: Any) -> torch.Tensor:
    """Each element's scale (float32), in the item's box order: element ``x`` of the quantized tensor (its
    multi-index over ``spec.shape``) takes ``scale[index // block]``."""
    smap = storage.smap
    key = smap.key_id[spec.scale]
    elements = _box_elements(item.storage_base, item.storage_strides, item.lengths)
    shape = spec.shape
    if not shape:
        cell = np.zeros_like(elements)
    else:
        grid = [-(-n // b) for n, b in zip(shape, spec.block, strict=True)]
        rem = elements
        cell = np.zeros_like(elements)
        coords = []
        for n in reversed(shape):
            coords.append(rem % n)
            rem = rem // n
        coords.reverse()
        for c, b, g in zip(coords, spec.block, grid, strict=True):
            cell = cell * g + c // b
    values = storage.typed(key, storage.dtypes[key])[torch.from_numpy(storage.packed_index(key, cell))]
    return values.to(torch.float32).reshape(item.lengths)


def _run_item(storage: MemoryStorage, local: torch.Tensor, item: Any, dtype: torch.dtype, spec: Any) -> None:
    key = storage.smap.key_id[item.source]
    src = _packed_view(storage, key, dtype, item)
    values = src.to(torch.float32) * _scales_of(storage, item, spec) if spec is not None else src
    if item.post:
        values = apply_post(values.clone(), item.post)
    view = local
    for d, (o, n) in enumerate(zip(item.dest_offsets, item.lengths, strict=True)):
        view = view.narrow(d, o, n)
    view.copy_(values)


def _ready_rounds(job: JobPlan, rank: int) -> dict[int, int]:
    """Per checkpoint tensor this rank needs: the round after which all its bytes are here."""
    chunk, key, _, _ = job.split[rank]
    out: dict[int, int] = {}
    for k, r in zip(key.tolist(), job.chunk_round[chunk].tolist(), strict=True):
        if r > out.get(k, -1):
            out[k] = r
    return out


def deliver(
    job: JobPlan,
    rank: int,
    plan: LoadPlan,
    context: Any,
    *,
    threads: int | None = None,
    backend: str | None = None,
    memory_rows: dict[str, np.ndarray] | None = None,
    skip: frozenset[int] = frozenset(),
    progress: Callable[[int], None] | None = None,
    group: Any = None,
) -> DeliveryStats:
    """Run ``job`` on this rank: read its chunks, exchange the messages, fill its targets from memory.

    ``plan`` / ``context``: this rank's own plan (its items, unchanged); ``memory_rows``: per target, the rows of its
    items run here from memory (default: all but MXFP4 items, ``delivered_rows``); the others are the caller's.
    ``skip``: tensors (``smap`` ids) whose pieces this rank reads for itself alone and none of these rows use:
    not read into staging nor placed. Each round's reads are agreed (``dist.agree.agree``: every rank raises
    when one failed); its messages are exchanged inside ``dist.agree.exchanging`` (a signal there raises and
    tells the peers) and each is waited for by ``dist.agree.wait_work`` (interruptible; a peer's interrupt ends
    it). ``group``: the process group of every rank that carries the messages (host tensors; None: the default
    group; ``dist.groups.host_message_group``). Every rank of the default group calls it together.
    """
    import torch.distributed as dist

    stats = DeliveryStats(rounds=job.rounds)
    index = context.index
    smap = job.smap
    storage = MemoryStorage(job, job.needs[rank])
    skipped = np.fromiter(sorted(skip), dtype=np.int64, count=len(skip))  # once, for every round's filters
    ready = _ready_rounds(job, rank)
    # this rank's items from memory, by the round after which they can run
    by_round: dict[int, list[tuple[str, Reads, int, Any]]] = {}
    last_use: dict[int, int] = {}
    for name, reads in plan.region_reads.items():
        seconds = reads.second
        for i in (delivered_rows(reads) if memory_rows is None else memory_rows[name]).tolist():
            item = reads[i]
            spec = seconds[i] if seconds is not None else None
            k = smap.key_id[item.source]
            storage.dtypes.setdefault(k, index.locate(item.source).dtype)
            deps = [k]
            if spec is not None:
                sk = smap.key_id[spec.scale]
                storage.dtypes.setdefault(sk, index.locate(spec.scale).dtype)
                deps.append(sk)
            rnd = max(ready.get(d, -1) for d in deps)
            if item.numel == 0:
                continue
            by_round.setdefault(rnd, []).append((name, reads, i, spec))
            for d in deps:
                last_use[d] = max(last_use.get(d, -1), rnd)
    if -1 in by_round:  # nothing to wait for: cannot happen for items with bytes
        raise ReadError(f"rank {rank}: {len(by_round[-1])} items need bytes the job plan never delivers")
    _split_chunk, split_key, split_start, split_end = job.split[rank]
    split_bytes = (split_end - split_start) * smap.itemsize[split_key]

    def run_ready(rnd: int) -> None:
        for name, reads, i, spec in by_round.pop(rnd, []):
            item = reads[i]
            local = context.target(name).local()
            _run_item(storage, local, item, storage.dtypes[smap.key_id[item.source]], spec)
            stats.items += 1
        for k in [k for k, r in last_use.items() if r == rnd]:
            storage.release(k)
            del last_use[k]

    with torch.no_grad():
        for rnd in range(job.rounds):
            sends, receives = job.messages(rank, rnd)

            read_before = stats.seconds_read

            def read_this_round(rnd: int = rnd) -> tuple[np.ndarray, Any, Any, Any]:
                return _read_round(job, rank, rnd, index, threads, backend, stats, skipped)

            t_round = time.perf_counter()
            outcome = agree(f"Reading round {rnd + 1} of {job.rounds} of the job-wide plan", read_this_round)
            stats.seconds_agree += time.perf_counter() - t_round - stats.seconds_read + read_before
            staging, piece_lo, piece_hi, piece_off = outcome
            del piece_hi
            with exchanging():
                works: list[tuple[int, Any]] = []
                inbox: dict[int, torch.Tensor] = {}
                for peer, rows in receives.items():
                    if peer == rank:
                        continue
                    buf = torch.empty(int(split_bytes[rows].sum()), dtype=torch.uint8)
                    inbox[peer] = buf
                    with _lost(rank, peer, rnd, job.rounds):
                        works.append((peer, dist.irecv(buf, src=peer, tag=rnd, group=group)))
                outbox: list[torch.Tensor] = []
                t0 = time.perf_counter()
                for peer, rows in sends.items():
                    data = _pack(job, peer, rows, staging, piece_lo, piece_off)
                    tensor = torch.from_numpy(data)
                    outbox.append(tensor)
                    stats.bytes_sent += tensor.numel()
                    with _lost(rank, peer, rnd, job.rounds):
                        works.append((peer, dist.isend(tensor, dst=peer, tag=rnd, group=group)))
                own = receives.get(rank)
                if own is not None and len(skipped):
                    own = own[~np.isin(split_key[own], skipped)]
                if own is not None and len(own):
                    data = _pack(job, rank, own, staging, piece_lo, piece_off)
                    _place(storage, split_key[own], split_start[own], data, split_bytes[own])
                stats.seconds_pack += time.perf_counter() - t0
                t0 = time.perf_counter()
                for peer, work in works:
                    with _lost(rank, peer, rnd, job.rounds):
                        stage = f"Round {rnd + 1} of {job.rounds} of the job-wide delivery"
                        wait_work(stage, work, peer, WAIT_TIMEOUT_S)
                t1 = time.perf_counter()
                stats.seconds_wait += t1 - t0
                for peer, buf in inbox.items():
                    rows = receives[peer]
                    _place(storage, split_key[rows], split_start[rows], buf.numpy(), split_bytes[rows])
                    stats.bytes_received += buf.numel()
                del outbox, staging
                t2 = time.perf_counter()
                stats.seconds_place += t2 - t1
                run_ready(rnd)
                stats.seconds_items += time.perf_counter() - t2
                if progress is not None:
                    progress(int(split_bytes[own].sum()) if own is not None else 0)
    if by_round:
        raise ReadError(f"rank {rank}: items left after the last round of the job-wide plan")
    return stats


@contextmanager
def _lost(rank: int, peer: int, rnd: int, rounds: int) -> Iterator[None]:
    """A transport error posting a message to ``peer`` or waiting for one (gloo's "Connection closed by peer") as
    the ``PeerLost`` that names the peer, its node and the round; a ``PeerInterrupted`` or ``PeerLost`` (a silent
    peer, from the wait) passes as it is."""
    try:
        yield
    except (PeerInterrupted, PeerLost):
        raise
    except RuntimeError as exc:
        raise PeerLost(
            f"hp_fastload.load: rank {rank} lost rank {peer} (node {node_of(peer)}) during round {rnd + 1} of "
            f"{rounds} of the job-wide delivery ({str(exc).splitlines()[0][:200]}); rank {peer} failed or exited",
            [peer],
            [node_of(peer)],
        ) from exc


def _pack(
    job: JobPlan, peer: int, rows: np.ndarray, staging: np.ndarray, piece_lo: np.ndarray, piece_off: np.ndarray
) -> np.ndarray:
    """``peer``'s rows (of its ``split``) from this rank's staging: its bytes, in axis order."""
    smap = job.smap
    _, key, start, end = job.split[peer]
    key, start, end = key[rows], start[rows], end[rows]
    size = smap.itemsize[key]
    glo = smap.g0[key] + start * size
    piece = np.searchsorted(piece_lo, glo, "right") - 1
    pos = piece_off[piece] + (glo - piece_lo[piece])
    return _gather(staging, pos, (end - start) * size)


def _place(storage: MemoryStorage, keys: np.ndarray, starts: np.ndarray, data: np.ndarray, nbytes: np.ndarray) -> None:
    storage.place(keys, starts, data, nbytes)
