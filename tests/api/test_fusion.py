"""transformers' module fusion (``fusion_config``, 5.23 and newer; 5.25 reworked it) and today's transformers, on 2
gloo ranks.

A model built with ``fusion_config={"patch_embeddings": True}`` replaces each Conv3d patch embedding by a fused
class holding a flattened ``linear_proj`` (``[out, in * kt * kh * kw]``); its weight transforms
(``Conv3dToLinear`` and a rename) load the original checkpoint layout (``proj.weight``, 5-D) and save it back. A
Qwen2-VL written by transformers' ``save_pretrained`` is loaded by ``hp_fastload.load`` into the fused model under
FSDP2 (every block and the root wrapped) and under TP (the fused projection sharded on both of its dims), and by
``hp_fastload.from_pretrained(..., fusion_config=...)``; every local shard must equal ``distribute_tensor`` of
transformers' own ``from_pretrained(..., fusion_config=...)``, the loss and gradients of one training step those
of the single-process model, and ``hp_fastload.save`` must write the checkpoint's tensors back byte for byte. A
plain Llama (no fusion) runs the same checks. One spawn runs every case.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.dist import child_environment, run_distributed, run_subchecks, subcheck_values
from tests.helpers.layouts import torch_fsdp

transformers = pytest.importorskip("transformers")
#: transformers >= 5.25: fusions applied per build (``get_fusion_patch_mapping``). 5.23 and 5.24 register them
#: process-wide and their own fused loads miss the fused weights, so hp_fastload refuses fusion there (tested below).
FUSION_API = importlib.util.find_spec("transformers.fusion_mapping") is not None and hasattr(
    importlib.import_module("transformers.fusion_mapping"), "get_fusion_patch_mapping"
)
NO_FUSION = "module fusion loads correctly from transformers 5.25 on; this run has an older release"

ROOT_ENV = "HPF_FUSION_ROOT"
FUSION = {"patch_embeddings": True}
FUSED = "model.visual.patch_embed.linear_proj.weight"
FUSED_CASES = ("qwen2_vl/fsdp", "qwen2_vl/tp", "qwen2_vl/from_pretrained")
CASES = ("llama/fsdp", "llama/tp", *(FUSED_CASES if FUSION_API else ()))


def _config(family: str) -> Any:
    from tests.helpers.tiny_models import root_rule_config

    if family == "llama":
        return transformers.LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    config = root_rule_config("qwen2_vl")
    # the text model's multimodal RoPE sections must sum to half its head size (16 / 4 heads / 2) to run a step
    config.get_text_config().rope_parameters["mrope_section"] = [1, 1, 0]
    return config


def _class(family: str) -> Any:
    return transformers.LlamaForCausalLM if family == "llama" else transformers.Qwen2VLForConditionalGeneration


def _meta_model(family: str) -> Any:
    """The model as a user builds it on meta: with the fusion's module patches where the family has them."""
    from transformers.monkey_patching import apply_patches

    cls, config = _class(family), _config(family)
    with torch.device("meta"):
        if family == "llama":
            return cls(config)
        from transformers.fusion_mapping import get_fusion_patch_mapping

        config.fusion_config = dict(FUSION)
        with apply_patches(get_fusion_patch_mapping(cls, config, FUSION)):
            return cls(config)


