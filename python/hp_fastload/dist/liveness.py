"""Which ranks of the job are still there: heartbeats in the default process group's store, so that a rank
waiting for a peer whose node's link went down, or whose process died, raises ``PeerLost`` naming it within
seconds instead of waiting for the process group's timeout (30 minutes by default).

From a rank's first distributed call (``load``, ``save``, ``from_pretrained``) on, a daemon thread of that
process, on a client connection of its own to the store (``Store.clone``, with a short timeout: a store that
stops answering cannot hold the thread, nor the waits that read through it, for longer), every ``beat_s()``:

- adds 1 to its rank's counter (``hp_fastload/alive/<rank>``),
- reads every other rank's counter, and notes when each last changed, by this process's clock.

A peer whose counter has not changed for ``silence_s()`` seconds, by reads that did answer, is lost; so is
every peer when the store itself has not answered for that long (this rank's node is cut off, or the store's
host, rank 0's node, is). A rank that has not yet beaten (it has made no distributed call so far) is never
declared lost by silence: it may be late, not gone.

The waits of the agreements and of the job-wide delivery (``dist.agree``) ask :func:`verdict` as they poll;
after a transport error ("Connection closed by peer") they ask :func:`verdict_after_error`, which names a
peer as soon as its counter stood still for a few beats while the others' moved: a dead process stops beating
at once, and the error already says some peer is gone.

Bounds (``HP_FASTLOAD_PEER_SILENCE_S`` = S, default 30; the beat is ``min(0.5, S / 6)``): a rank waiting for a
peer that went silent raises within S + 2 beats of that peer's last beat; after a transport error, within
4 beats (or S, if shorter) of the peer's last beat. The load's work does not hold the thread: the engine and
torch's collectives release the GIL.

Cost: one store round trip per rank and beat for its own counter and one per other rank (a job of a few
hundred ranks; a larger one would read one aggregate key, which this does not do yet).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch

from hp_fastload.errors import PeerLost
from hp_fastload.runtime import env_seconds, node_of

__all__ = [
    "SILENCE_ENV",
    "beat_s",
    "ensure_running",
    "ask",
    "silence_s",
    "store_answering",
    "verdict",
    "verdict_after_error",
]

SILENCE_ENV = "HP_FASTLOAD_PEER_SILENCE_S"
_KEY = "hp_fastload/alive/"
#: Beats a peer's counter must stand still, after a transport error, to be named the lost one.
_BEATS_AFTER_ERROR = 4


def silence_s() -> float:
    """``HP_FASTLOAD_PEER_SILENCE_S`` (seconds, > 0), default 30."""
    return env_seconds(SILENCE_ENV, 30.0)


def beat_s() -> float:
    return min(0.5, silence_s() / 6)


def _describe(ranks: list[int]) -> str:
    by_node: dict[int, list[int]] = {}
    for r in ranks:
        by_node.setdefault(node_of(r), []).append(r)
    return "; ".join(
        f"node {n} (rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))})" for n, rs in by_node.items()
    )


class _Monitor:
    """The heartbeat thread of one default store."""

    def __init__(self, store: Any, rank: int, world: int) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.silence, self.beat = silence_s(), beat_s()
        timeout = timedelta(seconds=max(self.beat * 2, self.silence / 2))
        self.client = store.clone()
        self.client.set_timeout(timeout)
        #: the waiting thread's own reads, on a connection and a thread of their own (``ask``)
        self.asker = _Asker(store.clone())
        self.lock = threading.Lock()
        self.values: dict[int, int] = {}
        self.changed: dict[int, float] = {}
        self.read_at = 0.0  # when the last complete read of every counter returned
        self.started = time.monotonic()
        self.answered = self.started  # when the store last answered
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="hp_fastload-liveness", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        own = f"{_KEY}{self.rank}"
        while not self.stop.is_set():
            try:
                self.client.add(own, 1)
                now = time.monotonic()
                self.answered = now
                seen = {}
                for peer in range(self.world):
                    if peer != self.rank:
                        seen[peer] = int(self.client.add(f"{_KEY}{peer}", 0))
                now = time.monotonic()
                with self.lock:
                    for peer, value in seen.items():
                        if value and value != self.values.get(peer):
                            self.values[peer] = value
                            self.changed[peer] = now
                    self.read_at = self.answered = now
            except Exception:  # the store timed out or went away: the silence shows in ``answered``
                if not _same_store(self.store):
                    return
            self.stop.wait(self.beat)

    def silent(self, seconds: float) -> tuple[list[int], bool]:
        """(peers silent for ``seconds``, whether the store itself was silent that long). A peer's silence is
        measured by reads that answered; once the store stops answering, a peer that had stopped beating well
        before it did (4 beats, or half the silence) keeps aging: the store's host can leave right after naming
        that peer lost, before this rank's reads saw the full silence. When one peer is silent, the others
        silent for all but two beats of that are named with it: the ranks of a node that went away stop
        together, and their last beats differ by up to a beat. The store is reported only when no peer is."""
        now = time.monotonic()
        with self.lock:
            quiet = {p: self.read_at - t for p, t in self.changed.items()}
            store_quiet = now - self.answered
            before = max(4 * self.beat, seconds / 2)  # clear of a live peer's jitter on a loaded host
            if store_quiet > 2 * self.beat:
                for p, t in self.changed.items():
                    if self.answered - t > before:
                        quiet[p] = now - t
            if any(q > seconds for q in quiet.values()):
                return sorted(p for p, q in quiet.items() if q > seconds - 2 * self.beat), False
            if store_quiet > seconds and now - self.started > seconds:
                return sorted(self.values), True
            return [], False


_monitor: _Monitor | None = None
_guard = threading.Lock()


def _default_store() -> Any:
    get = getattr(torch.distributed.distributed_c10d, "_get_default_store", None)
    try:
        return get() if get is not None else None
    except (RuntimeError, ValueError):
        return None


def _same_store(store: Any) -> bool:
    return torch.distributed.is_initialized() and _default_store() is store


def ensure_running() -> None:
    """Starts this process's heartbeat for the current default process group (once per group; a store that
    cannot clone itself, as a ``HashStore``, has none)."""
    global _monitor
    store = _default_store()
    if store is None:
        return
    with _guard:
        if _monitor is not None and _monitor.store is store and _monitor.thread.is_alive():
            return
        if _monitor is not None:
            _monitor.stop.set()
        try:
            _monitor = _Monitor(store, torch.distributed.get_rank(), torch.distributed.get_world_size())
        except (RuntimeError, NotImplementedError, AttributeError, ValueError):
            _monitor = None


T = TypeVar("T")
#: Longest wait for one of the waiting thread's reads (``ask``) before it goes on as if nothing was there.
_ASK_S = 1.0


class _Asker:
    """Runs the waiting thread's reads of the store on a daemon thread of its own: a store request that does
    not return (a TCPStore client's reads do not time out when the store's host is cut off) then holds that
    thread, not the waiting one, which goes on (and raises ``PeerLost`` once the silence is long enough)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.requests: queue.SimpleQueue[tuple[Callable[[Any], Any], list[Any], threading.Event]] = queue.SimpleQueue()
        self.stuck: threading.Event | None = None
        threading.Thread(target=self._run, name="hp_fastload-liveness-ask", daemon=True).start()

    def _run(self) -> None:
        while True:
            fn, box, done = self.requests.get()
            try:
                box.append((True, fn(self.store)))
            except Exception as exc:  # handed to the asking thread
                box.append((False, exc))
            done.set()

    def ask(self, fn: Callable[[Any], T], timeout: float) -> T | None:
        if self.stuck is not None and not self.stuck.is_set():
            return None  # an earlier read has not returned: the store is not answering
        done, box = threading.Event(), cast(list[Any], [])
        self.requests.put((fn, box, done))
        if not done.wait(timeout):
            self.stuck = done
            return None
        ok, value = box[0]
        if not ok:
            raise value
        return cast(T, value)


