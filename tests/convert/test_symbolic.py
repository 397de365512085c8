"""RegionTensor: every traced op must describe exactly what torch computes (shape, dtype, exact bits)."""

from __future__ import annotations

import copy
import pickle
import random
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch
from transformers.core_model_loading import (
    Chunk,
    Concatenate,
    Interleave,
    MergeModulelist,
    PermuteForRope,
    Split,
    SplitModulelist,
    Transpose,
)

from hp_fastload.convert import symbolic as region_mod
from hp_fastload.convert.symbolic import (
    Block,
    PostOp,
    RegionTensor,
    UnsupportedRegionOp,
    apply_post,
    materialize,
    post_dtype,
)
from tests.helpers.bits import bits

# ------------------------------------------------------------------------------------------------------------
# helpers


def _values(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 3).to(dtype)
    return torch.randint(-50, 50, shape, generator=g).to(dtype)


class Case:
    """Named real tensors plus matching leaves."""

    def __init__(self, **specs: tuple[tuple[int, ...], torch.dtype]) -> None:
        self.real = {name: _values(shape, dtype, seed=i) for i, (name, (shape, dtype)) in enumerate(specs.items())}
        self.leaves = {name: RegionTensor.leaf(name, shape, dtype) for name, (shape, dtype) in specs.items()}


def _strides(t: torch.Tensor) -> list[int]:
    return [s for s, n in zip(t.stride(), t.shape, strict=True) if n > 1]


def assert_same(traced: Any, real: Any, sources: Mapping[str, torch.Tensor]) -> None:
    """Structure, shapes, dtypes, strides and values of a traced result equal the real one."""
    if isinstance(real, torch.Tensor):
        assert isinstance(traced, RegionTensor), type(traced)
        traced.validate()
        assert traced.shape == real.shape
        assert traced.dtype == real.dtype
        # Strides follow torch (they decide whether a later .view() succeeds); size-1 dims' strides are free.
        assert _strides(traced) == _strides(real)
        got = materialize(traced, sources)
        assert got.shape == real.shape and got.dtype == real.dtype
        assert torch.equal(got, real), (got, real)
        # Bit-exact (NaN-free inputs, but compare the bytes anyway).
        assert torch.equal(bits(got), bits(real))
    elif isinstance(real, (list, tuple)):
        assert type(traced) is type(real) and len(traced) == len(real)
        for t, r in zip(traced, real, strict=True):
            assert_same(t, r, sources)
    elif isinstance(real, dict):
        assert list(traced) == list(real)
        for key in real:
            assert_same(traced[key], real[key], sources)
    else:
        raise AssertionError(f"unexpected result {type(real)}")


def check(fn: Callable[..., Any], case: Case) -> Any:
    real = fn(**case.real)
    traced = fn(**case.leaves)
    assert_same(traced, real, case.real)
    return traced


X = {"x": ((2, 3, 4), torch.float32)}

# ------------------------------------------------------------------------------------------------------------
# shape operations

