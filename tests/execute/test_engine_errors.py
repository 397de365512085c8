"""Every error path of the engine API: exception type and message content."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import pytest
import torch
from safetensors.torch import save_file

import hp_fastload as hf
from hp_fastload import HeaderError, HpFastloadError, PlanError, ReadError, TargetError


def adversarial(tmp_path, header: bytes | str, data: bytes = b"", length: int | None = None):
    """A hand-built file: these are malformed on purpose, so no library would write them."""
    raw = header.encode() if isinstance(header, str) else header
    path = tmp_path / "bad.safetensors"
    n = len(raw) if length is None else length
    path.write_bytes(n.to_bytes(8, "little") + raw + data)
    return path


def entry(dtype="U8", shape=(2,), offsets=(0, 2)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


CASES = [
    ("too long", json.dumps({"a": entry()}), b"xx", 200_000_000, "exceeds the limit"),
    ("past end", json.dumps({"a": entry()}), b"xx", 500, "past the end of the file"),
    ("utf8", b'{"\xff":1}', b"", None, "not valid UTF-8"),
    ("not object", "[1,2]", b"", None, "expected an object"),
    ("not json", '{"a":', b"", None, "not valid JSON"),
    ("metadata value", json.dumps({"__metadata__": {"k": 1}}), b"", None, "expected a string"),
    ("unknown dtype", json.dumps({"a": entry(dtype="Q7")}), b"xx", None, "unknown dtype 'Q7'"),
    ("negative shape", json.dumps({"a": entry(shape=(-2,))}), b"xx", None, "non-negative integer"),
    ("float shape", json.dumps({"a": entry(shape=(2.0,))}), b"xx", None, "non-negative integer"),
    ("offsets mismatch", json.dumps({"a": entry(offsets=(0, 3))}), b"xxx", None, "need 2"),
    (
        "overlap",
        json.dumps({"a": entry(shape=(4,), offsets=(0, 4)), "b": entry(offsets=(2, 4))}),
        b"xxxx",
        None,
        "overlaps",
    ),
    ("hole", json.dumps({"a": entry(), "b": entry(offsets=(3, 5))}), b"xxxxx", None, "hole"),
    ("not covering", json.dumps({"a": entry()}), b"xxxx", None, "cover 2 bytes but the data section has 4"),
    ("short data", json.dumps({"a": entry(shape=(8,), offsets=(0, 8))}), b"xx", None, "cover 8 bytes"),
    (
        "duplicate",
        '{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{}}',
        b"x",
        None,
        "duplicate key 'a'",
    ),
    (
        "overflow",
        json.dumps({"a": entry(shape=(2**40, 2**40), offsets=(0, 0))}),
        b"",
        None,
        "overflows",
    ),
    ("trailing junk", "{} x", b"", None, "unexpected text"),
]


@pytest.mark.parametrize(("header", "data", "length", "needle"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_malformed_headers(tmp_path, header, data, length, needle):
    path = adversarial(tmp_path, header, data, length)
    with pytest.raises(HeaderError, match="invalid safetensors header") as info:
        hf.SafetensorsFile(path)
    assert needle in str(info.value)
    assert str(path) in str(info.value)
    assert isinstance(info.value, ValueError)


def test_tiny_file_and_trailing_spaces(tmp_path):
    path = tmp_path / "tiny.safetensors"
    path.write_bytes(b"\x01\x00")
    with pytest.raises(HeaderError, match="fewer than the 8-byte length prefix"):
        hf.SafetensorsFile(path)
    ok = adversarial(tmp_path, json.dumps({"a": entry()}) + "    ", b"xy")
    assert hf.SafetensorsFile(ok).shape("a") == (2,)


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(
        {"w": torch.arange(20, dtype=torch.float32).reshape(4, 5), "i": torch.arange(6, dtype=torch.int32)},
        str(path),
    )
    return path


def test_box_outside_tensor(model):
    with pytest.raises(PlanError) as info:
        hf.read_into(model, "w", [1, 3], [2, 4], torch.zeros(2, 4))
    msg = str(info.value)
    assert "tensor 'w'" in msg and "dim 1" in msg and "offset 3 + length 4" in msg and "size 5" in msg
    with pytest.raises(PlanError, match="one entry per dim"):
        hf.read_into(model, "w", [0], [4], torch.zeros(4))
    with pytest.raises(PlanError, match="dim 0: offset -1"):
        hf.read_into(model, "w", [-1, 0], [1, 5], torch.zeros(1, 5))


def test_destination_wrong_shape_and_device(model):
    with pytest.raises(PlanError, match=r"out has shape \[5, 4\] but the box has lengths \[4, 5\]"):
        hf.read_into(model, "w", [0, 0], [4, 5], torch.zeros(5, 4))
    with pytest.raises(PlanError, match=r"must be a torch\.Tensor"):
        hf.read_into(model, "w", [0, 0], [4, 5], [[0.0] * 5] * 4)  # type: ignore[arg-type]
    meta = torch.empty(4, 5, device="meta")
    with pytest.raises(PlanError, match="CPU"):
        hf.read_into(model, "w", [0, 0], [4, 5], meta)


def test_impossible_cast(model):
    with pytest.raises(PlanError, match="cannot convert I32 to F32") as info:
        hf.read_into(model, "i", [0], [6], torch.zeros(6))
    assert "tensor 'i'" in str(info.value)
    with pytest.raises(PlanError, match="cannot convert F32 to I64"):
        hf.read_into(model, "w", [0, 0], [4, 5], torch.zeros(4, 5, dtype=torch.int64))


def test_unknown_key(model):
    with pytest.raises(PlanError, match="no tensor named 'missing'") as info:
        hf.read_into(model, "missing", [0], [1], torch.zeros(1))
    assert str(model) in str(info.value)


def test_overlapping_destinations(model):
    out = torch.zeros(6, 5)
    with pytest.raises(PlanError, match="destination ranges overlap") as info:
        hf.read_many([(model, "w", [0, 0], [4, 5], out[:4]), (model, "w", [0, 0], [4, 5], out[2:])])
    assert "item 0" in str(info.value) and "item 1" in str(info.value)
    assert out.abs().sum() == 0, "nothing is written when validation fails"
    # Interleaved but disjoint column blocks are fine.
    wide = torch.zeros(4, 10)
    hf.read_many([(model, "w", [0, 0], [4, 5], wide[:, :5]), (model, "w", [0, 0], [4, 5], wide[:, 5:])])
    assert torch.equal(wide[:, 5:], wide[:, :5])
    with pytest.raises(PlanError, match="several times"):
        hf.read_into(model, "w", [0, 0], [4, 5], torch.zeros(1, 5).expand(4, 5))


def test_missing_and_unreadable_files(tmp_path, model):
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(FileNotFoundError) as info:
        hf.SafetensorsFile(missing)
    assert info.value.filename == str(missing) and "no such file" in str(info.value)
    with pytest.raises(FileNotFoundError):
        hf.read_into(missing, "w", [0], [1], torch.zeros(1))
    with pytest.raises(IsADirectoryError) as dir_info:
        hf.SafetensorsFile(tmp_path)
    assert dir_info.value.filename == str(tmp_path)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs POSIX fork and users")
def test_permission_denied(model):
    box = tempfile.mkdtemp(prefix="hp-fastload-perm-")
    try:
        os.chmod(box, 0o755)
        locked = os.path.join(box, "locked.safetensors")
        shutil.copy(model, locked)
        os.chmod(locked, 0)
        if os.geteuid() != 0:
            with pytest.raises(PermissionError) as info:
                hf.SafetensorsFile(locked)
            assert info.value.filename == locked and "permission denied" in str(info.value)
            return
        # Root ignores file modes: check in a forked child that drops to user "nobody" (65534).
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            status = 3
            try:
                os.setgid(65534)
                os.setuid(65534)
                try:
                    hf.SafetensorsFile(locked)
                    status = 1
                except PermissionError as e:
                    status = 0 if e.filename == locked and "permission denied" in str(e) else 2
            finally:
                os._exit(status)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        shutil.rmtree(box)


@pytest.mark.parametrize("backend", ["mmap", "pread", "auto"])
def test_file_truncated_after_first_read(tmp_path, backend):
    path = tmp_path / "shrink.safetensors"
    save_file({"a": torch.ones(64, 64), "b": torch.ones(64, 64)}, str(path))
    f = hf.SafetensorsFile(path)
    out = torch.zeros(64, 64)
    hf.read_into(f, "b", [0, 0], [64, 64], out, backend=backend)
    assert out.sum() == 64 * 64
    size = path.stat().st_size
    os.truncate(path, size - 1000)
    with pytest.raises(ReadError, match="truncated") as info:
        hf.read_into(f, "b", [0, 0], [64, 64], out, backend=backend)
    assert f"expected {size} bytes but found {size - 1000}" in str(info.value)
    assert isinstance(info.value, OSError)
    # By path, the cached header is dropped because the file changed, and the new one is invalid.
    with pytest.raises(HeaderError, match="cover"):
        hf.read_into(path, "b", [0, 0], [64, 64], out, backend=backend)


def test_file_rewritten_after_open(tmp_path):
    path = tmp_path / "rewrite.safetensors"
    save_file({"a": torch.ones(8)}, str(path))
    f = hf.SafetensorsFile(path)
    os.replace(_write(tmp_path / "other.safetensors", {"a": torch.zeros(8)}), path)
    with pytest.raises(ReadError, match="changed since its header was read"):
        hf.read_into(f, "a", [0], [8], torch.zeros(8))


def _write(path, tensors):
    save_file(tensors, str(path))
    return path


def test_bad_engine_arguments(model):
    out = torch.zeros(4, 5)
    with pytest.raises(PlanError, match="unknown backend 'fast'"):
        hf.read_into(model, "w", [0, 0], [4, 5], out, backend="fast")
    with pytest.raises(PlanError, match="threads must be at least 1"):
        hf.read_into(model, "w", [0, 0], [4, 5], out, threads=0)
    with pytest.raises(PlanError, match=r"request 0 must be"):
        hf.read_many([(model, "w")])  # type: ignore[list-item]


def test_hierarchy():
    assert issubclass(HeaderError, HpFastloadError) and issubclass(HeaderError, ValueError)
    assert issubclass(PlanError, HpFastloadError) and issubclass(PlanError, ValueError)
    assert issubclass(ReadError, HpFastloadError) and issubclass(ReadError, OSError)
    assert issubclass(TargetError, HpFastloadError) and issubclass(TargetError, ValueError)
    assert not issubclass(HpFastloadError, ValueError)


def _sharded(tmp_path):
    """Two shards written by safetensors and the key -> file map an index of them holds."""
    shards = {
        "a.safetensors": {"x.1.w": torch.arange(4.0), "x.10.w": torch.ones(2)},
        "b.safetensors": {"x.2.w": torch.zeros(3)},
    }
    weight_map = {}
    for name, tensors in shards.items():
        save_file(tensors, str(tmp_path / name))
        weight_map.update(dict.fromkeys(tensors, name))
    return weight_map


INDEX_CASES = [
    ("not json", '{"weight_map": {', "failed to read safetensors index"),
    ("not utf8", b'{"weight_map": {"\xff": "a.safetensors"}}', "failed to read safetensors index"),
    ("no weight_map", json.dumps({"metadata": {}}), "no non-empty weight_map"),
    ("empty weight_map", json.dumps({"weight_map": {}}), "no non-empty weight_map"),
    ("list", json.dumps([1]), "no non-empty weight_map"),
    ("non-string file", json.dumps({"weight_map": {"x.1.w": 3}}), "maps a key to 3, not a file name"),
    ("wrong file", json.dumps({"weight_map": {"x.1.w": "b.safetensors"}}), "puts 'x.1.w' in b.safetensors"),
]


@pytest.mark.parametrize(("text", "needle"), [c[1:] for c in INDEX_CASES], ids=[c[0] for c in INDEX_CASES])
def test_bad_index(tmp_path, text, needle):
    from hp_fastload.source.index import CheckpointIndex

    _sharded(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    index.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(HeaderError, match=needle):
        CheckpointIndex.open(tmp_path)


@pytest.mark.parametrize(("text", "needle"), [c[1:] for c in INDEX_CASES[:5]], ids=[c[0] for c in INDEX_CASES[:5]])
def test_bad_index_metadata(tmp_path, text, needle):
    """``from_pretrained``'s read of the index's ``metadata`` parses it as the index does: the same typed error,
    naming the file; no index, or no metadata object, is empty."""
    from hp_fastload.source.index import index_metadata

    _sharded(tmp_path)
    assert index_metadata(tmp_path) == {}
    index = tmp_path / "model.safetensors.index.json"
    index.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(HeaderError, match=needle) as raised:
        index_metadata(tmp_path)
    assert str(index) in str(raised.value)
    index.write_text(json.dumps({"metadata": {"dtype": "float16", "total_size": 36}, "weight_map": _sharded(tmp_path)}))
    assert index_metadata(tmp_path) == {"dtype": "float16", "total_size": 36}
    index.write_text(json.dumps({"metadata": [1], "weight_map": _sharded(tmp_path)}))
    assert index_metadata(tmp_path) == {}


def test_index_missing_shard(tmp_path):
    from hp_fastload.source.index import CheckpointIndex

    weight_map = _sharded(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {**weight_map, "y": "c.safetensors"}})
    )
    with pytest.raises(FileNotFoundError, match=r"c\.safetensors"):
        CheckpointIndex.open(tmp_path)


@pytest.mark.parametrize("variant", ["exact", "extra fields", "subset", "listed twice"])
def test_index_variants_agree_with_the_headers(tmp_path, variant):
    """The Rust fast path (an index that lists exactly the headers' tensors) and the per-key path give the
    same index; a subset lists only its keys; a name listed twice keeps its last file, as ``json`` does."""
    from safetensors import safe_open

    from hp_fastload.source.index import CheckpointIndex

    weight_map = _sharded(tmp_path)
    body = json.dumps({"weight_map": weight_map})
    if variant == "extra fields":
        body = json.dumps({"metadata": {"total_size": 36, "nested": [1, {"a": None}]}, "weight_map": weight_map})
    elif variant == "subset":
        weight_map = {"x.10.w": "a.safetensors", "x.2.w": "b.safetensors"}
        body = json.dumps({"weight_map": weight_map})
    elif variant == "listed twice":
        body = '{"weight_map": {"x.1.w": "b.safetensors", ' + body[len('{"weight_map": {') :]
    (tmp_path / "model.safetensors.index.json").write_text(body)
    index = CheckpointIndex.open(tmp_path)
    assert index.keys() == [k for k in ("x.1.w", "x.2.w", "x.10.w") if k in weight_map]
    for key in index:
        file = index.locate(key).file
        assert os.path.basename(file.path) == weight_map[key]
        with safe_open(file.path, "pt") as f:
            assert file.shape(key) == tuple(f.get_slice(key).get_shape())


def test_index_key_in_two_shards_uses_the_indexed_file(tmp_path):
    """A key stored in two shards: the index's file wins for every lookup (shape facts, entries, reads)."""
    from hp_fastload.source.index import CheckpointIndex

    save_file({"a": torch.zeros(2), "b": torch.ones(1)}, str(tmp_path / "s1.safetensors"))
    save_file({"a": torch.zeros(5), "c": torch.ones(1)}, str(tmp_path / "s2.safetensors"))
    weight_map = {"a": "s1.safetensors", "b": "s1.safetensors", "c": "s2.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    index = CheckpointIndex.open(tmp_path)
    a, c = index.locate("a"), index.locate("c")
    assert (a.shape, a.dtype_name, a.dtype, a.nbytes, a.key) == ((2,), "F32", torch.float32, 8, "a")
    assert os.path.basename(a.file.path) == "s1.safetensors" and a.position == a.file.tensor_index("a")
    assert (c.shape, os.path.basename(c.file.path)) == ((1,), "s2.safetensors")
    assert index.locate("a") is a  # remembered: one lookup, one record
    with pytest.raises(KeyError, match="not indexed: 'zz'"):
        index.locate("zz")
