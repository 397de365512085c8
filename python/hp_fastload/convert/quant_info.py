"""The result of quantization detection: ``QuantTensor`` (one quantized checkpoint tensor and its companions),
``QuantTensors`` (all of them, as a mapping built lazily from bulk name passes) and ``QuantInfo`` (the format, the
block shape and the refusal of what cannot be dequantized exactly), consumed by planning and the DCP reader.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Collection, Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain, compress, filterfalse, repeat
from typing import Any, NamedTuple

import torch

import hp_fastload._core as _core
from hp_fastload.convert.quant import (
    BLOCK_FP8,
    FLOATS,
    MXFP4_FORMAT,
    SUPPORTED,
    Dequant,
    mxfp4_group,
    mxfp4_region,
)
from hp_fastload.errors import QuantizationError
from hp_fastload.formats import FLOAT_NAMES


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


class QuantTensors(Mapping[str, QuantTensor]):
    """The quantized tensors of a checkpoint, value key -> :class:`QuantTensor`: the keys (and companions) are
    the companion scan's; each :class:`QuantTensor`, with its layout (the :class:`Dequant`, or why none), is
    built on first access and kept, so planning builds those of the tensors a rank claims and reads (a rank
    of an 8-way expert-parallel load builds ~1/8 of them). The common block-fp8 tensors are held in bulk
    (``BlockScales``): their scan records too are made on first access."""

    def __init__(
        self,
        found: dict[str, FoundQuant],
        spec: Callable[[str, str, str], tuple[Dequant | None, str]],
        block: BlockScales | None = None,
    ):
        self._found = found  # the records made by the scan (every format but the bulk block-fp8 ones)
        self._block = block
        self._spec = spec
        self._built: dict[str, QuantTensor] = {}
        self._any: bool | None = None
        #: every quantized key (the scan's and the bulk block-fp8 ones), made on the first bulk ``among``
        self._quantized: frozenset[str] | None = None

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

    @property
    def has_records(self) -> bool:
        """True when the scan made a record for some tensor (False: only bulk block-fp8 tensors, if any)."""
        return bool(self._found)

    def scanned(self, key: str) -> bool:
        """True when ``key`` has a record of the scan (False: a bulk block-fp8 tensor, or not quantized)."""
        return key in self._found

    def record(self, key: str) -> FoundQuant | None:
        """The scan's record of ``key`` (None: not quantized), without building its :class:`QuantTensor`."""
        f = self._found.get(key)
        if f is None and self._block is not None and key in self._block:
            return self._block.record(key)
        return f

    def among(self, keys: Iterable[str]) -> list[str]:
        """The quantized ones of ``keys``, in their order (in bulk: a stacked-experts target has 10^3
        sources; no call per key)."""
        if self._block is None:
            return [k for k in keys if k in self._found]
        return list(filter(self.quantized.__contains__, keys))

    @property
    def quantized(self) -> frozenset[str]:
        """Every quantized key (the scan's and the bulk block-fp8 ones), made once (shared by every rank):
        then one filter in C per bulk question (``among``, ``QuantInfo.check_claim``)."""
        if self._quantized is None:
            found, block = self._found, self._block
            if block is None:
                self._quantized = frozenset(found)
            else:
                self._quantized = frozenset(found).union(block.value_set) if found else block.value_set
        return self._quantized

    def companions_of(self, keys: Collection[str]) -> set[str]:
        """The companions of quantized ``keys`` (a block-fp8 tensor's is its name + ``_scale_inv``)."""
        found = self._found
        out = {c for k in keys if k in found for c in found[k].companions} if found else set()
        if self._block is not None:
            out.update(self._block.scales_of([k for k in keys if k not in found] if found else keys))
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
    nonfloat: Collection[str] | None = None
    #: the bulk dtype query (``CheckpointIndex.keys_stored_as``): ``check_claim`` asks it once per float
    #: target dtype instead of each claimed source's dtype (None: ``dtype_of`` is asked)
    stored_as: Callable[[Collection[str]], Iterable[str]] | None = None
    _same_as: dict[torch.dtype, frozenset[str]] = field(default_factory=dict, repr=False)

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
        floats = target_dtype in FLOATS
        same = self._quantized_stored_as(target_dtype) if floats else None
        claim = (target_name, target_dtype)
        if not isinstance(sources, (list, tuple, set, frozenset)):
            sources = list(sources)
        if same is not None:  # the quantized sources not stored as the target's dtype
            differ = list(filter(tensors.quantized.__contains__, sources))  # (one pass in C)
            if not differ:  # (a target of no quantized source)
                return
            if same:  # (a quantized tensor stored as the target's dtype loads raw)
                differ = list(filterfalse(same.__contains__, differ))
        else:
            differ = [k for k in tensors.among(sources) if dtype_of(k) != target_dtype]
        if floats and not resolve and tensors.has_bulk:
            # the bulk block-fp8 tensors' kind is "block" (dequantized into floats): no record per key (a
            # DeepSeek-V3 rank claims all 45,572 of them, 0.36 s of records; docs/perf-notes.md, "Full scale")
            if tensors.has_records:
                rest = list(filter(tensors.scanned, differ))
                self.claimed.update(zip(filterfalse(tensors.scanned, differ), repeat(claim)))
                differ = rest
            else:  # (no record at all: every one is a bulk tensor, claimed in one C-level update)
                self.claimed.update(zip(differ, repeat(claim)))
                differ = []
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
        return dataclasses.replace(self, dequantized={}, claimed={}, fallback_keys=set(), _same_as=self._same_as)

    def _quantized_stored_as(self, dtype: torch.dtype) -> frozenset[str] | None:
        """The quantized keys stored as float ``dtype`` (one bulk query per dtype, kept; usually none: a
        quantized tensor is stored packed), None without the query. (Asked of the keys stored as ``dtype``,
        not of the ~90k a DeepSeek-V3 checkpoint does not store as bf16.)"""
        if self.stored_as is None:
            return None
        same = self._same_as.get(dtype)
        if same is None:
            same = self._same_as[dtype] = self.tensors.quantized.intersection(self.stored_as((FLOAT_NAMES[dtype],)))
        return same

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
        out.update(self.fallback_keys)  # (``out`` is new: no copy of its 45k names)
        return out

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
            if name is not None and dtype_of_target(name) in FLOATS:
                yield q, name

    def _missing_target(self, q: QuantTensor | FoundQuant, missing: Collection[str]) -> str | None:
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
            compute = functools.partial(mxfp4_group, name, blocks, scales)
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


