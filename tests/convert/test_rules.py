"""Rule matching and grouping against transformers' own implementation, on real key lists."""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter as HFConverter
from transformers.core_model_loading import dot_natural_key as hf_dot_natural_key
from transformers.core_model_loading import rename_source_key as hf_rename_source_key

from hp_fastload import rules
from hp_fastload.convert.groups import build_groups, rename_key
from hp_fastload.convert.patterns import Prefiltered, required_literals
from tests.helpers.shards import write_sharded
from tests.helpers.tiny_models import FAMILIES, tiny_model


def _checkpoint_keys(model: torch.nn.Module, tmp_path) -> list[str]:
    from safetensors import safe_open

    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        return sorted(f.keys(), key=hf_dot_natural_key)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_case(request, tmp_path_factory):
    model = tiny_model(request.param)
    keys = _checkpoint_keys(model, tmp_path_factory.mktemp(request.param))
    return request.param, model, keys


@pytest.mark.parametrize("prefiltered", [False, True], ids=["plain", "prefiltered"])
@pytest.mark.parametrize("own", [False, True], ids=["transformers-objects", "hp_fastload-objects"])
def test_renames_match_transformers(family_case, own, prefiltered):
    family, model, keys = family_case
    hf_rules = get_model_conversion_mapping(model)
    hf_renamings = [r for r in hf_rules if not isinstance(r, HFConverter)]
    hf_converters = [r for r in hf_rules if isinstance(r, HFConverter)]
    ours = [rules.from_transformers(r) for r in hf_rules] if own else hf_rules
    targets = dict(model.state_dict())
    renamings = [r for r in ours if rules.is_renaming(r)]
    converters = [r for r in ours if rules.is_converter(r)]
    if prefiltered:
        renamings = [Prefiltered(r) for r in renamings]
        converters = [Prefiltered(r) for r in converters]
    changed = 0
    for key in keys:
        expected, expected_pattern = hf_rename_source_key(
            key, hf_renamings, hf_converters, model.base_model_prefix, targets
        )
        if expected not in targets and key in targets:
            expected, expected_pattern = hf_rename_source_key(key, [], [], model.base_model_prefix, targets)
        got, _, pattern = rename_key(key, renamings, converters, model.base_model_prefix, targets)
        assert (got, pattern) == (expected, expected_pattern), f"{family}: {key}"
        changed += got != key
    if family in {"mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"}:
        assert changed > 0, f"{family}: the expert rules should rename keys"


def test_groups_stack_experts_in_natural_order(tmp_path):
    model = tiny_model("mixtral")
    keys = _checkpoint_keys(model, tmp_path)
    mapping = rules.resolve_mapping(model, None)
    groups, unexpected = build_groups(keys, dict(model.state_dict()), mapping, base_model_prefix="model")
    assert unexpected == []
    by_target = {g.target: g for g in groups}
    gate_up = by_target["model.layers.0.mlp.experts.gate_up_proj"]
    for w in ("w1", "w3"):
        assert [k for p, k in gate_up.sources if p.endswith(f"{w}.weight")] == [
            f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight" for e in range(4)
        ]
    # natural order: expert 10 after expert 2
    wide = [f"layers.0.experts.{e}.w1.weight" for e in (10, 2, 1)]
    conv = rules.WeightConverter(["experts.*.w1.weight"], "experts.w", [rules.MergeModulelist(0)])
    groups, _ = build_groups(sorted(wide, key=rules.dot_natural_key), {"layers.0.experts.w"}, [conv])
    assert groups[0].keys == [f"layers.0.experts.{e}.w1.weight" for e in (1, 2, 10)]


def test_dot_natural_key_matches_transformers():
    names = ["a.10.b", "a.2.b", "a.b", "shard_11.x", "shard_2.x", "a.1", "a.1a", "layers.0.weight"]
    assert sorted(names, key=rules.dot_natural_key) == sorted(names, key=hf_dot_natural_key)


