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

Detection costs what a rank reads: the companion scan is over names (and the bulk non-float query of
``CheckpointIndex.keys_not_stored_as``), a claim is checked by name, and a tensor's layout (its ``Dequant``,
or why it does not fit) is built only for the keys the rank's reads use (``QuantInfo.read``); a layout that
does not fit is refused on the rank that would read it (``load`` makes every rank raise).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from collections.abc import Callable, Collection, Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain, compress, repeat
from pathlib import Path
from typing import Any, NamedTuple

import torch

from .errors import PlanError

__all__ = [
    "Dequant",
    "QuantInfo",
    "QuantTensor",
    "QuantTensors",
    "QuantizationError",
    "detect",
    "detect_in_index",
    "read_quant_config",
]

#: What a float target can receive from a quantized checkpoint.
SUPPORTED = (
    "dequantized into float16/bfloat16/float32/float64 targets: fp8 (e4m3, e5m2) weights with per-block "
    "weight_scale_inv (block from quantization_config.weight_block_size, default 128x128; ragged last blocks), "
    "per-tensor or per-channel weight_scale; scales fp32, bf16, fp16 or e8m0; MXFP4 (gpt-oss *_blocks of e2m1 "
    "pairs with e8m0 *_scales, into the transposed stacked-experts tensor). A model that keeps the quantized "
    "tensors (parameters of the checkpoint's dtype, its scales as parameters or buffers) loads them raw"
)

_FLOATS = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))
#: their safetensors dtype names (``CheckpointIndex.keys_not_stored_as``)
_FLOAT_NAMES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64"}
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


class _Found(NamedTuple):
    """What the companion scan records for one quantized tensor (names only; its layout is not computed):
    ``kind`` is the dequantization to try (``"block"`` or ``"scale"``, with ``companions[0]`` the scale), None
    when the format is not one the engine dequantizes (``why`` then says why, or is empty)."""

    method: str
    fmt: str
    companions: tuple[str, ...]
    dequantized: str
    kind: str | None
    why: str


_new_found = tuple.__new__

_SCALE_INV = "_scale_inv"


class _BlockScales:
    """The block-fp8 tensors of a checkpoint in bulk: the ``X_scale_inv`` keys the companion scan found, ``X``
    quantized when the checkpoint has it (``present``). Each ``X``'s record (``record``) is made when asked
    for; the name -> scale mapping is the name (``X`` + ``_scale_inv``), so nothing is built per tensor at
    detection, and the present values are listed (``values``) only when every one is asked for."""

    def __init__(self, scales: list[str], present: Container[str], method: str) -> None:
        self.scales = scales  # in the scan's order
        self.present = present
        self.method = method
        self._scale_set: frozenset[str] | None = None
        self._values: list[str] | None = None

    @property
    def scale_set(self) -> frozenset[str]:
        if self._scale_set is None:
            self._scale_set = frozenset(self.scales)
        return self._scale_set

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key + _SCALE_INV in self.scale_set and key in self.present

    def values(self) -> list[str]:
        """The quantized tensors, in the scan's order (each scale's value the checkpoint has)."""
        if self._values is None:
            cut = slice(None, -len(_SCALE_INV))
            self._values = list(filter(self.present.__contains__, map(str.__getitem__, self.scales, repeat(cut))))
        return self._values

    def any(self) -> bool:
        if self._values is not None:
            return bool(self._values)
        cut = len(_SCALE_INV)
        return any(s[:-cut] in self.present for s in self.scales)

    def record(self, key: str) -> _Found:
        return _new_found(_Found, (self.method, _BLOCK_FP8, (key + _SCALE_INV,), key, "block", ""))


