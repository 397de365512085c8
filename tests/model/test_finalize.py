"""What ``load`` finishes beyond the checkpoint (issue 15, item 1): ties and non-persistent buffers.

A model built on meta and materialized with ``to_empty`` has its tied weights untied (torch swaps the tensors)
and garbage in its non-persistent buffers (rotary ``inv_freq``). After ``hp_fastload.load`` the ties must hold
and the buffers, the forward loss and the loss after one optimizer step must equal transformers' own
``from_pretrained`` (one process: the same ops, so bit-equal).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import hp_fastload
from hp_fastload.model.finalize import non_persistent_buffers
from tests.helpers.bits import bits
from tests.helpers.tiny_models import TINY_DECODER, config_of, randomized, sgd_step_losses

LLAMA = dict(TINY_DECODER, tie_word_embeddings=True)


def _config():
    return config_of("llama", **LLAMA)


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = randomized(AutoModelForCausalLM.from_config(_config()), 0.5)
    path = tmp_path_factory.mktemp("tied_llama")
    model.save_pretrained(path)
    return path


def _meta_materialized():
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_config(), dtype=torch.float32)
    model.to_empty(device="cpu")
    return model


def _step_losses(model: nn.Module) -> tuple[float, float]:
    torch.manual_seed(1)
    ids = torch.randint(0, LLAMA["vocab_size"], (2, 9))
    loss, after = sgd_step_losses(model, ids, lr=0.1)
    return loss.item(), after.item()


def test_to_empty_unties_and_load_reties_and_recreates_buffers(tied_llama):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tied_llama, dtype=torch.float32)
    model = _meta_materialized()
    assert model.lm_head.weight is not model.model.embed_tokens.weight  # what to_empty does to a tie
    report = hp_fastload.load(model, tied_llama)
    assert report.retied_keys == ("lm_head.weight",)
    assert report.unfilled_buffers == ()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    expected = dict(non_persistent_buffers(reference))
    got = dict(non_persistent_buffers(model))
    assert sorted(got) == sorted(expected) == ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]
    for name, value in expected.items():
        assert torch.equal(bits(got[name]), bits(value)), name
    assert _step_losses(model) == _step_losses(reference)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still one tensor after the step


def test_buffers_are_recreated_without_walking_the_whole_model(tied_llama, monkeypatch):
    """The rotary buffers come from the model's own init applied to the module that holds them, not from a full
    ``initialize_weights()`` (a walk through every module: most of the call's cost on a large model); bit-equal
    to transformers' own ``from_pretrained``."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tied_llama, dtype=torch.float32)
    model = _meta_materialized()

    def walk_everything() -> None:
        raise AssertionError("initialize_weights() walked the whole model")

    monkeypatch.setattr(model, "initialize_weights", walk_everything)
    report = hp_fastload.load(model, tied_llama)
    assert report.unfilled_buffers == ()
    expected = dict(non_persistent_buffers(reference))
    got = dict(non_persistent_buffers(model))
    for name, value in expected.items():
        assert torch.equal(bits(got[name]), bits(value)), name


def test_without_finalize_the_tie_stays_broken(tied_llama):
    model = _meta_materialized()
    with pytest.raises(RuntimeError, match=r"lm_head\.weight"):
        hp_fastload.load(model, tied_llama, finalize=False)


def test_a_missing_parameter_is_not_reinitialized(tmp_path):
    """strict=False: the buffers are recreated, but nothing the checkpoint did not fill is overwritten."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(_config())
    state = {k: v.clone() for k, v in model.state_dict().items() if k != "model.norm.weight"}
    state.pop("lm_head.weight")
    save_file(state, tmp_path / "model.safetensors")
    target = _meta_materialized()
    with torch.no_grad():
        target.model.norm.weight.fill_(7.0)
    report = hp_fastload.load(target, tmp_path, strict=False)
    assert report.missing_keys == ("model.norm.weight",)
    assert torch.equal(target.model.norm.weight, torch.full((16,), 7.0))
    assert not hasattr(target.model.norm.weight, "_is_hf_initialized")  # the temporary mark is removed
    assert torch.equal(target.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq)


class _Rotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)
        self.register_buffer("scale", torch.ones(4))


def test_plain_module_lists_the_buffers_nothing_recreated(tmp_path):
    source = _Rotary()
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, tmp_path / "model.safetensors")
    model = _Rotary()
    report = hp_fastload.load(model, tmp_path)
    assert report.missing_keys == ()
    assert report.unfilled_buffers == ("inv_freq",)
    assert "1 non-persistent buffers not re-created (inv_freq)" in report.summary()
