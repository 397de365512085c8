"""Named parallel layouts of a transformers model, applied to a model on the meta device.

Owns ``hp-fastload plan``'s layouts (``fsdp``, ``tp``, ``tp+fsdp``, ``ep``, ``2d``, ``hsdp``), each built with
torch's own APIs (``fully_shard``, ``parallelize_module``, ``distribute_tensor``): :func:`apply_layout` and
:func:`mesh_shape_for`. Planning them for any rank on one machine is ``api.ranks.plan_ranks`` (the model built once
under torch's ``fake`` process group of the full world size, each rank planned as ``model.regions.virtual_rank``)
and the transfer's dry run (``api.transfer_dry``). The same layout functions run on real ranks give the same plans
(tests compare them with ``hp_fastload.plan`` on gloo ranks).

Layouts (``world`` ranks; ``mesh`` is ``(dp, inner)`` for the 2-D ones, default ``(world // 2, 2)``):

- ``fsdp``: ``fully_shard`` on every decoder layer, then the root, over all ranks.
- ``tp``: ``parallelize_module`` over all ranks: q/k/v/gate/up projections colwise, o/down rowwise, the token
  embedding rowwise; stacked (3-D) expert tensors ``Shard(1)``.
- ``tp+fsdp``: the attention of every layer tensor-parallel on ``inner``, ``fully_shard`` of every layer, the
  embedding and the root on ``dp``.
- ``ep``: stacked expert tensors ``Shard(0)`` (by expert) over all ranks, everything else replicated.
- ``2d``: ``(dp, ep)``: expert tensors ``Shard(0)`` on ``ep`` and ``Shard(1)`` on ``dp``; everything else
  ``Shard(0)`` on ``dp``, replicated on ``ep``.
- ``hsdp``: ``(replicate, shard)``: ``fully_shard`` of every layer and the root on the 2-D mesh (HSDP: each
  parameter replicated over the outer dim, ``Shard(0)`` over the inner one).

It does not read tensor bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

_COLWISE = ("q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj", "gate_up_proj")


_ROWWISE = ("o_proj", "down_proj")


_ATTENTION_COLWISE = ("q_proj", "k_proj", "v_proj")


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks: the longest ``ModuleList`` named ``layers`` / ``layer`` / ``h`` / ``blocks``."""
    lists: list[list[nn.Module]] = [
        list(m)
        for n, m in model.named_modules()
        if isinstance(m, nn.ModuleList) and n.rsplit(".", 1)[-1] in {"layers", "layer", "h", "blocks"}
    ]
    return max(lists, key=len) if lists else []


def _is_expert(name: str, tensor: torch.Tensor) -> bool:
    return tensor.ndim == 3 and "experts" in name


