"""The plan's data: ``ReadItem`` (one strided box of a checkpoint tensor into a box of a target),
``Reads`` (a target's items as columns: the one read type), ``DeferredGroup`` (work done on whole tensors), ``LoadPlan``
(one rank's plan) and ``LoadReport`` (what a load did), with ``touched_scale_rows``: the scale grid rows a set of
reads makes the engine read (the plan's and the batch's byte counts). Builds nothing: planning lives in the sibling
modules.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, NamedTuple

import numpy as np
import torch

from hp_fastload.convert.quant import Dequant, source_nbytes
from hp_fastload.errors import PlanError

#: The phases of :class:`CriticalPath`, in the order a load runs them.
PHASES = ("index", "planning", "agreement", "reading", "waiting", "finishing", "other")


@dataclass(frozen=True)
class CriticalPath:
    """Where one rank's load spent its wall time, in seconds; every instant of it is charged to one phase, so
    the phases add up to ``LoadReport.seconds``.

    ``index``: resolving the location, opening the files and parsing their headers. ``planning``: targets,
    rules, traces, claims, region intersection (and the replica plan of ``share_replicated``). ``agreement``:
    what the ranks compare before reading (their checkpoint identities' digests, ``share="job"``'s plan; the
    identity itself is computed with the index). ``reading``: the
    engine (or, with sharing, the delivery rounds and broadcasts). ``waiting``: inside the agreement
    collectives after this rank's own step was done, i.e. for the slowest peer. ``finishing``: tying tied
    weights, unmapping the files, re-creating non-persistent buffers, PEFT copies. ``other``: argument checks
    and bookkeeping between the phases.

    ``planning_hidden`` is not a phase: the planning done while the engine was reading (the region
    intersections ``load`` makes as it reads, ``execute.read.execute_stream``), inside ``reading``; the part of
    it no read covered is in ``planning``. ``planning + planning_hidden`` is all the planning.
    """

    index: float = 0.0
    planning: float = 0.0
    agreement: float = 0.0
    reading: float = 0.0
    waiting: float = 0.0
    finishing: float = 0.0
    other: float = 0.0
    planning_hidden: float = 0.0

    @property
    def total(self) -> float:
        return sum(getattr(self, phase) for phase in PHASES)

    def as_dict(self) -> dict[str, float]:
        return {phase: getattr(self, phase) for phase in PHASES}

    def summary(self) -> str:
        total = self.total
        text = ", ".join(
            f"{phase} {getattr(self, phase):.3f} s"
            + (f" ({100 * getattr(self, phase) / total:.0f}%)" if total > 0 else "")
            for phase in PHASES
        )
        if self.planning_hidden > 0:
            text += f"; planning hidden behind reads {self.planning_hidden:.3f} s"
        return text


@dataclass(frozen=True)
class LoadReport:
    """What a load did: every name is a model FQN (tied aliases included) or a checkpoint key.

    ``loaded_keys``, ``missing_keys`` and ``unexpected_keys`` are natural-sorted tuples and are the only
    fields compared by ``==`` (both loaders produce equal reports). The rest is measurement.
    """

    loaded_keys: tuple[str, ...]
    missing_keys: tuple[str, ...]
    unexpected_keys: tuple[str, ...]
    bytes_read: int = field(default=0, compare=False)
    bytes_needed: int = field(default=0, compare=False)
    checkpoint_bytes: int = field(default=0, compare=False)
    seconds: float = field(default=0.0, compare=False)
    region_targets: int = field(default=0, compare=False)
    deferred_targets: tuple[str, ...] = field(default=(), compare=False)
    loader: str = field(default="", compare=False)
    #: tied weights that reached different tensors and were tied again before planning (``finalize.retie``)
    retied_keys: tuple[str, ...] = field(default=(), compare=False)
    #: non-persistent buffers nothing re-created after the load: after ``to_empty`` they hold garbage until
    #: the caller sets them (``finalize.recreate_buffers`` recomputes those of transformers models)
    unfilled_buffers: tuple[str, ...] = field(default=(), compare=False)
    #: model tensors no checkpoint holds by design, left as they are: those a ``state_dict_adapter`` does not
    #: map (torchtitan's ``expert_bias``) and those matching ``ignore_missing``
    ignored_missing_keys: tuple[str, ...] = field(default=(), compare=False)
    #: a PEFT model's adapter tensors that a base-checkpoint load left as they are (their initialization)
    adapter_keys: tuple[str, ...] = field(default=(), compare=False)
    #: bytes this rank received from / sent to other ranks (``share="job"`` or ``"replicated"``)
    bytes_received: int = field(default=0, compare=False)
    bytes_sent: int = field(default=0, compare=False)
    #: the sharing strategy that ran: ``"none"``, ``"job"`` or ``"replicated"``
    share: str = field(default="", compare=False)
    #: ``share="job"``: the ranks whose reads were far slower per byte than the median reader's (a slow link or
    #: disk on their node), each as "rank r (node n): ...", the same on every rank
    stragglers: tuple[str, ...] = field(default=(), compare=False)
    #: where ``seconds`` went on this rank (``CriticalPath``): header parse, planning, agreement, reading,
    #: waiting for peers, finishing
    critical_path: CriticalPath = field(default_factory=CriticalPath, compare=False)

    def summary(self) -> str:
        rate = self.bytes_read / self.seconds / 1e9 if self.seconds > 0 else 0.0
        text = (
            f"{self.loader or 'hp_fastload'}: loaded {len(self.loaded_keys)} tensors, "
            f"missing {len(self.missing_keys)}, unexpected {len(self.unexpected_keys)}; "
            f"read {self.bytes_read / 1e6:.1f} MB of {self.checkpoint_bytes / 1e6:.1f} MB checkpoint "
            f"in {self.seconds:.3f} s ({rate:.2f} GB/s); {self.region_targets} region targets, "
            f"{len(self.deferred_targets)} deferred"
        )
        if self.ignored_missing_keys:
            shown = ", ".join(self.ignored_missing_keys[:3]) + (", ..." if len(self.ignored_missing_keys) > 3 else "")
            text += f"; {len(self.ignored_missing_keys)} not in any checkpoint, left as they are ({shown})"
        if self.adapter_keys:
            text += f"; {len(self.adapter_keys)} PEFT adapter tensors left to their initialization"
        if self.bytes_received or self.bytes_sent or self.share not in ("", "none"):
            text += (
                f"; share={self.share or 'none'}: received {self.bytes_received / 1e6:.1f} MB, "
                f"sent {self.bytes_sent / 1e6:.1f} MB"
            )
        if self.stragglers:
            text += f"; stragglers: {'; '.join(self.stragglers)}"
        if self.critical_path.total > 0:
            text += f"; time: {self.critical_path.summary()}"
        if self.retied_keys:
            text += f"; re-tied {len(self.retied_keys)} ({', '.join(self.retied_keys[:3])})"
        if self.unfilled_buffers:
            shown = ", ".join(self.unfilled_buffers[:3]) + (", ..." if len(self.unfilled_buffers) > 3 else "")
            text += (
                f"; {len(self.unfilled_buffers)} non-persistent buffers not re-created ({shown}): "
                "set them yourself if the model was materialized with to_empty"
            )
        return text


class ReadItem(NamedTuple):
    """One strided box of one checkpoint tensor into one box of a target's local tensor.

    Source element ``i`` (a multi-index over ``lengths``) is ``storage_base + sum(i * storage_strides)`` in
    the flattened checkpoint tensor; it lands at ``dest_offsets + i`` in the target's local tensor.
    ``post`` are elementwise ops applied (in the source dtype, then the traced casts) before the copy.
    """

    source: str
    storage_base: int
    storage_strides: tuple[int, ...]
    lengths: tuple[int, ...]
    dest_offsets: tuple[int, ...]
    post: tuple[Any, ...] = ()

    @property
    def numel(self) -> int:
        n = 1
        for length in self.lengths:
            n *= length
        return n


Int64s = np.ndarray[Any, np.dtype[np.int64]]


def _frozen(array: Any, shape: tuple[int, ...]) -> Int64s:
    out = np.asarray(array, dtype=np.int64).reshape(shape)
    out.flags.writeable = False  # shared between the targets of one trace: derived reads make new arrays
    return out


class Reads(Sequence[ReadItem]):
    """A target's read items as columns, one row per item: the one read type of every target.

    Direction-neutral: the *storage side* is a checkpoint tensor (``keys[i]``; element ``j``, a multi-index
    over ``lengths[i]``, is ``storage_base[i] + sum(j * storage_strides[i])`` of the flattened tensor); the
    *dest side* is the target's local tensor (element ``j`` lands at ``dest_offsets[i] + j``). A load copies
    storage -> dest; an export (``save``) executes the same rows dest -> storage. ``nbytes[i]`` is the storage
    bytes of item ``i``; ``post`` (None when no item has any) the elementwise ops applied to item ``i``'s
    values before the copy; ``second`` (None when no item has one) item ``i``'s second source: the
    ``quant.Dequant`` of a weight the engine dequantizes while copying (its scale tensor is read with it).

    The arrays are read-only: a stacked-experts trace's ~10^3 items per layer are built once and shared by
    every layer's target (``renamed``, ``take``, ``moved`` derive new rows). Indexing and iterating give
    ``ReadItem``s (without ``second``), equal to the general block/box intersection's (tests compare both).
    """

    __slots__ = ("dest_offsets", "keys", "lengths", "nbytes", "post", "second", "storage_base", "storage_strides")

    def __init__(
        self,
        keys: Sequence[str],
        storage_base: Any,
        storage_strides: Any,
        lengths: Any,
        dest_offsets: Any,
        nbytes: Any,
        post: Sequence[tuple[Any, ...]] | None = None,
        second: Sequence[Dequant | None] | None = None,
    ) -> None:
        n = len(keys)
        self.keys = list(keys)
        self.storage_strides = _frozen(storage_strides, (n, -1) if n else (0, np.shape(storage_strides)[-1]))
        ndim = self.storage_strides.shape[1]
        self.storage_base = _frozen(storage_base, (n,))
        self.lengths = _frozen(lengths, (n, ndim))
        self.dest_offsets = _frozen(dest_offsets, (n, ndim))
        self.nbytes = _frozen(nbytes, (n,))
        self.post = tuple(post) if post is not None and any(post) else None
        self.second = tuple(second) if second is not None and any(s is not None for s in second) else None

    @classmethod
    def empty(cls, ndim: int) -> Reads:
        return cls([], [], np.zeros((0, ndim)), np.zeros((0, ndim)), np.zeros((0, ndim)), [])

    @classmethod
    def one(
        cls,
        key: str,
        storage_base: int,
        storage_strides: Sequence[int],
        lengths: Sequence[int],
        dest_offsets: Sequence[int],
        dtype: torch.dtype,
        second: Dequant | None = None,
    ) -> Reads:
        """A single box (whole-tensor reads, requests of readers without a plan); its three tuples must have
        one length (``PlanError`` naming the key otherwise)."""
        ranks = (len(lengths), len(storage_strides), len(dest_offsets))
        if len(set(ranks)) != 1:
            raise PlanError(
                f"{key}: a read with {ranks[0]} lengths, {ranks[1]} strides and {ranks[2]} destination offsets"
            )
        ndim = ranks[0]
        numel = 1
        for length in lengths:
            numel *= int(length)
        return cls(
            [key],
            [storage_base],
            np.reshape(np.asarray(storage_strides, dtype=np.int64), (1, ndim)),
            np.reshape(np.asarray(lengths, dtype=np.int64), (1, ndim)),
            np.reshape(np.asarray(dest_offsets, dtype=np.int64), (1, ndim)),
            [source_nbytes(numel, dtype, second is not None)],
            None,
            None if second is None else [second],
        )

    @property
    def ndim(self) -> int:
        return int(self.storage_strides.shape[1])

    @property
    def total_nbytes(self) -> int:
        """Storage bytes of all items."""
        return int(self.nbytes.sum())

    def __len__(self) -> int:
        return len(self.keys)

    def _rows(self) -> Iterator[ReadItem]:
        posts = self.post if self.post is not None else repeat(())
        return map(
            ReadItem,
            self.keys,
            self.storage_base.tolist(),
            map(tuple, self.storage_strides.tolist()),
            map(tuple, self.lengths.tolist()),
            map(tuple, self.dest_offsets.tolist()),
            posts,
        )

    def __iter__(self) -> Iterator[ReadItem]:
        return self._rows()

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return list(self.take(np.arange(len(self), dtype=np.int64)[i]))
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return ReadItem(
            self.keys[i],
            int(self.storage_base[i]),
            tuple(self.storage_strides[i].tolist()),
            tuple(self.lengths[i].tolist()),
            tuple(self.dest_offsets[i].tolist()),
            self.post[i] if self.post is not None else (),
        )

    def take(self, rows: Any) -> Reads:
        """The items at ``rows`` (positions), in that order."""
        rows = np.asarray(rows, dtype=np.int64)
        picked = rows.tolist()
        return Reads(
            [self.keys[i] for i in picked],
            self.storage_base[rows],
            self.storage_strides[rows],
            self.lengths[rows],
            self.dest_offsets[rows],
            self.nbytes[rows],
            None if self.post is None else [self.post[i] for i in picked],
            None if self.second is None else [self.second[i] for i in picked],
        )

    def _derived(self, **changes: Any) -> Reads:
        """A copy sharing the unchanged (read-only) columns (attribute by attribute: a plan of 10^3 targets
        derives one per target and rank)."""
        out = object.__new__(Reads)
        get = changes.get
        out.keys = get("keys", self.keys)
        out.storage_base = get("storage_base", self.storage_base)
        out.storage_strides = get("storage_strides", self.storage_strides)
        out.lengths = get("lengths", self.lengths)
        out.dest_offsets = get("dest_offsets", self.dest_offsets)
        out.nbytes = get("nbytes", self.nbytes)
        out.post = get("post", self.post)
        out.second = get("second", self.second)
        return out

    def renamed(self, keys: Sequence[str]) -> Reads:
        """The same rows with other storage keys (a shared trace's placeholders -> one layer's keys)."""
        if len(keys) != len(self):
            raise ValueError(f"{len(keys)} keys for {len(self)} reads")
        return self._derived(keys=list(keys))

    def moved(self, shift: Sequence[int]) -> Reads:
        """The same rows with every destination moved by ``shift``."""
        moved = _frozen(self.dest_offsets + np.asarray(shift, dtype=np.int64), self.dest_offsets.shape)
        return self._derived(dest_offsets=moved)

    def with_second(self, second: Sequence[Dequant | None] | None) -> Reads:
        return self._derived(
            second=tuple(second) if second is not None and any(s is not None for s in second) else None
        )

    def clip_rows(self, r0: int, r1: int) -> Reads:
        """The parts of the items that land in destination rows ``[r0, r1)`` (first dim), with destinations
        counted from ``r0``: clipping an item's destination rows clips its storage side by the same rows of its
        first stride (the dest side maps element for element onto the storage side)."""
        d0 = self.dest_offsets[:, 0]
        a = np.maximum(d0, r0)
        b = np.minimum(d0 + self.lengths[:, 0], r1)
        rows = np.flatnonzero(b > a)
        part = self.take(rows)
        a, b, d0 = a[rows], b[rows], d0[rows]
        full = part.lengths[:, 0]  # the items' own row counts (a view of the read-only column)
        lengths = part.lengths.copy()
        lengths[:, 0] = b - a
        offsets = part.dest_offsets.copy()
        offsets[:, 0] = a - r0
        return part._derived(
            storage_base=_frozen(part.storage_base + (a - d0) * part.storage_strides[:, 0], (len(rows),)),
            lengths=_frozen(lengths, lengths.shape),
            dest_offsets=_frozen(offsets, offsets.shape),
            nbytes=_frozen(part.nbytes // np.maximum(full, 1) * (b - a), (len(rows),)),
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Reads):
            return NotImplemented
        return (
            self.keys == other.keys
            and self.post == other.post
            and self.second == other.second
            and all(
                np.array_equal(getattr(self, name), getattr(other, name))
                for name in ("storage_base", "storage_strides", "lengths", "dest_offsets", "nbytes")
            )
        )

    __hash__ = None  # type: ignore[assignment]

    def __getstate__(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            if isinstance(value, np.ndarray):
                value = _frozen(value, value.shape)
            object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        return f"Reads({len(self)} items, {self.total_nbytes} bytes, first {self.keys[0] if self.keys else None!r})"


#: Per dequantization spec, the first and last dim-0 row of its scale grid that some items touch.
ScaleRows = dict[Dequant, tuple[int, int]]


def touched_scale_rows(reads: Reads, into: ScaleRows | None = None) -> ScaleRows:
    """The scale grid rows ``reads``' dequantized items touch, per spec, merged into ``into`` (the engine's
    rule, ``exec::read_scales``: an item touches the dim-0 rows of the quantized tensor from its first element
    ``storage_base`` to its last ``storage_base + sum((lengths - 1) * storage_strides)``, i.e. grid rows
    ``row // block[0]``; the engine reads the hull of those rows of each scale, once per call). Exact for
    dim-0 (expert-parallel, FSDP) shards; a box cut along inner dims reads whole grid rows. Vectorized over the
    items (a stacked-experts target has one spec per expert)."""
    out: ScaleRows = {} if into is None else into
    if reads.second is None:
        return out
    if len(reads.keys) <= _FEW_ITEMS:
        return _few_touched_scale_rows(reads, reads.second, out)
    ids: dict[Dequant, int] = {}
    which = np.array([-1 if s is None else ids.setdefault(s, len(ids)) for s in reads.second], dtype=np.int64)
    live = (which >= 0) & (reads.lengths > 0).all(axis=1)
    if not live.any():
        return out
    specs = list(ids)
    # per spec: elements per dim-0 row, dim-0 length, dim-0 block (a 0-d spec: one row of one element)
    dims = [(math.prod(s.shape[1:]), s.shape[0], s.block[0]) if s.shape else (1, 1, 1) for s in specs]
    inner, rows0, block0 = np.array(dims, dtype=np.int64).reshape(-1, 3).T
    which = which[live]
    strides, lengths = reads.storage_strides[live], reads.lengths[live]
    first = reads.storage_base[live]
    last = first + ((lengths - 1) * strides).sum(axis=1)
    lo_row = np.minimum(first // inner[which], rows0[which] - 1) // block0[which]
    hi_row = np.minimum(last // inner[which], rows0[which] - 1) // block0[which]
    negative = (strides < 0).any(axis=1)  # the engine refuses these; count the whole grid meanwhile
    lo_row[negative] = 0
    hi_row[negative] = ((rows0 + block0 - 1) // block0)[which][negative] - 1
    lo = np.full(len(specs), np.iinfo(np.int64).max, dtype=np.int64)
    hi = np.full(len(specs), -1, dtype=np.int64)
    np.minimum.at(lo, which, lo_row)
    np.maximum.at(hi, which, hi_row)
    for spec, a, b in zip(specs, lo.tolist(), hi.tolist(), strict=True):
        if b < 0:
            continue  # every item of it is empty
        seen = out.get(spec)
        out[spec] = (a, b) if seen is None else (min(seen[0], a), max(seen[1], b))
    return out


#: Up to this many items, ``touched_scale_rows`` runs in plain Python (numpy's per-call cost dominated: most
#: targets of an FSDP rank have one item; a DeepSeek-V3 rank's report spent ~50 ms in it).
_FEW_ITEMS = 16


def _few_touched_scale_rows(reads: Reads, second: Sequence[Dequant | None], out: ScaleRows) -> ScaleRows:
    """``touched_scale_rows`` item by item: the same rows, merged in the same spec order."""
    acc: dict[Dequant, list[int]] = {}
    for spec, base, strides, lengths in zip(
        second, reads.storage_base.tolist(), reads.storage_strides.tolist(), reads.lengths.tolist(), strict=True
    ):
        if spec is None:
            continue
        hull = acc.get(spec)
        if hull is None:
            hull = acc[spec] = [np.iinfo(np.int64).max, -1]
        if not all(n > 0 for n in lengths):
            continue
        inner, rows0, block0 = (math.prod(spec.shape[1:]), spec.shape[0], spec.block[0]) if spec.shape else (1, 1, 1)
        if any(x < 0 for x in strides):  # the engine refuses these; count the whole grid meanwhile
            lo_row, hi_row = 0, (rows0 + block0 - 1) // block0 - 1
        else:
            last = base + sum((n - 1) * x for n, x in zip(lengths, strides, strict=True))
            lo_row = min(base // inner, rows0 - 1) // block0
            hi_row = min(last // inner, rows0 - 1) // block0
        hull[0] = min(hull[0], lo_row)
        hull[1] = max(hull[1], hi_row)
    for spec, (a, b) in acc.items():
        if b < 0:
            continue  # every item of it is empty
        seen = out.get(spec)
        out[spec] = (a, b) if seen is None else (min(seen[0], a), max(seen[1], b))
    return out


def _grid_rows(spec: Dequant) -> int:
    return -(-spec.shape[0] // spec.block[0]) if spec.shape else 1


def scale_read_nbytes(spec: Dequant, rows: tuple[int, int], scale_nbytes: int) -> int:
    """Bytes the engine reads of the scale tensor of ``spec`` (``scale_nbytes`` in all) for grid ``rows``."""
    return (rows[1] - rows[0] + 1) * (scale_nbytes // _grid_rows(spec))


@dataclass(frozen=True)
class DeferredGroup:
    """Work done on whole tensors on this rank: read ``keys`` whole, convert them with torch (the compute is
    the ``LoadContext``'s, at the same position), and copy each claimed output's local part into its target
    (``claims``: output name -> target name). ``nbytes``: each key's whole-tensor bytes."""

    label: str
    keys: tuple[str, ...]
    claims: dict[str, str] = field(default_factory=dict)
    reason: str = ""
    nbytes: tuple[int, ...] = ()


@dataclass(frozen=True)
class LoadPlan:
    """This rank's plan, as plain data: the reads of each region target (by target name), the deferred
    groups, the report, the dequantized keys, and the file of every checkpoint tensor it reads.

    It holds no model, target, open file or closure: it prints (``summary``), pickles and compares (``==``:
    two plannings of the same model and checkpoint are equal). What executing it needs live is in the
    ``LoadContext`` that ``planning.front.plan`` returns with it. Frozen: a part of it is a new plan
    (``dataclasses.replace``).
    """

    region_reads: dict[str, Reads]
    deferred: list[DeferredGroup]
    report: LoadReport
    files: dict[str, str]  # checkpoint key -> the path of the file it is read from (every key the plan reads)
    dequant: dict[str, Dequant] = field(default_factory=dict)  # the quantized keys this rank's reads dequantize
    #: the scale tensors of the region reads' dequantized keys (key -> bytes of the whole tensor); the engine
    #: reads the grid rows the items touch (``touched_scale_rows``)
    scale_nbytes: dict[str, int] = field(default_factory=dict)
    #: each region target's touched scale rows (``_touched``), made on first ask: a memo, not part of the plan
    _memo: dict[str, dict[str, ScaleRows]] = field(default_factory=dict, init=False, repr=False, compare=False)

    def _scale_bytes(self, rows: ScaleRows) -> Iterator[tuple[str, int]]:
        for spec, touched in rows.items():
            yield spec.scale, scale_read_nbytes(spec, touched, self.scale_nbytes[spec.scale])

    def _touched(self) -> dict[str, ScaleRows]:
        """Each region target's touched scale rows, computed once per plan (reports ask for them several times;
        an all-ranks report of a block-fp8 checkpoint spent most of its time here)."""
        cached = self._memo.get("touched")
        if cached is None:
            cached = self._memo["touched"] = {
                name: touched_scale_rows(reads) for name, reads in self.region_reads.items()
            }
        return cached

    def read_bytes_by_file(self) -> dict[str, int]:
        """Bytes of source data this rank's region reads need, per checkpoint file."""
        out: dict[str, int] = {}
        files = self.files
        rows: ScaleRows = {}
        touched = self._touched()
        for name, reads in self.region_reads.items():
            for key, n in zip(reads.keys, reads.nbytes.tolist(), strict=True):
                path = files[key]
                out[path] = out.get(path, 0) + n
            for spec, (a, b) in touched[name].items():
                seen = rows.get(spec)
                rows[spec] = (a, b) if seen is None else (min(seen[0], a), max(seen[1], b))
        for key, n in self._scale_bytes(rows):  # each scale's rows once, however many targets use it
            out[files[key]] = out.get(files[key], 0) + n
        for path, n in self._deferred_bytes():
            out[path] = out.get(path, 0) + n
        return out

    def _deferred_bytes(self) -> Iterator[tuple[str, int]]:
        for deferred in self.deferred:
            for key, n in zip(deferred.keys, deferred.nbytes, strict=True):
                yield self.files[key], n

    def read_bytes_by_target(self) -> dict[str, int]:
        """Source bytes of each region target's reads, the scale grid rows its dequantized items touch
        included."""
        touched = self._touched()
        return {
            name: reads.total_nbytes + sum(n for _, n in self._scale_bytes(touched[name]))
            for name, reads in self.region_reads.items()
        }

    def target_names(self) -> Iterator[str]:
        """Every target the plan fills: the region reads' and the deferred groups' claimed ones."""
        yield from self.region_reads
        for deferred in self.deferred:
            yield from deferred.claims.values()

    @property
    def bytes_needed(self) -> int:
        """Source bytes of the region reads plus the deferred groups' whole tensors."""
        return sum(self.read_bytes_by_target().values()) + sum(n for _, n in self._deferred_bytes())

    def summary(self) -> str:
        lines = [
            f"{len(self.region_reads)} targets as region reads, {len(self.deferred)} deferred groups; "
            f"{self.bytes_needed / 1e6:.2f} MB of {self.report.checkpoint_bytes / 1e6:.2f} MB"
        ]
        for path, nbytes in sorted(self.read_bytes_by_file().items()):
            lines.append(f"  {path}: {nbytes} bytes")
        for d in self.deferred:
            lines.append(f"  deferred {d.label}: {d.reason}")
        return "\n".join(lines)
