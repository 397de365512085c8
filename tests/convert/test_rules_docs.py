"""The examples of docs/rules.md, run as written against references computed with torch and torchtitan's own
RoPE permute (``Llama3StateDictAdapter._permute``, the Hugging Face conversion script's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import hp_fastload as hf
from hp_fastload import rules


class _Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.zeros(4, 6, 8))  # [E, 2I, H]


class _Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 32, bias=False)  # 8 heads of 4
        self.k = nn.Linear(8, 8, bias=False)  # 2 KV heads of 4


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = _Experts()
        self.attn = _Attn()


def test_rules_md_example(tmp_path: Path) -> None:
    pytest.importorskip("torchtitan")
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    g = torch.Generator().manual_seed(0)
    ckpt = {
        f"model.experts.{e}.{p}_proj.weight": torch.randn(3, 8, generator=g) for e in range(4) for p in ("gate", "up")
    }
    ckpt["model.attn.q_proj.weight"] = torch.randn(32, 8, generator=g)
    ckpt["model.attn.k_proj.weight"] = torch.randn(8, 8, generator=g)
    save_file(ckpt, str(tmp_path / "model.safetensors"))
    model, path = _Model(), tmp_path
    report = hf.load(  # docs/rules.md, as written
        model,
        path,
        key_mapping={r"^model\.": ""},  # renames first
        weights_mapping=[
            rules.WeightConverter(
                ["experts.*.gate_proj.weight", "experts.*.up_proj.weight"],
                "experts.gate_up",
                [rules.MergeModulelist(0), rules.Concatenate(1)],
            ),
            rules.WeightConverter("attn.q_proj.weight", "attn.q.weight", [rules.PermuteForRope(num_heads=8)]),
            rules.WeightConverter(  # k_proj: the KV head count
                "attn.k_proj.weight", "attn.k.weight", [rules.PermuteForRope(num_heads=8, num_kv_heads=2)]
            ),
        ],
    )
    assert report.missing_keys == ()
    gate = torch.stack([ckpt[f"model.experts.{e}.gate_proj.weight"] for e in range(4)])
    up = torch.stack([ckpt[f"model.experts.{e}.up_proj.weight"] for e in range(4)])
    assert torch.equal(model.experts.gate_up, torch.cat([gate, up], 1))
    permute: Any = Llama3StateDictAdapter._permute
    assert torch.equal(model.attn.q.weight, permute(None, ckpt["model.attn.q_proj.weight"], 8))
    assert torch.equal(model.attn.k.weight, permute(None, ckpt["model.attn.k_proj.weight"], 2))


class AddOne(rules.ConversionOp):  # docs/rules.md, "Your own operation"
    def convert(self, inputs, source_patterns, target_patterns, **kw):  # type: ignore[no-untyped-def]
        (values,) = inputs.values()  # {source pattern: [tensor, ...]}
        return {target_patterns[0]: values[0] + 1.0}


def test_rules_md_own_operation(tmp_path: Path) -> None:
    weight = torch.randn(3, 4)
    save_file({"raw.weight": weight}, str(tmp_path / "model.safetensors"))
    model = nn.Linear(4, 3, bias=False)
    hf.load(model, tmp_path, weights_mapping=[rules.WeightConverter("raw.weight", "weight", [AddOne()])])
    assert torch.equal(model.weight.detach(), weight + 1.0)
