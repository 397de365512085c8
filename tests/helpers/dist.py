"""Multi-process test harness: run one function on ``world_size`` ranks (forked processes) of a real process group.

Usage::

    from tests.helpers.dist import run_distributed, run_subchecks, subcheck_values

    def _body(rank: int, world_size: int, n: int) -> int:  # module level: the children import it by name
        return rank * n

    assert run_distributed(_body, 2, 10) == [0, 10]

Semantics of :func:`run_distributed`:

- ``world_size`` processes are started with ``torch.multiprocessing``, start method ``forkserver``: one server
  per test session imports torch once (``FORKSERVER_PRELOAD``) and each rank is forked from it, with the
  parent's environment of the moment (copied into the rank) plus ``OMP_NUM_THREADS=1`` and one intra-op thread.
  ``HP_FASTLOAD_TEST_SPAWN=1`` spawns every rank afresh instead (5-6 CPU s of ``import torch`` each).
  The parent hosts the run's ``TCPStore`` (127.0.0.1, a port the kernel picks) for the whole run; rank ``r``
  runs ``init_process_group(backend, store=..., rank=r, world_size=world_size)``, calls ``fn(rank,
  world_size, *args, **kwargs)``, sends back the result (pickled by value with the standard pickler, so
  tensors survive the child's exit), destroys the group and exits. (With rank 0 hosting the store, a peer
  still joining a group rank 0 is not in, as a size-1 mesh dimension makes one per rank, lost the store when
  rank 0 left: gloo's "Broken pipe" / "Connection reset by peer" in ``new_group``.)
- The call returns the results as a list indexed by rank.
- If any rank raises (or dies), the harness waits a short grace period for the other ranks (a peer of a
  failed rank usually fails too, once gloo notices the closed connection), kills the rest, and raises one
  ``AssertionError`` that lists every rank's exception and traceback.
- If the whole run exceeds ``timeout`` seconds, every child is killed and ``AssertionError`` is raised. The
  message includes the Python stacks of the hung ranks (dumped by ``faulthandler`` shortly before the
  deadline). The harness never hangs.
- ``timeout`` and ``backend`` are the harness's own keywords; every other keyword goes to ``fn``. A run whose
  rendezvous port was taken in the meantime (``EADDRINUSE``) is retried with a new port.

A rank costs a fraction of a second from the fork server (a spawned one pays 5-6 CPU seconds of ``import
torch``), but a rank's test module and the libraries it imports (transformers) are imported afresh per run,
so run many checks in one run:
pass :func:`run_subchecks` as ``fn`` with a list of module-level check functions
(``run_distributed(run_subchecks, 4, checks=[check_a, check_b])``, typically in a module-scoped fixture);
each check runs on every rank, its failures are caught per check, and :func:`subcheck_values` turns the
per-rank outcomes of one check into values (or one assertion naming the failing ranks). A check that
raises on some ranks but not others can desynchronise later collectives; the timeout still bounds that case.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import os
import pickle
import queue as queue_mod
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

__all__ = [
    "SubcheckOutcome",
    "find_free_port",
    "run_distributed",
    "run_subchecks",
    "subcheck_values",
]

#: Seconds to wait for the remaining ranks once one rank has failed.
ERROR_GRACE_S = 10.0


def find_free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def child_environment(values: Mapping[str, str]) -> Iterator[None]:
    """Set environment variables while children are started (spawned children inherit ``os.environ``)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


#: What the fork server imports once: torch's and transformers' imports are most of a rank's start (about 4 CPU s
#: each here). transformers and huggingface_hub read the environment when imported (HF_HOME, HF_HUB_CACHE, the
#: offline flags), so the server is restarted when a run's values of those variables differ from the ones it
#: imported them with (see ``_IMPORT_ENV_PREFIXES``).
FORKSERVER_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.tensor.parallel",
    "torch.distributed.fsdp",
    "numpy",
    "safetensors.torch",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto",
    "hp_fastload",
]
#: Prefixes of the environment variables that the preloaded modules read when imported.
_IMPORT_ENV_PREFIXES = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "XDG_", "TORCH", "PYTORCH_", "USE_")
_ctx: Any = None
_server_env: dict[str, str] | None = None


def _import_environment() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if key.startswith(_IMPORT_ENV_PREFIXES)}


