"""The order of ``save`` on real ranks (issue 40): every region is planned and every check passed (the coverage of
the released layout, one writer per byte, the same fallbacks on every rank) before the first byte is written.
``save`` does not write while later targets are planned, as ``load`` reads: its region planning is under 1% of
a save at every size measured (docs/perf-notes.md, session 20), so the writes wait for the whole plan.

One run of 2 gloo ranks, FSDP2 (``fully_shard`` of each layer and the root), holds every scenario. The saved
directories equal transformers' ``save_pretrained`` of the same model byte for byte, each rank writing its own
share. A failure on rank 1 (a tensor the layout has no place for, a late target that fails to plan, the writers'
check, a write after others succeeded) raises on every rank, leaves nothing at ``path`` (nor its temporary
sibling) and no descriptor or map of its files open; a failure while planning writes no byte.
"""

from __future__ import annotations

import importlib
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hp_fastload.errors import PlanError
from tests.helpers.dist import run_distributed
from tests.helpers.layouts import torch_fsdp
from tests.helpers.opened import open_under
from tests.helpers.tiny_models import tiny_model

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

SHARD = 4000  # several files for the tiny models
LAST_LAYER = "model.layers.1."  # the tiny models have two layers
FAMILIES = ["llama", "mixtral"]


class _Logged:
    """The engine's write calls (``Batch.execute`` in the write direction) and the region intersections
    (``planning.claims.region_items``), time-stamped; the last layer's intersections optionally failing, the
    writes failing after ``fail_write_after`` calls."""

    def __init__(self, fail_plan: bool = False, fail_write_after: int | None = None) -> None:
        self.claims = importlib.import_module("hp_fastload.planning.claims")
        self.batch = importlib.import_module("hp_fastload.execute.batch").Batch
        self.fail_plan, self.fail_write_after = fail_plan, fail_write_after
        self.planned: list[tuple[float, str]] = []
        self.writes: list[float] = []
        self.written = 0  # calls that returned

    def __enter__(self) -> _Logged:
        real_items, real_execute, log = self.claims.region_items, self.batch.execute, self

        def region_items(target: Any, *args: Any, **kwargs: Any) -> Any:
            name = target.names[0]
            log.planned.append((time.perf_counter(), name))
            if log.fail_plan and name.startswith(LAST_LAYER):
                raise PlanError(f"{name}: injected late planning failure")
            return real_items(target, *args, **kwargs)

        def execute(batch: Any, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("direction") != "write":
                return real_execute(batch, *args, **kwargs)
            log.writes.append(time.perf_counter())
            if log.fail_write_after is not None and log.written >= log.fail_write_after:
                raise OSError(28, "No space left on device (injected)")
            out = real_execute(batch, *args, **kwargs)
            log.written += 1
            return out

        self.saved = (real_items, real_execute)
        self.claims.region_items = region_items
        self.batch.execute = execute
        return self

    def __exit__(self, *exc: object) -> None:
        self.claims.region_items, self.batch.execute = self.saved


def _model(family: str, extra: bool = False) -> torch.nn.Module:
    model = tiny_model(family)
    torch_fsdp(model, torch.distributed.get_world_size())
    if extra:  # a tensor no released key holds on this rank only
        model.register_parameter("extra", torch.nn.Parameter(torch.zeros(3)))
    return model


def _attempt(model: torch.nn.Module, out: Path, log: _Logged, **kwargs: Any) -> dict[str, Any]:
    import hp_fastload as hf

    with log:
        try:
            hf.save(model, out, max_shard_size=SHARD, **kwargs)
            error = ""
        except Exception as exc:  # every rank must raise: recorded, compared by the parent
            error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "writes": len(log.writes), "written": log.written}


