"""Side files of a checkpoint, read once: ``config.json`` through ``AutoConfig`` and its ``quantization_config`` (a
FIFO or socket in its place is refused, never read); from object storage, the ``config.json`` object.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

from hp_fastload.errors import HeaderError
from hp_fastload.formats import CONFIG_NAME
from hp_fastload.source.objstore import ObjectLocation, is_object_url, read_side_object


def read_config_json(directory: str | Path) -> dict[str, Any] | None:
    """``directory/config.json`` as a dict, or None when there is none, it cannot be read or it is not a JSON
    object. A FIFO or socket there raises ``HeaderError`` (refused, never read). ``directory`` may be an
    ``s3://`` folder URL (the ``config.json`` object)."""
    from hp_fastload.source.location import read_regular_file

    try:
        if is_object_url(os.fspath(directory)):
            raw = read_side_object(f"{os.fspath(directory).rstrip('/')}/{CONFIG_NAME}")
        else:
            raw = read_regular_file(Path(directory) / CONFIG_NAME)
    except HeaderError:
        raise
    except OSError:
        return None
    try:
        config = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    return config if isinstance(config, dict) else None


def read_quant_config(directory: str | Path) -> dict[str, Any] | None:
    """The ``quantization_config`` of ``directory/config.json`` (or its ``compression_config``), or None."""
    config = read_config_json(directory)
    if config is None:
        return None
    quant = config.get("quantization_config") or config.get("compression_config")
    if isinstance(quant, dict):
        return quant
    text_config = config.get("text_config")
    if isinstance(text_config, dict) and isinstance(text_config.get("quantization_config"), dict):
        return dict(text_config["quantization_config"])
    return None


def read_config(location: Path | ObjectLocation, config_overrides: dict[str, Any]) -> Any:
    """The checkpoint's ``config.json`` through ``AutoConfig`` (``config_overrides`` applied); refused unopened
    when it is missing or not a regular file (a FIFO or a device would block the read)."""
    if isinstance(location, ObjectLocation):
        return _read_object_config(location, config_overrides)
    folder = location if location.is_dir() else location.parent
    config_path = folder / CONFIG_NAME
    if not config_path.is_file():
        what = "is a FIFO, socket or device, not a regular file" if config_path.exists() else "does not exist"
        raise FileNotFoundError(
            errno.ENOENT,
            f"{config_path} {what}: the model is built from the checkpoint's config.json; build the model "
            "yourself and call hp_fastload.load(model, path)",
            str(config_path),
        )
    try:
        from transformers import AutoConfig
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "building the model from a checkpoint's config.json needs transformers (pip install transformers); "
            "without it, build the model yourself and call hp_fastload.load(model, path)"
        ) from exc
    return AutoConfig.from_pretrained(folder, **config_overrides)


def _read_object_config(location: ObjectLocation, config_overrides: dict[str, Any]) -> Any:
    """``read_config`` of an object checkpoint: its ``config.json`` object, parsed by ``AutoConfig`` from a
    temporary directory (``AutoConfig`` reads only paths and Hub ids)."""
    import tempfile

    from transformers import AutoConfig

    url = location.child(CONFIG_NAME)
    raw = read_side_object(url)
    if raw is None:
        raise FileNotFoundError(
            errno.ENOENT,
            f"{url} does not exist: the model is built from the checkpoint's config.json; build the model "
            "yourself and call hp_fastload.load(model, url)",
            url,
        )
    with tempfile.TemporaryDirectory(prefix="hp_fastload-config-") as tmp:
        Path(tmp, CONFIG_NAME).write_bytes(raw)
        return AutoConfig.from_pretrained(tmp, **config_overrides)
