"""Quantized checkpoints dequantized exactly into float models, on one process (issue 13, items 2-3).

References, never the code under test: transformers' own CPU ``from_pretrained`` of the quantized checkpoint
with ``FineGrainedFP8Config(dequantize=True)`` wherever the weight dims are multiples of the block; elsewhere
(ragged last blocks: transformers derives the block from the scale grid) and for per-channel / per-tensor
scales, transformers' ``from_pretrained`` of a float checkpoint holding the published formula's values
(``quant_checkpoints.weight_dequant``: DeepSeek's ``weight_dequant`` with torch ops, fp32, rounded once).
Every model tensor must be bit-identical to the reference, on both loaders. A mutation that drops the scale
multiply in the engine fails every case.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import hp_fastload as hf
from hp_fastload.api.request import plan_request
from hp_fastload.execute.read import execute_plan
from hp_fastload.planning import front
from hp_fastload.source.index import CheckpointIndex
from tests.helpers import quant_checkpoints as qc
from tests.helpers.tiny_models import model_class

LOADERS = ["dcp", "legacy"]


def _zeroed(model: Any) -> Any:
    m = copy.deepcopy(model)
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
    return m


def _assert_equal(model: Any, reference: Any) -> None:
    got, want = model.state_dict(), reference.state_dict()
    assert set(got) == set(want)
    bad = [k for k in want if not torch.equal(got[k], want[k].to(got[k].dtype))]
    assert not bad, f"{len(bad)} tensors differ from the reference, first {bad[:4]}"


def _formula_reference(
    family: str, model: Any, tensors: dict[str, torch.Tensor], dequant: Callable[[str], torch.Tensor | None], tmp: Path
) -> Any:
    """transformers' ``from_pretrained`` of a float checkpoint holding each quantized tensor's formula value."""
    root = tmp / "reference"
    model.save_pretrained(root)
    out = {}
    for key, value in tensors.items():
        if key.endswith(("_scale_inv", ".weight_scale")):
            continue
        deq = dequant(key)
        out[key] = deq if deq is not None else value
    save_file(out, str(root / "model.safetensors"), metadata={"format": "pt"})
    return model_class(family).from_pretrained(root, dtype=next(model.parameters()).dtype)


def _fp8_block(family: str, block: tuple[int, int], tmp: Path, **overrides: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    model = qc.build_model(family, **overrides)
    tensors = qc.quantize_fp8_block(qc.released(model, tmp), block)
    qc.rewrite(tmp, tensors, dict(qc.FP8_CONFIG, weight_block_size=list(block)))
    return model, tensors


# ---------------------------------------------------------------------------------------------------------
# Against transformers' own dequantizing load (dims multiples of the block)

TRANSFORMERS_CASES = {
    "qwen3_moe_stacked_experts": ("qwen3_moe", (4, 8), {}),
    "deepseek_v3_multiple": ("deepseek_v3", (4, 8), {}),
    "llama_128_blocks": ("llama", (128, 128), dict(hidden_size=256, intermediate_size=384, num_hidden_layers=1)),
}


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("case", sorted(TRANSFORMERS_CASES))
def test_fp8_block_matches_transformers_dequantizing_load(tmp_path, case, loader):
    from transformers import FineGrainedFP8Config

    family, block, overrides = TRANSFORMERS_CASES[case]
    model, _ = _fp8_block(family, block, tmp_path, **overrides)
    reference = model_class(family).from_pretrained(
        tmp_path,
        dtype=torch.bfloat16,
        quantization_config=FineGrainedFP8Config(weight_block_size=block, dequantize=True),
    )
    target = _zeroed(model)
    report = hf.load(target, tmp_path, loader=loader)
    assert not report.missing_keys and not report.unexpected_keys  # the scales are consumed, not unexpected
    _assert_equal(target, reference)


# ---------------------------------------------------------------------------------------------------------
# Against the published formula


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ragged_blocks_match_deepseek_weight_dequant(tmp_path, loader, dtype):
    """kv_a_proj_with_mqa has 12 rows over blocks of 8 (a ragged 2-row grid, like 576 over 128 in
    DeepSeek-V3); o_proj / q_b_proj are whole blocks; experts are stacked by transformers' mapping."""
    block = (8, 8)
    model, tensors = _fp8_block("deepseek_v3", block, tmp_path, dtype=dtype)
    assert tensors["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (2, 2)

    def dequant(key: str) -> torch.Tensor | None:
        scale = tensors.get(key + "_scale_inv")
        return None if scale is None else qc.weight_dequant(tensors[key], scale, block, dtype)

    reference = _formula_reference("deepseek_v3", model, tensors, dequant, tmp_path)
    target = _zeroed(model)
    report = hf.load(target, tmp_path, loader=loader)
    assert not report.unexpected_keys
    _assert_equal(target, reference)


SCALE_CASES: dict[str, tuple[Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], dict[str, Any] | None]] = {
    "per_channel_compressed_tensors": (qc.fp8_channel_quantize, qc.COMPRESSED_FP8_CONFIG),
    "per_channel_fbgemm": (qc.fp8_channel_quantize, qc.FBGEMM_CONFIG),
    "per_tensor_no_config": (qc.fp8_tensor_quantize, None),
}


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("case", sorted(SCALE_CASES))
def test_weight_scale_fp8_llama_matches_formula(tmp_path, case, loader):
    quantize, config = SCALE_CASES[case]
    model = qc.build_model("llama")
    tensors = qc.quantize_with(qc.released(model, tmp_path), quantize)
    qc.rewrite(tmp_path, tensors, config)

    def dequant(key: str) -> torch.Tensor | None:
        scale = tensors.get(key[: -len("weight")] + "weight_scale")
        return None if scale is None else (tensors[key].float() * scale.float()).to(torch.bfloat16)

    reference = _formula_reference("llama", model, tensors, dequant, tmp_path)
    target = _zeroed(model)
    hf.load(target, tmp_path, loader=loader)
    _assert_equal(target, reference)


