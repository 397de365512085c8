"""``hp_fastload.save`` failure paths on real gloo ranks and around the final rename.

Multi-rank: a failure on one rank inside the torch fallback (the only stage that runs collectives other than
the agreement: ``full_tensor`` per fallback group) must make every rank raise, not leave the ranks in
different collectives. One process: the publish step over an existing directory must never leave ``path``
without the user's directory, must make the new directory durable before the old one is deleted, and must
not report a failure once the new checkpoint is in place.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.dist import run_distributed, run_subchecks, subcheck_values
from tests.helpers.tiny_models import scale_mapping, tiny_model

save_mod = importlib.import_module("hp_fastload.api.save")

ROOT_ENV = "HPF_SAVE_FAULTS_ROOT"


def _siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}."))


FALLBACK_KEYS = ["model.layers.0.input_layernorm.weight", "model.norm.weight"]


def check_fallback_fault_on_rank0(rank: int, world: int) -> str:
    """FSDP2 llama with two fallback groups; rank 0's write of the first one fails (disk full)."""
    import hp_fastload as hf
    from tests.helpers.layouts import torch_fsdp

    model = tiny_model("llama")
    torch_fsdp(model, world)
    out = Path(os.environ[ROOT_ENV]) / "fallback-fault"
    real = save_mod.write_whole

    def failing(*args: Any) -> None:
        raise OSError(28, "No space left on device")

    if rank == 0:
        save_mod.write_whole = failing
    try:
        hf.save(model, out, weights_mapping=scale_mapping(FALLBACK_KEYS))
    except OSError as exc:
        return str(exc)
    finally:
        save_mod.write_whole = real
    return "no error"


def check_fallback_groups_differ(rank: int, world: int) -> str:
    """Rank 1 plans one fallback group more than rank 0 (as a rank whose plan differs would): both raise
    before writing, instead of rank 1 waiting in a gather rank 0 never joins."""
    import hp_fastload as hf
    from tests.helpers.layouts import torch_fsdp

    model = tiny_model("llama")
    torch_fsdp(model, world)
    out = Path(os.environ[ROOT_ENV]) / "fallback-differ"
    real = save_mod._fallback_groups

    def more(*planned: Any) -> Any:
        groups, names = real(*planned)
        return groups + groups[:1], names

    if rank == 1:
        save_mod._fallback_groups = more
    try:
        hf.save(model, out, weights_mapping=scale_mapping(FALLBACK_KEYS))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        save_mod._fallback_groups = real
    return "no error"


def check_fallbacks_on_two_ranks(rank: int, world: int) -> list[str]:
    """The same two fallback groups without a fault: both written (by rank 0), reported on every rank."""
    import hp_fastload as hf
    from tests.helpers.layouts import torch_fsdp

    model = tiny_model("llama")
    torch_fsdp(model, world)
    out = Path(os.environ[ROOT_ENV]) / "fallback-ok"
    return list(hf.save(model, out, weights_mapping=scale_mapping(FALLBACK_KEYS)).fallbacks)


def check_relative_path_per_cwd(rank: int, world: int) -> str:
    """Each rank in its own working directory, one relative ``path``: the ranks name different directories;
    every rank must raise (rank 0 created its files where rank 1 cannot see them) and leave nothing behind."""
    import hp_fastload as hf
    from tests.helpers.layouts import torch_fsdp

    model = tiny_model("llama")
    torch_fsdp(model, world)
    cwd = Path(os.environ[ROOT_ENV]) / f"cwd{rank}"
    cwd.mkdir()
    here = os.getcwd()
    os.chdir(cwd)
    try:
        hf.save(model, "out")
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        os.chdir(here)
    return "no error"