def _context() -> Any:
    """``forkserver`` (torch and transformers imported once), or ``spawn`` with ``HP_FASTLOAD_TEST_SPAWN=1``.

    A fork server whose preloaded modules were imported under other values of the variables they read at
    import (``_IMPORT_ENV_PREFIXES``) is stopped first; the next rank started launches a fresh one."""
    global _ctx, _server_env
    if _ctx is None:
        if os.environ.get("HP_FASTLOAD_TEST_SPAWN") == "1":
            _ctx = mp.get_context("spawn")
        else:
            _ctx = mp.get_context("forkserver")
            _ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    if _ctx.get_start_method() == "forkserver":
        env = _import_environment()
        if _server_env is not None and env != _server_env:
            from multiprocessing import forkserver

            forkserver._forkserver._stop()  # the stdlib's own tests stop the server this way
        _server_env = env
    return _ctx


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout: float,
    wall_deadline: float,
    stack_file: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    results: Any,
    environ: Mapping[str, str],
) -> None:
    """Child process body: take the parent's environment, join the group, run ``fn``, report
    ``("ok"|"error", payload)`` on the queue."""
    os.environ.clear()
    os.environ.update(environ)  # a forked rank has the fork server's environment, not the test's
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # torch read OMP_NUM_THREADS when the fork server imported it

    with open(stack_file, "w") as stacks:
        # Dump this rank's stacks shortly before the parent gives up on it, so a hang is diagnosable.
        dump_in = max(0.5, wall_deadline - 1.5 - time.time())
        faulthandler.dump_traceback_later(dump_in, exit=False, file=stacks)
        try:
            # The parent hosts the store (see _spawn_once): it outlives every rank.
            store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=timeout))
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
            )
            value = fn(rank, world_size, *args, **kwargs)
            message: tuple[int, str, Any] = (rank, "ok", pickle.dumps(value))
        except BaseException as exc:  # report everything, including SystemExit / KeyboardInterrupt
            text = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            message = (rank, "error", text)
        finally:
            faulthandler.cancel_dump_traceback_later()
        try:
            results.put(message)
        except Exception as exc:  # unpicklable payload and the like
            results.put((rank, "error", f"could not send the result: {exc!r}"))
        with contextlib.suppress(Exception):
            if dist.is_initialized():
                dist.destroy_process_group()