class QuantTensors(Mapping[str, QuantTensor]):
    """The quantized tensors of a checkpoint, value key -> :class:`QuantTensor`: the keys (and companions) are
    the companion scan's; each :class:`QuantTensor`, with its layout (the :class:`Dequant`, or why none), is
    built on first access and kept, so planning builds those of the tensors a rank claims and reads (a rank
    of an 8-way expert-parallel load builds ~1/8 of them). The common block-fp8 tensors are held in bulk
    (``_BlockScales``): their scan records too are made on first access."""

    def __init__(
        self,
        found: dict[str, _Found],
        spec: Callable[[str, str, str], tuple[Dequant | None, str]],
        block: _BlockScales | None = None,
    ):
        self._found = found  # the records made by the scan (every format but the bulk block-fp8 ones)
        self._block = block
        self._spec = spec
        self._built: dict[str, QuantTensor] = {}
        self._any: bool | None = None

    def __getitem__(self, key: str) -> QuantTensor:
        q = self._built.get(key)
        if q is not None:
            return q
        f = self.record(key)
        if f is None:
            raise KeyError(key)
        how, why = self._spec(key, f.companions[0], f.kind) if f.kind is not None else (None, f.why)
        if how is None and not why:
            why = "not dequantized by hp_fastload"
        q = self._built[key] = QuantTensor(key, f.method, f.fmt, f.companions, f.dequantized, how, why)
        return q

    def __contains__(self, key: object) -> bool:
        return key in self._found or (self._block is not None and key in self._block)

    def __iter__(self) -> Iterator[str]:
        if self._block is None:
            return iter(self._found)
        return chain(self._block.values(), self._found)  # (the scan's order: the config's keys come last)

    def __len__(self) -> int:
        return len(self._found) + (len(self._block.values()) if self._block is not None else 0)

    def __bool__(self) -> bool:  # (asked per claimed target: kept)
        if self._any is None:
            self._any = bool(self._found) or (self._block is not None and self._block.any())
        return self._any

    @property
    def has_bulk(self) -> bool:
        """True when block-fp8 tensors are held in bulk (their kind is ``"block"``, their records made lazily)."""
        return self._block is not None

    def scanned(self, key: str) -> bool:
        """True when ``key`` has a record of the scan (False: a bulk block-fp8 tensor, or not quantized)."""
        return key in self._found

    def record(self, key: str) -> _Found | None:
        """The scan's record of ``key`` (None: not quantized), without building its :class:`QuantTensor`."""
        f = self._found.get(key)
        if f is None and self._block is not None and key in self._block:
            return self._block.record(key)
        return f

    def among(self, keys: Iterable[str]) -> list[str]:
        """The quantized ones of ``keys``, in their order (in bulk: a stacked-experts target has 10^3
        sources; no call per key)."""
        found, block = self._found, self._block
        if block is None:
            return [k for k in keys if k in found]
        scales, present = block.scale_set, block.present
        return [k for k in keys if k in found or (k + _SCALE_INV in scales and k in present)]

    def companions_of(self, keys: Collection[str]) -> set[str]:
        """The companions of quantized ``keys`` (a block-fp8 tensor's is its name + ``_scale_inv``)."""
        found = self._found
        out = {c for k in keys if k in found for c in found[k].companions}
        if self._block is not None:
            out.update(map(str.__add__, (k for k in keys if k not in found), repeat(_SCALE_INV)))
        return out

    def built(self) -> list[str]:
        """The keys whose :class:`QuantTensor` (layout included) has been built so far."""
        return list(self._built)