class Plain(torch.nn.Module):
    """Not a transformers model: a tied head, a persistent and a non-persistent buffer, no config."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(12, 8)
        self.block = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 12, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("steps", torch.arange(3))
        self.register_buffer("scratch", torch.ones(2), persistent=False)


def check_plain_module_fsdp(rank: int, world: int) -> list[int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import hp_fastload as hf

    model = Plain()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    out = Path(os.environ[ROOT_ENV]) / "plain"
    report = hf.save(model, out)
    return list(report.bytes_written_by_rank)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("save_faults")
    os.environ[ROOT_ENV] = str(path)  # spawned ranks inherit the environment
    return path


@pytest.fixture(scope="module")
def world2(root: Path) -> list[dict[str, Any]]:
    checks = [
        check_fallback_fault_on_rank0,
        check_fallback_groups_differ,
        check_fallbacks_on_two_ranks,
        check_relative_path_per_cwd,
        check_plain_module_fsdp,
    ]
    return run_distributed(run_subchecks, 2, checks, timeout=150)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_fallback_fault_on_one_rank_raises_everywhere(root: Path, world2: list[dict[str, Any]]) -> None:
    messages = subcheck_values(world2, "check_fallback_fault_on_rank0")
    assert "No space left on device" in messages[0]
    assert "rank 0" in messages[1] and "No space left on device" in messages[1]
    assert not (root / "fallback-fault").exists()
    assert [p.name for p in root.iterdir() if p.name.startswith(".fallback-fault")] == []


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_ranks_planning_different_fallbacks_raise_before_writing(root: Path, world2: list[dict[str, Any]]) -> None:
    messages = subcheck_values(world2, "check_fallback_groups_differ")
    assert all(m.startswith("PlanError") and "different tensors to convert with torch" in m for m in messages)
    assert not (root / "fallback-differ").exists()
    assert [p.name for p in root.iterdir() if p.name.startswith(".fallback-differ")] == []


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_fallbacks_on_two_ranks(root: Path, world2: list[dict[str, Any]]) -> None:
    from safetensors.torch import load_file

    assert subcheck_values(world2, "check_fallbacks_on_two_ranks") == [sorted(FALLBACK_KEYS)] * 2
    model = tiny_model("llama")
    out = root / "fallback-ok"
    saved: dict[str, torch.Tensor] = {}
    for file in out.glob("*.safetensors"):
        saved.update(load_file(file))
    for key in FALLBACK_KEYS:
        assert torch.equal(saved[key], model.get_parameter(key).detach() / 4.0)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_relative_path_in_different_working_directories(root: Path, world2: list[dict[str, Any]]) -> None:
    messages = subcheck_values(world2, "check_relative_path_per_cwd")
    assert all("working directory" in m and str(root / "cwd0" / "out") in m for m in messages), messages
    assert "rank 1" in messages[0]
    assert [sorted(p.name for p in (root / f"cwd{r}").iterdir()) for r in range(2)] == [[], []]


def _rank_skips_save(rank: int, world: int, path: str) -> str:
    import hp_fastload as hf

    if rank == 1:
        return "rank 1 went on without calling save"
    try:
        hf.save(tiny_model("llama"), path)
    except RuntimeError as exc:
        return str(exc)
    return "save returned"


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_rank_that_does_not_call_save_is_named_as_such(tmp_path: Path) -> None:
    """The waiting rank's error names save (it named load, which the ranks were not in)."""
    results = run_distributed(_rank_skips_save, 2, str(tmp_path / "out"), timeout=60)
    assert "rank 0 of 2 waited for the other ranks" in results[0], results[0]
    assert "must call hp_fastload.save together" in results[0] and "hp_fastload.load" not in results[0], results[0]
    assert not (tmp_path / "out").exists() and _siblings(tmp_path / "out") == []


# ---------------------------------------------------------------------------------------------------------
# Publishing over an existing directory (one process)


def _existing(tmp_path: Path) -> Path:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    return out


def test_failed_second_rename_puts_the_old_directory_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without RENAME_EXCHANGE the old directory is moved aside first; if moving the new one in fails, the
    user's directory is back at ``path`` (not left under a hidden name) and nothing else remains."""
    import hp_fastload as hf

    out = _existing(tmp_path)
    real = os.rename

    def rename(src: Any, dst: Any) -> None:
        if ".hp_save-" in os.fspath(src):
            raise OSError(5, "Input/output error")
        real(src, dst)

    monkeypatch.setattr(save_mod, "_exchange", lambda a, b: False)
    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="Input/output"):
        hf.save(tiny_model("llama"), out, overwrite=True)
    monkeypatch.undo()
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "mine"
    assert _siblings(out) == []


def test_failed_rename_over_an_empty_directory_keeps_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty directory at ``path`` is replaced by the rename itself, not removed first: a rename that
    fails leaves it (with its mode) where it was."""
    import hp_fastload as hf

    out = tmp_path / "out"
    out.mkdir(mode=0o750)
    real = os.rename

    def rename(src: Any, dst: Any) -> None:
        if ".hp_save-" in os.fspath(src):
            raise OSError(5, "Input/output error")
        real(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="Input/output"):
        hf.save(tiny_model("llama"), out)
    monkeypatch.undo()
    assert out.is_dir() and list(out.iterdir()) == [] and out.stat().st_mode & 0o777 == 0o750
    assert _siblings(out) == []
    hf.save(tiny_model("llama"), out)
    assert (out / "model.safetensors").exists() and _siblings(out) == []


@pytest.mark.parametrize("exchange", [True, False])
def test_new_directory_is_durable_before_the_old_one_is_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    import hp_fastload as hf

    out = _existing(tmp_path)
    events: list[tuple[str, str]] = []
    real_fsync_dir, real_rmtree = save_mod.fsync_dir, save_mod.shutil.rmtree

    def fsync_dir(path: Path) -> None:
        events.append(("fsync", os.fspath(path)))
        real_fsync_dir(path)

    def rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
        events.append(("rmtree", os.fspath(path)))
        real_rmtree(path, *args, **kwargs)

    if not exchange:
        monkeypatch.setattr(save_mod, "_exchange", lambda a, b: False)
    monkeypatch.setattr(save_mod, "fsync_dir", fsync_dir)
    monkeypatch.setattr(save_mod.shutil, "rmtree", rmtree)
    hf.save(tiny_model("llama"), out, overwrite=True)
    monkeypatch.undo()
    parent = events.index(("fsync", os.fspath(tmp_path)))
    removed = [i for i, (what, where) in enumerate(events) if what == "rmtree" and Path(where).parent == tmp_path]
    assert removed and all(parent < i for i in removed), events
    assert (out / "model.safetensors").exists() and _siblings(out) == []


def test_old_directory_that_cannot_be_removed_does_not_fail_the_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the new checkpoint is at ``path`` the save has succeeded: a previous directory that cannot be
    deleted is reported with a warning naming where it is, not raised (which would say nothing was saved)."""
    import hp_fastload as hf

    out = _existing(tmp_path)
    real = save_mod.shutil.rmtree

    def rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
        if (Path(path) / "keep.txt").exists():
            raise PermissionError(13, "Permission denied", os.fspath(path))
        real(path, *args, **kwargs)

    monkeypatch.setattr(save_mod.shutil, "rmtree", rmtree)
    with pytest.warns(UserWarning, match="previous directory"):
        report = hf.save(tiny_model("llama"), out, overwrite=True)
    monkeypatch.undo()
    assert report.files == ["model.safetensors"] and (out / "model.safetensors").exists()
    (left,) = _siblings(out)
    assert (tmp_path / left / "keep.txt").read_text() == "mine"


