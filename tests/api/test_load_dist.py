"""Loading into real DTensors on several gloo ranks, bit-exact against torch's own ``distribute_tensor``.

One spawn per world size runs every check (``run_subchecks``); each check compares, on every rank, the local
shard hp_fastload wrote with ``distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()`` of
the torch-converted full tensor, for both loaders.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from tests.helpers.dist import run_distributed, run_subchecks, subcheck_values

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)

    def r(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    return {
        "q.weight": r(8, 6),
        "k.weight": r(4, 6),
        "v.weight": r(4, 6),
        "experts.0.gate.weight": r(3, 4, dtype=torch.bfloat16),
        "experts.1.gate.weight": r(3, 4, dtype=torch.bfloat16),
        "experts.0.up.weight": r(3, 4, dtype=torch.bfloat16),
        "experts.1.up.weight": r(3, 4, dtype=torch.bfloat16),
        "rope.weight": r(16, 6),
        "router.weight": r(6, 10),
        "norm_raw.weight": r(10, dtype=torch.bfloat16),
        "scaled.a": r(7),
        "scaled.b": r(7),
        "embed.weight": r(11, 6),
        "plain.weight": r(9, 5),
    }


class _Cfg:
    num_attention_heads = 4


class _AddOne:
    def convert(self, inputs: dict[str, Any], source_patterns: list[str], target_patterns: list[str], **kw: Any):
        (values,) = inputs.values()
        return {target_patterns[0]: values[0] + 1.0}


class _Product:
    def convert(self, inputs: dict[str, Any], source_patterns: list[str], target_patterns: list[str], **kw: Any):
        a, b = (inputs[p][0] for p in source_patterns)
        return {target_patterns[0]: a * b}


def _mapping() -> list[Any]:
    from hp_fastload import rules

    return [
        rules.WeightConverter(["q.weight", "k.weight", "v.weight"], "qkv.weight", [rules.Concatenate(0)]),
        rules.WeightConverter(
            ["experts.*.gate.weight", "experts.*.up.weight"],
            "experts.gate_up",
            [rules.MergeModulelist(0), rules.Concatenate(1)],
        ),
        rules.WeightConverter("rope.weight", "rope_out.weight", [rules.PermuteForRope()]),
        rules.WeightConverter("router.weight", "router_t.weight", [rules.Transpose(0, 1)]),
        rules.WeightConverter("norm_raw.weight", "norm.weight", [_AddOne()]),
        rules.WeightConverter(["scaled.a", "scaled.b"], "scaled.weight", [_Product()]),
    ]


def _converted(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    gate = torch.stack([t["experts.0.gate.weight"], t["experts.1.gate.weight"]])
    up = torch.stack([t["experts.0.up.weight"], t["experts.1.up.weight"]])
    return {
        "qkv.weight": torch.cat([t["q.weight"], t["k.weight"], t["v.weight"]]),
        "experts.gate_up": torch.cat([gate, up], dim=1),
        "rope_out.weight": t["rope.weight"].view(4, 2, 2, 6).transpose(1, 2).reshape(16, 6),
        "router_t.weight": t["router.weight"].t().contiguous(),
        "norm.weight": t["norm_raw.weight"] + 1.0,
        "scaled.weight": t["scaled.a"] * t["scaled.b"],
        "embed.weight": t["embed.weight"],
        "plain.weight": t["plain.weight"],
    }


def _layouts(world: int) -> dict[str, tuple[tuple[int, ...], list[Any], torch.dtype]]:
    """Target name -> (mesh shape, placements, target dtype): every placement kind, per world size."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if world == 2:
        return {
            "qkv.weight": ((2,), [Shard(0)], torch.float32),  # rank 1 starts in k: crosses the cat boundary
            "experts.gate_up": ((2,), [Shard(1)], torch.float32),  # gate|up boundary inside rank 0, bf16->f32
            "rope_out.weight": ((2,), [Shard(0)], torch.float32),
            "router_t.weight": ((2,), [Shard(1)], torch.bfloat16),  # transposed source, column shard, cast
            "norm.weight": ((2,), [Shard(0)], torch.float32),  # post-op +1 in bf16, then cast
            "scaled.weight": ((2,), [Shard(0)], torch.float32),  # deferred, uneven (7 on 2)
            "embed.weight": ((2,), [_StridedShard(0, split_factor=2)], torch.float32),
            "plain.weight": ((2,), [Replicate()], torch.float32),
        }
    return {
        "qkv.weight": ((2, 2), [Shard(0), Shard(1)], torch.float32),
        "experts.gate_up": ((2, 2), [Shard(0), Shard(1)], torch.float32),
        "rope_out.weight": ((4,), [Shard(0)], torch.float32),
        "router_t.weight": ((2, 2), [Shard(0), Shard(1)], torch.float32),  # transposed, sharded on both dims
        "norm.weight": ((4,), [Shard(0)], torch.float32),  # 10 rows on 4: uneven
        "scaled.weight": ((2, 2), [Shard(0), Replicate()], torch.float32),
        "embed.weight": ((2, 2), [_StridedShard(0, split_factor=2), Shard(0)], torch.float32),  # FSDP over TP
        "plain.weight": ((4,), [Shard(1)], torch.float32),  # 5 columns on 4 ranks
    }


