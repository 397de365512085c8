"""Architecture x layout x loader parity against real clients, bit-exact (issue 4, items 1 and 2).

Every checkpoint is written by transformers' own ``save_pretrained`` (bf16, so the per-expert, transposed,
fused and interleaved on-disk layouts are the ones transformers really writes). On gloo ranks, each model
is laid out

- by transformers itself: ``from_pretrained(path, distributed_config=DistributedConfig(...))`` (tp, fsdp,
  fsdp+ep; tp x fsdp on 4 ranks). Its own shards are recorded against the reference, then every local
  shard is zeroed and reloaded by ``hp_fastload.load(model, path)``;
- by torch directly: built on meta from the config, then ``fully_shard`` / ``parallelize_module`` with
  colwise/rowwise plans (stacked experts sharded on their output dim) / the demo's TP-attention + FSDP
  layout / a 2-D (dp, tp) mesh on 4 ranks, then ``to_empty(device="cpu")`` and ``hp_fastload.load``.

Reference: the single-process ``from_pretrained`` state dict, cut with torch's
``distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()``. Every local shard must be
bit-equal, for both loaders. One spawn per world size runs every family (``run_subchecks``); the parent
writes the checkpoints once and passes their folder through ``HPF_PARITY_ROOT``.
"""

from __future__ import annotations

import importlib.util
import os
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers.bits import bits
from tests.helpers.dist import run_distributed, run_subchecks, subcheck_values
from tests.helpers.layouts import COLWISE, torch_demo, torch_fsdp, torch_tp
from tests.helpers.tiny_models import FAMILIES, model_class, tiny_config, tiny_model

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

#: transformers 5.23's from_pretrained(distributed_config=...) goes through check_and_set_device_map, which
#: raises without accelerate ("Using a `device_map`, `tp_plan`, ... requires `accelerate`").
HAS_ACCELERATE = importlib.util.find_spec("accelerate") is not None
NO_ACCELERATE = "transformers' distributed_config loading requires the accelerate package, which is not installed"

ROOT_ENV = "HPF_PARITY_ROOT"
LOADERS = ("dcp", "legacy")

MOE = {"mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss", "qwen3_vl_moe", "granitemoe"}
FAMILIES_2 = sorted(FAMILIES)
FAMILIES_4 = ["llama", "mixtral", "gpt_oss", "qwen3_vl_moe"]

#: transformers layouts: name -> (world, DistributedConfig kwargs, MoE only)
HF_LAYOUTS: dict[str, tuple[int, dict[str, int], bool]] = {
    "hf_tp": (2, dict(tp_size=2), False),
    "hf_fsdp": (2, dict(fsdp_size=2), False),
    "hf_fsdp_ep": (2, dict(fsdp_size=2, ep_size=2), True),
    "hf_tp_fsdp": (4, dict(tp_size=2, fsdp_size=2), False),
    "hf_fsdp4_ep2": (4, dict(fsdp_size=4, ep_size=2), True),
}
#: torch layouts: name -> world
TORCH_LAYOUTS: dict[str, int] = {"torch_fsdp": 2, "torch_tp": 2, "torch_demo": 2, "torch_2d": 4}

#: (family, layout) pairs that cannot be built, with the reason (the docs' table repeats them).
NOT_BUILDABLE: dict[tuple[str, str], str] = {
    (family, layout): "demo.parallelize expects causal-LM layers at model.model.layers"
    for family in ("bert", "qwen3_vl_moe")
    for layout in ("torch_demo", "torch_2d")
}


def _combos(world: int) -> list[tuple[str, str]]:
    families = FAMILIES_2 if world == 2 else FAMILIES_4
    out = []
    for family in families:
        for layout, (w, _, moe_only) in HF_LAYOUTS.items():
            if w == world and (family in MOE or not moe_only) and HAS_ACCELERATE:
                out.append((family, layout))
        for layout, w in TORCH_LAYOUTS.items():
            if w == world and (family, layout) not in NOT_BUILDABLE:
                out.append((family, layout))
    return out


# ---------------------------------------------------------------------------------------------------------
# Rank-side helpers


def _path(family: str) -> str:
    return str(Path(os.environ[ROOT_ENV]) / family)


_REFERENCE: dict[tuple[str, torch.dtype], dict[str, torch.Tensor]] = {}


