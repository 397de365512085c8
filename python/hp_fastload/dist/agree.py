"""The agreement protocol: every rank runs a step, the outcomes are all-gathered, and a failure on any rank is raised
on every rank with the failing rank named; a peer missing from the collective is reported as such rather than left
to hang. Interrupts: a rank whose step raised ``KeyboardInterrupt`` posts its outcome without waiting and raises at
once, its peers raise ``PeerInterrupted`` naming it; the wait for the peers is polled, so a signal is answered while
waiting too. A rank that leaves while waiting and the peers that finish the step settle in the process group's store
which came first (one ``compare_set`` on the step's key): either the peers learn of it before any further collective
and raise, or the rank stays for the next step and raises there, so the ranks' collectives stay in step.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch

from hp_fastload import errors
from hp_fastload.dist import liveness
from hp_fastload.runtime import dist_active, interrupts_deferred
from hp_fastload.source.location import Location, resolve_checkpoint_location

#: A rank's outcome of a step, as the first, fixed-size gather carries it.
_OK, _FAILED, _INTERRUPTED = 0, 1, 2
#: Longest sleep between two polls of a pending gather (the first polls are shorter).
_POLL_SECONDS = 0.002
#: How often a waiting rank looks for a peer's interrupt notice in the store.
_NOTICE_SECONDS = 0.05
_NOTICE_KEY = "hp_fastload/interrupted/"
#: A step's settlement: "sealed" (a peer finished the step first) or "rank r" (rank r left while waiting).
_SEAL_KEY = "hp_fastload/step/"
_SEALED = "sealed"
_sequence = 0  # agreements of the running call so far: the same count on every rank of a job in step
_call = 0  # distributed calls (load, save, from_pretrained) this process made: notices are keyed by both
_depth = 0  # 1 inside such a call (nested calls share it)
#: SIGINTs that arrived between the steps of the running distributed call (None: no such call holds them).
_held: list[int] | None = None


@contextlib.contextmanager
def interrupts_between_steps() -> Iterator[None]:
    """For a distributed call made of agreements (``load``, ``from_pretrained``, ``save``): a SIGINT that arrives
    between two agreements is held, then raised by this rank in the next agreement as its interrupted status (so
    every rank stops in that same step, their collectives in step), or when the call returns. Inside an
    agreement's step and its waits the signal raises at once, as without this block. A ``KeyboardInterrupt``
    raised between steps would leave the peers waiting for this rank in a collective it never enters.

    Each such call numbers its agreements from 1 and is counted, on every rank alike: the interrupt notices a
    rank leaves in the store are keyed by both, so a notice of a call that ended is never read by the next.
    Signals are held only with torch.distributed running, on the main thread, under Python's default SIGINT
    handler; nested calls share the outer block."""
    global _held, _depth, _call, _sequence
    if _depth:
        yield
        return
    _depth, _call, _sequence = 1, _call + 1, 0
    if dist_active():
        liveness.ensure_running()
    try:
        if (
            not dist_active()
            or threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        ):
            yield
            return
        held: list[int] = []
        _held = held
        signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            _held = None
        if held:
            raise KeyboardInterrupt
    finally:
        _depth = 0


@contextlib.contextmanager
def _signals_live() -> Iterator[None]:
    """Inside an agreement's step or wait: Python's default SIGINT handler (the signal raises), then holding
    again (see :func:`interrupts_between_steps`)."""
    if _held is None:
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def exchanging() -> Iterator[None]:
    """A step between two agreements in which the ranks exchange messages directly (the job-wide delivery):
    a signal raises here, as in an agreement's wait, after leaving a notice in the store that the peers find in
    their waits of this step or in the next agreement (they raise ``PeerInterrupted`` naming this rank). A
    transport error here (posting a message to, or waiting for, a peer that is gone) becomes that
    ``PeerInterrupted`` when the peer left such a notice: an interrupted rank that leaves closes its
    connections, and a peer posting to it meanwhile fails in gloo before any wait could look at the store."""
    sequence = _sequence
    try:
        with _signals_live():
            yield
    except KeyboardInterrupt:
        store = _store() if dist_active() else None
        if store is not None:
            with contextlib.suppress(RuntimeError, ValueError):
                store.set(f"{_NOTICE_KEY}{_call}/{sequence}", f"rank {torch.distributed.get_rank()}")
        raise
    except RuntimeError as exc:
        if not dist_active() or not liveness.store_answering():
            raise
        noticed = _notice_within(sequence, _LEFT_NOTICE_SECONDS)
        if noticed is not None:
            raise _peer_interrupted("The job-wide exchange", noticed, " during the exchange") from exc
        if isinstance(exc, errors.PeerLost):
            raise
        lost = liveness.verdict_after_error("The job-wide exchange", exc)
        if lost is not None:
            raise lost from exc
        raise


#: How long a rank whose exchange failed looks for the notice of a peer that left it (the notice is written
#: before the leaving rank raises, so before its connections close: this only covers the store's latency).
_LEFT_NOTICE_SECONDS = 0.5


def _notice_within(sequence: int, seconds: float) -> str | None:
    """A peer's interrupt notice of step ``sequence``, looked for during ``seconds`` at most."""
    deadline = time.monotonic() + seconds
    while True:
        noticed = liveness.ask(lambda store: _notice(store, sequence))
        if noticed is not None or time.monotonic() >= deadline:
            return noticed
        time.sleep(0.01)


