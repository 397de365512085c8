"""The file each planned read comes from (``LoadPlan.files``, ``read_bytes_by_file``): the file that holds the
key, or the one the index names when two headers have it. Checkpoints from transformers' ``save_pretrained``
(sharded) and safetensors' ``save_file``; the expected bytes are what safetensors reads from each file.
"""

from __future__ import annotations

import json

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

import hp_fastload as hf
from tests.helpers import quant_checkpoints as qc


def test_each_read_is_counted_in_the_file_that_holds_it(tmp_path):
    model = qc.build_model("llama")
    model.save_pretrained(tmp_path, max_shard_size="2KB")
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) > 2
    expected = {}
    for path in files:
        with safe_open(str(path), "pt") as f:
            expected[str(path)] = sum(f.get_tensor(k).nbytes for k in f.keys())  # noqa: SIM118 (safe_open is not iterable)
    plan = hf.plan(qc.build_model("llama"), tmp_path)
    assert not plan.report.unexpected_keys and not plan.report.missing_keys
    assert plan.read_bytes_by_file() == expected


def test_a_key_in_two_headers_is_read_from_the_file_the_index_names(tmp_path):
    save_file({"x": torch.ones(4), "y": torch.ones(3)}, str(tmp_path / "a.safetensors"))
    save_file({"x": torch.full((4,), 2.0)}, str(tmp_path / "b.safetensors"))
    weight_map = {"x": "b.safetensors", "y": "a.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model = nn.Module()
    model.x = nn.Parameter(torch.zeros(4))
    model.y = nn.Parameter(torch.zeros(3))
    plan = hf.plan(model, tmp_path)
    assert plan.read_bytes_by_file() == {str(tmp_path / "a.safetensors"): 12, str(tmp_path / "b.safetensors"): 16}
    hf.load(model, tmp_path)
    with safe_open(str(tmp_path / "b.safetensors"), "pt") as f:
        assert torch.equal(model.x.detach(), f.get_tensor("x"))
