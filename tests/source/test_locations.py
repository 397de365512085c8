"""Checkpoint locations (issue 4, item 4): Hub ids through huggingface_hub's cache offline, with a revision;
a directory of shards without an index; a torch-sharded export refused with a message naming what to use;
on several ranks every rank resolves its own argument, rank 0 first and the others from the cache it filled.

The Hub cache is laid out exactly as huggingface_hub lays it out (``models--org--name/{blobs,refs,snapshots}``,
snapshot files symlinked to content-addressed blobs, folder name from ``huggingface_hub``'s own
``repo_folder_name``), and ``huggingface_hub.scan_cache_dir`` must recognise it before any load runs.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from tests.helpers.dist import run_distributed, run_subchecks, subcheck_values

REPO_ID = "tiny-org/tiny-model"
COMMITS = {"main": "a" * 40, "v2": "b" * 40}  # refs -> commit hashes
CACHE_ENV = "HPF_TEST_HUB_CACHE"


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"lin.weight": torch.randn(6, 4, generator=g), "lin.bias": torch.randn(6, generator=g)}


def _seed(ref: str) -> int:
    return {"main": 1, "v2": 2}[ref]


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)
        with torch.no_grad():
            for p in self.parameters():
                p.zero_()


def _load_values(path: str, **kwargs: Any) -> dict[str, torch.Tensor]:
    import hp_fastload

    model = _Tiny()
    report = hp_fastload.load(model, path, weights_mapping=[], **kwargs)
    assert not report.missing_keys, report.missing_keys
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _build_hub_cache(cache: Path) -> Path:
    """One repo, two refs (main, v2) pointing at two commits with different weights; blobs symlinked."""
    from huggingface_hub.file_download import repo_folder_name

    repo = cache / repo_folder_name(repo_id=REPO_ID, repo_type="model")
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    for ref, commit in COMMITS.items():
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        staged = snapshot / "staged.safetensors"
        save_file(_tensors(_seed(ref)), str(staged))
        files = {"model.safetensors": staged.read_bytes(), "config.json": json.dumps({"ref": ref}).encode()}
        staged.unlink()
        for name, data in files.items():
            blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
            (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
        (repo / "refs" / ref).write_text(commit)
    return repo


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("hub_cache")
    _build_hub_cache(cache)
    return cache


@pytest.fixture
def offline(hub_cache, monkeypatch) -> Path:
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # the constants were read when it was imported
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    return hub_cache


def test_cache_is_laid_out_as_huggingface_hub_lays_it_out(hub_cache):
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(hub_cache)
    assert not info.warnings, info.warnings
    (repo,) = info.repos
    assert repo.repo_id == REPO_ID
    refs = {ref: rev.commit_hash for rev in repo.revisions for ref in rev.refs}
    assert refs == COMMITS


def test_hub_id_resolves_offline_to_main(offline):
    got = _load_values(REPO_ID)
    expected = _tensors(_seed("main"))
    assert all(torch.equal(got[k], expected[k]) for k in expected)


@pytest.mark.parametrize("revision", ["v2", COMMITS["v2"]], ids=["branch", "commit"])
def test_hub_id_resolves_offline_with_a_revision(offline, revision):
    got = _load_values(REPO_ID, revision=revision)
    expected = _tensors(_seed("v2"))
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert not torch.equal(got["lin.weight"], _tensors(_seed("main"))["lin.weight"])


def test_hub_id_not_in_the_cache_fails_offline(offline):
    with pytest.raises(Exception, match=r"(?i)offline|cache|local|not found|cannot find"):
        _load_values("tiny-org/absent-model")


def test_directory_of_shards_without_an_index(tmp_path):
    from tests.helpers.tiny_models import model_class, tiny_model

    source = tiny_model("llama").to(torch.bfloat16)
    source.save_pretrained(tmp_path, max_shard_size="10KB")
    (tmp_path / "model.safetensors.index.json").unlink()
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) >= 2, shards
    import hp_fastload

    target = model_class("llama").from_config(source.config).to(torch.bfloat16)
    report = hp_fastload.load(target, str(tmp_path))
    assert not report.missing_keys and not report.unexpected_keys
    expected = source.state_dict()
    got = target.state_dict()
    assert [k for k in expected if not torch.equal(got[k], expected[k])] == []


def test_torch_sharded_export_is_refused_with_what_to_use(tmp_path):
    import hp_fastload

    full = _tensors(3)
    # the layout torch's HuggingFaceStorageWriter(save_distributed=True) writes: one file per rank, each piece
    # with its offsets in the DCP_SHARDING_INFO metadata
    for rank in range(2):
        piece = {k: v.chunk(2)[rank].contiguous() for k, v in full.items()}
        info = {k: {"saved_offsets": [rank * full[k].shape[0] // 2] + [0] * (v.ndim - 1)} for k, v in piece.items()}
        save_file(
            piece,
            str(tmp_path / f"shard-{rank + 1:05d}-model-00001-of-00001.safetensors"),
            metadata={"DCP_SHARDING_INFO": json.dumps(info)},
        )
    with pytest.raises(hp_fastload.HeaderError, match="HuggingFaceStorageReader") as err:
        hp_fastload.load(_Tiny(), str(tmp_path), weights_mapping=[])
    assert "DCP_SHARDING_INFO" in str(err.value)


# ---------------------------------------------------------------------------------------------------------
# On 2 ranks each rank resolves the Hub id once, from the local cache (issue 16 item 4: every rank resolves its
# own argument; the ranks then compare what they resolved)


def check_hub_resolved_once(rank: int, world: int) -> dict[str, Any]:
    import huggingface_hub

    calls: list[bool] = []
    real = huggingface_hub.snapshot_download

    def counting(*args: Any, **kwargs: Any) -> str:
        calls.append(bool(kwargs.get("local_files_only")))
        return real(*args, **kwargs)

    huggingface_hub.snapshot_download = counting  # hp_fastload imports it from the package at call time
    try:
        got = _load_values(REPO_ID, revision="v2")
    finally:
        huggingface_hub.snapshot_download = real
    expected = _tensors(_seed("v2"))
    return {"calls": calls, "equal": all(torch.equal(got[k], expected[k]) for k in expected)}


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_hub_resolution_happens_once_per_rank_from_the_cache(hub_cache, monkeypatch):
    # spawned ranks inherit the environment, and import huggingface_hub with it
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    per_rank = run_distributed(run_subchecks, 2, [check_hub_resolved_once], timeout=150)
    values = subcheck_values(per_rank, "check_hub_resolved_once")
    assert [v["calls"] for v in values] == [[True], [True]]
    assert [v["equal"] for v in values] == [True, True]
