"""accelerate and the transformers Trainer on 2 gloo ranks, through accelerate's real FSDP2 code (issue 28).

FSDP for real on CPU: accelerate picks ``DistributedType.MULTI_CPU`` (DDP) on CPU whatever its FSDP plugin says,
so every rank creates one ``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, ...))`` and
sets its shared state to ``DistributedType.FSDP`` with that plugin (:func:`_accelerator`); ``accelerator.is_fsdp2``
is then true, ``prepare`` runs ``fsdp2_prepare_model`` (``fully_shard`` per decoder layer, the tail and the root),
and each check asserts that the prepared model's parameters are FSDP2 DTensors sharded on the 2 ranks. The
Trainer's own ``Accelerator`` shares that state, so the Trainer prepares with FSDP2 too.

Each route is compared bit-exactly with accelerate's own path (transformers' ``from_pretrained`` +
``accelerator.prepare(model, AdamW)``): every local shard after the load, the loss, and every local shard after
one AdamW step (the Trainer: one ``train()`` step each). The routes run are the guide's snippets themselves
(docs/guides/accelerate.md), read from the page. The last check: a ``parallelize`` that fails on
rank 0 inside accelerate's ``prepare`` while rank 1 waits in accelerate's own broadcast (the
``cpu_ram_efficient_loading`` hang of the issue, with the up-front refusal switched off) raises on every rank
within seconds, naming rank 0 and its error.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers.accelerate_fsdp2 import fsdp2_accelerator
from tests.helpers.dist import run_distributed, run_subchecks, subcheck_values
from tests.helpers.docs import snippets
from tests.helpers.tiny_models import TINY_DECODER, config_of, randomized

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

ROOT_ENV = "HPF_ACCELERATE_ROOT"
GUIDE = "docs/guides/accelerate.md"
CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(TINY_DECODER, tie_word_embeddings=True),
    "qwen3_moe": dict(
        TINY_DECODER, tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8
    ),
}
LR = 1e-5  # the guide snippet's


def readme_snippets() -> dict[str, str]:
    """The guide's Python snippets by name (``accelerate``, ``Trainer``, ``distributed_config``)."""
    return {name: s.code for name, s in snippets(GUIDE).items()}


def _path(family: str) -> str:
    return str(Path(os.environ[ROOT_ENV]) / family)


def _batch(family: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7 + torch.distributed.get_rank())
    return torch.randint(0, CONFIGS[family]["vocab_size"], (2, 9), generator=generator)


def _local_shards(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    shards = {}
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), f"{name} is not an FSDP2 DTensor: accelerate did not shard the model"
        assert p.device_mesh.size() == 2
        shards[name] = p.to_local().detach().clone()
    return shards


def _one_adamw_step(model: nn.Module, optimizer: Any, accelerator: Any, family: str) -> dict[str, Any]:
    """Local shards after the load, the loss, the local shards after one step, and the optimizer's size."""
    loaded = _local_shards(model)
    model.train()
    ids = _batch(family)
    loss = model(input_ids=ids, labels=ids).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    stepped = _local_shards(model)
    entries = [p for group in optimizer.param_groups for p in group["params"]]
    return {
        "loaded": loaded,
        "loss": loss.detach().item(),
        "stepped": stepped,
        "optimizer_entries": len(entries),
        "distinct_optimizer_entries": len({id(p) for p in entries}),
    }


def _accelerate_own(family: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    accelerator = fsdp2_accelerator()
    model = AutoModelForCausalLM.from_pretrained(_path(family), dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)
    return _one_adamw_step(model, optimizer, accelerator, family)


def _readme_accelerate(family: str) -> dict[str, Any]:
    import hp_fastload

    accelerator = fsdp2_accelerator()
    scope: dict[str, Any] = {"hp_fastload": hp_fastload, "torch": torch, "accelerator": accelerator}
    scope["path"] = _path(family)
    exec(readme_snippets()["accelerate"], scope)
    return _one_adamw_step(scope["model"], scope["optimizer"], accelerator, family)


def check_accelerate_own_llama(rank: int, world: int) -> dict[str, Any]:
    return _accelerate_own("llama")


def check_accelerate_own_qwen3_moe(rank: int, world: int) -> dict[str, Any]:
    return _accelerate_own("qwen3_moe")


def check_helper_llama(rank: int, world: int) -> dict[str, Any]:
    return _readme_accelerate("llama")


def check_helper_qwen3_moe(rank: int, world: int) -> dict[str, Any]:
    return _readme_accelerate("qwen3_moe")


def check_meta_prepare_binds_one_parameter(rank: int, world: int) -> tuple[int, int]:
    """Why the helper rebinds the optimizer: accelerate's FSDP2 prepare of a meta model, left alone."""
    from transformers import AutoModelForCausalLM

    accelerator = fsdp2_accelerator()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config_of("llama", **CONFIGS["llama"]))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
    entries = [p for group in optimizer.param_groups for p in group["params"]]
    return len(entries), len({id(p) for p in entries})


