"""Natural key order: the one definition of how checkpoint keys, targets and shard names sort.

Owns: ``dot_natural_key`` (transformers' ``dot_natural_key``, part for part), ``natural_sort_key`` (a string
that sorts exactly like it and compares fast), and :class:`KeyOrder`, a checkpoint's keys in that order with
ties broken by name: merged from the header parser's order (``_core.SafetensorsHeader.natural_order``, the fast
path computing the same order in Rust; it hands the names it cannot decide back here) and used to sort subsets
of them. Every other module imports its order from here.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import hp_fastload._core as _core

_NATURAL_PARTS: dict[str, tuple[Any, ...]] = {}


def _natural_part(part: str) -> tuple[Any, ...]:
    # isdecimal, not isdigit: int() refuses digits that are not decimal ("²" is a digit, and a shard named
    # "².safetensors" crashed indexing); those sort as text.
    if part.isdecimal():
        try:
            value: tuple[Any, ...] = (0, int(part))
        except ValueError:  # more digits than int() converts (4300): after every smaller number, by value
            digits = part.lstrip("0")
            value = (0, math.inf, len(digits), digits)
    else:
        stem = part.rstrip("0123456789")
        digits = part[len(stem) :]
        value = (1, stem, int(digits)) if digits else (1, stem)
    if len(_NATURAL_PARTS) < 1 << 20:
        _NATURAL_PARTS[part] = value
    return value


def dot_natural_key(name: str) -> list[tuple[Any, ...]]:
    """Sort key for dotted names: digit parts compare as numbers (``layers.2`` before ``layers.10``).

    Compatible with transformers' ``dot_natural_key``: a part that is all digits sorts before text parts,
    and a trailing number inside a text part compares numerically (``shard_2`` before ``shard_11``). Parts
    repeat across a checkpoint's keys, so their keys are memoized (sorting 100k keys is a hot path).
    """
    cache = _NATURAL_PARTS
    return [cache.get(part) or _natural_part(part) for part in name.split(".")]


_SORT_PARTS: dict[str, str] = {}


def _sort_part(part: str) -> str:
    if part.isdecimal():  # as in _natural_part; other scripts' decimal digits compare by value there too
        digits = part.lstrip("0") if part.isascii() or len(part) > 4000 else str(int(part)).lstrip("0")
        value = "\x02" + digits.rjust(24, "0")
    elif part:
        stem = part.rstrip("0123456789")
        digits = part[len(stem) :]
        value = stem + ("\x03" + digits.lstrip("0").rjust(24, "0") if digits else "")
    else:  # an empty part is text: after every number ("\x02" + digits), before every printable text part
        value = "\x02~"
    if len(_SORT_PARTS) < 1 << 20:
        _SORT_PARTS[part] = value
    return value


def natural_sort_key(name: str) -> str:
    r"""A string that sorts exactly like ``dot_natural_key(name)`` but compares much faster.

    Parts are joined with ``\x01`` (below every other character, so a name that is a prefix of another sorts
    first); a digit part becomes ``\x02`` + its digits zero-padded to 24 (before any text part, which starts
    higher; an empty part, text too, is ``\x02~``, between the two), and a text part's trailing number is
    zero-padded after ``\x03``. The header parser's fast path
    (``rust/header.rs``, ``natural_order``) orders ASCII names exactly by this key; its tests compare the two.
    Used to sort 100k-key checkpoints, where comparing lists of tuples dominated planning.
    """
    cache = _SORT_PARTS
    return "\x01".join([cache.get(part) or _sort_part(part) for part in name.split(".")])


def _tie_broken(name: str) -> tuple[str, str]:
    return natural_sort_key(name), name


def natural_sorted(names: Iterable[str]) -> list[str]:
    """``names`` in natural order, ties (``l.01`` and ``l.1``) by name: the order of :class:`KeyOrder`."""
    return sorted(names, key=_tie_broken)


class KeyOrder:
    """A checkpoint's keys in natural order (ties by name), and sorting names by it.

    Built from the parsed headers: the Rust parser sorts every ASCII name (positions, so the keys are the
    caller's own string objects, whose hashes are cached for the lookups planning makes); the names it
    hands back (non-ASCII, control characters, numbers of more than 24 digits) are placed here by
    :func:`natural_sort_key`.
    """

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys
        self._position: dict[str, int] | None = None
        self._passes = 0  # calls answered by a pass over the keys (the position table is built at the second)

    @classmethod
    def of_headers(
        cls, names: Sequence[str], headers: Sequence[_core.SafetensorsHeader], indexed: Collection[str]
    ) -> KeyOrder:
        """The order of ``names``: every tensor of ``headers`` taken in order (each in file order), keeping
        only the ``indexed`` ones, each once (an index that lists some of its files' keys)."""
        order, other = _core.SafetensorsHeader.natural_order(list(headers))
        keys = list(map(names.__getitem__, order))
        if other:
            keys = natural_sorted(keys + [names[i] for i in other])
        if len(keys) != len(indexed):
            keys = list(dict.fromkeys(k for k in keys if k in indexed))
        return cls(keys)

    def sorted(self, names: Iterable[str]) -> list[str]:
        """``names`` in natural order: the known keys by their position in :attr:`keys` (reports sort tens of
        thousands of unexpected keys, and computing each one's sort key in Python was slow), then any other
        names by :func:`natural_sort_key`."""
        names = names if isinstance(names, (set, frozenset)) else set(names)
        position = self._position
        if position is None and (len(names) * 8 > len(self.keys) or self._passes == 0):
            # Many names (the unexpected keys of a big checkpoint), or the first call (a one-rank plan sorts
            # once): one C-level pass over the ordered keys. Building the position table of 92k keys costs
            # several such passes (docs/perf-notes.md, "Session 11"), so it is built only when asked again.
            if len(names) * 8 <= len(self.keys):
                self._passes += 1
            known = list(filter(names.__contains__, self.keys))
        else:
            if position is None:
                position = self._position = dict(zip(self.keys, range(len(self.keys)), strict=True))
            known = sorted((n for n in names if n in position), key=position.__getitem__)
        if len(known) == len(names):
            return known
        return known + natural_sorted(names.difference(known))
