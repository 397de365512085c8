"""``hp_fastload.save`` on one process, against transformers' own ``save_pretrained`` and safetensors' reads.

Every comparison is byte for byte: the whole output directory (safetensors shards, index, config files) of
``hp_fastload.save(model, out)`` against ``model.save_pretrained(ref)`` of the same model with the same
``max_shard_size``, and each tensor as safetensors itself reads it. Crash safety: a failure while writing,
a parameter still on meta and an existing directory leave ``path`` as it was and no temporary sibling.
"""

from __future__ import annotations

import importlib
import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import hp_fastload as hf
from hp_fastload.errors import TargetError
from hp_fastload.planning.export import file_header
from tests.helpers.tiny_models import model_class, scale_mapping, tiny_config, tiny_model

save_mod = importlib.import_module("hp_fastload.api.save")
write_mod = importlib.import_module("hp_fastload.execute.write")

SHARD = 4000  # bytes: several shards for every tiny family, experts' storages kept together
FAMILIES = ["mixtral", "qwen3_moe", "phi3", "llama", "gemma2", "deepseek_v3", "gpt_oss", "qwen3_vl_moe"]


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def _tensors(root: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """key -> (dtype, shape, raw bytes), read by safetensors."""
    out = {}
    for file in sorted(root.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                t = f.get_tensor(key)
                raw = t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
                out[key] = (str(t.dtype), tuple(t.shape), raw.numpy().tobytes())
    return out


def _siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}."))


def _assert_same_dir(ref: Path, out: Path) -> None:
    a, b = _files(ref), _files(out)
    assert sorted(a) == sorted(b)
    different = [name for name in a if a[name] != b[name]]
    assert not different, f"files differ: {different}"
    assert _tensors(ref) == _tensors(out)


@pytest.mark.parametrize("family", FAMILIES)
def test_save_equals_save_pretrained(tmp_path: Path, family: str) -> None:
    model = tiny_model(family)
    model.save_pretrained(tmp_path / "ref", max_shard_size=SHARD)
    report = hf.save(model, tmp_path / "out", max_shard_size=SHARD)
    _assert_same_dir(tmp_path / "ref", tmp_path / "out")
    assert report.fallbacks == []
    data = sum(len(raw) for _, _, raw in _tensors(tmp_path / "out").values())
    assert report.bytes_written == data == report.bytes_written_by_rank[0]
    assert _siblings(tmp_path / "out") == []


def test_single_file_default_shard_size(tmp_path: Path) -> None:
    model = tiny_model("mixtral").to(torch.bfloat16)
    model.save_pretrained(tmp_path / "ref")
    report = hf.save(model, tmp_path / "out")
    assert report.files == ["model.safetensors"]
    _assert_same_dir(tmp_path / "ref", tmp_path / "out")


def _empty_model(family: str) -> Any:
    cls = model_class(family)
    with torch.device("meta"):
        if cls.__name__.startswith("Auto"):
            model = cls.from_config(tiny_config(family), dtype=torch.bfloat16)
        else:
            model = cls._from_config(tiny_config(family), dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    model.tie_weights()
    return model


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "phi3", "llama", "gemma2"])
def test_load_then_save_reproduces_the_checkpoint(tmp_path: Path, family: str) -> None:
    """A transformers-saved checkpoint, loaded by hp_fastload and saved again: the same tensors, byte for byte;
    the directory equal to save_pretrained of the loaded model (which orders keys after its conversions)."""
    tiny_model(family).to(torch.bfloat16).save_pretrained(tmp_path / "src", max_shard_size=SHARD)
    model = _empty_model(family)
    hf.load(model, tmp_path / "src")
    hf.save(model, tmp_path / "out", max_shard_size=SHARD)
    assert _tensors(tmp_path / "out") == _tensors(tmp_path / "src")
    model.save_pretrained(tmp_path / "ref", max_shard_size=SHARD)
    _assert_same_dir(tmp_path / "ref", tmp_path / "out")
    again = _empty_model(family)  # round trip: load the export back
    hf.load(again, tmp_path / "out")
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), name