def _trainer_run(family: str, with_callback: bool) -> dict[str, Any]:
    """One Trainer step on the same data: accelerate's own model, or the guide's callback route."""
    import tempfile

    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    import hp_fastload

    fsdp2_accelerator()
    path = _path(family)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (4, 9), generator=_seeded(5))]
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            max_steps=1,
            per_device_train_batch_size=2,
            learning_rate=LR,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            seed=0,
            data_seed=0,
            fsdp=True,
            fsdp_config={"version": 2},
        )
        scope: dict[str, Any] = {"hp_fastload": hp_fastload, "torch": torch, "Trainer": Trainer}
        scope.update(path=path, args=args, dataset=rows)
        if with_callback:
            exec(readme_snippets()["Trainer"], scope)
            trainer = scope["trainer"]
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            trainer = Trainer(model=model, args=args, train_dataset=rows)
        _trainer_to_fsdp2(trainer)
        result = trainer.train()
        callback = next((c for c in trainer.callback_handler.callbacks if hasattr(c, "report")), None)
        return {
            "stepped": _local_shards(trainer.model),
            "loss": result.training_loss,
            "report": None if callback is None else callback.report.summary(),
        }


def _trainer_to_fsdp2(trainer: Any) -> None:
    """The Trainer's Accelerator falls back to DDP on CPU: set its shared state to the FSDP2 plugin the
    TrainingArguments asked for, as the Accelerator does on GPUs."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
    trainer.is_fsdp_enabled = True
    assert trainer.accelerator.is_fsdp2


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def check_trainer_own_llama(rank: int, world: int) -> dict[str, Any]:
    return _trainer_run("llama", with_callback=False)


def check_trainer_callback_llama(rank: int, world: int) -> dict[str, Any]:
    return _trainer_run("llama", with_callback=True)


def check_distributed_config_qwen3_moe(rank: int, world: int) -> list[str]:
    """The guide's third route, against transformers' own single-process from_pretrained: names that differ."""
    import transformers
    from transformers import AutoModelForCausalLM

    import hp_fastload

    fsdp2_accelerator()  # the ranks' environment, as a launcher sets it
    scope: dict[str, Any] = {"hp_fastload": hp_fastload, "transformers": transformers, "path": _path("qwen3_moe")}
    exec(readme_snippets()["distributed_config"], scope)
    reference = AutoModelForCausalLM.from_pretrained(_path("qwen3_moe"), dtype=torch.float32).state_dict()
    differing = []
    for name, p in scope["model"].state_dict().items():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        if not (full.dtype == reference[name].dtype and torch.equal(full, reference[name])):
            differing.append(name)
    assert len(reference) > 10
    return differing


def check_cpu_ram_efficient_loading_is_refused(rank: int, world: int) -> list[str]:
    import hp_fastload
    from hp_fastload.integrations import prepare_pretrained

    accelerator = fsdp2_accelerator()
    plugin = accelerator.state.fsdp_plugin
    plugin.cpu_ram_efficient_loading = True
    messages = []
    try:
        for call in (
            lambda: hp_fastload.from_pretrained(_path("llama"), parallelize=lambda m: m, device="cpu"),
            lambda: prepare_pretrained(accelerator, _path("llama"), optimizer=lambda p: torch.optim.AdamW(p)),
        ):
            try:
                call()
                messages.append("loaded")
            except ValueError as exc:
                messages.append(str(exc))
    finally:
        plugin.cpu_ram_efficient_loading = False
    return messages


def check_failure_inside_prepare_raises_everywhere(rank: int, world: int) -> tuple[float, str]:
    """The issue's hang, with the up-front refusal switched off: rank 0 fails inside accelerate's
    ``fsdp2_load_full_state_dict`` (it cannot copy a meta tensor) while rank 1 waits in its broadcast.
    Must run last: rank 1 is released when rank 0's process exits."""
    import hp_fastload
    from hp_fastload.api import pretrained
    from hp_fastload.dist.bounded import PEER_WAIT_ENV

    accelerator = fsdp2_accelerator()
    plugin = accelerator.state.fsdp_plugin
    plugin.cpu_ram_efficient_loading = True
    os.environ[PEER_WAIT_ENV] = "2"
    pretrained.refuse_rank0_broadcast = lambda: None  # type: ignore[assignment]

    def parallelize(model: nn.Module) -> nn.Module:
        prepared, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
        return prepared

    start = time.monotonic()
    try:
        hp_fastload.from_pretrained(_path("llama"), parallelize=parallelize, device="cpu", dtype=torch.float32)
    except Exception as exc:
        return time.monotonic() - start, f"{type(exc).__name__}: {exc}"
    return time.monotonic() - start, "loaded"