class FoundQuant(NamedTuple):
    """What the companion scan records for one quantized tensor (names only; its layout is not computed):
    ``kind`` is the dequantization to try (``"block"`` or ``"scale"``, with ``companions[0]`` the scale), None
    when the format is not one the engine dequantizes (``why`` then says why, or is empty)."""

    method: str
    fmt: str
    companions: tuple[str, ...]
    dequantized: str
    kind: str | None
    why: str


new_found = tuple.__new__


SCALE_INV = "_scale_inv"


class BlockScales:
    """The block-fp8 tensors of a checkpoint in bulk: the ``X_scale_inv`` keys the companion scan found, ``X``
    quantized when the checkpoint has it (``present``). Each ``X``'s record (``record``) is made when asked
    for; the name -> scale mapping is the name (``X`` + ``_scale_inv``), so nothing is built per tensor at
    detection. The present values and their scales (``values``, ``scales_of``) are the index's own string
    objects, paired by detection's scan in Rust (or here, when first asked for)."""

    def __init__(
        self,
        scales: list[str],
        present: Container[str],
        method: str,
        keys: list[str] | None = None,
        pairs: tuple[list[str], list[str]] | None = None,
    ) -> None:
        self.scales = scales  # in the scan's order
        self.present = present
        self.method = method
        #: the keys ``present`` holds, exactly, in the scan's order (None: not known): ``values`` then pairs
        #: each scale with its value in Rust and takes the values as these keys' own string objects
        self.keys = keys
        #: ``pairs``: the values and each one's scale, when the scan paired them (``_core.companion_scan``)
        self._values: list[str] | None = pairs[0] if pairs is not None else None
        self._value_set: frozenset[str] | None = None
        #: each value's scale, the scale's own string (made with ``_values``)
        self._paired: list[str] = pairs[1] if pairs is not None else []

    @property
    def value_set(self) -> frozenset[str]:
        """``values()`` as a set (the bulk tensors' membership: ``key in value_set`` is ``key in self``)."""
        if self._value_set is None:
            self._value_set = frozenset(self.values())
        return self._value_set

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in self.value_set

    def values(self) -> list[str]:
        """The quantized tensors, in the scan's order (each scale's value the checkpoint has)."""
        if self._values is None:
            if self.keys is not None:
                # (slicing 45k scale names and hashing the new strings against the index cost ~6x this;
                # docs/perf-notes.md, "Session 11")
                _, _, self._values, self._paired = _core.companion_scan(self.keys, (SCALE_INV,))
            else:
                cut = slice(None, -len(SCALE_INV))
                stems = list(map(str.__getitem__, self.scales, repeat(cut)))
                kept = list(map(self.present.__contains__, stems))
                self._values = list(compress(stems, kept))
                self._paired = list(compress(self.scales, kept))
        return self._values

    def scales_of(self, keys: Collection[str]) -> Iterable[str]:
        """Each of ``keys``' name + ``_scale_inv`` (in no particular order): a bulk value's is its scale's own
        string object (whose hash is cached: a DeepSeek-V3 rank asks it for its 45k claimed values, which
        would otherwise be 45k new strings, each hashed again by the set they go into)."""
        values = self.values()
        if 4 * len(keys) < len(values):  # (a few keys: naming them costs less than the pass over every value)
            return map(str.__add__, keys, repeat(SCALE_INV))
        within = keys if isinstance(keys, (set, frozenset, dict)) else set(keys)
        out = list(compress(self._paired, map(within.__contains__, values)))
        value_set = self.value_set
        out.extend(map(str.__add__, filterfalse(value_set.__contains__, within), repeat(SCALE_INV)))
        return out

    def any(self) -> bool:
        if self._values is not None:
            return bool(self._values)
        cut = len(SCALE_INV)
        return any(s[:-cut] in self.present for s in self.scales)

    def record(self, key: str) -> FoundQuant:
        return new_found(FoundQuant, (self.method, BLOCK_FP8, (key + SCALE_INV,), key, "block", ""))
