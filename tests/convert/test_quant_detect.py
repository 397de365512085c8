"""Quantized checkpoints are never cast raw into a float model (issue 13, item 1).

The formats hp_fastload dequantizes are tested for values in tests/test_quant_dequant.py; here, the ones it
does not (GPTQ/AWQ int4, bitsandbytes nf4, ModelOpt NVFP4, fp8 without scales) are refused.

Each checkpoint is a tiny model's released checkpoint with its projection weights quantized by torch ops
(``quant_checkpoints``), written with safetensors ``save_file`` next to the ``quantization_config`` the real
models ship. Loading it into the float model must raise ``QuantizationError`` on both loaders and in the DCP
reader, naming the method and the tensor, before any byte is read (the engine entry point is replaced by one
that fails the test). A model that keeps the quantized tensors as parameters loads them raw, bit for bit.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import hp_fastload as hf
from hp_fastload import _core
from hp_fastload.convert.detect import detect_in_index
from hp_fastload.convert.quant import QuantizationError
from hp_fastload.source.index import CheckpointIndex
from tests.helpers import quant_checkpoints as qc


def _no_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the engine was called: bytes were read before the refusal")

    monkeypatch.setattr(_core, "execute", refuse)


def _case(name: str, root: Path) -> tuple[Any, str, str]:
    """Writes checkpoint ``name`` under ``root``; returns (float model, method, one quantized key)."""
    if name == "deepseek_fp8_block":
        model = qc.build_model("deepseek_v3")
        t = qc.released(model, root)
        qc.rewrite(root, qc.quantize_fp8_block(t, (8, 8)), dict(qc.FP8_CONFIG, weight_block_size=[8, 8]))
        return model, "fp8", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    if name == "qwen3_moe_fp8_block":
        model = qc.build_model("qwen3_moe")
        t = qc.released(model, root)
        qc.rewrite(root, qc.quantize_fp8_block(t, (4, 8)), dict(qc.FP8_CONFIG, weight_block_size=[4, 8]))
        return model, "fp8", "model.layers.0.mlp.experts.0.gate_proj.weight"
    if name == "llama_fp8_channel_compressed_tensors":
        model = qc.build_model("llama")
        t = qc.released(model, root)
        qc.rewrite(root, qc.quantize_with(t, qc.fp8_channel_quantize), qc.COMPRESSED_FP8_CONFIG)
        return model, "compressed-tensors", "model.layers.0.self_attn.q_proj.weight"
    if name == "llama_fp8_channel_fbgemm":
        model = qc.build_model("llama")
        t = qc.released(model, root)
        qc.rewrite(root, qc.quantize_with(t, qc.fp8_channel_quantize), qc.FBGEMM_CONFIG)
        return model, "fbgemm_fp8", "model.layers.1.mlp.down_proj.weight"
    if name == "llama_fp8_tensor_no_config":
        model = qc.build_model("llama")
        t = qc.released(model, root)
        qc.rewrite(root, qc.quantize_with(t, qc.fp8_tensor_quantize), None)
        return model, "fp8", "model.layers.0.self_attn.o_proj.weight"
    if name == "gpt_oss_mxfp4":
        model = qc.build_model("gpt_oss", hidden_size=32, intermediate_size=32)
        t = qc.released(model, root)
        out = {}
        for key, v in t.items():
            if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
                out[key + "_blocks"], out[key + "_scales"] = qc.mxfp4_quantize(v)
            else:
                out[key] = v
        qc.rewrite(root, out, qc.MXFP4_CONFIG)
        return model, "mxfp4", "model.layers.0.mlp.experts.gate_up_proj_blocks"
    if name == "llama_gptq_int4":
        model = qc.build_model("llama")
        qc.rewrite(root, qc.gptq_layout(qc.released(model, root)), qc.GPTQ_CONFIG)
        return model, "gptq", "model.layers.0.self_attn.q_proj.qweight"
    if name == "llama_bnb_nf4":
        model = qc.build_model("llama")
        qc.rewrite(root, qc.bnb_nf4_layout(qc.released(model, root)), qc.BNB_CONFIG)
        return model, "bitsandbytes", "model.layers.0.mlp.up_proj.weight"
    if name == "llama_nvfp4_modelopt":
        model = qc.build_model("llama")
        qc.rewrite(root, qc.nvfp4_layout(qc.released(model, root)), qc.NVFP4_CONFIG)
        return model, "modelopt", "model.layers.1.self_attn.k_proj.weight"
    if name == "llama_fp8_config_only":  # fp8 weights without scales, covered by the config alone
        model = qc.build_model("llama")
        t = qc.released(model, root)
        t = {k: (v.to(torch.float8_e4m3fn) if qc.is_linear_weight(k, v) else v) for k, v in t.items()}
        qc.rewrite(root, t, dict(qc.FP8_CONFIG, weight_block_size=[8, 8]))
        return model, "fp8", "model.layers.0.self_attn.q_proj.weight"
    raise AssertionError(name)


#: every checkpoint built here; the first six are dequantized (tests/test_quant_dequant.py)
CASES = [
    "deepseek_fp8_block",
    "qwen3_moe_fp8_block",
    "llama_fp8_channel_compressed_tensors",
    "llama_fp8_channel_fbgemm",
    "llama_fp8_tensor_no_config",
    "gpt_oss_mxfp4",
    "llama_gptq_int4",
    "llama_bnb_nf4",
    "llama_nvfp4_modelopt",
    "llama_fp8_config_only",
]
#: the formats refused with a float model
REFUSED = CASES[6:]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any, str, str]]:
    out = {}
    for name in CASES:
        root = tmp_path_factory.mktemp(name)
        model, method, key = _case(name, root)
        out[name] = (root, model, method, key)
    return out


@pytest.mark.parametrize("loader", ["dcp", "legacy"])
@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("name", REFUSED)
def test_quantized_checkpoint_is_refused_before_reading(checkpoints, monkeypatch, name, loader, strict):
    root, model, method, key = checkpoints[name]
    model = copy.deepcopy(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _no_reads(monkeypatch)
    with pytest.raises(QuantizationError) as info:
        hf.load(model, root, loader=loader, strict=strict)
    message = str(info.value)
    assert method in message and "Supported:" in message
    assert isinstance(info.value, hf.PlanError)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # nothing the user had was touched
    # the named tensor is one of the quantized ones (the first refused in natural order)
    quant = detect_in_index(CheckpointIndex.open(root))
    assert key in quant.tensors
    assert any(q in message for q in quant.tensors)


@pytest.mark.parametrize("name", REFUSED)
def test_plan_refuses_too(checkpoints, name):
    root, model, method, _ = checkpoints[name]
    with pytest.raises(QuantizationError, match=method):
        hf.plan(copy.deepcopy(model), root)


def test_detects_every_quantized_tensor(checkpoints):
    root = checkpoints["deepseek_fp8_block"][0]
    file = load_file(str(root / "model.safetensors"))
    quant = detect_in_index(CheckpointIndex.open(root))
    expected = {k for k in file if k + "_scale_inv" in file}
    assert expected and set(quant.tensors) == expected
    assert quant.companions == {k + "_scale_inv" for k in expected}
    root = checkpoints["gpt_oss_mxfp4"][0]
    quant = detect_in_index(CheckpointIndex.open(root))
    assert set(quant.tensors) == {
        f"model.layers.{i}.mlp.experts.{p}_blocks" for i in range(2) for p in ("gate_up_proj", "down_proj")
    }
    assert quant.tensors["model.layers.1.mlp.experts.down_proj_blocks"].dequantized == (
        "model.layers.1.mlp.experts.down_proj"
    )


def test_modules_to_not_convert_are_not_covered(tmp_path):
    """A non-float tensor under an excluded module is not quantized by the config; the same checkpoint
    without the exclusion is refused."""
    model = qc.build_model("llama")
    t = qc.released(model, tmp_path)
    key = "model.layers.0.self_attn.q_proj.weight"
    t[key] = t[key].to(torch.float8_e4m3fn)
    qc.rewrite(tmp_path, t, dict(qc.FP8_CONFIG, modules_to_not_convert=["model.layers.0.self_attn.q_proj"]))
    quant = detect_in_index(CheckpointIndex.open(tmp_path))
    assert not quant
    qc.write_config(tmp_path, dict(qc.FP8_CONFIG, ignored_layers=["self_attn.k_proj"]))
    with pytest.raises(QuantizationError, match="q_proj"):
        hf.load(copy.deepcopy(model), tmp_path)


class _Fp8Linear(nn.Module):
    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, cols, dtype=torch.float8_e4m3fn), requires_grad=False)
        self.register_buffer("weight_scale_inv", torch.zeros(-(-rows // 8), -(-cols // 8)))


class _Fp8Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = _Fp8Linear(12, 16)
        self.norm = nn.Linear(16, 1, bias=False)


@pytest.mark.parametrize("loader", ["dcp", "legacy"])
def test_quantized_model_loads_raw(tmp_path, loader):
    """fp8 parameters + scale buffers in the model: the checkpoint's bytes and scales land as stored."""
    w = torch.randn(12, 16)
    q, s = qc.fp8_block_quantize(w, (8, 8))
    norm = torch.randn(1, 16)
    save_file({"proj.weight": q, "proj.weight_scale_inv": s, "norm.weight": norm}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(
        '{"quantization_config": {"quant_method": "fp8", "weight_block_size": [8, 8]}}'
    )
    model = _Fp8Model()
    report = hf.load(model, tmp_path, loader=loader)
    assert not report.missing_keys and not report.unexpected_keys
    assert torch.equal(model.proj.weight.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(model.proj.weight_scale_inv, s)
    assert torch.equal(model.norm.weight, norm)


def test_dcp_reader_refuses_quantized_into_float(checkpoints, monkeypatch):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from hp_fastload.api.dcp import HuggingFaceStorageReader

    root, _, _, key = checkpoints["deepseek_fp8_block"]
    file = load_file(str(root / "model.safetensors"))
    state = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in file.items() if k == key}
    _no_reads(monkeypatch)
    with pytest.raises(CheckpointException) as info:  # dcp.load wraps the reader's errors, per rank
        dcp.load(state, storage_reader=HuggingFaceStorageReader(root), no_dist=True)
    failures = [f[0] if isinstance(f, tuple) else f for f in info.value.failures.values()]
    assert failures and all(isinstance(f, QuantizationError) and key in str(f) for f in failures)
    assert not state[key].any()
    monkeypatch.undo()
    # the same tensor into its own dtype, and its scale, load raw
    raw = {
        key: torch.zeros(file[key].shape, dtype=file[key].dtype),
        key + "_scale_inv": torch.zeros(file[key + "_scale_inv"].shape),
    }
    dcp.load(raw, storage_reader=HuggingFaceStorageReader(root), no_dist=True)
    assert torch.equal(raw[key].view(torch.uint8), file[key].view(torch.uint8))
    assert torch.equal(raw[key + "_scale_inv"], file[key + "_scale_inv"])


def test_bulk_dtype_query_matches_safetensors(tmp_path):
    """``CheckpointIndex.keys_not_stored_as`` (what detection asks instead of locating every key) gives the
    indexed keys whose dtype, as safetensors itself reads it, is not one of the names; a header tensor the
    index's weight_map leaves out is not among them."""
    import json

    from safetensors import safe_open

    shards = {
        "a.safetensors": {
            "a.w": torch.zeros(4, 4).to(torch.float8_e4m3fn),
            "a.s": torch.ones(1, 1),
            "stray": torch.zeros(3, dtype=torch.int8),  # in the header, not in the weight_map
        },
        "b.safetensors": {
            "b.w": torch.zeros(2, 2, dtype=torch.bfloat16),
            "b.q": torch.zeros(2, dtype=torch.int32),
            "b.m": torch.zeros(2, dtype=torch.bool),
            "b.h": torch.zeros(2, dtype=torch.float16),
        },
    }
    weight_map = {}
    for name, tensors in shards.items():
        save_file(tensors, str(tmp_path / name))
        weight_map.update({k: name for k in tensors if k != "stray"})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    stored = {}
    for name in shards:
        with safe_open(str(tmp_path / name), "pt") as f:
            stored.update({k: f.get_slice(k).get_dtype() for k, where in weight_map.items() if where == name})
    index = CheckpointIndex.open(tmp_path)
    for names in ({"F16", "BF16", "F32", "F64"}, {"BF16"}, set()):
        got = index.keys_not_stored_as(names)
        assert len(got) == len(set(got))
        assert set(got) == {k for k, dtype in stored.items() if dtype not in names}
