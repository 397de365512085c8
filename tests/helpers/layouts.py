"""Parallel layouts the tests apply with torch's own APIs, for comparing hp_fastload against torch on real ranks:
``torch_fsdp`` (``fully_shard`` per block list entry, then the root), ``torch_tp`` (``parallelize_module`` with
colwise/rowwise ``Linear`` plans by name, stacked 3-D experts ``Shard(1)``), ``torch_demo`` (the CLI demo's
layout), and ``block_lists`` (a model's decoder block lists). Call them inside a spawned rank (``tests.helpers.dist``)
on a model built on the meta device or on CPU."""

from __future__ import annotations

from typing import Any

from torch import nn


def torch_fsdp(model: nn.Module, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for blocks in block_lists(model):
        for block in blocks:
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def torch_tp(model: nn.Module, world: int) -> None:
    """parallelize_module with colwise/rowwise Linear plans; stacked 3-D experts sharded on dim 1."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    plan: dict[str, Any] = {}
    for name, module in model.named_modules():
        if "visual" in name or (tied and name == "lm_head"):
            continue
        if isinstance(module, nn.Linear) and name.endswith(COLWISE):
            plan[name] = ColwiseParallel()
        elif (isinstance(module, nn.Linear) and name.endswith(ROWWISE)) or (
            isinstance(module, nn.Embedding) and name.endswith(("embed_tokens", "word_embeddings"))
        ):
            plan[name] = RowwiseParallel()
    assert plan, "no module matched the TP plan"
    parallelize_module(model, mesh, plan)
    if tied:
        model.tie_weights()  # parallelize_module replaced the embedding's parameter: tie lm_head to it again
    for name, module in model.named_modules():
        if "visual" in name:
            continue
        for pname, param in list(module._parameters.items()):
            if param is not None and param.ndim == 3 and "experts" in name:
                dt = distribute_tensor(param.data, mesh, [Shard(1)], src_data_rank=None)
                module.register_parameter(pname, nn.Parameter(dt, requires_grad=param.requires_grad))


def torch_demo(model: nn.Module, world: int) -> None:
    from hp_fastload.cli.demo import parallelize

    parallelize(model, world)


COLWISE = ("q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj", "gate_up_proj", "q_b_proj")


ROWWISE = ("o_proj", "down_proj", "output.dense")  # bert: attention.output.dense and the MLP's output.dense


def block_lists(model: nn.Module) -> list[nn.ModuleList]:
    return [m for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and n.endswith(("layers", "layer"))]
