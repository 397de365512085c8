"""Exception hierarchy of hp_fastload.

What goes wrong with a checkpoint, a plan, a read or a model tensor raises a subclass of
:class:`HpFastloadError`, and each subclass also derives from the builtin class that callers of the seed API
already catch (``ValueError`` for bad input, ``OSError`` for failed reads). Two kinds of error stay builtin:
the seed API's own argument checks (an unknown loader name or an empty path is a ``ValueError``, a model that
is not an ``nn.Module`` a ``TypeError``), and missing or unreadable files (``FileNotFoundError`` /
``PermissionError`` with ``filename`` set). The Rust engine imports this module when it raises.

Every public error class is here, and :data:`ERROR_TABLE` names each with the fields it carries beyond its
message: a failure on one rank of a distributed call reaches the other ranks through it (:func:`carried` on the
failing rank, :func:`rebuilt` on its peers; ``dist.agree`` and ``dist.bounded`` send it)."""

from __future__ import annotations

import builtins
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

__all__ = [
    "ERROR_TABLE",
    "KEY_SHOWN",
    "AdapterError",
    "AdapterMismatchError",
    "Carried",
    "CheckpointMismatchError",
    "ConversionError",
    "ErrorEntry",
    "HeaderError",
    "HpFastloadError",
    "MissingKeysError",
    "ObjectStoreError",
    "PeerInterrupted",
    "PeerLost",
    "PlanError",
    "QuantizationError",
    "ReadError",
    "TargetError",
    "carried",
    "rebuilt",
    "shown_key",
]
#: Most characters of a tensor name that a message or log line quotes (a checkpoint can hold a 50 MB name).
KEY_SHOWN = 200


def shown_key(key: object) -> str:
    """``repr(key)`` for messages: control characters and bidi overrides escaped by ``repr``, and a name
    longer than :data:`KEY_SHOWN` characters cut there, with its length."""
    if isinstance(key, str) and len(key) > KEY_SHOWN:
        return f"{key[:KEY_SHOWN]!r}... ({len(key)} characters)"
    return repr(key)


class HpFastloadError(Exception):
    """Base class of hp_fastload's own errors."""


class HeaderError(HpFastloadError, ValueError):
    """A safetensors file has an invalid header (bad length, JSON, dtype, shape or byte ranges)."""


class PlanError(HpFastloadError, ValueError):
    """A read request is impossible: box outside the tensor, wrong destination, impossible cast, unknown key,
    overlapping destinations."""


class QuantizationError(PlanError):
    """A quantized checkpoint tensor would land in a target that cannot take it as stored (a float model
    without a supported dequantization): refused at planning, before any byte is read."""


class ConversionError(PlanError, RuntimeError):
    """A conversion op failed on the checkpoint's shapes (a rule that does not fit the checkpoint)."""


class AdapterError(PlanError, RuntimeError):
    """A state-dict adapter (or a model hook) did something that cannot be planned as exact region reads."""


class ReadError(HpFastloadError, OSError):
    """Reading failed: the file is shorter than its header says (truncated, or shrank after it was opened)
    or changed since its header was read."""


class ObjectStoreError(ReadError):
    """A request to object storage failed (after retrying transient failures): no such object or bucket,
    access denied, credentials refused, the server gone. ``bucket``, ``key`` and ``status`` (the HTTP status,
    None when no answer came) name it."""

    def __init__(self, message: str, bucket: str = "", key: str = "", status: int | None = None) -> None:
        super().__init__(message)
        self.bucket = bucket
        self.key = key
        self.status = status


class CheckpointMismatchError(HpFastloadError, ValueError):
    """The ranks of one load resolved their checkpoint arguments to different checkpoints (other files,
    sizes or headers). Raised on every rank, naming each rank's location."""


class PeerInterrupted(HpFastloadError, RuntimeError):
    """Another rank of the same ``load`` / ``save`` was interrupted (a signal, such as SIGINT, raised
    ``KeyboardInterrupt`` there); raised on the ranks that were not, naming the interrupted ranks and the
    stage. ``ranks``: their numbers."""

    def __init__(self, message: str, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)


