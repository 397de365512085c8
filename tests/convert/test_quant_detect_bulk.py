"""Quantization detection in bulk (issue 12): the block-fp8 tensors a checkpoint marks with ``X_scale_inv``
are found by C-level passes over the names and held as one bulk set, each record made when planning asks for
it; any other companion sends the scan through the per-key path. What is detected, in what order, and the
refusals and their messages are the same on both paths.

The checkpoints are written with safetensors' ``save_file`` (and a tiny transformers model's
``save_pretrained``); the expected records are spelled from the names and shapes safetensors reads back.
"""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import hp_fastload as hf
from hp_fastload.convert.detect import detect_in_index
from hp_fastload.source.index import CheckpointIndex
from tests.helpers import quant_checkpoints as qc

FP8 = torch.float8_e4m3fn
BLOCK = "block-scaled fp8 (weight_scale_inv)"


def _write(root: Path, tensors: dict[str, torch.Tensor], quantization_config: dict | None = None) -> Path:
    save_file(tensors, str(root / "model.safetensors"))
    config: dict = {"model_type": "llama"}
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (root / "config.json").write_text(json.dumps(config))
    return root


def _record(quant, key: str) -> tuple:
    q = quant.tensors[key]
    return q.method, q.fmt, q.companions, q.dequantized


def test_block_fp8_is_held_in_bulk_and_resolved_when_asked(tmp_path):
    """Only scales whose value the checkpoint has mark a quantized tensor (an orphan scale does not; a scale
    of a scale does), listed in the checkpoint's order; no per-tensor record or layout exists until one is
    asked for, and then only that one."""
    _write(
        tmp_path,
        {
            "a.weight": torch.zeros(4, 4).to(FP8),
            "a.weight_scale_inv": torch.ones(1, 1),
            "c.weight": torch.zeros(4, 4).to(FP8),
            "c.weight_scale_inv": torch.ones(1, 1),
            "c.weight_scale_inv_scale_inv": torch.ones(1, 1),
            "orphan.weight_scale_inv": torch.ones(1, 1),
            "norm.weight": torch.ones(4),
        },
    )
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    index = CheckpointIndex.open(tmp_path)
    quant = detect_in_index(index)
    assert not quant.tensors._found and not quant.tensors.built()  # nothing made per tensor at detection
    expected = [k[: -len("_scale_inv")] for k in index if k.endswith("_scale_inv") and k[:-10] in names]
    assert expected == ["a.weight", "c.weight", "c.weight_scale_inv"]
    assert bool(quant) and list(quant.tensors) == expected and len(quant.tensors) == 3
    assert "orphan.weight" not in quant.tensors and "norm.weight" not in quant.tensors
    assert quant.tensors.record("orphan.weight") is None
    assert quant.companions == {k + "_scale_inv" for k in expected}
    assert _record(quant, "c.weight") == ("fp8", BLOCK, ("c.weight_scale_inv",), "c.weight")
    assert quant.tensors.built() == ["c.weight"]
    dequant = quant.tensors["a.weight"].dequant
    assert dequant is not None and (dequant.scale, dequant.shape, dequant.block) == (
        "a.weight_scale_inv",
        (4, 4),
        (128, 128),
    )


def test_a_lazily_resolved_scale_of_the_wrong_grid_is_refused_naming_it(tmp_path):
    """One weight's scale grid short of a row: planning (which resolves only the layouts it reads) refuses
    it with the message naming the weight, its scale, the grid and the block, before any byte is read."""
    model = qc.build_model("llama")
    tensors = qc.quantize_fp8_block(qc.released(model, tmp_path), (4, 8))
    key = "model.layers.1.mlp.down_proj.weight"
    tensors[key + "_scale_inv"] = tensors[key + "_scale_inv"][:-1].contiguous()
    qc.rewrite(tmp_path, tensors, dict(qc.FP8_CONFIG, weight_block_size=[4, 8]))
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        shape, scale_shape = tuple(f.get_slice(key).get_shape()), tuple(f.get_slice(key + "_scale_inv").get_shape())
    grid = (math.ceil(shape[0] / 4), math.ceil(shape[1] / 8))
    expected = (
        f"{key} is quantized (fp8, {BLOCK}; companions: {key}_scale_inv) and would be converted into {key} "
        f"(torch.bfloat16) ({key}_scale_inv has shape {scale_shape}, not the grid {grid} of blocks (4, 8) over "
        f"{shape}); it is never cast raw into a float tensor. Supported: "
    )
    for call in (hf.plan, hf.load):
        with pytest.raises(hf.QuantizationError, match=re.escape(expected)):
            call(copy.deepcopy(model), tmp_path)


