"""Loading from ``s3://`` on a real S3 server (the session's SeaweedFS, ``s3_server``), one process.

Values are compared with safetensors' own ``load_file`` of the same local files; bytes fetched are read from the
backend's counters; faults: a missing object, refused credentials, a ``weight_map`` entry outside the prefix,
connections reset (retried) and a server that goes away mid-load (raises in bounded time).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import hp_fastload as hf
import hp_fastload._core as _core
from hp_fastload.errors import HeaderError, ObjectStoreError
from hp_fastload.source import objstore

from ..helpers import s3server
from ..helpers.flaky_proxy import FlakyProxy

pytestmark = pytest.mark.timeout(240)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "a.weight": torch.randn(96, 64, generator=g),
        "b.weight": torch.randn(40, 24, generator=g).to(torch.bfloat16),
        "c.weight": torch.randn(2048, 256, generator=g),  # 2 MiB: several ranged GETs at a 1 MiB piece
    }


def _model() -> nn.Module:
    m = nn.Module()
    m.a = nn.Linear(64, 96, bias=False)
    m.b = nn.Linear(24, 40, bias=False)
    m.c = nn.Linear(256, 2048, bias=False)
    for p in m.parameters():
        p.requires_grad_(False).fill_(7.0)
    return m


def _write(root: Path, tensors: dict[str, torch.Tensor], index: dict[str, Any] | None = None) -> None:
    root.mkdir(parents=True)
    save_file({"a.weight": tensors["a.weight"], "b.weight": tensors["b.weight"]}, str(root / "s0.safetensors"))
    save_file({"c.weight": tensors["c.weight"]}, str(root / "s1.safetensors"))
    weight_map = {"a.weight": "s0.safetensors", "b.weight": "s0.safetensors", "c.weight": "s1.safetensors"}
    (root / "model.safetensors.index.json").write_text(json.dumps(index or {"weight_map": weight_map}))


@pytest.fixture(scope="module")
def server(s3_server: s3server.S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("s3")
    local = root / "ckpt"
    _write(local, _tensors())
    escaping = root / "escaping"
    _write(escaping, _tensors(), {"weight_map": {"a.weight": "../other/s0.safetensors"}})
    url = s3_server.upload_dir(local, s3server.BUCKET, "tiny")
    s3_server.upload_dir(escaping, s3server.BUCKET, "escaping")
    with pytest.MonkeyPatch.context() as env:
        for name, value in s3_server.env(HP_FASTLOAD_S3_PIECE_MB="1").items():
            env.setenv(name, value)
        yield {"srv": s3_server, "url": url, "local": local}
    objstore.clear_cache()


def _header_bytes(local: Path) -> int:
    """The bytes a load fetches besides tensor data: the index and each file's length prefix and header."""
    total = (local / "model.safetensors.index.json").stat().st_size
    for f in local.glob("*.safetensors"):
        with open(f, "rb") as fh:
            total += 8 + int.from_bytes(fh.read(8), "little")
    return total


@pytest.mark.parametrize("direct", ["1", "0"], ids=["direct", "staged"])
def test_load_matches_safetensors_and_fetches_only_what_it_needs(
    server: dict[str, Any], direct: str, monkeypatch
) -> None:
    """Bit-exact either way: plain copies written straight from the fetched bytes (a, c: f32 into f32) or
    staged first (``HP_FASTLOAD_S3_DIRECT=0``); b (bf16 into f32) is cast from the staged bytes in both."""
    monkeypatch.setenv("HP_FASTLOAD_S3_DIRECT", direct)
    objstore.clear_cache()
    reference = {
        **load_file(str(server["local"] / "s0.safetensors")),
        **load_file(str(server["local"] / "s1.safetensors")),
    }
    model = _model()
    _core.object_counters(reset=True)
    report = hf.load(model, server["url"])
    fetched, requests, _ = _core.object_counters()
    assert report.missing_keys == ()
    for name, value in reference.items():
        assert torch.equal(model.get_parameter(name), value.to(torch.float32)), name
    assert report.bytes_needed == sum(v.numel() * v.element_size() for v in reference.values())
    assert fetched <= 1.05 * report.bytes_needed + _header_bytes(server["local"]), (fetched, report.bytes_needed)
    assert fetched >= report.bytes_needed
    assert requests >= 4  # index, 2 x (prefix + header), data pieces


def test_headers_are_cached_on_etag_and_size(server: dict[str, Any]) -> None:
    objstore.clear_cache()
    hf.load(_model(), server["url"])
    _core.object_counters(reset=True)
    report = hf.load(_model(), server["url"])
    fetched, _, _ = _core.object_counters()
    # Index and data again; the two headers came from the cache (a HEAD each fetches no body).
    index_bytes = (server["local"] / "model.safetensors.index.json").stat().st_size
    assert fetched == report.bytes_needed + index_bytes


def test_plan_from_s3_equals_plan_from_files(server: dict[str, Any]) -> None:
    remote = hf.plan(_model(), server["url"])
    local = hf.plan(_model(), server["local"])
    assert remote.bytes_needed == local.bytes_needed
    assert sorted(map(str, remote.read_bytes_by_target().items())) == sorted(
        map(str, local.read_bytes_by_target().items())
    )