CHECKS = [
    check_accelerate_own_llama,
    check_helper_llama,
    check_accelerate_own_qwen3_moe,
    check_helper_qwen3_moe,
    check_meta_prepare_binds_one_parameter,
    check_trainer_own_llama,
    check_trainer_callback_llama,
    check_distributed_config_qwen3_moe,
    check_cpu_ram_efficient_loading_is_refused,
    check_failure_inside_prepare_raises_everywhere,
]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("accelerate")
    for family in CONFIGS:
        torch.manual_seed(0)
        randomized(AutoModelForCausalLM.from_config(config_of(family, **CONFIGS[family])), 0.5).save_pretrained(
            root / family
        )
    os.environ[ROOT_ENV] = str(root)
    try:
        return run_distributed(run_subchecks, 2, checks=CHECKS, timeout=500)
    finally:
        os.environ.pop(ROOT_ENV, None)


def _bit_equal(observed: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(observed) == sorted(expected), what
    for name, value in expected.items():
        assert observed[name].dtype == value.dtype and torch.equal(observed[name], value), f"{what}: {name} differs"


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_helper_is_bit_equal_to_accelerates_own_path_after_one_adamw_step(ranks, family):
    own = subcheck_values(ranks, f"check_accelerate_own_{family}")
    helper = subcheck_values(ranks, f"check_helper_{family}")
    for rank, (ours, theirs) in enumerate(zip(helper, own, strict=True)):
        _bit_equal(ours["loaded"], theirs["loaded"], f"rank {rank} after the load")
        assert ours["loss"] == theirs["loss"]
        _bit_equal(ours["stepped"], theirs["stepped"], f"rank {rank} after one AdamW step")
        assert ours["distinct_optimizer_entries"] == ours["optimizer_entries"] == theirs["optimizer_entries"]


def test_accelerates_fsdp2_prepare_of_a_meta_model_binds_one_parameter(ranks):
    """Up to accelerate 1.15, FSDP2's prepare of a meta model left every optimizer entry bound to one parameter
    (what prepare_pretrained's rebinding by name repairs); accelerate 1.16 binds each entry to its own. The
    helper's route is checked against accelerate's on both (the parity test above)."""
    from importlib.metadata import version

    fixed = tuple(int(p) for p in version("accelerate").split(".")[:2]) >= (1, 16)
    for entries, distinct in subcheck_values(ranks, "check_meta_prepare_binds_one_parameter"):
        assert entries > 1 and distinct == (entries if fixed else 1), (version("accelerate"), entries, distinct)


def test_trainer_callback_is_bit_equal_to_the_trainers_own_load(ranks):
    own = subcheck_values(ranks, "check_trainer_own_llama")
    callback = subcheck_values(ranks, "check_trainer_callback_llama")
    for rank, (ours, theirs) in enumerate(zip(callback, own, strict=True)):
        assert ours["loss"] == theirs["loss"]
        _bit_equal(ours["stepped"], theirs["stepped"], f"rank {rank} after one Trainer step")
        assert ours["report"] is not None and "missing 0" in ours["report"], ours["report"]


def test_readme_distributed_config_route_matches_transformers(ranks):
    for differing in subcheck_values(ranks, "check_distributed_config_qwen3_moe"):
        assert differing == []


def test_readme_section_has_the_three_routes():
    assert sorted(readme_snippets()) == ["Trainer", "accelerate", "distributed_config"]


def test_cpu_ram_efficient_loading_is_refused_on_every_rank(ranks):
    for messages in subcheck_values(ranks, "check_cpu_ram_efficient_loading_is_refused"):
        assert len(messages) == 2
        for message in messages:
            assert "cpu_ram_efficient_loading=True" in message and "broadcasting rank 0" in message, message


def test_failure_inside_prepare_on_one_rank_raises_on_every_rank_within_seconds(ranks):
    outcomes = subcheck_values(ranks, "check_failure_inside_prepare_raises_everywhere")
    for rank, (seconds, message) in enumerate(outcomes):
        assert "Building and parallelizing the model failed on rank 0" in message, (rank, message)
        assert "Cannot copy out of meta tensor" in message, (rank, message)
        assert seconds < 30, f"rank {rank} raised after {seconds:.1f} s (the process group's timeout is 500 s)"
    assert "ranks [1] had not finished" in outcomes[0][1]