def _distribute_params(model: nn.Module, choose: Callable[[str, torch.Tensor], Any]) -> None:
    """Replace each parameter for which ``choose(name, param)`` gives ``(mesh, placements)`` by that DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for module_name, module in model.named_modules():
        for pname, param in list(module._parameters.items()):
            if param is None or isinstance(param, DTensor):
                continue
            layout = choose(f"{module_name}.{pname}" if module_name else pname, param)
            if layout is None:
                continue
            mesh, placements = layout
            dt = distribute_tensor(param.data, mesh, placements, src_data_rank=None)
            module.register_parameter(pname, nn.Parameter(dt, requires_grad=param.requires_grad))


def _tied(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    return bool(getattr(text, "tie_word_embeddings", False))


def _retie(model: nn.Module) -> None:
    tie = getattr(model, "tie_weights", None)
    if tie is not None and _tied(model):
        tie()


def _fsdp(model: nn.Module, world: int, mesh_shape: tuple[int, ...]) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return f"fsdp over {world} ranks"


def _tp_plan(module: nn.Module, attention_only: bool, tied: bool = False) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    colwise = _ATTENTION_COLWISE if attention_only else _COLWISE
    plan: dict[str, Any] = {}
    for name, child in module.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if "visual" in name or "vision" in name or (tied and leaf == "lm_head"):
            continue
        if isinstance(child, nn.Linear):
            if attention_only and "self_attn" not in name:
                continue
            if leaf in colwise:
                plan[name] = ColwiseParallel()
            elif leaf == "o_proj" or (not attention_only and leaf in _ROWWISE):
                plan[name] = RowwiseParallel()
        elif isinstance(child, nn.Embedding) and not attention_only and leaf in {"embed_tokens", "word_embeddings"}:
            plan[name] = RowwiseParallel()
    return plan


def _hsdp(model: nn.Module, world: int, mesh_shape: tuple[int, ...]) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    replicas, shards = mesh_shape
    mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("dp_replicate", "dp_shard"))
    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return f"hsdp: {replicas} replicas x fsdp over {shards} ranks"


def _tp(model: nn.Module, world: int, mesh_shape: tuple[int, ...]) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    plan = _tp_plan(model, attention_only=False, tied=_tied(model))
    if plan:
        parallelize_module(model, mesh, plan)
    _retie(model)  # parallelize_module replaced the embedding's parameter
    _distribute_params(model, lambda n, p: (mesh, [Shard(1)]) if _is_expert(n, p) else None)
    return f"tp over {world} ranks ({len(plan)} modules)"


def _tp_fsdp(model: nn.Module, world: int, mesh_shape: tuple[int, ...]) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    dp, tp = mesh_shape
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    for layer in _decoder_layers(model):
        plan = _tp_plan(layer, attention_only=True)
        if plan:
            parallelize_module(layer, mesh["tp"], plan)
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return f"tp (attention) on {tp} x fsdp on {dp}"


def _ep(model: nn.Module, world: int, mesh_shape: tuple[int, ...]) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    _distribute_params(model, lambda n, p: (mesh, [Shard(0)]) if _is_expert(n, p) else None)
    return f"ep over {world} ranks (experts by expert, the rest replicated)"


def _two_d(model: nn.Module, world: int, mesh_shape: tuple[int, ...]) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    dp, ep = mesh_shape
    mesh = init_device_mesh("cpu", (dp, ep), mesh_dim_names=("dp", "ep"))
    _distribute_params(
        model, lambda n, p: (mesh, [Shard(1), Shard(0)] if _is_expert(n, p) else [Shard(0), Replicate()])
    )
    _retie(model)
    return f"dp {dp} x ep {ep}"


LAYOUTS: dict[str, Callable[[nn.Module, int, tuple[int, ...]], str]] = {
    "fsdp": _fsdp,
    "tp": _tp,
    "tp+fsdp": _tp_fsdp,
    "ep": _ep,
    "2d": _two_d,
    "hsdp": _hsdp,
}


_TWO_D = {"tp+fsdp", "2d", "hsdp"}


def mesh_shape_for(layout: str, world: int, mesh: Sequence[int] | None = None) -> tuple[int, ...]:
    """The mesh of ``layout`` on ``world`` ranks (``mesh`` given or defaulted); ``ValueError`` when it cannot be."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
    if world < 1:
        raise ValueError(f"--world must be at least 1, got {world}")
    if layout not in _TWO_D:
        if mesh is not None and tuple(mesh) != (world,):
            raise ValueError(f"layout {layout} uses a 1-D mesh of all {world} ranks; --mesh is for tp+fsdp and 2d")
        return (world,)
    if mesh is None:
        if world % 2:
            raise ValueError(
                f"layout {layout} on {world} ranks: pass --mesh DPxN (the default DPx2 needs an even world)"
            )
        return (world // 2, 2)
    shape = tuple(int(s) for s in mesh)
    if len(shape) != 2 or min(shape) < 1 or shape[0] * shape[1] != world:
        raise ValueError(f"--mesh {'x'.join(map(str, shape))} does not multiply to --world {world}")
    return shape


def apply_layout(model: nn.Module, layout: str, world: int, mesh: Sequence[int] | None = None) -> str:
    """Parallelize ``model`` (on meta, or real) in place as ``layout``; returns a one-line description."""
    return LAYOUTS[layout](model, world, mesh_shape_for(layout, world, mesh))