SHAPE_OPS: dict[str, Callable[[torch.Tensor], Any]] = {
    "reshape_3_8": lambda x: x.reshape(3, 8),
    "reshape_flat": lambda x: x.reshape(-1),
    "torch_reshape": lambda x: torch.reshape(x, (4, 6)),
    "view_2322": lambda x: x.view(2, 3, 2, 2),
    "transpose_0_2": lambda x: x.transpose(0, 2),
    "torch_transpose_neg": lambda x: torch.transpose(x, -2, -1),
    "torch_transpose_kw": lambda x: torch.transpose(x, dim0=0, dim1=1),
    "permute": lambda x: x.permute(2, 0, 1),
    "torch_permute": lambda x: torch.permute(x, (1, 2, 0)),
    "swapaxes": lambda x: x.swapaxes(0, 1),
    "swapdims": lambda x: torch.swapdims(x, 1, 2),
    "movedim": lambda x: x.movedim(0, -1),
    "mT": lambda x: x.mT,
    "merge_after_transpose": lambda x: x.transpose(1, 2).reshape(2, 12),
    "flatten_all_after_transpose": lambda x: x.transpose(0, 1).flatten(),
    "torch_flatten_01": lambda x: torch.flatten(x, 0, 1),
    "flatten_12": lambda x: x.flatten(1),
    "unflatten": lambda x: x.unflatten(2, (2, 2)),
    "torch_unflatten": lambda x: torch.unflatten(x, 1, (3, 1)),
    "split_then_merge": lambda x: x.reshape(6, 4).transpose(0, 1).reshape(2, 2, 6).permute(1, 0, 2).reshape(4, 6),
    "split_merge_chain": lambda x: x.view(2, 3, 2, 2).transpose(1, 3).reshape(4, 6).t().reshape(-1),
    "partial_rows": lambda x: x.reshape(2, 12)[:, 5:].reshape(-1),
    "index": lambda x: x[1],
    "index_neg": lambda x: x[-1, 2],
    "slice": lambda x: x[:, 1:3],
    "slice_open": lambda x: x[1:, :, :-1],
    "stepped_slice": lambda x: x[..., ::2],
    "stepped_slice_offset": lambda x: x[:, 1::2, 1::3],
    "mixed_index": lambda x: x[None, 0, :, 1],
    "ellipsis_none": lambda x: x[..., None],
    "select": lambda x: x.select(1, -1),
    "torch_select": lambda x: torch.select(x, 2, 1),
    "narrow": lambda x: torch.narrow(x, 2, 1, 2),
    "narrow_method": lambda x: x.narrow(0, 1, 1),
    "unsqueeze_squeeze": lambda x: x.unsqueeze(1).unsqueeze(-1).squeeze(1).squeeze(),
    "squeeze_dim_noop": lambda x: x.squeeze(0),
    "torch_split": lambda x: torch.split(x, [1, 2], 1),
    "split_size": lambda x: x.split(3, dim=2),
    "chunk": lambda x: x.chunk(2, dim=-1),
    "torch_chunk_uneven": lambda x: torch.chunk(x, 2, 1),
    "unbind": lambda x: x.unbind(1),
    "torch_unbind": lambda x: torch.unbind(x),
    "tensor_split": lambda x: x.tensor_split([1, 3], dim=2),
    "transpose_contiguous": lambda x: x.transpose(0, 1).contiguous(),
    "clone_detach_cpu": lambda x: x.t().clone().detach().cpu() if x.ndim == 2 else x.clone().detach().cpu(),
    "to_device": lambda x: x.to("cpu"),
    "expand": lambda x: x[:, :1].expand(2, 5, 4),
    "expand_as": lambda x: x[:1].expand_as(x),
    "iterate": lambda x: list(x),
    "reshape_as_view_as": lambda x: x.reshape(4, 6).view_as(x.reshape(6, 4)).reshape_as(x.reshape(8, 3)),
    "size1_dims": lambda x: x.reshape(1, 2, 1, 12, 1).transpose(0, 4).reshape(2, 3, 1, 4),
    "zero_dim_result": lambda x: x[1, 2, 3],
    "empty_slice": lambda x: x[:, 3:],
    "empty_reshape": lambda x: x[:, 3:].reshape(0, 5),
}


@pytest.mark.parametrize("name", list(SHAPE_OPS))
def test_shape_operations_match_torch(name: str) -> None:
    fn = SHAPE_OPS[name]
    check(lambda x: fn(x), Case(**X))


def test_plain_layout_chains_stay_one_block() -> None:
    x = RegionTensor.leaf("x", (6, 8), torch.float16)
    for y in (
        x.t().contiguous(),
        x.reshape(2, 3, 8),
        x.reshape(3, 2, 2, 4).reshape(6, 8),
        torch.stack([x], dim=1).squeeze(1),
        x.t().t(),
        x[None],
        x.view(6, 2, 4).permute(1, 0, 2),
    ):
        assert len(y.blocks) == 1
    # Block maps are affine in the source's own multi-index: flattening two source dims needs one block per
    # source row (each a contiguous run; the reader coalesces neighbouring runs).
    assert len(x.reshape(48).blocks) == 6
    assert len(x.reshape(2, 3, 8).reshape(6, 8).blocks) == 1


def test_slicing_and_cat_back_coalesces() -> None:
    case = Case(x=((6, 8), torch.float32))
    y = check(lambda x: torch.cat([x[:2], x[2:5], x[5:]], dim=0), case)
    assert len(y.blocks) == 1
    y = check(lambda x: torch.cat(torch.chunk(x, 4, dim=1), dim=1), case)
    assert len(y.blocks) == 1
    y = check(lambda x: torch.cat([x[::2], x[1::2]]), case)
    assert len(y.blocks) == 2
    # Interleaving two stepped halves back: each output row is its own piece, merged back to one block.
    y = check(lambda x: torch.stack([x[::2], x[1::2]], dim=1).reshape(6, 8), case)
    assert len(y.blocks) == 1


# ------------------------------------------------------------------------------------------------------------
# cat / stack (case 2)


def test_concatenation_and_stacking_match_torch() -> None:
    case = Case(q=((4, 3), torch.float32), k=((2, 3), torch.float32), v=((2, 3), torch.float32))
    check(lambda q, k, v: torch.cat([q, k, v]), case)
    check(lambda q, k, v: torch.concat([q.t(), k.t()], dim=1), case)
    check(lambda q, k, v: torch.concatenate((k, v), axis=1), case)
    check(lambda q, k, v: torch.stack([q[:2], q[2:], k]), case)
    check(lambda q, k, v: torch.stack((k, v), dim=-1), case)
    # The experts pattern.
    check(lambda q, k, v: torch.cat([torch.stack([q[:2], q[2:]]), torch.stack([k, k])], dim=1), case)
    # Empty pieces and legacy 1-D empty inputs are skipped like torch does.
    check(lambda q, k, v: torch.cat([q[:0], k, q[4:]], dim=0), case)
    check(lambda q, k, v: torch.cat([q.reshape(-1)[:0], k]), case)


