"""The seed's contract on one process: both loaders, reports, strict, tied aliases, deferred groups, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import hp_fastload as hf
from hp_fastload import rules
from hp_fastload.errors import HpFastloadError, TargetError


class AddOne(rules.ConversionOp):
    """norm + 1 reparameterization: a scalar post-op the region loader must apply exactly as torch."""

    def convert(self, inputs, source_patterns, target_patterns, **kw):
        (values,) = inputs.values()
        return {target_patterns[0]: values[0] + 1.0}


class Product(rules.ConversionOp):
    """Combines two tensors elementwise: cannot be a region read, so it is deferred."""

    def convert(self, inputs, source_patterns, target_patterns, **kw):
        a, b = (inputs[p][0] for p in source_patterns)
        return {target_patterns[0]: a * b}


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.lm_head = nn.Linear(4, 8, bias=False)
        self.lm_head.weight = self.embed.weight
        layer = nn.Module()
        layer.qkv = nn.Linear(4, 16)
        layer.norm = nn.Module()
        layer.norm.weight = nn.Parameter(torch.empty(4))
        layer.experts = nn.Module()
        layer.experts.gate_up_proj = nn.Parameter(torch.empty(2, 6, 4))
        layer.rope_q = nn.Linear(4, 8, bias=False)
        layer.scaled = nn.Module()
        layer.scaled.weight = nn.Parameter(torch.empty(4))
        self.layers = nn.ModuleList([layer])
        self.register_buffer("inv_freq", torch.ones(2), persistent=False)
        for p in self.parameters():
            nn.init.zeros_(p)


class Cfg:
    num_attention_heads = 2


def mapping() -> list[object]:
    return [
        rules.WeightConverter(
            ["attn.q.weight", "attn.k.weight", "attn.v.weight"], "qkv.weight", [rules.Concatenate(0)]
        ),
        rules.WeightConverter(["attn.q.bias", "attn.k.bias", "attn.v.bias"], "qkv.bias", [rules.Concatenate(0)]),
        rules.WeightConverter(
            ["experts.*.gate.weight", "experts.*.up.weight"],
            "experts.gate_up_proj",
            [rules.MergeModulelist(0), rules.Concatenate(1)],
        ),
        rules.WeightConverter("norm_raw.weight", "norm.weight", [AddOne()]),
        rules.WeightConverter("rope_q_raw.weight", "rope_q.weight", [rules.PermuteForRope()]),
        rules.WeightConverter(["scaled.a", "scaled.b"], "scaled.weight", [Product()]),
    ]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)

    def r(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    tensors = {
        "embed.weight": r(8, 4, dtype=torch.bfloat16),
        "layers.0.attn.q.weight": r(8, 4),
        "layers.0.attn.k.weight": r(4, 4),
        "layers.0.attn.v.weight": r(4, 4),
        "layers.0.attn.q.bias": r(8),
        "layers.0.attn.k.bias": r(4),
        "layers.0.attn.v.bias": r(4),
        "layers.0.experts.0.gate.weight": r(3, 4),
        "layers.0.experts.1.gate.weight": r(3, 4),
        "layers.0.experts.0.up.weight": r(3, 4),
        "layers.0.experts.1.up.weight": r(3, 4),
        "layers.0.norm_raw.weight": r(4, dtype=torch.bfloat16),
        "layers.0.rope_q_raw.weight": r(8, 4),
        "layers.0.scaled.a": r(4),
        "layers.0.scaled.b": r(4),
        "unused.bias": r(3),
    }
    root = tmp_path_factory.mktemp("tiny")
    save_file(tensors, str(root / "model.safetensors"))
    save_file(tensors, str(root / "weights.safetensors"))
    return root, tensors


def expected_values(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a torch-only conversion gives (the reference is torch's ops on whole tensors)."""
    rope = t["layers.0.rope_q_raw.weight"].view(2, 2, 2, 4).transpose(1, 2).reshape(8, 4)
    gate = torch.stack([t["layers.0.experts.0.gate.weight"], t["layers.0.experts.1.gate.weight"]])
    up = torch.stack([t["layers.0.experts.0.up.weight"], t["layers.0.experts.1.up.weight"]])
    return {
        "embed.weight": t["embed.weight"].float(),
        "lm_head.weight": t["embed.weight"].float(),
        "layers.0.qkv.weight": torch.cat([t[f"layers.0.attn.{n}.weight"] for n in "qkv"]),
        "layers.0.qkv.bias": torch.cat([t[f"layers.0.attn.{n}.bias"] for n in "qkv"]),
        "layers.0.norm.weight": (t["layers.0.norm_raw.weight"] + 1.0).float(),
        "layers.0.experts.gate_up_proj": torch.cat([gate, up], dim=1),
        "layers.0.rope_q.weight": rope,
        "layers.0.scaled.weight": t["layers.0.scaled.a"] * t["layers.0.scaled.b"],
    }