def _reference(family: str, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The single-process ``from_pretrained`` state dict (no distributed_config), cached per process."""
    key = (family, dtype)
    if key not in _REFERENCE:
        model = model_class(family).from_pretrained(_path(family), dtype=dtype)
        _REFERENCE[key] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return _REFERENCE[key]


def _local_and_expected(param: torch.Tensor, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        expected = distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
        return param.to_local(), expected.to_local()
    return param, full.to(param.dtype)


def _mismatches(model: nn.Module, reference: dict[str, torch.Tensor]) -> list[str]:
    """Names whose local shard differs (bitwise) from ``distribute_tensor`` of the reference tensor.

    Every reference key must exist in the model; a missing one is reported as ``missing:<name>``.
    """
    state = model.state_dict()
    bad = [f"missing:{name}" for name in reference if name not in state]
    for name, full in reference.items():
        if name not in state:
            continue
        local, expected = _local_and_expected(state[name], full)
        if local.shape != expected.shape or not torch.equal(bits(local), bits(expected)):
            bad.append(name)
    return bad


@torch.no_grad()
def _zero(model: nn.Module) -> None:
    from torch.distributed.tensor import DTensor

    for tensor in model.state_dict().values():
        (tensor.to_local() if isinstance(tensor, DTensor) else tensor).zero_()


def _load_and_compare(model: nn.Module, family: str, loader: str) -> list[str]:
    import hp_fastload

    _zero(model)
    report = hp_fastload.load(model, _path(family), loader=loader)
    bad = _mismatches(model, _reference(family))
    return bad + [f"missing-key:{k}" for k in report.missing_keys]


def _set_launcher_env(rank: int, world: int) -> None:
    # what torchrun would export; transformers' distributed_config reads them
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))


#: tp plans for families whose config has no ``base_model_tp_plan`` (keys as transformers' named_modules, "*"
#: for the layer number)
HF_TP_PLANS: dict[str, dict[str, str]] = {
    "bert": {
        "encoder.layer.*.attention.self.query": "colwise",
        "encoder.layer.*.attention.self.key": "colwise",
        "encoder.layer.*.attention.self.value": "colwise",
        "encoder.layer.*.attention.output.dense": "rowwise",
        "encoder.layer.*.intermediate.dense": "colwise",
        "encoder.layer.*.output.dense": "rowwise",
    }
}


def _hf_layout(family: str, kwargs: dict[str, int]) -> tuple[nn.Module, str | None]:
    """transformers' own distributed load; when it refuses, the same layout with the refused tensors re-initialized.

    Returns the model and transformers' error (None when its load went through).
    """
    from transformers.distributed import DistributedConfig

    kwargs = dict(kwargs)
    if kwargs.get("tp_size", 1) > 1 and family in HF_TP_PLANS:
        kwargs["tp_plan"] = HF_TP_PLANS[family]  # type: ignore[assignment]
    cls = model_class(family)
    try:
        model = cls.from_pretrained(_path(family), distributed_config=DistributedConfig(**kwargs), dtype=torch.bfloat16)
        return model, None
    except RuntimeError as exc:
        if "ignore_mismatched_sizes" not in str(exc):
            raise
        error = f"{type(exc).__name__}: {exc}"
    model = cls.from_pretrained(
        _path(family),
        distributed_config=DistributedConfig(**kwargs),
        dtype=torch.bfloat16,
        ignore_mismatched_sizes=True,
    )
    return model, error


def meta_model(family: str, dtype: torch.dtype) -> nn.Module:
    cls = model_class(family)
    config = tiny_config(family)
    with torch.device("meta"):
        if cls.__name__.startswith("Auto"):
            return cls.from_config(config, dtype=dtype)
        return cls._from_config(config, dtype=dtype)


COLWISE += ("kv_b_proj", "query", "key", "value", "intermediate.dense", "lm_head")


_TORCH_BUILDERS = {"torch_fsdp": torch_fsdp, "torch_tp": torch_tp, "torch_demo": torch_demo, "torch_2d": torch_demo}


def _torch_layout(family: str, layout: str, world: int, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    model = meta_model(family, dtype)
    _TORCH_BUILDERS[layout](model, world)
    model.to_empty(device="cpu")
    return model


def _run_world(rank: int, world: int) -> dict[str, Any]:
    """Every (family, layout) of this world size: {"family/layout/loader": mismatches or "ERROR ..."}."""
    import torch.distributed as dist

    _set_launcher_env(rank, world)
    out: dict[str, Any] = {}
    for family, layout in _combos(world):
        started = time.perf_counter()
        try:
            if layout in HF_LAYOUTS:
                model, error = _hf_layout(family, HF_LAYOUTS[layout][1])
                out[f"{family}/{layout}/transformers"] = {"error": error, "bad": _mismatches(model, _reference(family))}
            else:
                model = _torch_layout(family, layout, world)
            for loader in LOADERS:
                out[f"{family}/{layout}/{loader}"] = _load_and_compare(model, family, loader)
        except Exception as exc:
            text = f"ERROR {type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
            out.setdefault(f"{family}/{layout}/transformers", text)
            for loader in LOADERS:
                out.setdefault(f"{family}/{layout}/{loader}", text)
        out[f"{family}/{layout}/seconds"] = time.perf_counter() - started
        dist.barrier()
    return out


def check_world(rank: int, world: int) -> dict[str, Any]:
    return _run_world(rank, world)


# ---------------------------------------------------------------------------------------------------------
# Forward parity (fp32 model, bf16 checkpoint: the cast is exact, so logits differ only by reduction order)


@torch.no_grad()
def _reinit_rotary(model: nn.Module) -> None:
    """Non-persistent RoPE buffers are garbage after ``to_empty``; recompute them as the module's init does."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for module in model.modules():
        if hasattr(module, "inv_freq") and hasattr(module, "rope_type"):
            fn = module.compute_default_rope_parameters if module.rope_type == "default" else None
            fn = fn or ROPE_INIT_FUNCTIONS[module.rope_type]
            inv_freq, scaling = fn(module.config)
            module.inv_freq.copy_(inv_freq)
            module.original_inv_freq.copy_(inv_freq)
            module.attention_scaling = scaling


def _forward_parity(family: str, world: int) -> tuple[float, float]:
    import hp_fastload

    torch.manual_seed(0)
    ids = torch.randint(0, tiny_config(family).vocab_size, (2, 7))
    reference = model_class(family).from_pretrained(_path(family), dtype=torch.float32).eval()
    expected = reference(input_ids=ids).logits
    model = _torch_layout(family, "torch_demo", world, dtype=torch.float32)
    _reinit_rotary(model)
    report = hp_fastload.load(model, _path(family))
    assert not report.missing_keys, report.missing_keys
    got = model.eval()(input_ids=ids).logits
    got = got.full_tensor() if hasattr(got, "full_tensor") else got
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    return float((got - expected).abs().max()), float(expected.abs().max())


def check_forward_llama(rank: int, world: int) -> tuple[float, float]:
    return _forward_parity("llama", world)


def check_forward_mixtral(rank: int, world: int) -> tuple[float, float]:
    return _forward_parity("mixtral", world)


# ---------------------------------------------------------------------------------------------------------
# Parent side


def _write_checkpoints(root: Path, families: list[str]) -> None:
    for family in families:
        tiny_model(family).to(torch.bfloat16).save_pretrained(root / family)


class _Runs:
    """One spawn per world size, on first use; its result (or its failure) is kept for every later test."""

    def __init__(self) -> None:
        self._done: dict[int, list[dict[str, Any]] | AssertionError] = {}

    def __call__(self, world: int) -> list[dict[str, Any]]:
        if world not in self._done:
            checks = [check_world] + ([check_forward_llama, check_forward_mixtral] if world == 2 else [])
            try:
                self._done[world] = run_distributed(run_subchecks, world, checks, timeout=500)
            except AssertionError as exc:
                self._done[world] = exc
        done = self._done[world]
        if isinstance(done, AssertionError):
            raise done
        return done


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> _Runs:
    root = tmp_path_factory.mktemp("parity")
    _write_checkpoints(root, FAMILIES_2)
    os.environ[ROOT_ENV] = str(root)  # spawned ranks inherit the environment
    return _Runs()


def _result(per_rank: list[dict[str, Any]], key: str) -> list[Any]:
    return [values[key] for values in subcheck_values(per_rank, "check_world")]


def _all_combos(world: int) -> list[tuple[str, str]]:
    """Like ``_combos``, with the transformers layouts listed even where accelerate is missing (then skipped)."""
    families = FAMILIES_2 if world == 2 else FAMILIES_4
    return [
        (f, lay)
        for f in families
        for lay, (w, _, moe_only) in HF_LAYOUTS.items()
        if w == world and (f in MOE or not moe_only)
    ] + [(f, lay) for f, lay in _combos(world) if lay not in HF_LAYOUTS]


def _params(cases: list[tuple[Any, ...]]) -> list[Any]:
    """pytest params (world, family, layout, ...); transformers layouts are skipped, with the reason, without
    accelerate."""
    skip = pytest.mark.skipif(not HAS_ACCELERATE, reason=NO_ACCELERATE)
    return [pytest.param(*c, id="-".join(map(str, c)), marks=[skip] if c[2] in HF_LAYOUTS else []) for c in cases]


def _transformers_version() -> tuple[int, int]:
    from importlib.metadata import version

    return tuple(int(p) for p in version("transformers").split(".")[:2])  # type: ignore[return-value]


_CASES = [(w, f, lay, ld) for w in (2, 4) for f, lay in _all_combos(w) for ld in LOADERS]
_HF_CASES = [(w, f, lay) for w in (2, 4) for f, lay in _all_combos(w) if lay in HF_LAYOUTS]


def transformers_wrong(family: str, layout: str) -> bool:
    """Where transformers' own distributed load is wrong (see docs/parity.md): Qwen3-VL-MoE's transposed experts
    under every layout up to transformers 5.24; 5.25 loads them right under plain TP (``hf_tp``) only."""
    return family == "qwen3_vl_moe" and (_transformers_version() < (5, 25) or layout != "hf_tp")


@pytest.mark.parametrize(("world", "family", "layout", "loader"), _params(_CASES))
def test_local_shards_bit_exact(runs, world, family, layout, loader):
    """hp_fastload's local shards == distribute_tensor(single-process from_pretrained), on every rank."""
    assert _result(runs(world), f"{family}/{layout}/{loader}") == [[]] * world


@pytest.mark.parametrize(
    ("world", "family", "layout"), _params([c for c in _HF_CASES if not transformers_wrong(c[1], c[2])])
)
def test_transformers_own_distributed_load_matches_the_reference(runs, world, family, layout):
    """The reference agrees with transformers' own sharded load wherever transformers gets it right."""
    assert _result(runs(world), f"{family}/{layout}/transformers") == [{"error": None, "bad": []}] * world


@pytest.mark.parametrize(
    ("world", "family", "layout"), _params([c for c in _HF_CASES if transformers_wrong(c[1], c[2])])
)
def test_transformers_distributed_load_is_wrong_for_qwen3_vl_moe_and_hp_fastload_right(runs, world, family, layout):
    """Qwen3-VL-MoE stores its stacked experts transposed ([E, H, 2I] in the file, [E, 2I, H] in the model).

    transformers 5.23 and 5.24's distributed load (and 5.25's, but under plain TP: shard-on-read, then
    ``Transpose(1, 2, check_dims=True)``, whose shape check looks at the parameter) ends with wrongly oriented
    expert pieces under every DistributedConfig: it refuses the load, and with ``ignore_mismatched_sizes=True``
    leaves the experts re-initialized, i.e. its shards differ from the reference. hp_fastload fills the very same
    layout exactly.
    """
    experts = [
        f"model.language_model.layers.{i}.mlp.experts.{w}" for i in (0, 1) for w in ("gate_up_proj", "down_proj")
    ]
    per_rank = runs(world)
    for outcome in _result(per_rank, f"{family}/{layout}/transformers"):
        assert outcome["error"] is not None and "mismatched" in outcome["error"]
        assert sorted(outcome["bad"]) == sorted(experts)  # transformers' shards differ from the reference
    for loader in LOADERS:
        assert _result(per_rank, f"{family}/{layout}/{loader}") == [[]] * world


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_forward_parity(runs, family):
    """Logits of the hp_fastload-loaded TP+FSDP model (fp32) == the single-process model's, within fp tolerance."""
    values = subcheck_values(runs(2), f"check_forward_{family}")
    for max_diff, scale in values:
        assert scale > 1.0  # the logits are not trivially zero
        assert max_diff <= 1e-5 + 1e-4 * scale
