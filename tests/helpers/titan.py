"""Tiny torchtitan 0.3.0 models for tests and benchmarks: configs built with torchtitan's own layer builders,
their state-dict adapters and parallelize functions, a Hugging Face checkpoint written by torchtitan's own
``to_hf`` and safetensors' own ``save_file``, and torchtitan's own HF load (``CheckpointManager.dcp_load``,
``from_hf=True``) as the reference.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import torch
from torch import nn

#: model name -> (vocabulary, hidden size): small enough for a 2-core test run
NAMES = ("llama3", "qwen3", "qwen3_moe", "deepseek_v3")


def config(name: str, *, layers: int = 2, dim: int = 64, scale: int = 1) -> Any:
    """A tiny torchtitan model config (``scale`` multiplies widths, for benchmarks)."""
    from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm

    dim = dim * scale
    vocab = 256 * scale
    if name == "llama3":
        from torchtitan.models import llama3

        return llama3.Llama3Model.Config(
            dim=dim,
            vocab_size=vocab,
            tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=llama3._EMBEDDING_INIT),
            norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
            lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=llama3._output_linear_init(dim)),
            layers=llama3._build_llama3_layers(
                fuse_qkv=True,
                n_layers=layers,
                dim=dim,
                n_heads=8,
                n_kv_heads=2,
                hidden_dim=2 * dim,
                rope=ComplexRoPE.Config(dim=dim // 8, max_seq_len=256, theta=500000, scaling="llama"),
                attn_backend="flex",
            ),
        )
    if name in ("qwen3", "qwen3_moe"):
        from torchtitan.models import qwen3

        head_dim = 16
        rope = CosSinRoPE.Config(dim=head_dim, max_seq_len=256, theta=1000000.0)
        common = dict(n_layers=layers, dim=dim, n_heads=4, n_kv_heads=2, head_dim=head_dim, attn_backend="flex")
        if name == "qwen3":
            built = qwen3._build_qwen3_layers(hidden_dim=2 * dim, rope=rope, **common)
        else:
            built = qwen3._build_qwen3_moe_layers(
                moe_hidden_dim=dim, num_experts=4, top_k=2, rope=rope, moe_comm_backend="standard", **common
            )
        return qwen3.Qwen3Model.Config(
            vocab_size=vocab,
            dim=dim,
            norm=qwen3._qwen3_norm(dim),
            enable_weight_tying=False,
            tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=qwen3._EMBEDDING_INIT),
            lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=qwen3._LINEAR_INIT),
            layers=built,
        )
    if name == "deepseek_v3":
        from torchtitan.models import deepseek_v3 as ds

        rope_dim = 16
        built = ds._build_dsv3_layers(
            n_layers=layers,
            n_dense_layers=1,
            dim=dim,
            n_heads=4,
            q_lora_rank=0,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=rope_dim,
            v_head_dim=16,
            mscale=0.70,
            dense_hidden_dim=2 * dim,
            moe_hidden_dim=dim,
            num_experts=4,
            num_shared_experts=1,
            router_top_k=2,
            router_score_func="softmax",
            attn_backend="flex",
            moe_comm_backend="standard",
            non_blocking_capacity_factor=None,
            rope=ComplexRoPE.Config(
                dim=rope_dim,
                max_seq_len=256,
                theta=10000.0,
                scaling="yarn",
                rope_factor=40.0,
                beta_fast=32.0,
                beta_slow=1.0,
                original_seq_len=64,
            ),
        )
        return ds.DeepSeekV3Model.Config(
            vocab_size=vocab,
            dim=dim,
            tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=ds._EMBEDDING_INIT),
            norm=RMSNorm.Config(normalized_shape=dim, param_init=ds._NORM_INIT),
            lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=ds._output_linear_init(dim)),
            layers=built,
            mtp_layers=ds._build_mtp_layers(built[-1], dim=dim, num_mtp_layers=0),
        )
    raise ValueError(name)


def adapter(name: str, cfg: Any) -> Any:
    """torchtitan's own state-dict adapter of ``name`` (no HF assets)."""
    if name == "llama3":
        from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

        return Llama3StateDictAdapter(cfg, None)
    if name in ("qwen3", "qwen3_moe"):
        from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

        return Qwen3StateDictAdapter(cfg, None)
    from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter

    return DeepSeekV3StateDictAdapter(cfg, None)


def parallelize_fn(name: str) -> Any:
    if name == "llama3":
        from torchtitan.models.llama3.parallelize import parallelize_llama

        return parallelize_llama
    if name in ("qwen3", "qwen3_moe"):
        from torchtitan.models.qwen3.parallelize import parallelize_qwen3

        return parallelize_qwen3
    from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3

    return parallelize_deepseekv3


def write_checkpoint(name: str, path: Path, *, seed: int = 0, **kw: Any) -> None:
    """A Hugging Face checkpoint of a freshly initialized model: torchtitan's ``to_hf`` of its state dict,
    written by safetensors' own ``save_file``."""
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    cfg = config(name, **kw)
    model = cfg.build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
        for p in model.parameters():  # norms start at ones: make every tensor distinct
            p.add_(torch.randn_like(p) * 0.01)
    state = adapter(name, cfg).to_hf(model.state_dict())
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})


def _cpu_meshes() -> None:
    """torchtitan 0.3.0 builds its meshes on ``tools.utils.device_type``, which is "cuda" when no accelerator
    is present: on a CPU-only machine the gloo ranks need "cpu" meshes (the modules imported it by name)."""
    if torch.cuda.is_available():
        return
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.models.common.token_dispatcher as token_dispatcher

    parallel_dims.device_type = "cpu"  # type: ignore[attr-defined]
    token_dispatcher.device_type = "cpu"  # type: ignore[attr-defined]


