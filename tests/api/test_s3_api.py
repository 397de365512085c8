"""The public entry points over ``s3://`` (the session's SeaweedFS, ``s3_server``), one process:

- ``hp_fastload.from_pretrained("s3://...")`` equals transformers' own ``from_pretrained`` of the same files;
- an FP8 block-quantized checkpoint (quantized with plain torch ops, written with safetensors ``save_file``)
  loaded and dequantized from ``s3://`` equals transformers' own dequantizing ``from_pretrained``
  (``FineGrainedFP8Config(dequantize=True)``), fetching only what the plan reads;
- the ``hp_fastload.dcp`` readers over ``s3://`` equal torch's own readers of the same files.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import hp_fastload as hf
import hp_fastload._core as _core
from hp_fastload.source import objstore

from ..helpers import quant_checkpoints as qc
from ..helpers import s3server
from ..helpers.bits import bit_equal
from ..helpers.docs import run_snippet, snippet
from ..helpers.tiny_models import model_class, tiny_model

pytestmark = pytest.mark.timeout(300)

#: square blocks: torch's quantized reader (a reference here) takes one block size
FP8_FAMILY, FP8_BLOCK = "qwen3_moe", (8, 8)


def _header_bytes(root: Path) -> int:
    """Bytes a load fetches besides tensor data: each file's length prefix and header, the side objects."""
    total = sum(p.stat().st_size for p in root.glob("*.json"))
    for f in root.glob("*.safetensors"):
        with open(f, "rb") as fh:
            total += 8 + int.from_bytes(fh.read(8), "little")
    return total