def test_blocks_describe_where_elements_come_from() -> None:
    q = RegionTensor.leaf("q", (4, 3), torch.bfloat16)
    k = RegionTensor.leaf("k", (2, 3), torch.bfloat16)
    out = torch.cat([q.t(), k.t()], dim=1)
    assert out.shape == (3, 6)
    assert [(b.source, b.offsets, b.lengths, b.base, b.coeff, b.post) for b in out.blocks] == [
        ("q", (0, 0), (3, 4), (0, 0), ((0, 1), (1, 0)), ()),
        ("k", (0, 4), (3, 2), (0, 0), ((0, 1), (1, 0)), ()),
    ]
    b = out.blocks[1]
    assert b.source_index((2, 5)) == (1, 2)
    assert b.steps == ((0, 1), (1, 0))
    assert b.source_strides() == (1, 3) and b.source_offset() == 0
    assert b.src_dtype == torch.bfloat16 and b.src_shape == (2, 3) and b.dtype == torch.bfloat16
    with pytest.raises(IndexError):
        b.source_index((0, 0))


# ------------------------------------------------------------------------------------------------------------
# arithmetic and casts (case 3, 4)

ARITH: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "add": lambda t: t + 1.0,
    "radd": lambda t: 1 + t,
    "rsub": lambda t: 1 - t,
    "sub": lambda t: t - 0.3,
    "rmul": lambda t: 2 * t,
    "mul": lambda t: t * 0.7,
    "div": lambda t: t / 3,
    "rdiv": lambda t: 3 / t,
    "neg": lambda t: -t,
    "torch_add": lambda t: torch.add(t, 0.25),
    "torch_mul_kw": lambda t: torch.mul(t, other=3),
    "floordiv": lambda t: t // 2,
    "rfloordiv": lambda t: 7 // t,
    "div_floor": lambda t: t.div(3, rounding_mode="floor"),
    "div_trunc": lambda t: torch.div(t, 3, rounding_mode="trunc"),
    "float": lambda t: t.float(),
    "chain_then_cast": lambda t: (t[1:] + 0.1).to(torch.float32),
    "cast_then_op": lambda t: t.double() * 0.1 + 1,
    "to_kw": lambda t: t.to(dtype=torch.float16),
    "to_same": lambda t: t.to(t.dtype) - 1,
    "int_cast": lambda t: (t * 10).int(),
    "long_then_div": lambda t: (t * 10).long() / 4,
    "positive": lambda t: +t,
    "layout_then_arith": lambda t: (t.t() * 2).reshape(-1)[3:] - 1,
    "half_bf16": lambda t: t.half().bfloat16(),
}


@pytest.mark.parametrize("name", list(ARITH))
def test_arithmetic_and_casts_match_torch(name: str) -> None:
    fn = ARITH[name]
    check(lambda t: fn(t), Case(t=((5, 4), torch.bfloat16)))


