"""A training script's prologue on 2 gloo ranks (issue 15): tiny fp32 Llama (tied) and Qwen3-MoE.

Three ways to get a parallelized, loaded model, each checked against transformers' single-process
``from_pretrained`` of the same checkpoint: non-persistent buffers bit-equal, ties kept, and the loss of one
forward/backward/SGD step, and the loss after it, equal to the single-process ones (up to the reduction order
of the sharded matmuls and gradient reductions):

- (a) the user builds on meta, parallelizes (FSDP2 per layer and root), ``to_empty``, ``hp_fastload.load``;
- (b) ``hp_fastload.from_pretrained(path, parallelize=fsdp)``: the same layout in one call;
- (c) ``hp_fastload.from_pretrained(path, distributed_config=DistributedConfig(...))``: transformers' own plans
  (tensor parallel and FSDP for Llama, FSDP + expert parallel for Qwen3-MoE).

One spawn runs every check; the parent writes the checkpoints with ``save_pretrained`` and computes the
single-process reference.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers.dist import run_distributed, run_subchecks, subcheck_values
from tests.helpers.tiny_models import TINY_DECODER, config_of, randomized, sgd_step_losses

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

ROOT_ENV = "HPF_PROLOGUE_ROOT"
_SIZES: dict[str, Any] = TINY_DECODER
CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(_SIZES, tie_word_embeddings=True),
    "qwen3_moe": dict(_SIZES, tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8),
}
TIED = {"llama": ("lm_head.weight", "model.embed_tokens.weight")}


def _config(family: str) -> Any:
    return config_of(family, **CONFIGS[family])


def _path(family: str) -> Path:
    return Path(os.environ[ROOT_ENV]) / family


def _batch() -> torch.Tensor:
    generator = torch.Generator().manual_seed(3)
    return torch.randint(0, _SIZES["vocab_size"], (4, 11), generator=generator)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _observe(model: nn.Module, family: str) -> dict[str, Any]:
    """Buffers, ties, and the losses of one SGD step: what every way of building the model must agree on."""
    from hp_fastload.model.finalize import non_persistent_buffers

    buffers = {name: b.detach().clone() for name, b in non_persistent_buffers(model)}
    ties = {}
    if family in TIED:
        a, b = TIED[family]
        ties[a] = model.get_parameter(a) is model.get_parameter(b)
    loss, after = sgd_step_losses(model, _batch(), lr=0.5)
    if family in TIED:
        a, b = TIED[family]
        ties[a + " after the step"] = model.get_parameter(a) is model.get_parameter(b)
    return {"buffers": buffers, "ties": ties, "loss": _full(loss).item(), "loss_after_step": _full(after).item()}


def meta_model(family: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(_config(family), dtype=torch.float32)


def fsdp(model: nn.Module) -> None:
    """The user's parallelization: FSDP2 on every decoder layer, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _user_parallelized(family: str) -> dict[str, Any]:
    import hp_fastload

    model = meta_model(family)
    fsdp(model)
    model.to_empty(device="cpu")
    report = hp_fastload.load(model, _path(family))
    assert not report.missing_keys and not report.unfilled_buffers, report.summary()
    return _observe(model, family)


def check_user_parallelized_llama(rank: int, world: int) -> dict[str, Any]:
    return _user_parallelized("llama")


def check_user_parallelized_qwen3_moe(rank: int, world: int) -> dict[str, Any]:
    return _user_parallelized("qwen3_moe")


def _one_call(family: str, **kwargs: Any) -> dict[str, Any]:
    import hp_fastload

    model, report = hp_fastload.from_pretrained(
        _path(family), dtype=torch.float32, device="cpu", output_loading_info=True, **kwargs
    )
    assert not report.missing_keys and not report.unfilled_buffers, report.summary()
    assert report.share == kwargs.get("share", "none"), report.summary()
    assert not model.training  # eval mode, as transformers' from_pretrained leaves it
    from torch.distributed.tensor import DTensor

    assert any(isinstance(p, DTensor) for p in model.parameters())  # really parallelized
    return _observe(model, family)


def check_from_pretrained_llama(rank: int, world: int) -> dict[str, Any]:
    return _one_call("llama", parallelize=fsdp)


def check_from_pretrained_qwen3_moe(rank: int, world: int) -> dict[str, Any]:
    return _one_call("qwen3_moe", parallelize=fsdp)


def check_from_pretrained_job_llama(rank: int, world: int) -> dict[str, Any]:
    """The job-wide read through from_pretrained: each rank a node of its own, every byte read once."""
    return _one_call("llama", parallelize=fsdp, share="job", ranks_per_node=1)


