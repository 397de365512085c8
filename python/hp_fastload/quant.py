"""Quantized checkpoints: which checkpoint tensors are quantized, in what format, and the refusal.

Owns: reading a checkpoint's ``quantization_config`` (``config.json`` next to its files), recognising the
quantized tensors of a checkpoint by their companions (``weight_scale_inv`` per block, ``weight_scale`` per
tensor or channel, MXFP4 ``*_blocks`` + ``*_scales``, GPTQ/AWQ ``qweight``, bitsandbytes ``absmax`` / ``SCB``,
NVFP4 ``weight_scale_2`` / ``weight_global_scale``, compressed-tensors ``weight_packed``) or by the config
(a non-float tensor the config covers, its exclusion lists honoured), and the rule that nothing quantized is
ever plain-cast into a float target: planning calls :func:`check_claim` for every claimed target and
:func:`check_missing` before the strict check, and raises :class:`QuantizationError` naming the method, the
tensor and what is supported. A model that keeps the quantized tensors themselves (an fp8 parameter of the
checkpoint's dtype, its scales as parameters or buffers) loads them raw. Planning only: no bytes are read here.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from .errors import PlanError

__all__ = ["Dequant", "QuantInfo", "QuantTensor", "QuantizationError", "detect", "detect_in_index", "read_quant_config"]

#: What a float target can receive from a quantized checkpoint.
SUPPORTED = (
    "dequantized into float16/bfloat16/float32/float64 targets: fp8 (e4m3, e5m2) weights with per-block "
    "weight_scale_inv (block from quantization_config.weight_block_size, default 128x128; ragged last blocks), "
    "per-tensor or per-channel weight_scale; scales fp32, bf16, fp16 or e8m0; MXFP4 (gpt-oss *_blocks of e2m1 "
    "pairs with e8m0 *_scales, into the transposed stacked-experts tensor). A model that keeps the quantized "
    "tensors (parameters of the checkpoint's dtype, its scales as parameters or buffers) loads them raw"
)

_FLOATS = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))
_FP8 = frozenset((torch.float8_e4m3fn, torch.float8_e5m2))
_SCALE_DTYPES = frozenset((torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.float8_e8m0fnu))
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
    from .region import RegionTensor

    *prefix, rows, groups, width = (int(n) for n in shape)
    logical = (*prefix, rows, groups * width * 2)
    region = RegionTensor.leaf(blocks, logical, MXFP4_LEAF_DTYPE).transpose(1, 2)
    return region, Dequant(scales, logical, (1,) * (len(logical) - 1) + (width * 2,))


def _mxfp4_group(name: str, blocks: str, scales: str, sources: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
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


class QuantizationError(PlanError):
    """A quantized checkpoint tensor would land in a target that cannot take it as stored (a float model
    without a supported dequantization): refused at planning, before any byte is read."""


@dataclass(frozen=True)
class QuantTensor:
    """One quantized checkpoint tensor: ``key`` holds the packed values, ``companions`` its scales (and the
    format's other side tensors), ``dequantized`` the name the dequantized tensor has in a float model."""

    key: str
    method: str
    fmt: str
    companions: tuple[str, ...]
    dequantized: str
    dequant: Dequant | None = None  # None: not dequantized by hp_fastload
    why: str = ""  # why not, when dequant is None


@dataclass
class QuantInfo:
    """The quantized tensors of one checkpoint (see :func:`detect`)."""

    method: str | None  # the config's quant_method, None without one
    config: dict[str, Any] | None
    tensors: dict[str, QuantTensor]  # value key -> its description
    companions: frozenset[str]

    def __bool__(self) -> bool:
        return bool(self.tensors)

    dequantized: dict[str, Dequant] = field(default_factory=dict)  # keys planned as dequantizing reads
    fallback_keys: set[str] = field(default_factory=set)  # sources of the torch-dequantized groups

    def refuse(self, q: QuantTensor, why: str) -> QuantizationError:
        detail = f" ({q.why})" if q.why else ""
        return QuantizationError(
            f"{q.key} is quantized ({q.method}, {q.fmt}; companions: {', '.join(q.companions) or 'none'}) "
            f"and {why}{detail}; it is never cast raw into a float tensor. Supported: {SUPPORTED}"
        )

    def check_claim(self, target_name: str, target_dtype: torch.dtype, sources: Iterable[str], dtype_of: Any) -> None:
        """A quantized source converted into ``target_name``: the same dtype loads raw, a float target of a
        supported format is dequantized (recorded in ``dequantized``), anything else raises."""
        for key in sources:
            q = self.tensors.get(key)
            if q is None or dtype_of(key) == target_dtype:
                continue
            if q.dequant is not None and target_dtype in _FLOATS:
                self.dequantized[key] = q.dequant
                continue
            raise self.refuse(q, f"would be converted into {target_name} ({target_dtype})")

    def consumed(self) -> set[str]:
        """The companions of the dequantized tensors (read with them, so not unexpected)."""
        return {c for k in self.dequantized for c in self.tensors[k].companions} | self.fallback_keys

    def _missing_target(self, q: QuantTensor, missing: Collection[str]) -> str | None:
        for name in missing:
            if name == q.dequantized or name.endswith("." + q.dequantized) or q.dequantized.endswith("." + name):
                return name
        return None

    def fallbacks(
        self,
        missing: Collection[str],
        unclaimed: Collection[str],
        dtype_of_target: Callable[[str], torch.dtype],
        shape_of: Callable[[str], Sequence[int]],
    ) -> list[tuple[str, list[str], Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]], tuple[int, ...]]]:
        """Formats dequantized with torch on whole tensors (MXFP4 ``*_blocks`` + ``*_scales`` into a float
        model tensor of the dequantized name): ``(target name, source keys, compute, output shape)`` for each,
        to plan as a deferred group. The sources are then consumed (see ``consumed``)."""
        out: list[
            tuple[str, list[str], Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]], tuple[int, ...]]
        ] = []
        for key in unclaimed:
            q = self.tensors.get(key)
            if q is None or q.fmt != MXFP4_FORMAT or len(q.companions) != 1 or key in self.fallback_keys:
                continue
            name = self._missing_target(q, missing)
            if name is None or dtype_of_target(name) not in _FLOATS:
                continue
            blocks, scales = q.key, q.companions[0]
            compute = functools.partial(_mxfp4_group, name, blocks, scales)
            shape = tuple(int(n) for n in shape_of(blocks))
            if len(shape) < 4:
                raise self.refuse(q, f"its blocks have shape {shape}, not [..., rows, groups, 16]")
            out.append((name, [blocks, scales], compute, (*shape[:-3], shape[-2] * shape[-1] * 2, shape[-3])))
            self.fallback_keys.update((blocks, scales))
        return out

    def packed_regions(
        self,
        missing: Collection[str],
        unclaimed: Collection[str],
        dtype_of_target: Callable[[str], torch.dtype],
        shape_of: Callable[[str], Sequence[int]],
        dtype_of: Callable[[str], torch.dtype],
    ) -> list[tuple[str, Any]]:
        """MXFP4 ``*_blocks`` + ``*_scales`` into a float model tensor of the dequantized name, read on the
        region path (``mxfp4_region``; the engine dequantizes them in its copy pass): ``(target name,
        region)`` for each. Their sources are then consumed and left out of ``fallbacks``."""
        out: list[tuple[str, Any]] = []
        for key in unclaimed:
            q = self.tensors.get(key)
            if q is None or q.fmt != MXFP4_FORMAT or len(q.companions) != 1 or key in self.fallback_keys:
                continue
            name = self._missing_target(q, missing)
            if name is None or dtype_of_target(name) not in _FLOATS:
                continue
            shape = tuple(int(n) for n in shape_of(key))
            scale = q.companions[0]
            if len(shape) < 4 or shape[-1] != 16:
                raise self.refuse(q, f"its blocks have shape {shape}, not [..., rows, groups, 16]")
            if tuple(shape_of(scale)) != shape[:-1]:
                raise self.refuse(q, f"its scales {scale} have shape {tuple(shape_of(scale))}, not {shape[:-1]}")
            if dtype_of(key) != torch.uint8 or dtype_of(scale) not in (torch.uint8, torch.float8_e8m0fnu):
                raise self.refuse(q, f"it is {dtype_of(key)} with {dtype_of(scale)} scales, not uint8 with e8m0")
            region, spec = mxfp4_region(key, scale, shape)
            self.dequantized[key] = spec
            self.fallback_keys.update((key, q.companions[0]))
            out.append((name, region))
        return out

    def check_missing(self, missing: Collection[str], unclaimed: Collection[str]) -> None:
        """Raise when a quantized tensor was not claimed and a model tensor of its dequantized name is missing
        (a float model whose weight the checkpoint ships packed, e.g. MXFP4 ``*_blocks``, GPTQ ``qweight``)."""
        if not missing:
            return
        for key in unclaimed:
            q = self.tensors.get(key)
            if q is None:
                continue
            name = self._missing_target(q, missing)
            if name is not None:
                raise self.refuse(q, f"the model expects it as {name}")


