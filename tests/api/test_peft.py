"""PEFT (LoRA) models on 2 gloo ranks, FSDP2 with the root wrapped and TP: the base checkpoint through ``load``,
peft's adapter format through ``load_adapter`` and ``save(adapter_only=True)``, against peft's own single-process
route (``get_peft_model`` / ``PeftModel.from_pretrained`` on transformers' ``from_pretrained``, then torch's
``distribute_tensor`` of every reference tensor) and peft's own ``save_pretrained`` of the gathered model.

The checkpoints are made by transformers' ``save_pretrained`` (base) and peft's ``save_pretrained`` (adapter, its
LoRA tensors drawn at random so that no value sits at its init). One spawn of 2 ranks runs every check."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers.accelerate_fsdp2 import fsdp2_accelerator
from tests.helpers.dist import run_distributed, run_subchecks, subcheck_values
from tests.helpers.tiny_models import randomized, tiny_config

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(400)]

ROOT_ENV = "HPF_PEFT_ROOT"
LORA: dict[str, Any] = dict(
    r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"], modules_to_save=["lm_head"]
)
#: LoRA on a MoE: attention modules and the stacked experts' parameters (peft's ``target_parameters``)
MOE_LORA: dict[str, Any] = dict(
    r=4,
    lora_alpha=8,
    lora_dropout=0.0,
    target_modules=["q_proj", "v_proj"],
    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
)
#: checkpoint directory -> (family, LoRA config)
BASES = {"base": ("llama", LORA), "moe": ("qwen3_moe", MOE_LORA)}
SENTINEL = 7.0
#: TP plans of the inner model: the tuner layer's base_layer and the LoRA factor on the sharded side.
COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROWWISE = ("o_proj", "down_proj")


def _root() -> Path:
    return Path(os.environ[ROOT_ENV])


def _batch() -> torch.Tensor:
    return torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(5))


def _lora(base: str = "base", **overrides: Any) -> Any:
    from peft import LoraConfig

    return LoraConfig(**{**BASES[base][1], **overrides})


def _meta_peft(base: str = "base", **overrides: Any) -> nn.Module:
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(_root() / base)  # the user's prologue: the base's own config.json
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return get_peft_model(model, _lora(base, **overrides))


def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (torch.distributed.get_world_size(),))


def _fsdp(peft_model: nn.Module) -> None:
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh()
    for layer in peft_model.get_base_model().model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(peft_model, mesh=mesh)


def _tp(peft_model: nn.Module) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    inner = peft_model.get_base_model()
    plan: dict[str, Any] = {}
    for name, module in inner.named_modules():
        leaf = name.rpartition(".")[2]
        wrapped = hasattr(module, "base_layer")
        if leaf in COLWISE:
            plan[f"{name}.base_layer" if wrapped else name] = ColwiseParallel()
            if wrapped:
                plan[f"{name}.lora_B.default"] = ColwiseParallel()
        elif leaf in ROWWISE:
            plan[f"{name}.base_layer" if wrapped else name] = RowwiseParallel()
            if wrapped:
                plan[f"{name}.lora_A.default"] = RowwiseParallel()
    parallelize_module(inner, _mesh(), plan)


def _ep(peft_model: nn.Module) -> None:
    """Expert parallel: the stacked experts split by expert (dim 0), their LoRA factors by the experts' blocks of
    rank rows (A: dim 0, B: dim 1); the rest replicated."""
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _mesh()
    for name, module in peft_model.get_base_model().named_modules():
        if "experts" not in name:
            continue
        for pname, param in list(module._parameters.items()):
            if param is None:
                continue
            dim = 0 if param.ndim == 3 or ".lora_A." in f"{name}." else 1
            dt = distribute_tensor(param.data, mesh, [Shard(dim)], src_data_rank=None)
            module.register_parameter(pname, nn.Parameter(dt, requires_grad=param.requires_grad))


LAYOUTS = {"fsdp": _fsdp, "tp": _tp, "ep": _ep}


def _sharded(layout: str, base: str = "base", **overrides: Any) -> nn.Module:
    model = _meta_peft(base, **overrides)
    LAYOUTS[layout](model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                getattr(param, "_local_tensor", param).fill_(SENTINEL)
    return model


def _reference(adapter: bool, base: str = "base") -> nn.Module:
    """peft's own single-process route: transformers' from_pretrained, then get_peft_model or
    PeftModel.from_pretrained."""
    from peft import PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(_root() / base, dtype=torch.float32)
    if adapter:
        return PeftModel.from_pretrained(model, _root() / f"{base}_adapter", is_trainable=True)
    return get_peft_model(model, _lora(base))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _expected_local(ours: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(ours, DTensor):
        return distribute_tensor(theirs.detach(), ours.device_mesh, ours.placements, src_data_rank=None).to_local()
    return theirs.detach()


def _differences(model: nn.Module, reference: nn.Module, skip_lora: bool) -> list[str]:
    """Names whose local shard is not bit-equal to ``distribute_tensor`` of the reference's tensor."""
    theirs = dict(reference.named_parameters())
    theirs.update(reference.named_buffers())
    ours = dict(model.named_parameters())
    ours.update(model.named_buffers())
    assert sorted(ours) == sorted(theirs)
    bad = []
    for name, tensor in ours.items():
        if skip_lora and "lora_" in name:
            continue
        expected = _expected_local(tensor, theirs[name])
        local = _local(tensor.detach())
        if local.shape != expected.shape or not torch.equal(local.view(torch.uint8), expected.view(torch.uint8)):
            bad.append(name)
    return bad


