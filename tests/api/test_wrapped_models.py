"""Loading into wrapped models, ``from_pretrained``'s choices, and what a hostile checkpoint directory gets.

- ``load`` into a model wrapped by ``torch.compile`` (``_orig_mod.``) or ``DistributedDataParallel``
  (``module.``): the wrapped module's names and default rules (gpt_neox's ``embed_out`` -> ``lm_head``), values
  equal to transformers' own ``from_pretrained``.
- blocks wrapped as torchtitan does (activation checkpointing, ``torch.compile``, ``fully_shard`` per block):
  target names without ``_checkpoint_wrapped_module`` / ``_orig_mod``, values and buffers equal to
  ``from_pretrained``'s, on one process and on 2 gloo ranks.
- ``from_pretrained`` on 2 gloo ranks: a rank whose directory has no ``config.json`` makes every rank raise
  ``FileNotFoundError`` naming it; ranks whose ``config.json`` differ (same safetensors) all raise
  ``CheckpointMismatchError``.
- ``from_pretrained``'s default dtype is transformers' ``"auto"`` (a config without one: the index's
  ``metadata.dtype``, else the weights'), a bad index is a ``HeaderError`` naming it, and with ``strict=False``
  what the checkpoint lacks is initialized as transformers does, not left as ``to_empty``'s bytes.
- ``hp-fastload plan`` with a FIFO ``config.json`` or a config transformers rejects (with its own exception
  types) ends with one error line; a checkpoint path that is a FIFO is refused as such, not looked up on the
  Hub; terminal escapes in a missing shard's name or a file name are escaped in the error and the CLI's line; a
  huge shard name is cut in the error.
- Symlinks inside a checkpoint: a symlinked shard directory loads, a link to ``/dev/zero`` is refused unopened.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import hp_fastload as hf
from hp_fastload.source.index import CheckpointIndex
from hp_fastload.source.location import resolve_checkpoint_location
from tests.helpers.checkpoints import run_child, write_sharded_pair
from tests.helpers.dist import run_distributed, run_subchecks, subcheck_values
from tests.helpers.tiny_models import randomized, root_rule_class, root_rule_config

ROOT_ENV = "HPF_PROLOGUE_REVIEW_ROOT"


def _meta_built() -> Any:
    with torch.device("meta"):
        model = root_rule_class("gpt_neox")(root_rule_config("gpt_neox"))
    model.to_empty(device="cpu")
    return model.float()


def _state(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def neox(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A gpt_neox checkpoint (class-level rename ``embed_out`` -> ``lm_head``) and from_pretrained's values."""
    path = tmp_path_factory.mktemp("neox")
    torch.manual_seed(0)
    randomized(root_rule_class("gpt_neox")(root_rule_config("gpt_neox")).float()).save_pretrained(path)
    return path, _state(root_rule_class("gpt_neox").from_pretrained(path, dtype=torch.float32))


def test_load_into_a_torch_compiled_model(neox):
    path, expected = neox
    model = _meta_built()
    report = hf.load(torch.compile(model), path)  # never called: nothing is compiled
    assert report.missing_keys == () and report.unexpected_keys == ()
    got = _state(model)
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