def parallel_model(name: str, layout: str, world: int, **kw: Any) -> tuple[nn.Module, Any]:
    """``(model, config)``: built on meta, parallelized by torchtitan's own function for ``layout`` (``fsdp``,
    ``tp``, ``fsdp_ac``, ``ep``, ``ddp``: every rank a whole replica), materialized on CPU with ``init_weights``."""
    cfg, parallelize = parallelizer(name, layout, world, **kw)
    with torch.device("meta"):
        model = cfg.build()
    model = parallelize(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model, cfg


def parallelizer(name: str, layout: str, world: int, **kw: Any) -> tuple[Any, Any]:
    """``(config, parallelize)``: the model config as torchtitan's trainer fills it for ``layout`` and a
    callable that applies torchtitan's own parallelize function to a model built from it (the meshes built
    now, on the default process group)."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.activation_checkpoint import FullAC

    _cpu_meshes()
    degrees = {"dp_shard": world, "tp": 1, "ep": 1, "dp_replicate": 1}
    if layout == "tp":
        degrees = {"dp_shard": 1, "tp": world, "ep": 1, "dp_replicate": 1}
    elif layout == "ep":
        degrees = {"dp_shard": world, "tp": 1, "ep": world, "dp_replicate": 1}
    elif layout == "ddp":
        degrees = {"dp_shard": 1, "tp": 1, "ep": 1, "dp_replicate": world}
    parallelism = ParallelismConfig(
        data_parallel_replicate_degree=degrees["dp_replicate"],
        data_parallel_shard_degree=degrees["dp_shard"],
        tensor_parallel_degree=degrees["tp"],
        expert_parallel_degree=degrees["ep"],
        spmd_backend="partial_dtensor",  # plain fully_shard / parallelize_module (the default needs full DTensors)
    )
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    cfg = config(name, **kw)
    # what torchtitan's trainer does before building: fills every module config's ``sharding_config`` (TP and
    # EP placements); without it ``Module.parallelize`` skips every module and "tp" leaves whole-tensor
    # replicas on a one-rank FSDP mesh
    cfg.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))

    def parallelize(model: nn.Module) -> nn.Module:
        return parallelize_fn(name)(
            model,
            parallel_dims=dims,
            training=TrainingConfig(mixed_precision_param="float32", mixed_precision_reduce="float32"),
            parallelism=parallelism,
            compile_config=CompileConfig(),
            ac_config=FullAC.Config() if layout == "fsdp_ac" else None,
            dump_folder="/tmp",
        )

    return cfg, parallelize


def torchtitan_load(model: nn.Module, adapter_obj: Any, path: Path) -> None:
    """torchtitan's own HF load: ``CheckpointManager.dcp_load(state, path, from_hf=True)`` over its
    ``ModelWrapper``, with ``reader`` (default: the adapter's own storage reader)."""
    from torchtitan.components.checkpointer.base import MODEL, ModelWrapper
    from torchtitan.components.checkpointer.dcp import CheckpointManager

    wrapper = ModelWrapper(model)
    manager = types.SimpleNamespace(sd_adapter=adapter_obj, states={MODEL: wrapper})
    CheckpointManager.dcp_load(manager, wrapper.state_dict(), str(path), from_hf=True, from_quantized=False)  # type: ignore[arg-type]


def torchtitan_export(model: nn.Module, adapter_obj: Any, path: Path) -> None:
    """torchtitan's own HF export: ``CheckpointManager.dcp_save(state, path, to_hf=True)``."""
    from torchtitan.components.checkpointer.base import ModelWrapper
    from torchtitan.components.checkpointer.dcp import AsyncMode, CheckpointManager

    manager = types.SimpleNamespace(sd_adapter=adapter_obj)
    CheckpointManager.dcp_save(  # type: ignore[arg-type]
        manager, ModelWrapper(model).state_dict(), str(path), AsyncMode.DISABLED, to_hf=True
    )


def loss(model: nn.Module, vocab: int, seed: int = 3) -> float:
    """Cross-entropy of one fixed batch (the same tokens on every rank)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (2, 17), generator=g)
    inputs = tokens[:, :-1]
    positions = torch.arange(inputs.shape[1]).expand_as(inputs)
    with torch.no_grad():
        masks = model.get_attention_masks(positions)  # type: ignore[operator]
        logits = model(inputs, positions=positions, attention_masks=masks)
    if hasattr(logits, "full_tensor"):
        logits = logits.full_tensor()
    return float(
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))
    )


def local_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer's local shard (a copy)."""
    out = {}
    for name, value in _named_tensors(model):
        local = value.to_local() if hasattr(value, "to_local") else value
        out[name] = local.detach().clone()
    return out


def layout(model: nn.Module) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], dict[str, int]]]:
    """Every parameter's ``(global shape, local shape, {mesh dim name: size})`` (an empty dict: not a DTensor)."""
    out = {}
    for name, p in model.named_parameters():
        mesh = getattr(p, "device_mesh", None)
        dims = dict(zip(mesh.mesh_dim_names or (), mesh.shape, strict=True)) if mesh is not None else {}
        local = p.to_local() if hasattr(p, "to_local") else p
        out[name] = (tuple(p.shape), tuple(local.shape), dims)
    return out


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    out = list(model.named_parameters())
    skip = set()
    for mod_name, module in model.named_modules():
        for b in module._non_persistent_buffers_set:
            skip.add(f"{mod_name}.{b}" if mod_name else b)
    out += [(n, b) for n, b in model.named_buffers() if n not in skip]
    return out
