"""Tiny transformers configs of several families, for tests that need real architectures and key lists."""

from __future__ import annotations

from typing import Any

_COMMON: dict[str, Any] = dict(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)

_MOE: dict[str, Any] = dict(num_local_experts=4, num_experts_per_tok=2)

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(_COMMON, head_dim=4),
    "qwen2": dict(_COMMON),
    "qwen3": dict(_COMMON, head_dim=4),
    "mistral": dict(_COMMON, head_dim=4),
    "gemma2": dict(_COMMON, head_dim=4, tie_word_embeddings=True),
    "phi3": dict(_COMMON, pad_token_id=0),
    "mixtral": dict(_COMMON, **_MOE, head_dim=4),
    "qwen2_moe": dict(
        _COMMON,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=12,
    ),
    "qwen3_moe": dict(_COMMON, head_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8),
    "deepseek_v3": dict(
        _COMMON,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        n_shared_experts=1,
        first_k_dense_replace=1,
        kv_lora_rank=8,
        q_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=4,
        n_group=1,
        topk_group=1,
    ),
    "granitemoe": dict(_COMMON, **_MOE),
    "gpt_oss": dict(_COMMON, head_dim=4, num_local_experts=4, num_experts_per_tok=2, layer_types=None),
    # A vision-language MoE: the text tower stores its stacked experts transposed ([E, H, 2I] in the file,
    # [E, 2I, H] in the model); moe_intermediate_size=6 keeps the two orientations distinguishable by shape.
    "qwen3_vl_moe": dict(
        tie_word_embeddings=False,
        text_config=dict(
            _COMMON,
            head_dim=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 0]},
        ),
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=16,
            num_heads=2,
            out_hidden_size=16,
            patch_size=2,
            temporal_patch_size=1,
            spatial_merge_size=1,
            num_position_embeddings=16,
            deepstack_visual_indexes=[0],
        ),
    ),
    # An encoder (no causal LM head): BertModel, whose checkpoint keys carry no "bert." prefix.
    "bert": dict(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
    ),
}

#: The transformers class of each family that is not built with ``AutoModelForCausalLM``.
MODEL_CLASSES: dict[str, str] = {
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
    "bert": "AutoModel",
}


def tiny_config(family: str) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(family, **FAMILIES[family])


def model_class(family: str) -> Any:
    """The transformers class that builds (``from_config``) and loads (``from_pretrained``) ``family``."""
    import transformers

    return getattr(transformers, MODEL_CLASSES.get(family, "AutoModelForCausalLM"))


def tiny_model(family: str, seed: int = 0) -> Any:
    import torch

    torch.manual_seed(seed)
    cls = model_class(family)
    config = tiny_config(family)
    model = cls.from_config(config) if cls.__name__.startswith("Auto") else cls(config)
    # give every tensor distinct values (init may leave norms at exactly 1 and biases at 0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    return model.eval()
