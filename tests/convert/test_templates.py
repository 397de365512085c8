"""Load groups built once per key template (``hp_fastload.convert.templates``) equal the per-key path's, group for group
and key for key: on every family's real ``save_pretrained`` checkpoint keys and transformers' own mapping, on
big generated expert layouts, and on rules built to trip a template rename (digit literals, one-character
wildcards next to numbers, a matched text that occurs earlier in the key, renames that cut numbers)."""

from __future__ import annotations

import random
import re

import pytest

from hp_fastload import _core, rules
from hp_fastload.convert.groups import build_groups, is_converter, is_renaming, prefix_normalize
from hp_fastload.convert.ops import Concatenate, MergeModulelist
from hp_fastload.convert.patterns import Prefiltered
from hp_fastload.convert.rules import WeightConverter, WeightRenaming
from hp_fastload.convert.templates import mask, number_blind, template_groups
from hp_fastload.source.index import CheckpointIndex
from hp_fastload.source.natural import natural_sorted
from tests.helpers.tiny_models import FAMILIES, tiny_model


def _shape(result):
    groups, unexpected = result
    return [(g.target, id(g.rule), list(g.sources)) for g in groups], list(unexpected)


def _outcome(keys, targets, mapping, prefix, templates):
    try:
        return _shape(build_groups(keys, targets, mapping, base_model_prefix=prefix, templates=templates))
    except ValueError as exc:  # conflicting rules, several keys to one target: the same error both ways
        return ("error", str(exc))


def _both(keys, targets, mapping, prefix=None):
    """(template path, per-key path) of build_groups; also whether the template path decided by itself."""
    templated = _outcome(keys, targets, mapping, prefix, True)
    per_key = _outcome(keys, targets, mapping, prefix, False)
    direct = template_groups(
        list(keys),
        list(keys),
        targets,
        [Prefiltered(r) for r in mapping if is_renaming(r)],
        [Prefiltered(r) for r in mapping if is_converter(r)],
        prefix,
        lambda name: prefix_normalize(name, prefix, targets),
        lambda t, r, s: (t, r, s),
    )
    return templated, per_key, direct is not None


def test_key_templates_take_out_whole_numbers_only():
    names = ["a.3.b.17", "a.10.b.0", "a.01.b", "w1.2", "x.1234567890123456789", "0.z"]
    texts, ids, numbers, width = _core.key_templates(names)
    assert texts == ["a.#.b.#", "a.01.b", "w1.#", "x.1234567890123456789", "#.z"]
    assert list(memoryview(ids).cast("I")) == [0, 0, 1, 2, 3, 4]
    assert width == 2
    assert list(memoryview(numbers).cast("q")) == [3, 17, 10, 0, -1, -1, 2, -1, -1, -1, 0, -1]
    assert [mask(n) for n in names] == ["a.#.b.#", "a.#.b.#", "a.01.b", "w1.#", "x.1234567890123456789", "#.z"]
    assert _core.key_templates(["a.#.b"]) is None


@pytest.mark.parametrize(
    "pattern",
    [
        r"(?P<g0>mlp.experts..*\.gate_proj.weight(?!\w))|(?P<g1>mlp.experts..*\.up_proj.weight(?!\w))",
        r"(?P<g0>.weight_g(?!\w))",
        r"(?P<g0>^model\.language_model\.model(?!\w))",
        r"layers\.\d+\.mlp",
        r"experts\.[^.]+\.w1",
        r"block_sparse_moe.experts.*.w2.weight",
        r"fc1\.",
        r"\.12x\.",
    ],
)
def test_number_blind_patterns(pattern):
    assert number_blind(pattern)


@pytest.mark.parametrize(
    "pattern",
    [
        r"layers\.1\.mlp",  # a digit literal: layer 1 only
        r"w\.12",  # digits that could be a number
        r"experts\.1",  # a number's first digit
        r"layers\.\d\.mlp",  # one digit: layers 0-9 only
        r"layers\..\.mlp",  # one character after a dot: a one-digit number only
        r"layers\.\d{2}\.",  # two digits
        r"layers\.[0-4]+\.",  # some digits
        r"(?<=layers\.)\d+",  # a lookbehind
        r"layers\.(\d+)\.\1",  # a back reference
        r"layers\.\d+(?=\d)",  # could end inside a number
        r"x.*\d",  # a repeat followed by a digit class
        r"\bw\b",  # word boundaries
    ],
)
def test_number_sighted_patterns(pattern):
    assert not number_blind(pattern)


