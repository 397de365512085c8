"""The docs pages' Python snippets, run as written (``tests/helpers/docs.py``), against the real clients.

Single process: the getting-started page's first load, ``from_pretrained`` and ``read_into``, the export
guide's ``save``, the checkpointer and the torch DCP reader, each compared bit for bit with transformers'
``from_pretrained`` / ``save_pretrained`` or safetensors' own reads of the same files. On 2 gloo ranks (one
spawn): the training script and the own-prologue snippets of the transformers guide (FSDP2 DTensors whose full
values, and the loss, are transformers' own) and the at-scale guide's ``share="job"`` (each checkpoint byte read
once per job). The accelerate, torchtitan, rehearsal and ``s3://`` snippets run in their own modules'
tests (test_accelerate.py, test_torchtitan.py, test_scale.py, test_s3_api.py), where their fixtures are.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import hp_fastload as hf
from tests.helpers.bits import bit_equal
from tests.helpers.dist import run_distributed, run_subchecks, subcheck_values
from tests.helpers.docs import run_snippet, snippet
from tests.helpers.tiny_models import TINY_DECODER, config_of, randomized

pytestmark = pytest.mark.timeout(300)

GETTING_STARTED = "docs/getting-started.md"
TRANSFORMERS = "docs/guides/transformers.md"
EXPORT = "docs/guides/export.md"
DCP = "docs/guides/dcp.md"
AT_SCALE = "docs/guides/at-scale.md"
README = "README.md"
ROOT_ENV = "HPF_DOCS_ROOT"


def _write(root: Path, name: str, tied: bool) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_of("llama", **dict(TINY_DECODER, tie_word_embeddings=tied)))
    randomized(model, 0.5).save_pretrained(root / name)
    return root / name


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("docs")
    return {"tied": _write(root, "tied", tied=True), "untied": _write(root, "untied", tied=False)}


def _transformers(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def _differing(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> list[str]:
    assert sorted(ours) == sorted(theirs)
    return [k for k in theirs if ours[k].dtype != theirs[k].dtype or not bit_equal(ours[k], theirs[k])]


def _state(model: Any) -> dict[str, torch.Tensor]:
    """Parameters and every buffer (non-persistent ones included: rotary ``inv_freq``)."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _first_load(path: Path, page: str = GETTING_STARTED) -> dict[str, Any]:
    return run_snippet(snippet(page, "first-load"), replace={'"Qwen/Qwen3-0.6B"': repr(str(path))})


# ---- single process ----


def test_first_load_is_transformers_from_pretrained(ckpts: dict[str, Path]) -> None:
    scope = _first_load(ckpts["tied"])  # checks the printed summary against the page's
    model = scope["model"]
    assert model.lm_head.weight is model.model.embed_tokens.weight  # re-tied
    assert _differing(_state(model), _state(_transformers(ckpts["tied"]))) == []
    assert scope["report"].missing_keys == () and scope["report"].unexpected_keys == ()


def test_readme_example_is_the_first_load(ckpts: dict[str, Path]) -> None:
    scope = _first_load(ckpts["tied"], README)
    assert _differing(_state(scope["model"]), _state(_transformers(ckpts["tied"]))) == []


def test_from_pretrained_line(ckpts: dict[str, Path]) -> None:
    path = ckpts["tied"]
    scope = run_snippet(snippet(GETTING_STARTED, "from-pretrained"), {"hf": hf, "torch": torch, "path": str(path)})
    model = scope["model"]
    assert next(model.parameters()).dtype == torch.bfloat16 and not model.training
    assert _differing(_state(model), _state(_transformers(path, torch.bfloat16))) == []


def test_read_into_box_is_safetensors_slice(tmp_path: Path) -> None:
    """The box ``w[0:64, 128:192]`` of a bf16 tensor into a float32 buffer: safetensors' slice, converted."""
    file = tmp_path / "model.safetensors"
    save_file({"w": torch.randn(96, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)}, str(file))
    scope = run_snippet(
        snippet(GETTING_STARTED, "read-into"), {"hf": hf, "torch": torch}, {'"model.safetensors"': repr(str(file))}
    )
    with safe_open(str(file), "pt") as f:
        expected = f.get_slice("w")[0:64, 128:192].to(torch.float32)
    assert scope["buf"].dtype == torch.float32 and torch.equal(scope["buf"], expected)