def test_header_order_is_safetensors_own(tmp_path: Path) -> None:
    """The header and data order (dtype, then name) for every dtype, against safetensors' own file."""
    dtypes = [torch.bool, torch.uint8, torch.int8, torch.float8_e5m2, torch.float8_e4m3fn, torch.int16]
    dtypes += [torch.float16, torch.bfloat16, torch.int32, torch.float32, torch.float64, torch.int64]
    tensors = {
        f"t{len(dtypes) - i}.{d}".replace("torch.", ""): torch.zeros(i + 1, 2).to(d) for i, d in enumerate(dtypes)
    }
    tensors["scalar"] = torch.zeros(())
    tensors["empty"] = torch.zeros(0, 3)
    save_file(tensors, str(tmp_path / "st.safetensors"), metadata={"format": "pt"})
    raw = (tmp_path / "st.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    meta = [(k, v.to("meta")) for k, v in tensors.items()]
    header, data, _ = file_header(meta)
    assert header == raw[: 8 + n]
    assert len(header) + data == len(raw)


def test_existing_directory_refused_then_swapped(tmp_path: Path) -> None:
    model = tiny_model("llama")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        hf.save(model, out)
    assert _files(out) == {"keep.txt": b"mine"}
    hf.save(model, out, overwrite=True)
    assert "keep.txt" not in _files(out)
    model.save_pretrained(tmp_path / "ref")
    _assert_same_dir(tmp_path / "ref", out)
    assert _siblings(out) == []
    empty = tmp_path / "empty"
    empty.mkdir()
    hf.save(model, empty)  # an empty directory is not refused
    assert (empty / "model.safetensors").exists()


def test_a_file_at_path_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(FileExistsError, match="not a directory"):
        hf.save(tiny_model("llama"), target, overwrite=True)
    assert target.read_text() == "x"


def test_write_failure_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = write_mod.write_batch

    def failing(batch: Any, threads: Any, stats: Any) -> None:
        calls.append(batch.count)
        real(batch, threads, stats)  # the bytes reach the temporary files first
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(write_mod, "write_batch", failing)
    out = tmp_path / "out"
    with pytest.raises(OSError, match="No space left"):
        hf.save(tiny_model("mixtral"), out)
    assert calls and not out.exists()
    assert _siblings(out) == []


def test_failure_keeps_the_existing_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")

    def failing(*args: Any) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(write_mod, "write_batch", failing)
    with pytest.raises(OSError, match="Input/output"):
        hf.save(tiny_model("llama"), out, overwrite=True)
    assert _files(out) == {"keep.txt": b"mine"}
    assert _siblings(out) == []


def test_meta_parameter_is_named(tmp_path: Path) -> None:
    model = tiny_model("llama")
    model.model.norm.weight = torch.nn.Parameter(torch.empty(16, device="meta"))
    with pytest.raises(TargetError, match=r"model\.norm\.weight"):
        hf.save(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert _siblings(tmp_path / "out") == []


def test_plain_module_saved_after_a_load_round_trips(tmp_path: Path) -> None:
    """A module that is not a transformers model, loaded by ``hf.load`` (which records its empty rule list) and
    saved: the files hold safetensors' own bytes of the same tensors (no transformers revert is attempted)."""
    g = torch.Generator().manual_seed(4)
    tensors = {"a.weight": torch.randn(12, 8, generator=g), "b.weight": torch.randn(5, generator=g).bfloat16()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model = torch.nn.Module()
    model.a = torch.nn.Linear(8, 12, bias=False)
    model.b = torch.nn.Module()
    model.b.weight = torch.nn.Parameter(torch.zeros(5, dtype=torch.bfloat16))
    hf.load(model, tmp_path)
    hf.save(model, tmp_path / "out")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    assert sorted(saved) == sorted(tensors)
    assert all(torch.equal(saved[k], v) and saved[k].dtype == v.dtype for k, v in tensors.items())


def test_value_changing_conversion_falls_back_to_torch(tmp_path: Path) -> None:
    """A conversion without a region inverse: the tensor is computed with torch (transformers' reverse op),
    reported, and the files equal save_pretrained's under the same rules."""
    model = tiny_model("llama")
    mapping = scale_mapping(["model.norm.weight"])
    report = hf.save(model, tmp_path / "out", max_shard_size=SHARD, weights_mapping=mapping)
    assert report.fallbacks == ["model.norm.weight"]
    model._weight_conversions = mapping
    model.save_pretrained(tmp_path / "ref", max_shard_size=SHARD)
    _assert_same_dir(tmp_path / "ref", tmp_path / "out")
    with safe_open(
        str(
            tmp_path
            / "out"
            / json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"][
                "model.norm.weight"
            ]
        ),
        "pt",
    ) as f:
        assert torch.equal(f.get_tensor("model.norm.weight"), model.model.norm.weight.detach() / 4.0)


def test_checkpointer_save_is_save(tmp_path: Path) -> None:
    model = tiny_model("llama")
    report = hf.HuggingFaceCheckpointer().save(tmp_path / "out", {"model": model})
    assert isinstance(report, hf.SaveReport)
    model.save_pretrained(tmp_path / "ref")
    _assert_same_dir(tmp_path / "ref", tmp_path / "out")
    assert os.path.isdir(tmp_path / "out")


def test_quantized_model_is_refused(tmp_path: Path) -> None:
    model = tiny_model("llama")
    model.hf_quantizer = type("Fp8HfQuantizer", (), {})()
    with pytest.raises(NotImplementedError, match="Fp8HfQuantizer"):
        hf.save(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_checkpointer_save_refuses_async_and_non_modules(tmp_path: Path) -> None:
    ckpt = hf.HuggingFaceCheckpointer()
    with pytest.raises(NotImplementedError, match="save_async"):
        ckpt.save(tmp_path / "out", {"model": tiny_model("llama")}, global_step=3, save_async=True)
    with pytest.raises(TypeError, match=r"nn\.Module to export"):
        ckpt.save(tmp_path / "out", {"model": {}})
    assert not (tmp_path / "out").exists()


def test_replacement_conversions_are_refused(tmp_path: Path) -> None:
    model = tiny_model("llama")
    model._hp_used_replacement_weight_conversions = [object()]
    with pytest.raises(NotImplementedError, match="replacement conversions"):
        hf.save(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("staging_bytes", [1 << 20, 512])
def test_staged_writes_equal_direct_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, staging_bytes: int) -> None:
    """The device path (double-buffered host slabs, row blocks cut to the slab, written one slab behind) taken
    by CPU shards: the same directory as save_pretrained's. 512 bytes: most tensors are cut into row blocks."""
    import functools

    real = save_mod.write_regions
    calls: list[int] = []

    def staged(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        real(*args, **kwargs, staging_bytes=staging_bytes, stage_all=True)

    monkeypatch.setattr(save_mod, "write_regions", functools.wraps(real)(staged))
    model = tiny_model("mixtral")
    model.save_pretrained(tmp_path / "ref", max_shard_size=SHARD)
    hf.save(model, tmp_path / "out", max_shard_size=SHARD)
    assert calls == [1]
    _assert_same_dir(tmp_path / "ref", tmp_path / "out")