def read_quant_config(directory: str | Path) -> dict[str, Any] | None:
    """The ``quantization_config`` of ``directory/config.json`` (or its ``compression_config``), or None."""
    from .index import read_regular_file

    try:
        raw = read_regular_file(Path(directory) / "config.json")  # a FIFO there is refused, never read
    except OSError:
        return None
    if raw is None:
        return None
    try:
        config = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(config, dict):
        return None
    quant = config.get("quantization_config") or config.get("compression_config")
    if isinstance(quant, dict):
        return quant
    text_config = config.get("text_config")
    if isinstance(text_config, dict) and isinstance(text_config.get("quantization_config"), dict):
        return dict(text_config["quantization_config"])
    return None


def _exclusions(config: Mapping[str, Any]) -> list[str]:
    out: list[str] = []
    for name in ("modules_to_not_convert", "ignored_layers", "ignore", "exclude_modules", "llm_int8_skip_modules"):
        value = config.get(name)
        if isinstance(value, str):
            out.append(value)
        elif isinstance(value, list):
            out.extend(str(v) for v in value)
    return out


def _excluded(module: str, patterns: list[str]) -> bool:
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], module):
                return True
        elif module == pattern or pattern in module.split(".") or module.endswith("." + pattern) or pattern in module:
            return True
    return False


