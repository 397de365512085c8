"""Quantized checkpoints dequantized into DTensor shards on 2 gloo ranks (issue 13, items 2-3).

One spawn runs every check. The parent writes the quantized checkpoints (``quant_checkpoints``) and their
full float references (transformers' own loads: ``FineGrainedFP8Config(dequantize=True)`` for Qwen3-MoE, the
published ``weight_dequant`` formula loaded with ``from_pretrained`` for DeepSeek-V3's ragged blocks and the
per-channel Llama); each rank builds the float model, shards it (FSDP2 ``fully_shard``; TP and EP as DTensor
placements: column and row shards whose boundaries fall inside scale blocks, experts split over the ranks),
loads with both loaders and compares every local shard with ``distribute_tensor(reference)``. gpt-oss MXFP4
experts (dequantized by the engine on the region path, each rank reading only the packed bytes of its
shard; with torch by the legacy loader) are compared with transformers' ``Mxfp4Config(dequantize=True)`` load. A
refused format (GPTQ) must raise ``QuantizationError`` on every rank.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import quant_checkpoints as qc
from tests.helpers.dist import run_distributed, run_subchecks, subcheck_values
from tests.helpers.tiny_models import model_class

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

ROOT_ENV = "HPF_QUANT_ROOT"
#: family -> fp8 block (None: per-channel weight_scale; "mxfp4": gpt-oss MXFP4 experts)
MODELS: dict[str, Any] = {"deepseek_v3": (8, 8), "qwen3_moe": (4, 8), "llama": None, "gpt_oss": "mxfp4"}
MXFP4_SIZES = dict(hidden_size=32, intermediate_size=32)
LAYOUTS = ("fsdp", "tp", "ep")
LOADERS = ("dcp", "legacy")


def _write(root: Path) -> None:
    from transformers import FineGrainedFP8Config

    for family, block in MODELS.items():
        path = root / family
        model = qc.build_model(family, **(MXFP4_SIZES if block == "mxfp4" else {}))
        released = qc.released(model, path)
        if block == "mxfp4":
            from transformers import Mxfp4Config

            tensors = {}
            for key, value in released.items():
                if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
                    tensors[key + "_blocks"], tensors[key + "_scales"] = qc.mxfp4_quantize(value)
                else:
                    tensors[key] = value
            qc.rewrite(path, tensors, qc.MXFP4_CONFIG)
            reference = model_class(family).from_pretrained(
                path, dtype=torch.bfloat16, quantization_config=Mxfp4Config(dequantize=True)
            )
            torch.save(reference.state_dict(), path / "reference.pt")
            continue
        if block is None:
            tensors = qc.quantize_with(released, qc.fp8_channel_quantize)
            qc.rewrite(path, tensors, qc.FBGEMM_CONFIG)
        else:
            tensors = qc.quantize_fp8_block(released, block)
            qc.rewrite(path, tensors, dict(qc.FP8_CONFIG, weight_block_size=list(block)))
        if family == "qwen3_moe":
            reference = model_class(family).from_pretrained(
                path,
                dtype=torch.bfloat16,
                quantization_config=FineGrainedFP8Config(weight_block_size=block, dequantize=True),
            )
        else:
            formula = root / f"{family}-formula"
            model.save_pretrained(formula)
            out = {}
            for key, value in tensors.items():
                if key.endswith(("_scale_inv", "weight_scale")):
                    continue
                if block is not None and key + "_scale_inv" in tensors:
                    value = qc.weight_dequant(value, tensors[key + "_scale_inv"], block, torch.bfloat16)
                elif block is None and key[: -len("weight")] + "weight_scale" in tensors:
                    scale = tensors[key[: -len("weight")] + "weight_scale"]
                    value = (value.float() * scale.float()).to(torch.bfloat16)
                out[key] = value
            qc.save_file(out, str(formula / "model.safetensors"), metadata={"format": "pt"})
            reference = model_class(family).from_pretrained(formula, dtype=torch.bfloat16)
        torch.save(reference.state_dict(), path / "reference.pt")
    for family in ("deepseek_v3", "gpt_oss"):  # torch's quantized reader needs an index
        path = root / family
        keys = qc.load_file(str(path / "model.safetensors"))
        index = {"metadata": {}, "weight_map": dict.fromkeys(keys, "model.safetensors")}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    gptq = root / "llama_gptq"
    qc.rewrite(gptq, qc.gptq_layout(qc.released(qc.build_model("llama"), gptq)), qc.GPTQ_CONFIG)


def _placements(name: str, shape: tuple[int, ...], layout: str) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    if layout == "ep":  # stacked experts split over the ranks; everything else replicated
        return [Shard(0)] if ".experts." in name and len(shape) == 3 else [Replicate()]
    # tp: output projections by columns (inputs of a row-parallel layer), the rest by rows
    if len(shape) == 2 and name.endswith(("o_proj.weight", "down_proj.weight")):
        return [Shard(1)]
    if len(shape) == 3:
        return [Shard(1)]  # experts: a split of every expert along its second dim
    return [Shard(0)] if len(shape) >= 1 and shape[0] >= 2 else [Replicate()]


def _build(family: str, layout: str) -> Any:
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    model = qc.build_model(family, seed=1, **(MXFP4_SIZES if MODELS.get(family) == "mxfp4" else {}))
    mesh = init_device_mesh("cpu", (2,))
    if layout == "fsdp":
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        for name, param in list(model.named_parameters()):
            *path, leaf = name.split(".")
            module = model.get_submodule(".".join(path))
            placements = _placements(name, tuple(param.shape), layout)
            dt = distribute_tensor(param.detach().clone(), mesh, placements, src_data_rank=None)
            setattr(module, leaf, nn.Parameter(dt, requires_grad=False))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def _check(family: str, layout: str, loader: str) -> list[str]:
    from torch.distributed.tensor import DTensor, distribute_tensor

    import hp_fastload as hf

    root = Path(os.environ[ROOT_ENV]) / family
    reference = torch.load(root / "reference.pt")
    model = _build(family, layout)
    report = hf.load(model, root, loader=loader)
    assert not report.missing_keys and not report.unexpected_keys, report
    bad = []
    sharded = 0
    for name, param in model.state_dict().items():
        full = reference[name].to(param.dtype)
        if isinstance(param, DTensor):
            expected = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
            local = param.to_local()
            sharded += expected.numel() < full.numel()
        else:
            expected, local = full, param
        if expected.shape != local.shape or not torch.equal(expected, local):
            bad.append(name)
    assert sharded, "no tensor was sharded"
    if family == "gpt_oss" and loader == "dcp":  # MXFP4 on the region path: each rank reads its share only
        assert not any(".experts." in n for n in report.deferred_targets), report.deferred_targets
        read = hf.plan(model, root).read_bytes_by_target()
        stored = qc.load_file(str(root / "model.safetensors"))
        for name, param in model.state_dict().items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                local = param.to_local() if isinstance(param, DTensor) else param
                # the scale rows: every [Y, G] grid row of the experts this shard holds (dim 0 of the blocks)
                scales = stored[name + "_scales"]
                experts = torch.arange(scales.shape[0]).view(-1, 1, 1).expand(param.shape).contiguous()
                if isinstance(param, DTensor):
                    experts = distribute_tensor(experts, param.device_mesh, param.placements, src_data_rank=None)
                    experts = experts.to_local()
                held = int(experts.max() - experts.min() + 1)
                want = local.numel() // 2 + held * scales[0].numel()  # two 4-bit codes a byte, + the scale rows
                if layout in ("ep", "fsdp"):
                    assert held == scales.shape[0] // 2, (name, held)  # an expert split: half the scales
                if read.get(name) != want:
                    bad.append(f"{name}: reads {read.get(name)} bytes for {local.numel()} local elements")
    return bad


def _make_check(family: str, layout: str, loader: str) -> Any:
    def check(rank: int, world: int) -> list[str]:
        return _check(family, layout, loader)

    check.__name__ = f"check_{family}_{layout}_{loader}"
    return check


#: (family, layout, loader) of every value check (a dense model has no experts for the EP layout)
CASES = [
    (family, layout, loader)
    for family in MODELS
    for layout in LAYOUTS
    if not (layout == "ep" and family == "llama")
    for loader in LOADERS
]


def _all_checks(rank: int, world: int) -> dict[str, Any]:
    checks = [_make_check(*case) for case in CASES] + [
        check_gptq_refused_on_every_rank,
        check_quantized_dcp_reader_matches_torch,
        check_ep_rank_builds_the_specs_it_reads,
    ]
    return run_subchecks(rank, world, checks)


#: DCP reader cases: (family, key, placement, state-dict dtype, target_dtype)
READER_CASES = [
    ("deepseek_v3", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight", 0, "bfloat16", "float32"),
    ("deepseek_v3", "model.layers.0.mlp.down_proj.weight", 1, "float32", "float32"),
    ("deepseek_v3", "model.layers.1.mlp.experts.3.up_proj.weight", 1, "bfloat16", "bfloat16"),
    ("deepseek_v3", "model.layers.0.self_attn.o_proj.weight", None, "float32", "bfloat16"),
    ("deepseek_v3", "model.layers.1.input_layernorm.weight", 0, "float32", "float32"),
    ("gpt_oss", "model.layers.0.mlp.experts.gate_up_proj_blocks", 2, "bfloat16", "bfloat16"),
    ("gpt_oss", "model.layers.1.mlp.experts.down_proj_blocks", 0, "float32", "float32"),
    ("gpt_oss", "model.layers.1.mlp.experts.down_proj_blocks", 2, "bfloat16", "float32"),
]


def check_quantized_dcp_reader_matches_torch(rank: int, world: int) -> list[str]:
    """Our QuantizedHuggingFaceStorageReader under dcp.load == torch's, bit for bit, on sharded DTensors
    whose boundaries cut scale blocks (rows 6 of 12 over blocks of 8), and == the formula (fp8 and MXFP4,
    whose groups of 32 are cut at 16)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader as Theirs
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from hp_fastload.api.dcp import QuantizedHuggingFaceStorageReader as Ours

    mesh = init_device_mesh("cpu", (2,))
    bad = []
    for i, (family, key, dim, dtype_name, target_name) in enumerate(READER_CASES):
        path = Path(os.environ[ROOT_ENV]) / family
        stored = qc.load_file(str(path / "model.safetensors"))[key]
        shape = list(stored.shape) if not key.endswith("_blocks") else [*stored.shape[:-2], stored.shape[-2] * 32]
        placement = [Replicate()] if dim is None else [Shard(dim)]
        dtype, target = getattr(torch, dtype_name), getattr(torch, target_name)
        results = []
        for reader in (
            Theirs(str(path), target_dtype=target, block_size=8),
            Ours(str(path), target_dtype=target, block_size=8),
        ):
            tensor = distribute_tensor(torch.full(shape, 7.0, dtype=dtype), mesh, placement, src_data_rank=None)
            state = {key: tensor}
            dcp.load(state, storage_reader=reader)
            results.append(state[key].to_local())
        if key.endswith("_blocks"):
            # torch's reader keeps the packed chunk in its metadata and fills one value in 32 (torch 2.15):
            # the reference here is the formula in torch's layout (not transposed), from torch ops
            blocks, scales = stored, qc.load_file(str(path / "model.safetensors"))[key[: -len("_blocks")] + "_scales"]
            full = qc.mxfp4_dequant(blocks, scales, target).transpose(1, 2).to(dtype)
            want = distribute_tensor(full, mesh, placement, src_data_rank=None).to_local()
            if not torch.equal(results[1], want):
                bad.append(f"{i}: {key} differs from the MXFP4 formula")
        elif not torch.equal(results[0], results[1]):
            bad.append(f"{i}: {key} differs from torch's reader")
        if results[1].numel() and bool((results[1] == 7.0).all()):
            bad.append(f"{i}: {key} was not read")
        if key.endswith(".weight") and key + "_scale_inv" in qc.load_file(str(path / "model.safetensors")):
            scale = qc.load_file(str(path / "model.safetensors"))[key + "_scale_inv"]
            full = qc.weight_dequant(stored, scale, (8, 8), target).to(dtype)
            want = distribute_tensor(full, mesh, placement, src_data_rank=None).to_local()
            if not torch.equal(results[1], want):
                bad.append(f"{i}: {key} differs from the formula")
    return bad


