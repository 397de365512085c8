"""Writes overlapping planning in ``save`` (issue 40): the key-level plan of the save (every claim, name and shape;
the coverage of the released layout) is agreed before any byte is written, then each rank's region writes start
while its later targets are intersected (``execute.write.write_regions``: a planner thread, the engine on the
calling thread). The checks that need every region (one writer per byte, the same fallbacks on every rank) run
after the writes: the output is in a temporary directory, removed on any failure.

One run of 2 gloo ranks, FSDP2 (``fully_shard`` of each layer and the root), holds every scenario. The saved
directories must equal transformers' ``save_pretrained`` of the same model byte for byte. A failure after the
writes began (a late target that fails to plan, a write that fails, the writers' check) raises on every rank,
leaves nothing at ``path`` (nor its temporary sibling) and no descriptor, map or planner thread open; a
key-level failure writes nothing. ``OVERLAP_BYTES`` / ``OVERLAP_SECONDS`` are set to one byte and no wait in
the children, so every target goes to an idle engine as soon as it is packed.
"""

from __future__ import annotations

import importlib
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hp_fastload.errors import PlanError
from tests.helpers.dist import run_distributed
from tests.helpers.layouts import torch_fsdp
from tests.helpers.tiny_models import tiny_model

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

SHARD = 4000  # several files for the tiny models
LAST_LAYER = "model.layers.1."  # the tiny models have two layers
FAMILIES = ["llama", "mixtral"]


def _open_in(root: str) -> dict[str, list[str]]:
    """This process's descriptors and maps of files under ``root``, and its planner threads."""
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(root):
            fds.append(target)
    with open("/proc/self/maps") as maps:
        mapped = sorted({line.split()[-1] for line in maps if root in line})
    planners = [t.name for t in threading.enumerate() if t.name.startswith("hp-fastload-plan")]
    return {"fds": fds, "maps": mapped, "planners": planners}


class _Logged:
    """The engine's write calls (``Batch.execute`` in the write direction) and the region intersections
    (``planning.claims.region_items``), time-stamped; the last layer's intersections optionally slowed or
    failing, the writes slowed or failing after ``fail_write_after`` calls."""

    def __init__(
        self,
        slow_plan: float = 0.0,
        slow_write: float = 0.0,
        fail_plan: bool = False,
        fail_write_after: int | None = None,
    ) -> None:
        self.claims = importlib.import_module("hp_fastload.planning.claims")
        self.batch = importlib.import_module("hp_fastload.execute.batch").Batch
        self.slow_plan, self.slow_write, self.fail_plan = slow_plan, slow_write, fail_plan
        self.fail_write_after = fail_write_after
        self.planned: list[tuple[float, str]] = []
        self.writes: list[float] = []
        self.written = 0  # calls that returned

    def __enter__(self) -> _Logged:
        real_items, real_execute, log = self.claims.region_items, self.batch.execute, self

        def region_items(target: Any, *args: Any, **kwargs: Any) -> Any:
            name = target.names[0]
            log.planned.append((time.perf_counter(), name))
            if name.startswith(LAST_LAYER):
                time.sleep(log.slow_plan)
                if log.fail_plan:
                    raise PlanError(f"{name}: injected late planning failure")
            return real_items(target, *args, **kwargs)

        def execute(batch: Any, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("direction") != "write":
                return real_execute(batch, *args, **kwargs)
            log.writes.append(time.perf_counter())
            if log.fail_write_after is not None and log.written >= log.fail_write_after:
                raise OSError(28, "No space left on device (injected)")
            if log.slow_write:
                time.sleep(log.slow_write)
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


def _attempt(model: torch.nn.Module, out: Path, log: _Logged) -> dict[str, Any]:
    import hp_fastload as hf

    with log:
        try:
            hf.save(model, out, max_shard_size=SHARD)
            error = ""
        except Exception as exc:  # every rank must raise: recorded, compared by the parent
            error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "writes": len(log.writes), "written": log.written}


