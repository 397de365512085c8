"""``plan.Reads``, the one read type: its template form (whole blocks of a shared trace, rows renamed and
moved) against the general block/box intersection.

Each case traces a stacked-experts style conversion over real safetensors files, plans one region of it, and
checks (1) that the items equal the general block/box intersection's, item for item, and (2) that the bytes
the engine writes through them equal torch's own conversion of the tensors safetensors reads, cut to the
region.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from hp_fastload.convert.symbolic import RegionTensor
from hp_fastload.execute.batch import Batch
from hp_fastload.execute.read import ExecStats, add_target_items
from hp_fastload.model.regions import LocalRegion
from hp_fastload.model.targets import Target
from hp_fastload.planning import intersect as regions
from hp_fastload.planning.intersect import VECTOR_BLOCKS, BlockCache, region_items
from hp_fastload.planning.items import LoadPlan, LoadReport, Reads
from hp_fastload.source.index import CheckpointIndex

EXPERTS = 40  # above plan.VECTOR_BLOCKS, so the partial regions take the array test too
ROWS, COLS = 3, 5


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("template_reads")
    g = torch.Generator().manual_seed(7)
    tensors = {
        f"e.{i}.{w}": torch.randn(ROWS, COLS, generator=g).to(torch.bfloat16)
        for i in range(EXPERTS)
        for w in ("gate", "up")
    }
    keys = sorted(tensors)
    save_file({k: tensors[k] for k in keys[: len(keys) // 2]}, str(root / "a.safetensors"))
    save_file({k: tensors[k] for k in keys[len(keys) // 2 :]}, str(root / "b.safetensors"))
    return root


def _leaves(index: CheckpointIndex) -> dict[str, RegionTensor]:
    names = [f"e.{i}.{w}" for i in range(EXPERTS) for w in ("gate", "up")]
    return {k: RegionTensor.leaf(k, index.locate(k).shape, index.locate(k).dtype) for k in names}


def _convert(x: dict[str, Any], fn: Any) -> Any:
    gate = torch.stack([x[f"e.{i}.gate"] for i in range(EXPERTS)])
    up = torch.stack([x[f"e.{i}.up"] for i in range(EXPERTS)])
    return fn(gate, up)


CONVERSIONS = {
    # gate_up_proj: experts stacked, gate and up concatenated along rows
    "stack-cat": lambda gate, up: torch.cat([gate, up], dim=1),
    # the same, transposed per expert (non-unit source strides)
    "stack-cat-transpose": lambda gate, up: torch.cat([gate, up], dim=1).transpose(1, 2),
    "stack-only": lambda gate, up: gate,
}


def _regions(shape: tuple[int, ...]) -> dict[str, tuple[LocalRegion, bool]]:
    """Each region and whether its reads come from the shared rows (True) or the general intersection."""
    e, a, b = shape
    return {
        "full": (LocalRegion.full(shape), True),
        # an expert-parallel rank: experts 8..16, whole
        "experts": (LocalRegion(shape, (((8, 16),), ((0, a),), ((0, b),))), True),
        # rows cut through the blocks: the general intersection
        "rows": (LocalRegion(shape, (((0, e),), ((1, a - 1),), ((0, b),))), False),
        # two boxes (strided sharding): the general intersection
        "two-boxes": (LocalRegion(shape, (((0, 4), (20, 24)), ((0, a),), ((0, b),))), False),
    }


def _counting_intersect(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts calls of the general intersection (``regions.intersect``)."""
    calls: list[int] = []
    original = regions.intersect

    def spy(*args: Any) -> Reads:
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(regions, "intersect", spy)
    return calls


def _target(name: str, region: LocalRegion) -> Target:
    local = torch.zeros(region.local_shape, dtype=torch.bfloat16)
    return Target((name,), local, region.global_shape, torch.bfloat16, local.device, False, _region=region)


