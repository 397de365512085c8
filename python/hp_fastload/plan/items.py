"""The plan's data: ``ReadItem`` (one strided box of a checkpoint tensor into a box of a target),
``TemplateReads`` (a target's items as arrays), ``DeferredGroup`` (work done on whole tensors), ``LoadPlan``
(one rank's plan) and ``LoadReport`` (what a load did). Builds nothing: planning lives in the sibling modules.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from ..engine import SafetensorsFile
from ..index import CheckpointIndex
from ..quant import Dequant
from ..targets import Target

if TYPE_CHECKING:
    from .regions import Template

__all__ = ["Columns", "DeferredGroup", "LoadPlan", "LoadReport", "ReadItem", "TemplateReads"]


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

    def summary(self) -> str:
        rate = self.bytes_read / self.seconds / 1e9 if self.seconds > 0 else 0.0
        text = (
            f"{self.loader or 'hp_fastload'}: loaded {len(self.loaded_keys)} tensors, "
            f"missing {len(self.missing_keys)}, unexpected {len(self.unexpected_keys)}; "
            f"read {self.bytes_read / 1e6:.1f} MB of {self.checkpoint_bytes / 1e6:.1f} MB checkpoint "
            f"in {self.seconds:.3f} s ({rate:.2f} GB/s); {self.region_targets} region targets, "
            f"{len(self.deferred_targets)} deferred"
        )
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


class Columns(NamedTuple):
    """A template list as arrays, one row per block (blocks of one rank only): what packing and read
    accounting need, built once per shared trace."""

    base: np.ndarray[Any, np.dtype[np.int64]]  # (n,) flat source index of each block's first element
    strides: np.ndarray[Any, np.dtype[np.int64]]  # (n, ndim) source element strides per region dim
    lengths: np.ndarray[Any, np.dtype[np.int64]]  # (n, ndim)
    offsets: np.ndarray[Any, np.dtype[np.int64]]  # (n, ndim) region offsets
    nbytes: np.ndarray[Any, np.dtype[np.int64]]  # (n,) source bytes each block reads


class TemplateReads(Sequence[ReadItem]):
    """The read items of a target that takes whole blocks of a shared trace, held as arrays.

    Item ``i`` is template ``rows[i]`` (all templates when ``rows`` is None) with its source renamed to
    ``keys[i]`` and its destination moved by ``shift``. A stacked-experts target has ~10^3 items per layer,
    all alike but for the key: the arrays are built once per trace and shared by every layer, and packing and
    read accounting use them without a ``ReadItem`` per box. Indexing or iterating builds the ``ReadItem``s,
    equal to what the general intersection makes (tests compare both).
    """

    __slots__ = ("_columns", "_templates", "keys", "rows", "shift")

    def __init__(
        self,
        templates: Sequence[Template],
        columns: Columns,
        rows: np.ndarray[Any, np.dtype[np.int64]] | None,
        keys: list[str],
        shift: tuple[int, ...] | None,
    ) -> None:
        self._templates = templates
        self._columns = columns
        self.rows = rows
        self.keys = keys
        self.shift = shift

    def __len__(self) -> int:
        return len(self.keys)

    def _item(self, i: int) -> ReadItem:
        _, base, strides, lengths, offsets, post = self._templates[i if self.rows is None else int(self.rows[i])]
        if self.shift is not None:
            offsets = tuple(o + s for o, s in zip(offsets, self.shift, strict=True))
        return ReadItem(self.keys[i], base, strides, lengths, offsets, post)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self._item(j) for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self._item(i)

    def __iter__(self) -> Iterator[ReadItem]:
        return (self._item(i) for i in range(len(self)))

    def column(self, name: str) -> np.ndarray[Any, np.dtype[np.int64]]:
        """One of ``base``, ``strides``, ``lengths``, ``offsets`` (moved by ``shift``), ``nbytes``: one row
        per item."""
        col = getattr(self._columns, name)
        if self.rows is not None:
            col = col[self.rows]
        if name == "offsets" and self.shift is not None:
            col = col + np.asarray(self.shift, dtype=np.int64)
        return col

    @property
    def nbytes(self) -> int:
        """Source bytes these items read."""
        return int(self.column("nbytes").sum())

    def __repr__(self) -> str:
        return f"TemplateReads({len(self)} items, first {self.keys[0] if self.keys else None!r})"


@dataclass
class DeferredGroup:
    """Work done on whole tensors on this rank: read ``keys`` whole, ``compute`` the converted outputs with
    torch, and copy each claimed output's local part into its target (``claims``: output name -> target)."""

    label: str
    keys: list[str]
    compute: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
    claims: dict[str, Target] = field(default_factory=dict)
    reason: str = ""


@dataclass
class LoadPlan:
    """This rank's plan: region reads per target, deferred groups, the report, the rules that fired."""

    index: CheckpointIndex
    targets: dict[str, Target]
    region_reads: dict[str, tuple[Target, Sequence[ReadItem]]]  # a list, or TemplateReads
    deferred: list[DeferredGroup]
    report: LoadReport
    used_rules: list[Any]
    model: Any = None
    used_base_rules: list[Any] = field(default_factory=list)
    used_replacement_rules: list[Any] = field(default_factory=list)
    dequant: dict[str, Dequant] = field(default_factory=dict)  # quantized keys read dequantized (quant.py)

    def read_bytes_by_file(self) -> dict[str, int]:
        """Bytes of source data this rank's region reads need, per checkpoint file."""
        by_file: dict[SafetensorsFile, int] = {}
        locate = self.index.locate
        for _, items in self.region_reads.values():
            if isinstance(items, TemplateReads):
                for key, n in zip(items.keys, items.column("nbytes").tolist(), strict=True):
                    file = locate(key)[0]
                    by_file[file] = by_file.get(file, 0) + n
                continue
            for item in items:
                file, _, dtype = locate(item.source)
                by_file[file] = by_file.get(file, 0) + item.numel * dtype.itemsize
        out: dict[str, int] = {}
        for file, n in by_file.items():
            out[file.path] = out.get(file.path, 0) + n
        for path, n in self._deferred_bytes():
            out[path] = out.get(path, 0) + n
        return out

    def _deferred_bytes(self) -> Iterator[tuple[str, int]]:
        for deferred in self.deferred:
            for key in deferred.keys:
                entry = self.index.entry(key)
                yield entry.file.path, entry.nbytes

    def read_bytes_by_target(self) -> dict[str, int]:
        out: dict[str, int] = {}
        locate = self.index.locate
        for name, (_, items) in self.region_reads.items():
            if isinstance(items, TemplateReads):
                out[name] = items.nbytes
            else:
                out[name] = sum(i.numel * locate(i.source)[2].itemsize for i in items)
        return out

    @property
    def bytes_needed(self) -> int:
        """Source bytes of the region reads plus the deferred groups' whole tensors."""
        return sum(self.read_bytes_by_target().values()) + sum(n for _, n in self._deferred_bytes())

    def summary(self) -> str:
        lines = [
            f"{len(self.region_reads)} targets as region reads, {len(self.deferred)} deferred groups; "
            f"{self.bytes_needed / 1e6:.2f} MB of {self.index.total_bytes / 1e6:.2f} MB"
        ]
        for path, nbytes in sorted(self.read_bytes_by_file().items()):
            lines.append(f"  {path}: {nbytes} bytes")
        for d in self.deferred:
            lines.append(f"  deferred {d.label}: {d.reason}")
        return "\n".join(lines)
