"""Every rank's needs, computed on one rank for the job-wide plan, without planning each rank.

The model is planned once with every target's region made whole (``planning.front.whole_plan``: each DTensor's
mesh seen as of size 1, so the trace and the claims run once and each item is a whole traced block, its
destination in global coordinates). A rank's items are those blocks cut by its local boxes, exactly the
intersection ``region_items`` makes when that rank plans (``planning.intersect``): so each rank's needs follow
from the whole plan and the rank's local region (``model.regions.local_region`` at its coordinate,
``mesh_coordinates``), by array arithmetic. Work is shared where the ranks' layouts differ only by offsets:

- a target's region depends only on the coordinates of the mesh dims that shard it: one ``local_region`` per
  distinct projection, not per rank;
- targets with the same layout and the same items up to their checkpoint keys (the decoder layers of a model,
  the experts of every MoE layer) share one intersection, renamed per target;
- one sort of the starts and one of the ends merge every rank's intervals (``jobneeds.merge_bounds_by_rank``).

``rank_needs_by_planning`` is the reference it is tested against (and the per-rank way: one plan per
distinct layout). Pure: headers, the rules and the model's layout; nothing is read.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hp_fastload.formats import SAFETENSORS_TO_TORCH, SUB_BYTE_BITS
from hp_fastload.model.regions import local_region, mesh_coordinates, virtual_rank
from hp_fastload.model.targets import Target
from hp_fastload.planning.front import Groundwork, plan, targets_of, whole_plan
from hp_fastload.planning.items import LoadPlan, Reads
from hp_fastload.planning.jobneeds import (
    AXIS_BITS,
    Int64s,
    Needs,
    StorageMap,
    as_int64,
    check_axis,
    delivered_rows,
    item_runs,
    merge_bounds_by_rank,
    rank_axis_bounds,
    rank_needs,
)
from hp_fastload.planning.request import PlanRequest
from hp_fastload.source.index import CheckpointIndex

__all__ = [
    "all_rank_needs",
    "needs_from_whole_plan",
    "packed_keys",
    "rank_needs_by_planning",
]


#: Stored dtypes read as themselves, not as bytes: a key of one of them is never packed.
_UNPACKED = [n for n, d in SAFETENSORS_TO_TORCH.items() if d != torch.uint8 and n not in SUB_BYTE_BITS]


def packed_keys(plan: LoadPlan, index: CheckpointIndex) -> frozenset[str]:
    """The MXFP4 keys a plan dequantizes (their items stay with each rank: ``jobneeds.delivered_rows``): those
    read as bytes (``locate(k).dtype`` is ``uint8``), asked only of the keys one bulk query of the stored dtypes
    leaves (``CheckpointIndex.keys_not_stored_as``; DeepSeek-V3's 45k FP8 keys are not located one by one)."""
    if not plan.dequant:
        return frozenset()
    dequant = plan.dequant
    candidates = [k for k in index.keys_not_stored_as(_UNPACKED) if k in dequant]
    return frozenset(k for k in candidates if index.locate(k).dtype == torch.uint8)


class _Layouts:
    """Per target layout (global shape, placements, mesh): every rank's local boxes as arrays
    ``(box rank, box low corner, box high corner)``, one ``local_region`` per distinct sharding coordinate."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.meshes: dict[int, tuple[Any, tuple[int, ...], dict[int, tuple[int, ...]]]] = {}
        self.cache: dict[tuple[Any, ...], tuple[Int64s, Int64s, Int64s]] = {}

    def _mesh(self, mesh: Any) -> tuple[tuple[int, ...], dict[int, tuple[int, ...]]]:
        hit = self.meshes.get(id(mesh))
        if hit is None or hit[0] is not mesh:
            shape, coords = mesh_coordinates(mesh)
            hit = self.meshes[id(mesh)] = (mesh, shape, coords)
        return hit[1], hit[2]

    def key(self, target: Target) -> tuple[Any, ...]:
        mesh = getattr(target.tensor, "device_mesh", None)
        if not target.is_dtensor or mesh is None or target.placements is None:
            return (target.global_shape, None, None)
        return (target.global_shape, tuple(target.placements), id(mesh), mesh)

    def boxes(self, target: Target) -> tuple[Int64s, Int64s, Int64s]:
        key = self.key(target)
        hit = self.cache.get(key[:3])
        if hit is not None:
            return hit
        shape = target.global_shape
        nd = len(shape)
        if key[1] is None:  # a plain tensor: every rank holds it whole
            hit = (
                np.arange(self.world, dtype=np.int64),
                np.zeros((self.world, nd), dtype=np.int64),
                np.tile(np.asarray(shape, dtype=np.int64), (self.world, 1)),
            )
        else:
            placements = key[1]
            mesh_shape, coords = self._mesh(key[3])
            sharding = [isinstance(p, Shard | _StridedShard) for p in placements]
            by_projection: dict[tuple[int, ...], list[tuple[Sequence[int], Sequence[int]]]] = {}
            ranks: list[int] = []
            lows: list[Sequence[int]] = []
            highs: list[Sequence[int]] = []
            for r in range(self.world):
                coord = coords.get(r)
                if coord is None:
                    continue
                projected = tuple(c if s else 0 for c, s in zip(coord, sharding, strict=True))
                boxes = by_projection.get(projected)
                if boxes is None:
                    region = local_region(shape, mesh_shape, projected, placements)
                    boxes = by_projection[projected] = [
                        (g, tuple(a + n for a, n in zip(g, ln, strict=True))) for g, ln, _ in region.boxes()
                    ]
                for lo, hi in boxes:
                    ranks.append(r)
                    lows.append(lo)
                    highs.append(hi)
            hit = (
                as_int64(ranks),
                np.asarray(lows, dtype=np.int64).reshape(len(ranks), nd),
                np.asarray(highs, dtype=np.int64).reshape(len(ranks), nd),
            )
        self.cache[key[:3]] = hit
        return hit


class _Cut:
    """One intersection of a target's items (up to keys) with every rank's boxes: per (box, item) pair that
    meets, the rank, the item, the cut item's storage base and lengths; and its element runs."""

    __slots__ = ("base", "item", "lengths", "rank", "run_end", "run_item", "run_rank", "run_start", "shift")

    def __init__(self, reads: Reads, box_rank: Int64s, lo: Int64s, hi: Int64s) -> None:
        dest, lengths, strides = reads.dest_offsets, reads.lengths, reads.storage_strides
        a = np.maximum(dest[None, :, :], lo[:, None, :])
        b = np.minimum((dest + lengths)[None, :, :], hi[:, None, :])
        bi, ii = np.nonzero((b > a).all(axis=2))
        a, b = a[bi, ii], b[bi, ii]
        self.rank = box_rank[bi]
        self.item = as_int64(ii)
        self.lengths = as_int64(b - a)
        self.base = reads.storage_base[ii] + ((a - dest[ii]) * strides[ii]).sum(axis=1)
        # element runs, by (lengths, strides) pattern: every item of a pattern has the same relative runs
        runs_rank, runs_item, runs_start, runs_end = [], [], [], []
        if len(ii):
            shape = np.concatenate([self.lengths, strides[ii]], axis=1)
            patterns, which = np.unique(shape, axis=0, return_inverse=True)
            which = which.reshape(-1)
            nd = lengths.shape[1]
            for p, row in enumerate(patterns.tolist()):
                rel, run = item_runs(row[:nd], row[nd:])
                if run == 0 or not len(rel):
                    continue
                rows = np.flatnonzero(which == p)
                starts = (self.base[rows][:, None] + rel[None, :]).reshape(-1)
                runs_rank.append(np.repeat(self.rank[rows], len(rel)))
                runs_item.append(np.repeat(self.item[rows], len(rel)))
                runs_start.append(starts)
                runs_end.append(starts + run)
        join = lambda xs: as_int64(np.concatenate(xs)) if xs else as_int64([])  # noqa: E731
        self.run_rank, self.run_item = join(runs_rank), join(runs_item)
        self.run_start, self.run_end = join(runs_start), join(runs_end)
        self.shift = self.run_rank << AXIS_BITS  # the runs' ranks on the ranks' axis (``rank_axis_bounds``)


def _structure(reads: Reads) -> tuple[bytes, ...]:
    """What an intersection depends on besides the keys."""
    return tuple(
        np.ascontiguousarray(a).tobytes() + str(a.shape).encode()
        for a in (reads.dest_offsets, reads.lengths, reads.storage_strides, reads.storage_base)
    )


class _Specs:
    """The numbers ``items.touched_scale_rows`` uses, per spec shape (``quant.Dequant``'s shape and block):
    ``(elements per dim-0 row, dim-0 rows, dim-0 block, scale grid rows)``; and the touched grid rows of each
    (cut, spec pattern), computed once for every target sharing them (the MoE layers' experts)."""

    def __init__(self, smap: StorageMap) -> None:
        self.smap = smap
        self.dims: dict[tuple[Any, Any], tuple[int, int, int, int]] = {}
        self.touched: dict[tuple[Any, ...], tuple[Int64s, Int64s, Int64s, Int64s]] = {}

    def __call__(self, spec: Any) -> tuple[int, int, int, int]:
        shape_block = (spec.shape, spec.block)
        hit = self.dims.get(shape_block)
        if hit is None:
            inner, rows0, block0 = (
                (math.prod(spec.shape[1:]), spec.shape[0], spec.block[0]) if spec.shape else (1, 1, 1)
            )
            hit = self.dims[shape_block] = (inner, rows0, block0, -(-rows0 // block0))
        return hit


def _touched_rows(
    reads: Reads, cut: _Cut, which_item: Int64s, dims: Int64s, world: int
) -> tuple[Int64s, Int64s, Int64s, Int64s]:
    """Per (rank, spec) some cut item of ``reads`` touches, in that order: ``(rank, spec, first grid row, last
    grid row)``; ``which_item``: each item's spec (-1: none), ``dims``: per spec ``_Specs`` numbers."""
    nspecs = len(dims)
    which = which_item[cut.item]
    live = (which >= 0) & (cut.lengths > 0).all(axis=1)
    if not live.any():
        empty = as_int64([])
        return empty, empty, empty, empty
    inner, rows0, block0 = dims[:, 0], dims[:, 1], dims[:, 2]
    which, ranks = which[live], cut.rank[live]
    strides = reads.storage_strides[cut.item[live]]
    first = cut.base[live]
    last = first + ((cut.lengths[live] - 1) * strides).sum(axis=1)
    lo_row = np.minimum(first // inner[which], rows0[which] - 1) // block0[which]
    hi_row = np.minimum(last // inner[which], rows0[which] - 1) // block0[which]
    slot = ranks * nspecs + which
    lo = np.full(world * nspecs, np.iinfo(np.int64).max, dtype=np.int64)
    hi = np.full(world * nspecs, -1, dtype=np.int64)
    np.minimum.at(lo, slot, lo_row)
    np.maximum.at(hi, slot, hi_row)
    used = np.flatnonzero(hi >= 0)
    return used // nspecs, used % nspecs, lo[used], hi[used]


def _scale_rows(
    reads: Reads, cut: _Cut, specs_of: _Specs, world: int, out: list[tuple[Int64s, Int64s, Int64s, Int64s]]
) -> None:
    """The scale rows each rank's cut items of ``reads`` touch (``items.touched_scale_rows`` per rank, for
    this target alone, as ``rank_needs`` takes them) appended to ``out`` as intervals of the scale tensors.
    The grid rows depend on the cut, which items share a spec and the specs' shapes: targets that share those
    (the same cut, up to keys) share them (``_Specs.touched``); only the scale keys are per target."""
    if reads.second is None or not len(cut.item):
        return
    ids: dict[Any, int] = {}
    which_item = as_int64([-1 if s is None else ids.setdefault(s, len(ids)) for s in reads.second])
    specs = list(ids)
    dims = tuple(specs_of(s) for s in specs)
    memo = (id(cut), which_item.tobytes(), dims)
    hit = specs_of.touched.get(memo)
    if hit is None:
        hit = specs_of.touched[memo] = _touched_rows(
            reads, cut, which_item, np.array(dims, dtype=np.int64).reshape(-1, 4), world
        )
    ranks, spec_of, lo, hi = hit
    if not len(ranks):
        return
    smap = specs_of.smap
    scale_key = as_int64([smap.key_id[s.scale] for s in specs])
    grid_rows = as_int64([d[3] for d in dims])
    per_row = smap.nbytes[scale_key] // smap.itemsize[scale_key] // grid_rows
    rows = per_row[spec_of]
    out.append((ranks, scale_key[spec_of], lo * rows, (hi + 1) * rows))


def all_rank_needs(
    model: Any,
    index: CheckpointIndex,
    smap: StorageMap,
    world: int,
    request: PlanRequest,
    *,
    groundwork: Groundwork | None = None,
) -> list[Needs]:
    """Every rank's needs (equal to ``rank_needs`` of each rank's own plan for ``request``), from one whole
    plan (``planning.front.whole_plan``; ``groundwork``: the rank-independent part of this rank's own plan,
    reused by it)."""
    plan, targets = whole_plan(model, index, request, groundwork=groundwork)
    return needs_from_whole_plan(plan, targets, index, smap, world)


def needs_from_whole_plan(
    plan: LoadPlan, targets: dict[str, Target], index: CheckpointIndex, smap: StorageMap, world: int
) -> list[Needs]:
    """``all_rank_needs`` from a whole plan already made (``whole_plan``)."""
    packed = packed_keys(plan, index)
    layouts = _Layouts(world)
    cuts: dict[tuple[Any, ...], _Cut] = {}
    check_axis(smap, world)
    los: list[Int64s] = []  # every rank's rows, as bounds on the ranks' axis (``rank_axis_bounds``)
    his: list[Int64s] = []
    scales: list[tuple[Int64s, Int64s, Int64s, Int64s]] = []
    key_id = smap.key_id
    specs_of = _Specs(smap)
    for name, reads in plan.region_reads.items():
        rows = delivered_rows(reads, packed)
        if not len(rows):
            continue
        part = reads if len(rows) == len(reads) else reads.take(rows)
        target = targets[name]
        signature = (layouts.key(target)[:3], _structure(part))
        cut = cuts.get(signature)
        if cut is None:
            cut = cuts[signature] = _Cut(part, *layouts.boxes(target))
        if len(cut.run_item):
            keys = as_int64([key_id[k] for k in part.keys])
            lo, hi = rank_axis_bounds(smap, cut.run_rank, keys[cut.run_item], cut.run_start, cut.run_end, cut.shift)
            los.append(lo)
            his.append(hi)
        _scale_rows(part, cut, specs_of, world, scales)
    for rank, key, start, end in scales:
        lo, hi = rank_axis_bounds(smap, rank, key, start, end)
        los.append(lo)
        his.append(hi)
    if not los:
        return [Needs.empty() for _ in range(world)]
    return merge_bounds_by_rank(smap, world, np.concatenate(los), np.concatenate(his))


def rank_needs_by_planning(
    model: Any, index: CheckpointIndex, smap: StorageMap, world: int, request: PlanRequest
) -> list[Needs]:
    """Every rank's needs by planning each rank (``virtual_rank``; traced, not strict), ranks whose targets all
    have the same regions planned once: the reference ``all_rank_needs`` is tested against, and its cost at
    scale is one full planning per distinct layout."""
    seen: dict[Any, Needs] = {}
    out: list[Needs] = []
    base = dataclasses.replace(request, trace=True, strict=False)
    for r in range(world):
        each = base.seen_as(virtual_rank(r))
        targets = targets_of(model, each)
        signature = tuple((name, t.region if t.error is None else t.error) for name, t in targets.items())
        needs = seen.get(signature)
        if needs is None:
            planned, _ = plan(model, index, each, targets=targets)
            needs = seen[signature] = rank_needs(planned, smap, packed_keys(planned, index))
        out.append(needs)
    return out