def agree(stage: str, fn: Callable[[], Any], call: str = "hp_fastload.load (or from_pretrained)") -> Any:
    """Run ``fn`` on every rank; if it fails on any rank, every rank raises: the failing rank its own exception,
    the others the same class with the same message and fields, naming the failing rank (:func:`raised_on`).
    ``call``: the entry point every rank must be in, for the message when a peer is absent.

    The outcomes travel in two gathers: a fixed-size status per rank (polled, so this rank answers a signal
    while it waits), then, only when some rank failed and none was interrupted, the failures' messages. A rank
    whose ``fn`` raised ``KeyboardInterrupt`` posts its status without waiting for the gather to complete and
    re-raises at once; the others raise :class:`~hp_fastload.errors.PeerInterrupted` naming it."""
    global _sequence
    _sequence += 1
    result = None
    failure: BaseException | None = None
    if _held:  # a signal came since the last step (interrupts_between_steps): this rank stops here
        _held.clear()
        if _peer_left_last_step():  # the peers will not come to this step: stop without posting
            raise errors.PeerInterrupted(f"{stage}: a peer was interrupted in the previous step", [])
        failure = KeyboardInterrupt()
    else:
        try:
            with _signals_live():
                result = fn()
        except (Exception, KeyboardInterrupt) as exc:
            failure = exc
    if not dist_active():
        if failure is not None:
            raise failure
        return result
    status = _OK if failure is None else _INTERRUPTED if isinstance(failure, KeyboardInterrupt) else _FAILED
    statuses = _gather_status(stage, status, call)
    if failure is not None and status == _INTERRUPTED:
        raise failure
    interrupted = [rank for rank, s in enumerate(statuses) if s == _INTERRUPTED]
    if interrupted:
        raise errors.PeerInterrupted(
            f"{stage} was interrupted on rank {', '.join(map(str, interrupted))} (KeyboardInterrupt): every rank "
            "stops; this rank's tensors and files are as after a failure",
            interrupted,
        )
    if _FAILED not in statuses:
        return result
    payload = None if failure is None else errors.carried(failure)
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    with interrupts_deferred():
        _waiting(stage, lambda: torch.distributed.all_gather_object(gathered, payload), call)
    if failure is not None:
        raise failure
    for rank, item in enumerate(gathered):
        if item is not None:
            raise raised_on(stage, rank, item)
    return result


def _status_device() -> torch.device:
    """Where the status gather's tensors live: where torch's own object collectives put them (the current
    GPU under NCCL), CPU when torch does not say."""
    get = getattr(torch.distributed.distributed_c10d, "_get_object_coll_device", None)
    try:
        return torch.device(get()) if get is not None else torch.device("cpu")
    except (RuntimeError, ValueError):
        return torch.device("cpu")


def _store() -> Any:
    get = getattr(torch.distributed.distributed_c10d, "_get_default_store", None)
    try:
        return get() if get is not None else None
    except (RuntimeError, ValueError):
        return None


def _notice(store: Any, sequence: int) -> str | None:
    """The interrupt notice a peer left in agreement ``sequence`` ("rank r"), if any."""
    key = f"{_NOTICE_KEY}{_call}/{sequence}"
    try:
        return store.get(key).decode() if store.check([key]) else None
    except (RuntimeError, ValueError):
        return None