def test_another_companion_takes_the_per_key_scan(tmp_path):
    """A weight with both a weight_scale and a weight_scale_inv is one tensor of several scale companions
    (the format first in the checkpoint's order, not dequantized); a plain block-fp8 weight beside it is
    found as on the bulk path."""
    _write(
        tmp_path,
        {
            "a.weight": torch.zeros(4, 4).to(FP8),
            "a.weight_scale": torch.ones(1),
            "a.weight_scale_inv": torch.ones(1, 1),
            "b.weight": torch.zeros(4, 4).to(FP8),
            "b.weight_scale_inv": torch.ones(1, 1),
        },
    )
    quant = detect_in_index(CheckpointIndex.open(tmp_path))
    assert list(quant.tensors) == ["a.weight", "b.weight"]
    a = quant.tensors["a.weight"]
    assert (a.fmt, a.companions) == (
        "fp8 with a per-tensor or per-channel weight_scale",
        ("a.weight_scale", "a.weight_scale_inv"),
    )
    assert a.dequant is None and a.why == "a.weight has several scale companions"
    assert _record(quant, "b.weight") == ("fp8", BLOCK, ("b.weight_scale_inv",), "b.weight")
    assert quant.tensors["b.weight"].dequant is not None


def test_config_scan_passes_over_the_bulk_tensors_and_their_scales(tmp_path):
    """Under a quantization_config the non-float tensors are quantized, except the block-fp8 weights (found by
    their scales) and those scales themselves (an e8m0 scale is stored as uint8), and index buffers."""
    _write(
        tmp_path,
        {
            "a.weight": torch.zeros(8, 8).to(FP8),
            "a.weight_scale_inv": torch.full((2, 2), 127, dtype=torch.uint8),
            "i.weight": torch.zeros(4, 4, dtype=torch.int8),
            "idx": torch.zeros(3, dtype=torch.int64),
            "norm.weight": torch.ones(4),
        },
        {"quant_method": "fp8", "weight_block_size": [4, 4]},
    )
    quant = detect_in_index(CheckpointIndex.open(tmp_path))
    assert list(quant.tensors) == ["a.weight", "i.weight"]
    assert _record(quant, "a.weight") == ("fp8", BLOCK, ("a.weight_scale_inv",), "a.weight")
    assert _record(quant, "i.weight") == ("fp8", "torch.int8 under quantization_config", (), "i.weight")
    assert quant.companions == {"a.weight_scale_inv"}


def test_bulk_values_paired_in_rust_equal_the_sliced_names():
    """``BlockScales.values`` pairs each scale with its value in Rust (the neighbour in natural order, else a
    table of every name): the same values, in the same order, as slicing each scale name and asking the
    checkpoint's keys; each value is the keys' own string object."""
    from hp_fastload.convert.quant_info import BlockScales
    from hp_fastload.source.natural import natural_sorted

    names = ["a.weight", "a.weight_scale_inv", "b.weight", "b.weight.x", "b.weight_scale_inv", "orphan_scale_inv"]
    names += ["_scale_inv", "c.w_scale_inv_scale_inv", "c.w_scale_inv", "c.w", "d.w_scale_inv", "z.d.w"]
    names += [f"l.{i}.w" for i in range(30)] + [f"l.{i}.w_scale_inv" for i in range(0, 30, 3)]
    keys = natural_sorted(names)  # ("b.weight.x" sorts between b.weight and its scale: the table's case)
    scales = [k for k in keys if k.endswith("_scale_inv")]
    paired = BlockScales(scales, set(keys), "fp8", keys).values()
    sliced = BlockScales(scales, set(keys), "fp8").values()
    assert paired == sliced and len(paired) == 14
    assert all(any(v is k for k in keys) for v in paired)
