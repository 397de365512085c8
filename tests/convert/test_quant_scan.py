"""The bulk helpers of block-fp8 detection and planning (issue 40): the companion scan in Rust against its
Python definition, the claimed values' scales as the index's own strings, and the bulk dtype queries, each
equal to what planning asked before (per-key names and dtypes) on odd names and mixed formats.

Checkpoints are written with safetensors' ``save_file``; the references are spelled from Python's own string
operations and each key's dtype as safetensors reads it back.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import hp_fastload._core as _core
from hp_fastload.convert import detect as detect_module
from hp_fastload.convert.detect import _SCAN_SUFFIXES, detect, detect_in_index
from hp_fastload.convert.quant_info import SCALE_INV, BlockScales
from hp_fastload.errors import QuantizationError
from hp_fastload.source.index import CheckpointIndex

FP8 = torch.float8_e4m3fn
MARKER = ".weight.quant_state."


def _scan_reference(names: list[str], suffixes: tuple[str, ...], marker: str | None):
    """The definition: Python's ``endswith`` / ``in`` over every name, the stem's first occurrence."""
    hits = [n for n in names if n.endswith(suffixes)]
    paired = all(h.endswith(suffixes[0]) for h in hits) and not (marker and any(marker in n for n in names))
    first: dict[str, str] = {}
    for n in names:
        first.setdefault(n, n)
    cut = len(suffixes[0])
    pairs = [(first[h[:-cut]], h) for h in hits if h[:-cut] in first] if paired else []
    return hits, paired, [v for v, _ in pairs], [s for _, s in pairs]


def _odd_names(rng: random.Random) -> list[str]:
    stems = ["a.weight", "b.w", "ü.weight", "层.0.weight", "x", "", "c.weight_scale_inv", "d.weight.absmax"]
    endings = ["", "_scale_inv", "_scale_inv_scale_inv", "_blocks", ".weight_scale", ".SCB", ".qweight", "_scales"]
    names = []
    for _ in range(rng.randrange(0, 40)):
        name = rng.choice(stems) + rng.choice(endings)
        if rng.random() < 0.05:
            name = f"m.{rng.randrange(3)}{MARKER}bitsandbytes__nf4"
        # (a repeated name as a new string object: the stem taken must be the first one's)
        names.append("".join(list(name)))
    if rng.random() < 0.5:
        names.sort()
    return names


@pytest.mark.parametrize("seed", range(300))
def test_companion_scan_equals_its_python_definition(seed):
    """Hits, the bulk test and the pairs equal the definition on odd names (non-ASCII, empty, duplicates in
    any order, names ending with several suffixes, a quant_state name); each value is the first occurrence's
    own object and each scale the hit's own."""
    rng = random.Random(seed)
    names = _odd_names(rng)
    suffixes = _SCAN_SUFFIXES if seed % 3 else (SCALE_INV,)
    marker = MARKER if seed % 4 else None
    got = _core.companion_scan(names, suffixes, marker)
    expected = _scan_reference(names, suffixes, marker)
    assert got == expected
    hits, _, values, scales = got
    by_id = {id(n) for n in names}
    assert all(id(s) in by_id for s in hits + scales)
    assert all(v is next(n for n in names if n == v) for v in values)


def test_companion_scan_refuses_a_name_that_is_not_utf8_and_detect_falls_back():
    """A lone surrogate cannot be UTF-8: the scan raises, and detection takes the Python path with the same
    result as a checkpoint without that name's oddity."""
    names = ["a.weight", "a.weight_scale_inv", "s\udc80.weight"]
    with pytest.raises(UnicodeEncodeError):
        _core.companion_scan(names, _SCAN_SUFFIXES, MARKER)
    dtypes = {"a.weight": FP8, "a.weight_scale_inv": torch.float32, "s\udc80.weight": torch.bfloat16}
    quant = detect(names, dtypes.__getitem__, {"quant_method": "fp8"})
    assert list(quant.tensors) == ["a.weight"] and quant.companions == {"a.weight_scale_inv"}


def _mixed(root: Path, extra: dict[str, torch.Tensor] | None = None) -> Path:
    tensors = {
        "m.0.weight": torch.zeros(4, 4).to(FP8),
        "m.0.weight_scale_inv": torch.ones(1, 1),
        "m.1.weight": torch.zeros(4, 4).to(FP8),
        "m.1.weight_scale_inv": torch.ones(1, 1),
        "m.2.weight": torch.zeros(4, 4, dtype=torch.bfloat16),  # stored as the target's dtype: loads raw
        "m.2.weight_scale_inv": torch.ones(1, 1),
        "ü.weight": torch.zeros(4, 4).to(FP8),
        "ü.weight_scale_inv": torch.ones(1, 1),
        "orphan.weight_scale_inv": torch.ones(1, 1),
        "norm.weight": torch.ones(4, dtype=torch.bfloat16),
        "i.weight": torch.zeros(4, 4, dtype=torch.int8),
        "idx": torch.zeros(3, dtype=torch.int64),
    }
    tensors.update(extra or {})
    save_file(tensors, str(root / "model.safetensors"))
    config = {"model_type": "llama", "quantization_config": {"quant_method": "fp8", "weight_block_size": [4, 4]}}
    (root / "config.json").write_text(json.dumps(config))
    return root


