"""Local regions: the global indices of a tensor that this rank holds under a DTensor layout (``Shard``,
``_StridedShard``, several mesh dims on one tensor dim, uneven chunks), asked of torch's own chunking, and
``virtual_rank`` to lay out any rank of a mesh on one machine.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from hp_fastload.errors import TargetError

#: A half-open interval ``(start, stop)`` of global indices along one dimension.
Interval: TypeAlias = tuple[int, int]


#: ``(global_offsets, lengths, local_offsets)`` of one box, one entry per tensor dimension.
Box: TypeAlias = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


#: ``mesh -> (mesh_shape, coordinate or None)``: the layout of a *virtual* rank on ``mesh``.
MeshOverride: TypeAlias = Callable[[Any], tuple[Sequence[int], Sequence[int] | None]]


#: Dimensions up to this size are split with a real ``torch.arange`` index list; longer ones with exact
#: position arithmetic on meta tensors (same torch chunk calls, no index materialisation).
ARANGE_LIMIT = 1 << 22


@dataclass(frozen=True)
class LocalRegion:
    """The global indices one rank holds of one tensor.

    ``intervals[d]`` lists half-open global intervals along dimension ``d`` in local order: the local tensor
    along ``d`` is the concatenation of those intervals, and the local tensor is their Cartesian product.
    A plain box has one interval per dimension; ``_StridedShard`` (or two mesh dims interleaving one tensor
    dim) can give several. A dimension with no interval (or an empty one) means the rank holds nothing.
    ``in_mesh`` is False for a rank outside the tensor's mesh (it then holds nothing, even of a scalar).
    """

    global_shape: tuple[int, ...]
    intervals: tuple[tuple[Interval, ...], ...]
    in_mesh: bool = True

    @staticmethod
    def full(global_shape: Sequence[int]) -> LocalRegion:
        """The region of a rank holding the whole tensor (plain tensors, replicated DTensors)."""
        shape = tuple(int(s) for s in global_shape)
        return LocalRegion(shape, tuple(((0, s),) if s > 0 else () for s in shape))

    @staticmethod
    def empty(global_shape: Sequence[int]) -> LocalRegion:
        """The region of a rank outside the mesh: nothing."""
        shape = tuple(int(s) for s in global_shape)
        return LocalRegion(shape, tuple(() for _ in shape), in_mesh=False)

    @functools.cached_property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of the local tensor (0 along a dimension with no interval)."""
        return tuple(sum(b - a for a, b in dim) for dim in self.intervals)

    @functools.cached_property
    def numel(self) -> int:
        """Number of elements held locally."""
        return math.prod(self.local_shape) if self.in_mesh else 0

    @property
    def is_empty(self) -> bool:
        """True when this rank holds no element."""
        return self.numel == 0

    @property
    def is_full(self) -> bool:
        """True when this rank holds the whole tensor."""
        return self.in_mesh and self.local_shape == self.global_shape

    @functools.cached_property
    def _dim_pieces(self) -> tuple[tuple[tuple[int, int, int], ...], ...]:
        """Per dimension, ``(global_start, length, local_start)`` of every non-empty interval."""
        out = []
        for dim in self.intervals:
            pieces = []
            local = 0
            for a, b in dim:
                if b > a:
                    pieces.append((a, b - a, local))
                    local += b - a
            out.append(tuple(pieces))
        return tuple(out)

    @functools.cached_property
    def _merged(self) -> tuple[tuple[Interval, ...], ...]:
        """Per dimension, the intervals sorted by global start with touching ones merged."""
        out = []
        for dim in self.intervals:
            merged: list[list[int]] = []
            for a, b in sorted(iv for iv in dim if iv[1] > iv[0]):
                if merged and a <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], b)
                else:
                    merged.append([a, b])
            out.append(tuple((a, b) for a, b in merged))
        return tuple(out)

    def boxes(self) -> Iterator[Box]:
        """Yield ``(global_offsets, lengths, local_offsets)`` for every combination of intervals.

        The boxes tile the local tensor exactly; none is yielded when the region is empty. A scalar held
        locally yields one box ``((), (), ())``.
        """
        if self.is_empty:
            return
        for combo in itertools.product(*self._dim_pieces):
            yield (
                tuple(p[0] for p in combo),
                tuple(p[1] for p in combo),
                tuple(p[2] for p in combo),
            )

    def intersect(self, offsets: Sequence[int], lengths: Sequence[int]) -> Iterator[Box]:
        """Yield the parts of the global box ``(offsets, lengths)`` held here, as ``boxes()`` entries."""
        self._check_ndim(offsets, lengths)
        if self.is_empty:
            return
        per_dim = []
        for pieces, o, n in zip(self._dim_pieces, offsets, lengths, strict=True):
            hits = []
            for g, length, loc in pieces:
                a = max(g, o)
                b = min(g + length, o + n)
                if b > a:
                    hits.append((a, b - a, loc + a - g))
            if not hits:
                return
            per_dim.append(hits)
        for combo in itertools.product(*per_dim):
            yield (
                tuple(p[0] for p in combo),
                tuple(p[1] for p in combo),
                tuple(p[2] for p in combo),
            )

    def contains(self, offsets: Sequence[int], lengths: Sequence[int]) -> bool:
        """True when every element of the global box ``(offsets, lengths)`` is held here (an empty box is)."""
        self._check_ndim(offsets, lengths)
        if any(n <= 0 for n in lengths):
            return True
        if not self.in_mesh:
            return False
        for merged, o, n in zip(self._merged, offsets, lengths, strict=True):
            if not any(a <= o and o + n <= b for a, b in merged):
                return False
        return True

    def _check_ndim(self, offsets: Sequence[int], lengths: Sequence[int]) -> None:
        if len(offsets) != len(self.global_shape) or len(lengths) != len(self.global_shape):
            raise ValueError(
                f"box rank mismatch: offsets {tuple(offsets)} / lengths {tuple(lengths)} "
                f"for a tensor of shape {self.global_shape}"
            )


