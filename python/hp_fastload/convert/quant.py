"""Quantized sources as records: what a dequantizing read item carries (``Dequant``: the scale tensor, its
block shape and format), the bytes a quantized source occupies (``source_nbytes``), the MXFP4 layout as a
symbolic region and its torch reference (``mxfp4_region`` / ``mxfp4_dequantize``) and the supported formats
(``errors.QuantizationError`` refuses the others; the float dtypes' safetensors names are ``formats.FLOAT_NAMES``).

Detection (which checkpoint tensors are quantized, in what format) is ``convert.detect``; its results are the
types of ``convert.quant_info``. Nothing quantized is ever plain-cast into a float target.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from hp_fastload.errors import QuantizationError

#: What a float target can receive from a quantized checkpoint.
SUPPORTED = (
    "dequantized into float16/bfloat16/float32/float64 targets: fp8 (e4m3, e5m2) weights with per-block "
    "weight_scale_inv (block from quantization_config.weight_block_size, default 128x128; ragged last blocks), "
    "per-tensor or per-channel weight_scale; scales fp32, bf16, fp16 or e8m0; MXFP4 (gpt-oss *_blocks of e2m1 "
    "pairs with e8m0 *_scales, into the transposed stacked-experts tensor). A model that keeps the quantized "
    "tensors (parameters of the checkpoint's dtype, its scales as parameters or buffers) loads them raw"
)


FLOATS = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))


FP8 = frozenset((torch.float8_e4m3fn, torch.float8_e5m2))


SCALE_DTYPES = frozenset((torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.float8_e8m0fnu))


DEFAULT_BLOCK = (128, 128)


MXFP4_FORMAT = "MXFP4 (e2m1 blocks, e8m0 scales)"


#: the e2m1 value of each 4-bit code (OCP MX spec)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


#: The leaf dtype of an MXFP4 region (``mxfp4_region``): its elements are the 4-bit e2m1 codes, two a byte
#: of the stored uint8 ``*_blocks`` (low nibble first), as the engine reads them.
MXFP4_LEAF_DTYPE = torch.float4_e2m1fn_x2


def source_nbytes(numel: int, dtype: torch.dtype, dequantized: bool) -> int:
    """Bytes ``numel`` elements of a checkpoint tensor of ``dtype`` take: a dequantized uint8 tensor is MXFP4
    ``*_blocks``, whose elements are the 4-bit codes (two a byte)."""
    if dequantized and dtype in (torch.uint8, MXFP4_LEAF_DTYPE):
        return (numel + 1) // 2
    return numel * dtype.itemsize


def mxfp4_region(blocks: str, scales: str, shape: Sequence[int]) -> tuple[Any, Dequant]:
    """The dequantized layout of MXFP4 ``blocks`` ``[E, Y, G, 16]`` as a region, and its scale: the logical
    tensor ``[E, Y, G * 32]`` of 4-bit elements (element ``j`` of a row is nibble ``j % 2`` of byte ``j // 2``,
    low first, as ``convert_moe_packed_tensors`` unpacks them), dims 1 and 2 swapped as its caller does
    (``[E, G * 32, Y]``); each element's scale is ``scales[e, y, j // 32]`` (blocks ``[1, 1, 32]``)."""
    from hp_fastload.convert.symbolic import RegionTensor

    *prefix, rows, groups, width = (int(n) for n in shape)
    logical = (*prefix, rows, groups * width * 2)
    region = RegionTensor.leaf(blocks, logical, MXFP4_LEAF_DTYPE).transpose(1, 2)
    return region, Dequant(scales, logical, (1,) * (len(logical) - 1) + (width * 2,))


def mxfp4_group(name: str, blocks: str, scales: str, sources: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: mxfp4_dequantize(sources[blocks], sources[scales])}


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 ``*_blocks`` ``[..., Y, G, 16]`` (two e2m1 codes a byte, low nibble first) and e8m0 ``*_scales``
    ``[..., Y, G]`` -> float32 ``[..., G * 32, Y]``: each value ``e2m1 * 2^(e - 127)`` (exact in float32),
    laid out as transformers' ``convert_moe_packed_tensors`` does (groups joined along the last dim, then
    dims 1 and 2 swapped)."""
    if blocks.dtype != torch.uint8 or scales.dtype not in (torch.uint8, torch.float8_e8m0fnu):
        raise QuantizationError(f"MXFP4 needs uint8 blocks and e8m0 scales, got {blocks.dtype} and {scales.dtype}")
    if tuple(blocks.shape[:-1]) != tuple(scales.shape) or blocks.dim() < 3:
        raise QuantizationError(f"MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)}")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)
    values = values.reshape(*blocks.shape[:-1], blocks.shape[-1] * 2)
    exponents = scales.view(torch.uint8).to(torch.int32) - 127
    values = torch.ldexp(values, exponents.unsqueeze(-1))
    *prefix, groups, width = values.shape
    return values.reshape(*prefix, groups * width).transpose(1, 2).contiguous()


class Dequant(NamedTuple):
    """How the engine dequantizes one checkpoint tensor: the scale tensor, the quantized tensor's storage
    shape and the block of elements each scale covers (the grid is ``ceil(shape / block)``)."""

    scale: str
    shape: tuple[int, ...]
    block: tuple[int, ...]


BLOCK_FP8 = "block-scaled fp8 (weight_scale_inv)"
