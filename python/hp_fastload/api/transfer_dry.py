"""The transfer's dry run: the message table of ``hf.transfer`` between two layouts of one checkpoint config, planned
in one process without weights (``hp-fastload plan CHECKPOINT --layout A --transfer-to B``).

Both models are built on the meta device from the checkpoint's ``config.json`` under torch's ``fake`` process group
of the job's size, laid out by ``model.layouts``; every rank of each side is planned as a virtual rank
(``model.regions.virtual_rank``) against a header-only index of the released layout, as ``transfer`` plans its own
rank, and the sides' runs are intersected by ``planning.transfer.plan_transfer``: the same pieces, messages and
rounds the job would run. Nothing is read but ``config.json``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from hp_fastload.api.request import plan_request
from hp_fastload.api.transfer import DEFAULT_BUDGET_BYTES, DIRECT_BYTES, layout_facts, layout_index
from hp_fastload.model.layouts import apply_layout, mesh_shape_for
from hp_fastload.model.regions import virtual_rank
from hp_fastload.planning import front
from hp_fastload.planning.transfer import TransferPlan, check_layouts, plan_transfer, runs_of_plan
from hp_fastload.runtime import gc_paused

__all__ = ["TransferDryRun", "dry_run"]


@dataclass
class TransferDryRun:
    """A dry run's outcome: the plan (``plan.table()`` prints it), the two layouts' descriptions, the released
    tensors' count and bytes, the targets without an exact region form, and the seconds spent."""

    plan: TransferPlan
    source: str
    destination: str
    tensors: int
    checkpoint_bytes: int
    inexact: list[str]
    build_seconds: float
    plan_seconds: float

    def text(self) -> str:
        lines = [
            f"source: {self.source}",
            f"destination: {self.destination}",
            f"{self.tensors} checkpoint tensors, {self.checkpoint_bytes:,} bytes; models built on meta in "
            f"{self.build_seconds:.2f} s, every rank of both sides planned in {self.plan_seconds:.2f} s",
            self.plan.table(),
        ]
        if self.inexact:
            lines.append(
                f"{len(self.inexact)} tensors without an exact region form (transfer refuses them): "
                + ", ".join(self.inexact[:5])
            )
        return "\n".join(lines)


def dry_run(
    checkpoint: str,
    source_layout: str,
    destination_layout: str,
    world: int,
    *,
    source_mesh: Sequence[int] | None = None,
    destination_mesh: Sequence[int] | None = None,
    auto_class: str | None = None,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
    direct_bytes: int = DIRECT_BYTES,
) -> TransferDryRun:
    """Plan ``hf.transfer`` from ``source_layout`` to ``destination_layout`` (``model.layouts`` names) of the model
    of ``checkpoint``'s config on the same ``world`` ranks, in this process (which must have no process group)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hp_fastload.api.ranks import meta_model
    from hp_fastload.source.location import resolve_checkpoint_location

    shapes = (
        mesh_shape_for(source_layout, world, source_mesh),
        mesh_shape_for(destination_layout, world, destination_mesh),
    )
    location = resolve_checkpoint_location(checkpoint)
    if dist.is_initialized():
        raise RuntimeError("the transfer's dry run needs a process without a process group (it starts a fake one)")
    started = time.perf_counter()
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        with gc_paused():
            models, descriptions = [], []
            for layout, shape in zip((source_layout, destination_layout), shapes, strict=True):
                model = meta_model(location, auto_class)
                descriptions.append(apply_layout(model, layout, world, shape))
                models.append(model)
            built = time.perf_counter()
            facts = check_layouts([layout_facts(models[0])], [layout_facts(models[1])])
            key_id = {f[0]: i for i, f in enumerate(facts)}
            sides: list[list[tuple[object, ...]]] = [[], []]
            inexact: set[str] = set()
            with layout_index(facts) as index:
                for side, model in enumerate(models):
                    request = plan_request(model, strict=False)
                    for rank in range(world):
                        rank_plan, context = front.plan(model, index, request.seen_as(virtual_rank(rank)))
                        local = {name: context.target(name).region.local_shape for name in rank_plan.region_reads}
                        runs, skipped = runs_of_plan(rank_plan, key_id, local)
                        inexact.update(skipped)
                        sides[side].append(runs.spans)
            nbytes = [int(_numel(shape)) * size for _, shape, _, size in facts]
            plan = plan_transfer(
                nbytes,
                [size for *_, size in facts],
                sides[0],  # type: ignore[arg-type]
                sides[1],  # type: ignore[arg-type]
                budget_bytes=budget_bytes,
                direct_bytes=direct_bytes,
                keys=[f[0] for f in facts],
            )
    finally:
        dist.destroy_process_group()
    return TransferDryRun(
        plan=plan,
        source=f"{source_layout}: {descriptions[0]}",
        destination=f"{destination_layout}: {descriptions[1]}",
        tensors=len(facts),
        checkpoint_bytes=sum(nbytes),
        inexact=sorted(inexact),
        build_seconds=built - started,
        plan_seconds=time.perf_counter() - built,
    )


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