def _checkpoint_keys(tmp_path, family):
    model = tiny_model(family)
    model.save_pretrained(tmp_path / family)
    index = CheckpointIndex.open(tmp_path / family)
    return model, list(index)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_families_group_alike(tmp_path, family):
    model, keys = _checkpoint_keys(tmp_path, family)
    targets = dict(model.state_dict())
    mapping = rules.resolve_mapping(model, None)
    templated, per_key, direct = _both(keys, targets, mapping, getattr(model, "base_model_prefix", None))
    assert templated == per_key
    assert direct, "the template path left a real family's checkpoint to the per-key path"
    assert templated[0], "nothing grouped"


def _experts(layers, experts, projections=("w1", "w2", "w3")):
    keys = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
    for layer in range(layers):
        keys += [f"model.layers.{layer}.input_layernorm.weight", f"model.layers.{layer}.self_attn.q_proj.weight"]
        for e in range(experts):
            keys += [f"model.layers.{layer}.block_sparse_moe.experts.{e}.{p}.weight" for p in projections]
            keys.append(f"model.layers.{layer}.block_sparse_moe.experts.{e}.w1.weight_scale_inv")
    return natural_sorted(keys)


def _expert_targets(layers):
    out = {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}
    for layer in range(layers):
        out |= {
            f"model.layers.{layer}.input_layernorm.weight",
            f"model.layers.{layer}.self_attn.q_proj.weight",
            f"model.layers.{layer}.mlp.experts.gate_up_proj",
            f"model.layers.{layer}.mlp.experts.down_proj",
        }
    return out


def _mixtral_rules(*extra):
    return [
        *extra,
        WeightRenaming("block_sparse_moe", "mlp"),
        WeightConverter(
            ["mlp.experts.*.w1.weight", "mlp.experts.*.w3.weight"],
            "mlp.experts.gate_up_proj",
            [MergeModulelist(0), Concatenate(1)],
        ),
        WeightConverter("mlp.experts.*.w2.weight", "mlp.experts.down_proj", [MergeModulelist(0)]),
    ]


def test_expert_layout_groups_alike_in_one_pass():
    keys = _experts(13, 37)
    templated, per_key, direct = _both(keys, _expert_targets(13), _mixtral_rules(), "model")
    assert templated == per_key and direct
    names = [t for t, _, _ in templated[0]]
    assert "model.layers.12.mlp.experts.gate_up_proj" in names
    assert len(templated[1]) == 13 * 37  # the scales: no target


@pytest.mark.parametrize(
    "extra",
    [
        WeightRenaming(r"layers\.1\.", "layers.one."),  # digit literal
        WeightRenaming(r"layers\.\d\.input", "layers.x.input"),  # one digit
        WeightRenaming(r"\..\.self_attn", ".self_attn"),  # a lone wildcard after a dot
        WeightRenaming(r"experts\.1", "experts.x1"),  # cuts numbers 1, 10-19
        WeightRenaming(r"3\.w", "3.v"),  # matched text that occurs earlier for some layers
        WeightRenaming(r"w1\.weight_scale_inv", "w9.weight_scale_inv"),  # digits in plain text
        WeightRenaming(r"layers\.(\d+)\.self", r"layers.\1.self"),  # a capture (per-key rename)
    ],
    ids=["digit", "one-digit", "wildcard", "cut", "earlier", "plain-digits", "capture"],
)
def test_rules_that_see_numbers_group_alike(extra):
    keys = _experts(12, 12)
    targets = _expert_targets(12) | {"model.layers.one.input_layernorm.weight", "model.layers.x.input_layernorm.weight"}
    templated, per_key, _ = _both(keys, targets, _mixtral_rules(extra), "model")
    assert templated == per_key


def test_first_occurrence_trap():
    # transformers replaces the first occurrence of the matched text, which for "b.5.c.b.5.c" (the match is
    # the second "b.5.c", anchored at the end) is the first one, and for "b.5.c.b.7.c" the match itself: the
    # template "b.#.c.b.#.c" must be split into its keys.
    keys = natural_sorted([f"b.{i}.c.b.{j}.c" for i in range(4) for j in range(4)])
    rule = WeightConverter(r"b\.\d+\.c$", "d", [MergeModulelist(0)])
    per_key = build_groups(keys, set(), [rule], templates=False)[1]
    assert per_key == keys
    renamed = {rule.rename_source_key(k)[0] for k in keys}
    assert "d.b.1.c" in renamed and "b.0.c.d" in renamed  # from b.1.c.b.1.c and b.0.c.b.1.c
    templated, per_key, direct = _both(keys, renamed, [rule])
    assert templated == per_key and direct
    assert sorted(g[0] for g in templated[0]) == sorted(renamed)
    sources = dict((g[0], g[2]) for g in templated[0])["b.0.c.d"]
    assert [k for _, k in sources] == ["b.0.c.b.1.c", "b.0.c.b.2.c", "b.0.c.b.3.c"]