def test_natural_sort_key_sorts_like_transformers():
    import random

    rng = random.Random(0)
    parts = ["a", "ab", "abc", "b", "x1", "x2", "x10", "x01", "0", "1", "2", "10", "007", "w_3", "w_", "layers"]
    names = [".".join(rng.choice(parts) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    assert sorted(names, key=rules.natural_sort_key) == sorted(names, key=hf_dot_natural_key)
    for a, b in itertools.pairwise(names):
        same = hf_dot_natural_key(a) == hf_dot_natural_key(b)
        assert (rules.natural_sort_key(a) == rules.natural_sort_key(b)) == same


def test_checkpoint_index_keys_merge_shards_in_natural_order(tmp_path):
    """``SafetensorsHeader.natural_order`` over several shards, and the index built on it, order keys exactly as
    the planner's ``natural_sort_key`` does (ties by name); non-ASCII names are handed back to Python."""
    import random

    from hp_fastload import _core
    from hp_fastload.source.index import CheckpointIndex

    rng = random.Random(2)
    parts = ["a", "x1", "x01", "0", "00", "007", "10", "2", "layers", "experts", "w_3", "w_", "", "9" * 30, "é2"]
    parts += ["٣", "e²"]  # non-ASCII digits: Python's to order
    names = sorted({".".join(rng.choice(parts) for _ in range(rng.randint(1, 5))) for _ in range(2000)})
    rng.shuffle(names)
    write_sharded(tmp_path, [names[i::3] for i in range(3)])
    index = CheckpointIndex.open(tmp_path)
    every = [key for f in index.files for key in f]
    order, other = _core.SafetensorsHeader.natural_order([f.header for f in index.files])
    assert sorted(order + other) == list(range(len(names)))
    # Rust orders the names whose compact key provably sorts like the planner's; the others come back apart.
    left = {n for n in names if not n.isascii() or "9" * 25 in n}
    assert {every[i] for i in other} == left and left
    ordered = [every[i] for i in order]
    assert ordered == sorted((n for n in names if n not in left), key=lambda n: (rules.natural_sort_key(n), n))
    keys = index.keys()
    assert sorted(keys) == sorted(names)
    sort_keys = [rules.natural_sort_key(k) for k in keys]
    assert sort_keys == sorted(sort_keys)
    picked = [*rng.sample(names, 200), "not.a.key.10", "not.a.key.9"]
    assert index.natural_sorted(picked) == [*sorted(picked[:200], key=keys.index), "not.a.key.9", "not.a.key.10"]


def test_name_boundary_guard_and_star_dot():
    conv = rules.WeightConverter(["mlp.experts.*.gate_proj.weight"], "mlp.experts.gate_up_proj", [rules.Chunk(0)])
    assert conv.rename_source_key("model.layers.12.mlp.experts.3.gate_proj.weight") == (
        "model.layers.12.mlp.experts.gate_up_proj",
        "mlp.experts.*.gate_proj.weight",
    )
    assert conv.rename_source_key("model.layers.12.mlp.experts.3.gate_proj.weight_scale_inv")[1] is None


def test_scope_prefix_and_capture_group():
    scoped = rules.WeightRenaming("norm.weight", "norm.scale")
    scoped.scope_prefix = "layers.0"
    assert scoped.rename_source_key("layers.0.norm.weight") == ("layers.0.norm.scale", "norm.weight")
    assert scoped.rename_source_key("layers.1.norm.weight") == ("layers.1.norm.weight", None)
    capture = rules.WeightRenaming(r"^(encoder|decoder)\.old", r"\1.new")
    assert capture.rename_source_key("decoder.old.weight")[0] == "decoder.new.weight"


def test_renamings_chain_then_one_converter():
    first = rules.WeightRenaming(r"\.block_sparse_moe\.", ".mlp.")
    second = rules.WeightRenaming(r"\.mlp\.gate\.", ".mlp.router.")
    conv_a = rules.WeightConverter(["mlp.router.weight"], "mlp.router.w", [rules.Transpose(0, 1)])
    conv_b = rules.WeightConverter(["router.weight"], "router.other", [rules.Transpose(0, 1)])
    key = "layers.0.block_sparse_moe.gate.weight"
    renamed, conv, pattern = rename_key(key, [first, second], [conv_a, conv_b], None, {"layers.0.mlp.router.w"})
    assert (renamed, conv, pattern) == ("layers.0.mlp.router.w", conv_a, "mlp.router.weight")


def test_resolve_mapping_orders_key_mapping_first_and_rejects_unknown():
    conv = rules.WeightConverter(["a"], "b", [rules.Chunk(0)])
    out = rules.resolve_mapping(torch.nn.Linear(1, 1), [conv, conv], key_mapping={"^legacy\\.": ""})
    assert isinstance(out[0], rules.WeightRenaming) and out[1] is conv and len(out) == 2
    with pytest.raises(ValueError, match="Unsupported weight transforms: int"):
        rules.resolve_mapping(torch.nn.Linear(1, 1), [3])


def test_own_ops_match_transformers_ops():
    from transformers import core_model_loading as hf

    torch.manual_seed(0)
    experts = [torch.randn(3, 4) for _ in range(3)]
    cases = [
        (rules.MergeModulelist(0), hf.MergeModulelist(0), {"s": list(experts)}, ["s"], ["t"]),
        (rules.Chunk(0), hf.Chunk(0), {"s": [torch.randn(6, 4)]}, ["s"], ["a", "b", "c"]),
        (rules.Transpose(0, 1), hf.Transpose(0, 1), {"s": [torch.randn(6, 4)]}, ["s"], ["t"]),
        (rules.Interleave(0), hf.Interleave(0), {"s": [torch.randn(6, 4)]}, ["s"], ["t"]),
        (rules.SplitModulelist(0), hf.SplitModulelist(0), {"s": [torch.randn(3, 2, 4)]}, ["s"], ["t.*.w"]),
    ]
    for ours, theirs, inputs, src, tgt in cases:
        a = ours.convert({k: list(v) for k, v in inputs.items()}, src, tgt)
        b = theirs.convert({k: list(v) for k, v in inputs.items()}, src, tgt)
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (ours, k)

    class Cfg:
        num_attention_heads = 2

    rope = torch.randn(8, 4)
    a = rules.PermuteForRope().convert({"q": [rope]}, ["q"], ["q"], config=Cfg())
    b = hf.PermuteForRope().convert({"q": [rope]}, ["q"], ["q"], config=Cfg())
    assert torch.equal(a["q"], b["q"])
    assert re.search("PermuteForRope", repr(rules.PermuteForRope()))


def test_literal_prefilter_is_derived_from_the_regex():
    conv = rules.WeightConverter(
        ["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"], "x", [rules.Chunk(0)]
    )
    assert required_literals(conv) == (".gate_proj", ".up_proj")
    assert required_literals(rules.WeightRenaming(r"^(encoder|decoder)\.old", r"\1.new")) == (".old",)
    assert required_literals(rules.WeightRenaming(r"(?i:norm)", "n")) is None
    assert required_literals(rules.WeightRenaming(r"a|b.c", "n")) is None  # an alternative with no 2-char literal


def test_batched_grouping_matches_transformers_per_key(family_case):
    family, model, keys = family_case
    hf_rules = get_model_conversion_mapping(model)
    hf_renamings = [r for r in hf_rules if not isinstance(r, HFConverter)]
    hf_converters = [r for r in hf_rules if isinstance(r, HFConverter)]
    targets = dict(model.state_dict())
    expected: dict[str, str] = {}
    for key in keys:
        renamed, _ = hf_rename_source_key(key, hf_renamings, hf_converters, model.base_model_prefix, targets)
        if renamed not in targets and key in targets:
            renamed, _ = hf_rename_source_key(key, [], [], model.base_model_prefix, targets)
        expected[key] = renamed
    groups, unexpected = build_groups(keys, targets, rules.resolve_mapping(model, None), base_model_prefix="model")
    got = {key: group.target for group in groups for key in group.keys}
    assert got == {k: v for k, v in expected.items() if k not in unexpected}, family
    assert all(expected[k] not in targets for k in unexpected), family


def test_split_alternatives_cut_only_at_top_level_bars():
    from hp_fastload.convert.patterns import split_alternatives

    assert split_alternatives(r"(?P<g0>a[|(]b)|(?P<g1>c\|d)|(?P<g2>[]|]x)|(?P<g3>(e|f))") == [
        r"(?P<g0>a[|(]b)",
        r"(?P<g1>c\|d)",
        r"(?P<g2>[]|]x)",
        r"(?P<g3>(e|f))",
    ]


@pytest.mark.parametrize("make", [HFConverter, rules.WeightConverter], ids=["transformers", "hp_fastload"])
def test_alternatives_searched_apart_match_like_the_joined_regex(make):
    """``rename_all`` searches each alternative alone in the keys holding its literal; the result must be what
    the rule's own ``rename_source_key`` (one search of the joined regex: leftmost match, ties to the first
    branch) gives for every key."""
    from transformers.core_model_loading import MergeModulelist

    from hp_fastload.convert.patterns import Prefiltered

    rule = make(
        ["mlp.experts.*.gate_proj.weight", "experts.*.up_proj.weight", "gate_proj", "mlp.*.weight"],
        "mlp.experts.gate_up_proj",
        [rules.MergeModulelist(0)] if make is rules.WeightConverter else [MergeModulelist(0)],
    )
    wrapped = Prefiltered(rule)
    assert wrapped.searches is not None and len(wrapped.searches) == 4
    parts = ["model", "layers", "3", "mlp", "experts", "12", "gate_proj", "up_proj", "weight", "weight_scale_inv"]
    keys = sorted({".".join(p) for n in range(2, 7) for p in itertools.permutations(parts, n)})[::7]
    keys += ["a.gate_proj.mlp.experts.1.up_proj.weight", "mlp.experts.1.gate_proj.weight", "mlp.x.weight"]
    got = {i: (new, pattern) for i, new, pattern in wrapped.rename_all(keys)}
    expected = {}
    for i, key in enumerate(keys):
        new, pattern = rule.rename_source_key(key)
        if pattern is not None:
            expected[i] = (new, pattern)
    assert got == expected
    assert len(expected) > 1000 and len({p for _, p in expected.values()}) == 4


@pytest.mark.parametrize("doubled_target", [False, True])
def test_prefix_normalization_in_bulk_equals_per_name(doubled_target):
    """``normalized`` (one dict lookup per name) gives ``prefix_normalize``'s answer for every name."""
    import random

    from hp_fastload.convert.groups import normalized, prefix_normalize

    rng = random.Random(3)
    parts = ["model", "lm_head", "layers", "0", "1", "weight", "embed", "model.model"]
    targets = {".".join(rng.choice(parts) for _ in range(rng.randint(1, 4))) for _ in range(300)}
    targets = {t for t in targets if not t.startswith("model.model.")}
    if doubled_target:
        targets.add("model.model.x")
    names = [".".join(rng.choice(parts) for _ in range(rng.randint(1, 5))) for _ in range(3000)]
    names += [f"model.{t}" for t in list(targets)[:50]] + [t.removeprefix("model.") for t in list(targets)[:50]]
    expected = [prefix_normalize(n, "model", targets) for n in names]
    assert normalized(names, "model", targets) == expected
    assert sum(e != n for e, n in zip(expected, names, strict=True)) > 50  # the prefix moved for many
    assert normalized(names, None, targets) == names
