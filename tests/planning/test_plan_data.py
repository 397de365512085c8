"""The plan as plain data and the one read type (issue 12).

A ``LoadPlan`` names its targets by key and holds nothing live: it pickles (nothing live reaches the
pickler), two plannings of the same rank compare equal and another rank's plan does not, and the byte counts
and ``summary`` of an unpickled plan (no index open) are the original's. Every target's reads are
``plan.Reads``. ``batch.Batch`` and ``read_many``'s packer write the same engine records for the same boxes.
"""

from __future__ import annotations

import io
import pickle
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from hp_fastload.convert.symbolic import row_major_strides
from hp_fastload.execute.batch import Batch
from hp_fastload.execute.requests import pack_requests
from hp_fastload.model.targets import Target
from hp_fastload.planning.items import LoadPlan, Reads
from hp_fastload.source.files import SafetensorsFile, open_file
from hp_fastload.source.index import CheckpointIndex
from tests.helpers.plans import virtual_plan
from tests.helpers.tiny_models import tiny_model

LIVE = (Target, torch.nn.Module, torch.Tensor, CheckpointIndex, SafetensorsFile, types.FunctionType)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("plan_data")
    tiny_model("mixtral").to(torch.bfloat16).save_pretrained(root)
    return str(root)


class _NothingLive(pickle.Pickler):
    """A pickler that refuses every live object (targets, modules, tensors, open files, closures)."""

    def persistent_id(self, obj: Any) -> None:
        if isinstance(obj, LIVE):
            raise AssertionError(f"a live {type(obj).__name__} in the plan: {obj!r:.80}")
        return None


def test_plan_pickles_compares_and_prints_without_the_index(mixtral: str) -> None:
    first = virtual_plan(mixtral, world=2, rank=0)[0]
    again = virtual_plan(mixtral, world=2, rank=0)[0]
    other = virtual_plan(mixtral, world=2, rank=1)[0]
    assert isinstance(first, LoadPlan)
    _NothingLive(io.BytesIO()).dump(first)
    assert first == again  # two plannings of the same rank
    assert first != other  # and the comparison sees the reads (the ranks read different experts)
    assert first.report == other.report  # ... which the reports alone do not tell apart
    clone = pickle.loads(pickle.dumps(first))
    assert clone == first
    assert clone.summary() == first.summary()
    assert clone.read_bytes_by_file() == first.read_bytes_by_file()
    assert clone.read_bytes_by_target() == first.read_bytes_by_target()
    assert 0 < clone.bytes_needed < clone.report.checkpoint_bytes
    some = next(iter(clone.region_reads.values()))
    assert not some.storage_base.flags.writeable  # the unpickled columns are read-only again


def test_every_target_reads_the_one_read_type(mixtral: str) -> None:
    plan = virtual_plan(mixtral, world=2, rank=1)[0]
    kinds = {type(reads) for reads in plan.region_reads.values()}
    assert kinds == {Reads}
    experts = [name for name in plan.region_reads if "experts" in name]
    assert experts  # the expert-parallel targets (the shared rows' path) are among them
    for name in experts:
        reads = plan.region_reads[name]
        assert list(reads) and all(item.source in plan.files for item in reads)


