"""Checkpoint locations: a user's ``path`` (a ``.safetensors`` file of any name, a directory, a Hub repo id resolved
through huggingface_hub, an ``s3://`` URL) to a local path or an object location, and regular-file reads of small side
files.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from hp_fastload.errors import HeaderError
from hp_fastload.formats import CONFIG_NAME
from hp_fastload.source.objstore import ObjectLocation, is_object_url

#: A resolved checkpoint location: a local file or directory, or a prefix (or one object) in object storage.
Location = Path | ObjectLocation


def folder_of(location: Location) -> Path | str:
    """The directory (or, for objects, the ``s3://`` folder URL) that holds the checkpoint's files and its
    ``config.json``."""
    if isinstance(location, ObjectLocation):
        return location.folder
    return location if location.is_dir() else location.parent


def _looks_local(text: str) -> bool:
    """A path the user meant on this machine: absolute, ``./``, ``../``, ``~``, a Windows separator, more than
    two components, a ``.safetensors`` name, or ``dir/name`` whose ``dir`` exists here (``checkpoints/lama``
    with ``checkpoints/`` present is a mistyped path, not the Hub repo ``checkpoints/lama``)."""
    if text.startswith((".", "/", "~")) or os.path.isabs(text) or "\\" in text:
        return True
    parts = text.split("/")
    return len(parts) > 2 or text.endswith(".safetensors") or (len(parts) == 2 and os.path.isdir(parts[0]))


def _is_hub_id(text: str) -> bool:
    """``name`` or ``owner/name`` that is not a local-looking path."""
    parts = text.split("/")
    return 1 <= len(parts) <= 2 and all(parts) and not _looks_local(text)


def _resolve_hub(repo_id: str, revision: str | None, cache_first: bool = False) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise FileNotFoundError(
            f"{repo_id!r} is neither a file nor a directory, and huggingface_hub is not installed "
            "to resolve it as a Hub repo id (pip install 'hp_fastload[hub]')"
        ) from exc
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in {"1", "true", "yes", "on"}
    patterns = ["*.safetensors", "*.safetensors.index.json", CONFIG_NAME]
    if cache_first and not offline:  # another rank has just fetched it: the local cache answers, no request
        try:
            return Path(
                snapshot_download(repo_id=repo_id, revision=revision, allow_patterns=patterns, local_files_only=True)
            )
        except Exception:  # not in this node's cache (or another revision): ask the Hub as usual
            pass
    try:
        path = snapshot_download(repo_id=repo_id, revision=revision, allow_patterns=patterns, local_files_only=offline)
    except Exception as exc:  # huggingface_hub's errors: cache miss, unknown repo, gated, network
        from huggingface_hub.errors import LocalEntryNotFoundError

        where = f"{repo_id!r}{f' (revision {revision!r})' if revision else ''}"
        if isinstance(exc, LocalEntryNotFoundError) and offline:
            raise FileNotFoundError(
                f"checkpoint {where} is not a local path, and it is not in the Hugging Face cache "
                f"(HF_HUB_OFFLINE is set, so the Hub was not asked): download it first or pass a local directory"
            ) from exc
        raise FileNotFoundError(
            f"checkpoint {where} is not a local path, and the Hub could not provide it: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        ) from exc
    return Path(path)


def resolve_checkpoint_location(
    path: str | os.PathLike[str] | ObjectLocation, *, revision: str | None = None, cache_first: bool = False
) -> Location:
    """A local file or directory for ``path``; Hub ids go through huggingface_hub (offline-aware); an
    ``s3://bucket/prefix`` URL gives an :class:`~hp_fastload.source.objstore.ObjectLocation`.

    ``cache_first``: try the local Hub cache before asking the Hub (``load`` resolves on rank 0 first, then
    on the other ranks with it, so a job does not send one request per rank).
    """
    if isinstance(path, ObjectLocation):  # already resolved
        return path
    text = os.fspath(path)
    if not text:
        raise ValueError("pretrained_path must be provided: got an empty checkpoint path")
    if is_object_url(text):  # s3://bucket/prefix: a Path would fold the '//'
        return ObjectLocation.parse(text)
    local = Path(text).expanduser()
    if local.is_file():
        if local.suffix != ".safetensors":
            raise ValueError(f"only safetensors checkpoints are supported, got: {local}")
        return local
    if local.is_dir():
        return local
    if local.exists():  # a FIFO, socket or device: not a checkpoint, and not a Hub id either
        raise FileNotFoundError(
            errno.ENOENT, f"checkpoint {local.absolute()} is a FIFO, socket or device, not a file or a directory", text
        )
    if _is_hub_id(text):
        return _resolve_hub(text, revision, cache_first)
    hub = "" if _looks_local(text) else ", nor a Hub repo id (owner/name)"
    raise FileNotFoundError(
        errno.ENOENT, f"checkpoint not found ({local.absolute()} is not a file or a directory{hub})", text
    )


def read_regular_file(path: Path) -> bytes | None:
    """The bytes of a checkpoint's side file (``config.json``), None when there is none. A FIFO, socket or
    device there is a :class:`HeaderError`: it is checked after a non-blocking open, so reading it can never
    block (and a regular file swapped for a FIFO after a ``stat`` is refused too)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise HeaderError(f"{path} is a FIFO, socket or device, not a regular file; refusing to read it")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
