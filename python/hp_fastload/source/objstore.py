"""Checkpoints in object storage (``s3://bucket/prefix``): the second byte source of the one engine.

Owns: recognising object URLs (:func:`is_object_url`, :class:`ObjectLocation`), indexing an object checkpoint
(:func:`open_index`: its ``model.safetensors.index.json``, a single ``model.safetensors``, a single object, or
the ``*.safetensors`` objects under the prefix) with every header fetched by ranged GETs in the Rust backend
(``rust/objstore.rs``), the header cache keyed on each object's ETag and size, reading side objects
(``config.json``), and what ranks compare to agree on an object checkpoint. The plan, the items, the batch and
the report are the files' own: a :class:`~hp_fastload.source.files.SafetensorsFile` whose header came from an object
makes the engine fetch the byte ranges each batch needs (coalesced, many in flight) before copying them.

Credentials, region and endpoint come from the standard ``AWS_*`` environment variables (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``) and, when the access
key is not in the environment, from the shared credentials/config files (``AWS_PROFILE``,
``AWS_SHARED_CREDENTIALS_FILE``, ``AWS_CONFIG_FILE``), which are read here and handed over as variables.
"""

from __future__ import annotations

import configparser
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import hp_fastload._core as _core
from hp_fastload.errors import HeaderError, ObjectStoreError, shown_key
from hp_fastload.formats import INDEX_NAME, SINGLE_NAME
from hp_fastload.source.files import SafetensorsFile, parse_index

__all__ = [
    "ObjectLocation",
    "checkpoint_identity",
    "is_object_url",
    "list_safetensors",
    "open_index",
    "open_objects",
    "read_side_object",
]

_SCHEMES = ("s3://", "s3a://")


def is_object_url(path: object) -> bool:
    """Whether ``path`` is an object-storage URL (``s3://bucket/...``)."""
    return isinstance(path, str) and path.startswith(_SCHEMES)


@dataclass(frozen=True)
class ObjectLocation:
    """A checkpoint in object storage: ``bucket`` and ``prefix`` (no trailing slash); ``prefix`` may be one
    ``.safetensors`` object."""

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, url: str) -> ObjectLocation:
        """``s3://bucket/prefix`` (a trailing slash is dropped); ``ValueError`` for anything else."""
        rest = url.split("://", 1)[1] if is_object_url(url) else ""
        bucket, _, prefix = rest.partition("/")
        prefix = prefix.strip("/")
        if not bucket or not prefix:
            raise ValueError(f"{url!r} is not a checkpoint URL: expected s3://bucket/prefix")
        return cls(bucket, prefix)

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    @property
    def is_single_object(self) -> bool:
        return self.prefix.endswith(".safetensors")

    @property
    def folder(self) -> str:
        """The URL of the "directory" its files are in."""
        if self.is_single_object:
            return f"s3://{self.bucket}/{self.prefix.rpartition('/')[0]}".rstrip("/")
        return self.url

    def child(self, name: str) -> str:
        """The URL of ``name`` in its folder."""
        return f"{self.folder}/{name}"

    def relative(self, url: str) -> str:
        """``url`` relative to the folder (what ranks compare: not where the checkpoint is)."""
        return url.removeprefix(self.folder + "/")

    def __str__(self) -> str:
        return self.url

    def absolute(self) -> ObjectLocation:
        """Itself (a URL is absolute), for code written for paths."""
        return self


def _require_backend() -> None:
    if not getattr(_core, "HAS_OBJECT_STORE", False):
        raise ObjectStoreError("this build of hp_fastload has no object-storage backend (Rust feature 's3')")


_profile_lock = threading.Lock()


def _apply_shared_config() -> None:
    """When no access key is in the environment, the keys (and region) of ``AWS_PROFILE`` (default
    ``default``) from the shared credentials and config files, put in the environment the backend reads."""
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        return
    profile = os.environ.get("AWS_PROFILE") or os.environ.get("AWS_DEFAULT_PROFILE") or "default"
    home = Path("~/.aws").expanduser()
    creds_file = Path(os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or home / "credentials")
    config_file = Path(os.environ.get("AWS_CONFIG_FILE") or home / "config")
    found: dict[str, str] = {}
    for file, section in (
        (config_file, f"profile {profile}" if profile != "default" else "default"),
        (creds_file, profile),
    ):
        parser = configparser.RawConfigParser()
        try:
            parser.read(file)
        except (OSError, configparser.Error):
            continue
        if parser.has_section(section):
            found.update(parser.items(section))
    names = {
        "aws_access_key_id": "AWS_ACCESS_KEY_ID",
        "aws_secret_access_key": "AWS_SECRET_ACCESS_KEY",
        "aws_session_token": "AWS_SESSION_TOKEN",
        "region": "AWS_REGION",
        "endpoint_url": "AWS_ENDPOINT_URL",
    }
    with _profile_lock:
        for key, var in names.items():
            if key in found and not os.environ.get(var):
                os.environ[var] = found[key]


_CACHE_SIZE = 256
#: url -> ((etag, size), the file): a header is reused while the object's ETag and size are unchanged.
_cache: OrderedDict[str, tuple[tuple[str | None, int], SafetensorsFile]] = OrderedDict()
_cache_lock = threading.Lock()


