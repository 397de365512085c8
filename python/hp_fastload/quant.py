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

import json
import re
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import PlanError

__all__ = ["QuantInfo", "QuantTensor", "QuantizationError", "detect", "read_quant_config"]

#: What a float target can receive from a quantized checkpoint today.
SUPPORTED = (
    "a model that keeps the quantized tensors (parameters of the checkpoint's dtype, with their scales as "
    "parameters or buffers) loads them raw; dequantizing into a float model is not supported for this format"
)

_FLOATS = frozenset(
    d
    for d in (
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
    )
)


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


@dataclass
class QuantInfo:
    """The quantized tensors of one checkpoint (see :func:`detect`)."""

    method: str | None  # the config's quant_method, None without one
    config: dict[str, Any] | None
    tensors: dict[str, QuantTensor]  # value key -> its description
    companions: frozenset[str]

    def __bool__(self) -> bool:
        return bool(self.tensors)

    def refuse(self, q: QuantTensor, why: str) -> QuantizationError:
        return QuantizationError(
            f"{q.key} is quantized ({q.method}, {q.fmt}; companions: {', '.join(q.companions) or 'none'}) "
            f"and {why}; it is never cast raw into a float tensor. Supported: {SUPPORTED}"
        )

    def check_claim(self, target_name: str, target_dtype: torch.dtype, sources: Iterable[str], dtype_of: Any) -> None:
        """Raise when a quantized source would be converted into ``target_name`` of another dtype."""
        for key in sources:
            q = self.tensors.get(key)
            if q is not None and dtype_of(key) != target_dtype:
                raise self.refuse(q, f"would be converted into {target_name} ({target_dtype})")

    def check_missing(self, missing: Collection[str], unclaimed: Collection[str]) -> None:
        """Raise when a quantized tensor was not claimed and a model tensor of its dequantized name is missing
        (a float model whose weight the checkpoint ships packed, e.g. MXFP4 ``*_blocks``, GPTQ ``qweight``)."""
        if not missing:
            return
        for key in unclaimed:
            q = self.tensors.get(key)
            if q is None:
                continue
            for name in missing:
                if name == q.dequantized or name.endswith("." + q.dequantized) or q.dequantized.endswith("." + name):
                    raise self.refuse(q, f"the model expects it as {name}")


def read_quant_config(directory: str | Path) -> dict[str, Any] | None:
    """The ``quantization_config`` of ``directory/config.json`` (or its ``compression_config``), or None."""
    path = Path(directory) / "config.json"
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return None
    try:
        config = json.loads(text)
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


def detect(keys: Iterable[str], dtype_of: Callable[[str], torch.dtype], config: Mapping[str, Any] | None) -> QuantInfo:
    """The quantized tensors among ``keys`` (``dtype_of(key)`` gives a key's stored dtype)."""
    keys = list(keys)
    present = set(keys)
    method_of_config = str(config.get("quant_method") or config.get("format") or "") if config else ""
    method = method_of_config or None
    tensors: dict[str, QuantTensor] = {}
    companions: set[str] = set()

    def add(key: str, default_method: str, fmt: str, comps: Iterable[str], dequantized: str | None = None) -> None:
        comps = tuple(c for c in comps if c in present)
        if key in tensors:
            comps = tuple(dict.fromkeys(tensors[key].companions + comps))
            fmt = tensors[key].fmt
        tensors[key] = QuantTensor(key, method or default_method, fmt, comps, dequantized or key)
        companions.update(comps)

    for key in keys:
        if key.endswith("_scale_inv"):
            value = key[: -len("_scale_inv")]
            if value in present:
                add(value, "fp8", "block-scaled fp8 (weight_scale_inv)", [key])
        elif key.endswith("_blocks"):
            stem = key[: -len("_blocks")]
            if stem + "_scales" in present:
                add(key, "mxfp4", "MXFP4 (e2m1 blocks, e8m0 scales)", [stem + "_scales"], stem)
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
                    add(value, "fp8", "fp8 with a per-tensor or per-channel weight_scale", [key])
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
    return detect(index, lambda k: index.source(k)[1], config)