def test_a_symlink_at_path_is_refused_and_its_target_kept(tmp_path: Path) -> None:
    """A link to a directory is refused even with ``overwrite=True`` (the swap would replace the link, and the
    old "directory" to delete would be the link), with a message that says it is a link and where it points."""
    import hp_fastload as hf

    real = _existing(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    with pytest.raises(FileExistsError, match=r"symbolic link \(to .*out\).*points to"):
        hf.save(tiny_model("llama"), link, overwrite=True)
    assert link.is_symlink() and sorted(p.name for p in real.iterdir()) == ["keep.txt"]
    assert _siblings(link) == [] and _siblings(real) == []


def _plain_reference(tmp_path: Path) -> dict[str, torch.Tensor]:
    """What safetensors' own ``save_model`` keeps of :class:`Plain` (aliases dropped), read back."""
    from safetensors.torch import load_file, save_model

    save_model(Plain(), str(tmp_path / "ref.safetensors"))
    return load_file(tmp_path / "ref.safetensors")


def _assert_plain_export(out: Path, ref: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import load_file

    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]  # no config: none to write
    got = load_file(out / "model.safetensors")
    assert sorted(got) == sorted(ref) == ["block.bias", "block.weight", "emb.weight", "steps"]
    assert all(got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]) for k in ref)


def test_plain_module_saves_what_save_model_keeps(tmp_path: Path) -> None:
    """A module that is not a transformers model: its persistent state dict, one name per tied tensor (the
    one safetensors' ``save_model`` keeps), no config files; ``load`` restores it with the tie kept."""
    import hp_fastload as hf

    ref = _plain_reference(tmp_path)
    hf.save(Plain(), tmp_path / "out")
    _assert_plain_export(tmp_path / "out", ref)
    fresh = Plain()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    hf.load(fresh, tmp_path / "out")
    assert torch.equal(fresh.emb.weight, ref["emb.weight"]) and fresh.head.weight is fresh.emb.weight


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_plain_module_under_fsdp2(root: Path, world2: list[dict[str, Any]], tmp_path: Path) -> None:
    by_rank = subcheck_values(world2, "check_plain_module_fsdp")
    ref = _plain_reference(tmp_path)
    assert by_rank[0] == by_rank[1] and min(by_rank[0]) > 0, by_rank  # FSDP2 shards: both ranks write
    assert sum(by_rank[0]) == sum(t.numel() * t.element_size() for t in ref.values())
    _assert_plain_export(root / "plain", ref)


def test_every_safetensors_dtype_is_saved_as_safetensors_saves_it(tmp_path: Path) -> None:
    """Buffers of every dtype safetensors' torch API writes (unsigned, complex and fnuz float8 included):
    the file equals safetensors' own ``save_file`` with ``{"format": "pt"}`` metadata byte for byte (header
    order is by dtype, so a dtype missing from save's order table misplaces data)."""
    from safetensors.torch import save_file

    import hp_fastload as hf

    names = ["bool", "uint8", "int8", "float8_e5m2", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2fnuz"]
    names += ["int16", "uint16", "float16", "bfloat16", "int32", "uint32", "float32", "complex64", "float64"]
    names += ["int64", "uint64"]
    module = torch.nn.Module()
    for i, name in enumerate(names):
        raw = torch.arange(8 * (i + 1), dtype=torch.uint8).reshape(-1)[: 8 * 2]
        module.register_buffer(f"b_{i:02d}", raw.view(getattr(torch, name))[: 16 // getattr(torch, name).itemsize])
    hf.save(module, tmp_path / "out")
    save_file(dict(module.state_dict()), str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