def _released(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    assert files, f"no safetensors files in {directory}"
    return {k: v for f in files for k, v in load_file(str(f)).items()}


def test_save_writes_save_pretrained_files(ckpts: dict[str, Path], tmp_path: Path) -> None:
    model = _first_load(ckpts["tied"])["model"]
    out = tmp_path / "out" / "dir"
    scope = run_snippet(snippet(EXPORT, "save"), {"hf": hf, "model": model}, {'"out/dir"': repr(str(out))})
    assert scope["saved"].summary()
    model.save_pretrained(tmp_path / "theirs")
    ours, theirs = _released(out), _released(tmp_path / "theirs")
    assert "lm_head.weight" not in ours  # the tie removed, as save_pretrained does
    assert _differing(ours, theirs) == []
    assert (out / "config.json").is_file()


def test_checkpointer_loads_and_saves(ckpts: dict[str, Path], tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    path = ckpts["tied"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    model.to_empty(device="cpu")
    out = tmp_path / "out" / "dir"
    scope = run_snippet(
        snippet(TRANSFORMERS, "checkpointer"),
        {"hf": hf, "model": model, "path": str(path)},
        {'"out/dir"': repr(str(out))},
    )
    report = scope["state"]["load_report"]
    assert report.missing_keys == [] or report.missing_keys == ()
    assert _differing(_state(model), _state(_transformers(path))) == []
    assert _differing(_released(out), _released(path)) == []


def test_dcp_reader_fills_the_state_dict(ckpts: dict[str, Path]) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    path = ckpts["untied"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    model.to_empty(device="cpu")
    scope = run_snippet(snippet(DCP, "dcp-reader"), {"model": model, "path": str(path)})
    assert _differing(dict(scope["state_dict"]), _released(path)) == []
    assert _differing(model.state_dict(), _released(path)) == []  # in place: the model's own tensors


# ---- 2 gloo ranks ----


def _path(name: str) -> str:
    return str(Path(os.environ[ROOT_ENV]) / name)


def _full(model: Any) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, t in _state(model).items():
        out[name] = t.full_tensor() if isinstance(t, DTensor) else t
    return out


def _sharded(model: Any) -> bool:
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    return all(isinstance(p, DTensor) and p.device_mesh.size() == 2 for p in params)


def check_training_script(rank: int, world: int) -> dict[str, Any]:
    path = _path("tied")
    scope = run_snippet(
        snippet(TRANSFORMERS, "training-script"),
        replace={
            'dist.init_process_group("nccl")\n': "",  # the harness made the (gloo) process group
            'init_device_mesh("cuda"': 'init_device_mesh("cpu"',
            '"meta-llama/Llama-3.1-8B"': repr(path),
        },
    )
    model = scope["model"]
    return {
        "sharded": _sharded(model),
        "differing": _differing(_full(model), _state(_transformers(Path(path), torch.bfloat16))),
        "missing": list(scope["report"].missing_keys),
        "optimizer": len(scope["optimizer"].param_groups[0]["params"]),
    }


def check_own_prologue(rank: int, world: int) -> dict[str, Any]:
    path = _path("tied")
    scope = run_snippet(snippet(TRANSFORMERS, "prologue"), {"path": path}, replace={'"cuda"': '"cpu"'})
    theirs = _transformers(Path(path))
    ids = scope["ids"]
    from torch.distributed.fsdp import FSDPModule

    model = scope["model"]  # the root's own parameters stay unsharded after a forward without backward (FSDP2)
    return {
        "sharded": isinstance(model, FSDPModule) and all(_sharded(layer) for layer in model.model.layers),
        "differing": _differing(_full(model), _state(theirs)),
        "loss": scope["loss"].item(),
        "their_loss": theirs(input_ids=ids, labels=ids).loss.item(),
        "printed": scope["__stdout__"],
    }


def check_share_job(rank: int, world: int) -> dict[str, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM

    path = _path("untied")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    model.to_empty(device="cpu")  # a full replica on each rank: every byte needed twice in the job
    scope = run_snippet(snippet(AT_SCALE, "share-job"), {"hf": hf, "model": model, "path": path})
    report = scope["report"]
    return {
        "differing": _differing(_state(model), _state(_transformers(Path(path)))),
        "bytes": (report.bytes_read, report.bytes_received, report.bytes_sent),
        "printed": scope["__stdout__"].split(),
    }


CHECKS = [check_training_script, check_own_prologue, check_share_job]


@pytest.fixture(scope="module")
def ranks(ckpts: dict[str, Path]) -> list[dict[str, Any]]:
    os.environ[ROOT_ENV] = str(ckpts["tied"].parent)
    try:
        return run_distributed(run_subchecks, 2, checks=CHECKS, timeout=240)
    finally:
        del os.environ[ROOT_ENV]


@pytest.mark.distributed
def test_training_script_is_transformers_from_pretrained_sharded(ranks: list[dict[str, Any]]) -> None:
    for value in subcheck_values(ranks, "check_training_script"):
        assert value["sharded"] and value["differing"] == [] and value["missing"] == []
        assert value["optimizer"] > 0


@pytest.mark.distributed
def test_own_prologue_gives_transformers_values_and_loss(ranks: list[dict[str, Any]]) -> None:
    for value in subcheck_values(ranks, "check_own_prologue"):
        assert value["sharded"] and value["differing"] == []
        assert value["loss"] == value["their_loss"]
        assert value["printed"].startswith("dcp: loaded"), value["printed"]


@pytest.mark.distributed
def test_share_job_reads_each_byte_once(ranks: list[dict[str, Any]], ckpts: dict[str, Path]) -> None:
    values = subcheck_values(ranks, "check_share_job")
    data = sum(t.numel() * t.element_size() for t in _released(ckpts["untied"]).values())
    assert all(v["differing"] == [] for v in values)
    read = [v["bytes"][0] for v in values]
    assert sum(read) == data and min(read) > 0, (read, data)  # once per job, both ranks reading
    for v in values:  # each rank holds everything: what it did not read, it received
        assert v["bytes"][0] + v["bytes"][1] == data
        assert v["printed"] == [str(b) for b in v["bytes"]]
    assert sum(v["bytes"][1] for v in values) == sum(v["bytes"][2] for v in values)


# ---- PEFT (one process; the sharded layouts are tests/api/test_peft.py's) ----

PEFT = "docs/guides/peft.md"


def _peft_reference(base: Path, adapter: Path | None) -> Any:
    """peft's own route: transformers' from_pretrained, then get_peft_model (after the same seed) or
    PeftModel.from_pretrained."""
    from peft import LoraConfig, PeftModel, get_peft_model

    model = _transformers(base)
    if adapter is not None:
        return PeftModel.from_pretrained(model, adapter, is_trainable=True)
    torch.manual_seed(0)
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))


def test_peft_guide_routes(ckpts: dict[str, Path], tmp_path: Path) -> None:
    base, out = ckpts["untied"], tmp_path / "out" / "adapter"
    scope = {"base": str(base), "parallelize": lambda model: model, "hf": hf, "torch": torch}
    renamed = {'"out/adapter"': repr(str(out))}
    fresh = run_snippet(snippet(PEFT, "fresh-lora"), scope, renamed)["model"]
    reference = _peft_reference(base, None)
    assert _differing(_state(fresh), _state(reference)) == []
    reference.save_pretrained(tmp_path / "theirs")
    theirs = load_file(str(tmp_path / "theirs" / "adapter_model.safetensors"))
    assert _differing(load_file(str(out / "adapter_model.safetensors")), theirs) == []

    with torch.no_grad():  # a trained adapter: no value at its initialization
        for name, p in fresh.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p))
    hf.save(fresh, out, adapter_only=True, overwrite=True)
    resumed = run_snippet(snippet(PEFT, "saved-adapter"), scope, renamed)["model"]
    reference = _peft_reference(base, out)
    assert _differing(_state(resumed), _state(reference)) == []
    assert sorted(n for n, p in resumed.named_parameters() if p.requires_grad) == sorted(
        n for n, p in reference.named_parameters() if p.requires_grad
    )

    own = run_snippet(snippet(PEFT, "own-prologue"), scope, {**renamed, '"cuda"': '"cpu"'})
    assert len(own["report"].adapter_keys) > 0
    model = own["model"]
    assert (
        _differing(
            {k: v for k, v in _state(model).items() if "lora_" not in k},
            {k: v for k, v in _state(reference).items() if "lora_" not in k},
        )
        == []
    )
    lora = {k: v for k, v in _state(model).items() if "lora_" in k}
    assert lora and _differing(lora, {k: v for k, v in _state(reference).items() if "lora_" in k}) == []
