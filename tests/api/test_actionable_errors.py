"""Errors a user can act on (issue 15, item 3): strict failures, mistyped paths, Hub cache misses, a rank that
does not call ``load``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hp_fastload
from hp_fastload.errors import HpFastloadError, MissingKeysError
from tests.helpers.dist import run_distributed

SIZES: dict[str, Any] = dict(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=24,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=4,
    max_position_embeddings=64,
)


def _model(model_type: str, layers: int) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, num_hidden_layers=layers, **SIZES)
    return AutoModelForCausalLM.from_config(config)


@pytest.fixture(scope="module")
def llama2(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama2")
    _model("llama", 2).save_pretrained(path)
    return path


def test_strict_failure_is_a_missing_keys_error_and_a_runtime_error(llama2):
    model = _model("llama", 3)
    with pytest.raises(MissingKeysError) as info:
        hp_fastload.load(model, llama2)
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, HpFastloadError)
    assert info.value.missing_keys[0] == "model.layers.2.input_layernorm.weight"
    assert len(info.value.missing_keys) == 9  # the third layer's 9 tensors
    assert "num_hidden_layers 2 in the checkpoint, 3 in the model" in str(info.value)


def test_another_model_type_counts_the_unexpected_keys(llama2):
    model = _model("qwen3", 2)  # q_norm / k_norm the llama checkpoint lacks, no unexpected keys
    with pytest.raises(MissingKeysError, match="model_type 'llama' in the checkpoint, 'qwen3' in the model"):
        hp_fastload.load(model, llama2)
    from safetensors import safe_open

    with safe_open(llama2 / "model.safetensors", "pt") as f:
        stored = sorted(f.keys())
    model = _model("gpt_neox", 2)  # another architecture: only lm_head.weight is a name both share
    with pytest.raises(MissingKeysError) as info:
        hp_fastload.load(model, llama2)
    assert sorted(info.value.unexpected_keys) == [k for k in stored if k != "lm_head.weight"]
    assert f"The checkpoint also holds {len(stored) - 1} tensors this model does not own" in str(info.value)
    assert "model_type 'llama' in the checkpoint, 'gpt_neox' in the model" in str(info.value)


@pytest.mark.parametrize("path", ["checkpoints/lama", "./lama", "../lama", "~/no-such-hp-fastload-dir", "/no/such"])
def test_a_local_looking_path_that_does_not_exist_is_file_not_found(tmp_path, monkeypatch, path):
    import huggingface_hub

    def no_hub(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a local-looking path must not be looked up on the Hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_hub)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    if path == "checkpoints/lama":
        monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as info:
        hp_fastload.load(torch.nn.Linear(2, 2), path)
    assert info.value.filename == path
    assert "is not a file or a directory" in str(info.value) and "Hub" not in str(info.value)


def test_an_uncached_hub_id_offline_says_so(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match=r"'hp-fastload-tests/absent' is not a local path.*not in the Hugging"):
        hp_fastload.load(torch.nn.Linear(2, 2), "hp-fastload-tests/absent")


def _rank_skips_load(rank: int, world: int, path: str) -> str:
    if rank == 1:
        return "rank 1 went on without calling load"
    try:
        hp_fastload.load(torch.nn.Linear(2, 2), path)
    except RuntimeError as exc:
        return str(exc)
    return "load returned"


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_rank_that_does_not_call_load_is_named_in_the_waiting_ranks_error(tmp_path):
    from safetensors.torch import save_file

    save_file({"weight": torch.ones(2, 2), "bias": torch.ones(2)}, tmp_path / "model.safetensors")
    results = run_distributed(_rank_skips_load, 2, str(tmp_path), timeout=60)
    assert results[1] == "rank 1 went on without calling load"
    assert "rank 0 of 2 waited for the other ranks" in results[0], results[0]
    assert "Every rank of the default process group must call hp_fastload.load" in results[0]


def test_from_pretrained_refuses_two_layouts_and_a_checkpoint_without_config(llama2, tmp_path):
    from safetensors.torch import save_file

    with pytest.raises(ValueError, match="either parallelize or distributed_config"):
        hp_fastload.from_pretrained(llama2, parallelize=lambda m: None, distributed_config=object())
    save_file({"w": torch.ones(2)}, tmp_path / "model.safetensors")
    with pytest.raises(
        FileNotFoundError, match=r"config\.json does not exist: the model is built from the checkpoint's config\.json"
    ):
        hp_fastload.from_pretrained(tmp_path)


def test_from_pretrained_single_process_equals_transformers(llama2):
    from transformers import AutoModelForCausalLM

    model, report = hp_fastload.from_pretrained(llama2, dtype="float32", output_loading_info=True)
    reference = AutoModelForCausalLM.from_pretrained(llama2, dtype=torch.float32)
    assert not report.missing_keys and type(model) is type(reference)
    ids = torch.arange(12).reshape(2, 6)
    assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)
    assert (
        hp_fastload.from_pretrained(
            llama2, dtype=torch.float32, num_hidden_layers=1, strict=False
        ).config.num_hidden_layers
        == 1
    )