@pytest.mark.parametrize("conversion", sorted(CONVERSIONS))
def test_template_reads_equal_the_intersection_and_load_the_right_bytes(
    ckpt: Path, conversion: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = CheckpointIndex.open(ckpt)
    leaves = _leaves(index)
    traced = _convert(leaves, CONVERSIONS[conversion])
    real = {**load_file(str(ckpt / "a.safetensors")), **load_file(str(ckpt / "b.safetensors"))}
    want_full = _convert(real, CONVERSIONS[conversion])
    shape = tuple(traced.shape)
    for label, (region, shared) in _regions(shape).items():
        target = _target("w", region)
        cache = BlockCache()
        with monkeypatch.context() as m:
            calls = _counting_intersect(m)
            items = region_items(target, traced.blocks, index, None, cache)
        assert bool(calls) != shared, label  # the path this case is meant to take
        with monkeypatch.context() as m:
            m.setattr(BlockCache, "columns", lambda self, blocks: None)
            calls = _counting_intersect(m)
            general = region_items(target, traced.blocks, index, None, BlockCache())
        assert calls, label
        assert type(items) is type(general) is Reads  # one read type on both paths
        assert list(items) == list(general), label
        assert items == general, label  # the columns too (nbytes, post), not only the items they give
        assert len(items) == len(general) and (not len(general) or items[-1] == list(general)[-1])

        batch = Batch(index.locate)
        add_target_items(batch, target, items, None)
        stats = ExecStats()
        batch.run(1, None, stats)
        want = want_full
        for d, dim in enumerate(region.intervals):
            want = torch.cat([want.narrow(d, a, b - a) for a, b in dim], dim=d)
        assert torch.equal(target.tensor, want), (conversion, label)
        assert stats.bytes_read == region.numel * 2, label

        files = {k: index.locate(k).file.path for k in items.keys}
        plan = LoadPlan({"w": items}, [], LoadReport((), (), ()), files)
        assert plan.read_bytes_by_target() == {"w": region.numel * 2}
        assert plan.bytes_needed == region.numel * 2
        assert sum(plan.read_bytes_by_file().values()) == region.numel * 2


def test_template_reads_index_like_a_list(ckpt: Path) -> None:
    index = CheckpointIndex.open(ckpt)
    leaves = _leaves(index)
    traced = _convert(leaves, CONVERSIONS["stack-cat"])
    region = LocalRegion(tuple(traced.shape), (((8, 16),), ((0, 2 * ROWS),), ((0, COLS),)))
    items = region_items(_target("w", region), traced.blocks, index, None, BlockCache())
    as_list = list(items)
    assert len(as_list) == len(items) == 16  # 8 experts x (gate, up)
    assert items[-1] == as_list[-1] and items[0] == as_list[0]
    assert items[2:5] == as_list[2:5]
    assert [i.dest_offsets[0] for i in as_list[:4]] == [0, 0, 1, 1]  # moved from experts 8, 9 to local 0, 1
    with pytest.raises(IndexError):
        items[len(items)]
    assert "Reads(16 items" in repr(items)


def test_post_ops_ride_in_the_columns(ckpt: Path) -> None:
    """Blocks with post-ops keep them per item in the one read type, on both paths."""
    index = CheckpointIndex.open(ckpt)
    leaves = _leaves(index)
    traced = _convert(leaves, lambda gate, up: gate * 2)
    shape = tuple(traced.shape)
    for region in (LocalRegion.full(shape), LocalRegion(shape, (((8, 16),), ((0, ROWS),), ((0, COLS),)))):
        items = region_items(_target("w", region), traced.blocks, index, None, BlockCache())
        assert items.post is not None and len(items) and all(i.post for i in items)
        with pytest.MonkeyPatch.context() as m:
            m.setattr(BlockCache, "columns", lambda self, blocks: None)
            general = region_items(_target("w", region), traced.blocks, index, None, BlockCache())
        assert items == general
    assert VECTOR_BLOCKS < EXPERTS


def test_template_reads_into_a_dtype_the_engine_does_not_cast_to(ckpt: Path) -> None:
    """bf16 expert reads into an int32 target go through temporaries and torch's own cast."""
    index = CheckpointIndex.open(ckpt)
    traced = _convert(_leaves(index), CONVERSIONS["stack-cat"])
    region = LocalRegion(tuple(traced.shape), (((8, 16),), ((0, 2 * ROWS),), ((0, COLS),)))
    local = torch.zeros(region.local_shape, dtype=torch.int32)
    target = Target(("w",), local, region.global_shape, torch.int32, local.device, False, _region=region)
    items = region_items(target, traced.blocks, index, None, BlockCache())
    batch = Batch(index.locate)
    add_target_items(batch, target, items, None)
    batch.run(1, None, ExecStats())
    real = {**load_file(str(ckpt / "a.safetensors")), **load_file(str(ckpt / "b.safetensors"))}
    want = _convert(real, CONVERSIONS["stack-cat"])[8:16].to(torch.int32)
    assert int(want.count_nonzero()) > 0  # the zeroed target alone would not pass
    assert torch.equal(local, want)