def _loss_and_step(model: nn.Module) -> tuple[float, float]:
    ids = _batch()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        after = model(input_ids=ids, labels=ids).loss
    return float(_local(loss.detach())), float(_local(after.detach()))


def _base(layout: str) -> dict[str, Any]:
    import hp_fastload as hf

    model = _sharded(layout)
    planned = hf.plan(model, _root() / "base")  # the dry run plans what the load reads
    report = hf.load(model, _root() / "base")
    untouched = all(
        bool((_local(p.detach()) == SENTINEL).all()) for name, p in model.named_parameters() if "lora_" in name
    )
    return {
        "differences": _differences(model, _reference(adapter=False), skip_lora=True),
        "adapters_untouched": untouched,
        "adapter_keys": sorted(report.adapter_keys),
        "lora_names": sorted(n for n, _ in model.named_parameters() if "lora_" in n or "modules_to_save" in n),
        "planned_as_loaded": planned.report.loaded_keys == report.loaded_keys
        and planned.bytes_needed == report.bytes_needed,
        "missing": list(report.missing_keys),
        "unexpected": list(report.unexpected_keys),
        "summary": report.summary(),
    }


def check_base_fsdp(rank: int, world: int) -> dict[str, Any]:
    return _base("fsdp")


def check_base_tp(rank: int, world: int) -> dict[str, Any]:
    return _base("tp")


def check_base_job_share_tp(rank: int, world: int) -> dict[str, Any]:
    """``share="job"`` (each checkpoint byte read once per job): the same shards as every rank reading its own."""
    import hp_fastload as hf

    alone, shared = _sharded("tp"), _sharded("tp")
    hf.load(alone, _root() / "base")
    report = hf.load(shared, _root() / "base", share="job")
    differing = [
        name
        for (name, a), (_, b) in zip(alone.named_parameters(), shared.named_parameters(), strict=True)
        if not torch.equal(_local(a.detach()), _local(b.detach()))
    ]
    return {"differing": differing, "share": report.share, "adapter_keys": len(report.adapter_keys)}


def _adapter(layout: str) -> dict[str, Any]:
    import hp_fastload as hf

    model = _sharded(layout)
    hf.load(model, _root() / "base")
    report = hf.load_adapter(model, _root() / "base_adapter")
    for param in model.parameters():  # PeftModel.from_pretrained(is_trainable=True) leaves the base frozen
        param.requires_grad_(False)
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name or "modules_to_save" in name)
    reference = _reference(adapter=True)
    differences = _differences(model, reference, skip_lora=False)
    from safetensors.torch import load_file

    file_tensors = load_file(str(_root() / "base_adapter" / "adapter_model.safetensors"))
    return {
        "differences": differences,
        "file_bytes": sum(t.numel() * t.element_size() for t in file_tensors.values()),
        "loaded": len(report.loaded_keys),
        "bytes_read": report.bytes_read,
        "bytes_needed": report.bytes_needed,
        "losses": _loss_and_step(model),
        "reference_losses": _loss_and_step(reference),
    }