#: One sharding step on one tensor dim: (placement, number of chunks = mesh dim size, chunk index).
_Step: TypeAlias = tuple["Shard | _StridedShard", int, int]


def _compress(index: torch.Tensor) -> tuple[Interval, ...]:
    """Turn a 1-D index list into maximal runs of consecutive indices, in order."""
    n = index.numel()
    if n == 0:
        return ()
    breaks = (torch.nonzero(index[1:] - index[:-1] != 1).flatten() + 1).tolist()
    starts = [0, *breaks]
    stops = [*breaks, n]
    first = index[starts].tolist()
    last = index[[s - 1 for s in stops]].tolist()
    return tuple((int(a), int(b) + 1) for a, b in zip(first, last, strict=True))


def dim_intervals_arange(size: int, steps: tuple[_Step, ...]) -> tuple[Interval, ...]:
    """Apply each step's ``_split_tensor`` to the index list ``arange(size)`` and keep the chosen chunk.

    The index list is laid along the placement's dim (size 1 elsewhere), as torch's own
    ``_StridedShard.local_shard_size_and_offset`` does.
    """
    index = torch.arange(size)
    for placement, num_chunks, chunk in steps:
        view = index.view([1] * placement.dim + [index.numel()])
        shards, _ = placement._split_tensor(view, num_chunks, with_padding=False, contiguous=False)
        index = shards[chunk].reshape(-1)
    return _compress(index)


def _narrow_position(piece: torch.Tensor, dim: int) -> Interval:
    """``(start, stop)`` positions of a narrowed view of a 1-long-elsewhere meta tensor."""
    start = int(piece.storage_offset())
    return (start, start + int(piece.shape[dim]))


def _step_positions(placement: Shard | _StridedShard, num_chunks: int, chunk: int, n: int) -> list[Interval] | None:
    """Positions (in the current index list of length ``n``) that ``placement`` keeps for ``chunk``.

    Uses the same torch chunk calls as the placement's ``_split_tensor``, on a meta tensor, and reads the
    chunk boundaries from the views' storage offsets. Returns None for placement types it does not know
    (subclasses included), which then take the exact ``arange`` path.
    """
    dim: int = placement.dim
    base = torch.empty([1] * dim + [n], device="meta")
    if type(placement) is Shard:
        shards, _ = placement._split_tensor(base, num_chunks, with_padding=False, contiguous=False)
        return [_narrow_position(shards[chunk], dim)]
    if type(placement) is _StridedShard:
        # _StridedShard._split_tensor: chunk into split_factor pieces, chunk each piece into num_chunks,
        # and chunk i is the concatenation over pieces of their i-th sub-chunk.
        out = []
        for piece in Shard._custom_chunk(base, placement._split_factor_int(), dim=dim):
            sub = Shard._custom_chunk(piece, num_chunks, dim=dim)[chunk]
            out.append(_narrow_position(sub, dim))
        return out
    return None


