"""Planning any rank of a job on one machine: a meta model from the checkpoint's config, laid out with a named layout
for a virtual rank, planned against the checkpoint (``hp-fastload plan --all-ranks``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from hp_fastload.model.layouts import apply_layout, mesh_shape_for
from hp_fastload.source.location import Location


@dataclass
class RankPlan:
    """What one rank of a planned layout reads."""

    rank: int
    bytes_needed: int
    files: dict[str, int]
    deferred: list[str]
    region_targets: int
    missing: int
    unexpected: int
    seconds: float
    summary: str = field(repr=False, default="")


def _meta_model(checkpoint: Location, auto_class: str | None) -> nn.Module:
    import transformers

    from hp_fastload.source.config import read_config

    config = read_config(checkpoint, {})  # a regular config.json (a FIFO would block the read), or an object
    cls = getattr(transformers, auto_class or "AutoModelForCausalLM", None)
    if cls is None:
        raise ValueError(f"--auto-class {auto_class!r} is not a class of transformers")
    with torch.device("meta"):
        if hasattr(cls, "from_config"):
            return cls.from_config(config, dtype=torch.bfloat16)
        return cls._from_config(config, dtype=torch.bfloat16)


def plan_ranks(
    checkpoint: str,
    layout: str,
    world: int,
    ranks: Sequence[int],
    mesh: Sequence[int] | None = None,
    auto_class: str | None = None,
) -> tuple[str, list[RankPlan], float]:
    """Plan ``ranks`` of ``world`` under ``layout`` in this process; ``(layout description, plans, build s)``.

    The model is built once from the checkpoint's config on meta under a ``fake`` process group of ``world``
    ranks and parallelized with :func:`apply_layout`; each rank is planned with ``virtual_rank``.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hp_fastload.api.load import plan as plan_load
    from hp_fastload.model.regions import virtual_rank
    from hp_fastload.source.location import resolve_checkpoint_location

    shape = mesh_shape_for(layout, world, mesh)
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        raise ValueError(f"--rank {bad[0]} is not a rank of --world {world} (0..{world - 1})")
    location = resolve_checkpoint_location(checkpoint)
    if dist.is_initialized():
        raise RuntimeError("plan_ranks needs a process without a process group (it starts a fake one)")
    started = time.perf_counter()
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        model = _meta_model(location, auto_class)
        description = apply_layout(model, layout, world, shape)
        built = time.perf_counter() - started
        plans = []
        for rank in ranks:
            t0 = time.perf_counter()
            p = plan_load(model, str(location), mesh_override=virtual_rank(rank))  # a path or an s3:// URL
            plans.append(
                RankPlan(
                    rank=rank,
                    bytes_needed=p.bytes_needed,
                    files=dict(sorted(p.read_bytes_by_file().items())),
                    deferred=[d.label for d in p.deferred],
                    region_targets=len(p.region_reads),
                    missing=len(p.report.missing_keys),
                    unexpected=len(p.report.unexpected_keys),
                    seconds=time.perf_counter() - t0,
                    summary=p.summary(),
                )
            )
    finally:
        dist.destroy_process_group()
    return description, plans, built
