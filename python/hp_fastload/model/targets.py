"""Load targets: the model tensors a checkpoint fills, and the global indices this rank holds of each.

A *target* is one physical tensor of the model (a parameter or a persistent buffer) under every name that
reaches it (tied weights and shared modules are one target with several names). For a DTensor, the target
also carries its layout (global shape, mesh shape, this rank's mesh coordinate, placements) and the
:class:`LocalRegion` it implies: per tensor dimension, the global index intervals this rank holds, in the
order they appear in the local tensor.

Regions are computed by ``model.regions.local_region`` without any process group, from the mesh shape and a mesh
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

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor.placement_types import Placement

from hp_fastload.errors import TargetError
from hp_fastload.model.regions import LocalRegion, MeshOverride, local_region
from hp_fastload.model.wrappers import WRAPPED_CHILDREN
from hp_fastload.source.natural import dot_natural_key


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
        if not isinstance(self.tensor, DTensor):
            return self.tensor
        if not torch.is_grad_enabled():  # the loaders' case: no context manager per target
            return self.tensor.to_local()
        with torch.no_grad():
            return self.tensor.to_local()


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


def build_targets(
    model: nn.Module,
    *,
    external_target_fqns: Collection[str] = frozenset(),
    mesh_override: MeshOverride | None = None,
    tensors: ModelTensors | None = None,
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

    ``tensors`` (:func:`model_tensors` of ``model``, made once) skips the walk over the modules: planning many
    virtual ranks of one model builds its targets once per rank.
    """
    by_id, order = tensors if tensors is not None else model_tensors(model)
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


#: :func:`model_tensors`' result: tensor id -> (tensor, its names), and (name, tensor id) in traversal order.
ModelTensors: TypeAlias = tuple[dict[int, tuple[torch.Tensor, list[str]]], list[tuple[str, int]]]


def model_tensors(model: nn.Module) -> ModelTensors:
    """The parameters and persistent buffers of ``model`` as :func:`build_targets` finds them (through
    ``named_modules(remove_duplicate=False)``, wrapper components left out of the names): tensor id ->
    (tensor, names in registration order), and every (name, tensor id) in traversal order."""
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
    return by_id, order


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
