"""PEFT adapters on sharded models: ``load_adapter`` reads peft's own adapter format into the local shards.

An adapter directory is what peft's ``save_pretrained`` writes: ``adapter_config.json`` and
``adapter_model.safetensors`` (keys without the adapter's name, ``modules_to_save`` copies under their module's
name). The keys are matched to the model's tensors by peft's own ``get_peft_model_state_dict`` (``model.peft``),
the config and the keys are checked against the model's adapter on every rank before any byte is read, and
the read is ``load``'s: each rank reads only the regions its shards hold. The base checkpoint of a PEFT model
goes through ``load`` itself; the adapter's export through ``save(..., adapter_only=True)``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from hp_fastload.api.load import load
from hp_fastload.dist.agree import agree, interrupts_between_steps
from hp_fastload.errors import AdapterMismatchError
from hp_fastload.formats import CONFIG_NAME
from hp_fastload.model.peft import (
    adapter_tensors,
    check_adapter_config,
    check_adapter_keys,
    init_adapter,
    is_peft_model,
    skeleton,
)
from hp_fastload.model.wrappers import unwrapped
from hp_fastload.planning.items import LoadReport
from hp_fastload.runtime import gc_paused
from hp_fastload.source.files import open_file

#: The file names of peft's adapter format (``peft.utils.constants``).
ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"


def resolve_adapter_dir(path: str | os.PathLike[str], revision: str | None = None) -> Path:
    """The local directory of an adapter: ``path`` itself, the directory of an ``adapter_model.safetensors``
    file, or a Hub repo (``owner/name``) downloaded (its two adapter files only) through huggingface_hub."""
    local = Path(os.fspath(path)).expanduser()
    if local.is_file():
        return local.parent
    if local.is_dir():
        return local
    text = os.fspath(path)
    parts = text.split("/")
    if len(parts) != 2 or not all(parts) or text.startswith((".", "~")) or os.path.isdir(parts[0]):
        raise FileNotFoundError(f"adapter not found: {local.absolute()} is not a file or a directory")
    from huggingface_hub import snapshot_download

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in {"1", "true", "yes", "on"}
    return Path(
        snapshot_download(
            repo_id=text,
            revision=revision,
            allow_patterns=[ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME],
            local_files_only=offline,
        )
    )


def read_adapter_config(directory: Path) -> dict[str, Any]:
    """``adapter_config.json`` of an adapter directory, as a dict (``FileNotFoundError`` naming it)."""
    config_path = directory / ADAPTER_CONFIG_NAME
    if not config_path.is_file():
        raise FileNotFoundError(f"no {ADAPTER_CONFIG_NAME} in {directory}: not a PEFT adapter directory")
    with open(config_path, encoding="utf-8") as f:
        config: dict[str, Any] = json.load(f)
    return config


@interrupts_between_steps()
@gc_paused()
def load_adapter(
    model: nn.Module,
    path: str | os.PathLike[str],
    adapter_name: str = "default",
    *,
    revision: str | None = None,
    loader: str | None = None,
    threads: int | None = None,
    backend: str | None = None,
    progress: bool | None = None,
) -> LoadReport:
    """Fill the adapter ``adapter_name`` of a PEFT model (``peft.get_peft_model``, sharded or not) from peft's
    own adapter format at ``path`` (a directory, its ``adapter_model.safetensors``, or a Hub repo id).

    The adapter's ``adapter_config.json`` must agree with the model's adapter on what shapes and scales the
    tensors (type, rank, alpha, target modules, ``modules_to_save``...), and its file must hold exactly the
    model's adapter tensors; both are checked on every rank before any byte is read
    (``AdapterMismatchError``, a ``TargetError``). Each rank reads only its shards' regions, as ``load`` does.
    Every rank of the default process group calls it together. Returns the ``LoadReport`` (keys as in the file).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"load_adapter() needs a live nn.Module to write into, got {type(model).__name__}")
    peft_model = unwrapped(model)
    if not is_peft_model(peft_model):
        raise TypeError(
            f"load_adapter() needs a PEFT model (peft.get_peft_model), got {type(peft_model).__name__}; "
            "a base checkpoint goes through hp_fastload.load"
        )
    directory = agree("Resolving the adapter", lambda: resolve_adapter_dir(path, revision))
    weights = directory / ADAPTER_WEIGHTS_NAME

    def checked() -> nn.Module:
        check_adapter_config(read_adapter_config(directory), peft_model, adapter_name, str(directory))
        if not weights.is_file():
            raise FileNotFoundError(f"no {ADAPTER_WEIGHTS_NAME} in {directory} (only safetensors adapters load)")
        tensors = adapter_tensors(peft_model, adapter_name)
        check_adapter_keys(open_file(weights).keys(), tensors, str(weights))
        return skeleton(tensors.items())

    view: nn.Module = agree("Checking the adapter against the model", checked)
    return load(
        view,
        weights,
        weights_mapping=[],
        strict=True,
        loader=loader,
        threads=threads,
        backend=backend,
        progress=progress,
        finalize=False,
    )