def _tp(model: Any, mesh: Any) -> None:
    """Column- and row-wise plans on the attention and MLP, and the fused patch projection sharded on its
    flattened input dim (``Shard(1)``: the cut falls inside the Conv3d's channel x kernel volume)."""
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan: dict[str, Any] = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if name.endswith(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")) and "visual" not in name:
            plan[name] = ColwiseParallel()
        elif (name.endswith(("o_proj", "down_proj")) and "visual" not in name) or name.endswith(
            "patch_embed.linear_proj"
        ):
            plan[name] = RowwiseParallel()
    parallelize_module(model, mesh, plan)


def _reference(family: str, path: Path) -> Any:
    kwargs = {"fusion_config": dict(FUSION)} if family != "llama" else {}
    return _class(family).from_pretrained(path, dtype=torch.float32, **kwargs)


def _step(model: Any, family: str) -> tuple[float, dict[str, torch.Tensor]]:
    """One forward and backward on text; the loss and every parameter's full gradient."""
    from torch.distributed.tensor import DTensor

    ids = torch.randint(0, 60, (2, 7), generator=torch.Generator().manual_seed(3))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad
            grads[name] = g.full_tensor() if isinstance(g, DTensor) else g
    return float(loss.item()), grads


def _case(case: str, root: Path) -> list[str]:
    """What differs from transformers (local shards, loss, gradients, the saved tensors); empty when exact."""
    import tempfile

    from safetensors import safe_open
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    import hp_fastload as hf

    family, layout = case.split("/")
    path = root / family
    world = torch.distributed.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    reference = _reference(family, path)
    if layout == "from_pretrained":
        model = hf.from_pretrained(
            path,
            auto_class=_class(family),
            parallelize=lambda m: torch_fsdp(m, world),
            dtype=torch.float32,
            device="cpu",
            fusion_config=dict(FUSION),
        )
    else:
        model = _meta_model(family)
        if layout == "fsdp":
            torch_fsdp(model, world)
        else:
            _tp(model, mesh)
        model.to_empty(device="cpu")
        report = hf.load(model, path, strict=True)
        if report.missing_keys or report.unexpected_keys:
            return [f"missing {report.missing_keys}, unexpected {report.unexpected_keys}"]
    bad = []
    want = reference.state_dict()
    if family != "llama" and FUSED not in want:
        return [f"transformers' model has no {FUSED}: the fusion did not apply"]
    for name, value in model.state_dict().items():
        if isinstance(value, DTensor):
            expected = distribute_tensor(want[name], value.device_mesh, value.placements).to_local()
            if not torch.equal(value.to_local(), expected):
                bad.append(f"local shard of {name}")
        elif not torch.equal(value, want[name]):
            bad.append(name)
    loss, grads = _step(model, family)
    want_loss, want_grads = _step(reference, family)
    if abs(loss - want_loss) > 1e-6 * max(1.0, abs(want_loss)):
        bad.append(f"loss {loss} != {want_loss}")
    for name, g in want_grads.items():
        if not torch.allclose(grads[name], g, rtol=1e-5, atol=1e-6):
            bad.append(f"gradient of {name}")
    out = Path(tempfile.mkdtemp(prefix="fusion-save-")) if torch.distributed.get_rank() == 0 else None
    shared = [str(out) if out else None]
    torch.distributed.broadcast_object_list(shared, src=0)
    hf.save(model, shared[0])
    torch.distributed.barrier()
    if out is not None:
        with safe_open(path / "model.safetensors", "pt") as src, safe_open(out / "model.safetensors", "pt") as back:
            if sorted(src.keys()) != sorted(back.keys()):
                bad.append(f"saved keys {sorted(set(back.keys()) ^ set(src.keys()))} differ")
            else:
                for key in src.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    a, b = src.get_tensor(key), back.get_tensor(key)
                    if a.dtype != b.dtype or not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
                        bad.append(f"saved {key}")
    return bad


def _checkpoint_layout(root: Path) -> list[str]:
    """What the fused model loads from: the unfused 5-D weight, as transformers' save_pretrained writes it."""
    from safetensors import safe_open

    model = _meta_model("qwen2_vl")
    if not type(model.model.visual.patch_embed).__name__.startswith("Fused"):
        return [f"the patch embedding is {type(model.model.visual.patch_embed).__name__}, not fused"]
    with safe_open(root / "qwen2_vl" / "model.safetensors", "pt") as f:
        shape = f.get_slice("visual.patch_embed.proj.weight").get_shape()
    fused = tuple(model.get_parameter(FUSED).shape)
    if len(shape) != 5 or fused != (shape[0], shape[1] * shape[2] * shape[3] * shape[4]):
        return [f"checkpoint {shape}, fused {fused}"]
    return []


def _region_reads(root: Path) -> list[str]:
    """The flattening is affine per row: the fused weight is read as regions, not through the deferred path."""
    from hp_fastload import plan

    planned = plan(_meta_model("qwen2_vl"), root / "qwen2_vl", strict=True)
    bad = [] if FUSED in planned.region_reads else [f"{FUSED} has no region reads"]
    bad += [f"deferred: {g.claims}" for g in planned.deferred if FUSED in g.claims.values()]
    return bad + ([f"deferred targets {planned.report.deferred_targets}"] if planned.report.deferred_targets else [])


def _typed_error(root: Path) -> list[str]:
    """A patch weight of the wrong rank: ``Conv3dToLinear`` cannot run on it, so the load raises
    ``ConversionError`` naming the target, the checkpoint key and the op, before any byte reaches the model."""
    import hp_fastload as hf

    model = _meta_model("qwen2_vl")
    model.to_empty(device="cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        hf.load(model, root / "qwen2_vl_4d")
    except hf.ConversionError as exc:
        message = str(exc)
        if not (FUSED in message and "visual.patch_embed.proj.weight" in message and "Conv3dToLinear" in message):
            return [f"the error does not name the target, key and op: {message}"]
    else:
        return ["the 4-D patch weight loaded without an error"]
    changed = [
        k for k, v in model.state_dict().items() if not torch.equal(v.view(torch.uint8), before[k].view(torch.uint8))
    ]
    return [f"written before the error: {changed}"] if changed else []


#: Checks of one process, run in the spawned ranks (pytest's own process builds no fused model).
SINGLE = {"layout": _checkpoint_layout, "regions": _region_reads, "typed error": _typed_error} if FUSION_API else {}


def check_fusion(rank: int, world: int) -> dict[str, Any]:
    root = Path(os.environ[ROOT_ENV])
    out: dict[str, Any] = {}
    for name, check in SINGLE.items():
        try:
            out[name] = check(root)
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"
    for case in CASES:
        try:
            out[case] = _case(case, root)
        except Exception as exc:
            out[case] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"
    return out


@pytest.fixture(scope="module")
def fusion_runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("fusion")
    for family in ("llama", "qwen2_vl"):
        torch.manual_seed(0)
        model = _class(family)(_config(family))
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p) * 0.1)
        model.save_pretrained(root / family)  # the original layout: a 5-D Conv3d patch weight
    # the same checkpoint with a 4-D patch weight (safetensors' own save_file), which Conv3dToLinear refuses
    (root / "qwen2_vl_4d").mkdir()
    for name in ("config.json", "generation_config.json"):
        if (root / "qwen2_vl" / name).exists():
            (root / "qwen2_vl_4d" / name).write_bytes((root / "qwen2_vl" / name).read_bytes())
    tensors = load_file(root / "qwen2_vl" / "model.safetensors")
    w = tensors["visual.patch_embed.proj.weight"]
    tensors["visual.patch_embed.proj.weight"] = w.reshape(*w.shape[:3], -1).contiguous()
    save_file(tensors, root / "qwen2_vl_4d" / "model.safetensors", metadata={"format": "pt"})
    with child_environment({ROOT_ENV: str(root)}):
        per_rank = run_distributed(run_subchecks, 2, checks=[check_fusion], timeout=500)
    return subcheck_values(per_rank, "check_fusion")