def check_adapter_fsdp(rank: int, world: int) -> dict[str, Any]:
    return _adapter("fsdp")


def check_adapter_tp(rank: int, world: int) -> dict[str, Any]:
    return _adapter("tp")


def check_adapter_mismatch(rank: int, world: int) -> dict[str, str]:
    import hp_fastload as hf

    out = {}
    for what, overrides in {"rank": dict(r=8), "targets": dict(target_modules=["q_proj", "v_proj"])}.items():
        model = _sharded("fsdp", **overrides)
        try:
            hf.load_adapter(model, _root() / "base_adapter")
            out[what] = "loaded"
        except hf.AdapterMismatchError as exc:
            untouched = all(
                bool((_local(p.detach()) == SENTINEL).all()) for n, p in model.named_parameters() if "lora_" in n
            )
            out[what] = f"{type(exc).__name__} untouched={untouched}: {exc}"
    return out


def check_save_adapter_fsdp(rank: int, world: int) -> dict[str, Any]:
    """Train one step, save the adapter from the shards, and compare with peft's save_pretrained of the
    gathered model (rank 0); then load the saved adapter into a fresh sharded model (round trip)."""
    import hp_fastload as hf

    out_dir = _root() / "saved"
    model = _sharded("fsdp")
    hf.load(model, _root() / "base")
    hf.load_adapter(model, _root() / "base_adapter")
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name or "modules_to_save" in name)
    _loss_and_step(model)
    report = hf.save(model, out_dir, adapter_only=True)
    gathered = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in model.named_parameters()}
    same: dict[str, bool] = {}
    if rank == 0:
        reference = _reference(adapter=False)
        with torch.no_grad():
            for name, param in reference.named_parameters():
                param.copy_(gathered[name])
        reference.save_pretrained(_root() / "peft_saved")
        for file in ("adapter_model.safetensors", "adapter_config.json", "README.md"):
            same[file] = (out_dir / file).read_bytes() == (_root() / "peft_saved" / file).read_bytes()
        same["files"] = sorted(p.name for p in out_dir.iterdir()) == sorted(
            p.name for p in (_root() / "peft_saved").iterdir()
        )
    torch.distributed.barrier()
    fresh = _sharded("fsdp")
    hf.load(fresh, _root() / "base")
    hf.load_adapter(fresh, out_dir)
    round_trip = [
        name
        for (name, a), (_, b) in zip(fresh.named_parameters(), model.named_parameters(), strict=True)
        if not torch.equal(_local(a.detach()), _local(b.detach()))
    ]
    return {"same": same, "bytes_written_by_rank": report.bytes_written_by_rank, "round_trip": round_trip}