def dim_intervals_lazy(size: int, steps: tuple[_Step, ...]) -> tuple[Interval, ...]:
    """Same result as :func:`dim_intervals_arange`, without materialising ``size`` indices."""
    current: list[Interval] = [(0, size)] if size > 0 else []
    for placement, num_chunks, chunk in steps:
        n = sum(b - a for a, b in current)
        positions = _step_positions(placement, num_chunks, chunk, n)
        if positions is None:
            return dim_intervals_arange(size, steps)
        # Map positions in the current list back to global intervals.
        starts = list(itertools.accumulate((b - a for a, b in current), initial=0))
        selected: list[Interval] = []
        for p0, p1 in positions:
            for (a, b), s in zip(current, starts, strict=False):
                lo, hi = max(p0, s), min(p1, s + (b - a))
                if hi > lo:
                    g0, g1 = a + lo - s, a + hi - s
                    if selected and selected[-1][1] == g0:
                        selected[-1] = (selected[-1][0], g1)
                    else:
                        selected.append((g0, g1))
        current = selected
    return tuple(current)


def dim_intervals_chunks(size: int, steps: tuple[_Step, ...]) -> tuple[Interval, ...] | None:
    """Same result as :func:`dim_intervals_arange` when every step is a plain ``Shard`` (None otherwise), in
    closed form: ``Shard._split_tensor`` is ``torch.chunk`` (chunks of ``ceil(n / k)``, the last ones shorter or
    empty), and a chunk of a contiguous run is a contiguous run. FSDP's rows of a 1,024-way job are planned
    per rank without a torch call (the arange path cost ~2 ms per rank and layout)."""
    a, b = 0, size
    for placement, num_chunks, chunk in steps:
        if type(placement) is not Shard:
            return None
        c = -(-(b - a) // num_chunks)
        start = a + chunk * c
        a, b = start, min(b, start + c)
        if b <= a:
            return ()
    return ((a, b),)


@functools.lru_cache(maxsize=65536)
def _dim_intervals(size: int, steps: tuple[_Step, ...]) -> tuple[Interval, ...]:
    if not steps:
        return ((0, size),) if size > 0 else ()
    chunks = dim_intervals_chunks(size, steps)
    if chunks is not None:
        return chunks
    if size > ARANGE_LIMIT:
        return dim_intervals_lazy(size, steps)
    return dim_intervals_arange(size, steps)


def _normalized_shard(placement: Shard | _StridedShard, ndim: int) -> Shard | _StridedShard:
    """The placement with a non-negative ``dim`` (DTensor normalizes already; hand-made ones may not)."""
    dim: int = placement.dim
    if not -ndim <= dim < ndim:
        raise TargetError(f"{placement} shards dim {dim} of a {ndim}-d tensor")
    if dim >= 0:
        return placement
    if isinstance(placement, _StridedShard):
        return _StridedShard(dim + ndim, split_factor=placement._split_factor_int())
    return Shard(dim + ndim)


@functools.lru_cache(maxsize=65536)
def _local_region_cached(
    global_shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    coordinate: tuple[int, ...] | None,
    placements: tuple[Placement, ...],
) -> LocalRegion:
    ndim = len(global_shape)
    if any(s < 0 for s in global_shape):
        raise TargetError(f"negative size in global shape {global_shape}")
    if len(placements) != len(mesh_shape):
        raise TargetError(f"{len(placements)} placements for a {len(mesh_shape)}-d mesh {mesh_shape}")
    steps: list[list[_Step]] = [[] for _ in range(ndim)]
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Partial):
            raise TargetError(f"Partial placement is not supported for pretrained loading: {placement}")
        if isinstance(placement, Shard | _StridedShard):
            placement = _normalized_shard(placement, ndim)
            chunk = 0 if coordinate is None else coordinate[mesh_dim]
            steps[placement.dim].append((placement, mesh_shape[mesh_dim], chunk))
        elif not isinstance(placement, Replicate):
            raise TargetError(f"unsupported placement {placement!r}")
    if coordinate is None:
        return LocalRegion.empty(global_shape)
    if len(coordinate) != len(mesh_shape) or not all(0 <= c < s for c, s in zip(coordinate, mesh_shape, strict=True)):
        raise TargetError(f"coordinate {coordinate} is not in a mesh of shape {mesh_shape}")
    intervals = tuple(_dim_intervals(size, tuple(st)) for size, st in zip(global_shape, steps, strict=True))
    return LocalRegion(global_shape, intervals)