def test_random_layouts_group_alike():
    rng = random.Random(7)
    parts = ["layers", "experts", "w1", "w2", "mlp", "attn", "x0", "0", "1", "10", "2", "01"]
    decided = 0
    for _ in range(60):
        keys = set()
        for _ in range(rng.randint(5, 80)):
            n = rng.randint(1, 5)
            keys.add(".".join(rng.choice(parts) if rng.random() < 0.6 else str(rng.randint(0, 20)) for _ in range(n)))
        keys = natural_sorted(keys)
        sources = [re.escape(rng.choice(parts)) + rng.choice([r"\.\d+", r"\..*", "", r"\.1"]) for _ in range(2)]
        mapping = [
            WeightRenaming(sources[0], rng.choice(["z", "q.0", "mlp"])),
            WeightConverter(sources[1], "stacked", [MergeModulelist(0)]),
        ]
        targets = set(rng.sample(keys, k=len(keys) // 2)) | {"stacked", "layers.stacked"}
        templated, per_key, direct = _both(keys, targets, mapping)
        assert templated == per_key, (keys, sources)
        decided += direct
    assert decided >= 5  # the rest: a key whose own name is a target, or an error, left to the per-key path


def test_plan_uses_templates_and_matches(tmp_path):
    """The whole plan (every item) is the same through both paths."""
    import hp_fastload
    from hp_fastload.convert import groups

    fresh, _ = _checkpoint_keys(tmp_path, "qwen3_moe")
    plan = hp_fastload.plan(fresh, tmp_path / "qwen3_moe")
    original = groups.build_groups

    def per_key(*args, **kwargs):
        return original(*args, **kwargs, templates=False)

    from hp_fastload.planning import orchestrate

    orchestrate.build_groups = per_key
    try:
        reference = hp_fastload.plan(fresh, tmp_path / "qwen3_moe")
    finally:
        orchestrate.build_groups = original
    assert plan == reference


def test_a_rule_that_sees_number_lengths_splits_the_template():
    # "layers\..\.attn" matches layers 0-9 but not 10-12: one template, two outcomes.
    keys = natural_sorted([f"layers.{i}.attn.w" for i in range(13)])
    rule = WeightConverter(r"layers\..\.attn\.w", "layers.small", [MergeModulelist(0)])
    templated, per_key, direct = _both(keys, {"layers.small"}, [rule])
    assert templated == per_key and direct
    assert [k for _, k in templated[0][0][2]] == keys[:10] and templated[1] == keys[10:]


@pytest.mark.parametrize("layers, decided", [(2, True), (13, False)])
def test_a_rule_without_a_prefilter_splits_or_hands_over(layers, decided):
    # A capture rule with no literal prefilter is applied key by key: the template path splits every template,
    # up to a quarter of the keys as templates (SPLIT_FLOOR at least); past that, the per-key path decides.
    keys = _experts(layers, 37)
    rule = WeightRenaming(r"s(\d+)", r"t\1")  # no literal of two characters: every key is a candidate
    templated, per_key, direct = _both(keys, _expert_targets(layers), _mixtral_rules(rule), "model")
    assert templated == per_key
    assert direct is decided


def test_names_and_targets_that_carry_the_prefix_twice_group_alike():
    # The prefix normalization of a renamed name is the per-key path's own (``prefix_normalize``), also for
    # names and targets that carry the base-model prefix twice.
    keys = natural_sorted(
        [f"model.model.layers.{i}.w" for i in range(3)]
        + [f"model.layers.{i}.v" for i in range(3)]
        + [f"layers.{i}.u" for i in range(3)]
        + ["model.model.model.x", "head.w"]
    )
    targets = {f"model.layers.{i}.w" for i in range(3)} | {f"model.model.layers.{i}.v" for i in range(2)}
    targets |= {f"model.layers.{i}.u" for i in range(3)} | {"model.model.x", "model.head.w"}
    templated, per_key, direct = _both(keys, targets, [], "model")
    assert templated == per_key and direct
    assert {g[0] for g in templated[0]} == targets
