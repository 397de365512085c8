"""Every rank's needs from one whole plan (``jobranks.all_rank_needs``) against planning each rank
(``rank_needs_by_planning``: ``plan_load`` per virtual rank, the planner every rank runs for itself), on every
named layout and an HSDP one, for a bf16 MoE (fused experts), a transposed-experts vision MoE and an FP8
block-quantized DeepSeek-V3 (scale rows), world 8 under torch's fake process group (headers only)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hp_fastload.api.request import plan_request
from hp_fastload.model.layouts import apply_layout
from hp_fastload.model.regions import virtual_rank
from hp_fastload.planning import front
from hp_fastload.planning.jobneeds import StorageMap
from hp_fastload.planning.jobranks import all_rank_needs, rank_needs_by_planning
from hp_fastload.source.index import CheckpointIndex
from tests.helpers import quant_checkpoints as qc
from tests.helpers.tiny_models import model_class, tiny_model

WORLD = 8
LAYOUTS = ("fsdp", "tp", "tp+fsdp", "ep", "2d", "hsdp")
FAMILIES = ("qwen3_moe", "qwen3_vl_moe", "deepseek_v3")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("jobranks")
    out = {}
    for family in ("qwen3_moe", "qwen3_vl_moe"):
        tiny_model(family, seed=1).to(torch.bfloat16).save_pretrained(root / family, max_shard_size="4KB")
        out[family] = root / family
    model = qc.build_model("deepseek_v3", seed=2)
    tensors = qc.quantize_fp8_block(qc.released(model, root / "deepseek_v3"), (8, 8))
    qc.rewrite(root / "deepseek_v3", tensors, dict(qc.FP8_CONFIG, weight_block_size=[8, 8]))
    out["deepseek_v3"] = root / "deepseek_v3"
    return out


@pytest.fixture
def fake_world() -> Iterator[None]:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=WORLD, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def meta_model(family: str, path: Path) -> Any:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    cls = model_class(family)
    with torch.device("meta"):
        model = cls.from_config(config) if cls.__name__.startswith("Auto") else cls(config)
    return model.to(torch.bfloat16)


def _hsdp(model: Any) -> None:
    """Replicated across 2 "nodes", rows sharded over 4 ranks within each (distribute_tensor on meta)."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 4))
    for name, param in list(model.named_parameters()):
        *path, leaf = name.split(".")
        rows = Shard(0) if param.dim() and param.shape[0] >= 4 else Replicate()
        dt = distribute_tensor(param.detach(), mesh, [Replicate(), rows], src_data_rank=None)
        setattr(model.get_submodule(".".join(path)), leaf, nn.Parameter(dt, requires_grad=False))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_needs_from_the_whole_plan_equal_planning_each_rank(
    checkpoints: dict[str, Path], fake_world: None, family: str, layout: str
) -> None:
    path = checkpoints[family]
    model = meta_model(family, path)
    if layout == "hsdp":
        _hsdp(model)
    else:
        apply_layout(model, layout, WORLD, (4, 2) if layout in ("tp+fsdp", "2d") else None)
    index = CheckpointIndex.open(path)
    smap = StorageMap.of_index(index)
    request = plan_request(model, loader="dcp", strict=False)
    fast = all_rank_needs(model, index, smap, WORLD, request)
    reference = rank_needs_by_planning(model, index, smap, WORLD, request)
    sizes = [n.nbytes(smap) for n in reference]
    assert min(sizes) < index.total_bytes, sizes  # some rank holds less than everything: the layout cuts
    for rank, (got, want) in enumerate(zip(fast, reference, strict=True)):
        assert got == want, (rank, got.nbytes(smap), want.nbytes(smap))
    # as a job-wide load runs it: the groundwork made for this rank's own plan, used by it, then by the whole plan
    mine = request.seen_as(virtual_rank(3))
    targets = front.targets_of(model, mine)
    work = front.groundwork(model, index, mine, targets)
    assert work is not None
    front.plan(model, index, mine, targets=targets, groundwork=work)
    assert all_rank_needs(model, index, smap, WORLD, request, groundwork=work) == reference
