"""Tiny transformers configs of several families, for tests that need real architectures and key lists."""

from __future__ import annotations

from typing import Any

_SIZES: dict[str, Any] = dict(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
_COMMON: dict[str, Any] = dict(_SIZES, tie_word_embeddings=False)

#: A tiny decoder's sizes (4 heads of 4, 2 KV heads): the prologue, finalize and CLI-plan tests add their own
#: tie, vocabulary and expert fields.
TINY_DECODER: dict[str, Any] = dict(_SIZES, head_dim=4)

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


def config_of(family: str, **fields: Any) -> Any:
    """transformers' config of ``family`` with ``fields`` set."""
    from transformers import AutoConfig

    return AutoConfig.for_model(family, **fields)


def tiny_config(family: str) -> Any:
    return config_of(family, **FAMILIES[family])


def sgd_step_losses(model: Any, ids: Any, lr: float) -> tuple[Any, Any]:
    """The language-model loss of ``ids`` (as its own labels) before and after one SGD step of ``lr``, in train
    mode: what a loaded model and transformers' own must agree on."""
    import torch

    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        after = model(input_ids=ids, labels=ids).loss
    return loss, after


def randomized(model: Any, scale: float = 1.0) -> Any:
    """``model`` with every parameter drawn from ``randn * scale`` (init may leave norms at exactly 1 and
    biases at 0, which would hide a value put in the wrong place)."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * scale)
    return model


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
    return randomized(model).eval()


# ---------------------------------------------------------------------------------------------------------
# Architectures whose conversion rules transformers registers under the class name or model_type of the root
# (``^embed_out.`` -> ``lm_head.``, the ``language_model.`` prefixes, ...): the rules a root wrapped by
# ``fully_shard`` (class ``FSDP<Class>``) must still get. Built from transformers' own default configs, shrunk.

#: model_type -> the transformers class that ``save_pretrained`` writes and ``from_pretrained`` reads
ROOT_RULE_FAMILIES: dict[str, str] = {
    "gpt_neox": "GPTNeoXForCausalLM",
    "llava": "LlavaForConditionalGeneration",
    "llava_next": "LlavaNextForConditionalGeneration",
    "fuyu": "FuyuForCausalLM",
    "mllama": "MllamaForConditionalGeneration",
    "emu3": "Emu3ForConditionalGeneration",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "bailing_hybrid": "BailingHybridForCausalLM",
    "hy_v4": "HYV4ForCausalLM",
    "inkling2_text": "Inkling2ForCausalLM",
}

_SHRINK: dict[str, Any] = dict(
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=64,
    unpadded_vocab_size=60,  # Inkling2 (transformers >= 5.25): lm_head rows; its conversion pads them to vocab_size
    head_dim=4,
    moe_intermediate_size=8,
    num_experts=4,
    num_experts_per_tok=2,
    num_local_experts=4,
    n_routed_experts=4,
    shared_expert_intermediate_size=8,
    depth=1,
    embed_dim=16,
    num_heads=2,
    pad_token_id=0,
    q_lora_rank=8,
    kv_lora_rank=8,
    qk_nope_head_dim=4,
    qk_rope_head_dim=4,
    v_head_dim=4,
    index_head_dim=4,
    index_n_heads=2,
    index_topk=4,
    codebook_size=64,
    base_channels=32,
    channel_multiplier=[1, 2],
    num_res_blocks=1,
    attn_resolutions=[],
)


def _shrink(config: Any) -> Any:
    fields = config.to_dict()
    for key, value in _SHRINK.items():
        if key in fields:
            setattr(config, key, value)
    layers = fields.get("num_hidden_layers")
    for key, value in fields.items():  # per-layer lists follow the layer count
        if not isinstance(value, list) or not value:
            continue
        if key.endswith("layer_types"):  # the first two kinds kept
            kinds = list(dict.fromkeys(value))[:2]
            setattr(config, key, (kinds * 2)[:2])
        elif isinstance(layers, int) and layers > 2 and len(value) == layers:  # e.g. BailingHybrid's swiglu_limits
            setattr(config, key, value[:2])
    if "vocabulary_map" in fields and fields["vocabulary_map"] is None:  # emu3 cannot build without one
        config.vocabulary_map = {"<|extra_200|>": 60, "<image>": 61, "<|visual token 000000|>": 62}
    for name in getattr(config, "sub_configs", {}):
        sub = getattr(config, name, None)
        if sub is not None:
            _shrink(sub)
    return config


def root_rule_config(family: str) -> Any:
    """A tiny config of a ``ROOT_RULE_FAMILIES`` architecture (transformers' defaults, every size shrunk)."""
    from transformers import AutoConfig

    return _shrink(AutoConfig.for_model(family))


def root_rule_class(family: str) -> Any:
    import transformers

    return getattr(transformers, ROOT_RULE_FAMILIES[family])


def scale_mapping(keys: list[str]) -> list[Any]:
    """A value-changing conversion (times 4, exact both ways) on each of ``keys``: torch fallbacks on save."""
    from transformers.core_model_loading import ConversionOps, WeightConverter

    class Scale(ConversionOps):
        def __init__(self, factor: float) -> None:
            self.factor = factor

        def convert(
            self, input_dict: dict[str, Any], source_patterns: list[str], target_patterns: list[str], **kw: Any
        ) -> dict[str, Any]:
            (values,) = input_dict.values()
            tensor = values[0] if isinstance(values, list) else values
            return {target_patterns[0]: tensor * self.factor}

        @property
        def reverse_op(self) -> ConversionOps:
            return Scale(1.0 / self.factor)

    return [WeightConverter(key, key, [Scale(4.0)]) for key in keys]
