"""Exception hierarchy of hp_fastload.

Every error the library raises on purpose derives from :class:`HpFastloadError`; each subclass also derives
from the builtin class that callers of the seed API already catch (``ValueError`` for bad input, ``OSError``
for failed reads). Missing and unreadable files raise the builtin ``FileNotFoundError`` / ``PermissionError``
(with ``filename`` set), not a class from here. The Rust engine imports this module when it raises.
"""

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
