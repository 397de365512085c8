"""``hp_fastload.save`` on real gloo ranks: FSDP2 (root wrapped), TP, EP, TP+FSDP on two meshes, a 2-D mesh.

The parent writes each family's checkpoint with transformers' ``save_pretrained`` (bf16) and the reference
export: the same checkpoint loaded into one process (``hp_fastload.load``) and written by
``save_pretrained``. On the ranks, each layout is built by torch (``fully_shard`` / ``parallelize_module`` /
``distribute_tensor``), loaded, and saved with ``hp_fastload.save``; the output directory must equal the
reference byte for byte (shards, index, config), every data byte must be written by exactly one rank, the
collectives must carry no tensor data, and loading the export back must give the same local shards. A fault
injected on one rank must make every rank raise and leave nothing at ``path``.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers.dist import run_distributed, run_subchecks, subcheck_values
from tests.helpers.layouts import torch_demo, torch_fsdp, torch_tp
from tests.helpers.tiny_models import FAMILIES as TINY
from tests.helpers.tiny_models import model_class, tiny_model

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

ROOT_ENV = "HPF_SAVE_ROOT"
SHARD = 4000
#: "llama_odd": llama with 63 vocab rows and a 25-wide MLP, so that FSDP2 and TP shards are uneven on 2 ranks
ODD = {"llama_odd": ("llama", dict(vocab_size=63, intermediate_size=25))}
FAMILIES = ["mixtral", "qwen3_moe", "phi3", "llama", "llama_odd", "deepseek_v3", "gpt_oss", "qwen3_vl_moe"]
LAYOUTS_2 = ["fsdp", "tp", "ep", "tp_fsdp"]
#: demo.parallelize expects causal-LM layers at model.model.layers
NOT_BUILDABLE = {("qwen3_vl_moe", "tp_fsdp")}
COMBOS_2 = [(f, lay) for f in FAMILIES for lay in LAYOUTS_2 if (f, lay) not in NOT_BUILDABLE]
FAMILIES_4 = ["llama", "mixtral", "qwen3_moe", "phi3", "deepseek_v3", "gpt_oss"]
#: 4 ranks: the (dp=2, tp=2) mesh for every family, and FSDP2 / EP on 4 (one expert per rank)
COMBOS_4 = [(f, "2d") for f in FAMILIES_4] + [(f, lay) for f in ("mixtral", "gpt_oss") for lay in ("fsdp", "ep")]


def _torch_ep(model: nn.Module, world: int) -> None:
    """Expert parallel: stacked experts split on the expert dim, everything else a Replicate DTensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    for name, module in model.named_modules():
        for pname, param in list(module._parameters.items()):
            if param is None:
                continue
            placement = Shard(0) if param.ndim == 3 and "experts" in name else Replicate()
            dt = distribute_tensor(param.data, mesh, [placement], src_data_rank=None)
            module.register_parameter(pname, nn.Parameter(dt, requires_grad=param.requires_grad))


_BUILDERS = {"fsdp": torch_fsdp, "tp": torch_tp, "ep": _torch_ep, "tp_fsdp": torch_demo, "2d": torch_demo}


def _config(family: str) -> Any:
    from transformers import AutoConfig

    base, extra = ODD.get(family, (family, {}))
    return AutoConfig.for_model(base, **{**TINY[base], **extra})


def _new_model(family: str, meta: bool) -> Any:
    """The family's model, on meta or initialized (every tensor random, as tiny_models does)."""
    base = ODD.get(family, (family, {}))[0]
    if not meta and family not in ODD:
        return tiny_model(family)
    cls = model_class(base)
    with torch.device("meta") if meta else contextlib.nullcontext():
        if cls.__name__.startswith("Auto"):
            model = cls.from_config(_config(family), dtype=torch.bfloat16 if meta else None)
        else:
            model = cls._from_config(_config(family), dtype=torch.bfloat16 if meta else None)
    if not meta:
        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p))
    return model


def _build(family: str, layout: str, world: int) -> nn.Module:
    model = _new_model(family, meta=True)
    _BUILDERS[layout](model, world)
    model.to_empty(device="cpu")
    return model


