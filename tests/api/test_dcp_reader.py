"""hp_fastload's ``HuggingFaceStorageReader`` as a drop-in for torch's, under ``dcp.load`` (issue 4, item 3).

Both readers load the same state dict (sharded DTensors on 2 gloo ranks, as torchtitan builds it; plain
tensors without a process group) with ``torch.distributed.checkpoint.load`` and the default planner. The
results must be bit-identical to each other AND to ``distribute_tensor`` of the file's tensor (so two
readers that both did nothing cannot agree by accident). Cases: a single bf16 file read into fp32 and bf16
entries, a multi-file checkpoint, and a torch-sharded export (``DCP_SHARDING_INFO``) written by torch's own
``HuggingFaceStorageWriter(save_distributed=True)`` from the ranks. Our reader must serve each plan with one
engine call.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.bits import bits
from tests.helpers.dist import run_distributed, run_subchecks, subcheck_values

ROOT_ENV = "HPF_DCP_ROOT"

#: tensor name -> (shape, file dtype, state-dict dtype, placement kind on the 1-D mesh)
SPECS: dict[str, tuple[tuple[int, ...], torch.dtype, torch.dtype, str]] = {
    "embed.weight": ((11, 6), torch.bfloat16, torch.float32, "shard0"),  # cast bf16 -> fp32, uneven rows
    "layers.0.q.weight": ((8, 6), torch.bfloat16, torch.bfloat16, "shard1"),  # column shard: strided read
    "layers.0.experts": ((4, 5, 3), torch.bfloat16, torch.float32, "shard0"),
    "layers.0.norm.weight": ((7,), torch.float32, torch.float32, "replicate"),
    "layers.1.o.weight": ((6, 9), torch.float32, torch.bfloat16, "shard1"),  # cast fp32 -> bf16, uneven cols
    "lm_head.weight": ((13, 6), torch.float16, torch.float32, "shard0"),
}


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {name: torch.randn(*shape, generator=g).to(dt) for name, (shape, dt, _, _) in SPECS.items()}


def _write_single(root: Path) -> Path:
    path = root / "single"
    path.mkdir()
    save_file(_tensors(), str(path / "model.safetensors"))
    return path


def _write_multi(root: Path) -> Path:
    path = root / "multi"
    path.mkdir()
    tensors = _tensors()
    names = sorted(tensors)
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    for i, part in enumerate(halves, 1):
        save_file({k: tensors[k] for k in part}, str(path / f"model-{i:05d}-of-00002.safetensors"))
    return path


def _placements(kind: str) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    return {"shard0": [Shard(0)], "shard1": [Shard(1)], "replicate": [Replicate()]}[kind]


def _state_dict(mesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor import distribute_tensor

    out = {}
    for name, (shape, _, dt, kind) in SPECS.items():
        zeros = torch.zeros(shape, dtype=dt)
        out[name] = distribute_tensor(zeros, mesh, _placements(kind), src_data_rank=None) if mesh else zeros
    return out


def _local(t: Any) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _expected(full: dict[str, torch.Tensor], state: dict[str, Any]) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor, distribute_tensor

    out = {}
    for name, t in state.items():
        src = full[name].to(t.dtype)
        if isinstance(t, DTensor):
            out[name] = distribute_tensor(src, t.device_mesh, t.placements, src_data_rank=None).to_local()
        else:
            out[name] = src
    return out


def _load_both(path: str, mesh: Any, full: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Load with torch's reader and with ours; compare each against the other and against distribute_tensor."""
    import torch.distributed.checkpoint as dcp

    from hp_fastload.api.dcp import HuggingFaceStorageReader as OurReader

    theirs = _state_dict(mesh)
    ours = _state_dict(mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns when it runs dcp.load without a process group
        dcp.load(theirs, storage_reader=dcp.HuggingFaceStorageReader(path))
        reader = OurReader(path)
        dcp.load(ours, storage_reader=reader)
    expected = _expected(full, ours)
    differ = [n for n in ours if not torch.equal(bits(_local(ours[n])), bits(_local(theirs[n])))]
    wrong = [n for n in ours if not torch.equal(bits(_local(ours[n])), bits(expected[n]))]
    wrong_torch = [n for n in theirs if not torch.equal(bits(_local(theirs[n])), bits(expected[n]))]
    stats = reader.last_stats
    return {
        "ours_vs_torch": differ,
        "ours_vs_expected": wrong,
        "torch_vs_expected": wrong_torch,
        "engine_calls": None if stats is None else stats.engine_calls,
        "bytes_read": None if stats is None else stats.bytes_read,
    }


def _root() -> Path:
    return Path(os.environ[ROOT_ENV])


def _mesh(world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def check_single_file(rank: int, world: int) -> dict[str, Any]:
    return _load_both(str(_root() / "single"), _mesh(world), _tensors())


def check_multi_file(rank: int, world: int) -> dict[str, Any]:
    return _load_both(str(_root() / "multi"), _mesh(world), _tensors())


def check_torch_sharded_export(rank: int, world: int) -> dict[str, Any]:
    """Write a DCP_SHARDING_INFO export with torch's own writer from the ranks' shards, then read it back."""
    import json

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from torch.distributed.tensor import distribute_tensor

    mesh = _mesh(world)
    path = _root() / "torch_sharded"
    full = {name: t.to(SPECS[name][2]) for name, t in _tensors().items()}
    state = {
        name: distribute_tensor(t, mesh, _placements(SPECS[name][3]), src_data_rank=None) for name, t in full.items()
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.HuggingFaceStorageWriter(str(path), save_distributed=True))
    dist.barrier()
    files = sorted(path.glob("*.safetensors"))
    sharded = []
    for file in files:
        with safe_open(str(file), "pt") as f:
            info = json.loads((f.metadata() or {}).get("DCP_SHARDING_INFO", "{}"))
        sharded += [k for k, v in info.items() if any(int(o) for o in v["saved_offsets"])]
    result = _load_both(str(path), mesh, full)
    result["files"] = len(files)
    result["keys_with_nonzero_offsets"] = sorted(set(sharded))
    return result


# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dcp")
    _write_single(path)
    _write_multi(path)
    os.environ[ROOT_ENV] = str(path)
    return path


@pytest.fixture(scope="module")
def outcomes(root) -> list[dict[str, Any]]:
    checks = [check_single_file, check_multi_file, check_torch_sharded_export]
    return run_distributed(run_subchecks, 2, checks, timeout=240)


def _assert_same(values: list[dict[str, Any]]) -> None:
    for value in values:
        assert value["ours_vs_expected"] == [], value
        assert value["torch_vs_expected"] == [], value
        assert value["ours_vs_torch"] == [], value
        assert value["engine_calls"] == 1, value  # one batch per plan
        assert value["bytes_read"] > 0, value


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("check", ["check_single_file", "check_multi_file"])
def test_both_readers_agree_on_sharded_dtensors(root, outcomes, check):
    values = subcheck_values(outcomes, check)
    _assert_same(values)
    # each rank read its shards only (the replicated norm whole): less than the checkpoint's tensor bytes
    assert all(v["bytes_read"] < _tensor_bytes(root) for v in values), values


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_both_readers_agree_on_a_torch_sharded_export(outcomes):
    values = subcheck_values(outcomes, "check_torch_sharded_export")
    _assert_same(values)
    assert values[0]["files"] == 2  # one file per rank
    # the export really is sharded: rank 1's pieces start at non-zero offsets
    assert "embed.weight" in values[0]["keys_with_nonzero_offsets"]


def test_both_readers_agree_without_a_process_group(root):
    assert not torch.distributed.is_initialized()
    for name in ("single", "multi"):
        _assert_same([_load_both(str(root / name), None, _tensors())])


def _tensor_bytes(root: Path) -> int:
    return sum(t.numel() * t.element_size() for t in load_file(str(root / "single" / "model.safetensors")).values())


def test_without_a_process_group_every_byte_is_read_once(root):
    assert _load_both(str(root / "single"), None, _tensors())["bytes_read"] == _tensor_bytes(root)