@dataclass
class QuantInfo:
    """The quantized tensors of one checkpoint (see :func:`detect`)."""

    method: str | None  # the config's quant_method, None without one
    config: dict[str, Any] | None
    tensors: QuantTensors  # value key -> its description (built on first access)
    #: the keys whose stored dtype is not a float (None: unknown, ``dtype_of`` is asked)
    nonfloat: frozenset[str] | None = None
    #: the bulk dtype query (``CheckpointIndex.keys_not_stored_as``): ``check_claim`` asks it once per float
    #: target dtype instead of each claimed source's dtype (None: ``dtype_of`` is asked)
    not_stored_as: Callable[[Collection[str]], Iterable[str]] | None = None
    _other_than: dict[torch.dtype, frozenset[str]] = field(default_factory=dict, repr=False)

    def __bool__(self) -> bool:
        return bool(self.tensors)

    @functools.cached_property
    def companions(self) -> frozenset[str]:
        """Every quantized tensor's companions (made when asked for: planning asks ``consumed``)."""
        return frozenset(self.tensors.companions_of(list(self.tensors)))

    dequantized: dict[str, Dequant] = field(default_factory=dict)  # keys planned as dequantizing reads
    #: keys claimed into float targets to be dequantized (-> the target's name and dtype): their layouts are
    #: checked (``read``) only where this rank reads them
    claimed: dict[str, tuple[str, torch.dtype]] = field(default_factory=dict)
    fallback_keys: set[str] = field(default_factory=set)  # sources of the torch-dequantized groups

    def refuse(self, q: QuantTensor, why: str) -> QuantizationError:
        detail = f" ({q.why})" if q.why else ""
        return QuantizationError(
            f"{q.key} is quantized ({q.method}, {q.fmt}; companions: {', '.join(q.companions) or 'none'}) "
            f"and {why}{detail}; it is never cast raw into a float tensor. Supported: {SUPPORTED}"
        )

    def check_claim(
        self, target_name: str, target_dtype: torch.dtype, sources: Iterable[str], dtype_of: Any, resolve: bool = True
    ) -> None:
        """A quantized source converted into ``target_name``: the same dtype loads raw, a float target of a
        supported format is dequantized, anything else raises. ``resolve``: check each such source's layout
        now and record its :class:`Dequant` in ``dequantized``; otherwise (planning, whose sources a rank
        reads only in part) the format is checked here by name, the source recorded in ``claimed``, and its
        layout checked by :meth:`read` for the sources the rank reads."""
        tensors = self.tensors  # (a stacked-experts target has 10^3 sources: no call per source)
        floats = target_dtype in _FLOATS
        other = self._stored_other_than(target_dtype) if floats else None
        claim = (target_name, target_dtype)
        if not isinstance(sources, (list, tuple, set, frozenset)):
            sources = list(sources)
        if other is not None:  # the quantized sources not stored as the target's dtype
            if other.isdisjoint(sources):  # (one pass in C: a bf16 checkpoint's weights with scales)
                return
            differ = tensors.among(filter(other.__contains__, sources))
        else:
            differ = [k for k in tensors.among(sources) if dtype_of(k) != target_dtype]
        if floats and not resolve and tensors.has_bulk:
            # the bulk block-fp8 tensors' kind is "block" (dequantized into floats): no record per key (a
            # DeepSeek-V3 rank claims all 45,572 of them, 0.36 s of records; docs/perf-notes.md, "Full scale")
            claimed, rest = self.claimed, []
            for key in differ:
                if tensors.scanned(key):
                    rest.append(key)
                else:
                    claimed[key] = claim
            differ = rest
        for key in differ:
            f = tensors.record(key)
            assert f is not None
            if f.kind is not None and floats:
                if not resolve:
                    self.claimed[key] = claim
                    continue
                q = self.tensors[key]
                if q.dequant is not None:
                    self.dequantized[key] = q.dequant
                    continue
            raise self.refuse(self.tensors[key], f"would be converted into {target_name} ({target_dtype})")

    def for_rank(self) -> QuantInfo:
        """A copy whose per-rank records (``dequantized``, ``claimed``, ``fallback_keys``) are empty; the tensors
        found, their built layouts and the bulk dtype queries are shared (planning several ranks at once)."""
        return dataclasses.replace(self, dequantized={}, claimed={}, fallback_keys=set(), _other_than=self._other_than)

    def _stored_other_than(self, dtype: torch.dtype) -> frozenset[str] | None:
        """The keys not stored as float ``dtype`` (one bulk query per dtype, kept), None without the query."""
        if self.not_stored_as is None:
            return None
        other = self._other_than.get(dtype)
        if other is None:
            other = self._other_than[dtype] = frozenset(self.not_stored_as((_FLOAT_NAMES[dtype],)))
        return other

    def read(self, keys: Iterable[str]) -> None:
        """``keys`` are read by this rank: each one ``claimed`` gets its layout checked and its
        :class:`Dequant` recorded in ``dequantized`` (a layout that does not fit raises, naming the target)."""
        claimed, done = self.claimed, self.dequantized
        for key in keys:
            if key in claimed and key not in done:
                q = self.tensors[key]
                if q.dequant is None:
                    name, dtype = claimed[key]
                    raise self.refuse(q, f"would be converted into {name} ({dtype})")
                done[key] = q.dequant

    def consumed(self) -> set[str]:
        """The companions of the claimed and dequantized tensors (read with them, so not unexpected)."""
        out = self.tensors.companions_of(self.claimed)
        out.update(self.tensors.companions_of(self.dequantized))
        return out | self.fallback_keys

    def _mxfp4_targets(
        self, missing: Collection[str], unclaimed: Collection[str], dtype_of_target: Callable[[str], torch.dtype]
    ) -> Iterator[tuple[QuantTensor, str]]:
        """The unclaimed MXFP4 ``*_blocks`` (one ``*_scales`` companion, not yet planned) whose dequantized
        name is a missing float model tensor: ``(blocks, target name)``."""
        if not missing:  # every target is loaded: nothing for a packed tensor to become
            return
        for key in self.tensors.among(unclaimed):
            f = self.tensors.record(key)
            if f is None or f.fmt != MXFP4_FORMAT or len(f.companions) != 1 or key in self.fallback_keys:
                continue
            q = self.tensors[key]
            name = self._missing_target(q, missing)
            if name is not None and dtype_of_target(name) in _FLOATS:
                yield q, name

    def _missing_target(self, q: QuantTensor | _Found, missing: Collection[str]) -> str | None:
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
        for q, name in self._mxfp4_targets(missing, unclaimed, dtype_of_target):
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
        for q, name in self._mxfp4_targets(missing, unclaimed, dtype_of_target):
            key = q.key
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
        record = self.tensors.record
        for key in self.tensors.among(unclaimed):
            f = record(key)
            if f is None:
                continue
            name = self._missing_target(f, missing)
            if name is not None:
                raise self.refuse(self.tensors[key], f"the model expects it as {name}")


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


