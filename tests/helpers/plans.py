"""Planning any rank of the demo layout in one process (tests of plans as data and of the demo's layout)."""

from __future__ import annotations

import time
from typing import Any

import torch

from hp_fastload.cli.demo import parallelize


def virtual_plan(checkpoint: str, world: int = 8, rank: int = 0) -> tuple[Any, dict[str, Any], float, float]:
    """Plan rank ``rank`` of ``world`` under the demo layout in this one process.

    The model is built on meta under torch's fake process group (no peers, no bytes read), parallelized as
    ``parallelize`` does, and planned with ``targets.virtual_rank(rank)``. Returns ``(plan, layout, build
    seconds, plan seconds)``.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import AutoConfig, AutoModelForCausalLM

    import hp_fastload
    from hp_fastload.model.regions import virtual_rank

    started = time.perf_counter()
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        config = AutoConfig.from_pretrained(checkpoint)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        layout = parallelize(model, world)
        built = time.perf_counter()
        plan = hp_fastload.plan(model, checkpoint, mesh_override=virtual_rank(rank))
        planned = time.perf_counter()
    finally:
        dist.destroy_process_group()
    return plan, layout, built - started, planned - built
