"""Quantization detection: which checkpoint tensors are quantized and in what format, from the checkpoint's
``quantization_config`` (``config.json`` next to its files; its exclusion lists honoured) and the companions
the headers hold (``weight_scale_inv`` per block, ``weight_scale`` per tensor or channel, MXFP4 ``*_blocks`` +
``*_scales``, GPTQ/AWQ ``qweight``, bitsandbytes ``absmax`` / ``SCB``, NVFP4 ``weight_scale_2`` /
``weight_global_scale``, compressed-tensors ``weight_packed``). The result is a ``QuantInfo``
(``convert.quant_info``), which planning asks for every claimed target; nothing here reads tensor bytes.

Detection costs what a rank reads: the companion scan is over names (and the bulk non-float query of
``CheckpointIndex.keys_not_stored_as``), and a tensor's layout is built only for the keys the rank's reads use.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Collection, Container, Iterable, Mapping, Sequence
from itertools import compress, filterfalse, repeat
from typing import Any

import torch

import hp_fastload._core as _core
from hp_fastload.convert.quant import (
    BLOCK_FP8,
    DEFAULT_BLOCK,
    FLOATS,
    FP8,
    MXFP4_FORMAT,
    SCALE_DTYPES,
    Dequant,
)
from hp_fastload.convert.quant_info import SCALE_INV, BlockScales, FoundQuant, QuantInfo, QuantTensors, new_found
from hp_fastload.formats import FLOAT_NAMES
from hp_fastload.source.config import read_quant_config


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


#: The name endings the companion scan looks at (every other key is passed over with one test).
_SCAN_SUFFIXES = (
    "_scale_inv",
    "_blocks",
    ".weight_scale",
    ".qweight",
    ".weight.absmax",
    ".weight.quant_map",
    ".SCB",
    ".weight_global_scale",
)


#: A bitsandbytes 4-bit companion's infix (its name does not end in a fixed suffix).
_QUANT_STATE = ".weight.quant_state."


def _scan_names(keys: list[str]) -> tuple[list[str], bool, tuple[list[str], list[str]] | None]:
    """``(hits, paired, pairs)``: the keys ending with a companion's suffix (``_SCAN_SUFFIXES``), in order;
    whether every one is a ``_scale_inv`` and no key is a bitsandbytes ``quant_state`` (the bulk block-fp8
    path); and then each value present with its scale (``BlockScales``' pairs), else None. One pass in Rust
    (``_core.companion_scan``); in Python for names that are not valid UTF-8 (a lone surrogate)."""
    try:
        hits, paired, values, scales = _core.companion_scan(keys, _SCAN_SUFFIXES, _QUANT_STATE)
    except UnicodeEncodeError:
        hits = list(compress(keys, map(str.endswith, keys, repeat(_SCAN_SUFFIXES))))
        paired = all(map(str.endswith, hits, repeat(SCALE_INV))) and _QUANT_STATE not in "\n".join(keys)
        return hits, paired, None  # (BlockScales slices the scale names for their values)
    return hits, paired, (values, scales) if paired else None


def _method_of(config: Mapping[str, Any] | None) -> str:
    """The config's ``quant_method`` (or ``format``), "" without one: a config scan runs only with one."""
    return str(config.get("quant_method") or config.get("format") or "") if config else ""


def detect(
    keys: Iterable[str],
    dtype_of: Callable[[str], torch.dtype],
    config: Mapping[str, Any] | None,
    shape_of: Callable[[str], Sequence[int]] | None = None,
    nonfloat: Iterable[str] | None = None,
    stored_as: Callable[[Collection[str]], Iterable[str]] | None = None,
    membership: Container[str] | None = None,
) -> QuantInfo:
    """The quantized tensors among ``keys`` (``dtype_of(key)`` / ``shape_of(key)`` give a key's stored dtype
    and shape; without ``shape_of`` nothing is dequantized). ``nonfloat``: the keys whose stored dtype is not
    a float, when the caller has them in bulk (``CheckpointIndex.keys_not_stored_as``); without it the
    ``quantization_config`` scan asks ``dtype_of`` of every key. ``stored_as``: the keys stored as the given
    dtype names, in bulk (``CheckpointIndex.keys_stored_as``), for :meth:`QuantInfo.check_claim` (see
    ``QuantInfo.stored_as``). ``membership``: ``key in membership``
    for exactly the ``keys`` (a ``CheckpointIndex``'s ``membership``), when the caller has one; otherwise a set
    of them is built.

    The scan is over names (a key's companions); a tensor's layout, which needs its and its scale's dtype
    and shape, is computed when its :class:`QuantTensor` is first asked for (see :class:`QuantTensors`)."""
    keys = keys if isinstance(keys, list) else list(keys)
    method_of_config = _method_of(config)
    method = method_of_config or None
    found: dict[str, FoundQuant] = {}
    companions: set[str] = set()

    def add(
        key: str,
        default_method: str,
        fmt: str,
        comps: Iterable[str],
        dequantized: str | None = None,
        kind: str | None = None,
        why: str = "",
    ) -> None:
        comps = tuple(c for c in comps if c in present)
        if key in found:  # a second companion: the format is not one the engine dequantizes
            comps = tuple(dict.fromkeys(found[key].companions + comps))
            fmt = found[key].fmt
            kind, why = None, f"{key} has several scale companions"
        found[key] = new_found(FoundQuant, (method or default_method, fmt, comps, dequantized or key, kind, why))
        companions.update(comps)

    shapes = shape_of
    block_size = config.get("weight_block_size") if config else None

    layouts: dict[tuple[Any, ...], tuple[tuple[int, ...], tuple[int, ...]] | str] = {}

    def layout(
        vdtype: torch.dtype, sdtype: torch.dtype, shape: tuple[int, ...], sshape: tuple[int, ...], kind: str
    ) -> tuple[tuple[int, ...], tuple[int, ...]] | str:
        """``(shape, block)`` of a dequantization, or why not (``{value}`` / ``{scale}`` name the tensors):
        the same for every tensor of one signature (all experts of a layer share it), so computed once."""
        if vdtype not in FP8:
            return f"{{value}} is {vdtype}, not an fp8 dtype"
        if sdtype not in SCALE_DTYPES:
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
        known = layouts.get(signature)
        if known is None:
            known = layouts[signature] = layout(*signature)
        if isinstance(known, str):
            return None, known.replace("{value}", value).replace("{scale}", scale)
        return Dequant(scale, *known), ""

    # The scan: the keys of a companion's name ending (one pass over the names in Rust). When every one is
    # a weight_scale_inv (block fp8, the common case) they are kept in bulk, each value's record made when
    # asked for (BlockScales); otherwise each is recorded here.
    hits, paired, pairs = _scan_names(keys)
    block: BlockScales | None = None
    present: Container[str]
    scanned: list[str] = []
    if paired:
        present = membership if membership is not None else set(keys)
        if hits:
            # (``keys`` are exactly ``present``'s: the values were paired in Rust, see _scan_names)
            block = BlockScales(hits, present, method or "fp8", keys if pairs is not None else None, pairs)
    else:  # another format: every companion recorded here, key by key
        present = set(keys)
        scanned = [k for k in keys if k.endswith(_SCAN_SUFFIXES) or _QUANT_STATE in k]
    for key in scanned:
        if key.endswith("_scale_inv"):
            value = key[: -len("_scale_inv")]
            if value in present and value not in found:  # (the common case of add, inlined: 45k of them)
                found[value] = new_found(FoundQuant, (method or "fp8", BLOCK_FP8, (key,), value, "block", ""))
                companions.add(key)
            elif value in present:
                add(value, "fp8", BLOCK_FP8, [key], kind="block")
        elif key.endswith("_blocks"):
            stem = key[: -len("_blocks")]
            if stem + "_scales" in present:
                add(key, "mxfp4", MXFP4_FORMAT, [stem + "_scales"], stem, why="dequantized only as gpt-oss experts")
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
                    add(value, "fp8", "fp8 with a per-tensor or per-channel weight_scale", [key], kind="scale")
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
    listed = list(nonfloat) if nonfloat is not None else None
    not_float = listed  # (no set of them: nothing asks membership of it)
    if config is not None and method_of_config:
        exclusions = _exclusions(config)
        candidates = keys if listed is None else listed  # (the caller's order)
        if block is not None:  # the block-fp8 tensors and their scales are not the config's: the values
            # in bulk (one filter in C; the set is the one planning asks), then the few left: a scale (every
            # key ending so is one, on this path) whose value is present
            cut = len(SCALE_INV)
            rest = filterfalse(block.value_set.__contains__, candidates)
            candidates = [k for k in rest if not (k.endswith(SCALE_INV) and k in present and k[:-cut] in present)]
        if listed is not None:
            candidates = list(filter(present.__contains__, candidates))
        for key in candidates:
            if key in found or key in companions:
                continue
            dtype = dtype_of(key)
            if dtype in FLOATS or dtype in (torch.bool, torch.int64):  # int64/bool: index buffers, never quantized
                continue
            if not _excluded(_module(key), exclusions):
                add(key, method_of_config, f"{dtype} under quantization_config", [])
    return QuantInfo(
        method,
        dict(config) if config is not None else None,
        QuantTensors(found, spec, block),
        not_float,
        stored_as,
    )


def detect_in_index(index: Any) -> QuantInfo:
    """:func:`detect` over a ``CheckpointIndex``, with the ``config.json`` next to its first file; the index is
    the keys' membership (no set of its keys is built)."""
    config = read_quant_config(os.path.dirname(index.files[0].path)) if index.files else None
    # the config scan's dtypes, in bulk (only a quantization_config with a method has a config scan)
    nonfloat = index.keys_not_stored_as(FLOAT_NAMES.values()) if _method_of(config) else None
    return detect(
        index.keys(),
        lambda k: index.locate(k).dtype,
        config,
        lambda k: index.locate(k).shape,
        nonfloat,
        index.keys_stored_as,
        index.membership,
    )
