"""``hf.load(model, "s3://...")`` on 2 gloo ranks against a real S3 server (SeaweedFS): TP (row and column),
FSDP and EP layouts bit-exact against torch's own ``distribute_tensor`` of safetensors' own ``load_file`` of the
same files, each rank fetching only its share (plus headers), and ranks that see different objects raising
``CheckpointMismatchError`` together. One spawn runs every check."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from ..helpers import s3server
from ..helpers.dist import run_distributed, run_subchecks, subcheck_values

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(400)]


def _tensors(seed: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "tp_col.weight": torch.randn(128, 64, generator=g),  # Shard(0): rows
        "tp_row.weight": torch.randn(64, 128, generator=g),  # Shard(1): half of every row
        "fsdp.weight": torch.randn(100, 30, generator=g).to(torch.bfloat16),  # Shard(0), cast to f32
        "experts.weight": torch.randn(8, 32, 16, generator=g),  # EP: Shard(0) over 8 experts
        "norm.weight": torch.randn(64, generator=g),  # Replicate
    }


def _layouts() -> dict[str, tuple[list[Any], torch.dtype]]:
    from torch.distributed.tensor import Replicate, Shard

    return {
        "tp_col.weight": ([Shard(0)], torch.float32),
        "tp_row.weight": ([Shard(1)], torch.float32),
        "fsdp.weight": ([Shard(0)], torch.float32),
        "experts.weight": ([Shard(0)], torch.float32),
        "norm.weight": ([Replicate()], torch.float32),
    }


def _model() -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    model = nn.Module()
    for name, (placements, dtype) in _layouts().items():
        module_name, leaf = name.split(".")
        if not hasattr(model, module_name):
            model.add_module(module_name, nn.Module())
        shape = _tensors()[name].shape
        dt = distribute_tensor(torch.zeros(shape, dtype=dtype), mesh, placements, src_data_rank=None)
        getattr(model, module_name).register_parameter(leaf, nn.Parameter(dt, requires_grad=False))
    return model


def _load_and_compare(**kwargs: Any) -> tuple[list[str], int, Any]:
    """``hf.load`` of the s3 checkpoint into a fresh model (``kwargs`` to ``load``): the names whose local shard
    differs from torch's ``distribute_tensor`` of safetensors' ``load_file``, the bytes fetched, the report."""
    from safetensors.torch import load_file
    from torch.distributed.tensor import distribute_tensor

    import hp_fastload as hf
    import hp_fastload._core as _core

    local = Path(os.environ["HPF_S3_LOCAL"])
    full = {**load_file(str(local / "s0.safetensors")), **load_file(str(local / "s1.safetensors"))}
    model = _model()
    _core.object_counters(reset=True)
    report = hf.load(model, os.environ["HPF_S3_URL"], **kwargs)
    fetched = _core.object_counters()[0]
    bad = []
    for name, value in full.items():
        param = model.get_parameter(name)
        expected = distribute_tensor(value.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
        if not torch.equal(expected.to_local(), param.to_local()):
            bad.append(name)
    return bad, fetched, report


def check_bit_exact_and_share(rank: int, world: int) -> tuple[list[str], int, int, int]:
    bad, fetched, report = _load_and_compare()
    return bad, fetched, report.bytes_needed, report.checkpoint_bytes


def check_same_as_local_files(rank: int, world: int) -> bool:
    import hp_fastload as hf

    a, b = _model(), _model()
    ra = hf.load(a, os.environ["HPF_S3_URL"])
    rb = hf.load(b, os.environ["HPF_S3_LOCAL"])
    same = all(torch.equal(pa.to_local(), pb.to_local()) for pa, pb in zip(a.parameters(), b.parameters(), strict=True))
    return same and ra.bytes_needed == rb.bytes_needed and ra.loaded_keys == rb.loaded_keys


def check_job_share_reads_each_byte_once(rank: int, world: int) -> tuple[list[str], int, int]:
    """``share="job"`` over objects: every byte fetched by one rank only, the rest received from peers."""
    bad, fetched, report = _load_and_compare(share="job")
    return bad, fetched, report.checkpoint_bytes


def check_ranks_on_different_objects_raise(rank: int, world: int) -> str:
    import hp_fastload as hf

    url = os.environ["HPF_S3_URL"] if rank == 0 else os.environ["HPF_S3_OTHER"]
    try:
        hf.load(_model(), url)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _write(root: Path, tensors: dict[str, torch.Tensor]) -> None:
    root.mkdir(parents=True)
    first = ["tp_col.weight", "tp_row.weight", "norm.weight"]
    save_file({k: tensors[k] for k in first}, str(root / "s0.safetensors"))
    save_file({k: v for k, v in tensors.items() if k not in first}, str(root / "s1.safetensors"))
    weight_map = {k: "s0.safetensors" if k in first else "s1.safetensors" for k in tensors}
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _header_bytes(local: Path) -> int:
    total = (local / "model.safetensors.index.json").stat().st_size
    for f in local.glob("*.safetensors"):
        with open(f, "rb") as fh:
            total += 8 + int.from_bytes(fh.read(8), "little")
    return total


@pytest.fixture(scope="module")
def outcomes(s3_server: s3server.S3Server, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("s3dist")
    local, other = root / "ckpt", root / "other"
    _write(local, _tensors())
    _write(other, _tensors(seed=6))  # same names, shapes and sizes; other values (other ETags)
    url = s3_server.upload_dir(local, s3server.BUCKET, "dist")
    other_url = s3_server.upload_dir(other, s3server.BUCKET, "dist-other")
    with pytest.MonkeyPatch.context() as env:
        for name, value in s3_server.env(HPF_S3_URL=url, HPF_S3_OTHER=other_url, HPF_S3_LOCAL=str(local)).items():
            env.setenv(name, value)
        checks = [
            check_bit_exact_and_share,
            check_same_as_local_files,
            check_job_share_reads_each_byte_once,
            check_ranks_on_different_objects_raise,
        ]
        results = run_distributed(run_subchecks, 2, checks, timeout=300)
    return {"results": results, "headers": _header_bytes(local)}


def test_tp_fsdp_ep_bit_exact_and_each_rank_fetches_its_share(outcomes: dict[str, Any]) -> None:
    values = subcheck_values(outcomes["results"], "check_bit_exact_and_share")
    for rank, (bad, fetched, needed, total) in enumerate(values):
        assert bad == [], (rank, bad)
        assert needed < 0.7 * total, (rank, needed, total)  # a real share, not the whole checkpoint
        assert needed <= fetched <= 1.05 * needed + outcomes["headers"], (rank, fetched, needed)


def test_s3_load_equals_the_load_from_local_files(outcomes: dict[str, Any]) -> None:
    assert subcheck_values(outcomes["results"], "check_same_as_local_files") == [True, True]


def test_job_share_over_objects_fetches_each_byte_once(outcomes: dict[str, Any]) -> None:
    values = subcheck_values(outcomes["results"], "check_job_share_reads_each_byte_once")
    assert [bad for bad, _, _ in values] == [[], []]
    fetched = sum(f for _, f, _ in values)
    total = values[0][2]  # the tensors' bytes of the whole checkpoint
    assert all(f > 0 for _, f, _ in values), values  # both ranks read part of it
    assert total <= fetched <= total + 2 * outcomes["headers"], (fetched, total)


def test_ranks_on_different_objects_all_raise_mismatch(outcomes: dict[str, Any]) -> None:
    got = subcheck_values(outcomes["results"], "check_ranks_on_different_objects_raise")
    assert [g.split(":")[0] for g in got] == ["CheckpointMismatchError"] * 2, got
    assert all("s3://models/dist-other" in g for g in got), got
