"""A bounded agreement for a step that runs the user's code (``from_pretrained``'s ``parallelize``): the outcomes
travel through the process group's store, never through a collective, so a rank whose step failed is not left
waiting in a collective while a peer waits in a different one inside the user's code.

The protocol, every rank: run the step; post its outcome (ok, or the exception as ``errors.carried`` gives it)
under a key of this call in the default store; then

- a rank whose step failed waits for the others' outcomes at most ``peer_wait_s()`` seconds (a few seconds,
  far below the process group's timeout), then raises: its own error, naming itself and the ranks that had not
  finished the step (those are waiting in a collective of the user's code that this rank will never join);
- a rank whose step succeeded waits for the others' outcomes (at most the process group's timeout: a healthy
  peer may be slow) and raises as soon as one of them is a failure, naming the rank and its error;
- while the step runs, a watcher thread reads the peers' outcomes as they arrive. A rank held inside the
  user's code by a collective that a failed peer never joins cannot be interrupted (a blocked gloo or NCCL
  call returns only when the peer's connection closes or at the process group's timeout); the watcher
  prints the peer's failure at once, and when the collective fails (the failed rank's process exits and
  closes its connections), this rank raises the peer's error, not a bare "connection closed".

Owns no collective and no planning; ``agree`` (the all-gather agreement) stays the protocol of ``load``.
"""

from __future__ import annotations

import itertools
import json
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from hp_fastload import errors
from hp_fastload.dist.agree import raised_on
from hp_fastload.runtime import dist_active, env_seconds

__all__ = ["PEER_WAIT_ENV", "agree_bounded", "peer_wait_s"]

#: Seconds a rank whose step failed waits for the others before raising (default 10).
PEER_WAIT_ENV = "HP_FASTLOAD_PEER_WAIT_S"
_POLL_S = 0.05
#: The final wait for the peers' outcomes starts polling the store this often and backs off to ``_POLL_S``: the
#: peers usually finish within milliseconds of this rank, and a fixed 50 ms poll added ~25 ms a step on average.
_FIRST_POLL_S = 0.0005
_CALLS = itertools.count()


def peer_wait_s() -> float:
    """``HP_FASTLOAD_PEER_WAIT_S`` (seconds, > 0), default 10."""
    return env_seconds(PEER_WAIT_ENV, 10.0)


def _group_timeout_s() -> float:
    from torch.distributed.distributed_c10d import _get_default_group

    timeout = getattr(getattr(_get_default_group(), "options", None), "_timeout", None)
    return timeout.total_seconds() if isinstance(timeout, timedelta) else 1800.0


class _Watcher:
    """Reads the peers' outcomes from the store while this rank runs its step; prints a peer's failure once."""

    def __init__(self, store: Any, keys: dict[int, str], stage: str, me: int) -> None:
        self.store, self.keys, self.stage, self.me = store, keys, stage, me
        self.seen: dict[int, errors.Carried | None] = {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="hp_fastload-agree-watch", daemon=True)

    def _run(self) -> None:
        while not self.done.wait(_POLL_S):
            try:
                self.poll()
            except Exception:  # the store went away (its host exited): the main thread reports it
                return
            failed = [rank for rank, item in self.seen.items() if item is not None]
            if failed:
                failure = self.seen[failed[0]]
                assert failure is not None
                first_line = failure.message.split("\n", 1)[0]
                print(
                    f"hp_fastload: {self.stage.lower()} failed on rank {failed[0]} ({failure.name}: {first_line}); "
                    f"rank {self.me} is still inside that step, presumably waiting in a collective rank {failed[0]} "
                    "will not join. It raises when the collective fails: when that rank's process exits, or at the "
                    "process group's timeout",
                    file=sys.stderr,
                    flush=True,
                )
                return

    def poll(self) -> None:
        for rank, key in self.keys.items():
            if rank not in self.seen and self.store.check([key]):
                item = json.loads(self.store.get(key).decode())
                self.seen[rank] = None if item is None else errors.Carried(*item)


def agree_bounded(stage: str, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on every rank of the default process group; if it fails on any rank, every rank raises,
    naming the first failing rank and its error, without entering a collective (see the module's docstring)."""
    if not dist_active() or torch.distributed.get_world_size() == 1:
        return fn()
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    me, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    prefix = f"hp_fastload/agree_bounded/{next(_CALLS)}"
    keys = {rank: f"{prefix}/{rank}" for rank in range(world) if rank != me}
    watcher = _Watcher(store, keys, stage, me)
    watcher.thread.start()
    result, failure = None, None
    try:
        result = fn()
    except Exception as exc:
        failure = exc
    finally:
        watcher.done.set()
        watcher.thread.join()
    payload = None if failure is None else errors.carried(failure)
    try:
        store.set(f"{prefix}/{me}", json.dumps(payload))
        _collect(watcher, failure is not None)
    except Exception as exc:
        if failure is None and not _peer_failure(watcher) and _is_store_error(exc):
            raise RuntimeError(
                f"hp_fastload.from_pretrained: rank {me} of {world} lost the other ranks while {stage.lower()} "
                f"({str(exc).splitlines()[0][:300]}): the store's host (rank 0) exited?"
            ) from exc
        if not _is_store_error(exc):
            raise
    peer = _peer_failure(watcher)
    if failure is not None:
        if peer is not None and _is_store_error(failure):
            # This rank's collective failed because a peer that had failed left it: the peer's error is the cause.
            raise raised_on(stage, peer[0], peer[1]) from failure
        missing = sorted(rank for rank in keys if rank not in watcher.seen)
        if missing:
            note = (
                f" (ranks {missing} had not finished this step {peer_wait_s():g} s later: they wait in a collective "
                f"of this step that rank {me} will not join, and are released when this process exits)"
            )
            mine = errors.carried(failure)
            raise raised_on(stage, me, mine._replace(message=mine.message + note)) from failure
        raise failure
    if peer is not None:
        raise raised_on(stage, peer[0], peer[1])
    return result


def _collect(watcher: _Watcher, failed: bool) -> None:
    """Wait for every peer's outcome: ``peer_wait_s()`` after a failure here, else until one fails or all are
    in (at most the process group's timeout)."""
    deadline = time.monotonic() + (peer_wait_s() if failed else _group_timeout_s())
    sleep = _FIRST_POLL_S
    while True:
        watcher.poll()
        if len(watcher.seen) == len(watcher.keys) or (not failed and _peer_failure(watcher) is not None):
            return
        if time.monotonic() >= deadline:
            if not failed:
                missing = sorted(rank for rank in watcher.keys if rank not in watcher.seen)
                raise RuntimeError(
                    f"hp_fastload.from_pretrained: ranks {missing} did not finish the step ({watcher.stage.lower()}) "
                    "within the process group's timeout"
                )
            return
        time.sleep(sleep)
        sleep = min(sleep * 2, _POLL_S)


def _peer_failure(watcher: _Watcher) -> tuple[int, errors.Carried] | None:
    failed = sorted((rank, item) for rank, item in watcher.seen.items() if item is not None)
    return failed[0] if failed else None


def _is_store_error(exc: BaseException) -> bool:
    """A failure of the store or of a collective (a peer gone, a timeout), not of the user's own code."""
    distributed = getattr(torch.distributed, "DistError", ())
    text = str(exc).lower()
    return isinstance(exc, distributed) or any(m in text for m in ("connection", "store", "broken pipe", "timed out"))