def _body(rank: int, world: int, base: str) -> dict[str, Any]:
    import hp_fastload as hf
    from hp_fastload.api import save as save_mod

    os.environ.update(LOCAL_WORLD_SIZE=str(world))
    root = Path(base)
    out: dict[str, Any] = {}

    # 1. the saves: every target planned before the first write
    for family in FAMILIES:
        with _Logged() as log:
            report = hf.save(_model(family), root / f"out-{family}", max_shard_size=SHARD)
        out[family] = {
            "planned": len(log.planned),
            "written": log.written,
            "planned_before_writes": bool(log.writes) and max(t for t, _ in log.planned) < log.writes[0],
            "bytes": report.bytes_written,
            "by_rank": report.bytes_written_by_rank,
        }
    out["after_success"] = open_under(base)

    # 2. rank 1's model has a tensor the released layout (rank 0's files) has no place for
    out["key_level"] = _attempt(_model("llama", extra=rank == 1), root / "key-level", _Logged())
    out["after_key_level"] = open_under(base)

    # 3. the last layer's targets fail to plan on rank 1
    out["late_plan"] = _attempt(_model("llama"), root / "late-plan", _Logged(fail_plan=rank == 1))
    out["after_late_plan"] = open_under(base)

    # 4. the writers' check: rank 1 claims 8 bytes more than it writes
    real_planned = save_mod.planned_bytes
    if rank == 1:
        save_mod.planned_bytes = lambda *args: real_planned(*args) + 8
    try:
        out["writers"] = _attempt(_model("llama"), root / "writers", _Logged())
    finally:
        save_mod.planned_bytes = real_planned
    out["after_writers"] = open_under(base)

    # 5. rank 1's third write call fails, after two that wrote (a batch per target: batch_bytes=1)
    log = _Logged(fail_write_after=2 if rank == 1 else None)
    out["late_write"] = _attempt(_model("llama"), root / "late-write", log, batch_bytes=1)
    out["after_late_write"] = open_under(base)
    return out


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def _data_bytes(files: dict[str, bytes]) -> int:
    """The tensor data of the safetensors files: each file less its 8-byte length and header."""
    return sum(
        len(raw) - 8 - int.from_bytes(raw[:8], "little") for n, raw in files.items() if n.endswith(".safetensors")
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    base = tmp_path_factory.mktemp("save_overlap")
    for family in FAMILIES:
        tiny_model(family).save_pretrained(base / f"ref-{family}", max_shard_size=SHARD)
    return base, run_distributed(_body, 2, str(base), timeout=240)


def _nothing_left(base: Path, name: str) -> None:
    assert not (base / name).exists()
    assert [p.name for p in base.iterdir() if p.name.startswith(f".{name}.")] == []


@pytest.mark.parametrize("family", FAMILIES)
def test_save_equals_save_pretrained_planning_every_region_first(run, family):
    base, outcomes = run
    reference, saved = _files(base / f"ref-{family}"), _files(base / f"out-{family}")
    assert len(reference) > 2 and sorted(saved) == sorted(reference)
    assert [name for name in reference if saved[name] != reference[name]] == []
    for rank, out in enumerate(outcomes):
        row = out[family]
        assert row["planned"] > 0 and row["written"] >= 1 and row["planned_before_writes"], (rank, row)
        assert sum(row["by_rank"]) == _data_bytes(reference) and row["by_rank"][rank] == row["bytes"] > 0, (rank, row)


@pytest.mark.parametrize(
    ("scenario", "name", "raised", "words"),
    [
        ("key_level", "key-level", "PlanError", "no place in the released layout"),
        ("late_plan", "late-plan", "PlanError", "injected late planning failure"),
        ("writers", "writers", "PlanError", "the ranks would write"),
    ],
)
def test_a_failure_while_planning_writes_nothing_and_raises_everywhere(run, scenario, name, raised, words):
    base, outcomes = run
    for rank, out in enumerate(outcomes):
        attempt = out[scenario]
        assert attempt["error"].startswith(raised) and words in attempt["error"], (rank, attempt)
        assert attempt["writes"] == 0, (rank, attempt)
        left = out[f"after_{scenario}"]
        assert left["maps"] == [] and sorted(left["fds"]) == sorted(out["after_success"]["fds"]), (rank, left)
    if scenario != "writers":  # (the writers' check sees every rank's sums: each raises it as its own)
        assert "rank 1" in outcomes[0][scenario]["error"], outcomes[0][scenario]
    if scenario == "key_level":
        assert "extra" in outcomes[0][scenario]["error"]
    _nothing_left(base, name)


def test_a_write_failure_after_others_succeeded_raises_everywhere_leaving_nothing(run):
    base, outcomes = run
    failing = outcomes[1]["late_write"]
    assert failing["error"].startswith("OSError") and "No space left on device (injected)" in failing["error"]
    assert failing["written"] == 2, failing  # two batches written before the one that failed
    assert "No space left on device (injected)" in outcomes[0]["late_write"]["error"]
    assert "rank 1" in outcomes[0]["late_write"]["error"], outcomes[0]
    _nothing_left(base, "late-write")
    for rank, out in enumerate(outcomes):
        left = out["after_late_write"]
        assert left["maps"] == [] and sorted(left["fds"]) == sorted(out["after_success"]["fds"]), (rank, left)
