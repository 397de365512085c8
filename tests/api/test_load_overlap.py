"""Reads overlapping planning (issue 40): ``load`` agrees the key-level plan (names, shapes, the strict check)
before any byte is read, then intersects the regions while the engine reads the first ones
(``execute.read.execute_stream``). A failure after reading started (a late target that fails to plan, a read of
a file truncated under the load) still raises on every rank and leaves nothing open (no descriptor or map of
the checkpoint, no planner thread); a key-level failure reads nothing.

One run of 2 gloo ranks holds every scenario. ``OVERLAP_BYTES`` / ``OVERLAP_SECONDS`` are set to one byte and no
wait in the children, so every target goes to an idle engine as soon as it is packed: the late failures come
after real engine calls.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import hp_fastload as hf
from hp_fastload.api import load as load_module
from hp_fastload.execute import read as read_module
from hp_fastload.execute.batch import Batch
from hp_fastload.planning import claims as claims_module
from tests.helpers.dist import run_distributed
from tests.helpers.opened import open_under
from tests.helpers.tiny_models import tiny_model

LAST_LAYER = "model.layers.1."  # the tiny llama has two layers


class _Counted:
    """``Batch.execute`` counted: calls made and calls that returned (the bytes they read)."""

    def __init__(self) -> None:
        self.calls = self.done = self.nbytes = 0
        self.real = Batch.execute

    def __enter__(self) -> _Counted:
        counter = self

        def execute(batch: Batch, *args: Any, **kwargs: Any) -> Any:
            counter.calls += 1
            out = counter.real(batch, *args, **kwargs)
            counter.done += 1
            counter.nbytes += batch.nbytes
            return out

        Batch.execute = execute  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        Batch.execute = self.real  # type: ignore[method-assign]


def _attempt(model: torch.nn.Module, root: str) -> dict[str, Any]:
    with _Counted() as counted:
        try:
            hf.load(model, root, progress=False)
            error = ""
        except Exception as exc:  # every rank must raise: recorded, compared by the parent
            error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "calls": counted.calls, "done": counted.done, "bytes": counted.nbytes}


def _late_file(root: str) -> str:
    """A shard holding only the last layer's tensors (none of the first targets read: embeddings, head)."""
    weight_map = json.loads((Path(root) / "model.safetensors.index.json").read_text())["weight_map"]
    early = {f for k, f in weight_map.items() if not k.startswith(LAST_LAYER)}
    late = sorted({f for k, f in weight_map.items() if k.startswith(LAST_LAYER)} - early)
    assert late, weight_map
    return late[-1]


def _body(rank: int, world_size: int, base: str) -> dict[str, Any]:
    read_module.OVERLAP_BYTES, read_module.OVERLAP_SECONDS = 1, 0.0  # every target to an idle engine at once
    root = f"{base}/rank{rank}"
    out: dict[str, Any] = {}

    # 1. the streamed load itself: several engine calls, the values transformers saved
    model = tiny_model("llama", seed=1)
    with _Counted() as counted:
        report = hf.load(model, root, progress=False)
    reference = tiny_model("llama", seed=0).state_dict()
    out["equal"] = all(torch.equal(t, reference[n]) for n, t in model.state_dict().items())
    out["calls"] = counted.done
    out["phases_add_up"] = abs(report.critical_path.total - report.seconds) < 1e-9
    out["after_success"] = open_under(base)

    # 2. key-level failure on rank 1 (a model tensor no checkpoint holds, strict): nothing read on any rank
    model = tiny_model("llama", seed=1)
    if rank == 1:
        model.register_parameter("extra", torch.nn.Parameter(torch.zeros(3)))
    out["key_level"] = _attempt(model, root)

    # 3. a late target fails to plan on rank 1 (its region intersection raises) after reads began
    real_items = claims_module.region_items

    def failing(target: Any, *args: Any, **kwargs: Any) -> Any:
        if rank == 1 and target.names[0].startswith(LAST_LAYER):
            raise hf.errors.PlanError(f"{target.names[0]}: injected late planning failure")
        return real_items(target, *args, **kwargs)

    claims_module.region_items = failing
    try:
        out["late_plan"] = _attempt(tiny_model("llama", seed=1), root)
    finally:
        claims_module.region_items = real_items
    out["after_late_plan"] = open_under(base)

    # 4. rank 1's last shard truncated once the plan is agreed: the reads of its late targets fail
    real_streamed = load_module.front.streamed

    def truncating(*args: Any, **kwargs: Any) -> Any:
        stream = real_streamed(*args, **kwargs)
        if rank == 1:
            late = Path(root) / _late_file(root)
            os.truncate(late, late.stat().st_size - 64)
        return stream

    load_module.front.streamed = truncating
    try:
        out["late_read"] = _attempt(tiny_model("llama", seed=1), root)
    finally:
        load_module.front.streamed = real_streamed
    out["after_late_read"] = open_under(base)
    return out


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> list[dict[str, Any]]:
    base = tmp_path_factory.mktemp("overlap")
    saved = base / "saved"
    tiny_model("llama", seed=0).save_pretrained(saved)
    # re-sharded with safetensors: the last layer in a file of its own (the one a late read fails on)
    tensors = load_file(saved / "model.safetensors")
    (saved / "model.safetensors").unlink()
    files = {"model-00001-of-00002.safetensors": False, "model-00002-of-00002.safetensors": True}
    weight_map = {}
    for name, late in files.items():
        part = {k: v for k, v in tensors.items() if k.startswith(LAST_LAYER) == late}
        save_file(part, saved / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    (saved / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert _late_file(str(saved)) == "model-00002-of-00002.safetensors"
    for rank in range(2):  # a copy per rank: rank 1 truncates its own
        shutil.copytree(saved, base / f"rank{rank}")
    return run_distributed(_body, 2, str(base), timeout=180)


def test_the_streamed_load_reads_in_several_calls_and_loads_the_saved_values(outcomes):
    for out in outcomes:
        assert out["equal"] and out["phases_add_up"]
        assert out["calls"] >= 2, out["calls"]


def test_a_key_level_failure_reads_no_byte_on_any_rank(outcomes):
    for rank, out in enumerate(outcomes):
        attempt = out["key_level"]
        assert attempt["error"], rank
        assert attempt["calls"] == 0 and attempt["bytes"] == 0, (rank, attempt)
    assert outcomes[1]["key_level"]["error"].startswith("MissingKeysError")
    assert "extra" in outcomes[0]["key_level"]["error"]  # the peer's failure, named on rank 0


@pytest.mark.parametrize(
    ("scenario", "raised", "words"),
    [("late_plan", "PlanError", "injected late planning failure"), ("late_read", "ReadError", "truncated")],
)
def test_a_late_failure_raises_on_every_rank_with_nothing_left_open(outcomes, scenario, raised, words):
    failing = outcomes[1][scenario]
    assert failing["error"].startswith(raised), failing
    assert failing["done"] >= 1 and failing["bytes"] > 0, failing  # reads had begun: the failure was late
    assert words in outcomes[0][scenario]["error"], outcomes[0][scenario]  # rank 0 raised, naming it
    for rank, out in enumerate(outcomes):
        assert out[scenario]["error"], rank
        left = out[f"after_{scenario}"]
        assert left["maps"] == [] and left["planners"] == [], (rank, left)
        # descriptors: none beyond what a finished load keeps
        assert sorted(left["fds"]) == sorted(out["after_success"]["fds"]), (rank, left, out["after_success"])