def load_tiny(path: Path, loader: str, **kw: object) -> tuple[Tiny, hf.LoadReport]:
    model = Tiny()
    model.config = Cfg()  # type: ignore[assignment]
    report = hf.load(model, path, weights_mapping=mapping(), loader=loader, **kw)
    return model, report


@pytest.mark.parametrize("loader", ["dcp", "legacy"])
def test_values_match_torch_conversion(checkpoint, loader):
    root, tensors = checkpoint
    model, report = load_tiny(root, loader)
    state = model.state_dict()
    for name, value in expected_values(tensors).items():
        assert torch.equal(state[name], value), name
    assert "lm_head.weight" in report.loaded_keys
    assert report.unexpected_keys == ("unused.bias",)
    assert report.missing_keys == ()
    assert len(model._weight_conversions) == 6


def test_dcp_and_legacy_agree(checkpoint):
    root, _ = checkpoint
    a, ra = load_tiny(root, "dcp")
    b, rb = load_tiny(root, "legacy")
    assert ra == rb
    for (na, va), (nb, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb and torch.equal(va, vb), na


def test_untraceable_conversion_is_deferred_and_the_rest_are_regions(checkpoint):
    root, _ = checkpoint
    model = Tiny()
    model.config = Cfg()  # type: ignore[assignment]
    p = hf.plan(model, root, weights_mapping=mapping())
    assert [n for d in p.deferred for n in d.claims] == ["layers.0.scaled.weight"]
    assert "layers.0.rope_q.weight" in p.region_reads
    rope_items = p.region_reads["layers.0.rope_q.weight"]
    assert len(rope_items) == 4  # two blocks per head, 2 heads
    norm_items = p.region_reads["layers.0.norm.weight"]
    assert norm_items and all(i.post for i in norm_items)


def test_strict_fails_before_reading(checkpoint):
    root, _ = checkpoint
    model = Tiny()
    model.config = Cfg()  # type: ignore[assignment]
    model.extra = nn.Parameter(torch.zeros(2))
    with pytest.raises(RuntimeError, match="extra"):
        hf.load(model, root, weights_mapping=mapping(), loader="dcp")
    assert torch.count_nonzero(model.embed.weight) == 0
    report = hf.load(model, root, weights_mapping=mapping(), strict=False)
    assert report.missing_keys == ("extra",)
    assert torch.count_nonzero(model.embed.weight) > 0


@pytest.mark.parametrize("loader", ["dcp", "legacy"])
def test_single_file_of_any_name(checkpoint, loader):
    root, tensors = checkpoint
    model, _ = load_tiny(root / "weights.safetensors", loader)
    assert torch.equal(model.layers[0].qkv.weight, expected_values(tensors)["layers.0.qkv.weight"])


def test_loader_resolution(monkeypatch):
    monkeypatch.delenv(hf.HF_LOADER_ENV, raising=False)
    assert hf.resolve_hf_loader(None) == "dcp"
    monkeypatch.setenv(hf.HF_LOADER_ENV, "LEGACY")
    assert hf.resolve_hf_loader(None) == "legacy"
    assert hf.resolve_hf_loader("dcp") == "dcp"
    with pytest.raises(ValueError, match=r"fastest.*legacy, dcp.*HYPER_PARALLEL_HF_LOADER"):
        hf.resolve_hf_loader("fastest")
    with pytest.raises(ValueError, match="fastest"):
        hf.HuggingFaceCheckpointer(loader="fastest")


def test_checkpointer_contract(checkpoint):
    root, tensors = checkpoint
    model = Tiny()
    model.config = Cfg()  # type: ignore[assignment]
    ckpt = hf.HuggingFaceCheckpointer(loader="dcp", weights_mapping=mapping())
    weight = model.embed.weight
    state = {"model": model}
    out = ckpt.load(root, state)
    assert out is state and isinstance(state["load_report"], hf.LoadReport)
    assert model.embed.weight is weight  # written in place
    assert torch.equal(weight, tensors["embed.weight"].float())
    with pytest.raises(ValueError, match="training state"):
        ckpt.load(root, {"model": model}, extra_state_skeleton={})
    with pytest.raises(ValueError, match="pretrained_path must be provided"):
        ckpt.load("", {"model": model})
    with pytest.raises(TypeError, match=r"nn\.Module"):
        ckpt.load(root, {"model": model.state_dict()})
    with pytest.raises(TypeError, match=r"nn\.Module to export"):  # save exports a module (tests/test_save.py)
        ckpt.save(root, {"model": model.state_dict()})


def test_external_targets_and_claimed_sources(checkpoint):
    root, _ = checkpoint
    model = Tiny()
    model.config = Cfg()  # type: ignore[assignment]
    report = hf.load(
        model,
        root,
        weights_mapping=mapping(),
        external_target_fqns={"layers.0.scaled.weight"},
        claimed_source_keys={"unused.bias", "layers.0.scaled.a", "layers.0.scaled.b"},
    )
    assert "layers.0.scaled.weight" not in report.loaded_keys + report.missing_keys
    assert report.unexpected_keys == ()
    assert torch.count_nonzero(model.layers[0].scaled.weight) == 0
    with pytest.raises(ValueError, match="nope"):
        hf.load(model, root, weights_mapping=mapping(), external_target_fqns={"nope"})


def test_shape_mismatch_names_the_target(checkpoint):
    root, _ = checkpoint
    model = Tiny()
    model.config = Cfg()  # type: ignore[assignment]
    model.layers[0].qkv = nn.Linear(4, 12)
    with pytest.raises(TargetError, match=r"layers\.0\.qkv\.bias: checkpoint \(16,\) vs target \(12,\)"):
        hf.load(model, root, weights_mapping=mapping())
    assert issubclass(TargetError, HpFastloadError) and issubclass(TargetError, ValueError)


def test_conversion_error_names_the_group(tmp_path):
    save_file(
        {"a.q.weight": torch.zeros(2, 3), "a.k.weight": torch.zeros(2, 4)},
        str(tmp_path / "model.safetensors"),
    )
    model = nn.Module()
    model.a = nn.Module()
    model.a.qk = nn.Parameter(torch.zeros(4, 3))
    conv = rules.WeightConverter(["q.weight", "k.weight"], "qk", [rules.Concatenate(0)])
    with pytest.raises(RuntimeError, match=r"Failed to convert checkpoint tensors for a\.qk"):
        hf.load(model, tmp_path, weights_mapping=[conv])


def test_meta_target_is_refused_before_reading(checkpoint):
    root, _ = checkpoint
    with torch.device("meta"):
        model = Tiny()
    model.config = Cfg()  # type: ignore[assignment]
    with pytest.raises(TargetError, match="materialized"):
        hf.load(model, root, weights_mapping=mapping())


def test_tied_alias_present_in_checkpoint_first_wins(tmp_path):
    emb = torch.randn(8, 4)
    save_file({"embed.weight": emb, "lm_head.weight": emb + 1}, str(tmp_path / "model.safetensors"))
    model = nn.Module()
    model.embed = nn.Embedding(8, 4)
    model.lm_head = nn.Linear(4, 8, bias=False)
    model.lm_head.weight = model.embed.weight
    report = hf.load(model, tmp_path, weights_mapping=[])
    assert torch.equal(model.embed.weight, emb)
    assert report.loaded_keys == ("embed.weight", "lm_head.weight") and report.unexpected_keys == ()


class Replaced(nn.Module):
    """A model whose attention was replaced by a fused-qkv module before loading (hyper's replacement path)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.lm_head = nn.Linear(4, 8, bias=False)
        self.lm_head.weight = self.embed.weight
        layer = nn.Module()
        layer.self_attn = nn.Module()
        layer.self_attn.linear_qkv = nn.Linear(4, 16, bias=False)
        layer.norm = nn.Module()
        layer.norm.weight = nn.Parameter(torch.zeros(4))
        self.layers = nn.ModuleList([layer])
        for p in self.parameters():
            nn.init.zeros_(p)


def replacement_rules() -> list[object]:
    qkv = rules.WeightConverter(
        ["q_proj.weight", "k_proj.weight", "v_proj.weight"], "linear_qkv.weight", [rules.Concatenate(0)]
    )
    qkv.scope_prefix = "layers.0.self_attn"
    norm = rules.WeightConverter("weight", "weight", [AddOne()])
    norm.scope_prefix = "layers.0.norm"
    return [qkv, norm]


@pytest.fixture(scope="module")
def replacement_checkpoint(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    tensors = {
        "embed.weight": torch.randn(8, 4, generator=g),
        "layers.0.self_attn.q_proj.weight": torch.randn(8, 4, generator=g),
        "layers.0.self_attn.k_proj.weight": torch.randn(4, 4, generator=g),
        "layers.0.self_attn.v_proj.weight": torch.randn(4, 4, generator=g),
        "layers.0.norm.weight": torch.randn(4, generator=g).to(torch.bfloat16),
        "unused.bias": torch.randn(2, generator=g),
    }
    root = tmp_path_factory.mktemp("replaced")
    save_file(tensors, str(root / "model.safetensors"))
    return root, tensors


#: The pre-replacement model's names and shapes (what the checkpoint is normalized to in stage 1).
SOURCE_SHAPES = {
    "embed.weight": (8, 4),
    "lm_head.weight": (8, 4),
    "layers.0.self_attn.q_proj.weight": (8, 4),
    "layers.0.self_attn.k_proj.weight": (4, 4),
    "layers.0.self_attn.v_proj.weight": (4, 4),
    "layers.0.norm.weight": (4,),
}


def load_replaced(root: Path, loader: str, mapping: list[object] | None = None) -> tuple[Replaced, hf.LoadReport]:
    model = Replaced()
    mapping = mapping if mapping is not None else replacement_rules()
    model._hp_replacement_weight_conversions = mapping  # type: ignore[assignment]
    model._hp_checkpoint_source_shapes = dict(SOURCE_SHAPES)  # type: ignore[assignment]
    report = hf.load(model, root, weights_mapping=mapping, loader=loader)
    return model, report


def test_replacement_conversions_load_in_two_stages(replacement_checkpoint):
    root, t = replacement_checkpoint
    a, ra = load_replaced(root, "dcp")
    b, rb = load_replaced(root, "legacy")
    assert ra == rb
    assert ra.missing_keys == () and ra.unexpected_keys == ("unused.bias",)
    assert ra.region_targets == 3 and ra.deferred_targets == ()  # both stages composed into region reads
    qkv = torch.cat([t[f"layers.0.self_attn.{n}_proj.weight"] for n in "qkv"])
    for model in (a, b):
        assert torch.equal(model.layers[0].self_attn.linear_qkv.weight, qkv)
        assert torch.equal(model.layers[0].norm.weight, (t["layers.0.norm.weight"] + 1.0).float())
        assert torch.equal(model.lm_head.weight, t["embed.weight"])
        assert len(model._hp_used_replacement_weight_conversions) == 2
        assert model._hp_used_base_weight_conversions == []
        assert len(model._weight_conversions) == 2


@pytest.mark.parametrize("loader", ["dcp", "legacy"])
def test_replacement_argument_equals_the_model_attributes(replacement_checkpoint, loader):
    """``replacement=hf.Replacement(...)`` plans the same two stages as the attributes, and wins over them."""
    root, _ = replacement_checkpoint
    by_attributes, expected = load_replaced(root, loader)
    model = Replaced()
    mapping = replacement_rules()
    replacement = hf.Replacement(rules=mapping, source_shapes=dict(SOURCE_SHAPES))
    assert hf.plan(model, root, loader=loader, replacement=replacement).report == expected
    report = hf.load(model, root, loader=loader, replacement=replacement)  # no weights_mapping needed
    assert report == expected and report.region_targets == expected.region_targets
    for name, value in by_attributes.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    assert len(model._hp_used_replacement_weight_conversions) == 2

    # An explicit argument is taken over the attributes: a stage that cannot route fails to plan.
    wrong = Replaced()
    wrong._hp_replacement_weight_conversions = replacement_rules()  # type: ignore[assignment]
    wrong._hp_checkpoint_source_shapes = dict(SOURCE_SHAPES)  # type: ignore[assignment]
    stage = hf.Replacement(rules=replacement_rules(), source_shapes={"layers.0.norm.weight": (4,)})
    with pytest.raises(RuntimeError, match="did not load"):
        hf.load(wrong, root, loader=loader, replacement=stage)


class Square(rules.ConversionOp):
    """Reads values (x * x): a replacement stage the region loader must defer."""

    def convert(self, inputs, source_patterns, target_patterns, **kw):
        (values,) = inputs.values()
        return {target_patterns[0]: values[0] * values[0]}


@pytest.mark.parametrize("loader", ["dcp", "legacy"])
def test_untraceable_replacement_stage_is_deferred_and_exact(replacement_checkpoint, loader):
    root, t = replacement_checkpoint
    mapping = replacement_rules()
    mapping[1] = rules.WeightConverter("weight", "weight", [Square()])
    mapping[1].scope_prefix = "layers.0.norm"  # type: ignore[attr-defined]
    model, report = load_replaced(root, loader, mapping)
    assert "layers.0.norm.weight" in report.deferred_targets
    assert ("layers.0.self_attn.linear_qkv.weight" in report.deferred_targets) == (loader == "legacy")
    norm = t["layers.0.norm.weight"]
    assert torch.equal(model.layers[0].norm.weight, (norm * norm).float())


def test_failing_replacement_conversion_names_its_target(replacement_checkpoint):
    root, _ = replacement_checkpoint
    model = Replaced()
    mapping = replacement_rules()
    mapping[1] = rules.WeightConverter("weight", "weight", [Product()])  # needs two inputs: fails on meta
    mapping[1].scope_prefix = "layers.0.norm"
    model._hp_replacement_weight_conversions = mapping  # type: ignore[assignment]
    model._hp_checkpoint_source_shapes = {"layers.0.norm.weight": (4,)}  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match=r"Failed to convert checkpoint tensors for layers\.0\.norm\.weight"):
        hf.load(model, root, weights_mapping=mapping)


@pytest.mark.parametrize("staging_bytes", [64, 256, 1 << 20])
def test_staging_path_double_buffers_exactly(checkpoint, staging_bytes):
    """The CUDA staging path (slabs, flips, oversize targets, post-ops before the copy), run on CPU targets."""
    from hp_fastload.api.request import plan_request
    from hp_fastload.execute.read import execute_plan
    from hp_fastload.planning.front import plan
    from hp_fastload.source.index import CheckpointIndex

    root, tensors = checkpoint
    model = Tiny()
    model.config = Cfg()  # type: ignore[assignment]
    request = plan_request(model, weights_mapping=mapping(), loader="dcp", strict=False)
    p, context = plan(model, CheckpointIndex.open(root), request)
    stats = execute_plan(p, context, stage_all=True, staging_bytes=staging_bytes)
    assert stats.engine_calls >= (3 if staging_bytes < 256 else 1)
    state = model.state_dict()
    for name, value in expected_values(tensors).items():
        assert torch.equal(state[name], value), name
    # Staging stays within the budget: targets larger than a slab are staged in blocks of rows; only a single
    # row wider than a slab may get a slab of its own size.
    slab = max(staging_bytes // 2, 64)
    widest_row = max(t[0].numel() * t.element_size() for t in state.values() if t.dim())
    assert 0 < stats.extra["staging_bytes"] <= 2 * max(slab, widest_row)


@pytest.mark.parametrize("loader", ["dcp", "legacy"])
def test_zero_dim_and_mixed_rank_tensors(tmp_path, loader):
    """0-d parameters and buffers next to 1-d and 3-d ones (the packer builds its records per destination)."""
    from safetensors import safe_open

    tensors = {"s": torch.tensor(3.5), "v": torch.arange(3.0), "c": torch.arange(24.0).reshape(2, 3, 4)}
    save_file(tensors, str(tmp_path / "model.safetensors"))

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.s = nn.Parameter(torch.tensor(0.0))
            self.v = nn.Parameter(torch.zeros(3))
            self.register_buffer("c", torch.zeros(2, 3, 4))

    m = M()
    report = hf.load(m, tmp_path, loader=loader)
    assert sorted(report.loaded_keys) == ["c", "s", "v"]
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        for name in tensors:
            assert torch.equal(getattr(m, name).detach(), f.get_tensor(name)), name


def test_plan_read_accounting(tmp_path):
    """``LoadPlan.read_bytes_by_target`` / ``read_bytes_by_file`` / ``bytes_needed`` count each target's source
    bytes (a bf16 source read into a float32 parameter counts 2 bytes an element)."""
    tensors = {"a.weight": torch.ones(4, 3, dtype=torch.bfloat16), "b.weight": torch.ones(5)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model = nn.Module()
    model.a = nn.Linear(3, 4, bias=False)
    model.b = nn.Module()
    model.b.weight = nn.Parameter(torch.zeros(5))
    plan = hf.plan(model, tmp_path)
    assert plan.read_bytes_by_target() == {"a.weight": 24, "b.weight": 20}
    assert plan.read_bytes_by_file() == {str(tmp_path / "model.safetensors"): 44}
    assert plan.bytes_needed == 44