def _stop(procs: Sequence[Any]) -> None:
    """Terminate, then kill, every child still alive; reap them all."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + 3.0
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)


@dataclasses.dataclass
class _Attempt:
    """What one spawn of the ranks produced."""

    outcomes: dict[int, tuple[str, Any]]
    missing: list[int]
    stacks: dict[int, str]
    timed_out: bool
    elapsed: float

    @property
    def errors(self) -> dict[int, str]:
        return {rank: payload for rank, (kind, payload) in self.outcomes.items() if kind == "error"}

    @property
    def port_clash(self) -> bool:
        """True when the rendezvous port was taken by someone else between probing and binding."""
        text = "\n".join(self.errors.values()).lower()
        return "address already in use" in text or "eaddrinuse" in text


def _spawn_once(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    timeout: float,
    backend: str,
) -> _Attempt:
    import torch.distributed as dist

    ctx = _context()
    results: Any = ctx.Queue()
    # The run's store lives here, not in rank 0: a rank may still need it after rank 0 has returned and left
    # (a peer joining a process group rank 0 is not in, as a size-1 mesh dimension makes one per rank, does its
    # rendezvous through the store; with rank 0 hosting it, that peer failed with "Broken pipe" / "Connection
    # reset by peer" in new_group), while a check may rely on rank 0 leaving to fail a peer's collective.
    store = dist.TCPStore(
        "127.0.0.1", 0, world_size, is_master=True, timeout=timedelta(seconds=timeout), wait_for_workers=False
    )
    port = store.port
    start = time.monotonic()
    deadline = start + timeout
    wall_deadline = time.time() + timeout
    with tempfile.TemporaryDirectory(prefix="hp_fastload_dist_") as tmp:
        stack_files = [os.path.join(tmp, f"rank{rank}.stacks") for rank in range(world_size)]
        procs = []
        env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
        with child_environment(env):
            for rank in range(world_size):
                worker_args = (rank, world_size, port, backend, timeout, wall_deadline, stack_files[rank])
                environ = dict(os.environ)
                proc = ctx.Process(target=_worker, args=(*worker_args, fn, args, kwargs, results, environ), daemon=True)
                proc.start()
                procs.append(proc)

        outcomes: dict[int, tuple[str, Any]] = {}
        first_error_at: float | None = None
        timed_out = False

        def record(rank: int, kind: str, payload: Any) -> None:
            nonlocal first_error_at
            outcomes[rank] = (kind, payload)
            if kind == "error" and first_error_at is None:
                first_error_at = time.monotonic()

        try:
            while len(outcomes) < world_size:
                now = time.monotonic()
                if now >= deadline:
                    timed_out = True
                    break
                if first_error_at is not None and now >= first_error_at + ERROR_GRACE_S:
                    break
                try:
                    record(*results.get(timeout=0.1))
                except queue_mod.Empty:
                    # A child that died without reporting (segfault, os._exit, kill) fails the run.
                    for rank, proc in enumerate(procs):
                        if rank not in outcomes and not proc.is_alive() and proc.exitcode is not None:
                            # Give a message still in the pipe a moment to arrive before declaring the death.
                            with contextlib.suppress(queue_mod.Empty):
                                record(*results.get(timeout=0.5))
                            if rank not in outcomes:
                                record(rank, "error", f"process died with exit code {proc.exitcode}")
        finally:
            if not timed_out and first_error_at is None:
                # Healthy ranks exit on their own right after reporting; let them tear down cleanly.
                for proc in procs:
                    proc.join(max(0.0, min(5.0, deadline - time.monotonic())))
            _stop(procs)
            results.close()
            results.join_thread()
            del store

        missing = [rank for rank in range(world_size) if rank not in outcomes]
        stacks: dict[int, str] = {}
        for rank in missing:
            stacks[rank] = ""
            with contextlib.suppress(OSError), open(stack_files[rank]) as fh:
                stacks[rank] = fh.read().strip()
    return _Attempt(outcomes, missing, stacks, timed_out, time.monotonic() - start)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` spawned ranks; return results by rank.

    ``fn``, ``args`` and ``kwargs`` must be picklable (``fn`` a module-level function); so must the results.
    Raises ``AssertionError`` naming every failing rank (with tracebacks) or the ranks that exceeded
    ``timeout``. A run whose rendezvous port was stolen in the meantime is retried (twice at most).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    for _ in range(3):
        attempt = _spawn_once(fn, world_size, args, kwargs, timeout, backend)
        if not attempt.port_clash:
            break
    errors = attempt.errors
    if attempt.timed_out or errors or attempt.missing:
        if attempt.timed_out:
            lines = [f"run_distributed({fn.__name__}) timed out after {attempt.elapsed:.1f}s (timeout={timeout}s)"]
        else:
            lines = [f"run_distributed({fn.__name__}) failed on {len(errors)} of {world_size} rank(s)"]
        for rank in sorted(errors):
            lines.append(f"--- rank {rank} raised:\n{errors[rank]}")
        reason = "killed at the timeout" if attempt.timed_out else "killed after another rank failed"
        for rank in attempt.missing:
            stacks = attempt.stacks[rank] or "<none dumped>"
            lines.append(f"--- rank {rank} did not finish ({reason}); stacks:\n{stacks}")
        raise AssertionError("\n".join(lines))
    return [pickle.loads(attempt.outcomes[rank][1]) for rank in range(world_size)]


@dataclasses.dataclass(frozen=True)
class SubcheckOutcome:
    """What one sub-check produced on one rank: its value, or the formatted exception."""

    ok: bool
    value: Any = None
    error: str = ""
    seconds: float = 0.0


def run_subchecks(
    rank: int, world_size: int, checks: Sequence[Callable[[int, int], Any]]
) -> dict[str, SubcheckOutcome]:
    """Run every ``check(rank, world_size)`` in order on this rank; map ``check.__name__`` to its outcome.

    Pass it as ``fn`` to :func:`run_distributed`; a failing check does not stop the others.
    """
    out: dict[str, SubcheckOutcome] = {}
    for check in checks:
        t0 = time.perf_counter()
        try:
            value = check(rank, world_size)
            out[check.__name__] = SubcheckOutcome(True, value, seconds=time.perf_counter() - t0)
        except Exception as exc:
            text = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            out[check.__name__] = SubcheckOutcome(False, error=text, seconds=time.perf_counter() - t0)
    return out


def subcheck_values(per_rank: Sequence[Mapping[str, SubcheckOutcome]], name: str) -> list[Any]:
    """Values of sub-check ``name`` on every rank; ``AssertionError`` with each failing rank's traceback."""
    failures = []
    values = []
    for rank, outcomes in enumerate(per_rank):
        if name not in outcomes:
            failures.append(f"--- rank {rank}: sub-check {name!r} did not run")
            continue
        outcome = outcomes[name]
        if not outcome.ok:
            failures.append(f"--- rank {rank}:\n{outcome.error}")
        values.append(outcome.value)
    if failures:
        raise AssertionError(f"sub-check {name!r} failed:\n" + "\n".join(failures))
    return values