def _module(key: str) -> str:
    return key.rpartition(".")[0]


def detect(
    keys: Iterable[str],
    dtype_of: Callable[[str], torch.dtype],
    config: Mapping[str, Any] | None,
    shape_of: Callable[[str], Sequence[int]] | None = None,
) -> QuantInfo:
    """The quantized tensors among ``keys`` (``dtype_of(key)`` / ``shape_of(key)`` give a key's stored dtype
    and shape; without ``shape_of`` nothing is dequantized)."""
    keys = list(keys)
    present = set(keys)
    method_of_config = str(config.get("quant_method") or config.get("format") or "") if config else ""
    method = method_of_config or None
    tensors: dict[str, QuantTensor] = {}
    companions: set[str] = set()

    def add(
        key: str,
        default_method: str,
        fmt: str,
        comps: Iterable[str],
        dequantized: str | None = None,
        spec: tuple[Dequant | None, str] = (None, ""),
    ) -> None:
        comps = tuple(c for c in comps if c in present)
        how, why = spec
        if key in tensors:  # a second companion: the format is not one the engine dequantizes
            comps = tuple(dict.fromkeys(tensors[key].companions + comps))
            fmt = tensors[key].fmt
            how, why = None, f"{key} has several scale companions"
        if how is None and not why:
            why = "not dequantized by hp_fastload"
        tensors[key] = QuantTensor(key, method or default_method, fmt, comps, dequantized or key, how, why)
        companions.update(comps)

    shapes = shape_of
    block_size = config.get("weight_block_size") if config else None

    layouts: dict[tuple[Any, ...], tuple[tuple[int, ...], tuple[int, ...]] | str] = {}

    def layout(
        vdtype: torch.dtype, sdtype: torch.dtype, shape: tuple[int, ...], sshape: tuple[int, ...], kind: str
    ) -> tuple[tuple[int, ...], tuple[int, ...]] | str:
        """``(shape, block)`` of a dequantization, or why not (``{value}`` / ``{scale}`` name the tensors):
        the same for every tensor of one signature (all experts of a layer share it), so computed once."""
        if vdtype not in _FP8:
            return f"{{value}} is {vdtype}, not an fp8 dtype"
        if sdtype not in _SCALE_DTYPES:
            return f"{{scale}} is {sdtype}"
        if kind == "block":
            if len(shape) < 1:
                return "{value} is 0-d"
            raw = block_size if block_size is not None else DEFAULT_BLOCK
            if not isinstance(raw, (list, tuple)) or not all(isinstance(b, int) and b > 0 for b in raw):
                return f"weight_block_size {raw!r} is not a list of positive ints"
            tail = tuple(int(b) for b in raw)[-len(shape) :]
            block = (1,) * (len(shape) - len(tail)) + tail
            grid = tuple(-(-n // b) for n, b in zip(shape, block, strict=True))
            if tuple(sshape) != grid:
                return f"{{scale}} has shape {sshape}, not the grid {grid} of blocks {block} over {shape}"
            return shape, block
        if math.prod(sshape) == 1:  # per tensor
            return shape, shape or ()
        if len(shape) == 2 and sshape in ((shape[0], 1), (shape[0],)):  # per output channel
            return shape, (1, shape[1])
        if block_size is not None:
            return layout(vdtype, sdtype, shape, sshape, "block")
        return f"{{scale}} has shape {sshape}: neither per-tensor nor per-channel over {shape}"

    def spec(value: str, scale: str, kind: str) -> tuple[Dequant | None, str]:
        """The engine's dequantization of ``value`` by ``scale`` (``kind``: block, tensor or channel)."""
        if shapes is None:
            return None, "shapes unknown"
        shape, sshape = tuple(shapes(value)), tuple(shapes(scale))
        signature = (dtype_of(value), dtype_of(scale), shape, sshape, kind)
        found = layouts.get(signature)
        if found is None:
            found = layouts[signature] = layout(*signature)
        if isinstance(found, str):
            return None, found.replace("{value}", value).replace("{scale}", scale)
        return Dequant(scale, *found), ""

    for key in keys:
        if key.endswith("_scale_inv"):
            value = key[: -len("_scale_inv")]
            if value in present:
                add(value, "fp8", "block-scaled fp8 (weight_scale_inv)", [key], spec=spec(value, key, "block"))
        elif key.endswith("_blocks"):
            stem = key[: -len("_blocks")]
            if stem + "_scales" in present:
                add(key, "mxfp4", MXFP4_FORMAT, [stem + "_scales"], stem, (None, "dequantized only as gpt-oss experts"))
        elif key.endswith(".weight_scale"):
            module = _module(key)
            if module + ".weight_packed" in present:
                add(
                    module + ".weight_packed",
                    "compressed-tensors",
                    "packed int4/fp4 (weight_packed)",
                    [key, module + ".weight_shape", module + ".weight_zero_point", module + ".weight_global_scale"],
                    module + ".weight",
                )
            elif module + ".weight" in present:
                value = module + ".weight"
                if dtype_of(value) == torch.uint8 or module + ".weight_scale_2" in present:
                    add(value, "modelopt", "NVFP4 (weight_scale, weight_scale_2)", [key, module + ".weight_scale_2"])
                else:
                    how = spec(value, key, "scale")
                    add(value, "fp8", "fp8 with a per-tensor or per-channel weight_scale", [key], spec=how)
        elif key.endswith(".qweight"):
            module = _module(key)
            add(
                key,
                "gptq/awq",
                "int4 packed (qweight, qzeros, scales)",
                [module + ".qzeros", module + ".scales", module + ".g_idx"],
                module + ".weight",
            )
        elif key.endswith((".weight.absmax", ".weight.quant_map", ".SCB")) or ".weight.quant_state." in key:
            module = key.split(".weight.", 1)[0] if ".weight." in key else _module(key)
            if module + ".weight" in present:
                add(module + ".weight", "bitsandbytes", "bitsandbytes 4-bit / 8-bit", [key])
        elif key.endswith(".weight_global_scale"):
            module = _module(key)
            if module + ".weight" in present:
                add(module + ".weight", "nvfp4", "NVFP4 (weight_global_scale)", [key])
    if config is not None and method_of_config:
        exclusions = _exclusions(config)
        for key in keys:
            if key in tensors or key in companions or dtype_of(key) in _FLOATS:
                continue
            if dtype_of(key) in (torch.bool, torch.int64):  # index buffers (position ids), never quantized
                continue
            if not _excluded(_module(key), exclusions):
                add(key, method_of_config, f"{dtype_of(key)} under quantization_config", [])
    return QuantInfo(method, dict(config) if config is not None else None, tensors, frozenset(companions))


def detect_in_index(index: Any) -> QuantInfo:
    """:func:`detect` over a ``CheckpointIndex``, with the ``config.json`` next to its first file."""
    config = read_quant_config(Path(index.files[0].path).parent) if index.files else None
    keys = list(index)
    entries = dict(zip(keys, index.locate_many(keys), strict=True))  # every key's header facts, in bulk

    def dtype_of(key: str) -> torch.dtype:
        return entries[key].dtype

    def shape_of(key: str) -> tuple[int, ...]:
        return entries[key].shape

    return detect(keys, dtype_of, config, shape_of)
