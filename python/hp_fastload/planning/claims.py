"""Claiming converted outputs for model targets: first claim of a physical tensor wins, tied aliases
load with it, shapes are checked, quantized sources are refused where they cannot be read; region outputs
become read items (``planning.intersect.region_items``) and the rest joins deferred groups.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from hp_fastload.convert.groups import LoadGroup
from hp_fastload.convert.quant_info import QuantInfo
from hp_fastload.convert.symbolic import Block
from hp_fastload.errors import TargetError
from hp_fastload.model.targets import Target
from hp_fastload.planning.context import PendingGroup
from hp_fastload.planning.intersect import BlockCache, region_items
from hp_fastload.planning.items import Reads
from hp_fastload.planning.trace import Traced, group_compute
from hp_fastload.source.index import CheckpointIndex


def _check_claim(name: str, target: Target, shape: Sequence[int]) -> None:
    err = getattr(target, "error", None)
    if err:
        raise TargetError(err)
    if tuple(shape) != tuple(target.global_shape):
        raise TargetError(
            f"Shape mismatch for {name}: checkpoint {tuple(shape)} vs target {tuple(target.global_shape)}"
        )


class Claims:
    """Claiming converted outputs for model targets: first claim of a physical tensor wins, aliases load."""

    def __init__(self, index: CheckpointIndex, targets: dict[str, Target], quant: QuantInfo | None = None) -> None:
        self.index = index
        self.targets = targets
        self.quant = quant  # the checkpoint's quantized tensors (None or empty: none)
        self.claimed: set[int] = set()
        self.loaded: set[str] = set()
        self.unexpected: list[str] = []
        self.region_reads: dict[str, tuple[Target, Reads]] = {}
        self.deferred: list[PendingGroup] = []
        self.blocks = BlockCache()  # per-block work on shared traces (see BlockCache)
        #: this rank's intersections of a block list with a region object (``region_items``' ``memo``)
        self.intersections: dict[tuple[int, int], tuple[Any, Any, Reads]] = {}
        #: True when another rank's planning of the same model already checked the quantized claims (shared
        #: planning: ``quant.claimed`` then comes filled, and the checks, rank-independent, are skipped)
        self.quant_checked = False
        #: claimed region outputs whose reads are not made yet (``region`` queues them; ``intersected`` makes
        #: them): claiming decides names and shapes, the intersection with this rank's region can come later
        self.queued: list[tuple[Target, Sequence[Block], dict[str, str] | None]] = []

    @property
    def region_count(self) -> int:
        """The region targets claimed, their reads made or queued."""
        return len(self.region_reads) + len(self.queued)

    def claim(self, name: str, shape: Sequence[int]) -> Target | None:
        target = self.targets.get(name)
        if target is None:
            self.unexpected.append(name)
            return None
        if id(target) in self.claimed:
            self.loaded.update(target.names)
            return None
        _check_claim(name, target, shape)
        self.claimed.add(id(target))
        self.loaded.update(target.names)
        return target

    def region(self, name: str, shape: Sequence[int], blocks: Sequence[Block], sources: dict[str, str] | None) -> None:
        if self.quant and not self.quant_checked and self._unclaimed(name):  # (the sources listed only then:
            # 3,868 of a DeepSeek-V3 rank's 4,835 region outputs are no target or one claimed already)
            srcs = {b.source for b in blocks}
            self._check_quant(name, [sources[s] for s in srcs] if sources is not None else srcs)
        target = self.claim(name, shape)
        if target is not None:
            self.queued.append((target, blocks, sources))

    def intersected(self) -> Iterator[tuple[Target, Reads]]:
        """The queued region outputs' reads, in claim order (each also recorded in ``region_reads``): the
        region intersection and the layout checks of the quantized keys they read (``QuantInfo.read``)."""
        queued, self.queued = self.queued, []
        for i, (target, blocks, sources) in enumerate(queued):
            try:
                items = region_items(target, blocks, self.index, sources, self.blocks, self.intersections)
                if self.quant and self.quant.claimed:  # the layouts of the quantized keys this rank reads
                    self.quant.read(items.keys)
            except BaseException:
                self.queued = queued[i:] + self.queued
                raise
            self.region_reads[target.names[0]] = (target, items)
            yield target, items

    def defer(self, name: str, shape: Sequence[int], pending: PendingGroup) -> None:
        if self.quant and not self.quant_checked:
            self._check_quant(name, pending.keys)
        target = self.claim(name, shape)
        if target is not None:
            pending.claims[name] = target
            if self.quant and self.quant.claimed:  # read whole on this rank
                self.quant.read(pending.keys)

    def _unclaimed(self, name: str) -> bool:
        """True when ``name`` is a model target not claimed yet (the claims whose quantized sources are checked)."""
        target = self.targets.get(name)
        return target is not None and id(target) not in self.claimed

    def _check_quant(self, name: str, sources: Iterable[str]) -> None:
        """A quantized source converted into a target of another dtype is refused (before shapes are checked:
        a packed layout has other shapes than the float tensor it encodes). A supported format into a float
        target is dequantized: its layout is checked, and its ``Dequant`` built, for the keys this rank's reads
        use (``QuantInfo.read`` after ``region_items``), not for every source of the target."""
        if self.quant is None or not self._unclaimed(name):
            return
        self.quant.check_claim(
            name, self.targets[name].dtype, sources, lambda k: self.index.locate(k).dtype, resolve=False
        )

    def add_deferred(self, pending: PendingGroup | None) -> None:
        if pending is not None and pending.claims:
            self.deferred.append(pending)

    def direct(self, group: LoadGroup, traced: Traced, model: Any, names: Sequence[str] | None = None) -> None:
        """Claim a stage's outputs as they are (region reads, or one deferred group for the rest)."""
        pending: PendingGroup | None = None
        for name in names if names is not None else traced.outputs:
            blocks = traced.outputs[name]
            if blocks is not None:
                self.region(name, traced.shapes[name], blocks, traced.sources)
                continue
            if pending is None:
                pending = PendingGroup(group.target, group.keys, group_compute(group, model), reason=traced.reason)
            self.defer(name, traced.shapes[name], pending)
        self.add_deferred(pending)