def test_integer_arithmetic_matches_torch() -> None:
    case = Case(t=((3, 4), torch.int32))
    check(lambda t: t + 1, case)
    check(lambda t: t * 2.5, case)  # promotes to the default float dtype
    check(lambda t: t // 3, case)
    check(lambda t: t / 2, case)
    check(lambda t: 1 - t, case)


def test_mixed_dtypes_are_converted_as_torch_converts_them() -> None:
    case = Case(a=((2, 3), torch.float16), b=((3, 3), torch.bfloat16))
    out = check(lambda a, b: torch.cat([a, b]) + 0.1, case)
    assert out.dtype == torch.float32
    for blk in out.blocks:
        assert [p.kind for p in blk.post] == ["cast", "add"]
        assert blk.post[0].value == torch.float32
    out = check(lambda a, b: torch.stack([a[0], b[1]]), case)
    assert [len(b.post) for b in out.blocks] == [1, 1]


def test_post_ops_are_applied_in_the_source_dtype() -> None:
    t = _values((64,), torch.bfloat16)
    post = (PostOp("add", 0.1), PostOp("cast", torch.float32))
    assert torch.equal(apply_post(t, post), (t + 0.1).float())
    assert not torch.equal(apply_post(t, post), t.float() + 0.1)
    assert post_dtype(torch.bfloat16, post) == torch.float32
    assert PostOp("add", 1) != PostOp("add", 1.0)
    assert PostOp("add", 1.0) == PostOp("add", 1.0)
    with pytest.raises(ValueError):
        PostOp("pow", 2)
    with pytest.raises(ValueError):
        PostOp("cast", 2)


# ------------------------------------------------------------------------------------------------------------
# transformers' real ConversionOps (case 6)


class _Config:
    num_attention_heads = 4

    def get_text_config(self) -> _Config:
        return self


class _FakeModel:
    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        self.shapes = shapes

    def get_parameter(self, name: str) -> torch.Tensor:
        return torch.empty(self.shapes[name], device="meta")


def _run_ops(ops: list[Any], inputs: dict[str, Any], sources: list[str], targets: list[str], **kw: Any) -> Any:
    data: Any = dict(inputs)
    for op in ops:
        data = op.convert(data, source_patterns=sources, target_patterns=targets, **kw)
    return data


def _check_ops(
    ops_factory: Callable[[], list[Any]],
    specs: dict[str, list[tuple[str, tuple[int, ...], torch.dtype]]],
    sources: list[str],
    targets: list[str],
    **kw: Any,
) -> Any:
    real = {}
    real_inputs: dict[str, Any] = {}
    leaf_inputs: dict[str, Any] = {}
    for i, (pattern, items) in enumerate(specs.items()):
        real_inputs[pattern] = []
        leaf_inputs[pattern] = []
        for j, (key, shape, dtype) in enumerate(items):
            real[key] = _values(shape, dtype, seed=10 * i + j)
            real_inputs[pattern].append(real[key])
            leaf_inputs[pattern].append(RegionTensor.leaf(key, shape, dtype))
    want = _run_ops(ops_factory(), real_inputs, sources, targets, **kw)
    got = _run_ops(ops_factory(), leaf_inputs, sources, targets, **kw)
    assert_same(got, want, real)
    return got


def _experts(name: str, n: int, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [(f"experts.{e}.{name}", shape, torch.bfloat16) for e in range(n)]


def test_transformers_merge_and_concatenate() -> None:
    specs = {"gate_proj": _experts("gate_proj", 3, (4, 5)), "up_proj": _experts("up_proj", 3, (4, 5))}
    got = _check_ops(
        lambda: [MergeModulelist(dim=0), Concatenate(dim=1)],
        specs,
        ["gate_proj", "up_proj"],
        ["gate_up_proj"],
    )
    out = got["gate_up_proj"]
    assert out.shape == (3, 8, 5) and len(out.blocks) == 6
    got = _check_ops(
        lambda: [MergeModulelist(dim=0), Concatenate(dim=1), Transpose(1, 2)],
        specs,
        ["gate_proj", "up_proj"],
        ["gate_up_proj"],
    )
    assert len(got["gate_up_proj"].blocks) == 6
    got = _check_ops(lambda: [MergeModulelist(dim=0)], {"down_proj": _experts("down", 3, (5, 2))}, ["down_proj"], ["d"])
    assert len(got["d"].blocks) == 3


def test_transformers_split_experts() -> None:
    specs = {"gate_up_proj": [("gate_up", (3, 8, 5), torch.bfloat16)]}
    got = _check_ops(
        lambda: [Chunk(dim=1), SplitModulelist(dim=0)],
        specs,
        ["gate_up_proj"],
        ["experts.*.gate_proj", "experts.*.up_proj"],
    )
    assert len(got) == 6 and all(len(v.blocks) == 1 for v in got.values())
    _check_ops(lambda: [SplitModulelist(dim=0)], {"w": [("w", (3, 2, 5), torch.float32)]}, ["w"], ["e.*.w"])


def test_transformers_permute_for_rope() -> None:
    specs = {"q_proj": [("q", (16, 6), torch.bfloat16)]}
    got = _check_ops(lambda: [PermuteForRope()], specs, ["q_proj"], ["q_proj"], config=_Config())
    assert len(got["q_proj"].blocks) == 8
    got = _check_ops(lambda: [PermuteForRope(inverse=True)], specs, ["q_proj"], ["q_proj"], config=_Config())
    _check_ops(
        lambda: [PermuteForRope()],
        {"q_proj": [("qb", (16,), torch.float32)]},
        ["q_proj"],
        ["q_proj"],
        config=_Config(),
    )
    # Chunk hands PermuteForRope bare tensors (not lists): the isinstance(torch.Tensor) branch must be taken.
    _check_ops(
        lambda: [Chunk(dim=0), PermuteForRope(permute_layer_names=["q_proj", "k_proj"])],
        {"wqkv": [("wqkv", (48, 6), torch.bfloat16)]},
        ["wqkv"],
        ["q_proj", "k_proj", "v_proj"],
        config=_Config(),
    )


def test_transformers_transpose_interleave_split() -> None:
    specs = {"w": [("w", (6, 4), torch.float16)]}
    model = _FakeModel({"layer.w": (4, 6), "layer.same": (6, 4), "layer.q_part": (2, 4), "layer.kv_part": (4, 4)})
    got = _check_ops(
        lambda: [Transpose(0, 1, check_dims=True)],
        specs,
        ["w"],
        ["w"],
        model=model,
        full_layer_name="layer.w",
    )
    assert got["w"].shape == (4, 6)
    got = _check_ops(
        lambda: [Transpose(0, 1, check_dims=True)],
        specs,
        ["w"],
        ["w"],
        model=model,
        full_layer_name="layer.same",
    )
    assert got["w"].shape == (6, 4)
    e = {"e": [("e", (2, 6, 4), torch.float32)]}
    _check_ops(
        lambda: [Transpose(1, 2, check_dims=True)],
        e,
        ["e"],
        ["e"],
        model=_FakeModel({"l.e": (2, 4, 6)}),
        full_layer_name="l.e",
    )
    _check_ops(lambda: [Interleave(dim=0)], specs, ["w"], ["w"])
    _check_ops(lambda: [Interleave(dim=1, inverse=True)], specs, ["w"], ["w"])
    _check_ops(lambda: [Interleave(dim=0), Chunk(dim=0)], specs, ["w"], ["a", "b"])
    _check_ops(
        lambda: [Split(dim=0)],
        specs,
        ["w"],
        ["q_part", "kv_part"],
        model=model,
        full_layer_name="layer.q_part",
    )


def test_transformers_ernie_and_conv3d_ops() -> None:
    from transformers.core_model_loading import (
        Conv3dToLinear,
        ErnieFuseAndSplitTextVisionExperts,
        ErnieSplitAndDecoupleTextVisionExperts,
        LinearToConv3d,
    )

    specs = {"gate": _experts("gate", 4, (3, 5)), "up": _experts("up", 4, (3, 5))}
    got = _check_ops(
        lambda: [ErnieFuseAndSplitTextVisionExperts(stack_dim=0, concat_dim=1)],
        specs,
        ["gate", "up"],
        ["text", "vision"],
        config=_Config(),
    )
    assert {k: len(v.blocks) for k, v in got.items()} == {"text": 4, "vision": 4}
    fused = {
        "gu_text": [("gu_text", (2, 6, 5), torch.bfloat16)],
        "gu_vision": [("gu_vis", (2, 6, 5), torch.bfloat16)],
    }
    _check_ops(
        lambda: [ErnieSplitAndDecoupleTextVisionExperts(stack_dim=0, concat_dim=1)],
        fused,
        ["gu_text", "gu_vision"],
        ["e.*.gate", "e.*.up"],
        config=_Config(),
    )
    conv = {"patch": [("patch", (4, 3, 2, 2, 2), torch.float32)]}
    got = _check_ops(lambda: [Conv3dToLinear(3, (2, 2, 2))], conv, ["patch"], ["proj"])
    assert got["proj"].shape == (4, 24)
    _check_ops(lambda: [LinearToConv3d(3, (2, 2, 2))], {"proj": [("proj", (4, 24), torch.float32)]}, ["proj"], ["c"])


def test_conversion_trace_is_coarse() -> None:
    """Stacking 256 experts gives one block per source, and splitting back touches only the blocks each
    chunk can reach (speed is measured by benches/compare.py, "planning")."""
    n, rows, cols = 256, 16, 8
    inputs = {
        "gate_proj": [RegionTensor.leaf(f"e.{i}.gate", (rows, cols), torch.bfloat16) for i in range(n)],
        "up_proj": [RegionTensor.leaf(f"e.{i}.up", (rows, cols), torch.bfloat16) for i in range(n)],
    }
    out = _run_ops([MergeModulelist(dim=0), Concatenate(dim=1)], inputs, ["gate_proj", "up_proj"], ["gu"])["gu"]
    assert out.shape == (n, 2 * rows, cols) and len(out.blocks) == 2 * n
    parts = _run_ops([Chunk(dim=1), SplitModulelist(dim=0)], {"gu": [out]}, ["gu"], ["e.*.g", "e.*.u"])
    assert len(parts) == 2 * n and all(len(p.blocks) == 1 for p in parts.values())
    assert parts["e.7.u"].blocks[0].source == "e.7.up"


# ------------------------------------------------------------------------------------------------------------
# refusals (case 8, 9)


def _augmented_multiply(r: RegionTensor, s: RegionTensor) -> Any:
    r *= 2  # must not silently become r = r * 2
    return r


def _refusals() -> dict[str, Callable[[RegionTensor, RegionTensor], Any]]:
    return {
        "region_mul_region": lambda r, s: r * s,
        "region_add_region": lambda r, s: r + s,
        "region_floordiv_region": lambda r, s: r // s,
        "region_rsub_tensor": lambda r, s: torch.ones(3, 4) - r,
        "tensor_index": lambda r, s: r[torch.tensor([0, 1])],
        "bool_index": lambda r, s: r[True],
        "list_index": lambda r, s: r[[0, 1]],
        "negative_step": lambda r, s: r[::-1],
        "add_": lambda r, s: r.add_(1),
        "iadd": lambda r, s: r.__iadd__(1),
        "imul_statement": _augmented_multiply,
        "setitem": lambda r, s: r.__setitem__(0, 1.0),
        "eq": lambda r, s: r == 1,
        "lt": lambda r, s: r < s,
        "bool": lambda r, s: bool(r),
        "item": lambda r, s: r.item(),
        "tolist": lambda r, s: r.tolist(),
        "numpy": lambda r, s: r.numpy(),
        "matmul": lambda r, s: r @ s.t(),
        "torch_matmul": lambda r, s: torch.matmul(r, s.t()),
        "view_dtype": lambda r, s: r.view(torch.int32),
        "cat_real": lambda r, s: torch.cat([r, torch.zeros(3, 4)]),
        "stack_real": lambda r, s: torch.stack([torch.zeros(3, 4), r]),
        "to_other": lambda r, s: r.to(torch.zeros(1, dtype=torch.float16)),
        "pow": lambda r, s: r**2,
        "rpow": lambda r, s: 2**r,
        "out": lambda r, s: torch.add(r, 1, out=torch.empty(3, 4)),
        "alpha": lambda r, s: torch.add(r, 1, alpha=2),
        "exp": lambda r, s: r.exp(),
        "sum": lambda r, s: r.sum(),
        "flip": lambda r, s: r.flip(0),
        "diagonal": lambda r, s: r.diagonal(),
        "data": lambda r, s: r.data,
        "add_tensor_scalar": lambda r, s: r + torch.tensor(1.0),
        "complex_scalar": lambda r, s: r * 1j,
    }


@pytest.mark.parametrize("name", list(_refusals()))
def test_operations_a_region_cannot_describe_raise(name: str) -> None:
    r = RegionTensor.leaf("r", (3, 4), torch.float32)
    s = RegionTensor.leaf("s", (3, 4), torch.float32)
    with pytest.raises(UnsupportedRegionOp):
        _refusals()[name](r, s)


def test_invalid_arguments_raise_like_torch() -> None:
    r = RegionTensor.leaf("r", (3, 4), torch.float32)
    with pytest.raises(RuntimeError):
        r.reshape(5, 3)
    with pytest.raises(RuntimeError):
        r.t().view(-1)  # not viewable, exactly like torch
    with pytest.raises(IndexError):
        r.transpose(0, 2)
    with pytest.raises(RuntimeError):
        torch.cat([r, RegionTensor.leaf("s", (3, 5), torch.float32)])


def test_region_cut_into_too_many_blocks_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    q = RegionTensor.leaf("q", (16, 6), torch.bfloat16)
    assert len(q.view(4, 2, 2, 6).transpose(1, 2).reshape(16, 6).blocks) == 8
    monkeypatch.setattr(region_mod.tensor, "MAX_BLOCKS", 4)
    with pytest.raises(UnsupportedRegionOp):
        q.view(4, 2, 2, 6).transpose(1, 2).reshape(16, 6)
    with pytest.raises(UnsupportedRegionOp):
        torch.stack([RegionTensor.leaf(f"e{i}", (2,), torch.float32) for i in range(5)])


# ------------------------------------------------------------------------------------------------------------
# the object itself


def test_leaf_and_queries() -> None:
    r = RegionTensor.leaf("w", (3, 4), torch.bfloat16)
    assert isinstance(r, torch.Tensor) and isinstance(r, RegionTensor)
    assert r.shape == torch.Size([3, 4]) and r.size(1) == 4 and r.dim() == 2 and r.ndim == 2
    assert r.numel() == 12 and len(r) == 3 and r.dtype == torch.bfloat16 and r.device.type == "meta"
    assert r.is_floating_point() and r.is_contiguous() and not r.t().is_contiguous()
    assert r.element_size() == 2
    (b,) = r.blocks
    assert b.offsets == (0, 0) and b.lengths == (3, 4) and b.base == (0, 0) and b.coeff == ((1, 0), (0, 1))
    assert "RegionTensor" in repr(r) and "RegionTensor" in f"{r}"
    assert RegionTensor.leaf("e", (0, 4), torch.float32).blocks == ()
    s = RegionTensor.leaf("s", (), torch.float32)
    assert s.blocks[0].lengths == () and s.shape == ()
    check(lambda s: s * 2, Case(s=((), torch.float32)))
    check(lambda s: s[None].expand(3), Case(s=((), torch.float32)))


def test_copy_and_pickle() -> None:
    q0, k0 = RegionTensor.leaf("l0.q", (4, 3), torch.float32), RegionTensor.leaf("l0.k", (2, 3), torch.float32)
    out = torch.cat([q0, k0]).t() + 1
    for clone in (copy.deepcopy(out), pickle.loads(pickle.dumps(out))):
        assert isinstance(clone, RegionTensor) and clone.blocks == out.blocks and clone.shape == out.shape


def test_blocks_are_checked() -> None:
    with pytest.raises(ValueError, match="outside"):
        Block(
            offsets=(0,),
            lengths=(4,),
            source="w",
            base=(1,),
            coeff=((1,),),
            post=(),
            src_dtype=torch.float32,
            src_shape=(4,),
        )
    with pytest.raises(ValueError, match="negative"):
        Block((0,), (2,), "w", (3,), ((-1,),), (), torch.float32, (4,))
    with pytest.raises(ValueError, match="rank"):
        Block((0, 0), (2,), "w", (0,), ((1,),), (), torch.float32, (4,))
    good = Block((0,), (2,), "w", (0,), ((2,),), (), torch.float32, (4,))
    with pytest.raises(ValueError, match="cover"):
        RegionTensor.from_blocks((3,), torch.float32, [good])
    r = RegionTensor.from_blocks((2,), torch.float32, [good])
    w = torch.arange(4.0)
    assert torch.equal(materialize(r, {"w": w}), w[::2])
    with pytest.raises(ValueError, match="expects"):
        materialize(r, {"w": torch.arange(5.0)})


def test_materialize_reads_strided_sources() -> None:
    big = _values((8, 6), torch.float32)
    src = big.t()[1:5]  # non-contiguous with a storage offset
    r = RegionTensor.leaf("w", tuple(src.shape), src.dtype)
    out = r.reshape(-1)[3:17].reshape(2, 7) * 2
    assert torch.equal(materialize(out, {"w": src}), src.reshape(-1)[3:17].reshape(2, 7) * 2)


# ----------------------------------------------------------------------------------------------------------
# randomized chains of supported ops

_START_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32]


def _factorization(rng: random.Random, n: int) -> list[int]:
    dims: list[int] = []
    while n > 1 and len(dims) < 4:
        d = rng.choice([d for d in range(2, n + 1) if n % d == 0])
        dims.append(d)
        n //= d
    if n > 1:
        dims.append(n)
    if rng.random() < 0.3:
        dims.insert(rng.randrange(len(dims) + 1), 1)
    return dims


_KINDS = [
    *("reshape", "reshape", "view_split", "transpose", "permute", "movedim", "slice", "index", "select"),
    *("narrow", "unsqueeze", "squeeze", "chunk", "split", "unbind", "flatten", "unflatten", "expand"),
    *("cast", "arith", "cat", "cat_other", "stack"),
]


def _random_op(rng: random.Random, t: torch.Tensor, other: torch.Tensor) -> Callable[..., Any] | None:
    """A random supported op as ``fn(t, other)``; every random choice is made here, not in ``fn``."""
    shape = tuple(t.shape)
    nd = len(shape)
    kind = rng.choice(_KINDS)
    if kind == "reshape":
        dims = _factorization(rng, t.numel())
        if dims and rng.random() < 0.3:
            dims[rng.randrange(len(dims))] = -1
        return lambda t, o: t.reshape(dims)
    if nd == 0:
        return lambda t, o: t.unsqueeze(0)
    d = rng.randrange(nd)
    e = rng.randrange(nd)
    if kind == "view_split" and shape[d] > 1:
        parts = _factorization(rng, shape[d])
        new_shape = (*shape[:d], *parts, *shape[d + 1 :])
        if rng.random() < 0.5:  # view on a possibly non-viewable layout: must fail exactly when torch fails
            dims = _factorization(rng, t.numel())
            return lambda t, o: t.view(dims)
        return lambda t, o: t.contiguous().view(new_shape)
    if kind == "transpose":
        return lambda t, o: t.transpose(d, e)
    if kind == "permute":
        perm = list(range(nd))
        rng.shuffle(perm)
        return lambda t, o: t.permute(perm)
    if kind == "movedim":
        return lambda t, o: torch.movedim(t, d, e)
    if kind == "slice" and shape[d] > 1:
        a = rng.randrange(-shape[d], shape[d])
        b = rng.choice([None, rng.randrange(shape[d] + 1)])
        idx = (slice(None),) * d + (slice(a, b, rng.choice([1, 1, 2, 3])),)
        return lambda t, o: t[idx]
    if kind == "index":
        items: list[Any] = []
        for size in shape:
            items.append(rng.choice([slice(None), rng.randrange(-size, size), None, slice(rng.randrange(size), None)]))
        if rng.random() < 0.5:
            items[rng.randrange(len(items))] = Ellipsis
        index = tuple(items)
        return lambda t, o: t[index]
    if kind == "select":
        i = rng.randrange(-shape[d], shape[d])
        return lambda t, o: t.select(d, i)
    if kind == "narrow":
        a = rng.randrange(shape[d] + 1)
        n = rng.randrange(shape[d] - a + 1)
        return lambda t, o: torch.narrow(t, d, a, n)
    if kind == "unsqueeze":
        u = rng.randrange(-nd - 1, nd + 1)
        return lambda t, o: t.unsqueeze(u)
    if kind == "squeeze":
        return (lambda t, o: t.squeeze()) if rng.random() < 0.5 else (lambda t, o: t.squeeze(d))
    if kind == "chunk" and shape[d] > 1:
        n = rng.randrange(1, shape[d] + 1)
        pick = rng.randrange(n)
        return lambda t, o: (lambda parts: parts[min(pick, len(parts) - 1)])(t.chunk(n, d))
    if kind == "split" and shape[d] > 1:
        cut = rng.randrange(1, shape[d])
        pick = rng.randrange(2)
        return lambda t, o: torch.split(t, [cut, shape[d] - cut], d)[pick]
    if kind == "unbind":
        pick = rng.randrange(shape[d])
        return lambda t, o: t.unbind(d)[pick]
    if kind == "flatten":
        return lambda t, o: t.flatten(min(d, e), max(d, e))
    if kind == "unflatten" and shape[d] > 1:
        parts = _factorization(rng, shape[d])
        return lambda t, o: t.unflatten(d, parts)
    if kind == "expand" and 1 in shape:
        target = [rng.choice([2, 3]) if s == 1 else s for s in shape]
        return lambda t, o: t.expand(*target)
    if kind == "cast":
        dt = rng.choice([torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64])
        return lambda t, o: t.to(dt)
    if kind == "arith":
        c = rng.choice([0.5, 2, -1.25, 3, 1])
        f = rng.choice(
            [
                lambda t: t * c,
                lambda t: t + c,
                lambda t: c - t,
                lambda t: t / c,
                lambda t: -t,
                lambda t: t // c,
                lambda t: t.div(c, rounding_mode="trunc"),
            ]
        )
        return lambda t, o: f(t)
    if kind == "cat":
        return lambda t, o: torch.cat([t, t.narrow(d, 0, 1)], d)
    if kind == "cat_other" and other.ndim == nd:
        perm = sorted(range(nd), key=lambda i: other.shape[i])
        if sorted(other.shape) == sorted(shape):
            return lambda t, o: torch.cat([t, o.permute(perm).reshape(shape)], d)
    if kind == "stack":
        s = rng.randrange(nd + 1)
        return lambda t, o: torch.stack([t, t[(slice(None),) * nd]], s)
    return None


def test_random_chains_match_torch() -> None:
    rng = random.Random(1234)
    for _ in range(300):
        nd = rng.randrange(0, 4)
        shape = tuple(rng.choice([1, 2, 3, 4, 6]) for _ in range(nd))
        dtype = rng.choice(_START_DTYPES)
        sources = {"x": _values(shape, dtype, seed=rng.randrange(1000)), "y": _values(shape, dtype, seed=1)}
        real: Any = sources["x"]
        traced: Any = RegionTensor.leaf("x", shape, dtype)
        other_leaf = RegionTensor.leaf("y", shape, dtype)
        for _ in range(rng.randrange(1, 8)):
            if real.numel() > 2048 or 0 in real.shape:
                break
            op = _random_op(rng, real, sources["y"])
            if op is None:
                continue
            try:
                want = op(real, sources["y"])
            except (RuntimeError, IndexError, ValueError):
                # Invalid for this input (e.g. view of a non-viewable tensor): the region must refuse it too.
                with pytest.raises((RuntimeError, IndexError, ValueError)):
                    op(traced, other_leaf)
                continue
            real, traced = want, op(traced, other_leaf)
            assert_same(traced, real, sources)


def test_random_reshapes_of_strided_regions_match_torch() -> None:
    rng = random.Random(99)
    for _ in range(200):
        shape = tuple(rng.choice([2, 3, 4, 5, 6]) for _ in range(rng.randrange(2, 4)))
        x = _values(shape, torch.float32, seed=rng.randrange(1000))
        leaf = RegionTensor.leaf("x", shape, torch.float32)

        def prep(t: Any, perm: list[int], idx: tuple[Any, ...]) -> Any:
            return t.permute(perm)[idx]

        perm = list(range(len(shape)))
        rng.shuffle(perm)
        permuted = [shape[p] for p in perm]
        idx = tuple(slice(rng.randrange(n // 2 + 1), None, rng.choice([1, 1, 2])) for n in permuted)
        real, traced = prep(x, perm, idx), prep(leaf, perm, idx)
        for _ in range(3):
            dims = _factorization(rng, real.numel())
            real, traced = real.reshape(dims), traced.reshape(dims)
            assert_same(traced, real, {"x": x})
            assert len(traced.blocks) <= max(real.numel(), 1)