def ask(fn: Callable[[Any], T]) -> T | None:
    """``fn(store)`` for the waiting thread (the interrupt notices of ``dist.agree``): on the monitor's own
    connection and thread, None when the store does not answer within ``_ASK_S`` seconds (or an earlier read
    still hangs); without a monitor, on the default store."""
    m = _monitor
    if m is None or not _same_store(m.store):
        store = _default_store()
        return fn(store) if store is not None else None
    return m.asker.ask(fn, _ASK_S)


def store_answering() -> bool:
    """False when the monitor's store has not answered for ``silence_s()`` seconds."""
    m = _monitor
    return m is None or not m.silent(m.silence)[1]


def _lost(m: _Monitor, peers: list[int], store_silent: bool, seconds: float, stage: str, cause: str) -> PeerLost:
    me = m.rank
    if store_silent:
        where = os.environ.get("MASTER_ADDR", "")
        return PeerLost(
            f"{stage}: rank {me} (node {node_of(me)}) has had no answer from the job's store (on node {node_of(0)}"
            f"{', ' + where if where else ''}, with rank 0) for {seconds:g} s{cause}: node {node_of(0)}'s link or "
            "this node's link is down, or the store's process is gone; every rank beyond this node is lost to it",
            [0],
            [node_of(0)],
        )
    nodes = sorted({node_of(p) for p in peers})
    return PeerLost(
        f"{stage}: rank {me} (node {node_of(me)}) lost {_describe(peers)}: no heartbeat for {seconds:g} s{cause} "
        "(its link is down, or its process died); every rank stops",
        peers,
        nodes,
    )


def verdict(stage: str) -> PeerLost | None:
    """The ``PeerLost`` to raise when a peer, or the store, has been silent for ``silence_s()`` seconds."""
    m = _monitor
    if m is None or not _same_store(m.store):
        return None
    peers, store_silent = m.silent(m.silence)
    if not peers and not store_silent:
        return None
    return _lost(m, peers, store_silent, m.silence, stage, "")


def verdict_after_error(stage: str, error: BaseException) -> PeerLost | None:
    """After a transport error: waits (at most ``_BEATS_AFTER_ERROR`` beats, or the silence if shorter) for a
    peer whose counter stood still that long while the store answered; the ``PeerLost`` naming it, or None."""
    m = _monitor
    if m is None or not _same_store(m.store):
        return None
    seconds = min(m.silence, _BEATS_AFTER_ERROR * m.beat)
    cause = f", after {str(error).splitlines()[0][:200] if str(error) else type(error).__name__}"
    deadline = time.monotonic() + seconds + 2 * m.beat
    while True:
        peers, store_silent = m.silent(seconds)
        if peers or store_silent:
            return _lost(m, peers, store_silent, seconds, stage, cause)
        if time.monotonic() >= deadline:
            return None
        with contextlib.suppress(Exception):
            time.sleep(m.beat / 4)
