"""Targets and local regions: pure checks against torch's own layout code, then real DTensors on 4 gloo ranks.

The distributed checks (``distribute_tensor`` layouts, FSDP2, FSDP2 x TP, sub-meshes, Partial, meta) run once
in one spawned 4-rank run (module-scoped fixture); each test asserts one sub-check. Two small extra spawns
exercise the harness itself (a failing rank, a hanging rank).
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from hp_fastload.model import regions as targets_mod
from hp_fastload.model.regions import LocalRegion, local_region, virtual_rank
from hp_fastload.model.targets import Target, TargetError, build_targets, check_targets, unique_targets
from hp_fastload.source.natural import dot_natural_key
from tests.helpers.dist import SubcheckOutcome, run_distributed, run_subchecks, subcheck_values

WORLD = 4

# ---------------------------------------------------------------------------------------------------------
# Helpers shared by the parent and the ranks


def _one_box(region: LocalRegion) -> bool:
    """At most one interval per dimension."""
    return all(len(dim) <= 1 for dim in region.intervals)


def _gather(full: torch.Tensor, region: LocalRegion) -> torch.Tensor:
    """``full`` restricted to ``region`` by index lists (interval order = local order)."""
    out = full
    for d, ivs in enumerate(region.intervals):
        idx = [i for a, b in ivs for i in range(a, b)]
        out = out.index_select(d, torch.tensor(idx, dtype=torch.long))
    return out


def _assemble(full: torch.Tensor, region: LocalRegion) -> torch.Tensor:
    """The local tensor rebuilt box by box from ``region.boxes()``."""
    out = torch.full(region.local_shape, -1, dtype=full.dtype)
    for goff, glen, loff in region.boxes():
        src = full[tuple(slice(o, o + n) for o, n in zip(goff, glen, strict=True))]
        out[tuple(slice(o, o + n) for o, n in zip(loff, glen, strict=True))] = src
    return out


def _fill(target: Target, full: torch.Tensor) -> None:
    """Write this rank's part of ``full`` into the target's local tensor, box by box."""
    local = target.local()
    with torch.no_grad():
        for goff, glen, loff in target.region.boxes():
            src = full[tuple(slice(o, o + n) for o, n in zip(goff, glen, strict=True))]
            local[tuple(slice(o, o + n) for o, n in zip(loff, glen, strict=True))].copy_(src)


def _reference(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return torch.arange(seed * 1000, seed * 1000 + max(1, torch.Size(shape).numel()), dtype=torch.float32)[
        : torch.Size(shape).numel()
    ].reshape(shape)


class TinyLM(nn.Module):
    """Tied embedding / lm_head, a persistent and a non-persistent buffer."""

    def __init__(self, vocab: int = 10, hidden: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(hidden))
        self.register_buffer("cache", torch.zeros(3), persistent=False)


def _intervals(targets: dict[str, Target]) -> dict[str, Any]:
    return {name: t.region.intervals for name, t in targets.items()}


# ---------------------------------------------------------------------------------------------------------
# Pure checks (no process group)


def test_dot_natural_key_matches_transformers() -> None:
    from transformers.core_model_loading import dot_natural_key as hf_key

    names = [
        "model.layers.10.mlp.experts.2.w1.weight",
        "model.layers.2.mlp.experts.10.w1.weight",
        "model.layers.2.mlp.experts.2.w1.weight",
        "model.layers.2.self_attn.q_proj.weight",
        "lm_head.weight",
        "shard_11.x",
        "shard_2.x",
        "shard.x",
        "a.0",
        "a.b",
        "layer01.0010",
        "",
    ]
    for name in names:
        assert dot_natural_key(name) == hf_key(name), name
    assert sorted(names, key=dot_natural_key) == sorted(names, key=hf_key)
    assert sorted(["l.10", "l.2", "l.1"], key=dot_natural_key) == ["l.1", "l.2", "l.10"]


def test_shard_uneven_rows() -> None:
    got = [local_region((7, 3), (4,), (c,), [Shard(0)]).intervals for c in range(4)]
    assert got == [
        (((0, 2),), ((0, 3),)),
        (((2, 4),), ((0, 3),)),
        (((4, 6),), ((0, 3),)),
        (((6, 7),), ((0, 3),)),
    ]
    two = [local_region((2, 5), (4,), (c,), [Shard(0)]) for c in range(4)]
    assert [r.local_shape for r in two] == [(1, 5), (1, 5), (0, 5), (0, 5)]
    assert [r.is_empty for r in two] == [False, False, True, True]
    assert list(two[3].boxes()) == []
    assert two[3].numel == 0


def test_replicate_and_plain() -> None:
    region = local_region((4, 6), (4,), (2,), [Replicate()])
    assert region == LocalRegion.full((4, 6))
    assert region.is_full and _one_box(region) and region.numel == 24
    assert list(region.boxes()) == [((0, 0), (4, 6), (0, 0))]


def test_two_dim_meshes() -> None:
    coords = list(itertools.product(range(2), range(2)))
    s0s1 = [local_region((8, 8), (2, 2), c, [Shard(0), Shard(1)]).intervals for c in coords]
    assert s0s1 == [
        (((0, 4),), ((0, 4),)),
        (((0, 4),), ((4, 8),)),
        (((4, 8),), ((0, 4),)),
        (((4, 8),), ((4, 8),)),
    ]
    s0s0 = [local_region((8,), (2, 2), c, [Shard(0), Shard(0)]).intervals for c in coords]
    assert s0s0 == [(((0, 2),),), (((2, 4),),), (((4, 6),),), (((6, 8),),)]
    # torch's docstring example: FSDP over dp after TP over tp is right-to-left -> dp coordinate picks
    # within each tp block.
    strided = [local_region((8,), (2, 2), c, [_StridedShard(0, split_factor=2), Shard(0)]).intervals for c in coords]
    assert strided == [(((0, 2),),), (((4, 6),),), (((2, 4),),), (((6, 8),),)]
    # Strided then plain on one dim with several intervals per rank: 12 rows, sf=3.
    many = local_region((12, 2), (2, 2), (1, 0), [_StridedShard(0, split_factor=3), Shard(0)])
    # sf=3 pieces [0, 4), [4, 8), [8, 12); mesh dim 0 keeps the second half of each: 2,3,6,7,10,11;
    # then Shard(0) on mesh dim 1 keeps the first half of that list.
    assert many.intervals == (((2, 4), (6, 7)), ((0, 2),))
    assert not _one_box(many)
    assert many.local_shape == (3, 2)
    # Shard then strided (torch's _compute_local_shape_and_global_offset example): several intervals.
    ss = [local_region((8,), (2, 2), c, [Shard(0), _StridedShard(0, split_factor=2)]).intervals for c in coords]
    assert ss == [(((0, 1), (2, 3)),), (((1, 2), (3, 4)),), (((4, 5), (6, 7)),), (((5, 6), (7, 8)),)]


def test_outside_mesh_and_scalars() -> None:
    out = local_region((5, 3), (2, 2), None, [Shard(0), Replicate()])
    assert not out.in_mesh and out.is_empty and out.numel == 0
    assert out.local_shape == (0, 0)
    assert list(out.boxes()) == []
    assert not out.contains((0, 0), (1, 1))
    scalar = local_region((), (4,), (1,), [Replicate()])
    assert scalar.numel == 1 and list(scalar.boxes()) == [((), (), ())]
    scalar_out = local_region((), (4,), None, [Replicate()])
    assert scalar_out.is_empty and list(scalar_out.boxes()) == []


def test_invalid_layouts() -> None:
    with pytest.raises(TargetError, match="Partial placement is not supported"):
        local_region((4,), (2,), (0,), [Partial()])
    with pytest.raises(TargetError, match="placements for a"):
        local_region((4,), (2, 2), (0, 0), [Shard(0)])
    with pytest.raises(TargetError, match="not in a mesh"):
        local_region((4,), (2,), (2,), [Shard(0)])
    with pytest.raises(TargetError, match="shards dim"):
        local_region((4,), (2,), (0,), [Shard(1)])


def test_negative_dims_are_normalized() -> None:
    for c in range(3):
        a = local_region((4, 7), (3,), (c,), [Shard(-1)])
        b = local_region((4, 7), (3,), (c,), [Shard(1)])
        assert a == b
        a = local_region((4, 8), (3, 2), (c, 1), [_StridedShard(-1, split_factor=2), Shard(-1)])
        b = local_region((4, 8), (3, 2), (c, 1), [_StridedShard(1, split_factor=2), Shard(1)])
        assert a == b


def _layouts_for(mesh_shape: tuple[int, ...]) -> list[tuple[Placement, ...]]:
    choices: list[Placement] = [
        Shard(0),
        Shard(1),
        Replicate(),
        _StridedShard(0, split_factor=2),
        _StridedShard(0, split_factor=3),
        _StridedShard(1, split_factor=2),
    ]
    return list(itertools.product(choices, repeat=len(mesh_shape)))


def test_matches_torch_local_shape_and_offset() -> None:
    """Local shape always equals torch's; torch's offset is the first global index of every non-empty dim
    (the whole story for ``Shard``; for ``_StridedShard`` torch gives only that first index)."""
    checked = 0
    for mesh_shape in [(4,), (3,), (2, 2), (2, 3), (3, 2)]:
        for placements in _layouts_for(mesh_shape):
            for shape in [(7, 5), (2, 3), (12, 6), (9, 13), (1, 1), (0, 4)]:
                for coord in itertools.product(*(range(s) for s in mesh_shape)):
                    region = local_region(shape, mesh_shape, coord, placements)
                    t_shape, t_off = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), placements)
                    assert region.local_shape == tuple(t_shape), (shape, mesh_shape, coord, placements)
                    for d, ivs in enumerate(region.intervals):
                        if region.local_shape[d]:
                            assert ivs[0][0] == t_off[d], (shape, mesh_shape, coord, placements)
                    if all(isinstance(p, Shard | Replicate) for p in placements):
                        assert _one_box(region)
                    checked += 1
    assert checked > 1000


def test_regions_partition_the_tensor() -> None:
    """Every global index is held by exactly one coordinate when no mesh dim replicates."""
    for mesh_shape in [(2, 2), (2, 3), (4,)]:
        for placements in _layouts_for(mesh_shape):
            if any(isinstance(p, Replicate) for p in placements):
                continue
            shape = (9, 7)
            count = torch.zeros(shape, dtype=torch.int64)
            for coord in itertools.product(*(range(s) for s in mesh_shape)):
                region = local_region(shape, mesh_shape, coord, placements)
                for goff, glen, _ in region.boxes():
                    count[goff[0] : goff[0] + glen[0], goff[1] : goff[1] + glen[1]] += 1
            assert bool((count == 1).all()), (mesh_shape, placements)


def test_lazy_path_matches_arange_path() -> None:
    choices: list[Shard | _StridedShard] = [
        Shard(0),
        _StridedShard(0, split_factor=2),
        _StridedShard(0, split_factor=3),
    ]
    for size in range(0, 30):
        for mesh_shape in [(2,), (3,), (2, 2), (2, 3), (4, 2)]:
            for placements in itertools.product(choices, repeat=len(mesh_shape)):
                for coord in itertools.product(*(range(s) for s in mesh_shape)):
                    steps = tuple(zip(placements, mesh_shape, coord, strict=True))
                    assert targets_mod.dim_intervals_lazy(size, steps) == targets_mod.dim_intervals_arange(
                        size, steps
                    ), (size, mesh_shape, placements, coord)
    big = targets_mod.ARANGE_LIMIT + 13
    steps_big = ((_StridedShard(0, split_factor=2), 3, 1), (Shard(0), 2, 1))
    lazy = local_region((big,), (3, 2), (1, 1), [p for p, _, _ in steps_big])
    assert lazy.intervals[0] == targets_mod.dim_intervals_arange(big, steps_big)


def test_closed_form_chunks_match_arange_path() -> None:
    """Plain ``Shard`` steps take the closed form (``dim_intervals_chunks``): equal to torch's own splitting of
    an index list for every size, chunk count and chunk, nested steps included; other placements are not
    taken (None)."""
    checked = 0
    for size in range(0, 40):
        for mesh_shape in [(1,), (2,), (3,), (4,), (7,), (2, 2), (3, 4), (8, 2), (2, 3, 2)]:
            for coord in itertools.product(*(range(s) for s in mesh_shape)):
                steps = tuple((Shard(0), s, c) for s, c in zip(mesh_shape, coord, strict=True))
                assert targets_mod.dim_intervals_chunks(size, steps) == targets_mod.dim_intervals_arange(size, steps), (
                    size,
                    mesh_shape,
                    coord,
                )
                checked += 1
    assert checked > 2000
    assert targets_mod.dim_intervals_chunks(12, ((_StridedShard(0, split_factor=2), 2, 1),)) is None
    assert targets_mod.dim_intervals_chunks(12, ((Shard(0), 2, 1), (_StridedShard(0, split_factor=2), 2, 0))) is None


def test_region_helpers() -> None:
    region = local_region((12, 4), (2, 2), (1, 0), [_StridedShard(0, split_factor=3), Shard(1)])
    assert region.intervals == (((2, 4), (6, 8), (10, 12)), ((0, 2),))
    boxes = list(region.boxes())
    assert boxes == [((2, 0), (2, 2), (0, 0)), ((6, 0), (2, 2), (2, 0)), ((10, 0), (2, 2), (4, 0))]
    full = _reference((12, 4))
    assert torch.equal(_assemble(full, region), _gather(full, region))
    assert region.contains((2, 0), (2, 2))
    assert region.contains((3, 1), (1, 1))
    assert not region.contains((3, 0), (4, 2))  # crosses a gap
    assert not region.contains((2, 1), (1, 2))  # leaves the columns
    assert region.contains((0, 0), (0, 5))  # an empty box
    pieces = list(region.intersect((3, 1), (8, 3)))
    assert pieces == [((3, 1), (1, 1), (1, 1)), ((6, 1), (2, 1), (2, 1)), ((10, 1), (1, 1), (4, 1))]
    assert list(region.intersect((0, 2), (12, 2))) == []
    with pytest.raises(ValueError, match="box rank mismatch"):
        region.contains((0,), (1,))


def test_regions_are_cached() -> None:
    layouts = [
        ((4096 + i, 1024), (4, 2), (i % 4, i % 2), (_StridedShard(0, split_factor=2), Shard(0))) for i in range(50)
    ]
    first = [local_region(*lay) for lay in layouts]
    for _ in range(3):
        for lay, region in zip(layouts, first, strict=True):
            assert local_region(*lay) is region  # a cache hit: the same object, no recomputation


def test_build_targets_plain_model() -> None:
    model = TinyLM()
    targets = build_targets(model)
    assert list(targets) == ["scale", "embed.weight", "proj.weight", "proj.bias", "lm_head.weight"]
    tied = targets["embed.weight"]
    assert targets["lm_head.weight"] is tied
    assert tied.names == ("embed.weight", "lm_head.weight")
    assert len(unique_targets(targets)) == 4
    assert "cache" not in targets
    scale = targets["scale"]
    assert scale.tensor is model.scale and not scale.is_dtensor and scale.placements is None
    assert scale.region == LocalRegion.full((6,))
    assert tied.global_shape == (10, 6) and tied.dtype == torch.float32 and tied.device.type == "cpu"
    assert tied.local() is model.embed.weight
    _fill(tied, _reference((10, 6)))
    assert torch.equal(model.lm_head.weight.detach(), _reference((10, 6)))
    check_targets(targets)


def test_shared_module_names() -> None:
    inner = nn.Linear(2, 2)
    model = nn.Sequential(inner, nn.ReLU(), inner)
    targets = build_targets(model)
    assert targets["0.weight"].names == ("0.weight", "2.weight")
    assert targets["2.bias"] is targets["0.bias"]


def test_external_target_fqns() -> None:
    model = TinyLM()
    targets = build_targets(model, external_target_fqns={"proj.weight", "lm_head.weight"})
    # lm_head.weight is the tied embedding: the physical tensor is external under both names.
    assert list(targets) == ["scale", "proj.bias"]
    with pytest.raises(ValueError, match=r"cache, nope\.weight"):
        build_targets(model, external_target_fqns={"cache", "nope.weight", "proj.bias"})


def test_meta_and_uninitialized_are_lazy_errors() -> None:
    with torch.device("meta"):
        model = TinyLM()
    targets = build_targets(model)
    target = targets["lm_head.weight"]
    assert target.error == "target must be materialized before loading: embed.weight"
    with pytest.raises(TargetError, match=r"target must be materialized before loading: embed\.weight"):
        target.check()
    with pytest.raises(TargetError, match="materialized"):
        target.local()
    with pytest.raises(TargetError, match="4 targets cannot be loaded"):
        check_targets(targets)
    with pytest.raises(TargetError, match=r"^target must be materialized before loading: proj\.bias$"):
        check_targets(targets, ["proj.bias"])
    # A virtual plan of a meta model is fine: regions exist, nothing can be written.
    virtual = build_targets(model, mesh_override=virtual_rank(0))
    check_targets(virtual)
    assert virtual["embed.weight"].region.local_shape == (10, 6)
    with pytest.raises(TargetError, match="virtual"):
        virtual["embed.weight"].local()

    lazy = nn.Sequential(nn.LazyLinear(3))
    lazy_targets = build_targets(lazy)
    assert lazy_targets["0.weight"].error == "target must be materialized before loading: 0.weight"
    with pytest.raises(TargetError):
        lazy_targets["0.weight"].region  # noqa: B018


def test_sharding_spec_plain_tensor_is_an_error() -> None:
    model = nn.Linear(2, 2)
    model.weight._sharding_spec = object()  # type: ignore[attr-defined]
    targets = build_targets(model)
    assert "only DTensor layouts are supported" in str(targets["weight"].error)
    assert targets["bias"].error is None


def test_build_targets_is_linear_in_the_number_of_targets() -> None:
    """Work (Python calls, counted by cProfile: deterministic, unlike a wall clock on a shared box) grows
    linearly with the number of targets; the speed itself is measured by benches/compare.py ("planning")."""
    import cProfile
    import pstats

    def calls(n_layers: int) -> int:
        model = nn.Sequential(*(nn.Linear(2, 2) for _ in range(n_layers)))
        profile = cProfile.Profile()
        profile.enable()
        targets = build_targets(model)
        profile.disable()
        assert len(targets) == 2 * n_layers
        return int(pstats.Stats(profile).total_calls)  # type: ignore[attr-defined]

    small, large = calls(500), calls(2000)
    assert large <= 4.4 * small, (small, large)
    assert large / (2 * 2000) < 50, f"{large / 4000:.0f} Python calls per target"


# ---------------------------------------------------------------------------------------------------------
# Distributed sub-checks (run on every rank of one 4-rank gloo run)

# (name, global shape, mesh key, placements as (kind, dim, split_factor))
LAYOUTS: list[tuple[str, tuple[int, ...], str, tuple[tuple[str, int, int], ...]]] = [
    ("rows7", (7, 3), "1d", (("S", 0, 1),)),
    ("rows2_empty", (2, 3), "1d", (("S", 0, 1),)),
    ("cols", (3, 10), "1d", (("S", 1, 1),)),
    ("replicate", (5,), "1d", (("R", 0, 1),)),
    ("scalar", (), "1d", (("R", 0, 1),)),
    ("s0_s1", (8, 8), "2d", (("S", 0, 1), ("S", 1, 1))),
    ("s0_s1_uneven", (5, 3), "2d", (("S", 0, 1), ("S", 1, 1))),
    ("s0_s0", (9, 4), "2d", (("S", 0, 1), ("S", 0, 1))),
    ("s0_s0_empty", (3,), "2d", (("S", 0, 1), ("S", 0, 1))),
    ("strided", (8, 4), "2d", (("SS", 0, 2), ("S", 0, 1))),
    ("strided_uneven", (9, 5), "2d", (("SS", 0, 2), ("S", 0, 1))),
    ("strided_cols", (3, 12), "2d", (("SS", 1, 2), ("S", 1, 1))),
    ("shard_then_strided", (11, 3), "2d", (("S", 0, 1), ("SS", 0, 2))),
    ("replicate_shard", (4, 6), "2d", (("R", 0, 1), ("S", 1, 1))),
    ("tp_submesh", (5, 7), "tp", (("S", 1, 1),)),
    ("dp_submesh", (5, 7), "dp", (("S", 0, 1),)),
]


def _placement(kind: str, dim: int, split_factor: int) -> Placement:
    if kind == "S":
        return Shard(dim)
    if kind == "SS":
        return _StridedShard(dim, split_factor=split_factor)
    return Replicate()


def _meshes() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return {"1d": init_device_mesh("cpu", (WORLD,)), "2d": mesh2, "dp": mesh2["dp"], "tp": mesh2["tp"]}


def _virtual_regions(mesh: Any, shape: tuple[int, ...], placements: Any) -> list[Any]:
    """The region of every global rank on ``mesh``, computed without the process group."""
    out = []
    for rank in range(WORLD):
        mesh_shape, coord = virtual_rank(rank)(mesh)
        out.append(local_region(shape, mesh_shape, coord, placements).intervals)
    return out


def check_distribute_tensor_layouts(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    meshes = _meshes()
    out: dict[str, Any] = {}
    for name, shape, mesh_key, spec in LAYOUTS:
        mesh = meshes[mesh_key]
        placements = [_placement(*p) for p in spec]
        full = _reference(shape)
        try:
            dt = distribute_tensor(full, mesh, placements)
            reference = "scatter"
        except AssertionError:
            # torch 2.15: distribute_tensor's scatter path asserts on uneven _StridedShard chunks (it computes
            # pad sizes but never pads); the local-split path (src_data_rank=None) works.
            dt = distribute_tensor(full, mesh, placements, src_data_rank=None)
            reference = "local split"
        holder = nn.Module()
        holder.w = nn.Parameter(dt, requires_grad=False)
        target = build_targets(holder)["w"]
        target.check()
        region = target.region
        local = dt.to_local()
        t_shape, t_off = compute_local_shape_and_global_offset(shape, mesh, dt.placements)
        # Round trip through torch's own all-gather: the local tensor our region selects is the right shard.
        rebuilt = DTensor.from_local(
            _gather(full, region) if shape else full,
            mesh,
            dt.placements,
            shape=full.shape,
            stride=full.stride(),
        ).full_tensor()
        out[name] = {
            "reference": reference,
            "roundtrip_ok": torch.equal(rebuilt, full),
            "placements": str(dt.placements),
            "intervals": region.intervals,
            "gather_ok": torch.equal(_gather(full, region), local) if shape else torch.equal(full, local),
            "boxes_ok": torch.equal(_assemble(full, region), local),
            "mesh_shape": target.mesh_shape,
            "coordinate": target.coordinate,
            "virtual": _virtual_regions(mesh, shape, tuple(dt.placements)),
            "torch_shape": tuple(t_shape),
            "torch_offset": tuple(t_off),
            "local_shape": region.local_shape,
        }
    return out


def _unshard_check(model: Any, fulls: dict[str, torch.Tensor], targets: dict[str, Target]) -> dict[str, bool]:
    """FSDP's own all-gather (``unshard``) sees what was written into ``Target.local()``; after ``reshard``
    the module holds the very parameter objects the targets refer to."""
    out: dict[str, bool] = {}
    model.unshard()
    for name, full in fulls.items():
        param: Any = model.get_parameter(name)
        value = param.full_tensor() if hasattr(param, "full_tensor") else param
        out[f"unshard {name}"] = torch.equal(value.detach(), full)
    model.reshard()
    for name in fulls:
        out[f"identity {name}"] = model.get_parameter(name) is targets[name].tensor
    return out


def _fsdp_tiny() -> tuple[nn.Module, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TinyLM()
    mesh = init_device_mesh("cpu", (WORLD,))
    fully_shard(model, mesh=mesh)
    return model, mesh


def check_fsdp(rank: int, world_size: int) -> dict[str, Any]:
    model, _ = _fsdp_tiny()
    targets = build_targets(model)
    check_targets(targets)
    out: dict[str, Any] = {
        "names": list(targets),
        "tied_names": targets["lm_head.weight"].names,
        "tied_same": targets["lm_head.weight"] is targets["embed.weight"],
        "placements": {n: str(t.placements) for n, t in targets.items()},
        "is_dtensor": {n: t.is_dtensor for n, t in targets.items()},
        "intervals": _intervals(targets),
        "local_is_view": {},
        "full_ok": {},
    }
    fulls: dict[str, torch.Tensor] = {}
    for target in unique_targets(targets):
        full = _reference(target.global_shape, seed=len(target.name))
        _fill(target, full)
        if target.is_dtensor:
            fulls[target.name] = full
        param: Any = target.tensor
        got = param.full_tensor() if target.is_dtensor else param
        out["full_ok"][target.name] = torch.equal(got.detach(), full)
        if target.is_dtensor:
            out["local_is_view"][target.name] = target.local().data_ptr() == param._local_tensor.data_ptr()
    out["unshard_ok"] = _unshard_check(model, fulls, targets)
    out["virtual"] = {r: _intervals(build_targets(model, mesh_override=virtual_rank(r))) for r in range(WORLD)}
    return out


def _fsdp_tp_model() -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh2 = _meshes()["2d"]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 7))
    parallelize_module(model, mesh2["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh2["dp"])
    return model


def _tp_only_model() -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh2 = _meshes()["2d"]
    model = nn.Sequential(nn.Linear(6, 9))
    parallelize_module(model, mesh2["tp"], {"0": ColwiseParallel()})
    return model


def _check_sharded_model(model: nn.Module) -> dict[str, Any]:
    from torch.distributed.tensor import distribute_tensor

    targets = build_targets(model)
    check_targets(targets)
    out: dict[str, Any] = {"placements": {}, "mesh_shape": {}, "coordinate": {}, "ref_ok": {}, "full_ok": {}}
    fulls: dict[str, torch.Tensor] = {}
    for target in unique_targets(targets):
        assert target.placements is not None
        full = _reference(target.global_shape, seed=len(target.name))
        dtensor: Any = target.tensor
        mesh = dtensor.device_mesh
        try:
            ref = distribute_tensor(full, mesh, target.placements).to_local()
        except AssertionError:  # uneven _StridedShard: see check_distribute_tensor_layouts
            ref = distribute_tensor(full, mesh, target.placements, src_data_rank=None).to_local()
        out["ref_ok"][target.name] = torch.equal(_gather(full, target.region), ref)
        _fill(target, full)
        out["full_ok"][target.name] = torch.equal(dtensor.full_tensor().detach(), full)
        fulls[target.name] = full
        out["placements"][target.name] = str(target.placements)
        out["mesh_shape"][target.name] = target.mesh_shape
        out["coordinate"][target.name] = target.coordinate
    out["intervals"] = _intervals(targets)
    out["unshard_ok"] = _unshard_check(model, fulls, targets) if hasattr(model, "unshard") else {}
    out["virtual"] = {r: _intervals(build_targets(model, mesh_override=virtual_rank(r))) for r in range(WORLD)}
    return out


def check_fsdp_tp(rank: int, world_size: int) -> dict[str, Any]:
    return _check_sharded_model(_fsdp_tp_model())


def check_tp_submesh(rank: int, world_size: int) -> dict[str, Any]:
    return _check_sharded_model(_tp_only_model())


def _error_of(fn: Any) -> str:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def check_errors(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (WORLD,))
    with torch.device("meta"):
        meta_model = nn.Sequential(nn.Linear(4, 6))
    fully_shard(meta_model, mesh=mesh)
    meta_targets = build_targets(meta_model)
    virtual_meta = build_targets(meta_model, mesh_override=virtual_rank(rank))

    holder = nn.Module()
    holder.p = nn.Parameter(DTensor.from_local(torch.ones(3), mesh, [Partial()]), requires_grad=False)
    partial = build_targets(holder)["p"]

    fsdp_model, _ = _fsdp_tiny()
    return {
        "meta_is_dtensor": meta_targets["0.weight"].is_dtensor,
        "meta_error": _error_of(lambda: check_targets(meta_targets, ["0.weight"])),
        "meta_virtual_ok": _error_of(lambda: check_targets(virtual_meta)),
        "meta_virtual_region": virtual_meta["0.weight"].region.intervals,
        "partial_error": _error_of(partial.check),
        "partial_local": _error_of(partial.local),
        "partial_region": _error_of(lambda: partial.region),
        "external": list(build_targets(fsdp_model, external_target_fqns={"proj.bias"})),
        "unknown_external": _error_of(lambda: build_targets(fsdp_model, external_target_fqns={"proj.nope"})),
    }


def check_harness_echo(rank: int, world_size: int) -> tuple[int, int, torch.Tensor]:
    import torch.distributed as dist

    value = torch.tensor([rank * 5])
    dist.all_reduce(value)
    return rank, world_size, value


CHECKS = [
    check_distribute_tensor_layouts,
    check_fsdp,
    check_fsdp_tp,
    check_tp_submesh,
    check_errors,
    check_harness_echo,
]


@pytest.fixture(scope="module")
def dist_results() -> list[dict[str, SubcheckOutcome]]:
    # One spawn for every distributed check of this module; ``checks`` also exercises kwargs passing.
    return run_distributed(run_subchecks, WORLD, checks=CHECKS, timeout=240)


# ---------------------------------------------------------------------------------------------------------
# Distributed tests


@pytest.mark.distributed
def test_layouts_match_distribute_tensor(dist_results: list[dict[str, SubcheckOutcome]]) -> None:
    per_rank = subcheck_values(dist_results, "check_distribute_tensor_layouts")
    for name, shape, _, _ in LAYOUTS:
        for rank, results in enumerate(per_rank):
            got = results[name]
            where = f"{name} rank {rank} {got['placements']}"
            assert got["gather_ok"], where
            assert got["roundtrip_ok"], where
            assert got["boxes_ok"], where
            # Virtual ranks (no process group) agree with the real ones, computed on any rank.
            for other in per_rank:
                assert other[name]["virtual"][rank] == got["intervals"], where
            # The pure computation in this process agrees too.
            expected = local_region(shape, got["mesh_shape"], got["coordinate"], _placements_of(name))
            assert expected.intervals == got["intervals"], where
            # torch's compute_local_shape_and_global_offset: same shape; its offset is our first index.
            assert got["torch_shape"] == got["local_shape"], where
            for d, ivs in enumerate(got["intervals"]):
                if got["local_shape"][d]:
                    assert got["torch_offset"][d] == ivs[0][0], where
    scatter_failed = sorted(name for name, got in per_rank[0].items() if got["reference"] != "scatter")
    assert scatter_failed == ["shard_then_strided", "strided_uneven"]  # torch's limitation, see the check
    empties = [r["rows2_empty"]["local_shape"] for r in per_rank]
    assert empties == [(1, 3), (1, 3), (0, 3), (0, 3)]
    assert per_rank[1]["strided"]["intervals"] == (((4, 6),), ((0, 4),))


def _placements_of(name: str) -> list[Placement]:
    spec = next(s for n, _, _, s in LAYOUTS if n == name)
    return [_placement(*p) for p in spec]


@pytest.mark.distributed
def test_fsdp_targets(dist_results: list[dict[str, SubcheckOutcome]]) -> None:
    per_rank = subcheck_values(dist_results, "check_fsdp")
    first = per_rank[0]
    assert first["names"] == ["scale", "embed.weight", "proj.weight", "proj.bias", "lm_head.weight"]
    assert first["tied_names"] == ("embed.weight", "lm_head.weight") and first["tied_same"]
    assert first["placements"]["embed.weight"] == "(Shard(dim=0),)"
    assert first["placements"]["scale"] == "None"  # FSDP2 leaves buffers as plain tensors
    assert first["is_dtensor"] == {
        "embed.weight": True,
        "proj.weight": True,
        "proj.bias": True,
        "lm_head.weight": True,
        "scale": False,
    }
    rows = [r["intervals"]["embed.weight"][0] for r in per_rank]
    assert rows == [((0, 3),), ((3, 6),), ((6, 9),), ((9, 10),)]
    assert [r["intervals"]["proj.bias"] for r in per_rank] == [
        (((0, 2),),),
        (((2, 4),),),
        (((4, 6),),),
        ((),),
    ]
    for rank, results in enumerate(per_rank):
        assert all(results["full_ok"].values()), (rank, results["full_ok"])
        assert all(results["local_is_view"].values()), (rank, results["local_is_view"])
        assert len(results["unshard_ok"]) == 6 and all(results["unshard_ok"].values()), results["unshard_ok"]
        for other in per_rank:
            assert other["virtual"][rank] == results["intervals"], rank


@pytest.mark.distributed
@pytest.mark.parametrize("check", ["check_fsdp_tp", "check_tp_submesh"])
def test_tp_targets(dist_results: list[dict[str, SubcheckOutcome]], check: str) -> None:
    per_rank = subcheck_values(dist_results, check)
    for rank, results in enumerate(per_rank):
        assert all(results["ref_ok"].values()), (rank, results["ref_ok"])
        assert all(results["full_ok"].values()), (rank, results["full_ok"])
        assert all(results["unshard_ok"].values()), (rank, results["unshard_ok"])
        for other in per_rank:
            assert other["virtual"][rank] == results["intervals"], rank
    placements = per_rank[0]["placements"]
    if check == "check_fsdp_tp":
        assert len(per_rank[0]["unshard_ok"]) == 8
    if check == "check_fsdp_tp":
        # What torch 2.15 produces for FSDP2 (dp) over TP (tp) on a (2, 2) mesh.
        assert placements["0.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
        assert placements["2.weight"] == "(Shard(dim=0), Shard(dim=1))"
        assert per_rank[0]["mesh_shape"]["0.weight"] == (2, 2)
        # 10 rows: tp blocks [0, 5) and [5, 10); dp takes 3 + 2 rows of each.
        assert [r["intervals"]["0.weight"][0] for r in per_rank] == [
            ((0, 3),),
            ((5, 8),),
            ((3, 5),),
            ((8, 10),),
        ]
    else:
        assert placements["0.weight"] == "(Shard(dim=0),)"
        assert per_rank[0]["mesh_shape"]["0.weight"] == (2,)
        assert [r["coordinate"]["0.weight"] for r in per_rank] == [(0,), (1,), (0,), (1,)]


@pytest.mark.distributed
def test_distributed_errors(dist_results: list[dict[str, SubcheckOutcome]]) -> None:
    for results in subcheck_values(dist_results, "check_errors"):
        assert results["meta_is_dtensor"]
        assert results["meta_error"] == "TargetError: target must be materialized before loading: 0.weight"
        assert results["meta_virtual_ok"] == "no error"
        assert results["partial_error"] == ("TargetError: Partial placement is not supported for pretrained loading: p")
        assert results["partial_local"] == results["partial_error"]
        assert results["partial_region"] == results["partial_error"]
        assert results["external"] == ["scale", "embed.weight", "proj.weight", "lm_head.weight"]
        assert results["unknown_external"].startswith("ValueError: external_target_fqns names 1 tensor(s)")
        assert "proj.nope" in results["unknown_external"]
    rows = [r["meta_virtual_region"][0] for r in subcheck_values(dist_results, "check_errors")]
    assert rows == [((0, 2),), ((2, 4),), ((4, 6),), ()]


# ---------------------------------------------------------------------------------------------------------
# The harness itself


def _failing_body(rank: int, world_size: int) -> str:
    if rank == 0:
        raise RuntimeError("boom from rank zero")
    os._exit(3)  # rank 1 dies without reporting


def _hanging_body(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(3600)


def _late_group_body(rank: int, world_size: int) -> int:
    """Rank 0 returns while rank 1 still joins a group rank 0 is not in (as a size-1 mesh dimension does)."""
    import torch.distributed as dist

    dist.new_group([0])
    if rank == 1:
        time.sleep(2.0)  # rank 0 is long past the next call and done by now
    group = dist.new_group([1])  # rank 1's rendezvous goes through the store rank 0 hosts
    return dist.get_world_size(group) if rank == 1 else 0


@pytest.mark.distributed
def test_harness_returns_results(dist_results: list[dict[str, SubcheckOutcome]]) -> None:
    values = subcheck_values(dist_results, "check_harness_echo")
    assert values == [(rank, WORLD, torch.tensor([30])) for rank in range(WORLD)]
    with pytest.raises(AssertionError, match="sub-check 'nope' failed"):
        subcheck_values(dist_results, "nope")


@pytest.mark.distributed
def test_harness_reports_failing_ranks() -> None:
    t0 = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_distributed(_failing_body, 2, timeout=100)
    message = str(info.value)
    assert time.monotonic() - t0 < 60
    assert "failed on 2 of 2 rank(s)" in message
    assert "--- rank 0 raised:\nRuntimeError: boom from rank zero" in message
    assert "_failing_body" in message  # the traceback
    assert "--- rank 1 raised:\nprocess died with exit code 3" in message


@pytest.mark.distributed
def test_harness_keeps_the_store_until_every_rank_is_done() -> None:
    # Rank 0 used to leave (taking the store with it) as soon as its own body returned: "Connection reset by
    # peer" in rank 1's new_group.
    assert run_distributed(_late_group_body, 2, timeout=60) == [0, 1]


def _hub_cache_body(rank: int, world_size: int) -> str:
    from huggingface_hub import constants  # read HF_HUB_CACHE when imported (in the fork server, if preloaded)

    return str(constants.HF_HUB_CACHE)


@pytest.mark.distributed
def test_harness_ranks_see_import_time_environment_of_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The ranks' libraries must have been imported under the run's HF_* variables, not the session's first.
    before = run_distributed(_hub_cache_body, 2, timeout=120)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert run_distributed(_hub_cache_body, 2, timeout=120) == [str(tmp_path / "hub")] * 2
    monkeypatch.undo()
    assert run_distributed(_hub_cache_body, 2, timeout=120) == before != [str(tmp_path / "hub")] * 2


@pytest.mark.distributed
def test_harness_kills_hanging_rank() -> None:
    t0 = time.monotonic()
    with pytest.raises(
        AssertionError, match=r"timed out after .*\n--- rank 0 did not finish \(killed at the timeout\)"
    ):
        run_distributed(_hanging_body, 2, timeout=8)
    assert time.monotonic() - t0 < 20