class PeerLost(HpFastloadError, RuntimeError):
    """Another rank of the same distributed call is gone: it gave no sign of life (no heartbeat in the job's
    store) for ``HP_FASTLOAD_PEER_SILENCE_S`` seconds (its node's link is down, its host hangs), or its
    connection closed under a message (its process died), or, seen from a node cut off from the job, the
    store's host stopped answering. Raised on the ranks that remain, naming the lost ``ranks`` and their
    ``nodes`` (``rank // LOCAL_WORLD_SIZE``). The process group is unusable afterwards."""

    def __init__(self, message: str, ranks: Sequence[int] = (), nodes: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.nodes = tuple(nodes)


class TargetError(HpFastloadError, ValueError):
    """A model tensor cannot receive what the checkpoint holds (used by the loader)."""


class AdapterMismatchError(TargetError):
    """A PEFT adapter checkpoint does not fit the adapter of the PEFT model it is loaded into: its
    ``adapter_config.json`` disagrees (type, rank, alpha, target modules, ``modules_to_save``...) or its file holds
    other tensors than the model's adapter has. Raised before any byte is read."""


class MissingKeysError(HpFastloadError, RuntimeError):
    """A strict load would leave model tensors unfilled (raised before any byte is read). A ``RuntimeError``, as
    the seed's strict check was. ``missing_keys`` / ``unexpected_keys`` hold the names (on the other ranks of a
    distributed call too)."""

    def __init__(self, message: str, missing_keys: Sequence[str] = (), unexpected_keys: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.missing_keys = tuple(missing_keys)
        self.unexpected_keys = tuple(unexpected_keys)


class ErrorEntry(NamedTuple):
    """A row of :data:`ERROR_TABLE`: the class, and the attributes beyond its message that its constructor takes
    as keywords (the peers of a failing rank rebuild it as ``cls(message, **fields)``)."""

    cls: type[HpFastloadError]
    fields: tuple[str, ...] = ()


#: Every public error class, by name: what a failure on one rank is raised as on the other ranks.
ERROR_TABLE: dict[str, ErrorEntry] = {
    entry.cls.__name__: entry
    for entry in (
        ErrorEntry(HpFastloadError),
        ErrorEntry(HeaderError),
        ErrorEntry(PlanError),
        ErrorEntry(QuantizationError),
        ErrorEntry(ConversionError),
        ErrorEntry(AdapterError),
        ErrorEntry(ReadError),
        ErrorEntry(ObjectStoreError, ("bucket", "key", "status")),
        ErrorEntry(CheckpointMismatchError),
        ErrorEntry(PeerInterrupted, ("ranks",)),
        ErrorEntry(PeerLost, ("ranks", "nodes")),
        ErrorEntry(TargetError),
        ErrorEntry(AdapterMismatchError),
        ErrorEntry(MissingKeysError, ("missing_keys", "unexpected_keys")),
    )
}
#: What an ``OSError`` carries beyond its message (``errno``, ``filename``... are attributes, not arguments).
_OS_FIELDS = ("errno", "strerror", "filename", "filename2")


class Carried(NamedTuple):
    """A rank's failure as its peers receive it: plain data (pickled by an object gather, JSON in the store).

    ``name``: the failure's own class (the peers' message names it); ``kind``: the class the peers raise, the
    nearest of the failure's classes that is in :data:`ERROR_TABLE` or a builtin exception (a ``JSONDecodeError``
    arrives as ``ValueError``, a library's ``RuntimeError`` subclass as ``RuntimeError``); ``fields``: that
    class's fields (an ``OSError``'s ``errno``, ``strerror`` and file names)."""

    name: str
    kind: str
    message: str
    fields: dict[str, Any]


def _plain(value: Any) -> Any:
    """A field's value as plain data: sequences as tuples, a path as ``str``."""
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, (bytes, os.PathLike)):
        return os.fsdecode(value)
    return str(value)


def _takes_a_message(cls: type[BaseException]) -> bool:
    try:
        cls("")
    except TypeError:  # UnicodeDecodeError, ExceptionGroup...: other arguments
        return False
    return True


def carried(exc: BaseException) -> Carried:
    """What :func:`rebuilt` needs to raise ``exc`` on another rank (see :class:`Carried`)."""
    for cls in type(exc).__mro__:
        entry = ERROR_TABLE.get(cls.__name__)
        if entry is not None and entry.cls is cls:
            fields = {f: _plain(getattr(exc, f)) for f in entry.fields if hasattr(exc, f)}
            return Carried(type(exc).__name__, cls.__name__, str(exc), fields)
        if cls.__module__ == "builtins" and issubclass(cls, Exception) and _takes_a_message(cls):
            fields = {f: _plain(getattr(exc, f)) for f in _OS_FIELDS} if issubclass(cls, OSError) else {}
            return Carried(type(exc).__name__, cls.__name__, str(exc), fields)
    return Carried(type(exc).__name__, "RuntimeError", str(exc), {})  # a BaseException that is no Exception


def rebuilt(failure: Carried, prefix: str) -> Exception:
    """The exception a peer raises for ``failure``: its class (:attr:`Carried.kind`), its message after
    ``prefix`` (which names the rank and the step), its fields. An ``OSError`` whose message is made from its
    fields (``[Errno 2] No such file or directory: 'path'``) gets them back, ``prefix`` before its ``strerror``."""
    entry = ERROR_TABLE.get(failure.kind)
    if entry is not None:
        return entry.cls(prefix + failure.message, **failure.fields)
    cls = getattr(builtins, failure.kind, None)
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        return RuntimeError(prefix + failure.message)
    fields = failure.fields
    if issubclass(cls, OSError) and fields.get("errno") is not None and fields.get("strerror") is not None:
        args = [fields["errno"], prefix + fields["strerror"]]
        if fields.get("filename") is not None:
            args.append(fields["filename"])
            if fields.get("filename2") is not None:
                args += [None, fields["filename2"]]
        return cls(*args)
    return cls(prefix + failure.message)