def local_region(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int] | None,
    placements: Sequence[Placement],
) -> LocalRegion:
    """The region that the rank at ``coordinate`` of a ``mesh_shape`` mesh holds of a DTensor.

    ``placements`` has one entry per mesh dim (as ``DTensor.placements``). Shard-like placements are applied
    in mesh-dim order with torch's own splitting (``_StridedShard`` included; plain ``Shard`` steps in its
    closed form, ``dim_intervals_chunks``, tested equal); ``Replicate`` keeps everything; ``Partial`` (and any
    other placement type) raises :class:`TargetError`, as do mismatched
    lengths and a coordinate outside the mesh. Negative shard dims are normalized. ``coordinate=None`` is a
    rank outside the mesh: the region is empty (``in_mesh=False``). No process group is needed. Results are
    cached per layout (the same object is returned for the same arguments).
    """
    return _local_region_cached(
        tuple(int(s) for s in global_shape),
        tuple(int(s) for s in mesh_shape),
        None if coordinate is None else tuple(int(c) for c in coordinate),
        tuple(placements),
    )


def _mesh_groups(mesh: Any) -> torch.Tensor:
    """Global ranks of every copy of ``mesh`` in the world, shape ``(copies, *mesh.shape)``.

    A sub-mesh (``mesh["tp"]``) object only lists the ranks of its own group in ``mesh.mesh``; torch keeps
    the full picture as a layout over the root mesh's rank map (private ``_layout`` / ``_rank_map``, torch
    >= 2.9). Without those, only ``mesh.mesh`` is known (a root mesh, or this rank's own group).
    """
    layout = getattr(mesh, "_layout", None)
    rank_map = getattr(mesh, "_rank_map", None)
    if layout is not None and rank_map is not None and hasattr(layout, "remap_to_tensor"):
        groups = layout.remap_to_tensor(rank_map)
        if groups.ndim == mesh.ndim + 1:
            return groups
    ranks: torch.Tensor = mesh.mesh
    return ranks.unsqueeze(0)


def mesh_coordinates(mesh: Any) -> tuple[tuple[int, ...], dict[int, tuple[int, ...]]]:
    """``(mesh shape, {global rank: its coordinate})`` over every copy of ``mesh`` (``virtual_rank`` for all
    ranks at once); ranks absent from every copy are absent from the dict."""
    groups = _mesh_groups(mesh)
    shape = tuple(int(s) for s in groups.shape[1:])
    flat = groups.reshape(groups.shape[0], -1).tolist()
    coords = list(itertools.product(*map(range, shape)))
    out: dict[int, tuple[int, ...]] = {}
    for copy in flat:
        for position, rank in enumerate(copy):
            out.setdefault(int(rank), coords[position])
    return shape, out


def virtual_rank(rank: int) -> MeshOverride:
    """A ``mesh_override`` that places global rank ``rank`` on every mesh (``None`` where it is absent).

    The coordinate is found among all copies of the mesh (so a sub-mesh such as ``mesh["tp"]`` places ranks
    of other TP groups too). Any process that built the model over the full world (a real rank, or one
    process under a ``fake`` process group of the full world size) can thus plan for any rank.
    """

    def override(mesh: Any) -> tuple[Sequence[int], Sequence[int] | None]:
        groups = _mesh_groups(mesh)
        hits = (groups == rank).nonzero()
        coordinate = None if hits.numel() == 0 else tuple(int(c) for c in hits[0, 1:].tolist())
        return tuple(groups.shape[1:]), coordinate

    return override