def check_gptq_refused_on_every_rank(rank: int, world: int) -> str:
    import hp_fastload as hf

    model = _build("llama", "fsdp")
    try:
        hf.load(model, Path(os.environ[ROOT_ENV]) / "llama_gptq")
    except hf.QuantizationError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def check_ep_rank_builds_the_specs_it_reads(rank: int, world: int) -> dict[str, Any]:
    """Plan the Qwen3-MoE FP8 checkpoint into the EP model, watching the detection planning uses: which
    quantized tensors had their layout (``QuantTensor`` / ``Dequant``) built, which are in ``plan.dequant``,
    and which quantized keys the plan reads."""
    import importlib

    import hp_fastload as hf

    orchestrate = importlib.import_module("hp_fastload.planning.orchestrate")  # (hf.plan is the function)
    seen: list[Any] = []
    real = orchestrate.detect_in_index
    orchestrate.detect_in_index = lambda index: seen.append(real(index)) or seen[-1]
    try:
        plan = hf.plan(_build("qwen3_moe", "ep"), Path(os.environ[ROOT_ENV]) / "qwen3_moe")
    finally:
        orchestrate.detect_in_index = real
    (quant,) = seen
    reads = {k for r in plan.region_reads.values() for k in r.keys} | {k for d in plan.deferred for k in d.keys}
    return {
        "built": sorted(quant.tensors.built()),
        "dequant": sorted(plan.dequant),
        "read": sorted(k for k in reads if k in quant.tensors),
        "quantized": len(quant.tensors),
        "unexpected": list(plan.report.unexpected_keys),
    }


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    _write(root)
    os.environ[ROOT_ENV] = str(root)  # spawned ranks inherit the environment
    return run_distributed(_all_checks, 2, timeout=500)