def check_from_pretrained_peft_config_fsdp(rank: int, world: int) -> list[str]:
    """The one-call prologue with a fresh LoRA: base and adapter init equal peft's single-process
    ``get_peft_model`` after the same seed, on every local shard."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    import hp_fastload as hf

    torch.manual_seed(11)
    model = hf.from_pretrained(_root() / "base", parallelize=_fsdp, peft_config=_lora(), dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(_root() / "base", dtype=torch.float32)
    torch.manual_seed(11)
    reference = get_peft_model(base, _lora())
    return _differences(model, reference, skip_lora=False)


def check_from_pretrained_adapter_tp(rank: int, world: int) -> dict[str, Any]:
    import hp_fastload as hf

    model = hf.from_pretrained(
        _root() / "base", parallelize=_tp, adapter=_root() / "base_adapter", is_trainable=True, dtype=torch.float32
    )
    reference = _reference(adapter=True)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    expected = sorted(n for n, p in reference.named_parameters() if p.requires_grad)
    return {
        "differences": _differences(model, reference, skip_lora=False),
        "trainable": trainable == expected and len(trainable) == 13,
        "losses": _loss_and_step(model),
        "reference_losses": _loss_and_step(reference),
    }


def check_from_pretrained_adapter_repo(rank: int, world: int) -> list[str]:
    """A path holding only an adapter: its base from ``base_model_name_or_path``, then the adapter (frozen, as
    ``PeftModel.from_pretrained`` leaves it)."""
    import hp_fastload as hf

    model = hf.from_pretrained(_root() / "base_adapter", parallelize=_fsdp, dtype=torch.float32)
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)
    reference = _reference(adapter=True)
    return _differences(model, reference, skip_lora=False)


def _moe(layout: str) -> dict[str, Any]:
    import hp_fastload as hf

    model = _sharded(layout, "moe")
    base_report = hf.load(model, _root() / "moe")
    hf.load_adapter(model, _root() / "moe_adapter")
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name)
    reference = _reference(adapter=True, base="moe")
    out: dict[str, Any] = {
        "differences": _differences(model, reference, skip_lora=False),
        "adapter_keys": len(base_report.adapter_keys),
    }
    if layout == "fsdp":  # transformers' MoE forward takes plain experts: FSDP2 gathers them
        out["losses"], out["reference_losses"] = _loss_and_step(model), _loss_and_step(reference)
    return out


def check_moe_fsdp(rank: int, world: int) -> dict[str, Any]:
    return _moe("fsdp")


def check_moe_ep(rank: int, world: int) -> dict[str, Any]:
    return _moe("ep")


def check_moe_from_pretrained_peft_config_ep(rank: int, world: int) -> list[str]:
    """A fresh LoRA on the experts (EP) and attention: peft's own init values after the same seed."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    import hp_fastload as hf

    torch.manual_seed(13)
    model = hf.from_pretrained(_root() / "moe", parallelize=_ep, peft_config=_lora("moe"), dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(_root() / "moe", dtype=torch.float32)
    torch.manual_seed(13)
    return _differences(model, get_peft_model(base, _lora("moe")), skip_lora=False)


def check_save_merged_fsdp(rank: int, world: int) -> dict[str, Any]:
    """``save(merge=True)`` after a training step: the files of peft's ``merge_and_unload()`` + ``save_pretrained``
    of the gathered model, and the sharded PEFT model unchanged afterwards."""
    import hp_fastload as hf

    out_dir = _root() / "merged"
    model = _sharded("fsdp")
    hf.load(model, _root() / "base")
    hf.load_adapter(model, _root() / "base_adapter")
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name or "modules_to_save" in name)
    _loss_and_step(model)
    model.reshard()  # the root keeps its parameters gathered after a forward (save reshards it)
    before = {n: _local(p.detach()).clone() for n, p in model.named_parameters()}
    hf.save(model, out_dir, merge=True)
    unchanged = all(torch.equal(_local(p.detach()), before[n]) for n, p in model.named_parameters())
    gathered = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in model.named_parameters()}
    same: dict[str, bool] = {}
    if rank == 0:
        reference = _reference(adapter=False)
        with torch.no_grad():
            for name, param in reference.named_parameters():
                param.copy_(gathered[name])
        reference.merge_and_unload().save_pretrained(_root() / "peft_merged")
        theirs = sorted(p.name for p in (_root() / "peft_merged").iterdir())
        same["files"] = sorted(p.name for p in out_dir.iterdir()) == theirs
        for file in theirs:
            same[file] = (out_dir / file).read_bytes() == (_root() / "peft_merged" / file).read_bytes()
    torch.distributed.barrier()
    return {"same": same, "unchanged": unchanged, "still_peft": type(model.base_model).__name__}


def _adamw_step(model: nn.Module, optimizer: Any, accelerator: Any) -> dict[str, Any]:
    loaded = {n: _local(p.detach()).clone() for n, p in model.named_parameters()}
    model.train()
    ids = _batch()
    loss = model(input_ids=ids, labels=ids).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    stepped = {n: _local(p.detach()).clone() for n, p in model.named_parameters()}
    return {"loaded": loaded, "loss": float(_local(loss.detach())), "stepped": stepped}