def adapter_only_repo(location: Any, path: str | os.PathLike[str], revision: str | None) -> Path | None:
    """The adapter directory when ``path`` (resolved to ``location``) holds a PEFT adapter and no model: no
    ``config.json`` but an ``adapter_config.json`` (fetched from the Hub for a repo id), else None."""
    if not isinstance(location, Path) or not location.is_dir() or (location / CONFIG_NAME).exists():
        return None
    if (location / ADAPTER_CONFIG_NAME).is_file():
        return location
    try:
        directory = resolve_adapter_dir(path, revision)
    except Exception:  # not an adapter repo either: from_pretrained's own config.json error follows
        return None
    return directory if (directory / ADAPTER_CONFIG_NAME).is_file() else None


def base_of_adapter(directory: Path) -> str:
    """The base model an adapter was trained on (``base_model_name_or_path`` of its config)."""
    base = read_adapter_config(directory).get("base_model_name_or_path")
    if not base:
        raise ValueError(
            f"the adapter at {directory} names no base model (base_model_name_or_path): pass the base checkpoint "
            "as the path and the adapter as adapter="
        )
    return str(base)


def peft_wrapper(
    peft_config: Any, adapter_dir: Path | None, adapter_name: str, is_trainable: bool
) -> Callable[[nn.Module], nn.Module]:
    """``get_peft_model`` of the meta model with ``peft_config``, or with the adapter's own config (trainable or
    not, as ``PeftModel.from_pretrained(is_trainable=...)``); the user's config object is not changed."""

    def wrap(model: nn.Module) -> nn.Module:
        from peft import PeftConfig, get_peft_model

        if peft_config is not None:
            config = copy.deepcopy(peft_config)
        else:
            assert adapter_dir is not None
            config = PeftConfig.from_pretrained(str(adapter_dir))
            config.inference_mode = not is_trainable
        return get_peft_model(model, config, adapter_name=adapter_name)

    return wrap


def fill_adapter(model: nn.Module, adapter_dir: Path | None, adapter_name: str, report: LoadReport) -> LoadReport:
    """After the base load of ``from_pretrained``: the adapter read from ``adapter_dir``, or (a fresh
    ``peft_config``) initialized as ``get_peft_model`` does on one process (``model.peft.init_adapter``)."""
    if adapter_dir is not None:
        load_adapter(model, adapter_dir, adapter_name)
    else:
        agree("Initializing the adapter", lambda: init_adapter(unwrapped(model), adapter_name))
    return dataclasses.replace(report, adapter_keys=())


__all__ = ["ADAPTER_CONFIG_NAME", "ADAPTER_WEIGHTS_NAME", "AdapterMismatchError", "load_adapter"]
