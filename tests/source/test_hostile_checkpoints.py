"""Hostile or unlucky checkpoints (issue 16): shard paths that leave the checkpoint directory, FIFOs, files
rewritten under a cached header, ranks given different checkpoints, the open-file limit, maps kept after a
read, unprintable and huge key names, writes into tensors that require grad, and positioned-read errors.

Wherever a hang or a signal is possible the case runs in a child process with a timeout, so a regression
fails the test instead of hanging the suite. Checkpoints are written with safetensors' ``save_file``; only
the adversarial ones (a FIFO, a 1 MB key name with a bad dtype) are built by hand.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import hp_fastload as hf
from hp_fastload.api.dcp import HuggingFaceStorageReader
from hp_fastload.cli import main as cli_main
from hp_fastload.formats import INDEX_NAME
from hp_fastload.source import files as engine
from hp_fastload.source import index as index_module
from hp_fastload.source.index import CheckpointIndex
from tests.helpers.checkpoints import load_file_tensors, run_child, tiny_tensors, write_sharded_pair
from tests.helpers.dist import run_distributed

# ---------------------------------------------------------------------------------------------------------
# helpers


@pytest.fixture(autouse=True)
def _fresh_cache():
    engine.clear_cache()
    yield
    engine.clear_cache()


# ---------------------------------------------------------------------------------------------------------
# 1. shard paths stay inside the checkpoint directory


def _escapes(tmp_path: Path) -> dict[str, str]:
    outside = tmp_path / "outside.safetensors"
    save_file({"lin.bias": torch.full((6,), 7.0)}, str(outside))
    return {
        "dotdot": "../outside.safetensors",
        "nested_dotdot": "sub/../../outside.safetensors",
        "absolute": str(outside),
        "empty": "",
        "nul": "model\x00.safetensors",
    }


@pytest.mark.parametrize("case", ["dotdot", "nested_dotdot", "absolute", "empty", "nul"])
@pytest.mark.parametrize("fast", [True, False], ids=["rust_weight_map", "python_json"])
def test_index_shard_paths_outside_the_directory_are_refused(tmp_path, monkeypatch, case, fast):
    name = _escapes(tmp_path)[case]
    ckpt = write_sharded_pair(tmp_path / "ckpt", bias_file=name)
    if not fast:  # the route of an index the Rust WeightMap leaves to Python's json

        class _Unusual:
            @staticmethod
            def parse(text: bytes) -> None:
                return None

        monkeypatch.setattr(index_module._core, "WeightMap", _Unusual)
    for attempt in (lambda: CheckpointIndex.open(ckpt), lambda: load_file_tensors(ckpt)):
        with pytest.raises(hf.HeaderError, match="outside the checkpoint directory") as err:
            attempt()
        assert str(ckpt / INDEX_NAME) in str(err.value)
        assert "'lin.bias'" in str(err.value)  # the entry
    # Refused before anything was opened: no shard of the index was parsed.
    assert not any(Path(p).parent == ckpt or "outside" in p for p in engine._cache)


def _hub_repo(cache: Path, repo_id: str, escape: bool) -> Path:
    """A Hub-cache repo laid out as huggingface_hub lays it out: snapshots/<sha>/x -> ../../blobs/<hash>. With
    ``escape`` its index names a blob through ``../../blobs/<hash>`` instead of a snapshot file."""
    from huggingface_hub.file_download import repo_folder_name

    repo = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    commit = ("e" if escape else "c") * 40
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "refs").mkdir()
    staged = write_sharded_pair(cache / f"staged-{commit}", seed=3)
    blobs = {}
    for f in sorted(staged.iterdir()):
        data = f.read_bytes()
        blobs[f.name] = blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
    if escape:
        index = json.loads((staged / INDEX_NAME).read_text())
        index["weight_map"]["lin.bias"] = os.path.relpath(blobs["model-00002-of-00002.safetensors"], snapshot)
        data = json.dumps(index).encode()
        blobs[INDEX_NAME] = blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
    for name, blob in blobs.items():
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    _hub_repo(cache, "tiny-org/good", escape=False)
    _hub_repo(cache, "tiny-org/escape", escape=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_hub_snapshot_symlinks_to_blobs_load_and_an_escaping_hub_index_is_refused(hub, capsys):
    from huggingface_hub import snapshot_download

    snapshot = Path(snapshot_download("tiny-org/good", local_files_only=True))
    assert all((snapshot / n).is_symlink() for n in os.listdir(snapshot))
    expected = {**load_file(str(snapshot / "model-00001-of-00002.safetensors"))}
    expected.update(load_file(str(snapshot / "model-00002-of-00002.safetensors")))
    got = load_file_tensors("tiny-org/good")
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert len(CheckpointIndex.open(snapshot)) == 2
    assert cli_main(["inspect", str(snapshot)]) == 0  # the CLI follows the snapshot's symlinks too
    assert "lin.bias" in capsys.readouterr().out
    with pytest.raises(hf.HeaderError, match="outside the checkpoint directory") as err:
        load_file_tensors("tiny-org/escape")
    assert "../../blobs/" in str(err.value)


def test_dcp_reader_refuses_storage_paths_outside_its_directory(tmp_path):
    import torch.distributed.checkpoint as dcp

    name = _escapes(tmp_path)["dotdot"]
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file(tiny_tensors(1), str(ckpt / "model.safetensors"))
    reader = HuggingFaceStorageReader(ckpt)
    metadata = reader.read_metadata()
    assert metadata.storage_data is not None
    for index in list(metadata.storage_data):  # metadata handed to the reader names a file outside
        if index.fqn == "lin.bias":
            metadata.storage_data[index] = str(ckpt / name)
    reader.read_metadata = lambda *a, **k: metadata  # type: ignore[method-assign]
    state = {k: torch.zeros_like(v) for k, v in tiny_tensors(0).items()}
    with warnings.catch_warnings(), pytest.raises(BaseException) as err:  # dcp raises a BaseException
        warnings.simplefilter("ignore")  # torch warns when it runs dcp.load without a process group
        dcp.load(state, storage_reader=reader)
    failures = getattr(err.value, "failures", {0: err.value})  # dcp wraps the reader's error per rank
    excs = [f[0] if isinstance(f, tuple) else f for f in failures.values()]  # (exception, traceback) per rank
    assert any(isinstance(e, hf.HeaderError) for e in excs), failures
    assert "outside the checkpoint directory" in str(failures)
    assert not any("outside" in p for p in engine._cache)


# ---------------------------------------------------------------------------------------------------------
# 2. FIFOs are refused without blocking (each entry point, in a child with a timeout)

_FIFO_CASES = [
    "load_index",
    "load_glob",
    "index_index",
    "index_glob",
    "index_fifo",
    "safetensors_file",
    "open_file",
    "cli_inspect",
    "dcp_reader",
    "load_fifo_path",
    "load_fifo_config",
]


@pytest.fixture(scope="module")
def fifo_outcomes(tmp_path_factory) -> dict[str, list[str]]:
    root = tmp_path_factory.mktemp("fifo")
    by_index = write_sharded_pair(root / "by_index", bias_file="fifo.safetensors")
    os.mkfifo(by_index / "fifo.safetensors")
    by_glob = root / "by_glob"
    by_glob.mkdir()
    save_file({"lin.weight": tiny_tensors(1)["lin.weight"]}, str(by_glob / "a.safetensors"))
    os.mkfifo(by_glob / "b.safetensors")
    fifo = by_glob / "b.safetensors"
    fifo_index = write_sharded_pair(root / "fifo_index")
    (fifo_index / INDEX_NAME).unlink()
    os.mkfifo(fifo_index / INDEX_NAME)
    fifo_config = root / "fifo_config"  # config.json is read for its quantization_config by every plan
    fifo_config.mkdir()
    save_file(tiny_tensors(1), str(fifo_config / "model.safetensors"))
    os.mkfifo(fifo_config / "config.json")
    code = f"""
        import contextlib, io, json, warnings
        import hp_fastload as hf
        from hp_fastload.cli import main
        from hp_fastload.dcp import HuggingFaceStorageReader
        from hp_fastload.source.files import open_file
        from hp_fastload.source.index import CheckpointIndex
        from tests.helpers.checkpoints import load_file_tensors
        cases = {{
            "load_index": lambda: load_file_tensors({str(by_index)!r}),
            "load_glob": lambda: load_file_tensors({str(by_glob)!r}),
            "index_index": lambda: CheckpointIndex.open({str(by_index)!r}),
            "index_glob": lambda: CheckpointIndex.open({str(by_glob)!r}),
            "index_fifo": lambda: CheckpointIndex.open({str(fifo_index)!r}),
            "safetensors_file": lambda: hf.SafetensorsFile({str(fifo)!r}),
            "open_file": lambda: open_file({str(fifo)!r}),
            "dcp_reader": lambda: HuggingFaceStorageReader({str(by_glob)!r}).read_metadata(),
            "load_fifo_path": lambda: load_file_tensors({str(fifo)!r}),
            "load_fifo_config": lambda: load_file_tensors({str(fifo_config)!r}),
        }}
        out = {{}}
        for name, case in cases.items():
            try:
                case()
                out[name] = ["no error", ""]
            except Exception as exc:
                out[name] = [type(exc).__name__, str(exc)]
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            status = main(["inspect", {str(by_glob)!r}])
        out["cli_inspect"] = [str(status), err.getvalue()]
        print(json.dumps(out))
    """
    done = run_child(code, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", _FIFO_CASES)
def test_fifo_is_refused_without_blocking(fifo_outcomes, case):
    kind, message = fifo_outcomes[case]
    if case == "cli_inspect":
        assert kind == "1" and "a FIFO, not a regular file" in message
    elif case == "load_fifo_path":  # not a file, not a directory: the location is refused as not found
        assert kind in {"FileNotFoundError", "HeaderError"}, (kind, message)
    elif case == "load_fifo_config":
        assert kind == "HeaderError" and "config.json" in message and "not a regular file" in message, message
    else:
        assert kind == "HeaderError", (kind, message)
        assert "FIFO" in message and "not a regular file" in message and "safetensors" in message


# ---------------------------------------------------------------------------------------------------------
# 3. a file rewritten in place with its old mtime restored is parsed again


def _rewrite_same_size(path: Path, seed: int) -> dict[str, torch.Tensor]:
    """Rewrites ``path`` in place (same inode, same size) with another header and values, then restores its
    mtime (what ``cp -p`` or a coarse clock does)."""
    st = os.stat(path)
    new = {"lin.wei9ht": torch.randn(6, 4, generator=torch.Generator().manual_seed(seed))}
    staged = path.with_suffix(".staged")
    save_file(new, str(staged))
    data = staged.read_bytes()
    staged.unlink()
    assert len(data) == st.st_size
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_mtime_ns == st.st_mtime_ns and os.stat(path).st_ino == st.st_ino
    return new


@pytest.mark.parametrize("settled", [False, True], ids=["header_bytes_compared", "ctime"])
def test_rewrite_with_restored_mtime_is_not_read_with_the_stale_header(tmp_path, monkeypatch, settled):
    if settled:  # every ctime counts as settled: the stamp's ctime alone must notice the rewrite
        monkeypatch.setattr(engine, "SETTLED_NS", 0)
    path = tmp_path / "w.safetensors"
    save_file({"lin.weight": tiny_tensors(1)["lin.weight"]}, str(path))
    before = engine.open_file(path)
    assert "lin.weight" in before
    time.sleep(0.05)  # past one tick of the kernel's coarse file clock
    new = _rewrite_same_size(path, seed=5)
    if not settled:
        assert not before.header.still_current()
    after = engine.open_file(path)
    assert after is not before and list(after) == ["lin.wei9ht"]
    out = torch.empty(6, 4)
    hf.read_into(path, "lin.wei9ht", (0, 0), (6, 4), out)
    assert torch.equal(out, load_file(str(path))["lin.wei9ht"]) and torch.equal(out, new["lin.wei9ht"])
    with pytest.raises(hf.PlanError, match="no tensor named"):
        hf.read_into(path, "lin.weight", (0, 0), (6, 4), out)


def test_an_unchanged_file_keeps_its_cached_header(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file(tiny_tensors(1), str(path))
    first = engine.open_file(path)
    assert first.header.still_current()
    assert engine.open_file(path) is first


# ---------------------------------------------------------------------------------------------------------
# 4. ranks given different checkpoints raise; identical copies at different paths load


def _divergent_body(rank: int, world: int, root: str) -> dict[str, list[str]]:
    base = Path(root)
    out: dict[str, list[str]] = {}
    cases = {
        "absolute_different": lambda: load_file_tensors(base / f"different-{rank}"),
        "absolute_copies": lambda: load_file_tensors(base / f"copy-{rank}"),
        "relative_different": lambda: load_file_tensors("ckpt"),
        "relative_copies": lambda: load_file_tensors("ckpt"),
    }
    start = os.getcwd()
    for name, case in cases.items():
        os.chdir(base / f"cwd-{rank}-{name.split('_')[1]}" if name.startswith("relative") else start)
        try:
            values = case()
            out[name] = ["ok", json.dumps({k: v.flatten().tolist() for k, v in values.items()})]
        except Exception as exc:
            out[name] = [type(exc).__name__, str(exc)]
        finally:
            os.chdir(start)
    return out


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_ranks_with_different_checkpoints_all_raise_and_copies_agree(tmp_path):
    for rank in range(2):
        write_sharded_pair(tmp_path / f"different-{rank}", seed=10 + rank)
        write_sharded_pair(tmp_path / f"copy-{rank}", seed=20)
        write_sharded_pair(tmp_path / f"cwd-{rank}-different" / "ckpt", seed=30 + rank)
        write_sharded_pair(tmp_path / f"cwd-{rank}-copies" / "ckpt", seed=40)
    per_rank = run_distributed(_divergent_body, 2, str(tmp_path), timeout=200)
    for case in ("absolute_different", "relative_different"):
        for rank in range(2):
            kind, message = per_rank[rank][case]
            assert kind == "CheckpointMismatchError", (case, rank, kind, message)
            # every rank names rank 0's location and rank 1's
            for r in range(2):
                name = f"different-{r}" if case.startswith("absolute") else f"cwd-{r}-different"
                assert name in message, (case, rank, message)
    for case, seed in (("absolute_copies", 20), ("relative_copies", 40)):
        expected = {k: v.flatten().tolist() for k, v in tiny_tensors(seed).items()}
        for rank in range(2):
            kind, values = per_rank[rank][case]
            assert kind == "ok", (case, rank, values)
            assert json.loads(values) == expected


# ---------------------------------------------------------------------------------------------------------
# 5. more shards than the soft open-file limit


def test_more_shards_than_the_open_file_limit(tmp_path):
    shards = 300
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({f"p.{i}": torch.full((4,), float(i))}, str(tmp_path / name))
        weight_map[f"p.{i}"] = name
    (tmp_path / INDEX_NAME).write_text(json.dumps({"weight_map": weight_map}))
    code = f"""
        import resource, torch
        from torch import nn
        import hp_fastload as hf
        from hp_fastload.source.index import CheckpointIndex
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
        index = CheckpointIndex.open({str(tmp_path)!r})
        assert len(index) == {shards}
        for backend in ("mmap", "pread", "auto"):
            outs = [torch.empty(4) for _ in range({shards})]
            requests = [(index.locate(f"p.{{i}}").file, f"p.{{i}}", (0,), (4,), outs[i]) for i in range({shards})]
            hf.read_many(requests, backend=backend, threads=2)
            assert all(torch.equal(o, torch.full((4,), float(i))) for i, o in enumerate(outs)), backend
        model = nn.Module()
        model.p = nn.ParameterList([nn.Parameter(torch.zeros(4)) for _ in range({shards})])
        for backend in ("mmap", "pread"):
            report = hf.load(model, {str(tmp_path)!r}, weights_mapping=[], backend=backend)
            assert not report.missing_keys, report.missing_keys
            assert all(torch.equal(p.detach(), torch.full((4,), float(i))) for i, p in enumerate(model.p))
        print("ok")
    """
    done = run_child(code, timeout=180)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


# ---------------------------------------------------------------------------------------------------------
# 7. no map outlives read_into / read_many unless asked; clear_cache is public


def _mapped(path: Path) -> bool:
    return str(path) in Path("/proc/self/maps").read_text()


def test_read_many_releases_its_maps_and_clear_cache_is_public(tmp_path):
    assert "clear_cache" in hf.__all__ and hf.clear_cache is engine.clear_cache
    path = tmp_path / "m.safetensors"
    save_file(tiny_tensors(1), str(path))
    out = torch.empty(6, 4)
    stats = hf.read_into(path, "lin.weight", (0, 0), (6, 4), out, backend="mmap")
    assert stats["backend"] == "mmap" and torch.equal(out, tiny_tensors(1)["lin.weight"])
    assert not _mapped(path)
    hf.read_many([(path, "lin.weight", (0, 0), (6, 4), out)], backend="mmap")
    assert not _mapped(path)
    hf.read_many([(path, "lin.weight", (0, 0), (6, 4), out)], backend="mmap", keep_maps=True)
    assert _mapped(path)
    hf.clear_cache()
    assert not _mapped(path)
    load_file_tensors(path, backend="mmap")  # load releases its maps when it returns, as before
    assert not _mapped(path)


# ---------------------------------------------------------------------------------------------------------
# 8. key names: escaped by inspect, cut in messages; unicode digits in shard names


def test_inspect_escapes_unprintable_key_names(tmp_path, capsys):
    hostile = "evil\x1b[2J\u202ename\x00x\\y"
    path = tmp_path / "k.safetensors"
    save_file({hostile: torch.zeros(2), "plain.weight": torch.zeros(1)}, str(path))
    assert hostile in load_file(str(path))
    assert cli_main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "\x1b" not in text and "\u202e" not in text and "\x00" not in text
    assert "evil\\x1b[2J\\u202ename\\x00x\\\\y" in text and "plain.weight" in text
    assert cli_main(["inspect", "--json", str(path)]) == 0
    raw = capsys.readouterr().out
    assert "\x1b" not in raw and "\u202e" not in raw
    assert hostile in [t["name"] for t in json.loads(raw)[0]["tensors"]]


def test_huge_key_names_are_cut_in_error_messages(tmp_path):
    huge = "k" * 1_000_000
    # a header error (bad dtype) quoting the name, raised by the Rust parser
    header = json.dumps({huge: {"dtype": "XX", "shape": [1], "data_offsets": [0, 1]}}).encode()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(len(header).to_bytes(8, "little") + header + b"\0")
    with pytest.raises(hf.HeaderError) as err:
        hf.SafetensorsFile(bad)
    assert len(str(err.value)) < 1000 and "(1000000 characters)" in str(err.value)
    header = json.dumps({"a\x1b[2J\u202eb": {"dtype": "XX", "shape": [1], "data_offsets": [0, 1]}}).encode()
    bad.write_bytes(len(header).to_bytes(8, "little") + header + b"\0")
    with pytest.raises(hf.HeaderError) as err:  # and control or bidi characters are escaped
        hf.SafetensorsFile(bad)
    assert "\x1b" not in str(err.value) and "\u202e" not in str(err.value)
    assert "'a\\u{1b}[2J\\u{202e}b'" in str(err.value)
    # request errors quoting the name, raised in Python and in Rust
    good = tmp_path / "good.safetensors"
    save_file({huge: torch.zeros(4)}, str(good))
    with pytest.raises(hf.PlanError) as err:
        hf.read_into(good, huge + "x", (0,), (4,), torch.empty(4))
    assert len(str(err.value)) < 1000 and "(1000001 characters)" in str(err.value)
    with pytest.raises(hf.PlanError) as err:
        hf.read_into(good, huge, (2,), (4,), torch.empty(4))
    assert len(str(err.value)) < 1000 and "(1000000 characters)" in str(err.value)
    with pytest.raises(hf.PlanError, match="cannot convert") as err:  # refused by the Rust engine
        hf.read_into(good, huge, (0,), (4,), torch.empty(4, dtype=torch.int32))
    assert len(str(err.value)) < 1000 and "(1000000 characters)" in str(err.value)


def test_a_shard_named_with_a_unicode_digit_is_indexed(tmp_path):
    save_file({"lin.weight": tiny_tensors(1)["lin.weight"]}, str(tmp_path / "\u00b2.safetensors"))  # "²"
    save_file({"lin.bias": tiny_tensors(1)["lin.bias"]}, str(tmp_path / "1.safetensors"))
    index = CheckpointIndex.open(tmp_path)
    assert sorted(index) == ["lin.bias", "lin.weight"]
    got = load_file_tensors(tmp_path)
    assert all(torch.equal(got[k], v) for k, v in tiny_tensors(1).items())
    # a number longer than int() converts (4300 digits) sorts after the others instead of raising
    from hp_fastload.rules import dot_natural_key, natural_sort_key

    names = ["layers." + "9" * 5000 + ".w", "layers.10.w", "layers.\u00b2.w", "layers.2.w"]
    for key in (dot_natural_key, natural_sort_key):
        assert sorted(names, key=key) == [names[3], names[1], names[0], names[2]]


# ---------------------------------------------------------------------------------------------------------
# 9. a tensor that requires grad is refused like torch's copy_, unless grad mode is off


def test_writing_into_a_tensor_that_requires_grad_matches_torch(tmp_path):
    path = tmp_path / "g.safetensors"
    save_file(tiny_tensors(1), str(path))
    leaf = torch.zeros(6, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad") as torch_err:
        leaf.copy_(torch.ones(6, 4))
    for out, words in ((leaf, "a leaf Variable that requires grad"), (leaf[:3], "a view of a leaf Variable")):
        with pytest.raises(RuntimeError, match=words) as err:
            hf.read_into(path, "lin.weight", (0, 0), tuple(out.shape), out)
        assert "in-place operation" in str(err.value) and "in-place operation" in str(torch_err.value)
        with pytest.raises(RuntimeError, match=words):
            hf.read_many(
                [(path, "lin.bias", (0,), (6,), torch.zeros(6)), (path, "lin.weight", (0, 0), tuple(out.shape), out)]
            )
    assert torch.count_nonzero(leaf.detach()) == 0  # nothing was written
    with torch.no_grad():
        hf.read_into(path, "lin.weight", (0, 0), (6, 4), leaf)
        hf.read_into(path, "lin.weight", (0, 0), (3, 4), leaf[3:])
    assert leaf.requires_grad and torch.equal(leaf.detach()[:3], tiny_tensors(1)["lin.weight"][:3])
    assert torch.equal(leaf.detach()[3:], tiny_tensors(1)["lin.weight"][:3])