def clear_cache() -> None:
    """Forget every cached object header."""
    with _cache_lock:
        _cache.clear()


def open_objects(urls: list[str]) -> list[SafetensorsFile]:
    """A :class:`SafetensorsFile` per object URL, headers fetched together; a cached header is reused when a
    HEAD shows the same ETag and size."""
    _require_backend()
    _apply_shared_config()
    out: dict[str, SafetensorsFile] = {}
    with _cache_lock:
        cached = {u: _cache[u] for u in urls if u in _cache}
    for url, (ident, file) in cached.items():
        if tuple(_core.object_identity(url)) == ident:
            out[url] = file
    missing = [u for u in urls if u not in out]
    if missing:
        headers = _core.SafetensorsHeader.open_objects(missing)
        for url, header in zip(missing, headers, strict=True):
            file = SafetensorsFile(url, header=header)
            out[url] = file
            ident = header.object_identity or (None, header.file_size)
            with _cache_lock:
                _cache[url] = (ident, file)
                _cache.move_to_end(url)
                while len(_cache) > _CACHE_SIZE:
                    _cache.popitem(last=False)
    return [out[u] for u in urls]


def read_side_object(url: str) -> bytes | None:
    """The bytes of a small object (``config.json``, an index), None when there is none."""
    _require_backend()
    _apply_shared_config()
    return _core.read_object(url)


def list_safetensors(url: str) -> list[str]:
    """The URLs of the ``*.safetensors`` objects directly under the prefix ``url`` (``s3://bucket/prefix``),
    sorted (what a directory's ``*.safetensors`` glob is for files)."""
    location = ObjectLocation.parse(url)
    _require_backend()
    _apply_shared_config()
    keys = _core.list_objects(location.url + "/")
    return sorted(f"s3://{location.bucket}/{k}" for k in keys if k.endswith(".safetensors"))


def _check_shard_name(index_url: str, name: object) -> str:
    """A ``weight_map`` file name that stays under the checkpoint's prefix: a non-empty string without NUL,
    not absolute, with no ``..`` component; :class:`HeaderError` otherwise (before any shard is fetched)."""
    plain = isinstance(name, str) and name and "\x00" not in name and "\\" not in name
    if plain and isinstance(name, str) and not name.startswith("/") and ".." not in name.split("/"):
        return name
    raise HeaderError(
        f"index {index_url} has weight_map entry {shown_key(name)}, a shard path outside the checkpoint prefix "
        "(shard names must be relative paths inside it: not empty, no NUL, not absolute, no '..' component); "
        "refusing to fetch it"
    )


def open_index(location: ObjectLocation) -> tuple[list[SafetensorsFile], dict[str, SafetensorsFile]]:
    """The files of the checkpoint at ``location`` and which file each key is taken from (the parts of a
    ``CheckpointIndex``)."""
    _require_backend()
    _apply_shared_config()
    if location.is_single_object:
        files = open_objects([location.url])
        return files, dict.fromkeys(files[0].keys(), files[0])
    index_url = location.child(INDEX_NAME)
    text = read_side_object(index_url)
    if text is not None:
        weight_map = parse_index(index_url, text)["weight_map"]
        names = sorted({_check_shard_name(index_url, n) for n in weight_map.values()})
        files = open_objects([location.child(n) for n in names])
        by_name = dict(zip(names, files, strict=True))
        key_files: dict[str, SafetensorsFile] = {}
        for key, name in weight_map.items():
            file = by_name[name]
            if key not in file:
                raise HeaderError(f"index {index_url} puts {shown_key(key)} in {name}, whose header does not have it")
            key_files[key] = file
        return files, key_files
    listed = _core.list_objects(location.url + "/")
    single = location.child(SINGLE_NAME)
    if single in {f"s3://{location.bucket}/{k}" for k in listed}:
        files = open_objects([single])
        return files, dict.fromkeys(files[0].keys(), files[0])
    shards = [f"s3://{location.bucket}/{k}" for k in listed if k.endswith(".safetensors")]
    if not shards:
        raise ObjectStoreError(
            f"no {INDEX_NAME}, {SINGLE_NAME} or *.safetensors objects under {location.url}/",
            bucket=location.bucket,
            key=location.prefix + "/",
            status=404,
        )
    files = open_objects(shards)
    key_files = {}
    for file in files:
        for key in file:
            if key in key_files:
                raise HeaderError(
                    f"tensor {shown_key(key)} is stored in two files: {key_files[key].path} and {file.path}"
                )
            key_files[key] = file
    return files, key_files


def checkpoint_identity(
    location: ObjectLocation, files: list[SafetensorsFile]
) -> tuple[list[tuple[str, int, int]], str]:
    """What ranks compare, as for files: each object's name relative to the prefix, size and header digest,
    and in place of a data sample the objects' ETags (an ETag names the content: no data is read)."""
    named = sorted((location.relative(f.path), f) for f in files)
    etags = []
    for name, f in named:
        ident = f.header.object_identity
        etags.append(f"{name}={(ident[0] if ident else None) or ''}")
    return [(name, f.file_size, f.header.digest) for name, f in named], "etags:" + ",".join(etags)
