"""Exception hierarchy of hp_fastload.

What goes wrong with a checkpoint, a plan, a read or a model tensor raises a subclass of
:class:`HpFastloadError`, and each subclass also derives from the builtin class that callers of the seed API
already catch (``ValueError`` for bad input, ``OSError`` for failed reads). Two kinds of error stay builtin:
the seed API's own argument checks (an unknown loader name or an empty path is a ``ValueError``, a model that
is not an ``nn.Module`` a ``TypeError``), and missing or unreadable files (``FileNotFoundError`` /
``PermissionError`` with ``filename`` set). The Rust engine imports this module when it raises."""

from __future__ import annotations

__all__ = ["HeaderError", "HpFastloadError", "PlanError", "ReadError", "TargetError"]


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