def test_missing_object_names_bucket_key_and_status(server: dict[str, Any]) -> None:
    with pytest.raises(ObjectStoreError) as info:
        hf.load(_model(), "s3://models/absent/model.safetensors")
    assert info.value.status == 404 and info.value.bucket == "models"
    assert info.value.key == "absent/model.safetensors"
    assert "s3://models/absent/model.safetensors" in str(info.value)


def test_refused_credentials_raise_before_any_byte_is_written(server: dict[str, Any], monkeypatch) -> None:
    objstore.clear_cache()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    model = _model()
    with pytest.raises(ObjectStoreError) as info:
        hf.load(model, server["url"])
    assert info.value.status == 403, info.value
    assert "models" in str(info.value)
    assert all(bool((p == 7.0).all()) for p in model.parameters())


def test_weight_map_outside_the_prefix_is_refused(server: dict[str, Any]) -> None:
    _core.object_counters(reset=True)
    with pytest.raises(HeaderError, match=r"outside the checkpoint prefix"):
        hf.load(_model(), "s3://models/escaping")
    assert _core.object_counters()[1] == 1  # the index only: no shard fetched


def test_reset_connections_are_retried(server: dict[str, Any], monkeypatch) -> None:
    objstore.clear_cache()
    port = int(server["srv"].endpoint.rsplit(":", 1)[1])
    proxy = FlakyProxy(port, drop_first=3)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        model = _model()
        _core.object_counters(reset=True)
        hf.load(model, server["url"])
        assert proxy.dropped == 3
        assert _core.object_counters()[2] >= 1  # retries counted
        assert torch.equal(model.c.weight, _tensors()["c.weight"])
    finally:
        proxy.close()


def _untouched_or_loaded(model: nn.Module, direct: str) -> None:
    """After a failed fetch: staged (``HP_FASTLOAD_S3_DIRECT=0``), every parameter untouched; direct, every
    byte either untouched or already the checkpoint's (plain copies are written as the bytes arrive, so an
    element may be cut between two of them)."""
    for name, value in _tensors().items():
        p = model.get_parameter(name).detach()
        if direct == "0":
            assert bool((p == 7.0).all()), name
        else:
            got, old = p.view(torch.uint8), torch.full_like(p, 7.0).view(torch.uint8)
            new = value.to(torch.float32).view(torch.uint8)
            assert bool(((got == old) | (got == new)).all()), name


@pytest.mark.parametrize("direct", ["1", "0"], ids=["direct", "staged"])
def test_server_gone_mid_load_raises_in_bounded_time(server: dict[str, Any], direct: str, monkeypatch) -> None:
    monkeypatch.setenv("HP_FASTLOAD_S3_DIRECT", direct)
    objstore.clear_cache()
    port = int(server["srv"].endpoint.rsplit(":", 1)[1])
    # Headers and index pass (a few KB); the 2 MiB tensor's pieces do not: the proxy dies after 64 KiB.
    proxy = FlakyProxy(port, die_after_bytes=64 * 1024)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    monkeypatch.setenv("HP_FASTLOAD_S3_ATTEMPTS", "2")
    model = _model()
    start = time.monotonic()
    try:
        with pytest.raises(ObjectStoreError) as info:
            hf.load(model, server["url"])
    finally:
        proxy.close()
    assert time.monotonic() - start < 60
    assert info.value.bucket == "models" and info.value.key.startswith("tiny/")
    _untouched_or_loaded(model, direct)


class _Stop(Exception):
    """What the test's signal handler raises."""


@pytest.mark.parametrize("direct", ["1", "0"], ids=["direct", "staged"])
def test_a_signal_during_a_stalled_fetch_raises_at_once(server: dict[str, Any], direct: str, monkeypatch) -> None:
    """A server that stops answering mid-fetch: the handler of a signal sent 1 s in raises out of ``load``
    within 0.5 s (the fetch is dropped, not waited out), nothing is written when staged (only correct bytes
    when direct), and the next load works."""
    monkeypatch.setenv("HP_FASTLOAD_S3_DIRECT", direct)
    objstore.clear_cache()
    port = int(server["srv"].endpoint.rsplit(":", 1)[1])
    proxy = FlakyProxy(port, stall_after_bytes=64 * 1024)  # headers and index pass, the 2 MiB tensor stalls
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    model = _model()
    sent: list[float] = []

    def fire() -> None:
        sent.append(time.perf_counter())
        os.kill(os.getpid(), signal.SIGUSR1)

    def handler(signum: int, frame: Any) -> None:
        raise _Stop

    previous = signal.signal(signal.SIGUSR1, handler)
    timer = threading.Timer(1.0, fire)
    try:
        timer.start()
        with pytest.raises(_Stop):
            hf.load(model, server["url"])
        latency = time.perf_counter() - sent[0]
    finally:
        timer.join()
        signal.signal(signal.SIGUSR1, previous)
        proxy.close()
    assert latency < 0.5, latency
    _untouched_or_loaded(model, direct)
    monkeypatch.setenv("AWS_ENDPOINT_URL", server["srv"].endpoint)
    objstore.clear_cache()
    hf.load(model, server["url"])
    assert torch.equal(model.c.weight, _tensors()["c.weight"])
