"""``hp-fastload inspect`` and ``hp-fastload plan`` of an ``s3://`` checkpoint (the session's SeaweedFS), in this
process: ``inspect`` lists what safetensors' own ``safe_open`` reads from the same files; ``plan`` gives, rank
for rank, what it gives for the same checkpoint on disk (which ``test_plan_command.py`` checks against real
ranks); a missing prefix is one line naming it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from safetensors import safe_open

from hp_fastload.cli import main
from hp_fastload.source import objstore

from ..helpers import s3server
from ..helpers.tiny_models import TINY_DECODER, config_of

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def ckpt(s3_server: s3server.S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    local = tmp_path_factory.mktemp("s3cli") / "qwen3_moe"
    config = config_of("qwen3_moe", **dict(TINY_DECODER, vocab_size=65, num_experts=3, moe_intermediate_size=8))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(local, max_shard_size="8KB")
    url = s3_server.upload_dir(local, s3server.BUCKET, "cli/qwen3_moe")
    with pytest.MonkeyPatch.context() as env:
        for name, value in s3_server.env().items():
            env.setenv(name, value)
        yield {"local": local, "url": url}
    objstore.clear_cache()


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_inspect_lists_what_safetensors_reads(ckpt: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _run(capsys, "inspect", ckpt["url"], "--json")
    assert status == 0
    listed = json.loads(out)
    files = sorted(ckpt["local"].glob("*.safetensors"))
    assert len(files) > 1  # sharded: the prefix's objects are listed
    assert [e["path"] for e in listed] == [f"{ckpt['url']}/{f.name}" for f in files]
    for entry, path in zip(listed, files, strict=True):
        with safe_open(str(path), "pt") as f:
            expected = {k: (str(f.get_slice(k).get_dtype()), list(f.get_slice(k).get_shape())) for k in f.keys()}  # noqa: SIM118
            assert entry["metadata"] == f.metadata()
        assert {t["name"]: (t["dtype"], t["shape"]) for t in entry["tensors"]} == expected
        assert entry["file_size"] == path.stat().st_size
    single = f"{ckpt['url']}/{files[0].name}"
    status, out, _ = _run(capsys, "inspect", single, "--json")
    assert status == 0 and json.loads(out) == listed[:1]


@pytest.mark.parametrize("layout", ["tp", "ep"])
def test_plan_over_s3_equals_plan_from_disk(
    ckpt: dict[str, Any], layout: str, capsys: pytest.CaptureFixture[str]
) -> None:
    plans = []
    for where in (ckpt["url"], str(ckpt["local"])):
        status, out, err = _run(capsys, "plan", where, "--layout", layout, "--world", "2", "--all-ranks", "--json")
        assert status == 0, err
        plans.append(json.loads(out))
    remote, local = plans
    assert remote["layout"] == local["layout"]
    for r, lo in zip(remote["ranks"], local["ranks"], strict=True):
        assert r["bytes_needed"] == lo["bytes_needed"] > 0
        assert sorted(name.rsplit("/", 1)[1] for name in r["files"]) == sorted(
            name.rsplit("/", 1)[1] for name in lo["files"]
        )
        assert (r["missing"], r["unexpected"], r["deferred"]) == (lo["missing"], lo["unexpected"], lo["deferred"])


def test_missing_prefix_is_one_line(ckpt: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = _run(capsys, "inspect", "s3://models/cli/absent")
    assert status == 1 and out == ""
    assert err.count("\n") == 1 and "s3://models/cli/absent" in err