def _dtype_names(root: Path) -> dict[str, str]:
    with safe_open(str(root / "model.safetensors"), "pt") as f:
        return {k: f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118 (safe_open is no mapping)


def test_keys_stored_as_is_the_complement_of_keys_not_stored_as(tmp_path):
    """``keys_stored_as`` lists exactly the keys whose dtype, as safetensors reads it, is one of those named."""
    root = _mixed(tmp_path)
    index = CheckpointIndex.open(root)
    dtypes = _dtype_names(root)
    for names in (["BF16"], ["F32"], ["F8_E4M3", "I8"], ["F64"], []):
        assert sorted(index.keys_stored_as(names)) == sorted(k for k, d in dtypes.items() if d in names)
        assert set(index.keys_stored_as(names)).isdisjoint(index.keys_not_stored_as(names))


@pytest.mark.parametrize("bulk", [True, False])
def test_claim_checks_in_bulk_equal_the_per_key_dtypes(tmp_path, bulk):
    """Each claim check gives the same claims, the same dequantized layouts and the same refusal text with the
    bulk dtype query as when each source's dtype is asked (``stored_as=None``), on the bulk block-fp8 path and
    on the per-key path (another companion format mixed in)."""
    extra = {} if bulk else {"g.qweight": torch.zeros(4, 4, dtype=torch.int32)}
    index = CheckpointIndex.open(_mixed(tmp_path, extra))
    cases = [
        ("t.a", torch.bfloat16, ["m.0.weight", "m.1.weight", "norm.weight", "m.2.weight"]),
        ("t.b", torch.float32, {"ü.weight", "m.0.weight_scale_inv"}),
        ("t.c", torch.bfloat16, ("norm.weight", "not.a.key")),
        ("t.d", torch.bfloat16, ["m.2.weight"]),
        ("t.e", torch.float8_e4m3fn, ["m.1.weight"]),
        ("t.f", torch.int8, ["m.0.weight"]),
        ("t.g", torch.bfloat16, ["i.weight"]),
    ]
    outcomes = []
    for stored in (True, False):
        quant = detect_in_index(index)
        assert quant.tensors.has_bulk is bulk
        if not stored:
            quant.stored_as = None
        seen = []
        for resolve in (False, True):
            for name, dtype, sources in cases:
                try:
                    quant.check_claim(name, dtype, sources, lambda k: index.locate(k).dtype, resolve=resolve)
                    seen.append(None)
                except QuantizationError as exc:
                    seen.append(str(exc))
        outcomes.append((seen, dict(quant.claimed), dict(quant.dequantized)))
    assert outcomes[0] == outcomes[1]
    seen, claimed, _ = outcomes[0]
    assert "m.2.weight" not in claimed and {"m.0.weight", "m.1.weight", "ü.weight"} <= set(claimed)
    assert seen[5] is not None and "m.0.weight is quantized" in seen[5]


def test_scales_of_are_the_names_with_the_suffix_as_the_index_strings(tmp_path):
    """``scales_of`` (the claimed values' companions) is each key + ``_scale_inv`` for any set of keys (all the
    values, a few, some not quantized, a list with repeats); for every value it returns the scale key's own
    object; ``consumed`` equals the sliced definition."""
    index = CheckpointIndex.open(_mixed(tmp_path))
    quant = detect_in_index(index)
    block = quant.tensors._block
    assert isinstance(block, BlockScales)
    values = block.values()
    assert values == ["m.0.weight", "m.1.weight", "m.2.weight", "ü.weight"]
    keys = index.keys()
    for subset in (values, values[:1], [*values, "norm.weight", "zz"], [], set(values[1:]), dict.fromkeys(values)):
        got = list(block.scales_of(subset))
        assert set(got) == {k + SCALE_INV for k in subset}
    for scale in block.scales_of(set(values)):
        assert any(scale is k for k in keys)
    quant.check_claim("t", torch.bfloat16, values, lambda k: index.locate(k).dtype, resolve=False)
    assert quant.consumed() == {k + SCALE_INV for k in quant.claimed}
    assert quant.companions == {k + SCALE_INV for k in values}


def test_detect_python_scan_equals_the_rust_scan(monkeypatch, tmp_path):
    """Detection through the Rust scan and through its Python fallback finds the same tensors, records and
    companions, on the bulk path and with other formats mixed in."""
    for extra in ({}, {"g.qweight": torch.zeros(4, 4, dtype=torch.int32), "n.weight.absmax": torch.ones(2)}):
        root = tmp_path / str(len(extra))
        root.mkdir()
        index = CheckpointIndex.open(_mixed(root, extra))
        rust = detect_in_index(index)

        def refuse(*args, **kwargs):
            raise UnicodeEncodeError("utf-8", "x", 0, 1, "test")

        with monkeypatch.context() as m:
            m.setattr(detect_module._core, "companion_scan", refuse)
            python = detect_in_index(index)
        assert list(rust.tensors) == list(python.tensors)
        assert [rust.tensors.record(k) for k in rust.tensors] == [python.tensors.record(k) for k in python.tensors]
        assert rust.companions == python.companions
