"""The rehearsal of one rank reads as ``load`` does (issue 40): the key-level plan names the shards to allocate,
and the regions are intersected while the engine reads the first ones (``execute.read.execute_stream``).

One tiny Qwen3-MoE (stacked experts: region reads from several keys) saved by transformers in several files,
laid out by FSDP2 over 4 ranks under torch's ``fake`` process group. ``OVERLAP_BYTES`` / ``OVERLAP_SECONDS`` are
set to one byte and no wait, so each target goes to an idle engine as soon as it is packed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import hp_fastload as hf
from hp_fastload.api import rehearse as rehearse_module
from hp_fastload.api.request import plan_request
from hp_fastload.execute import read as read_module
from hp_fastload.execute.batch import Batch
from hp_fastload.planning import claims as claims_module
from hp_fastload.planning import front
from hp_fastload.source.index import CheckpointIndex
from tests.helpers.opened import open_under
from tests.helpers.tiny_models import model_class, tiny_config, tiny_model

ROOT = Path(__file__).resolve().parents[2]
WORLD, RANK = 4, 3  # the last rank: the last chunk of every sharded dimension
LAST_LAYER = "model.layers.1."  # the tiny model has two layers


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("rehearse_stream") / "qwen3_moe"
    tiny_model("qwen3_moe", seed=0).save_pretrained(root, max_shard_size="8KB")
    assert len(list(root.glob("*.safetensors"))) > 2
    return root


@pytest.fixture(scope="module")
def laid_out() -> Iterator[Any]:
    """A model on meta laid out by FSDP2 over WORLD ranks under torch's ``fake`` process group as rank ``RANK``
    (torch's own ``distribute_tensor`` then makes that rank's local shards; one group per process: torch keeps
    a mesh's coordinate across groups)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=RANK, world_size=WORLD, store=FakeStore())
    try:
        with torch.device("meta"):
            model = model_class("qwen3_moe").from_config(tiny_config("qwen3_moe"))
        mesh = init_device_mesh("cpu", (WORLD,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        yield model
    finally:
        dist.destroy_process_group()


@pytest.fixture
def eager(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(read_module, "OVERLAP_BYTES", 1)
    monkeypatch.setattr(read_module, "OVERLAP_SECONDS", 0.0)


class _Timeline:
    """The order of region intersections (``("plan", target)``) and engine calls (``("call", bytes)``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: str | None = None) -> None:
        self.events: list[tuple[str, Any]] = []
        real_items, real_execute = claims_module.region_items, Batch.execute
        lock = threading.Lock()

        def items(target: Any, *args: Any, **kwargs: Any) -> Any:
            name = target.names[0]
            with lock:
                self.events.append(("plan", name))
            if fail is not None and name.startswith(fail):
                raise hf.errors.PlanError(f"{name}: injected late planning failure")
            return real_items(target, *args, **kwargs)

        def execute(batch: Batch, *args: Any, **kwargs: Any) -> Any:
            with lock:
                self.events.append(("call", batch.nbytes))
            return real_execute(batch, *args, **kwargs)

        monkeypatch.setattr(claims_module, "region_items", items)
        monkeypatch.setattr(Batch, "execute", execute)

    def planned_after_first_call(self) -> list[str]:
        kinds = [kind for kind, _ in self.events]
        first = kinds.index("call") if "call" in kinds else len(kinds)
        return [name for kind, name in self.events[first:] if kind == "plan"]

    @property
    def calls(self) -> int:
        return sum(kind == "call" for kind, _ in self.events)


def _unstreamed(model: Any, root: Path, rank: int) -> dict[str, torch.Tensor]:
    """The rank's shards as the rehearsal read them before it streamed: the whole plan first
    (``planning.front.plan``), then ``execute_plan``."""
    index = CheckpointIndex.open(str(root))
    request = plan_request(model, loader="dcp", strict=False, view=hf.as_rank(rank))
    plan, context = front.plan(model, index, request)
    targets, shards, _ = rehearse_module._materialize(plan.target_names(), context.targets, torch.device("cpu"), rank)
    try:
        read_module.execute_plan(plan, dataclasses.replace(context, targets=targets), threads=2)
    finally:
        index.release_maps()
    return shards


def test_the_streamed_rehearsal_reads_torchs_shards_while_it_plans(
    saved: Path, laid_out: Any, eager: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every local shard equals torch's ``distribute_tensor`` of what transformers' ``from_pretrained`` loads
    (experts stacked by its own rule), and the shards the whole plan's reads fill; some targets were
    intersected after the engine's first call, and the hidden planning is reported."""
    from torch.distributed.tensor import distribute_tensor

    model, rank = laid_out, RANK
    timeline = _Timeline(monkeypatch)
    report, shards = hf.rehearse(model, saved, rank=rank, threads=2, keep=True)
    assert timeline.calls >= 2, timeline.events
    assert timeline.planned_after_first_call(), timeline.events  # reads began before planning ended
    path = report.critical_path
    assert path.planning_hidden >= 0.0 and report.plan_seconds == pytest.approx(path.index + path.planning)
    assert "hidden behind the reads" in report.summary()

    reference = model_class("qwen3_moe").from_pretrained(saved).state_dict()
    params = dict(model.named_parameters())
    assert set(shards) == set(params)
    unstreamed = _unstreamed(model, saved, rank)
    assert set(unstreamed) == set(shards)
    for name, local in shards.items():
        param = params[name]
        expected = distribute_tensor(
            reference[name], param.device_mesh, param.placements, src_data_rank=None
        ).to_local()
        assert local.shape == expected.shape and torch.equal(local, expected), name
        assert torch.equal(local.view(torch.uint8), unstreamed[name].view(torch.uint8)), name
    assert report.bytes_read == report.bytes_needed == report.local_bytes


def test_a_late_planning_failure_raises_with_nothing_left_open(
    saved: Path, laid_out: Any, eager: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A target of the last layer failing to plan, after engine calls read the first ones: the rehearsal
    raises it, with no map of the checkpoint, no descriptor beyond a finished rehearsal's and no planner left."""
    model = laid_out
    hf.rehearse(model, saved, rank=1, threads=2)
    after_success = open_under(saved)
    timeline = _Timeline(monkeypatch, fail=LAST_LAYER)
    with pytest.raises(hf.errors.PlanError, match="injected late planning failure"):
        hf.rehearse(model, saved, rank=1, threads=2)
    assert timeline.calls >= 1, timeline.events  # reads had begun: the failure was late
    left = open_under(saved)
    assert left["maps"] == [] and left["planners"] == [], left
    assert left["fds"] == after_success["fds"], (left, after_success)


def test_plan_execute_reports_the_hidden_planning(saved: Path) -> None:
    """``hp-fastload plan CKPT --execute --json``: the row's critical path has ``planning_hidden`` beside the
    phases and ``plan_seconds`` is the index and the planning left on the critical path (a fresh process: the
    CLI lays the model out under its own ``fake`` group; its summary line is ``Rehearsal.summary``)."""
    command = [sys.executable, "-m", "hp_fastload.cli", "plan", str(saved), "--layout", "fsdp", "--world", "4"]
    command += ["--rank", "3", "--execute", "--threads", "2", "--json"]
    paths = [str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))}
    row = json.loads(subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout)
    path = row["critical_path"]
    assert set(path) >= {"index", "planning", "reading", "finishing", "planning_hidden"}, path
    assert path["planning_hidden"] >= 0.0 and path["reading"] > 0.0, path
    assert row["plan_seconds"] == pytest.approx(path["index"] + path["planning"])
    assert row["bytes_read"] == row["bytes_needed"] > 0, row