def _wrap_blocks(model: Any, shard: bool = False) -> Any:
    """torchtitan's order on every decoder block: activation checkpointing, then ``torch.compile`` (never run
    here, so nothing is compiled), then ``fully_shard`` with ``shard``; the root last."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    layers = model.gpt_neox.layers
    for i, layer in enumerate(layers):
        block = torch.compile(checkpoint_wrapper(layer))
        if shard:
            from torch.distributed.fsdp import fully_shard

            fully_shard(block)
        layers.register_module(str(i), block)
    if shard:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    return model


def _buffers(model: Any) -> dict[str, torch.Tensor]:
    from hp_fastload.model.finalize import non_persistent_buffers

    return {name: b.detach().clone() for name, b in non_persistent_buffers(model)}


def _full_state(model: Any) -> dict[str, torch.Tensor]:
    from hp_fastload.model.targets import build_targets

    out = {}
    for name, target in build_targets(model).items():
        t = target.tensor.detach()
        out[name] = (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
    return out


@pytest.fixture(scope="module")
def neox_buffers(neox) -> dict[str, torch.Tensor]:
    return _buffers(root_rule_class("gpt_neox").from_pretrained(neox[0], dtype=torch.float32))


def test_load_into_compiled_and_checkpointed_blocks(neox, neox_buffers):
    path, expected = neox
    with torch.device("meta"):
        model = _wrap_blocks(root_rule_class("gpt_neox")(root_rule_config("gpt_neox")).float())
    model.to_empty(device="cpu")
    report = hf.load(model, path)
    assert report.missing_keys == () and report.unfilled_buffers == ()
    got = _full_state(model)
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    buffers = _buffers(model)
    assert sorted(buffers) == sorted(neox_buffers)
    for key, value in neox_buffers.items():
        assert torch.equal(buffers[key], value), key


# ---------------------------------------------------------------------------------------------------------
# 2 gloo ranks


def _root() -> Path:
    return Path(os.environ[ROOT_ENV])


def check_ddp_load(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    from torch.nn.parallel import DistributedDataParallel

    model = _meta_built()
    report = hf.load(DistributedDataParallel(model), _root() / "neox")
    assert report.missing_keys == (), report.missing_keys
    return _state(model)


def check_torchtitan_style_blocks(
    rank: int, world_size: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    with torch.device("meta"):
        model = _wrap_blocks(root_rule_class("gpt_neox")(root_rule_config("gpt_neox")).float(), shard=True)
    model.to_empty(device="cpu")
    report = hf.load(model, _root() / "neox")
    assert report.missing_keys == () and report.unfilled_buffers == (), report.summary()
    return _full_state(model), _buffers(model)


def check_config_missing_on_one_rank(rank: int, world_size: int) -> list[str]:
    path = _root() / ("neox" if rank == 0 else "neox_no_config")
    try:
        hf.from_pretrained(path, parallelize=lambda m: m)
    except Exception as exc:
        return [type(exc).__name__, str(exc)]
    return ["no error", ""]


def check_configs_differ(rank: int, world_size: int) -> list[str]:
    path = _root() / ("neox" if rank == 0 else "neox_other_config")
    try:
        hf.from_pretrained(path)
    except Exception as exc:
        return [type(exc).__name__, str(exc)]
    return ["no error", ""]


CHECKS = [check_ddp_load, check_torchtitan_style_blocks, check_configs_differ, check_config_missing_on_one_rank]


@pytest.fixture(scope="module")
def two_ranks(neox, tmp_path_factory) -> list[Any]:
    path, _ = neox
    root = tmp_path_factory.mktemp("ranks")
    shutil.copytree(path, root / "neox")
    shutil.copytree(path, root / "neox_no_config")
    (root / "neox_no_config" / "config.json").unlink()
    shutil.copytree(path, root / "neox_other_config")
    config = json.loads((path / "config.json").read_text())
    config["layer_norm_eps"] = 1e-3  # same tensors, another model
    (root / "neox_other_config" / "config.json").write_text(json.dumps(config))
    os.environ[ROOT_ENV] = str(root)
    try:
        return run_distributed(run_subchecks, 2, checks=CHECKS, timeout=240)
    finally:
        os.environ.pop(ROOT_ENV, None)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_load_into_a_ddp_wrapped_model(two_ranks, neox):
    _, expected = neox
    for got in subcheck_values(two_ranks, "check_ddp_load"):
        assert sorted(got) == sorted(expected)
        for key, value in expected.items():
            assert torch.equal(got[key], value), key


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_load_into_fsdp2_compiled_and_checkpointed_blocks(two_ranks, neox, neox_buffers):
    _, expected = neox
    for got, buffers in subcheck_values(two_ranks, "check_torchtitan_style_blocks"):
        assert sorted(got) == sorted(expected)
        for key, value in expected.items():
            assert torch.equal(got[key], value), key
        assert sorted(buffers) == sorted(neox_buffers)
        for key, value in neox_buffers.items():
            assert torch.equal(buffers[key], value), key


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_from_pretrained_config_missing_on_one_rank_raises_on_every_rank(two_ranks):
    outcomes = subcheck_values(two_ranks, "check_config_missing_on_one_rank")
    for rank, (kind, message) in enumerate(outcomes):
        assert kind == "FileNotFoundError", (rank, kind, message)
        assert "neox_no_config/config.json does not exist" in message, (rank, message)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_from_pretrained_ranks_with_different_configs_all_raise(two_ranks):
    for kind, message in subcheck_values(two_ranks, "check_configs_differ"):
        assert kind == "CheckpointMismatchError", (kind, message)
        assert "rank 1's differs from rank 0's" in message


# ---------------------------------------------------------------------------------------------------------
# FIFOs and escapes


def _plan_error(ckpt: Path) -> str:
    """The one line ``hp-fastload plan CKPT`` writes to stderr (run in a child: a hang fails the test)."""
    done = run_child(
        f"""
        import sys
        from hp_fastload.cli import main
        sys.exit(main(["plan", {str(ckpt)!r}, "--world", "2", "--layout", "fsdp"]))
        """,
        timeout=120,
    )
    assert done.returncode == 1, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_plan_with_a_fifo_config_ends_with_one_line(neox, tmp_path):
    path, _ = neox
    ckpt = tmp_path / "ckpt"
    shutil.copytree(path, ckpt)
    (ckpt / "config.json").unlink()
    os.mkfifo(ckpt / "config.json")
    assert "config.json is a FIFO, socket or device" in _plan_error(ckpt)


def test_a_fifo_checkpoint_path_is_refused_as_such(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.mkfifo("ckpt")  # a bare name: would otherwise be taken for a Hub repo id
    with pytest.raises(FileNotFoundError, match="is a FIFO, socket or device"):
        resolve_checkpoint_location("ckpt")


def test_escapes_in_a_missing_shard_name_are_not_echoed(tmp_path):
    name = "\x1b]0;owned\x07\x1b[2J.safetensors"
    ckpt = write_sharded_pair(tmp_path / "ckpt", bias_file=name)
    with pytest.raises(FileNotFoundError) as caught:
        CheckpointIndex.open(ckpt)
    assert "\x1b" not in str(caught.value) and "\\x1b" in str(caught.value)


def test_cli_errors_escape_what_comes_from_the_files(tmp_path):
    bad = tmp_path / "\x1b]0;owned\x07\x1b[2J.safetensors"
    bad.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{\x1b[31m}")  # a header that is no JSON
    done = run_child(
        f"""
        import sys
        from hp_fastload.cli import main
        sys.exit(main(["inspect", {str(tmp_path)!r}]))
        """
    )
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "\x1b" not in done.stderr and "\x07" not in done.stderr, done.stderr
    assert "\\x1b]0;owned\\x07" in done.stderr, done.stderr


@pytest.mark.parametrize(
    "fields",
    [{"num_attention_heads": 0}, {"hidden_size": "x"}],
    ids=["zero_heads", "str_size"],
)
def test_plan_with_a_bad_config_ends_with_one_line(neox, tmp_path, fields):
    path, _ = neox
    ckpt = tmp_path / "ckpt"
    shutil.copytree(path, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, **fields}))
    assert _plan_error(ckpt).startswith("hp-fastload plan: error: ")


@pytest.mark.parametrize("field", ["dtype", "torch_dtype", None])
def test_from_pretrained_dtype_is_transformers_auto(tmp_path, field):
    """A config that names no dtype: transformers takes the weights' (bf16 here), not float32."""
    from transformers import AutoModelForCausalLM

    from tests.helpers.tiny_models import TINY_DECODER, config_of

    torch.manual_seed(0)
    randomized(AutoModelForCausalLM.from_config(config_of("llama", **TINY_DECODER))).to(torch.bfloat16).save_pretrained(
        tmp_path
    )
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("dtype", None)
    if field is not None:
        config[field] = "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps(config))
    reference = AutoModelForCausalLM.from_pretrained(tmp_path)
    model = hf.from_pretrained(tmp_path)
    assert reference.dtype == model.dtype == torch.bfloat16
    expected, got = reference.state_dict(), model.state_dict()
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def _sharded_bf16_without_config_dtype(path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from tests.helpers.tiny_models import TINY_DECODER, config_of

    torch.manual_seed(0)
    model = randomized(AutoModelForCausalLM.from_config(config_of("llama", **TINY_DECODER))).to(torch.bfloat16)
    model.save_pretrained(path, max_shard_size="4KB")
    config = json.loads((path / "config.json").read_text())
    config.pop("dtype", None)
    (path / "config.json").write_text(json.dumps(config))


def test_from_pretrained_dtype_from_the_index_metadata_is_transformers_auto(tmp_path):
    """A config that names no dtype, an index whose ``metadata.dtype`` does: transformers takes that one."""
    from transformers import AutoModelForCausalLM

    _sharded_bf16_without_config_dtype(tmp_path)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["metadata"]["dtype"] = "float16"
    index_path.write_text(json.dumps(index))
    reference = AutoModelForCausalLM.from_pretrained(tmp_path)
    model = hf.from_pretrained(tmp_path)
    assert reference.dtype == model.dtype == torch.float16
    expected, got = reference.state_dict(), model.state_dict()
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def test_from_pretrained_with_a_bad_index_names_it(tmp_path):
    """An index that is not JSON: a ``HeaderError`` naming it (transformers' own read raises ``JSONDecodeError``)."""
    _sharded_bf16_without_config_dtype(tmp_path)
    index_path = tmp_path / "model.safetensors.index.json"
    index_path.write_text(index_path.read_text()[:-5])
    with pytest.raises(hf.HeaderError, match="failed to read safetensors index") as raised:
        hf.from_pretrained(tmp_path)
    assert str(index_path) in str(raised.value)


def test_symlinks_inside_a_checkpoint_are_followed_to_regular_files_only(tmp_path):
    """The documented rule (design notes): a shard reached through a symlinked directory loads; a name that
    leads to a device through a link is refused unopened (it would read forever)."""
    outside = write_sharded_pair(tmp_path / "outside")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "shards").symlink_to(outside, target_is_directory=True)
    index = json.loads((outside / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: f"shards/{v}" for k, v in index["weight_map"].items()}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    assert sorted(CheckpointIndex.open(ckpt).keys()) == ["lin.bias", "lin.weight"]
    (ckpt / "zero.safetensors").symlink_to("/dev/zero")
    index["weight_map"]["lin.bias"] = "zero.safetensors"
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    done = run_child(
        f"""
        from hp_fastload.source.index import CheckpointIndex
        try:
            CheckpointIndex.open({str(ckpt)!r})
        except Exception as exc:
            print(type(exc).__name__, exc)
        """,
        timeout=60,
    )
    assert done.stdout.startswith("HeaderError") and "not a regular file" in done.stdout, (done.stdout, done.stderr)


def test_from_pretrained_strict_false_initializes_what_the_checkpoint_lacks(tmp_path):
    """transformers initializes a missing key through the model's init (an RMSNorm weight: ones); a model
    fresh from to_empty must not keep the allocator's bytes there."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from tests.helpers.tiny_models import TINY_DECODER, config_of

    model = randomized(AutoModelForCausalLM.from_config(config_of("llama", **TINY_DECODER)))
    model.config.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "model.norm.weight"}
    save_file(state, tmp_path / "model.safetensors")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path)
    loaded, report = hf.from_pretrained(tmp_path, strict=False, output_loading_info=True)
    assert report.missing_keys == ("model.norm.weight",)
    assert torch.equal(loaded.model.norm.weight, reference.model.norm.weight)
    assert torch.equal(loaded.model.norm.weight, torch.ones(16))
    for key, value in state.items():  # what the checkpoint held is untouched
        assert torch.equal(loaded.state_dict()[key], value), key


def test_a_huge_shard_name_is_cut_in_the_error(tmp_path):
    ckpt = write_sharded_pair(tmp_path / "ckpt", bias_file="\x1b[2J" + "b" * 100_000 + ".safetensors")
    with pytest.raises(hf.HeaderError) as caught:
        CheckpointIndex.open(ckpt)
    message = str(caught.value)
    assert len(message) < 1000 and "(100016 characters)" in message and "\x1b" not in message, message[:300]