def test_batch_packs_the_records_read_many_packs(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    g = torch.Generator().manual_seed(3)
    save_file(
        {"a": torch.randn(6, 8, generator=g), "b": torch.randn(4, 3, 5, generator=g).to(torch.bfloat16)},
        str(path),
    )
    file = open_file(path)
    big = torch.zeros(100, dtype=torch.float32)
    boxes: list[tuple[str, tuple[int, ...], tuple[int, ...], torch.Tensor]] = [
        ("a", (1, 2), (3, 5), big[7:22].view(3, 5)),  # a view at an offset of a larger buffer
        ("b", (1, 0, 2), (2, 3, 3), torch.zeros(2, 3, 3, dtype=torch.bfloat16)),
        ("a", (0, 0), (6, 8), torch.zeros(8, 6).t()),  # a transposed destination
        ("b", (0, 1, 0), (4, 1, 5), torch.zeros(4, 1, 5, dtype=torch.float32)),  # a cast the engine does
    ]
    _, dests, rows = pack_requests([(path, key, off, n, out) for key, off, n, out in boxes])
    batch = Batch()
    for key, off, n, out in boxes:
        strides = row_major_strides(file.shape(key))
        base = sum(o * s for o, s in zip(off, strides, strict=True))
        batch.add(key, base, strides, n, out, (0,) * len(n), file=file)
    assert np.array_equal(batch.records(), rows)
    assert batch.dests == [v for dest in dests for v in dest]


def test_read_many_runs_through_the_shared_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``read_many`` validates its requests itself and then makes its engine call through ``Batch`` (the one
    batch every caller shares): one ``Batch.execute`` per call, the values safetensors' own."""
    from hp_fastload import read_many
    from hp_fastload.execute import batch as batch_module

    path = tmp_path / "m.safetensors"
    tensors = {"a": torch.randn(6, 8), "b": torch.randn(4, 5).to(torch.bfloat16)}
    save_file(tensors, str(path))
    calls: list[int] = []
    real = batch_module.Batch.execute

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(self.count)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(batch_module.Batch, "execute", counted)
    out_a, out_b = torch.zeros(2, 8), torch.zeros(4, 5, dtype=torch.float32)
    stats = read_many([(path, "a", (3, 0), (2, 8), out_a), (path, "b", (0, 0), (4, 5), out_b)], threads=1)
    assert calls == [2]
    assert stats["bytes_copied"] > 0
    assert torch.equal(out_a, tensors["a"][3:5])
    assert torch.equal(out_b, tensors["b"].float())
    assert read_many([]) is not None and calls == [2, 0]  # nothing to read: the engine's stats all the same


def _pairs(reads: Reads, row0: int, cols: int) -> set[tuple[int, int]]:
    """(destination element, storage element) of every element the 2-d reads copy, destinations moved down by
    ``row0`` rows of ``cols``."""
    out = set()
    for item in reads:
        for i in range(item.lengths[0]):
            for j in range(item.lengths[1]):
                dest = (item.dest_offsets[0] + i + row0) * cols + item.dest_offsets[1] + j
                out.add((dest, item.storage_base + i * item.storage_strides[0] + j * item.storage_strides[1]))
    return out


def test_staging_chunks_clip_the_reads_exactly() -> None:
    """Row blocks of a staged target: their reads copy exactly the original element pairs, and their storage
    bytes add up to the original's (a batch sizes itself and reports bytes read by them)."""
    from hp_fastload.execute.staging import staging_chunks

    rows, cols = 10, 4
    local = torch.zeros(rows, cols, dtype=torch.bfloat16)
    # three boxes of a (20, 6) storage tensor: rows 0..3, 3..9 (transposed storage strides), 9..10
    reads = Reads(
        ["a", "b", "a"],
        [0, 7, 100],
        [[6, 1], [1, 6], [6, 1]],
        [[3, 4], [6, 4], [1, 4]],
        [[0, 0], [3, 0], [9, 0]],
        [3 * 4 * 2, 6 * 4 * 2, 1 * 4 * 2],
    )
    slab = 3 * cols * local.element_size()  # three rows a chunk
    chunks = list(staging_chunks(local, reads, slab))
    assert [c.shape[0] for c, _ in chunks] == [3, 3, 3, 1]
    starts = [0, 3, 6, 9]
    got: set[tuple[int, int]] = set()
    for (_, part), r0 in zip(chunks, starts, strict=True):
        got |= _pairs(part, r0, cols)
    assert got == _pairs(reads, 0, cols)
    assert sum(part.total_nbytes for _, part in chunks) == reads.total_nbytes
    assert all(
        int(n) == int(np.prod(ls)) * 2 for _, part in chunks for n, ls in zip(part.nbytes, part.lengths, strict=True)
    )


def test_touched_scale_rows_item_by_item_equals_the_vector_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """Few items take the plain-Python path (``_FEW_ITEMS``): the same rows, in the same spec order, as the
    vectorized form, for random reads over several specs (empty items, negative strides, 0-d and shared specs,
    items without a spec, merging into earlier rows)."""
    import random

    from hp_fastload.convert.quant import Dequant
    from hp_fastload.planning import items as items_mod

    rng = random.Random(7)
    specs = [
        Dequant("a_scale", (300, 256), (128, 128)),
        Dequant("b_scale", (7, 5, 64), (1, 1, 32)),
        Dequant("c_scale", (1000,), (100,)),
        Dequant("d_scale", (), ()),
    ]
    checked = 0
    for _ in range(400):
        n = rng.randint(1, 12)
        ndim = rng.choice([1, 2, 3])
        lengths = [[rng.choice([0, 1, 2, 5, 17]) for _ in range(ndim)] for _ in range(n)]
        strides = [[rng.choice([-3, 1, 64, 256, 5000]) for _ in range(ndim)] for _ in range(n)]
        bases = [rng.randrange(0, 300 * 256) for _ in range(n)]
        second = [rng.choice([*specs, None]) for _ in range(n)]
        reads = items_mod.Reads(["k"] * n, bases, strides, lengths, [[0] * ndim] * n, [1] * n, None, second)
        into = {specs[0]: (1, 1)} if rng.random() < 0.3 else None
        few = items_mod.touched_scale_rows(reads, dict(into) if into else None)
        monkeypatch.setattr(items_mod, "_FEW_ITEMS", -1)
        vector = items_mod.touched_scale_rows(reads, dict(into) if into else None)
        monkeypatch.setattr(items_mod, "_FEW_ITEMS", 16)
        assert list(few.items()) == list(vector.items()), (bases, strides, lengths, second)
        checked += bool(vector)
    assert checked > 200
