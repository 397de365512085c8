"""Quantized test checkpoints, made as the real ones are laid out: a tiny model's released checkpoint
(transformers ``save_pretrained``) whose linear weights are quantized with plain torch ops and written back
with safetensors ``save_file``, next to a ``config.json`` carrying the ``quantization_config`` the real
models ship. The dequantization references here are the published formulas written with torch ops.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tests.helpers.tiny_models import FAMILIES, model_class

FP8_MAX = 448.0
#: the e2m1 values of the 16 nibbles (as in the OCP MX spec and transformers' FP4_VALUES)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def build_model(family: str, seed: int = 0, dtype: torch.dtype = torch.bfloat16, **overrides: Any) -> Any:
    """A tiny ``family`` model with distinct random values (``overrides`` change its config)."""
    from transformers import AutoConfig

    torch.manual_seed(seed)
    config = AutoConfig.for_model(family, **dict(FAMILIES[family], **overrides))
    model = model_class(family).from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    return model.to(dtype).eval()


def released(model: Any, root: Path) -> dict[str, torch.Tensor]:
    """``model.save_pretrained(root)``; returns the released tensors it wrote."""
    model.save_pretrained(root)
    return load_file(str(root / "model.safetensors"))


def is_linear_weight(key: str, t: torch.Tensor) -> bool:
    """The tensors quantized by FP8 checkpoints: 2-d projection weights (not embeddings, heads, norms, gates)."""
    return (
        key.endswith(".weight")
        and t.dim() == 2
        and "embed" not in key
        and "lm_head" not in key
        and "norm" not in key
        and not key.endswith("mlp.gate.weight")
    )


def fp8_block_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-style block quantization: one fp32 scale per ``block`` (ceil-sized grid, ragged last blocks)."""
    rows, cols = w.shape
    bm, bn = block
    grid = (math.ceil(rows / bm), math.ceil(cols / bn))
    w = w.float()
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale = torch.empty(grid, dtype=torch.float32)
    for i in range(grid[0]):
        for j in range(grid[1]):
            blk = w[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn]
            s = blk.abs().amax().clamp(min=1e-8) / FP8_MAX
            scale[i, j] = s
            q[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn] = (blk / s).to(torch.float8_e4m3fn)
    return q, scale


def weight_dequant(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """DeepSeek's published ``weight_dequant`` with torch ops: ``q * s[i // bm, j // bn]``, in fp32, rounded once."""
    rows, cols = q.shape
    s = scale.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (q.float() * s).to(dtype)


def fp8_channel_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel fp8: ``weight_scale`` of shape ``[rows, 1]``."""
    s = w.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / FP8_MAX
    return (w.float() / s).to(torch.float8_e4m3fn), s


def fp8_tensor_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor fp8: a scalar ``weight_scale``."""
    s = w.float().abs().amax().clamp(min=1e-8) / FP8_MAX
    return (w.float() / s).to(torch.float8_e4m3fn), s.reshape(())


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss MXFP4 of a stacked-experts tensor ``[E, X, Y]`` as the model holds it: the checkpoint keeps
    its transpose ``[E, Y, X]`` in 32-element groups along X, packed two e2m1 nibbles a byte (low nibble
    first) as ``*_blocks`` ``[E, Y, X/32, 16]`` with e8m0 exponents ``*_scales`` ``[E, Y, X/32]``."""
    t = w.float().transpose(1, 2).contiguous()
    e, y, x = t.shape
    groups = t.reshape(e, y, x // 32, 32)
    amax = groups.abs().amax(dim=-1).clamp(min=2.0**-126)
    exp = torch.floor(torch.log2(amax)) - 2  # 6.0 = 1.5 * 2^2 is the largest e2m1
    scaled = groups / torch.exp2(exp).unsqueeze(-1)
    lut = torch.tensor(E2M1)
    codes = (scaled.unsqueeze(-1) - lut).abs().argmin(dim=-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8)


def mxfp4_dequant(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The MXFP4 formula with torch ops: e2m1 LUT of each nibble times 2^(e-127), then transposed back."""
    lut = torch.tensor(E2M1, dtype=torch.float32)
    lo = lut[(blocks & 0x0F).long()]
    hi = lut[(blocks >> 4).long()]
    vals = torch.stack([lo, hi], dim=-1).reshape(*blocks.shape[:-1], 32)
    vals = vals * torch.exp2(scales.float() - 127.0).unsqueeze(-1)
    e, y, g, _ = blocks.shape
    return vals.reshape(e, y, g * 32).transpose(1, 2).contiguous().to(dtype)


def write_config(root: Path, quantization_config: dict[str, Any]) -> None:
    path = root / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"] = quantization_config
    path.write_text(json.dumps(config, indent=2))


def rewrite(root: Path, tensors: dict[str, torch.Tensor], quantization_config: dict[str, Any] | None) -> None:
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(root / "model.safetensors"), metadata={"format": "pt"}
    )
    if quantization_config is not None:
        write_config(root, quantization_config)