def _body(rank: int, world: int, base: str) -> dict[str, Any]:
    import hp_fastload as hf
    from hp_fastload.api import save as save_mod
    from hp_fastload.execute import read as read_mod

    os.environ.update(LOCAL_WORLD_SIZE=str(world))
    read_mod.OVERLAP_BYTES, read_mod.OVERLAP_SECONDS = 1, 0.0  # every target to an idle engine at once
    root = Path(base)
    out: dict[str, Any] = {}

    # 1. streamed saves: the late targets planned slowly, the writes slower, so that some intersections run
    # while the engine writes (planning_hidden > 0) and writes start before the last target is planned
    for family in FAMILIES:
        with _Logged(slow_plan=0.02, slow_write=0.03) as log:
            report = hf.save(_model(family), root / f"out-{family}", max_shard_size=SHARD)
        last_late = max(t for t, name in log.planned if name.startswith(LAST_LAYER))
        out[family] = {
            "written": log.written,
            "first_write_before_last_plan": bool(log.writes) and log.writes[0] < last_late,
            "hidden": report.planning_hidden,
            "bytes": report.bytes_written,
            "by_rank": report.bytes_written_by_rank,
        }
    out["after_success"] = _open_in(base)

    # 2. key-level: rank 1's model has a tensor the released layout (rank 0's files) has no place for
    out["key_level"] = _attempt(_model("llama", extra=rank == 1), root / "key-level", _Logged())

    # 3. the last layer's targets fail to plan on rank 1, after its first writes
    log = _Logged(slow_plan=0.01, fail_plan=rank == 1)
    out["late_plan"] = _attempt(_model("llama"), root / "late-plan", log)
    out["after_late_plan"] = _open_in(base)

    # 4. rank 1's third write call fails (after two that wrote; the last layer planned slowly: several calls)
    log = _Logged(slow_plan=0.01, fail_write_after=2 if rank == 1 else None)
    out["late_write"] = _attempt(_model("llama"), root / "late-write", log)
    out["after_late_write"] = _open_in(base)

    # 5. the writers' check, now after the writes: rank 1 claims 8 bytes more than it writes
    real_planned = save_mod.planned_bytes
    if rank == 1:
        save_mod.planned_bytes = lambda *args: real_planned(*args) + 8
    try:
        out["writers"] = _attempt(_model("llama"), root / "writers", _Logged())
    finally:
        save_mod.planned_bytes = real_planned
    out["after_writers"] = _open_in(base)
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
def test_streamed_save_equals_save_pretrained_and_writes_while_planning(run, family):
    base, outcomes = run
    reference, saved = _files(base / f"ref-{family}"), _files(base / f"out-{family}")
    assert len(reference) > 2 and sorted(saved) == sorted(reference)
    assert [name for name in reference if saved[name] != reference[name]] == []
    for rank, out in enumerate(outcomes):
        row = out[family]
        assert row["written"] >= 2 and row["first_write_before_last_plan"], (rank, row)
        assert row["hidden"] > 0, (rank, row)
        assert sum(row["by_rank"]) == _data_bytes(reference) and row["by_rank"][rank] == row["bytes"] > 0, (rank, row)


def test_a_key_level_failure_writes_nothing_on_any_rank(run):
    base, outcomes = run
    for rank, out in enumerate(outcomes):
        attempt = out["key_level"]
        assert "PlanError" in attempt["error"] and "no place in the released layout" in attempt["error"], rank
        assert attempt["writes"] == 0, (rank, attempt)
    assert "extra" in outcomes[0]["key_level"]["error"] and "rank 1" in outcomes[0]["key_level"]["error"]
    _nothing_left(base, "key-level")


@pytest.mark.parametrize(
    ("scenario", "name", "raised", "words"),
    [
        ("late_plan", "late-plan", "PlanError", "injected late planning failure"),
        ("late_write", "late-write", "OSError", "No space left on device (injected)"),
        ("writers", "writers", "PlanError", "the ranks would write"),
    ],
)
def test_a_failure_after_the_writes_began_raises_everywhere_leaving_nothing(run, scenario, name, raised, words):
    base, outcomes = run
    failing = outcomes[1][scenario]
    assert failing["error"].startswith(raised) and words in failing["error"], failing
    assert failing["written"] >= 1, failing  # rank 1 had written: the failure was late
    assert outcomes[0][scenario]["error"].startswith(raised) and words in outcomes[0][scenario]["error"], outcomes[0]
    if scenario != "writers":  # (the writers' check sees every rank's sums: each raises it as its own)
        assert "rank 1" in outcomes[0][scenario]["error"], outcomes[0]
    _nothing_left(base, name)
    for rank, out in enumerate(outcomes):
        left = out[f"after_{scenario}"]
        assert left["maps"] == [] and left["planners"] == [], (rank, left)
        assert sorted(left["fds"]) == sorted(out["after_success"]["fds"]), (rank, left, out["after_success"])
