"""The transfer examples and the transfer guide's snippet run on four gloo ranks (one spawn):
``examples/rl_weight_sync.py`` on the same ranks and on disjoint ranks (the generator must equal the trainer bit
for bit after every optimizer step, and run a forward pass), ``examples/elastic_replica.py`` (the new replica
must equal the live one, each new rank receiving exactly its own shards), and ``docs/guides/transfer.md``'s
``transfer`` snippet as written, between the RL example's FSDP2 trainer and TP generator (the generator must
then equal the trainer)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.helpers.dist import run_distributed, run_subchecks, subcheck_values
from tests.helpers.docs import run_snippet, snippet

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _example(name: str) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def check_rl_same_ranks(rank: int, world: int) -> Any:
    return _example("rl_weight_sync").run(rank, world, disjoint=False, steps=2)


def check_rl_disjoint(rank: int, world: int) -> Any:
    return _example("rl_weight_sync").run(rank, world, disjoint=True, steps=2)


def check_elastic(rank: int, world: int) -> Any:
    return _example("elastic_replica").run(rank, world, steps=1)


GUIDE = "docs/guides/transfer.md"


def check_guide_snippet(rank: int, world: int) -> Any:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    example = _example("rl_weight_sync")
    config = example.tiny_llama_config()
    mesh = init_device_mesh("cpu", (world,))
    trainer = example.build_trainer(config, mesh, "cpu", seed=3)
    generator = example.build_generator(config, mesh, "cpu")
    namespace = run_snippet(snippet(GUIDE, "transfer"), {"trainer": trainer, "generator": generator})
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (example.digests(trainer), example.digests(generator)))
    return {"printed": namespace["__stdout__"], "equal": all(t == g for t, g in gathered)}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    checks = [check_rl_same_ranks, check_rl_disjoint, check_elastic, check_guide_snippet]
    return run_distributed(run_subchecks, 4, checks=checks, timeout=240)


def test_the_guide_snippet_runs_as_written(ranks: list[dict[str, Any]]) -> None:
    for rank, got in enumerate(subcheck_values(ranks, "check_guide_snippet")):
        assert got["equal"] and got["printed"].strip() == "moved / needed: 1.00", (rank, got)


@pytest.mark.parametrize("check", ["check_rl_same_ranks", "check_rl_disjoint"])
def test_rl_weight_sync_makes_the_generator_the_trainer(ranks: list[dict[str, Any]], check: str) -> None:
    for rank, records in enumerate(subcheck_values(ranks, check)):
        assert len(records) == 2, (rank, records)
        # the first sync plans, the next one runs the same plan (same models, same tensors)
        assert [r["planned"] for r in records] == [True, False], (rank, records)
        for record in records:
            assert record["equal"] and record["differing"] == [], (rank, record)
            assert record["finite"] and record["moved_over_needed"] == 1.0, (rank, record)
    if check == "check_rl_disjoint":
        values = subcheck_values(ranks, check)
        assert all(r["bytes_received"] == 0 and r["bytes_sent"] > 0 for r in values[0] + values[1])
        assert all(r["bytes_sent"] == 0 and r["bytes_received"] > 0 for r in values[2] + values[3])


def test_elastic_replica_is_filled_from_the_live_one(ranks: list[dict[str, Any]]) -> None:
    values = subcheck_values(ranks, "check_elastic")
    for rank, got in enumerate(values):
        assert got["equal"], (rank, got)
        assert got["moved_over_needed"] == 1.0, (rank, got)
    for got in values[2:]:  # the new ranks receive exactly their own shards
        assert got["received"] == got["needed"] > 0 and got["sent"] == 0, got