def check_accelerate_peft_config(rank: int, world: int) -> dict[str, Any]:
    """accelerate's FSDP2 with a fresh LoRA (the way TRL's SFTTrainer(peft_config=...) builds it): peft +
    accelerate's own route against ``prepare_pretrained(..., peft_config=...)``, after the same seed."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    import hp_fastload.integrations

    accelerator = fsdp2_accelerator()
    torch.manual_seed(17)
    theirs = get_peft_model(AutoModelForCausalLM.from_pretrained(_root() / "base", dtype=torch.float32), _lora())
    optimizer = torch.optim.AdamW([p for p in theirs.parameters() if p.requires_grad], lr=1e-2)
    theirs, optimizer = accelerator.prepare(theirs, optimizer)
    expected = _adamw_step(theirs, optimizer, accelerator)
    accelerator = fsdp2_accelerator()  # accelerate's FSDP2 prepare of the PEFT model left its state at MULTI_CPU
    torch.manual_seed(17)
    ours, optimizer = hp_fastload.integrations.prepare_pretrained(
        accelerator,
        _root() / "base",
        optimizer=lambda params: torch.optim.AdamW([p for p in params if p.requires_grad], lr=1e-2),
        peft_config=_lora(),
        dtype=torch.float32,
    )
    observed = _adamw_step(ours, optimizer, accelerator)
    return {
        "loaded": [n for n, t in expected["loaded"].items() if not torch.equal(observed["loaded"][n], t)],
        "stepped": [n for n, t in expected["stepped"].items() if not torch.equal(observed["stepped"][n], t)],
        "moved": sum(not torch.equal(expected["loaded"][n], t) for n, t in expected["stepped"].items()),
        "losses": (observed["loss"], expected["loss"]),
    }


def _trainer_step(with_callback: bool) -> dict[str, Any]:
    """One Trainer step (FSDP2 through accelerate) on a fresh LoRA: the PEFT model of peft's own route, or one
    built without initialization and filled by ``HpFastloadCallback`` after the Trainer prepared it."""
    import tempfile

    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments
    from transformers.initialization import no_init_weights

    from hp_fastload.integrations import HpFastloadCallback

    generator = torch.Generator().manual_seed(5)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (4, 9), generator=generator)]
    if with_callback:
        with no_init_weights():  # memory, not values: the callback fills the base after the Trainer's prepare
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(_root() / "base"))
    else:
        model = AutoModelForCausalLM.from_pretrained(_root() / "base", dtype=torch.float32)
    torch.manual_seed(23)  # the adapter's init: peft's own, on both routes
    model = get_peft_model(model, _lora())
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            max_steps=1,
            per_device_train_batch_size=2,
            learning_rate=1e-2,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            seed=0,
            data_seed=0,
            fsdp=True,
            fsdp_config={"version": 2},
        )
        callbacks = [HpFastloadCallback(_root() / "base")] if with_callback else []
        trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=callbacks)
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        state = trainer.accelerator.state  # on CPU the Trainer's Accelerator would pick DDP: FSDP2, as asked
        state.distributed_type = DistributedType.FSDP
        state.fsdp_plugin = FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
        trainer.is_fsdp_enabled = True
        result = trainer.train()
        stepped = {n: _local(p.detach()).clone() for n, p in trainer.model.named_parameters()}
        return {"stepped": stepped, "loss": result.training_loss}


def check_trainer_callback_peft(rank: int, world: int) -> dict[str, Any]:
    theirs, ours = _trainer_step(with_callback=False), _trainer_step(with_callback=True)
    return {
        "differing": [n for n, t in theirs["stepped"].items() if not torch.equal(ours["stepped"][n], t)],
        "names": sorted(theirs["stepped"]) == sorted(ours["stepped"]),
        "losses": (ours["loss"], theirs["loss"]),
    }


CHECKS = [
    check_base_fsdp,
    check_base_tp,
    check_base_job_share_tp,
    check_adapter_fsdp,
    check_adapter_tp,
    check_adapter_mismatch,
    check_save_adapter_fsdp,
    check_save_merged_fsdp,
    check_from_pretrained_peft_config_fsdp,
    check_from_pretrained_adapter_tp,
    check_from_pretrained_adapter_repo,
    check_moe_fsdp,
    check_moe_ep,
    check_moe_from_pretrained_peft_config_ep,
    check_accelerate_peft_config,  # last two: they leave accelerate's process-wide state set to FSDP2
    check_trainer_callback_peft,
]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict[str, Any]]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("peft")
    for base_dir, (family, lora) in BASES.items():
        torch.manual_seed(0)
        randomized(AutoModelForCausalLM.from_config(tiny_config(family)), 0.5).save_pretrained(root / base_dir)
        # the adapter of peft's usual route, which records the base's path in adapter_config.json
        base = AutoModelForCausalLM.from_pretrained(root / base_dir, dtype=torch.float32)
        adapted = get_peft_model(base, LoraConfig(**lora))
        with torch.no_grad():
            for name, param in adapted.named_parameters():
                if "lora_" in name or "modules_to_save" in name:
                    param.copy_(torch.randn_like(param) * 0.3)
        adapted.save_pretrained(root / f"{base_dir}_adapter")
    os.environ[ROOT_ENV] = str(root)
    try:
        return run_distributed(run_subchecks, 2, checks=CHECKS, timeout=360)
    finally:
        os.environ.pop(ROOT_ENV, None)


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_base_checkpoint_into_peft_model(ranks, layout):
    for value in subcheck_values(ranks, f"check_base_{layout}"):
        assert value["differences"] == [], value["differences"]
        assert value["adapters_untouched"] and value["planned_as_loaded"]
        lora = [n for n in value["lora_names"] if "lora_" in n]
        assert value["adapter_keys"] == sorted(value["lora_names"]) and len(lora) == 12
        assert value["missing"] == [] and value["unexpected"] == []
        assert "12 PEFT adapter tensors" not in value["summary"]  # 13: the 12 LoRA factors and lm_head's copy
        assert "13 PEFT adapter tensors left to their initialization" in value["summary"]


def test_base_checkpoint_with_job_share(ranks):
    values = subcheck_values(ranks, "check_base_job_share_tp")
    for value in values:
        assert value["differing"] == [] and value["share"] == "job" and value["adapter_keys"] == 13


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_adapter_loads_like_peft_from_pretrained(ranks, layout):
    values = subcheck_values(ranks, f"check_adapter_{layout}")
    for value in values:
        assert value["differences"] == [], value["differences"]
        assert value["loaded"] == 13
        loss, after = value["losses"]
        reference, reference_after = value["reference_losses"]
        assert loss == pytest.approx(reference, rel=1e-6, abs=1e-6)
        assert after == pytest.approx(reference_after, rel=1e-5, abs=1e-5)
        assert after != pytest.approx(loss, rel=1e-4)  # the step moved the adapter
    if layout == "fsdp":  # every adapter tensor is split between the ranks: each byte of the file read once
        assert [v["bytes_read"] for v in values] == [v["bytes_needed"] for v in values]
        assert sum(v["bytes_read"] for v in values) == values[0]["file_bytes"]


def test_adapter_mismatch_is_refused_before_reading(ranks):
    for value in subcheck_values(ranks, "check_adapter_mismatch"):
        assert value["rank"].startswith("AdapterMismatchError untouched=True"), value["rank"]
        assert "r 4 in the file, 8 in the model" in value["rank"]
        assert value["targets"].startswith("AdapterMismatchError untouched=True"), value["targets"]
        assert "target_modules" in value["targets"]


def test_adapter_only_save_equals_peft_save_pretrained(ranks):
    values = subcheck_values(ranks, "check_save_adapter_fsdp")
    assert values[0]["same"] == {
        "adapter_model.safetensors": True,
        "adapter_config.json": True,
        "README.md": True,
        "files": True,
    }
    # every rank wrote its own shards (accelerate #4206 kept rank 0's alone): losing any rank's regions would
    # change the bytes compared above; here each rank's share is also counted
    assert all(written > 0 for written in values[0]["bytes_written_by_rank"])
    for value in values:
        assert value["round_trip"] == []


def test_from_pretrained_with_a_fresh_lora_equals_get_peft_model(ranks):
    for value in subcheck_values(ranks, "check_from_pretrained_peft_config_fsdp"):
        assert value == []


def test_from_pretrained_with_a_saved_adapter(ranks):
    for value in subcheck_values(ranks, "check_from_pretrained_adapter_tp"):
        assert value["differences"] == [] and value["trainable"]
        assert value["losses"][0] == pytest.approx(value["reference_losses"][0], rel=1e-6, abs=1e-6)
        assert value["losses"][1] == pytest.approx(value["reference_losses"][1], rel=1e-5, abs=1e-5)
    for value in subcheck_values(ranks, "check_from_pretrained_adapter_repo"):
        assert value == []


@pytest.mark.parametrize("layout", ["fsdp", "ep"])
def test_moe_lora_on_experts(ranks, layout):
    for value in subcheck_values(ranks, f"check_moe_{layout}"):
        assert value["differences"] == [], value["differences"]
        assert value["adapter_keys"] == 16  # q, v and the two expert parameters' A and B, in 2 layers
        if layout == "fsdp":
            assert value["losses"][0] == pytest.approx(value["reference_losses"][0], rel=1e-6, abs=1e-6)
            assert value["losses"][1] == pytest.approx(value["reference_losses"][1], rel=1e-5, abs=1e-5)
    for value in subcheck_values(ranks, "check_moe_from_pretrained_peft_config_ep"):
        assert value == []


def test_merged_save_equals_peft_merge_and_unload(ranks):
    values = subcheck_values(ranks, "check_save_merged_fsdp")
    same = values[0]["same"]
    assert same.pop("files") and "model.safetensors" in same and "config.json" in same
    assert all(same.values()), same
    for value in values:
        assert value["unchanged"] and value["still_peft"] == "LoraModel"


def test_accelerate_prepare_pretrained_with_peft_config(ranks):
    for value in subcheck_values(ranks, "check_accelerate_peft_config"):
        assert value["loaded"] == []
        assert value["stepped"] == []
        assert value["moved"] >= 12  # the step moved the adapter (and the lm_head copy), not the frozen base
        assert value["losses"][0] == value["losses"][1]


def test_refusals(tmp_path):
    """Single process: a quantized base (QLoRA), a model that is no PEFT model, a directory without an
    adapter, an adapter name the model does not have; each a typed error naming the cause."""
    from transformers import AutoModelForCausalLM

    import hp_fastload as hf

    base = tmp_path / "base"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(base)
    os.environ[ROOT_ENV] = str(tmp_path)
    try:
        model = _meta_peft()
    finally:
        os.environ.pop(ROOT_ENV, None)
    model.to_empty(device="cpu")
    model.get_base_model().hf_quantizer = type("Bnb4BitHfQuantizer", (), {})()
    with pytest.raises(hf.TargetError, match=r"quantized \(Bnb4BitHfQuantizer: QLoRA\)"):
        hf.load(model, base)
    del model.get_base_model().hf_quantizer
    with pytest.raises(TypeError, match="needs a PEFT model"):
        hf.load_adapter(model.get_base_model(), base)
    with pytest.raises(FileNotFoundError, match=r"no adapter_config\.json"):
        hf.load_adapter(model, base)
    with pytest.raises(hf.TargetError, match="no adapter 'other'"):
        hf.save(model, tmp_path / "out", adapter_only=True, adapter_name="other")
    assert not (tmp_path / "out").exists()


def test_trainer_callback_with_a_peft_model(ranks):
    for value in subcheck_values(ranks, "check_trainer_callback_peft"):
        assert value["names"] and value["differing"] == []
        assert value["losses"][0] == value["losses"][1]


def test_hub_adapter_repo_resolves_its_base(tmp_path, monkeypatch):
    """An adapter-only Hub repo (offline, from a cache laid out as huggingface_hub lays it out):
    ``from_pretrained(repo)`` reads the base named by ``base_model_name_or_path`` and then the adapter, as
    ``PeftModel.from_pretrained(from_pretrained(base), repo)``; ``load_adapter(model, repo)`` reads it too."""
    import hashlib
    import json

    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name
    from peft import PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    import hp_fastload as hf

    base, adapter = tmp_path / "base", tmp_path / "adapter"
    torch.manual_seed(0)
    randomized(AutoModelForCausalLM.from_config(tiny_config("llama")), 0.5).save_pretrained(base)
    trained = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), _lora())
    with torch.no_grad():
        for name, param in trained.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param))
    trained.save_pretrained(adapter)
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base)
    repo_id, commit = "tiny-org/tiny-lora", "c" * 40
    repo = tmp_path / "hub" / repo_folder_name(repo_id=repo_id, repo_type="model")
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        data = (adapter / name).read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))

    model = hf.from_pretrained(repo_id, dtype=torch.float32)
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
    ours, theirs = dict(model.named_parameters()), dict(reference.named_parameters())
    assert sorted(ours) == sorted(theirs)
    assert [n for n in theirs if not torch.equal(ours[n], theirs[n])] == []
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.zero_()
    hf.load_adapter(model, repo_id)
    assert [n for n in theirs if not torch.equal(ours[n], theirs[n])] == []