def _gather_status(stage: str, status: int, call: str) -> list[int]:
    """Every rank's status of this agreement. Posted asynchronously (a signal meanwhile is held: a post cut
    short would leave the peers waiting for it), then polled in short sleeps in which a signal raises, and a
    peer's notice from the previous step ends the wait with ``PeerInterrupted``. An interrupted rank
    (``status``) does not wait at all: its status is on its way, the peers' gather completes without it.

    A signal that raises in the wait and the peers finishing this step are settled in the store (:func:`_leave`,
    :func:`_seal`): this rank either leaves now (its peers raise ``PeerInterrupted`` when they finish the step,
    before any other collective) or, when a peer had finished first, stays to the next step and raises there with
    the others."""
    world = torch.distributed.get_world_size()
    device = _status_device()
    mine = torch.tensor([status], dtype=torch.uint8, device=device)
    out = [torch.zeros(1, dtype=torch.uint8, device=device) for _ in range(world)]
    work = _waiting(stage, lambda: torch.distributed.all_gather(out, mine, async_op=True), call)
    if status == _INTERRUPTED:
        return [status]
    store, sequence = _store(), _sequence
    try:
        with _signals_live():
            if _held:  # the signal came while the status was being posted: answered as in the wait
                _held.clear()
                raise KeyboardInterrupt
            _poll(stage, lambda sleep: work.is_completed() or _slept(sleep), sequence - 1, _IN_PREVIOUS_STEP)
    except KeyboardInterrupt:
        if _leave(store, sequence, work):
            raise
        if _held is None:  # nothing holds a signal to the next step: raise after the step, as before
            _waiting(stage, work.wait, call)  # every status is posted: this completes at once
            raise
        _held.append(signal.SIGINT)  # the peers go on to the next step; this rank stops there, with them
    _waiting(stage, work.wait, call)
    _seal(store, sequence, stage)
    return [int(t.item()) for t in out]


#: How a peer's notice is described when it left in the previous step's wait or job-wide exchange.
_IN_PREVIOUS_STEP = " while waiting for the others in the previous step"


def _slept(seconds: float) -> bool:
    """Sleeps (a signal's handler runs, and raises, in the sleep); False, for :func:`_poll`'s ``done``."""
    time.sleep(seconds)
    return False


def _poll(stage: str, done: Callable[[float], bool], sequence: int, where: str = "") -> None:
    """Wait until ``done(sleep)`` says so (it waits up to ``sleep`` seconds itself; the sleeps double from 0.1 ms to
    ``_POLL_SECONDS``), looking every ``_NOTICE_SECONDS`` for a peer's interrupt notice of step ``sequence``, which
    raises ``PeerInterrupted`` naming it (``where`` says where it was interrupted); a peer silent for
    ``liveness.silence_s()`` seconds (or the store, seen from a node cut off) raises ``PeerLost`` naming it."""
    looked = time.monotonic()
    sleep = 0.0001
    while not done(sleep):
        sleep = min(sleep * 2, _POLL_SECONDS)
        now = time.monotonic()
        if now - looked >= _NOTICE_SECONDS:
            looked = now
            lost = liveness.verdict(stage)
            if lost is not None:
                raise lost
            noticed = liveness.ask(lambda store: _notice(store, sequence))
            if noticed is not None:
                raise _peer_interrupted(stage, noticed, where)


def _peer_interrupted(stage: str, notice: str, where: str) -> errors.PeerInterrupted:
    """The ``PeerInterrupted`` for a peer's notice ("rank r")."""
    rank = int(notice.split()[-1])
    return errors.PeerInterrupted(
        f"{stage}: rank {rank} was interrupted (KeyboardInterrupt){where}; every rank stops", [rank]
    )


def _claim(store: Any, sequence: int, value: str) -> str | None:
    """Writes ``value`` to step ``sequence``'s settlement key unless a value is there already (``compare_set``:
    the first writer wins); returns the value the key holds, None without a store that settles."""
    if store is None:
        return None
    try:
        return str(store.compare_set(f"{_SEAL_KEY}{_call}/{sequence}", "", value).decode())
    except (RuntimeError, ValueError, NotImplementedError):  # a store without compare_set: as without a store
        return None