def _build_model(world: int) -> tuple[nn.Module, dict[str, Any]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    meshes: dict[tuple[int, ...], Any] = {}
    model = nn.Module()
    model.config = _Cfg()  # type: ignore[assignment]
    layouts = _layouts(world)
    shapes = {k: v.shape for k, v in _converted(_tensors()).items()}
    for name, (mesh_shape, placements, dtype) in layouts.items():
        mesh = meshes.get(mesh_shape) or meshes.setdefault(mesh_shape, init_device_mesh("cpu", mesh_shape))
        module = model
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        dt = distribute_tensor(torch.zeros(shapes[name], dtype=dtype), mesh, placements, src_data_rank=None)
        module.register_parameter(leaf, nn.Parameter(dt, requires_grad=False))
    return model, layouts


def _root() -> str:
    return os.environ["HPF_TEST_CKPT"]


def check_placements_dcp(rank: int, world: int) -> list[str]:
    return _check_placements(rank, world, _root(), "dcp")


def check_placements_legacy(rank: int, world: int) -> list[str]:
    return _check_placements(rank, world, _root(), "legacy")


def check_placements_shared(rank: int, world: int) -> tuple[list[str], int, int]:
    """share_replicated: same values; the non-reading replica reads fewer bytes."""
    import hp_fastload as hf

    bad = _check_placements(rank, world, _root(), "dcp", share_replicated=True)
    model, _ = _build_model(world)
    plain = hf.load(model, _root(), weights_mapping=_mapping())
    model, _ = _build_model(world)
    shared = hf.load(model, _root(), weights_mapping=_mapping(), share_replicated=True)
    return bad, plain.bytes_read, shared.bytes_read


def _check_placements(rank: int, world: int, root: str, loader: str, **load_kwargs: Any) -> list[str]:
    from torch.distributed.tensor import distribute_tensor

    import hp_fastload as hf

    model, _ = _build_model(world)
    report = hf.load(model, root, weights_mapping=_mapping(), loader=loader, **load_kwargs)
    assert report.missing_keys == (), report.missing_keys
    bad = []
    for name, full in _converted(_tensors()).items():
        param = model.get_parameter(name)
        expected = distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
        local = param.to_local()
        if expected.to_local().shape != local.shape or not torch.equal(expected.to_local(), local):
            bad.append(name)
    return bad


def check_report_equal(rank: int, world: int) -> bool:
    root = _root()
    import hp_fastload as hf

    a, _ = _build_model(world)
    b, _ = _build_model(world)
    return hf.load(a, root, weights_mapping=_mapping(), loader="dcp") == hf.load(
        b, root, weights_mapping=_mapping(), loader="legacy"
    )


def check_reads_only_local_bytes(rank: int, world: int) -> tuple[int, int]:
    root = _root()
    import hp_fastload as hf

    model, _ = _build_model(world)
    report = hf.load(model, root, weights_mapping=_mapping())
    return report.bytes_read, report.checkpoint_bytes


def check_one_rank_fails_all_raise(rank: int, world: int) -> str:
    root = _root()
    import hp_fastload as hf

    model, _ = _build_model(world)
    if rank == world - 1:
        with torch.device("meta"):
            model.broken = nn.Linear(6, 9)  # a meta target on the last rank only
    mapping = _mapping()
    try:
        hf.load(model, root, weights_mapping=mapping, strict=False, key_mapping={r"^plain\.": "broken."})
    except Exception as exc:  # every rank must get here
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _run(world: int, root: Path) -> list[dict[str, Any]]:
    checks = [
        check_placements_dcp,
        check_placements_legacy,
        check_placements_shared,
        check_report_equal,
        check_reads_only_local_bytes,
        check_one_rank_fails_all_raise,
    ]
    os.environ["HPF_TEST_CKPT"] = str(root)  # spawned ranks inherit the environment
    return run_distributed(run_subchecks, world, checks, timeout=400)


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def outcomes(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    save_file(_tensors(), str(root / "model.safetensors"))
    return request.param, _run(request.param, root)


def test_every_placement_matches_distribute_tensor_dcp(outcomes):
    world, per_rank = outcomes
    assert subcheck_values(per_rank, "check_placements_dcp") == [[]] * world


def test_every_placement_matches_distribute_tensor_legacy(outcomes):
    world, per_rank = outcomes
    assert subcheck_values(per_rank, "check_placements_legacy") == [[]] * world


def test_shared_replicas_give_the_same_values_and_read_less(outcomes):
    world, per_rank = outcomes
    values = subcheck_values(per_rank, "check_placements_shared")
    assert [bad for bad, _, _ in values] == [[]] * world
    if world == 2:  # plain.weight is Replicate on a mesh of 2: rank 0 reads it, rank 1 receives it
        assert values[0][2] == values[0][1]
        assert values[1][2] < values[1][1]


def test_both_loaders_report_the_same(outcomes):
    world, per_rank = outcomes
    assert subcheck_values(per_rank, "check_report_equal") == [True] * world


def test_each_rank_reads_less_than_the_checkpoint(outcomes):
    _world, per_rank = outcomes
    values = subcheck_values(per_rank, "check_reads_only_local_bytes")
    total = values[0][1]
    # deferred sources (scaled.a/b) and replicated tensors are read whole; everything else only locally
    assert all(read < total for read, _ in values), values


def test_one_rank_failing_makes_every_rank_raise(outcomes):
    world, per_rank = outcomes
    messages = subcheck_values(per_rank, "check_one_rank_fails_all_raise")
    assert all(m != "no error" for m in messages), messages
    assert "materialized" in messages[-1]
    assert all(f"failed on rank {world - 1}" in m for m in messages[:-1]), messages


def _mixtral_rank(rank: int, world: int) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import hp_fastload as hf
    from hp_fastload.cli.demo import parallelize

    ckpt = os.environ["HPF_TEST_MIXTRAL"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ckpt), dtype=torch.bfloat16)
    parallelize(model, world)
    model.to_empty(device="cpu")
    return hf.load(model, ckpt).bytes_read


def test_virtual_rank_plan_predicts_the_real_reads(tmp_path):
    """hp_fastload.plan for a virtual rank (fake process group, one process) == what that real rank reads."""
    from tests.helpers.plans import virtual_plan
    from tests.helpers.tiny_models import tiny_model

    tiny_model("mixtral").to(torch.bfloat16).save_pretrained(tmp_path)
    os.environ["HPF_TEST_MIXTRAL"] = str(tmp_path)
    real = run_distributed(_mixtral_rank, 2, timeout=300)
    virtual = [virtual_plan(str(tmp_path), world=2, rank=r)[0].bytes_needed for r in range(2)]
    assert virtual == real
    assert all(0 < v < virtual_plan(str(tmp_path), world=2, rank=0)[0].report.checkpoint_bytes for v in virtual)