@pytest.fixture(scope="module")
def ckpts(s3_server: s3server.S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("s3api")
    # a sharded tiny llama, as transformers releases it (index + 2 shards + config.json)
    llama = root / "llama"
    tiny_model("llama").save_pretrained(llama, max_shard_size="20KB")
    # an FP8 block-quantized MoE: save_pretrained, linear weights quantized with torch ops, save_file
    fp8 = root / "fp8"
    released = qc.released(qc.build_model(FP8_FAMILY), fp8)
    qc.rewrite(fp8, qc.quantize_fp8_block(released, FP8_BLOCK), dict(qc.FP8_CONFIG, weight_block_size=[*FP8_BLOCK]))
    index = {
        "metadata": {},
        "weight_map": dict.fromkeys(load_file(str(fp8 / "model.safetensors")), "model.safetensors"),
    }
    (fp8 / "model.safetensors.index.json").write_text(json.dumps(index))  # torch's quantized reader needs one
    urls = {name: s3_server.upload_dir(root / name, s3server.BUCKET, f"api/{name}") for name in ("llama", "fp8")}
    with pytest.MonkeyPatch.context() as env:
        for name, value in s3_server.env().items():
            env.setenv(name, value)
        yield {"root": root, "urls": urls}
    objstore.clear_cache()


def test_from_pretrained_over_s3_equals_transformers(ckpts: dict[str, Any]) -> None:
    from transformers import AutoModelForCausalLM

    local = ckpts["root"] / "llama"
    assert (local / "model.safetensors.index.json").is_file()  # really sharded
    reference = AutoModelForCausalLM.from_pretrained(local)
    model, report = hf.from_pretrained(ckpts["urls"]["llama"], output_loading_info=True)
    assert report.missing_keys == () and report.unexpected_keys == ()
    assert type(model) is type(reference)
    ours, theirs = model.state_dict(), reference.state_dict()
    assert sorted(ours) == sorted(theirs)
    differ = [k for k in theirs if ours[k].dtype != theirs[k].dtype or not bit_equal(ours[k], theirs[k])]
    assert differ == []


def test_object_storage_guide_snippet(ckpts: dict[str, Any]) -> None:
    """The object-storage guide's snippet as written, its URL put in for the example's: transformers' values."""
    from transformers import AutoModelForCausalLM

    page = snippet("docs/guides/object-storage.md", "s3-load")
    scope = run_snippet(page, replace={'"s3://bucket/llama-3-8b"': repr(ckpts["urls"]["llama"])})
    ours, theirs = (
        scope["model"].state_dict(),
        AutoModelForCausalLM.from_pretrained(ckpts["root"] / "llama").state_dict(),
    )
    assert sorted(ours) == sorted(theirs)
    assert [k for k in theirs if not bit_equal(ours[k], theirs[k])] == []


def test_fp8_block_checkpoint_over_s3_dequantizes_like_transformers(ckpts: dict[str, Any]) -> None:
    from transformers import FineGrainedFP8Config

    local = ckpts["root"] / "fp8"
    reference = model_class(FP8_FAMILY).from_pretrained(
        local,
        dtype=torch.bfloat16,
        quantization_config=FineGrainedFP8Config(weight_block_size=FP8_BLOCK, dequantize=True),
    )
    model = qc.build_model(FP8_FAMILY, seed=1)  # other values: every tensor must be overwritten
    objstore.clear_cache()
    _core.object_counters(reset=True)
    report = hf.load(model, ckpts["urls"]["fp8"])
    fetched = _core.object_counters()[0]
    assert report.missing_keys == ()
    theirs, ours = reference.state_dict(), model.state_dict()
    differ = [k for k in theirs if not bit_equal(ours[k], theirs[k])]
    assert differ == []
    # every stored byte is needed here (weights and scales); fetched = that plus headers and side objects
    assert report.bytes_needed <= fetched <= 1.05 * report.bytes_needed + _header_bytes(local)


def test_dcp_reader_over_s3_equals_torchs_reader(ckpts: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp

    from hp_fastload.dcp import HuggingFaceStorageReader

    local = ckpts["root"] / "llama"
    full = {}
    for f in sorted(local.glob("*.safetensors")):
        full.update(load_file(str(f)))
    theirs = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in full.items()}
    ours = {k: torch.full_like(v, 7.0, dtype=torch.float32) for k, v in full.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns when dcp.load runs without a process group
        dcp.load(theirs, storage_reader=dcp.HuggingFaceStorageReader(str(local)))
        reader = HuggingFaceStorageReader(ckpts["urls"]["llama"])
        dcp.load(ours, storage_reader=reader)
    assert [k for k in theirs if not bit_equal(ours[k], theirs[k])] == []
    assert reader.last_stats is not None and reader.last_stats.bytes_read == sum(
        v.numel() * v.element_size() for v in full.values()
    )


def test_quantized_dcp_reader_over_s3_equals_torchs_reader(ckpts: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader as TorchReader

    from hp_fastload.dcp import QuantizedHuggingFaceStorageReader

    local = ckpts["root"] / "fp8"
    stored = load_file(str(local / "model.safetensors"))
    shapes = {k: v.shape for k, v in stored.items() if not k.endswith("_scale_inv")}
    theirs = {k: torch.zeros(s, dtype=torch.bfloat16) for k, s in shapes.items()}
    ours = {k: torch.full(s, 7.0, dtype=torch.bfloat16) for k, s in shapes.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(theirs, storage_reader=TorchReader(str(local), target_dtype=torch.bfloat16, block_size=FP8_BLOCK[0]))
        reader = QuantizedHuggingFaceStorageReader(
            ckpts["urls"]["fp8"], target_dtype=torch.bfloat16, block_size=FP8_BLOCK[0]
        )
        dcp.load(ours, storage_reader=reader)
    assert [k for k in theirs if not bit_equal(ours[k], theirs[k])] == []
    assert any(k + "_scale_inv" in stored for k in theirs)  # some really were dequantized


def test_dcp_reader_refuses_storage_outside_the_prefix(ckpts: dict[str, Any]) -> None:
    from hp_fastload.dcp import HuggingFaceStorageReader
    from hp_fastload.errors import HeaderError

    reader = HuggingFaceStorageReader(ckpts["urls"]["llama"])
    outside = ckpts["urls"]["llama"].rsplit("/", 1)[0] + "/fp8/model.safetensors"
    with pytest.raises(HeaderError, match="outside the checkpoint prefix"):
        reader._file(outside)
    with pytest.raises(HeaderError, match="outside the checkpoint prefix"):
        reader._file(ckpts["urls"]["llama"] + "/../fp8/model.safetensors")
