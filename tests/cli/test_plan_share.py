"""``hp-fastload plan CKPT --all-ranks --share job``: the simulator's JSON on a tiny MoE under every rank of a
2-D layout of 4 ranks in 2 nodes; its byte counts checked against the per-rank plans of ``hp_fastload.plan``
(the same CLI without ``--share``) and against what a job plan must satisfy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hp_fastload.cli.main import main
from tests.helpers.tiny_models import tiny_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("plan_share") / "qwen3_moe"
    tiny_model("qwen3_moe", seed=3).to(torch.bfloat16).save_pretrained(root, max_shard_size="4KB")
    return root


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_share_job_json_agrees_with_the_per_rank_plans(checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    common = [str(checkpoint), "--world", "4", "--layout", "2d", "--mesh", "2x2", "--all-ranks"]
    job = _run(
        capsys, *common, "--share", "job", "--ranks-per-node", "2", "--storage-gbps", "1", "--network-gbps", "10"
    )
    plans = _run(capsys, *common)
    needed = [rank["bytes_needed"] for rank in plans["ranks"]]
    assert job["per_rank_needed_bytes"] == needed  # the whole-plan needs are each rank's own plan's bytes
    assert job["storage_bytes_without_sharing"] == sum(needed)
    assert job["t1_read_over_needed"] == 1.0 and job["storage_bytes"] == job["job_needs_bytes"]
    assert job["storage_bytes"] < sum(needed)  # the 2-D layout replicates attention across the ep dim
    assert sum(job["per_rank_read_bytes"]) == job["storage_bytes"] == sum(job["per_node_storage_bytes"])
    assert all(got <= need for got, need in zip(job["per_rank_received_bytes"], needed, strict=True))
    assert sum(job["per_node_sent_bytes"]) == sum(job["per_node_received_bytes"]) > 0
    seconds = job["predicted_seconds"]
    # storage 1 GB/s, network 10: `none` reads every rank's needs, `job` each byte once, then its cross-node
    # messages (the phases run one after the other)
    assert seconds["none"] == pytest.approx(max(job["predicted_node_storage_bytes"]["none"]) / 1e9)
    phases = job["predicted_phases"]["job"]
    assert phases["read"] == pytest.approx(max(job["per_node_storage_bytes"]) / 1e9)
    assert phases["network"] == pytest.approx(
        max(max(o, i) for o, i in zip(job["per_node_sent_bytes"], job["per_node_received_bytes"], strict=True)) / 1e10
    )
    assert seconds["job"] == pytest.approx(sum(phases.values())) and seconds["job"] < seconds["none"]
    assert set(job["t4_plan_cpu_seconds"]) >= {"whole_plan", "all_ranks_needs", "job_plan", "t4"}


def test_share_job_needs_all_ranks(checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(checkpoint), "--world", "4", "--layout", "2d", "--share", "job"]) != 0
    assert "--all-ranks" in capsys.readouterr().err