@pytest.mark.parametrize("loader", LOADERS)
def test_e5m2_with_e8m0_and_bf16_scales(tmp_path, loader):
    """e5m2 weights, MXFP8-style uint8 e8m0 exponents per [1, 8] block and bf16 block scales in one
    checkpoint; the reference decodes e8m0 as 2^(e-127) with torch."""
    model = qc.build_model("llama")
    released = qc.released(model, tmp_path)
    tensors: dict[str, torch.Tensor] = {}
    expected: dict[str, torch.Tensor] = {}
    for i, (key, t) in enumerate(sorted(released.items())):
        if not qc.is_linear_weight(key, t):
            tensors[key] = t
            continue
        rows, cols = t.shape
        if i % 2:  # e8m0 exponents stored as uint8, one per 8 columns
            exps = torch.randint(120, 130, (rows, cols // 8), dtype=torch.uint8)
            scale = torch.exp2(exps.float() - 127).repeat_interleave(8, 1)
            tensors[key + "_scale_inv"] = exps
        else:  # bf16 scales
            sc = torch.rand(rows, cols // 8).to(torch.bfloat16) + 0.5
            scale = sc.float().repeat_interleave(8, 1)
            tensors[key + "_scale_inv"] = sc
        q = (t.float() / scale).to(torch.float8_e5m2)
        tensors[key] = q
        expected[key] = (q.float() * scale).to(torch.bfloat16)
    qc.rewrite(tmp_path, tensors, dict(qc.FP8_CONFIG, fmt="e5m2", weight_block_size=[1, 8]))
    reference = _formula_reference("llama", model, tensors, expected.get, tmp_path)
    target = _zeroed(model)
    hf.load(target, tmp_path, loader=loader)
    _assert_equal(target, reference)


def _mxfp4_gpt_oss(tmp: Path, **sizes: int) -> tuple[Any, dict[str, torch.Tensor], Any]:
    """A gpt-oss checkpoint whose experts are MXFP4 ``*_blocks`` + ``*_scales`` (the torch quantizer in
    quant_checkpoints), and transformers' ``Mxfp4Config(dequantize=True)`` load of it."""
    from transformers import Mxfp4Config

    model = qc.build_model("gpt_oss", **(sizes or dict(hidden_size=32, intermediate_size=32)))
    tensors = {}
    for key, value in qc.released(model, tmp).items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[key + "_blocks"], tensors[key + "_scales"] = qc.mxfp4_quantize(value)
        else:
            tensors[key] = value
    qc.rewrite(tmp, tensors, qc.MXFP4_CONFIG)
    reference = model_class("gpt_oss").from_pretrained(
        tmp, dtype=torch.bfloat16, quantization_config=Mxfp4Config(dequantize=True)
    )
    return model, tensors, reference


@pytest.mark.parametrize("loader", LOADERS)
def test_mxfp4_gpt_oss_matches_transformers_dequantizing_load(tmp_path, loader):
    """gpt-oss experts as MXFP4 into the bf16 model: equal to transformers' dequantizing load."""
    model, tensors, reference = _mxfp4_gpt_oss(tmp_path)
    key = "model.layers.1.mlp.experts.gate_up_proj"
    formula = qc.mxfp4_dequant(tensors[key + "_blocks"], tensors[key + "_scales"], torch.bfloat16)
    assert torch.equal(reference.state_dict()[key], formula)  # the reference is the published formula
    target = _zeroed(model)
    report = hf.load(target, tmp_path, loader=loader)
    assert not report.missing_keys and not report.unexpected_keys
    # the region path dequantizes MXFP4 in the engine's copy pass; the legacy loader with torch, whole
    assert (key in report.deferred_targets) == (loader == "legacy"), report.deferred_targets
    _assert_equal(target, reference)
    if loader == "dcp":  # each expert tensor reads its packed bytes once (half a byte an element) and its scales
        plan = hf.plan(_zeroed(model), tmp_path)
        assert plan.read_bytes_by_target()[key] == tensors[key + "_blocks"].numel() + tensors[key + "_scales"].numel()
        assert report.bytes_read == plan.bytes_needed == plan.report.checkpoint_bytes  # every byte once, scales too


@pytest.fixture(scope="module")
def every_scale_byte(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    """A gpt-oss MXFP4 checkpoint whose expert scales take every e8m0 byte 0..255 (each expert's rows cycle
    through them) over random blocks (every e2m1 code), and transformers' dequantizing load of it, checked
    against transformers' own ``convert_moe_packed_tensors``: byte 255 is the exponent 128 there (``ldexp``:
    ±0 stays ±0, ±0.5 is ±2^127, the rest ±inf), never NaN."""
    from transformers import Mxfp4Config
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    root = tmp_path_factory.mktemp("every_scale_byte")
    model = qc.build_model("gpt_oss", hidden_size=128, intermediate_size=32)
    gen = torch.Generator().manual_seed(5)
    tensors = {}
    for key, value in qc.released(model, root).items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = qc.mxfp4_quantize(value)
            blocks = torch.randint(0, 256, blocks.shape, dtype=torch.uint8, generator=gen)
            cycle = torch.arange(scales.numel()) * 7 % 256  # 7 is prime to 256: every byte, in every place
            tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, cycle.to(torch.uint8).reshape(scales.shape)
        else:
            tensors[key] = value
    qc.rewrite(root, tensors, qc.MXFP4_CONFIG)
    key = "model.layers.0.mlp.experts.gate_up_proj"
    blocks, scales = tensors[key + "_blocks"], tensors[key + "_scales"]
    assert set(scales.flatten().tolist()) == set(range(256))
    own = convert_moe_packed_tensors(blocks, scales)
    at_255 = (scales == 255).unsqueeze(-1).expand(*scales.shape, 32).reshape(own.shape[0], own.shape[2], -1)
    big = own.transpose(1, 2)[at_255]
    assert big.isinf().any() and not big.isnan().any() and (big.float().abs() == 2.0**127).any()
    reference = model_class("gpt_oss").from_pretrained(
        root, dtype=torch.bfloat16, quantization_config=Mxfp4Config(dequantize=True)
    )
    assert torch.equal(reference.state_dict()[key].view(torch.int16), own.view(torch.int16))
    return root, model, reference


@pytest.mark.parametrize("loader", LOADERS)
def test_mxfp4_every_scale_byte_matches_transformers(every_scale_byte, loader):
    """Every scale byte and code bit for bit as transformers gives them (the fixture): byte 255 included,
    byte 0's bf16 subnormals too. 64 byte columns by 64 rows an expert: the vectorized tiles and the scalar
    kernel both run."""
    root, model, reference = every_scale_byte
    target = _zeroed(model)
    hf.load(target, root, loader=loader)
    got, want = target.state_dict(), reference.state_dict()
    bad = [k for k in want if not torch.equal(got[k].view(torch.int16), want[k].view(torch.int16))]
    assert not bad, f"{len(bad)} tensors differ bitwise from transformers, first {bad[:4]}"


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_staged_reads_dequantize_in_row_blocks(tmp_path, fmt):
    """The staging path (CUDA targets; here forced on CPU) cuts targets into row blocks of a small slab:
    the scale of each element still comes from its row in the checkpoint (FP8 blocks; MXFP4 experts, whose
    transposed rows each take one nibble of every packed row)."""
    from transformers import FineGrainedFP8Config

    if fmt == "mxfp4":
        model, _, reference = _mxfp4_gpt_oss(tmp_path)
    else:
        model, _ = _fp8_block("qwen3_moe", (4, 8), tmp_path)
        reference = model_class("qwen3_moe").from_pretrained(
            tmp_path,
            dtype=torch.bfloat16,
            quantization_config=FineGrainedFP8Config(weight_block_size=(4, 8), dequantize=True),
        )
    target = _zeroed(model)
    plan, context = front.plan(target, CheckpointIndex.open(tmp_path), plan_request(target, loader="dcp"))
    assert plan.dequant
    stats = execute_plan(plan, context, stage_all=True, staging_bytes=512)
    assert stats.engine_calls > 1
    _assert_equal(target, reference)


def test_plan_names_the_dequantized_keys(tmp_path):
    model, tensors = _fp8_block("deepseek_v3", (8, 8), tmp_path)
    plan = hf.plan(copy.deepcopy(model), tmp_path)
    assert set(plan.dequant) == {k for k in tensors if k + "_scale_inv" in tensors}
    spec = plan.dequant["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    assert spec.shape == (12, 16) and spec.block == (8, 8)
    assert not plan.report.unexpected_keys


def test_block_size_that_does_not_fit_the_grid_is_refused(tmp_path):
    """A config whose weight_block_size does not give the scale grid the checkpoint holds: refused."""
    model, _ = _fp8_block("deepseek_v3", (8, 8), tmp_path)
    qc.write_config(tmp_path, dict(qc.FP8_CONFIG, weight_block_size=[4, 4]))
    with pytest.raises(hf.QuantizationError, match="not the grid"):
        hf.load(_zeroed(model), tmp_path)


def test_plan_counts_the_scale_bytes(tmp_path):
    """``hf.plan`` counts what the engine reads: at world 1 every weight and every scale tensor of an FP8
    checkpoint (each scale's grid rows all touched, read once), so the plan's bytes are the checkpoint's data bytes."""
    model, tensors = _fp8_block("deepseek_v3", (8, 8), tmp_path)
    plan = hf.plan(_zeroed(model), tmp_path)
    scale_bytes = sum(t.numel() * t.element_size() for k, t in tensors.items() if k.endswith("_scale_inv"))
    assert scale_bytes and plan.dequant
    assert plan.bytes_needed == plan.report.checkpoint_bytes
    assert sum(plan.read_bytes_by_file().values()) == plan.report.checkpoint_bytes
    key = next(k for k in plan.dequant if ".mlp.experts." not in k)  # a weight and its scale: its own target
    assert plan.read_bytes_by_target()[key] == tensors[key].numel() + tensors[key + "_scale_inv"].numel() * 4


@pytest.mark.parametrize("bad", ["flat_blocks", "short_scales", "int8_blocks"])
def test_mxfp4_that_does_not_fit_is_refused_before_reading(tmp_path, monkeypatch, bad):
    """MXFP4 blocks that are not ``[..., rows, groups, 16]`` uint8, or scales that are not one per group, are
    a ``QuantizationError`` at planning naming the tensor (``hf.plan`` and ``hf.load``), before the engine
    runs."""

    model = qc.build_model("gpt_oss", hidden_size=32, intermediate_size=32)
    key = "model.layers.1.mlp.experts.down_proj"
    tensors = {}
    for k, value in qc.released(model, tmp_path).items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[k + "_blocks"], tensors[k + "_scales"] = qc.mxfp4_quantize(value)
        else:
            tensors[k] = value
    blocks, scales = tensors[key + "_blocks"], tensors[key + "_scales"]
    if bad == "flat_blocks":
        tensors[key + "_blocks"] = blocks.reshape(*blocks.shape[:-2], -1)
    elif bad == "short_scales":
        tensors[key + "_scales"] = scales[:, :-1].contiguous()
    else:
        tensors[key + "_blocks"] = blocks.view(torch.int8)
    qc.rewrite(tmp_path, tensors, qc.MXFP4_CONFIG)
    calls = []
    monkeypatch.setattr(hf._core, "execute", lambda *a, **k: calls.append(a))
    with pytest.raises(hf.QuantizationError, match=key + "_blocks"):
        hf.plan(_zeroed(model), tmp_path)
    with pytest.raises(hf.QuantizationError, match=key + "_blocks"):
        hf.load(_zeroed(model), tmp_path)
    assert not calls


def test_batch_counts_the_scale_rows_the_engine_reads(tmp_path):
    """An expert-parallel rank's box (experts 3 and 4 of 8 MXFP4 experts, two items of one scale): the batch
    counts the packed bytes plus the two experts' scale rows, the engine reads exactly that (pread, no gap),
    and the values are the torch formula's (scale rows outside the box are never needed)."""
    from hp_fastload.convert.quant import Dequant
    from hp_fastload.execute.batch import Batch
    from hp_fastload.source.index import CheckpointIndex

    e, y, g = 8, 4, 2
    gen = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (e, y, g, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(120, 134, (e, y, g), dtype=torch.uint8, generator=gen)
    save_file({"w_blocks": blocks, "w_scales": scales}, str(tmp_path / "model.safetensors"))
    index = CheckpointIndex.open(tmp_path)
    spec = Dequant("w_scales", (e, y, g * 32), (1, 1, 32))
    batch = Batch(index.locate)
    out = torch.zeros(2, y, g * 32)
    for k, expert in enumerate((3, 4)):
        batch.add("w_blocks", expert * y * g * 32, (y * g * 32, g * 32, 1), (1, y, g * 32), out, (k, 0, 0), spec)
    assert batch.nbytes == 2 * y * g * 16 + 2 * y * g  # two experts' packed bytes and their scale rows
    stats = batch.execute(1, "pread")
    assert stats is not None and stats["bytes_read_from_files"] == batch.nbytes
    want = qc.mxfp4_dequant(blocks[3:5], scales[3:5], torch.float32).transpose(1, 2)
    assert torch.equal(out, want)