def quantize_fp8_block(tensors: dict[str, torch.Tensor], block: tuple[int, int]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        if is_linear_weight(key, t):
            out[key], out[key + "_scale_inv"] = fp8_block_quantize(t, block)
        else:
            out[key] = t
    return out


def quantize_with(
    tensors: dict[str, torch.Tensor], fn: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        if is_linear_weight(key, t):
            out[key], out[key[: -len("weight")] + "weight_scale"] = fn(t)
        else:
            out[key] = t
    return out


FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
COMPRESSED_FP8_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
        }
    },
    "ignore": ["lm_head"],
    "quantization_status": "compressed",
}
FBGEMM_CONFIG = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]}
MXFP4_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}
GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": 8, "desc_act": False, "sym": True}
BNB_CONFIG = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
NVFP4_CONFIG = {"quant_method": "modelopt", "quant_algo": "NVFP4", "exclude_modules": ["lm_head"]}


def gptq_layout(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPTQ/AWQ int4 tensors in place of each linear weight (values are arbitrary: only the layout matters)."""
    out: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        if is_linear_weight(key, t):
            module = key[: -len(".weight")]
            rows, cols = t.shape
            out[module + ".qweight"] = torch.randint(0, 2**31 - 1, (cols // 8, rows), dtype=torch.int32)
            out[module + ".qzeros"] = torch.randint(0, 2**31 - 1, (cols // 8, rows // 8), dtype=torch.int32)
            out[module + ".scales"] = torch.rand(cols // 8, rows, dtype=torch.float16)
            out[module + ".g_idx"] = torch.arange(cols, dtype=torch.int32) // 8
        else:
            out[key] = t
    return out


def bnb_nf4_layout(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """bitsandbytes nf4 tensors: packed uint8 weight plus absmax / quant_map / quant_state."""
    out: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        if is_linear_weight(key, t):
            n = t.numel()
            out[key] = torch.randint(0, 255, (n // 2, 1), dtype=torch.uint8)
            out[key + ".absmax"] = torch.rand(n // 64 or 1)
            out[key + ".quant_map"] = torch.rand(16)
            out[key + ".quant_state.bitsandbytes__nf4"] = torch.zeros(8, dtype=torch.uint8)
        else:
            out[key] = t
    return out


def nvfp4_layout(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """NVIDIA ModelOpt NVFP4: uint8 weight (two e2m1 a byte), fp8 per-16 ``weight_scale``, fp32 ``weight_scale_2``."""
    out: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        if is_linear_weight(key, t):
            rows, cols = t.shape
            module = key[: -len(".weight")]
            out[key] = torch.randint(0, 255, (rows, cols // 2), dtype=torch.uint8)
            out[module + ".weight_scale"] = torch.rand(rows, cols // 16).to(torch.float8_e4m3fn)
            out[module + ".weight_scale_2"] = torch.rand(())
            out[module + ".input_scale"] = torch.rand(())
        else:
            out[key] = t
    return out
