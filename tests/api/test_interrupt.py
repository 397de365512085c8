"""Ctrl-C during long calls: ``read_many``, ``load`` (one process; two gloo ranks) and ``save`` answer SIGINT with
``KeyboardInterrupt`` within 0.2 s of the signal, leave no descriptor or map of the checkpoint behind, leave nothing
at a save's path (a previous directory untouched, no temporary sibling), and the next call in the same process
works.

The calls are made long by size: a sparse checkpoint (zeros, no disk blocks) of 256 MiB read cold with
``backend="pread"`` (its page cache dropped with ``posix_fadvise`` first), and a 256 MiB model saved to
``/dev/shm`` where there is one (tmpfs: the writes are the call, not an ``fsync`` to disk, which no signal can
shorten). Each call is timed uninterrupted first; the signal is sent a third of that time into the same call,
from a timer thread of the process itself, and the test asserts the call was cut short (bytes left unread;
nothing published at a save's path), not raised after it finished. The signals go to child
processes (one ``python -c`` for the single-process calls, two spawned ranks for the distributed load): a
SIGINT that missed would otherwise stop pytest itself.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.dist import run_distributed

ROWS, COLS = 32768, 4096  # bf16: 256 MiB
LATENCY_S = 0.2
REPO = Path(__file__).resolve().parents[2]


def _sparse_checkpoint(directory: Path, rows: int = ROWS, cols: int = COLS) -> Path:
    """A one-tensor ``model.safetensors`` (``w``: bf16 zeros) whose data is a hole: no disk blocks."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "model.safetensors"
    nbytes = rows * cols * 2
    header = json.dumps({"w": {"dtype": "BF16", "shape": [rows, cols], "data_offsets": [0, nbytes]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + nbytes)
    return path


def _evict(path: Path) -> None:
    """Drops the file's clean pages from the page cache (no privileges needed), so the next read is cold."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _held(root: Path) -> dict[str, list[str]]:
    """This process's descriptors and maps of anything under ``root``."""
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed since
            continue
        if target.startswith(str(root)):
            fds.append(target)
    with open("/proc/self/maps", encoding="utf-8") as f:
        maps = [line.split()[-1] for line in f if str(root) in line]
    return {"fds": fds, "maps": maps}


def _interrupted(call: Any, after: float) -> dict[str, Any]:
    """Runs ``call()`` with SIGINT sent to this process ``after`` seconds in: the seconds from the signal to
    the ``KeyboardInterrupt`` (None when none came) and the call's seconds. A ``PeerInterrupted`` (another
    rank's signal stopped the call first) is an outcome too: the signal still comes, and is taken here."""
    from hp_fastload.errors import PeerInterrupted

    sent: list[float] = []

    def fire() -> None:
        sent.append(time.perf_counter())
        os.kill(os.getpid(), signal.SIGINT)

    # A process started with SIGINT ignored (a background job of a non-interactive shell, as CI runners may start
    # the suite) passes that on to its children, and Python then installs no KeyboardInterrupt handler: answer
    # SIGINT as an interactive Python does, for this call.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(after, fire)
    start = time.perf_counter()
    timer.start()
    where = ""
    try:
        try:
            outcome = f"returned {call()!r}"[:200]
        except KeyboardInterrupt as exc:
            outcome = "KeyboardInterrupt"
            where = " <- ".join(
                f"{Path(f.filename).name}:{f.lineno} {f.name}"
                for f in traceback.extract_tb(exc.__traceback__)[::-1][:4]
            )
        except PeerInterrupted as exc:
            outcome = f"PeerInterrupted {exc.ranks}: {exc}"[:300]
        ended = time.perf_counter()
        try:
            timer.join()
            time.sleep(0.05)  # a signal that came after the call is raised here, not in the caller
        except KeyboardInterrupt:
            outcome += " (the signal came after)"
    finally:
        signal.signal(signal.SIGINT, previous)
    latency = ended - sent[0] if sent else None
    return {"outcome": outcome, "latency": latency, "seconds": ended - start, "raised_at": where}


def _timed(call: Any) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def _cut_short(call: Any, full: float, prepare: Any, unread: Any) -> dict[str, Any]:
    """``_interrupted(call, ...)`` after ``prepare()``, the signal a third of ``full`` into the call, and
    ``left_unread``: ``unread()`` after it. A call that had read everything before the signal came (a cold read
    runs several times faster than the uninterrupted runs now and then on a shared machine) proves nothing
    about cutting one short: it is made again with the signal earlier (a sixth, then a twelfth of ``full``)."""
    for fraction in (3, 6, 12):
        prepare()
        cut = _interrupted(call, full / fraction)
        cut["left_unread"] = bool(unread())
        if cut["left_unread"] or cut["outcome"] != "KeyboardInterrupt":
            break
    cut["full"] = full
    cut["fraction"] = fraction
    return cut


def _uninterrupted(call: Any, prepare: Any) -> float:
    """The call's seconds uninterrupted, each run after ``prepare()`` as the interrupted run will be: the faster
    of two, so that a first call's one-time costs (imports, caches) do not place the signal after the end of the
    interrupted call."""
    times = []
    for _ in range(2):
        prepare()
        times.append(_timed(call))
    return min(times)


class _Big(torch.nn.Module):
    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(rows, cols, dtype=torch.bfloat16))


def single_process_checks(root: str) -> dict[str, Any]:
    """The child of ``test_single_process_calls``: read_many, load and save, each uninterrupted, interrupted,
    then again."""
    import hp_fastload as hf

    base = Path(root)
    ckpt = base / "ckpt"
    path = _sparse_checkpoint(ckpt)
    out: dict[str, Any] = {}

    out_t = torch.ones(ROWS, COLS, dtype=torch.bfloat16)

    def read() -> Any:
        return hf.read_many([(path, "w", (0, 0), (ROWS, COLS), out_t)], backend="pread")

    def reset_read() -> None:
        out_t.fill_(1)
        _evict(path)

    full = _uninterrupted(read, lambda: _evict(path))
    cut = _cut_short(read, full, reset_read, lambda: (out_t == 1).any())
    cut["held"] = _held(base)
    _evict(path)
    read()
    cut["again_all_read"] = bool((out_t == 0).all())
    out["read_many"] = cut

    model = _Big(ROWS, COLS)

    def load() -> Any:
        return hf.load(model, ckpt, backend="pread").bytes_read

    def reset_load() -> None:
        with torch.no_grad():
            model.w.fill_(1)
        _evict(path)

    full = _uninterrupted(load, lambda: _evict(path))
    cut = _cut_short(load, full, reset_load, lambda: (model.w == 1).any())
    cut["held"] = _held(base)
    _evict(path)
    load()
    cut["again_all_read"] = bool((model.w == 0).all())
    out["load"] = cut

    shm = Path("/dev/shm")
    save_root = Path(tempfile.mkdtemp(dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else base))
    try:
        target = save_root / "saved"
        target.mkdir()
        (target / "previous.txt").write_text("the user's directory")
        del model
        model = _Big(ROWS, COLS)  # a fresh module: save reverts the rules a load recorded on a loaded one
        with torch.no_grad():
            model.w.fill_(2)

        def save() -> Any:
            return hf.save(model, target, overwrite=True).bytes_written

        hf.save(_Big(8, 8), save_root / "warm")  # transformers' imports: seconds, not the save's
        scratch = save_root / "first"
        full = _timed(lambda: hf.save(model, scratch))
        cut = _interrupted(save, full / 3)
        cut["full"] = full
        cut["held"] = _held(save_root)
        cut["at_path"] = sorted(p.name for p in target.iterdir())
        cut["siblings"] = sorted(p.name for p in save_root.iterdir())
        save()
        with open(target / "model.safetensors", "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            f.seek(8 + n)
            first = f.read(2)
        cut["again"] = sorted(p.name for p in target.iterdir())
        cut["again_value"] = float(torch.frombuffer(bytearray(first), dtype=torch.bfloat16)[0])
        out["save"] = cut
    finally:
        import shutil

        shutil.rmtree(save_root, ignore_errors=True)
    return out


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("interrupt")
    code = (
        "import json, sys; from tests.api.test_interrupt import single_process_checks as c; "
        f"print('RESULT', json.dumps(c({str(root)!r})))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=180, check=False
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"child failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    return result


def _check_cut(cut: dict[str, Any], name: str) -> None:
    assert cut["outcome"] == "KeyboardInterrupt", (name, cut)
    assert cut["latency"] < LATENCY_S, (name, cut)
    assert cut["held"] == {"fds": [], "maps": []}, (name, cut)


@pytest.mark.parametrize("call", ["read_many", "load"])
def test_a_read_is_interrupted_promptly_and_the_next_one_reads(single: dict[str, Any], call: str) -> None:
    cut = single[call]
    _check_cut(cut, call)
    assert cut["left_unread"], cut
    assert cut["again_all_read"], cut


def test_an_interrupted_save_leaves_the_previous_directory(single: dict[str, Any]) -> None:
    cut = single["save"]
    _check_cut(cut, "save")
    assert cut["at_path"] == ["previous.txt"], cut
    assert cut["siblings"] == ["first", "saved", "warm"], cut  # no temporary directory left
    assert cut["again"] == ["model.safetensors"], cut
    assert cut["again_value"] == 2.0, cut


def _one_sided(rank: int, call: Any, after: float) -> dict[str, Any]:
    """``call()`` on every rank, SIGINT sent to rank 0 only ``after`` seconds in: rank 0's ``_interrupted``
    outcome; another rank's outcome ("returned" or its ``PeerInterrupted``) and seconds."""
    import hp_fastload as hf

    if rank == 0:
        return _interrupted(call, after)
    start = time.perf_counter()
    try:
        call()
        got = {"outcome": "returned"}
    except hf.PeerInterrupted as exc:
        got = {"outcome": f"PeerInterrupted {exc.ranks}: {exc}"}
    got["seconds"] = time.perf_counter() - start
    return got


def _settling_checks(rank: int) -> dict[str, Any]:
    """The agreement protocol itself, two steps inside ``interrupts_between_steps``: rank 1 spends 1 s in step
    one while rank 0, done at once, waits for it and is interrupted 0.3 s in. Rank 0 leaves; rank 1 must raise
    ``PeerInterrupted`` when it finishes step one, before it posts anything for step two, so a collective after
    the call completes on both ranks with the right sum (a rank one collective ahead would hang or mix them
    up). Then the other order, settled directly: a rank that finished a step seals it first, and a rank
    interrupted afterwards while it still waits for that step learns it must stay for the next one."""
    from datetime import timedelta

    from hp_fastload.dist import agree as protocol

    def call() -> None:
        with protocol.interrupts_between_steps():
            protocol.agree("Step one", lambda: time.sleep(1.0 if rank == 1 else 0.0))
            protocol.agree("Step two", lambda: None)

    got = _one_sided(rank, call, 0.3)
    torch.distributed.monitored_barrier(timeout=timedelta(seconds=30))
    total = torch.tensor([rank + 1.0])
    torch.distributed.all_reduce(total)
    got["sum_after"] = float(total.item())

    class _Waiting:  # a step's gather still pending on the interrupted rank
        def is_completed(self) -> bool:
            return False

    with protocol.interrupts_between_steps():
        store = protocol._store()
        if rank == 1:
            protocol._seal(store, 7, "Step seven")  # raises PeerInterrupted if a leaver came first
            got["sealer_goes_on"] = True
        torch.distributed.barrier()
        if rank == 0:
            got["late_leaver_stays"] = not protocol._leave(store, 7, _Waiting())
    torch.distributed.barrier()

    # A job-wide exchange: rank 0 left it after a signal (its notice of the step is in the store, its
    # connections closed), and rank 1's next post to it fails in the transport: rank 1 raises PeerInterrupted
    # naming rank 0, and a transport error with no notice stays what it is.
    with protocol.interrupts_between_steps():
        if rank == 0:
            store = protocol._store()
            store.set(f"{protocol._NOTICE_KEY}{protocol._call}/{protocol._sequence}", "rank 0")
        torch.distributed.barrier()
        if rank == 1:
            got["lost_peer"] = _lost_in_exchange(protocol)
        torch.distributed.barrier()
    with protocol.interrupts_between_steps():
        if rank == 1:
            got["lost_quietly"] = _lost_in_exchange(protocol)
    torch.distributed.barrier()
    return got


def _lost_in_exchange(protocol: Any) -> str:
    """What a gloo transport error raised inside ``protocol.exchanging()`` comes out as: its type, the ranks of a
    ``PeerInterrupted``, and its message."""
    try:
        with protocol.exchanging():
            raise RuntimeError("Connection closed by peer [127.0.0.1]:1")
    except Exception as exc:  # the type is the outcome
        return f"{type(exc).__name__} {getattr(exc, 'ranks', '')}: {exc}"
    return "nothing raised"


def _rank_checks(rank: int, world: int, root: str) -> dict[str, Any]:
    """Each rank loads its Shard(0) half of the sparse checkpoint: uninterrupted, then SIGINT on both ranks
    (as a terminal's Ctrl-C or torchrun sends it), then SIGINT on rank 0 only, each followed by a load that
    must work."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import hp_fastload as hf

    base = Path(root)
    ckpt = base / "ckpt"
    if rank == 0:
        _sparse_checkpoint(ckpt)
    torch.distributed.barrier()
    path = ckpt / "model.safetensors"
    mesh = init_device_mesh("cpu", (world,))
    model = _Big(1, 1)
    local = torch.ones(ROWS // world, COLS, dtype=torch.bfloat16)
    model.w = torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False))

    def load() -> Any:
        return hf.load(model, ckpt, backend="pread").bytes_read

    def cold() -> None:
        torch.distributed.barrier()
        if rank == 0:
            _evict(path)
        torch.distributed.barrier()
        with torch.no_grad():
            local.fill_(1)

    out: dict[str, Any] = {"settling": _settling_checks(rank)}
    full = _uninterrupted(load, cold)
    cold()
    both = _interrupted(load, full / 3)
    both["full"] = full
    both["held"] = _held(base)
    cold()
    load()
    both["again_all_read"] = bool((local == 0).all())
    out["both"] = both
    cold()
    one = _one_sided(rank, load, full / 3)
    one["full"] = full
    one["held"] = _held(base)
    cold()
    load()
    one["again_all_read"] = bool((local == 0).all())
    out["one"] = one

    # The job-wide plan over a replicated tensor: each rank reads half and sends it to the other, so a signal
    # finds rank 0 reading, agreeing or waiting for rank 1's message; rank 0 only is interrupted.
    from torch.distributed.tensor import Replicate

    whole = torch.ones(ROWS, COLS, dtype=torch.bfloat16)
    model.w = torch.nn.Parameter(DTensor.from_local(whole, mesh, [Replicate()], run_check=False))

    def load_job() -> Any:
        return hf.load(model, ckpt, backend="pread", share="job").bytes_received

    def cold_job() -> None:
        cold()
        with torch.no_grad():
            whole.fill_(1)

    cold_job()
    start = time.perf_counter()
    received = load_job()
    first = time.perf_counter() - start
    all_read = bool((whole == 0).all())
    full = min(first, _uninterrupted(load_job, cold_job))
    cold_job()
    job = _one_sided(rank, load_job, full / 2)
    job["full"] = full
    job["held"] = _held(base)
    job["received"] = received
    job["all_read"] = all_read
    out["job"] = job  # last: a peer may still have a message posted that rank 0 never sent (docs: interrupts)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("interrupt-dist")
    return run_distributed(_rank_checks, 2, str(root), timeout=240)


def test_a_rank_that_leaves_while_waiting_stops_its_peers_before_their_next_collective(
    ranks: list[dict[str, Any]],
) -> None:
    mine = ranks[0]["settling"]
    assert mine["outcome"] == "KeyboardInterrupt" and mine["latency"] < LATENCY_S, mine
    other = ranks[1]["settling"]
    assert other["outcome"].startswith("PeerInterrupted (0,)"), other
    assert "Step one" in other["outcome"] and "rank 0" in other["outcome"], other
    assert [got["settling"]["sum_after"] for got in ranks] == [3.0, 3.0], ranks
    assert other["sealer_goes_on"] and ranks[0]["settling"]["late_leaver_stays"], ranks


def test_a_peer_gone_from_the_exchange_after_its_signal_is_named_as_interrupted(
    ranks: list[dict[str, Any]],
) -> None:
    """A transport error in the job-wide exchange (posting to a rank that left after its signal closed its
    connections) is the ``PeerInterrupted`` naming that rank when its notice is in the store, and the transport
    error itself when there is none."""
    lost = ranks[1]["settling"]["lost_peer"]
    assert lost.startswith("PeerInterrupted (0,):") and "rank 0" in lost and "exchange" in lost, lost
    quiet = ranks[1]["settling"]["lost_quietly"]
    assert quiet.startswith("RuntimeError : Connection closed by peer"), quiet


def test_a_two_rank_load_interrupted_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    """Each rank's SIGINT comes a third of its own uninterrupted time in, so the two signals are milliseconds
    apart. Each rank raises ``KeyboardInterrupt`` within the latency bound or, when the other rank's signal had
    already made it leave the step this one was finishing, ``PeerInterrupted`` naming that rank, before its own
    signal; at least one raises ``KeyboardInterrupt``; nothing stays open; the next load reads everything on
    both (the ranks stayed in step)."""
    by_peer = 0
    for rank, got in enumerate(ranks):
        both = got["both"]
        if both["outcome"].startswith("PeerInterrupted"):
            by_peer += 1
            assert both["outcome"].startswith(f"PeerInterrupted ({1 - rank},)"), both
            assert both["held"] == {"fds": [], "maps": []}, both
            assert both["seconds"] < both["full"] + 5, both
        else:
            _check_cut(both, f"rank {rank}")
        assert both["again_all_read"], (rank, got)
    assert by_peer < 2, ranks


def test_a_two_rank_load_interrupted_on_one_rank_raises_on_both(ranks: list[dict[str, Any]]) -> None:
    _check_cut(ranks[0]["one"], "rank 0")
    other = ranks[1]["one"]
    assert other["outcome"].startswith("PeerInterrupted (0,)"), other
    assert "rank 0" in other["outcome"], other
    assert other["held"] == {"fds": [], "maps": []}, other
    for rank, got in enumerate(ranks):
        assert got["one"]["again_all_read"], (rank, got)


def test_a_job_wide_load_interrupted_on_one_rank_raises_on_both(ranks: list[dict[str, Any]]) -> None:
    """``share="job"``: the uninterrupted job-wide load fills both ranks (each received the half the other
    read); interrupted on rank 0, rank 0 raises within the latency bound wherever the signal finds it (its read,
    an agreement, its messages or the wait for a peer's), and the peer raises ``PeerInterrupted`` naming it or,
    when it had already received everything it needs, returns; neither waits for the process group's timeout."""
    _check_cut(ranks[0]["job"], "rank 0")
    other = ranks[1]["job"]
    assert other["outcome"].startswith("PeerInterrupted (0,)") or other["outcome"] == "returned", other
    assert other["seconds"] < ranks[1]["job"]["full"] + 5, other
    for rank, got in enumerate(ranks):
        assert got["job"]["all_read"], (rank, got)
        assert got["job"]["received"] > 0, (rank, got)