class _Counter:
    """Wraps the torch.distributed calls save uses; counts the bytes they carry (objects pickled)."""

    OBJECT_CALLS = ("all_gather_object", "broadcast_object_list")
    TENSOR_CALLS = ("all_gather", "all_gather_into_tensor", "broadcast", "all_reduce", "reduce_scatter_tensor")

    def __init__(self) -> None:
        self.bytes = 0
        self.calls = 0
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> _Counter:
        dist = torch.distributed
        for name in self.OBJECT_CALLS + self.TENSOR_CALLS:
            real = getattr(dist, name)
            self._saved[name] = real

            def wrapped(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
                self.calls += 1
                if _name == "all_gather_object":  # this rank's object, received by every rank
                    self.bytes += len(pickle.dumps(args[1])) * torch.distributed.get_world_size()
                elif _name == "broadcast_object_list":
                    self.bytes += sum(len(pickle.dumps(o)) for o in args[0])
                else:
                    tensors = [a for a in args if isinstance(a, torch.Tensor)]
                    for a in args:
                        if isinstance(a, list):
                            tensors.extend(t for t in a if isinstance(t, torch.Tensor))
                    self.bytes += sum(t.numel() * t.element_size() for t in tensors)
                return _real(*args, **kwargs)

            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, real in self._saved.items():
            setattr(torch.distributed, name, real)


def _locals(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in model.state_dict().items():
        local = value.to_local() if hasattr(value, "to_local") else value
        out[name] = local.detach().clone()
    return out


def _save_layouts(rank: int, world: int, combos: list[tuple[str, str]]) -> dict[str, Any]:
    os.environ.update(LOCAL_WORLD_SIZE=str(world))
    root = Path(os.environ[ROOT_ENV])
    results: dict[str, Any] = {}
    for family, layout in combos:
        try:
            results[f"{family}/{layout}"] = _save_one(root, family, layout, world)
        except Exception as exc:  # every rank raises together (save agrees); the next combo still runs
            results[f"{family}/{layout}"] = {"error": f"{type(exc).__name__}: {exc}"}
        torch.distributed.barrier()
    return results


def _save_one(root: Path, family: str, layout: str, world: int) -> dict[str, Any]:
    import hp_fastload as hf

    model = _build(family, layout, world)
    hf.load(model, root / "src" / family)
    before = _locals(model)
    out = root / f"out-{world}" / f"{family}-{layout}"
    with _Counter() as counter:
        report = hf.save(model, out, max_shard_size=SHARD)
    for value in model.state_dict().values():  # zero, then load the export back
        with torch.no_grad():
            (value.to_local() if hasattr(value, "to_local") else value).zero_()
    hf.load(model, out)
    after = _locals(model)
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    return {
        "bytes_written": report.bytes_written,
        "by_rank": report.bytes_written_by_rank,
        "fallbacks": report.fallbacks,
        "collective_bytes": counter.bytes,
        "collective_calls": counter.calls,
        "round_trip_changed": changed,
        "path": str(out),
    }


def check_layouts(rank: int, world: int) -> dict[str, Any]:
    return _save_layouts(rank, world, COMBOS_2)


def check_fault_on_one_rank(rank: int, world: int) -> str:
    """Rank 1's writes fail after reaching the files: every rank raises, naming rank 1; nothing at path."""
    import hp_fastload as hf

    write_mod = importlib.import_module("hp_fastload.execute.write")
    model = _build("mixtral", "fsdp", world)
    hf.load(model, Path(os.environ[ROOT_ENV]) / "src" / "mixtral")
    out = Path(os.environ[ROOT_ENV]) / "fault"
    real = write_mod.write_batch

    def failing(batch: Any, threads: Any, stats: Any) -> None:
        real(batch, threads, stats)
        raise OSError(28, "No space left on device")

    if rank == 1:
        write_mod.write_batch = failing
    try:
        hf.save(model, out)
    except OSError as exc:
        return str(exc)
    finally:
        write_mod.write_batch = real
    return "no error"


def check_overwrite_refused(rank: int, world: int) -> str:
    import hp_fastload as hf

    out = Path(os.environ[ROOT_ENV]) / "existing"
    if rank == 0:
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    torch.distributed.barrier()
    model = _build("llama", "fsdp", world)
    try:
        hf.save(model, out)
    except FileExistsError as exc:
        return str(exc)
    return "no error"


def _write_inputs(root: Path, families: list[str]) -> None:
    """Each family's checkpoint (transformers, bf16) and its reference export (one process: hp_fastload.load,
    then transformers' save_pretrained)."""
    import hp_fastload as hf

    for family in families:
        if (root / "ref" / family).exists():
            continue
        _new_model(family, meta=False).to(torch.bfloat16).save_pretrained(root / "src" / family, max_shard_size=SHARD)
        model = _new_model(family, meta=True)
        model.to_empty(device="cpu")
        model.tie_weights()
        hf.load(model, root / "src" / family)
        model.save_pretrained(root / "ref" / family, max_shard_size=SHARD)


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def _data_bytes(root: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in root.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                t = f.get_slice(key)
                total += int(torch.tensor(t.get_shape()).prod()) * {"BF16": 2, "F32": 4}[t.get_dtype()]
    return total


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("save_dist")
    _write_inputs(path, sorted(set(FAMILIES) | set(FAMILIES_4)))
    os.environ[ROOT_ENV] = str(path)  # spawned ranks inherit the environment
    return path


@pytest.fixture(scope="module")
def world2(root: Path) -> list[dict[str, Any]]:
    checks = [check_layouts, check_fault_on_one_rank, check_overwrite_refused]
    return run_distributed(run_subchecks, 2, checks, timeout=500)


def _check_combo(root: Path, per_rank: list[dict[str, Any]], key: str, world: int) -> None:
    family = key.split("/")[0]
    results = [r[key] for r in per_rank]
    assert all("error" not in r for r in results), [r.get("error") for r in results]
    out = Path(results[0]["path"])
    ref, got = _files(root / "ref" / family), _files(out)
    assert sorted(ref) == sorted(got)
    assert [name for name in ref if ref[name] != got[name]] == [], "files differ from save_pretrained's"
    data = _data_bytes(out)
    by_rank = results[0]["by_rank"]
    assert [r["bytes_written"] for r in results] == by_rank
    assert sum(by_rank) == data, "every data byte is written by exactly one rank"
    assert all(r["fallbacks"] == [] for r in results)
    collective = max(r["collective_bytes"] for r in results)
    assert collective < data / 20, f"collectives carried {collective} bytes for {data} bytes of tensors"
    assert all(r["round_trip_changed"] == [] for r in results)
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize(("family", "layout"), COMBOS_2)
def test_save_on_two_ranks(root: Path, world2: list[dict[str, Any]], family: str, layout: str) -> None:
    per_rank = subcheck_values(world2, "check_layouts")
    _check_combo(root, per_rank, f"{family}/{layout}", 2)
    if layout == "fsdp":  # FSDP2 on dim 0: each rank writes about half
        by_rank = per_rank[0][f"{family}/{layout}"]["by_rank"]
        assert min(by_rank) > 0.3 * sum(by_rank)


def test_fault_on_one_rank_leaves_nothing(root: Path, world2: list[dict[str, Any]]) -> None:
    messages = subcheck_values(world2, "check_fault_on_one_rank")
    assert "No space left on device" in messages[1]
    assert "rank 1" in messages[0] and "No space left on device" in messages[0]
    assert not (root / "fault").exists()
    assert [p.name for p in root.iterdir() if p.name.startswith(".fault")] == []


def test_overwrite_refused_on_every_rank(root: Path, world2: list[dict[str, Any]]) -> None:
    messages = subcheck_values(world2, "check_overwrite_refused")
    assert all("overwrite=True" in m for m in messages)
    assert _files(root / "existing") == {"keep.txt": b"mine"}


def check_layouts_2d(rank: int, world: int) -> dict[str, Any]:
    return _save_layouts(rank, world, COMBOS_4)


@pytest.fixture(scope="module")
def world4(root: Path) -> list[dict[str, Any]]:
    return subcheck_values(run_distributed(run_subchecks, 4, [check_layouts_2d], timeout=500), "check_layouts_2d")


@pytest.mark.parametrize(("family", "layout"), COMBOS_4)
def test_save_on_four_ranks(root: Path, world4: list[dict[str, Any]], family: str, layout: str) -> None:
    """demo.parallelize on 4 ranks ("2d"): a (dp=2, tp=2) mesh, attention TP inside FSDP2; FSDP2 and EP on 4."""
    _check_combo(root, world4, f"{family}/{layout}", 4)