_BLOCK_FP8 = "block-scaled fp8 (weight_scale_inv)"
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


def _method_of(config: Mapping[str, Any] | None) -> str:
    """The config's ``quant_method`` (or ``format``), "" without one: a config scan runs only with one."""
    return str(config.get("quant_method") or config.get("format") or "") if config else ""


def detect(
    keys: Iterable[str],
    dtype_of: Callable[[str], torch.dtype],
    config: Mapping[str, Any] | None,
    shape_of: Callable[[str], Sequence[int]] | None = None,
    nonfloat: Iterable[str] | None = None,
    not_stored_as: Callable[[Collection[str]], Iterable[str]] | None = None,
    membership: Container[str] | None = None,
) -> QuantInfo:
    """The quantized tensors among ``keys`` (``dtype_of(key)`` / ``shape_of(key)`` give a key's stored dtype
    and shape; without ``shape_of`` nothing is dequantized). ``nonfloat``: the keys whose stored dtype is not
    a float, when the caller has them in bulk (``CheckpointIndex.keys_not_stored_as``); without it the
    ``quantization_config`` scan asks ``dtype_of`` of every key. ``not_stored_as``: that bulk query itself,
    for :meth:`QuantInfo.check_claim` (see ``QuantInfo.not_stored_as``). ``membership``: ``key in membership``
    for exactly the ``keys`` (a ``CheckpointIndex``), when the caller has one; otherwise a set of them is built.

    The scan is over names (a key's companions); a tensor's layout, which needs its and its scale's dtype
    and shape, is computed when its :class:`QuantTensor` is first asked for (see :class:`QuantTensors`)."""
    keys = keys if isinstance(keys, list) else list(keys)
    method_of_config = _method_of(config)
    method = method_of_config or None
    found: dict[str, _Found] = {}
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
        found[key] = _new_found(_Found, (method or default_method, fmt, comps, dequantized or key, kind, why))
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
        known = layouts.get(signature)
        if known is None:
            known = layouts[signature] = layout(*signature)
        if isinstance(known, str):
            return None, known.replace("{value}", value).replace("{scale}", scale)
        return Dequant(scale, *known), ""

    # The scan: the keys of a companion's name ending (C-level passes over the names). When every one is a
    # weight_scale_inv (block fp8, the common case) they are kept in bulk, each value's record made when
    # asked for (_BlockScales); otherwise each is recorded here.
    hits = list(compress(keys, map(str.endswith, keys, repeat(_SCAN_SUFFIXES))))
    block: _BlockScales | None = None
    present: Container[str]
    scanned: list[str] = []
    if all(map(str.endswith, hits, repeat(_SCALE_INV))) and ".weight.quant_state." not in "\n".join(keys):
        present = membership if membership is not None else set(keys)
        if hits:
            block = _BlockScales(hits, present, method or "fp8")
    else:  # another format: every companion recorded here, key by key
        present = set(keys)
        scanned = [k for k in keys if k.endswith(_SCAN_SUFFIXES) or ".weight.quant_state." in k]
    for key in scanned:
        if key.endswith("_scale_inv"):
            value = key[: -len("_scale_inv")]
            if value in present and value not in found:  # (the common case of add, inlined: 45k of them)
                found[value] = _new_found(_Found, (method or "fp8", _BLOCK_FP8, (key,), value, "block", ""))
                companions.add(key)
            elif value in present:
                add(value, "fp8", _BLOCK_FP8, [key], kind="block")
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
    not_float = frozenset(listed) if listed is not None else None
    if config is not None and method_of_config:
        exclusions = _exclusions(config)
        candidates = keys if listed is None else listed  # (the caller's order)
        if block is not None:  # the block-fp8 tensors and their scales are not the config's (in bulk: a
            # candidate not in the checkpoint is dropped below, so the names need no presence test here)
            cut = len(_SCALE_INV)
            names = frozenset(map(str.__getitem__, block.scales, repeat(slice(None, -cut))))
            known = names.intersection(candidates).union(
                s for s in block.scale_set.intersection(candidates) if s[:-cut] in present
            )
            candidates = [k for k in candidates if k not in known]
        if listed is not None:
            candidates = list(filter(present.__contains__, candidates))
        for key in candidates:
            if key in found or key in companions:
                continue
            dtype = dtype_of(key)
            if dtype in _FLOATS or dtype in (torch.bool, torch.int64):  # int64/bool: index buffers, never quantized
                continue
            if not _excluded(_module(key), exclusions):
                add(key, method_of_config, f"{dtype} under quantization_config", [])
    return QuantInfo(
        method,
        dict(config) if config is not None else None,
        QuantTensors(found, spec, block),
        not_float,
        not_stored_as,
    )


def detect_in_index(index: Any) -> QuantInfo:
    """:func:`detect` over a ``CheckpointIndex``, with the ``config.json`` next to its first file; the index is
    the keys' membership (no set of its keys is built)."""
    config = read_quant_config(Path(index.files[0].path).parent) if index.files else None
    # the config scan's dtypes, in bulk (only a quantization_config with a method has a config scan)
    nonfloat = index.keys_not_stored_as(_FLOAT_NAMES.values()) if _method_of(config) else None
    return detect(
        index.keys(),
        lambda k: index.locate(k).dtype,
        config,
        lambda k: index.locate(k).shape,
        nonfloat,
        index.keys_not_stored_as,
        index,
    )
