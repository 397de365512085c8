"""natural.py, the one owner of key order: the index's order (Rust fast path plus the names it hands back)
and ``KeyOrder.sorted`` equal transformers' ``dot_natural_key`` order with ties broken by name."""

import json
import random

import torch
from safetensors.torch import save_file
from transformers.core_model_loading import dot_natural_key as hf_dot_natural_key

from hp_fastload.source import natural
from hp_fastload.source.index import CheckpointIndex
from tests.helpers.shards import write_sharded


def _reference(names):
    return sorted(names, key=lambda n: (hf_dot_natural_key(n), n))


def test_index_order_and_subsets_match_transformers_ties_by_name(tmp_path):
    # ties (x.01 / x.1 / x.001) among names the Rust key takes and among names it hands back (non-ASCII)
    names = ["x.1", "x.01", "x.001", "x.10", "x.2", "é.1", "é.01", "é.1.a", "e².3", "٣.w", "a.b", "a", "a.b.0"]
    names += ["layers." + "9" * 30 + ".w", "layers.7.w", "w_03", "w_3", "w_", ""]
    rng = random.Random(5)
    rng.shuffle(names)
    write_sharded(tmp_path, [names[0::2], names[1::2]])
    index = CheckpointIndex.open(tmp_path)
    assert index.keys() == _reference(names)
    assert natural.natural_sorted(names) == _reference(names)
    for picked in (rng.sample(names, 3), rng.sample(names, len(names) - 2)):
        extra = ["zz.1", "zz.01", "ü.2", "ü.02"]  # not checkpoint keys: sorted after them, ties by name
        assert index.natural_sorted(picked + extra) == _reference(picked) + _reference(extra)
    # a few names (at most an eighth of the keys): a scan of the keys at the first such call, the position
    # table from the second on
    for call, picked in enumerate((["x.1", "é.1"], ["x.01", "a"], ["w_3", "x.10"])):
        assert index.natural_sorted(picked) == _reference(picked)
        assert (index._order._position is not None) == (call > 0)


def test_partial_index_orders_only_its_keys(tmp_path):
    """An index that lists some of a file's keys: the order holds those, each once."""
    save_file({f"l.{i}.w": torch.zeros(1) for i in (1, 2, 10, 11)}, str(tmp_path / "s.safetensors"))
    weight_map = {"l.11.w": "s.safetensors", "l.2.w": "s.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    index = CheckpointIndex.open(tmp_path)
    assert index.keys() == ["l.2.w", "l.11.w"]
