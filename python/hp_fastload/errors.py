"""Exception hierarchy of hp_fastload.

What goes wrong with a checkpoint, a plan, a read or a model tensor raises a subclass of
:class:`HpFastloadError`, and each subclass also derives from the builtin class that callers of the seed API
already catch (``ValueError`` for bad input, ``OSError`` for failed reads). Two kinds of error stay builtin:
the seed API's own argument checks (an unknown loader name or an empty path is a ``ValueError``, a model that
is not an ``nn.Module`` a ``TypeError``), and missing or unreadable files (``FileNotFoundError`` /
``PermissionError`` with ``filename`` set). The Rust engine imports this module when it raises."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "KEY_SHOWN",
    "CheckpointMismatchError",
    "HeaderError",
    "HpFastloadError",
    "MissingKeysError",
    "ObjectStoreError",
    "PeerInterrupted",
    "PeerLost",
    "PlanError",
    "ReadError",
    "TargetError",
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


class MissingKeysError(HpFastloadError, RuntimeError):
    """A strict load would leave model tensors unfilled (raised before any byte is read). A ``RuntimeError``, as
    the seed's strict check was. ``missing_keys`` / ``unexpected_keys`` hold the names (empty when the error was
    rebuilt on another rank from its message)."""

    def __init__(self, message: str, missing_keys: Sequence[str] = (), unexpected_keys: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.missing_keys = tuple(missing_keys)
        self.unexpected_keys = tuple(unexpected_keys)