def check_from_pretrained_job_qwen3_moe(rank: int, world: int) -> dict[str, Any]:
    return _one_call("qwen3_moe", parallelize=fsdp, share="job", ranks_per_node=1)


#: transformers' own layouts: tensor parallel for the dense model, FSDP + expert parallel for the MoE
DISTRIBUTED = {"llama": dict(tp_size=2), "qwen3_moe": dict(fsdp_size=2, ep_size=2)}


def _with_distributed_config(family: str, rank: int, world: int) -> dict[str, Any]:
    from transformers.distributed import DistributedConfig

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    return _one_call(family, distributed_config=DistributedConfig(**DISTRIBUTED[family]))


def check_distributed_config_llama(rank: int, world: int) -> dict[str, Any]:
    return _with_distributed_config("llama", rank, world)


def check_distributed_config_qwen3_moe(rank: int, world: int) -> dict[str, Any]:
    return _with_distributed_config("qwen3_moe", rank, world)


def check_distributed_config_fsdp_llama(rank: int, world: int) -> str:
    """transformers' FSDP plan wraps the tied embedding alone (and unties it): refused, with what to do."""
    from transformers.distributed import DistributedConfig

    import hp_fastload

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    try:
        _one_call("llama", distributed_config=DistributedConfig(fsdp_size=2))
    except hp_fastload.TargetError as exc:
        return str(exc)
    return "loaded"


def check_untied_under_fsdp_is_refused(rank: int, world: int) -> str:
    """A tie fully_shard has split into two parameters cannot be made again: a TargetError says what to do."""
    from transformers import AutoModelForCausalLM, initialization

    import hp_fastload

    with torch.device("meta"), initialization.no_tie_weights():
        model = AutoModelForCausalLM.from_config(_config("llama"), dtype=torch.float32)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    fsdp(model)
    model.to_empty(device="cpu")
    try:
        hp_fastload.load(model, _path("llama"))
    except hp_fastload.TargetError as exc:
        return str(exc)
    return "loaded"


CHECKS = [
    check_untied_under_fsdp_is_refused,
    check_user_parallelized_llama,
    check_user_parallelized_qwen3_moe,
    check_from_pretrained_llama,
    check_from_pretrained_qwen3_moe,
    check_from_pretrained_job_llama,
    check_from_pretrained_job_qwen3_moe,
    check_distributed_config_llama,
    check_distributed_config_qwen3_moe,
    check_distributed_config_fsdp_llama,
]


@pytest.fixture(scope="module")
def prologue(tmp_path_factory) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("prologue")
    references = {}
    for family in CONFIGS:
        torch.manual_seed(0)
        model = randomized(AutoModelForCausalLM.from_config(_config(family)), 0.5)
        model.save_pretrained(root / family)
        reference = AutoModelForCausalLM.from_pretrained(root / family, dtype=torch.float32)
        os.environ[ROOT_ENV] = str(root)
        references[family] = _observe(reference, family)
    try:
        per_rank = run_distributed(run_subchecks, 2, checks=CHECKS, timeout=500)
    finally:
        os.environ.pop(ROOT_ENV, None)
    return references, per_rank


def _agrees(observed: dict[str, Any], expected: dict[str, Any]) -> None:
    assert sorted(observed["buffers"]) == sorted(expected["buffers"])
    for name, value in expected["buffers"].items():
        assert torch.equal(observed["buffers"][name], value), f"non-persistent buffer {name} differs"
    assert observed["ties"] == expected["ties"]
    assert all(observed["ties"].values()), observed["ties"]
    assert observed["loss"] == pytest.approx(expected["loss"], rel=1e-6, abs=1e-6)
    assert observed["loss_after_step"] == pytest.approx(expected["loss_after_step"], rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("way", ["user_parallelized", "from_pretrained", "from_pretrained_job", "distributed_config"])
def test_prologue_matches_single_process_from_pretrained(prologue, way, family):
    references, per_rank = prologue
    for observed in subcheck_values(per_rank, f"check_{way}_{family}"):
        _agrees(observed, references[family])


def test_distributed_config_fsdp_of_a_tied_model_is_refused_with_the_fix(prologue):
    for message in subcheck_values(prologue[1], "check_distributed_config_fsdp_llama"):
        assert message.startswith("lm_head.weight: tied to model.embed_tokens.weight"), message
        assert "pass from_pretrained(parallelize=...)" in message


def test_a_tie_split_by_fully_shard_is_refused_with_the_fix(prologue):
    for message in subcheck_values(prologue[1], "check_untied_under_fsdp_is_refused"):
        assert message.startswith("lm_head.weight: tied to model.embed_tokens.weight"), message
        assert "tie them before fully_shard" in message
