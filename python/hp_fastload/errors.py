"""Exception hierarchy of hp_fastload.

What goes wrong with a checkpoint, a plan, a read or a model tensor raises a subclass of
:class:`HpFastloadError`, and each subclass also derives from the builtin class that callers of the seed API
already catch (``ValueError`` for bad input, ``OSError`` for failed reads). Two kinds of error stay builtin:
the seed API's own argument checks (an unknown loader name or an empty path is a ``ValueError``, a model that
is not an ``nn.Module`` a ``TypeError``), and missing or unreadable files (``FileNotFoundError`` /
``PermissionError`` with ``filename`` set). The Rust engine imports this module when it raises."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["HeaderError", "HpFastloadError", "MissingKeysError", "PlanError", "ReadError", "TargetError"]


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