@pytest.mark.parametrize(("family", "layout", "loader"), CASES, ids=["-".join(c) for c in CASES])
def test_every_local_shard_matches_distribute_tensor(outcomes, family, layout, loader):
    assert subcheck_values(outcomes, f"check_{family}_{layout}_{loader}") == [[], []]


def test_gptq_is_refused_on_every_rank(outcomes):
    messages = subcheck_values(outcomes, "check_gptq_refused_on_every_rank")
    assert all(m.startswith("QuantizationError") and "gptq" in m for m in messages), messages


def test_quantized_dcp_reader_matches_torchs(outcomes):
    assert subcheck_values(outcomes, "check_quantized_dcp_reader_matches_torch") == [[], []]


def test_ep_rank_builds_dequantization_specs_only_for_what_it_reads(outcomes):
    """An EP rank's plan builds the layouts of the quantized tensors it reads, no others: ``plan.dequant``
    is exactly those keys, each rank's experts are its own half, and no scale is reported unexpected."""
    ranks = subcheck_values(outcomes, "check_ep_rank_builds_the_specs_it_reads")
    experts = []
    for got in ranks:
        assert got["built"] == got["dequant"] == got["read"]
        assert 0 < len(got["built"]) < got["quantized"]
        assert got["unexpected"] == []
        experts.append({k for k in got["built"] if ".mlp.experts." in k})
    assert experts[0] and experts[1] and not experts[0] & experts[1]
