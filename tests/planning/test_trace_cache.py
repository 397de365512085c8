"""The trace cache's exactness: groups share a trace only when every source's stored dtype and shape agree
(``CheckpointIndex.facts_many`` in the signature), checked against torch running the same conversion on
the tensors safetensors reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hp_fastload import rules
from hp_fastload.convert.groups import build_groups
from hp_fastload.planning.trace import Tracer
from hp_fastload.source.index import CheckpointIndex

LAYERS = 4  # 0 and 3 alike; 1: one source's shape differs; 2: one source's dtype differs


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(LAYERS):
        tensors[f"layers.{i}.attn.q.weight"] = torch.randn(4, 3, generator=g)
        k_rows, k_dtype = (2, torch.float32) if i == 1 else (4, torch.bfloat16 if i == 2 else torch.float32)
        tensors[f"layers.{i}.attn.k.weight"] = torch.randn(k_rows, 3, generator=g).to(k_dtype)
    path = tmp_path_factory.mktemp("trace_cache") / "model.safetensors"
    save_file(tensors, str(path))
    return path


def _groups(index: CheckpointIndex) -> list:
    rule = rules.WeightConverter(["attn.q.weight", "attn.k.weight"], "attn.qk.weight", [rules.Concatenate(0)])
    targets = {f"layers.{i}.attn.qk.weight" for i in range(LAYERS)}
    groups, unexpected = build_groups(index.keys(), targets, [rule])
    assert not unexpected and [g.target for g in groups] == [f"layers.{i}.attn.qk.weight" for i in range(LAYERS)]
    return groups


def test_groups_that_differ_in_one_sources_shape_or_dtype_do_not_share_a_trace(ckpt: Path) -> None:
    index = CheckpointIndex.open(ckpt)
    stored = load_file(str(ckpt))
    groups = _groups(index)
    tracer = Tracer(index, None, lambda name: None, trace=True)
    traced = [tracer.run(g) for g in groups]
    assert len(tracer.cache) == 3, "layers 0 and 3 share one trace; 1 and 2 have their own"
    for i, (group, t) in enumerate(zip(groups, traced, strict=True)):
        name = f"layers.{i}.attn.qk.weight"
        expected = torch.cat([stored[f"layers.{i}.attn.q.weight"], stored[f"layers.{i}.attn.k.weight"]], 0)
        assert t.shapes == {name: tuple(expected.shape)}, f"layer {i}"
        assert t.dtypes == {name: expected.dtype}, f"layer {i}"
        blocks = t.outputs[name]
        assert blocks is not None
        # Each block reads its source as stored: dtype and shape of the tensor safetensors reads.
        for b in blocks:
            source = stored[t.sources[b.source]]
            assert (b.src_dtype, tuple(b.src_shape)) == (source.dtype, tuple(source.shape)), f"layer {i}"
        # And the region over the real keys is what a fresh trace of this group alone gives.
        alone = Tracer(index, None, lambda name: None, trace=True).run(group)
        assert t.region(name) is not None and alone.region(name) is not None
        assert t.region(name).blocks == alone.region(name).blocks, f"layer {i}"


def test_facts_many_is_the_bulk_form_of_dtype_name_and_shape(ckpt: Path) -> None:
    index = CheckpointIndex.open(ckpt)
    keys = index.keys()
    facts = index.facts_many(keys)
    stored = {k: (index.locate(k).dtype_name, index.locate(k).shape) for k in keys}
    for a, fa in zip(keys, facts, strict=True):
        for b, fb in zip(keys, facts, strict=True):
            assert (fa == fb) == (stored[a] == stored[b]), (a, b)
    assert len(set(facts)) == 3  # F32 [4,3], F32 [2,3], BF16 [4,3]
    # Process-wide ids: a second index over the same file agrees.
    assert CheckpointIndex.open(ckpt.parent).facts_many(keys[::-1]) == facts[::-1]
    with pytest.raises(KeyError, match=r"checkpoint key is not indexed: 'layers\.9\.attn\.q\.weight'"):
        index.facts_many([keys[0], "layers.9.attn.q.weight"])


def test_facts_many_takes_each_key_from_the_file_the_index_takes_it_from(tmp_path: Path) -> None:
    # "w" is in both shards with different shapes; the weight_map takes it from s1: its facts are s1's.
    save_file({"w": torch.zeros(2, 3), "a": torch.zeros(2, 3)}, str(tmp_path / "s0.safetensors"))
    save_file({"w": torch.zeros(3, 2), "b": torch.zeros(3, 2)}, str(tmp_path / "s1.safetensors"))
    weight_map = {"a": "s0.safetensors", "w": "s1.safetensors", "b": "s1.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    index = CheckpointIndex.open(tmp_path)
    assert index.locate("w").shape == (3, 2)
    w, a, b = index.facts_many(["w", "a", "b"])
    assert w == b != a
    with pytest.raises(KeyError, match="checkpoint key is not indexed: 'c'"):
        index.facts_many(["a", "c"])
