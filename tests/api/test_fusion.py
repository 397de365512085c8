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

import os
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.dist import run_distributed, run_subchecks, subcheck_values
from tests.helpers.layouts import torch_fsdp

transformers = pytest.importorskip("transformers")
fusion_mapping = pytest.importorskip(
    "transformers.fusion_mapping", reason="module fusion is new in transformers 5.23 (this run has an older one)"
)

ROOT_ENV = "HPF_FUSION_ROOT"
FUSION = {"patch_embeddings": True}
FUSED = "model.visual.patch_embed.linear_proj.weight"
CASES = ("llama/fsdp", "llama/tp", "qwen2_vl/fsdp", "qwen2_vl/tp", "qwen2_vl/from_pretrained")


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
        config.fusion_config = dict(FUSION)
        if hasattr(fusion_mapping, "get_fusion_patch_mapping"):  # transformers >= 5.25: patches for this build
            with apply_patches(fusion_mapping.get_fusion_patch_mapping(cls, config, FUSION)):
                return cls(config)
        fusion_mapping.register_fusion_patches(cls, config, FUSION)  # 5.23, 5.24: registered for the model type
        with apply_patches():
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


def check_fusion(rank: int, world: int) -> dict[str, Any]:
    root = Path(os.environ[ROOT_ENV])
    out: dict[str, Any] = {}
    for case in CASES:
        try:
            out[case] = _case(case, root)
        except Exception as exc:
            out[case] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"
    return out


@pytest.fixture(scope="module")
def fusion_runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("fusion")
    for family in ("llama", "qwen2_vl"):
        torch.manual_seed(0)
        model = _class(family)(_config(family))
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p) * 0.1)
        model.save_pretrained(root / family)  # the original layout: a 5-D Conv3d patch weight
    saved = os.environ.get(ROOT_ENV)
    os.environ[ROOT_ENV] = str(root)
    try:
        per_rank = run_distributed(run_subchecks, 2, checks=[check_fusion], timeout=500)
    finally:
        if saved is None:
            os.environ.pop(ROOT_ENV, None)
        else:
            os.environ[ROOT_ENV] = saved
    return subcheck_values(per_rank, "check_fusion")


def test_the_checkpoint_holds_the_original_conv3d_layout(tmp_path: Path) -> None:
    """What the fused model loads from: the unfused 5-D weight, as transformers' save_pretrained writes it."""
    from safetensors import safe_open

    # saved before any fused model is built: transformers 5.23 and 5.24 register a fusion for the model type,
    # process-wide, and their save_pretrained then applies its transforms to every model of the type
    plain = _class("qwen2_vl")(_config("qwen2_vl"))
    plain.save_pretrained(tmp_path)
    model = _meta_model("qwen2_vl")
    assert type(model.model.visual.patch_embed).__name__.startswith("Fused")
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        shape = f.get_slice("visual.patch_embed.proj.weight").get_shape()
    assert len(shape) == 5 and tuple(model.get_parameter(FUSED).shape) == (
        shape[0],
        shape[1] * shape[2] * shape[3] * shape[4],
    )


def test_the_fused_projection_is_planned_as_region_reads(tmp_path: Path) -> None:
    """The flattening is affine per row: the fused weight is read as regions, not through the deferred path."""
    from hp_fastload import plan

    _class("qwen2_vl")(_config("qwen2_vl")).save_pretrained(tmp_path)
    planned = plan(_meta_model("qwen2_vl"), tmp_path, strict=True)
    assert FUSED in planned.region_reads
    assert not [g.claims for g in planned.deferred if FUSED in g.claims.values()]
    assert planned.report.deferred_targets == ()


def test_a_fusion_transform_that_does_not_fit_the_checkpoint_is_a_typed_error_naming_it(tmp_path: Path) -> None:
    """A patch weight of the wrong rank: ``Conv3dToLinear`` cannot run on it, so the load raises
    ``ConversionError`` naming the target, the checkpoint key and the op, before any byte reaches the model."""
    from safetensors.torch import load_file, save_file

    import hp_fastload as hf

    _class("qwen2_vl")(_config("qwen2_vl")).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    w = tensors["visual.patch_embed.proj.weight"]
    tensors["visual.patch_embed.proj.weight"] = w.reshape(*w.shape[:3], -1).contiguous()  # 4-D
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = _meta_model("qwen2_vl")
    model.to_empty(device="cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(hf.ConversionError) as raised:
        hf.load(model, tmp_path)
    message = str(raised.value)
    assert FUSED in message and "visual.patch_embed.proj.weight" in message and "Conv3dToLinear" in message
    assert all(torch.equal(v.view(torch.uint8), before[k].view(torch.uint8)) for k, v in model.state_dict().items())


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES)
def test_fused_and_plain_models_load_exactly_train_and_save_back(fusion_runs: list[dict[str, Any]], case: str) -> None:
    results = [per_rank[case] for per_rank in fusion_runs]
    assert results == [[], []], f"{case}: {results}"
