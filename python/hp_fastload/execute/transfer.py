"""Running a ``TransferPlan`` on one rank: its source shards packed into messages (or sent as they are), the
messages exchanged point to point, the received bytes scattered into its destination shards.

Owns, per round: packing this rank's staged messages from its source shards (a slice copy per contiguous run,
one ``index_select`` for a target's many short runs), the copies from its own source shards into its own
destination shards, posting the messages (``isend`` / ``irecv`` of host tensors on gloo; device tensors in one
``batch_isend_irecv`` on the group's own backend, NCCL, without a host copy), direct messages sent from and
received into the shards themselves, and scattering the packed messages received. Memory per rank: its shards
plus the round's packed messages (the plan's window). The agreement, the interruptible wait and the exchange
guard are the caller's (``agree``, ``wait``, ``exchange``): a failure in packing or placing raises on every rank,
a peer that fails or is interrupted during the exchange ends the wait.

It decides nothing: who sends what is the plan's (``planning.transfer``).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hp_fastload.errors import PlanError
from hp_fastload.planning.transfer import ALIGN, Runs, TransferPlan

__all__ = ["Side", "TransferStats", "run_transfer"]

#: Up to this many runs of one target in one message, a slice copy each; more: one ``index_select`` /
#: ``index_copy_`` over their elements.
FEW_RUNS = 16


@dataclass
class TransferStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_copied: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    direct_sent: int = 0
    direct_received: int = 0
    rounds: int = 0
    #: the largest packed bytes this rank held in one round (sent and received buffers)
    peak_staging_bytes: int = 0
    seconds_pack: float = 0.0
    seconds_wait: float = 0.0
    seconds_place: float = 0.0


class Side:
    """One side of this rank: its ``Runs`` and the flat local shards they point into.

    ``shards[t]``: the local tensor of target ``runs.names[t]``. A shard that is not contiguous is worked on
    through a contiguous copy (written back by :meth:`finish` on the destination side)."""

    def __init__(self, runs: Runs, shards: Sequence[torch.Tensor], base: np.ndarray, itemsize: np.ndarray) -> None:
        self.runs = runs
        self.shards = list(shards)
        self.flats: list[torch.Tensor] = []
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        for shard in self.shards:
            if shard.is_contiguous():
                self.flats.append(shard.view(-1))
            else:
                copy = shard.contiguous()
                self._copies.append((shard, copy))
                self.flats.append(copy.view(-1))
        self.lo = base[runs.key] + runs.start * itemsize[runs.key]
        self.hi = self.lo + runs.length * itemsize[runs.key]

    def locate(self, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The target and the local element of each piece ``[lo, hi)`` of the plan's axis (each within one run by
        construction of the plan; ``PlanError`` otherwise)."""
        i = np.searchsorted(self.lo, lo, "right") - 1
        ic = np.clip(i, 0, max(len(self.lo) - 1, 0))
        if len(lo) and (not len(self.lo) or ((i < 0) | (self.hi[ic] < hi)).any()):
            raise PlanError("hf.transfer: a piece of the plan is not within one run of this rank's shards")
        return self.runs.target[ic], self.runs.local[ic] + (lo - self.lo[ic]) // self._itemsize_of(ic)

    def _itemsize_of(self, runs: np.ndarray) -> np.ndarray:
        n = self.runs.length[runs]
        return np.where(n > 0, (self.hi[runs] - self.lo[runs]) // np.maximum(n, 1), 1)

    def finish(self) -> None:
        for shard, copy in self._copies:
            shard.copy_(copy)


def _element_index(starts: np.ndarray, lengths: np.ndarray, device: torch.device) -> torch.Tensor:
    """Every element of runs ``[starts, starts + lengths)``, in order, as one index tensor."""
    total = int(lengths.sum())
    first = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    shift = np.repeat(starts - first, lengths)
    index = torch.from_numpy(shift + np.arange(total, dtype=np.int64))
    return index.to(device, non_blocking=True) if device.type != "cpu" else index


def _groups(targets: np.ndarray) -> list[tuple[int, int]]:
    """``[a, b)`` stretches of consecutive pieces of one target."""
    if not len(targets):
        return []
    cut = np.flatnonzero(targets[1:] != targets[:-1]) + 1
    edges = [0, *cut.tolist(), len(targets)]
    return list(itertools.pairwise(edges))


def _strided(flat: torch.Tensor, local: np.ndarray, length: np.ndarray) -> torch.Tensor | None:
    """The runs ``[local, local + length)`` of ``flat`` as one 2-D view when they are evenly spaced and of one
    length (the rows of a column block: a row-wise TP shard, a column-split expert), else None."""
    count = len(local)
    if count < 2:
        return None
    run = int(length[0])
    step = int(local[1] - local[0])
    if step < run or not (length == run).all() or not (np.diff(local) == step).all():
        return None
    return flat.as_strided((count, run), (step, 1), flat.storage_offset() + int(local[0]))


def _gather(out: torch.Tensor, flat: torch.Tensor, local: np.ndarray, length: np.ndarray) -> None:
    """``out`` (typed, contiguous) := the runs ``[local, local + length)`` of ``flat``, in order."""
    view = _strided(flat, local, length)
    if view is not None:
        out.view(view.shape).copy_(view)
        return
    if len(local) <= FEW_RUNS:
        at = 0
        for s, n in zip(local.tolist(), length.tolist(), strict=True):
            out[at : at + n].copy_(flat[s : s + n])
            at += n
        return
    torch.index_select(flat, 0, _element_index(local, length, flat.device), out=out)


def _scatter(flat: torch.Tensor, data: torch.Tensor, local: np.ndarray, length: np.ndarray) -> None:
    """The runs ``[local, local + length)`` of ``flat`` := ``data``, in order."""
    view = _strided(flat, local, length)
    if view is not None:
        view.copy_(data.view(view.shape))
        return
    if len(local) <= FEW_RUNS:
        at = 0
        for s, n in zip(local.tolist(), length.tolist(), strict=True):
            flat[s : s + n].copy_(data[at : at + n])
            at += n
        return
    flat.index_copy_(0, _element_index(local, length, flat.device), data)


def _typed(buffer: torch.Tensor, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    size = torch.empty((), dtype=dtype).element_size()
    return buffer[offset : offset + count * size].view(dtype)


def _axis_of(plan: TransferPlan, base: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    key = plan.key[rows]
    lo = base[key] + plan.start[rows] * plan.itemsize[key]
    return lo, lo + plan.length[rows] * plan.itemsize[key]


def _message_runs(
    plan: TransferPlan, base: np.ndarray, msg: int, side: Side
) -> Iterator[tuple[torch.Tensor, int, int, np.ndarray, np.ndarray]]:
    """Message ``msg``'s pieces on this rank, a group per shard and tensor: the shard's flat view, the group's
    byte offset in the message, its elements, and its pieces' local starts and lengths."""
    rows = plan.pieces_of(msg)
    lo, hi = _axis_of(plan, base, rows)
    target, local = side.locate(lo, hi)
    length = plan.length[rows]
    offset = plan.offset[rows]
    for a, b in _groups(target * (1 << 32) + plan.key[rows]):
        yield side.flats[int(target[a])], int(offset[a]), int(length[a:b].sum()), local[a:b], length[a:b]


def pack_message(plan: TransferPlan, base: np.ndarray, msg: int, side: Side, device: torch.device) -> torch.Tensor:
    """Message ``msg``'s buffer (bytes) from this rank's source shards."""
    buffer = torch.empty(int(plan.msg_nbytes[msg]), dtype=torch.uint8, device=device)
    for flat, offset, count, local, length in _message_runs(plan, base, msg, side):
        _gather(_typed(buffer, offset, count, flat.dtype), flat, local, length)
    return buffer


def place_message(plan: TransferPlan, base: np.ndarray, msg: int, side: Side, buffer: torch.Tensor) -> None:
    """Message ``msg``'s buffer scattered into this rank's destination shards."""
    for flat, offset, count, local, length in _message_runs(plan, base, msg, side):
        _scatter(flat, _typed(buffer, offset, count, flat.dtype), local, length)


def _direct_view(plan: TransferPlan, base: np.ndarray, msg: int, side: Side) -> torch.Tensor:
    rows = plan.pieces_of(msg)
    lo, hi = _axis_of(plan, base, rows)
    target, local = side.locate(lo, hi)
    n = int(plan.length[rows[0]])
    s = int(local[0])
    return side.flats[int(target[0])][s : s + n]


def copy_local(plan: TransferPlan, base: np.ndarray, rows: np.ndarray, src: Side, dst: Side) -> int:
    """The pieces this rank holds for itself: from its source shards into its destination shards. Returns bytes."""
    if not len(rows):
        return 0
    lo, hi = _axis_of(plan, base, rows)
    s_target, s_local = src.locate(lo, hi)
    d_target, d_local = dst.locate(lo, hi)
    length = plan.length[rows]
    pair = s_target * (1 << 32) + d_target
    for a, b in _groups(pair):
        s_flat = src.flats[int(s_target[a])]
        d_flat = dst.flats[int(d_target[a])]
        s_view = _strided(s_flat, s_local[a:b], length[a:b])
        d_view = _strided(d_flat, d_local[a:b], length[a:b])
        if s_view is not None and d_view is not None:
            d_view.copy_(s_view)
        elif b - a <= FEW_RUNS:
            for s, d, n in zip(s_local[a:b].tolist(), d_local[a:b].tolist(), length[a:b].tolist(), strict=True):
                d_flat[d : d + n].copy_(s_flat[s : s + n])
        else:
            index_s = _element_index(s_local[a:b], length[a:b], s_flat.device)
            index_d = _element_index(d_local[a:b], length[a:b], d_flat.device)
            d_flat.index_copy_(0, index_d, s_flat.index_select(0, index_s))
    return int((hi - lo).sum())


def run_transfer(
    plan: TransferPlan,
    rank: int,
    base: np.ndarray,
    src: Side | None,
    dst: Side | None,
    *,
    device: torch.device,
    agree: Callable[[str, Callable[[], Any]], Any] | None = None,
    wait: Callable[[str, Any, int, float | None], None] | None = None,
    exchange: Callable[[], AbstractContextManager[None]] | None = None,
    group: Any = None,
    timeout_s: float | None = None,
) -> TransferStats:
    """Run ``plan`` on this rank: per round, pack (agreed), exchange, place (agreed).

    ``base``: the plan's axis (each tensor's first byte). ``device``: where staged buffers live (the shards'
    device; CUDA buffers go through ``batch_isend_irecv``). ``agree(stage, fn)`` makes every rank raise when ``fn``
    failed on any; ``wait(stage, work, peer, timeout_s)`` waits for one message so that a peer's failure or
    interrupt ends it; ``exchange()`` guards the exchange. Every rank of the group calls it together."""
    import torch.distributed as dist

    stats = TransferStats(rounds=plan.rounds)

    def agreed(stage: str, fn: Callable[[], Any]) -> Any:
        return fn() if agree is None else agree(stage, fn)

    on_device = device.type != "cpu"
    with torch.no_grad():
        for rnd in range(plan.rounds):
            sends, receives = plan.messages_of(rank, rnd)
            if len(sends) and src is None:
                raise PlanError(f"hf.transfer: rank {rank} is to send but holds no source model")
            if len(receives) and dst is None:
                raise PlanError(f"hf.transfer: rank {rank} is to receive but holds no destination model")
            stage = f"Round {rnd + 1} of {plan.rounds} of the transfer"

            def pack(sends: np.ndarray = sends, rnd: int = rnd) -> list[tuple[int, torch.Tensor]]:
                out = []
                for m in sends.tolist():
                    if plan.msg_direct[m]:
                        assert src is not None
                        out.append((m, _direct_view(plan, base, m, src)))
                    else:
                        assert src is not None
                        out.append((m, pack_message(plan, base, m, src, device)))
                return out

            t0 = time.perf_counter()
            outbox = agreed(f"{stage}: packing", pack)
            inbox: list[tuple[int, torch.Tensor, bool]] = []
            for m in receives.tolist():
                if plan.msg_direct[m]:
                    assert dst is not None
                    inbox.append((m, _direct_view(plan, base, m, dst), True))
                else:
                    inbox.append((m, torch.empty(int(plan.msg_nbytes[m]), dtype=torch.uint8, device=device), False))
            staged = sum(b.numel() for m, b in outbox if not plan.msg_direct[m])
            staged += sum(b.numel() * b.element_size() for _, b, direct in inbox if not direct)
            stats.peak_staging_bytes = max(stats.peak_staging_bytes, staged)
            t1 = time.perf_counter()
            stats.seconds_pack += t1 - t0
            copies = _LocalCopies(plan, base, plan.local_pieces(rank, rnd), src, dst)
            try:
                with nullcontext() if exchange is None else exchange():
                    works: list[tuple[int, Any]] = []
                    tag = int
                    if on_device:
                        ops = [
                            dist.P2POp(dist.irecv, b, int(plan.msg_src[m]), group, tag(m % (1 << 30)))
                            for m, b, _ in inbox
                        ]
                        ops += [
                            dist.P2POp(dist.isend, b, int(plan.msg_dst[m]), group, tag(m % (1 << 30)))
                            for m, b in outbox
                        ]
                        if ops:
                            for work in dist.batch_isend_irecv(ops):
                                works.append((-1, work))
                    else:
                        for m, b, _ in inbox:
                            peer = int(plan.msg_src[m])
                            works.append((peer, dist.irecv(b, src=peer, tag=m % (1 << 30), group=group)))
                        for m, b in outbox:
                            peer = int(plan.msg_dst[m])
                            works.append((peer, dist.isend(b, dst=peer, tag=m % (1 << 30), group=group)))
                    copies.start()  # this rank's own pieces, copied while the messages travel
                    for peer, work in works:
                        if wait is not None:
                            wait(f"{stage}: exchanging", work, peer, timeout_s)
                        else:
                            work.wait()
            except BaseException:
                copies.settle()  # no copy left running into the shards once this call has raised
                raise
            for m, b in outbox:
                stats.bytes_sent += b.numel() * b.element_size() if plan.msg_direct[m] else _payload(plan, m)
                stats.messages_sent += 1
                stats.direct_sent += int(plan.msg_direct[m])
            del outbox
            t2 = time.perf_counter()
            stats.seconds_wait += t2 - t1

            def place(inbox: list[tuple[int, torch.Tensor, bool]] = inbox, copies: _LocalCopies = copies) -> None:
                stats.bytes_copied += copies.join()  # its failure raises here, inside the agreement
                for m, b, direct in inbox:
                    if not direct:
                        assert dst is not None
                        place_message(plan, base, m, dst, b)

            agreed(f"{stage}: placing", place)
            for m, b, direct in inbox:
                stats.bytes_received += b.numel() * b.element_size() if direct else _payload(plan, m)
                stats.messages_received += 1
                stats.direct_received += int(direct)
            stats.seconds_place += time.perf_counter() - t2
    if dst is not None:
        dst.finish()
    return stats


class _LocalCopies:
    """The pieces a rank holds for itself, copied on a helper thread while the round's messages travel (torch
    copies release the GIL); a failure is kept and raised by :meth:`join`, which the caller runs inside the
    round's placing agreement, so that every rank raises in the same step."""

    def __init__(self, plan: TransferPlan, base: np.ndarray, rows: np.ndarray, src: Side | None, dst: Side | None):
        self._args = (plan, base, rows, src, dst)
        self._thread: threading.Thread | None = None
        self._copied = 0
        self._failure: BaseException | None = None

    def _run(self) -> None:
        plan, base, rows, src, dst = self._args
        try:
            with torch.no_grad():
                self._copied = copy_local(plan, base, rows, src, dst) if src is not None and dst is not None else 0
        except BaseException as exc:  # raised by join, in the agreement
            self._failure = exc

    def start(self) -> None:
        if len(self._args[2]):
            self._thread = threading.Thread(target=self._run, name="hp_fastload-transfer-copy", daemon=True)
            self._thread.start()

    def settle(self) -> None:
        """Waits for the copies to stop, keeping their outcome to itself (the call is raising already)."""
        if self._thread is not None:
            self._thread.join()

    def join(self) -> int:
        if self._thread is not None:
            self._thread.join()
        if self._failure is not None:
            raise self._failure
        return self._copied


def _payload(plan: TransferPlan, msg: int) -> int:
    rows = plan.pieces_of(msg)
    return int((plan.length[rows] * plan.itemsize[plan.key[rows]]).sum())


def axis_base(nbytes: np.ndarray) -> np.ndarray:
    """The plan's axis (as ``planning.transfer`` lays it out): each tensor's first byte."""
    padded = -(-nbytes // ALIGN) * ALIGN
    return np.concatenate([[0], np.cumsum(padded)[:-1]]).astype(np.int64) if len(nbytes) else np.zeros(0, np.int64)
