"""``convert.structure.trace_by_structure`` and the op memo (``convert.symbolic.memo``): a whole-state-dict
conversion traced with the block arithmetic once per layer structure gives exactly what tracing without the memo
gives, for every layer, also when the conversion treats a layer differently or mixes layers; the memo is hit for
the repeated layers and its results read the right layer's tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from hp_fastload.convert.structure import Mapped, layer_of, trace_by_structure
from hp_fastload.convert.symbolic import RegionTensor
from hp_fastload.convert.symbolic.memo import OpMemo, memoized

LAYERS = 5


def _inputs(layers: int = LAYERS) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {"model.embed.weight": ((16, 8), torch.float32)}
    for i in range(layers):
        out[f"model.layers.{i}.q.weight"] = ((8, 8), torch.float32)
        out[f"model.layers.{i}.k.weight"] = ((4, 8), torch.float32)
        out[f"model.layers.{i}.norm.weight"] = ((8,), torch.bfloat16)
    return out


def _rope(w: torch.Tensor, heads: int) -> torch.Tensor:  # torchtitan's reverse permute
    rows, cols = w.shape
    return w.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _conversion(odd: Callable[[int], bool] = lambda n: False, mix: bool = False) -> Any:
    """A torchtitan-like from_hf: renames, RoPE permutes, q and k fused per layer. ``odd(n)`` layers permute
    with another head count (a conversion that depends on the layer number); ``mix`` fuses each layer's q with
    the next layer's k."""

    def convert(state: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in state.items():
            found = layer_of(key)
            if found is None:
                out[key.removeprefix("model.")] = value
                continue
            (_, n), template = found
            if template.endswith(".norm.weight"):
                out[f"layers.{n}.attention_norm.weight"] = value.to(torch.float32)
            elif template.endswith(".q.weight"):
                k = state[f"model.layers.{(int(n) + 1) % LAYERS if mix else n}.k.weight"]
                q = _rope(value, 4 if odd(int(n)) else 2)
                out[f"layers.{n}.wqk.weight"] = torch.cat([q, _rope(k, 1)], dim=0)[:, 1:].t()
        return out

    return convert


def _real() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=g).to(d) for k, (s, d) in _inputs().items()}


def _materialized(value: Mapped, real: dict[str, torch.Tensor]) -> torch.Tensor:
    return RegionTensor.from_blocks(value.shape, value.dtype, value.blocks).materialize(real)


@pytest.mark.parametrize(
    "conversion",
    [_conversion(), _conversion(odd=lambda n: n == 2), _conversion(odd=lambda n: n == 0), _conversion(mix=True)],
    ids=["uniform", "middle-layer-differs", "first-layer-differs", "layers-mixed"],
)
def test_shared_trace_is_every_layers_own(conversion: Any) -> None:
    """With and without the memo: the same blocks for every output, and materialized they equal the conversion
    run on real tensors (so a layer converted differently is not given another layer's trace)."""
    inputs = _inputs()
    shared = trace_by_structure(conversion, inputs)
    alone = trace_by_structure(conversion, inputs, memo=False)
    assert shared.keys() == alone.keys() and len(alone) == 1 + 2 * LAYERS
    real = _real()
    expected = conversion(dict(real))
    for name, value in alone.items():
        assert isinstance(value, Mapped)
        assert shared[name] == value, name
        assert torch.equal(_materialized(shared[name], real), expected[name]), name


def test_the_memo_is_hit_for_repeated_layers() -> None:
    inputs = _inputs()
    layers = {}
    for key in inputs:
        found = layer_of(key)
        layers[key] = (key, None) if found is None else (found[1], found[0])
    leaves = {k: RegionTensor.leaf(k, *sd) for k, sd in inputs.items()}
    with memoized(layers) as memo:
        _conversion()(leaves)
    assert isinstance(memo, OpMemo)
    ops_per_layer = memo.misses  # only the first layer's ops (and the embed rename: none) computed
    assert memo.hits == (LAYERS - 1) * ops_per_layer and ops_per_layer > 0


def test_memo_does_not_key_on_real_tensors_or_mixed_layers() -> None:
    memo = OpMemo({"a.0.w": ("a.#.w", ("a.", "0")), "a.1.w": ("a.#.w", ("a.", "1"))})
    r0, r1 = (RegionTensor.leaf(f"a.{i}.w", (2, 2), torch.float32) for i in (0, 1))
    assert memo.key(torch.cat, ([r0, torch.zeros(2, 2)],), {}) is None
    assert memo.key(torch.cat, ([r0, r1],), {}) is None
    k0, k1 = memo.key(torch.Tensor.t, (r0,), {}), memo.key(torch.Tensor.t, (r1,), {})
    assert k0 is not None and k1 is not None and k0[0] == k1[0] and k0[1] != k1[1]
    # 1, 1.0 and True are different arguments
    assert memo.key(torch.Tensor.mul, (r0, 1), {})[0] != memo.key(torch.Tensor.mul, (r0, 1.0), {})[0]  # type: ignore[index]


def test_layer_of() -> None:
    assert layer_of("model.layers.12.mlp.experts.3.w1") == (("model.layers.", "12"), "model.layers.#.mlp.experts.3.w1")
    assert layer_of("7.weight") == (("", "7"), "#.weight")
    assert layer_of("model.norm.weight") is None
    assert layer_of("model.w1.weight") is None  # digits inside a part are not a layer number