def _leave(store: Any, sequence: int, work: Any) -> bool:
    """Whether this rank, interrupted while it waits for step ``sequence``'s statuses, leaves now: it writes
    "rank r" to the step's key; if that is first, it leaves (and leaves the notice the peers' waits look for);
    if a peer sealed the step first (:func:`_seal`), every status is posted and that peer goes on to the next
    collective, so this rank must stay for it (False; also when its gather has already completed). Without a
    store it just leaves (the peers then wait in their next collective until the process group's timeout,
    which names it)."""
    if work.is_completed():
        return False
    me = f"rank {torch.distributed.get_rank()}"
    got = _claim(store, sequence, me)
    if got == me:
        with contextlib.suppress(RuntimeError, ValueError):
            store.set(f"{_NOTICE_KEY}{_call}/{sequence}", me)
    return got != _SEALED


def _seal(store: Any, sequence: int, stage: str) -> None:
    """This rank finished step ``sequence``: it writes "sealed" to the step's key; a peer's "rank r" there
    instead means that peer left while waiting and no rank has gone past this step, so this one raises
    ``PeerInterrupted`` naming it before entering anything else."""
    got = _claim(store, sequence, _SEALED)
    if got is not None and got != _SEALED:
        raise _peer_interrupted(stage, got, " while waiting for the others")


#: How long a rank holding a signal looks for a peer's notice of the previous step before it posts its status.
_LEFT_WAIT_SECONDS = 0.05


def _peer_left_last_step() -> bool:
    """Whether a peer raised in the job-wide exchange after the previous step (its notice is in the store,
    written within milliseconds of the signal that also reached this rank): such a peer never posts a status
    for this step. (A peer that left while waiting in the previous step itself was settled there.)"""
    if _store() is None:
        return False
    deadline = time.monotonic() + _LEFT_WAIT_SECONDS
    while True:
        if liveness.ask(lambda store: _notice(store, _sequence - 1)) is not None:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)


def wait_work(stage: str, work: Any, peer: int, timeout_s: float | None = None) -> None:
    """Wait for a point-to-point ``work`` (an ``isend``/``irecv`` with ``peer``) between two agreements so that
    this rank still answers a signal: the blocking ``wait`` runs in a helper thread (gloo's point-to-point work
    reports completion only through ``wait``) while this thread sleeps in short steps. Called inside
    :func:`exchanging` (which leaves the notice when a signal raises here); a peer's notice of this step ends
    the wait with ``PeerInterrupted`` naming it, and the work's own error (a lost peer, ``timeout_s`` passed)
    is raised."""
    done = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            work.wait() if timeout_s is None else work.wait(timedelta(seconds=timeout_s))
        except BaseException as exc:  # handed to the waiting thread
            failure.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name=f"hp_fastload-wait-{peer}", daemon=True).start()
    with _signals_live():
        _poll(stage, done.wait, _sequence)  # a signal's handler runs (and raises) in the wait
    if failure:
        raise failure[0]


_COLLECTIVE_FAILURES = ("gloo", "nccl", "connection closed", "connection reset", "timed out", "timeout", "processgroup")


def _waiting(stage: str, collective: Callable[[], Any], call: str = "hp_fastload.load (or from_pretrained)") -> Any:
    """Run a collective of ``load``; when it fails because another rank is not there, say so.

    Every rank of the default process group must call ``load`` together: a rank that skipped the call, failed
    before it or exited leaves the others waiting in their first collective until the peer's connection closes
    or the process group's timeout (``init_process_group(timeout=...)``) expires.
    """
    try:
        return collective()
    except RuntimeError as exc:
        distributed = getattr(torch.distributed, "DistError", ())
        if not (isinstance(exc, distributed) or any(m in str(exc).lower() for m in _COLLECTIVE_FAILURES)):
            raise
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        notices: list[str] = []
        if _store() is not None and liveness.store_answering():
            for step in (_sequence - 1, _sequence):
                noticed = liveness.ask(lambda store, step=step: _notice(store, step))  # type: ignore[misc]
                if noticed:
                    notices.append(noticed)
        if notices:
            raise errors.PeerInterrupted(
                f"{call.split()[0]}: rank {rank} of {world} waited for the other ranks while {stage.lower()} and "
                f"the collective failed ({str(exc).splitlines()[0][:300]}): {notices[0]} was interrupted "
                "(KeyboardInterrupt) while it waited for the others",
                [int(notices[0].split()[-1])],
            ) from exc
        text = (
            f"{call.split()[0]}: rank {rank} of {world} waited for the other ranks while {stage.lower()} and "
            f"the collective failed ({str(exc).splitlines()[0][:300]}). Every rank of the default process group "
            f"must call {call} together; a rank that skipped the call, failed before it or exited makes the "
            "others wait until the process group's timeout"
        )
        lost = exc if isinstance(exc, errors.PeerLost) else liveness.verdict_after_error(stage, exc)
        if lost is not None:
            raise errors.PeerLost(f"{text}. {lost}", lost.ranks, lost.nodes) from exc
        raise RuntimeError(text) from exc


