"""``make demo`` (``hp-fastload demo``) on a small Mixtral: every shard, the re-created buffers and one
training step against a single-process ``from_pretrained`` must pass (issue 15, item 5)."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_demo_passes_on_a_small_mixtral(tmp_path, capsys):
    from transformers import MixtralConfig, MixtralForCausalLM

    from hp_fastload.cli.demo import run_demo

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    MixtralForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path)
    status = run_demo(checkpoint=str(tmp_path), world=2, timeout=240)
    out = capsys.readouterr().out
    assert status == 0, out
    assert out.count("(equal); non-persistent buffers not re-created: none") == 2, out
    assert "DEMO OK" in out
