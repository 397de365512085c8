"""The critical-path report (``LoadReport.critical_path``, ``Rehearsal.critical_path``): every instant of a load's
wall time is charged to one phase, each phase gets its own work, and a rank that waits for a slower peer says so.

Attribution is checked with delays put into one phase at a time: a delayed step's phase must hold at least the
delay (a lower bound, true however slow the host), and the phases must add up to the wall time. Nothing here
asserts a speed.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

import hp_fastload as hf
from hp_fastload.api import load as load_module
from hp_fastload.planning.items import PHASES, CriticalPath
from hp_fastload.source.index import CheckpointIndex
from tests.helpers.dist import run_distributed
from tests.helpers.tiny_models import tiny_model

DELAY = 0.3


def _delayed(fn, seconds):
    def slow(*args, **kwargs):
        time.sleep(seconds)
        return fn(*args, **kwargs)

    return slow


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("critical-path")
    tiny_model("llama", seed=0).save_pretrained(root)
    return root


def _consistent(path: CriticalPath, seconds: float) -> None:
    assert tuple(path.as_dict()) == PHASES
    assert all(value >= 0.0 for value in path.as_dict().values()), path
    assert math.isclose(path.total, seconds, rel_tol=1e-9, abs_tol=1e-9), (path.total, seconds)


def test_phases_add_up_to_the_wall_time_and_the_values_are_loaded(llama):
    model = tiny_model("llama", seed=1)
    report = hf.load(model, llama, progress=False)
    _consistent(report.critical_path, report.seconds)
    assert report.bytes_read > 0 and report.critical_path.reading > 0.0
    assert report.critical_path.index > 0.0 and report.critical_path.planning > 0.0
    assert "time: index " in report.summary() and "reading " in report.summary()
    reference = tiny_model("llama", seed=0).state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, reference[name]), name


@pytest.mark.parametrize(
    ("phase", "owner", "attribute"),
    [
        ("index", CheckpointIndex, "open"),
        ("planning", load_module.front, "streamed"),
        ("reading", load_module, "execute_stream"),
        ("finishing", load_module, "recreate_buffers"),
    ],
)
def test_each_phase_is_charged_its_own_work(llama, monkeypatch, phase, owner, attribute):
    monkeypatch.setattr(owner, attribute, _delayed(getattr(owner, attribute), DELAY))
    report = hf.load(tiny_model("llama", seed=1), llama, progress=False)
    path = report.critical_path
    _consistent(path, report.seconds)
    assert getattr(path, phase) >= DELAY, (phase, path)
    # the delay is charged once: the other phases together hold less than the wall time minus the delay
    assert path.total - getattr(path, phase) <= report.seconds - DELAY + 1e-9


def test_rehearsal_reports_its_time_to_loaded(llama):
    from hp_fastload.api.rehearse import rehearse

    report, shards = rehearse(tiny_model("llama", seed=1), llama, rank=0, keep=True)
    path = report.critical_path
    assert all(value >= 0.0 for value in path.as_dict().values()), path
    assert path.reading == pytest.approx(report.read_seconds)
    assert path.index + path.planning == pytest.approx(report.plan_seconds)
    assert path.index > 0.0 and path.reading > 0.0
    assert path.agreement == path.waiting == 0.0  # one process: nothing to agree on
    assert "time to loaded" in report.summary()
    reference = tiny_model("llama", seed=0).state_dict()
    assert shards and all(torch.equal(shard, reference[name]) for name, shard in shards.items())


# ---------------------------------------------------------------------------------------------------------
# Two gloo ranks: rank 1 plans DELAY seconds longer; rank 0 waits for it in the planning agreement.


def _two_ranks(rank: int, world_size: int, root: str) -> dict[str, float]:
    if rank == 1:
        load_module.front.streamed = _delayed(load_module.front.streamed, 2 * DELAY)  # this child process only
    torch.distributed.barrier()
    model = tiny_model("llama", seed=1)
    gathered: list[object] = []  # object collectives during the load: the ranks' identities travel only to
    real = torch.distributed.all_gather_object  # word a mismatch (equal checkpoints: one digest all-gather)

    def recorded(out, obj, *args, **kwargs):
        gathered.append(obj)
        return real(out, obj, *args, **kwargs)

    torch.distributed.all_gather_object = recorded
    try:
        report = hf.load(model, root, progress=False)
    finally:
        torch.distributed.all_gather_object = real
    assert gathered == [], gathered
    reference = tiny_model("llama", seed=0).state_dict()
    assert all(torch.equal(t, reference[n]) for n, t in model.state_dict().items())
    _consistent(report.critical_path, report.seconds)
    return {**report.critical_path.as_dict(), "seconds": report.seconds}


def test_a_rank_waiting_for_a_slower_peer_reports_the_wait(llama):
    fast, slow = run_distributed(_two_ranks, 2, str(llama), timeout=120)
    assert slow["planning"] >= 2 * DELAY
    # rank 0 finished planning first and waited in the agreement for rank 1 (lower bound with the ranks'
    # start skew allowed for: both left a barrier just before the load)
    assert fast["waiting"] >= DELAY, fast
    assert fast["agreement"] > 0.0 and slow["agreement"] > 0.0  # the checkpoint identity was compared


def test_planning_done_while_the_engine_reads_is_reported_hidden(llama, monkeypatch):
    """Each region intersection made slow, each engine call slower, every target to an idle engine at once:
    the intersections made while a call runs are ``planning_hidden``, not ``planning`` (one process)."""
    from hp_fastload.execute import read as read_module
    from hp_fastload.execute.batch import Batch
    from hp_fastload.planning import claims as claims_module

    monkeypatch.setattr(read_module, "OVERLAP_BYTES", 1)
    monkeypatch.setattr(read_module, "OVERLAP_SECONDS", 0.0)
    monkeypatch.setattr(claims_module, "region_items", _delayed(claims_module.region_items, 0.01))
    monkeypatch.setattr(Batch, "execute", _delayed(Batch.execute, DELAY / 3))
    model = tiny_model("llama", seed=1)
    report = hf.load(model, llama, progress=False)
    path = report.critical_path
    _consistent(path, report.seconds)
    assert path.planning_hidden >= 0.05, path
    assert "planning hidden behind reads" in report.summary()
    reference = tiny_model("llama", seed=0).state_dict()
    assert all(torch.equal(t, reference[n]) for n, t in model.state_dict().items())