def gather_floats(stage: str, values: list[float]) -> list[list[float]]:
    """Every rank's ``values`` (the same count on every rank), in one all-gather that this rank polls as it
    polls an agreement's statuses: a peer that went silent meanwhile raises ``PeerLost`` naming it."""
    if not dist_active():
        return [list(values)]
    world = torch.distributed.get_world_size()
    mine = torch.tensor(values, dtype=torch.float64)
    out = [torch.zeros(len(values), dtype=torch.float64) for _ in range(world)]
    work = _waiting(stage, lambda: torch.distributed.all_gather(out, mine, async_op=True))
    _poll(stage, lambda sleep: work.is_completed() or _slept(sleep), _sequence)
    _waiting(stage, work.wait)
    return [t.tolist() for t in out]


def gather_digests(stage: str, digest: bytes) -> list[bytes]:
    """Every rank's ``digest`` (the same length on every rank), in one all-gather of fixed-size tensors on the
    device torch's object collectives use, polled as an agreement's statuses are (a peer that went silent raises
    ``PeerLost``)."""
    if not dist_active():
        return [digest]
    device = _status_device()
    mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8).to(device)
    out = [
        torch.zeros(len(digest), dtype=torch.uint8, device=device) for _ in range(torch.distributed.get_world_size())
    ]
    with interrupts_deferred():  # a collective left half done would put this rank out of step for good
        work = _waiting(stage, lambda: torch.distributed.all_gather(out, mine, async_op=True))
    _poll(stage, lambda sleep: work.is_completed() or _slept(sleep), _sequence)
    _waiting(stage, work.wait)
    return [bytes(t.cpu().tolist()) for t in out]


def agree_digest(stage: str, digest: bytes, hint: str) -> None:
    """Every rank compares ``digest`` (the same length on every rank: one fixed-size all-gather,
    ``gather_digests``): a ``PlanError`` on every rank naming the ranks whose value differs from rank 0's,
    followed by ``hint``."""
    digests = gather_digests(stage, digest)
    differing = [r for r, d in enumerate(digests) if d != digests[0]]
    if differing:
        raise errors.PlanError(f"{stage}: the ranks disagree (rank 0 vs ranks {differing[:8]}): {hint}")


def resolve_location_each(path: str | os.PathLike[str], revision: str | None) -> Location:
    """Every rank resolves its own ``path`` (a relative path against its own working directory): rank 0
    first, then the others, a Hub id from the cache rank 0 has just filled when they share it. A failure on
    any rank makes every rank raise. The ranks' checkpoints are compared later (``dist.identity.agree_checkpoint``)."""
    if not dist_active() or torch.distributed.get_world_size() == 1:
        return resolve_checkpoint_location(path, revision=revision)
    first = torch.distributed.get_rank() == 0
    location = agree(
        "Resolving the checkpoint on rank 0",
        lambda: resolve_checkpoint_location(path, revision=revision) if first else None,
    )
    resolved: Location = agree(
        "Resolving the checkpoint",
        lambda: location if first else resolve_checkpoint_location(path, revision=revision, cache_first=True),
    )
    return resolved


def raised_on(stage: str, rank: int, failure: errors.Carried) -> Exception:
    """The exception a rank raises for a step that failed on ``rank`` (``failure``, from ``errors.carried``): the
    same class as there (one of ``errors.ERROR_TABLE``, else the nearest builtin class), with its fields and the
    message ``"{stage} failed on rank {rank}: {its class}: {its message}"``."""
    return errors.rebuilt(failure, f"{stage} failed on rank {rank}: {failure.name}: ")
