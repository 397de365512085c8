"""Load targets: the model tensors a checkpoint fills, and the global indices this rank holds of each.

A *target* is one physical tensor of the model (a parameter or a persistent buffer) under every name that
reaches it (tied weights and shared modules are one target with several names). For a DTensor, the target
also carries its layout (global shape, mesh shape, this rank's mesh coordinate, placements) and the
:class:`LocalRegion` it implies: per tensor dimension, the global index intervals this rank holds, in the
order they appear in the local tensor.

Regions are computed by :func:`local_region` without any process group, from the mesh shape and a mesh
coordinate, so a planner can answer "what does rank r of N read" on one machine ("virtual ranks"). The chunk
rules are torch's own: each Shard-like placement's ``_split_tensor`` is applied to an index list (exactly as
``_StridedShard.local_shard_size_and_offset`` does in torch), and the chunk at this rank's coordinate is
kept. Results are cached per layout, since every layer repeats the same few layouts.

Compared with torch's ``compute_local_shape_and_global_offset``: for ``Shard`` (including several mesh dims
sharding one tensor dim) the region is a single box whose offsets and lengths equal torch's result. For
``_StridedShard`` torch returns the right local shape but only the *first* global index as the offset; the
local shard is really several intervals, which is what :class:`LocalRegion` records. For an empty shard torch
reports the offset as the dimension size; here the dimension simply has no interval.

Errors are recorded lazily on the target (``Target.error``, a message) and raised by :meth:`Target.check`,
:meth:`Target.local`, :attr:`Target.region` and :func:`check_targets`, so a dry-run planner can still build
targets for a model that it will not write. The planner must call :meth:`Target.check` (or
:func:`check_targets`) on every target it will fill before reading any byte.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from .errors import TargetError
from .natural import dot_natural_key

__all__ = [
    "Box",
    "Interval",
    "LocalRegion",
    "MeshOverride",
    "Target",
    "TargetError",
    "build_targets",
    "check_targets",
    "local_region",
    "unique_targets",
    "virtual_rank",
]

#: A half-open interval ``(start, stop)`` of global indices along one dimension.
Interval: TypeAlias = tuple[int, int]
#: ``(global_offsets, lengths, local_offsets)`` of one box, one entry per tensor dimension.
Box: TypeAlias = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
#: ``mesh -> (mesh_shape, coordinate or None)``: the layout of a *virtual* rank on ``mesh``.
MeshOverride: TypeAlias = Callable[[Any], tuple[Sequence[int], Sequence[int] | None]]

#: Dimensions up to this size are split with a real ``torch.arange`` index list; longer ones with exact
#: position arithmetic on meta tensors (same torch chunk calls, no index materialisation).
_ARANGE_LIMIT = 1 << 22


# ---------------------------------------------------------------------------------------------------------
# Natural key


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
    def is_box(self) -> bool:
        """True when the region is one box (at most one interval per dimension)."""
        return all(len(dim) <= 1 for dim in self.intervals)

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


# ---------------------------------------------------------------------------------------------------------
# Region computation (no process group)

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


def _dim_intervals_arange(size: int, steps: tuple[_Step, ...]) -> tuple[Interval, ...]:
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


def _dim_intervals_lazy(size: int, steps: tuple[_Step, ...]) -> tuple[Interval, ...]:
    """Same result as :func:`_dim_intervals_arange`, without materialising ``size`` indices."""
    current: list[Interval] = [(0, size)] if size > 0 else []
    for placement, num_chunks, chunk in steps:
        n = sum(b - a for a, b in current)
        positions = _step_positions(placement, num_chunks, chunk, n)
        if positions is None:
            return _dim_intervals_arange(size, steps)
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


@functools.lru_cache(maxsize=65536)
def _dim_intervals(size: int, steps: tuple[_Step, ...]) -> tuple[Interval, ...]:
    if not steps:
        return ((0, size),) if size > 0 else ()
    if size > _ARANGE_LIMIT:
        return _dim_intervals_lazy(size, steps)
    return _dim_intervals_arange(size, steps)


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
    in mesh-dim order with torch's own splitting (``_StridedShard`` included); ``Replicate`` keeps
    everything; ``Partial`` (and any other placement type) raises :class:`TargetError`, as do mismatched
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


# ---------------------------------------------------------------------------------------------------------
# Targets


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


@dataclass(eq=False)
class Target:
    """One physical model tensor to fill, under every name that reaches it.

    ``region`` is what this (possibly virtual) rank holds of ``global_shape``. ``error`` is a message when
    the tensor cannot be loaded (meta or uninitialized, Partial, unsupported layout or placement, a local
    shard whose shape disagrees with the region, a plain tensor carrying a ``_sharding_spec``); :meth:`check`
    and :meth:`local` then raise :class:`TargetError` with it, and so does :attr:`region` when no region
    could be computed (Partial, bad layout, uninitialized). ``virtual`` is True when the layout came from a
    ``mesh_override``: such a target has no writable local tensor, and meta storage is not an error for it.
    ``placements``, ``mesh_shape`` and ``coordinate`` are None for plain tensors (whose region is full).
    """

    names: tuple[str, ...]
    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    is_dtensor: bool
    placements: tuple[Placement, ...] | None = None
    mesh_shape: tuple[int, ...] | None = None
    coordinate: tuple[int, ...] | None = None
    error: str | None = None
    virtual: bool = False
    _region: LocalRegion | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        """The first name (registration order)."""
        return self.names[0]

    @property
    def region(self) -> LocalRegion:
        """The global indices held locally; raises :class:`TargetError` when it could not be computed."""
        if self._region is None:
            raise TargetError(self.error or f"no region for target {self.name}")
        return self._region

    @property
    def is_meta(self) -> bool:
        """True when the (local) storage is on the meta device."""
        return self.device.type == "meta"

    def check(self) -> None:
        """Raise :class:`TargetError` if this target cannot be loaded."""
        if self.error is not None:
            raise TargetError(self.error)

    def local(self) -> torch.Tensor:
        """The tensor to write into: the DTensor's local shard (``to_local()``) or the plain tensor itself.

        For FSDP2 parameters the local shard is a view into FSDP's sharded storage, so writing into it (under
        ``torch.no_grad()``) changes the parameter.
        """
        self.check()
        if self.virtual:
            raise TargetError(f"target {self.name} has a virtual layout (mesh_override); nothing to write")
        with torch.no_grad():
            if isinstance(self.tensor, DTensor):
                return self.tensor.to_local()
            return self.tensor


def _is_uninitialized(t: torch.Tensor) -> bool:
    return isinstance(t, nn.parameter.UninitializedParameter | nn.parameter.UninitializedBuffer)


#: What one DTensor layout resolves to on this (virtual) rank: mesh shape, coordinate, region or an error
#: template (``{name}`` is filled in per target).
_Layout: TypeAlias = tuple[tuple[int, ...], tuple[int, ...] | None, LocalRegion | None, str | None]


class _LayoutResolver:
    """Per-:func:`build_targets` caches: mesh -> (shape, coordinate), and DTensor layout -> region."""

    def __init__(self, mesh_override: MeshOverride | None) -> None:
        self.mesh_override = mesh_override
        self.meshes: dict[int, tuple[Any, tuple[int, ...], tuple[int, ...] | None]] = {}
        self.layouts: dict[tuple[Any, ...], _Layout] = {}

    def mesh(self, mesh: Any) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
        hit = self.meshes.get(id(mesh))
        if hit is not None and hit[0] is mesh:
            return hit[1], hit[2]
        if self.mesh_override is not None:
            shape, coord = self.mesh_override(mesh)
        else:
            shape, coord = mesh.shape, mesh.get_coordinate()
        mesh_shape = tuple(int(s) for s in shape)
        coordinate = None if coord is None else tuple(int(c) for c in coord)
        self.meshes[id(mesh)] = (mesh, mesh_shape, coordinate)  # keeps mesh alive: ids stay unique
        return mesh_shape, coordinate

    def layout(self, global_shape: torch.Size, mesh: Any, placements: tuple[Placement, ...]) -> _Layout:
        key = (global_shape, id(mesh), placements)
        hit = self.layouts.get(key)
        if hit is not None:
            return hit
        mesh_shape, coordinate = self.mesh(mesh)
        region: LocalRegion | None = None
        error: str | None = None
        if any(isinstance(p, Partial) for p in placements):
            error = "Partial placement is not supported for pretrained loading: {name}"
        else:
            try:
                region = local_region(global_shape, mesh_shape, coordinate, placements)
            except TargetError as exc:
                error = str(exc).replace("{", "{{").replace("}", "}}") + ": {name}"
        layout = (mesh_shape, coordinate, region, error)
        self.layouts[key] = layout
        return layout


def _make_target(names: list[str], tensor: torch.Tensor, resolver: _LayoutResolver) -> Target:
    name = names[0]
    virtual = resolver.mesh_override is not None
    if isinstance(tensor, DTensor):
        local = tensor._local_tensor
        placements = tensor.placements
        global_shape = tensor.shape
        mesh_shape, coordinate, region, error = resolver.layout(global_shape, tensor.device_mesh, placements)
        target = Target(
            tuple(names),
            tensor,
            tuple(global_shape),
            tensor.dtype,
            local.device,
            True,
            placements,
            mesh_shape,
            coordinate,
            virtual=virtual,
            _region=region,
        )
        if error is not None:
            target.error = error.format(name=name)
            return target
        assert region is not None
        if not virtual and coordinate is not None and local.shape != region.local_shape:
            target.error = (
                f"local shard of {name} has shape {tuple(local.shape)} but its layout {placements} on mesh "
                f"{mesh_shape} at {coordinate} implies {region.local_shape}"
            )
            return target
    elif _is_uninitialized(tensor):
        return Target(
            tuple(names),
            tensor,
            (),
            tensor.dtype,
            torch.device("meta"),
            False,
            error=f"target must be materialized before loading: {name}",
            virtual=virtual,
        )
    else:
        target = Target(
            tuple(names),
            tensor,
            tuple(tensor.shape),
            tensor.dtype,
            tensor.device,
            False,
            virtual=virtual,
            _region=LocalRegion.full(tensor.shape),
        )
        spec = getattr(tensor, "_sharding_spec", None)
        if spec is not None:
            target.error = (
                f"target {name} is a plain tensor with a _sharding_spec ({type(spec).__name__}); "
                "only DTensor layouts are supported"
            )
            return target
    if not virtual and target.device.type == "meta":
        target.error = f"target must be materialized before loading: {name}"
    return target


#: Child names of forwarding wrappers that no checkpoint has, dropped from target names as torch's own
#: ``get_model_state_dict`` drops them: ``torch.compile``'s ``_orig_mod`` (torchtitan compiles each block) and
#: activation checkpointing's ``_checkpoint_wrapped_module``. Both wrappers forward attribute lookups, so
#: ``model.get_parameter`` of the name without them still reaches the tensor.
WRAPPED_CHILDREN = frozenset({"_orig_mod", "_checkpoint_wrapped_module"})


def build_targets(
    model: nn.Module,
    *,
    external_target_fqns: Collection[str] = frozenset(),
    mesh_override: MeshOverride | None = None,
) -> dict[str, Target]:
    """Map every load-target name of ``model`` to its :class:`Target` (aliases share one object).

    Targets are parameters and persistent buffers, found through ``named_modules(remove_duplicate=False)``
    so that shared modules and tied tensors appear under every path (without the wrapper components of
    :data:`WRAPPED_CHILDREN`); names reaching the same tensor object
    are one target, ``names`` in registration order. The dict is in traversal order (module by module, root
    first; within a module parameters, then buffers).

    ``external_target_fqns`` names tensors filled by someone else: each must be a parameter or persistent
    buffer name (else ``ValueError`` naming the unknown ones); the physical tensor it names is excluded
    under all its names.

    ``mesh_override(mesh) -> (mesh_shape, coordinate)`` replaces the real mesh shape and this rank's
    coordinate (``None`` = not in the mesh) for every DTensor, to plan for a virtual rank; see
    :func:`virtual_rank`. Placements are kept as they are, so the caller must keep them meaningful (e.g. a
    ``_StridedShard`` split factor matches the mesh it was made for). Virtual targets cannot be written and
    meta tensors are not an error for them.

    Problems are recorded on the target (``Target.error``), not raised here; see :func:`check_targets`.
    """
    by_id: dict[int, tuple[torch.Tensor, list[str]]] = {}
    order: list[tuple[str, int]] = []
    canonical: dict[str, str] = {"": ""}
    for module_name, module in model.named_modules(remove_duplicate=False):
        if module_name:
            parent, _, leaf = module_name.rpartition(".")
            above = canonical[parent]
            canonical[module_name] = above if leaf in WRAPPED_CHILDREN else f"{above}.{leaf}" if above else leaf
        prefix = f"{canonical[module_name]}." if canonical[module_name] else ""
        for key, param in module._parameters.items():
            if param is not None:
                by_id.setdefault(id(param), (param, []))[1].append(prefix + key)
                order.append((prefix + key, id(param)))
        non_persistent = module._non_persistent_buffers_set
        for key, buf in module._buffers.items():
            if buf is not None and key not in non_persistent:
                by_id.setdefault(id(buf), (buf, []))[1].append(prefix + key)
                order.append((prefix + key, id(buf)))

    external = set(external_target_fqns)
    if external:
        known = {name for _, names in by_id.values() for name in names}
        unknown = sorted(external - known, key=dot_natural_key)
        if unknown:
            raise ValueError(
                f"external_target_fqns names {len(unknown)} tensor(s) the model does not have "
                f"(parameters and persistent buffers only): {', '.join(unknown)}"
            )

    resolver = _LayoutResolver(mesh_override)
    by_tensor: dict[int, Target] = {}
    for key, (tensor, names) in by_id.items():
        if not external or external.isdisjoint(names):
            by_tensor[key] = _make_target(names, tensor, resolver)
    return {name: by_tensor[key] for name, key in order if key in by_tensor}


def unique_targets(targets: Mapping[str, Target]) -> list[Target]:
    """The distinct targets of a :func:`build_targets` result, in registration order."""
    seen: dict[int, Target] = {}
    for target in targets.values():
        seen.setdefault(id(target), target)
    return list(seen.values())


def check_targets(targets: Mapping[str, Target], names: Iterable[str] | None = None) -> None:
    """Raise :class:`TargetError` for the targets (all, or those reaching ``names``) that cannot be loaded.

    The message lists every bad target, first in natural order first.
    """
    chosen = unique_targets(targets) if names is None else unique_targets({n: targets[n] for n in names})
    errors = sorted((t for t in chosen if t.error is not None), key=lambda t: dot_natural_key(t.name))
    if len(errors) == 1:
        raise TargetError(errors[0].error)
    if errors:
        lines = "\n  ".join(str(t.error) for t in errors)
        raise TargetError(f"{len(errors)} targets cannot be loaded:\n  {lines}")