def test_fusion_on_an_older_transformers_is_refused_with_the_release_it_needs(tmp_path: Path) -> None:
    """Where transformers' own fused loads are wrong (5.23, 5.24), from_pretrained(fusion_config=...) refuses."""
    import hp_fastload as hf

    if FUSION_API:
        pytest.skip("this transformers has the 5.25 fusion API: the fused cases run instead")
    _class("qwen2_vl")(_config("qwen2_vl")).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"transformers 5\.25"):
        hf.from_pretrained(tmp_path, auto_class=_class("qwen2_vl"), device="cpu", fusion_config=dict(FUSION))


@pytest.mark.distributed
@pytest.mark.skipif(not FUSION_API, reason=NO_FUSION)
@pytest.mark.parametrize("check", ["layout", "regions", "typed error"])
def test_the_fused_layout_is_read_as_regions_and_a_misfit_is_a_typed_error(
    fusion_runs: list[dict[str, Any]], check: str
) -> None:
    """The checkpoint holds the unfused 5-D layout; the fused projection is planned as region reads; a patch weight
    of the wrong rank is a ConversionError naming the target, the key and the op, with nothing written."""
    results = [per_rank[check] for per_rank in fusion_runs]
    assert results == [[], []], f"{check}: {results}"


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES)
def test_fused_and_plain_models_load_exactly_train_and_save_back(fusion_runs: list[dict[str, Any]], case: str) -> None:
    results = [per_rank[case] for per_rank in fusion_runs]
    assert results == [[], []], f"{case}: {results}"
