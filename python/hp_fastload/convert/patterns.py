"""Rule patterns as fast filters: the literal text every match of a rule's regex must contain, the alternatives of a
pattern, and ``Prefiltered``, a rule with the candidate keys it can match found by substring search instead of
running the regex on every key.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from itertools import compress, repeat
from operator import contains
from typing import Any

from hp_fastload.convert.regex_ast import constants as _sre
from hp_fastload.convert.regex_ast import parser as _sre_parse
from hp_fastload.convert.rules import Transform


def _plain_matcher(rule: Any) -> bool:
    """True when ``rule`` matches with the standard regex search (no custom ``rename_source_key``)."""
    method = getattr(type(rule), "rename_source_key", None)
    if method is Transform.rename_source_key:
        return True
    try:
        from transformers.core_model_loading import WeightTransform
    except ImportError:  # pragma: no cover - transformers is optional
        return False
    return method is WeightTransform.rename_source_key


def _longest_literal(items: Any) -> str:
    best = run = ""
    for op, arg in items:
        if op is _sre.LITERAL:
            run += chr(arg)
            best = max(best, run, key=len)
        else:
            run = ""
    return best


def required_literals(rule: Any) -> tuple[str, ...] | None:
    """Substrings one of which every key matched by ``rule`` contains, or None when none can be derived.

    Derived from the rule's compiled regex (each alternative's longest run of top-level literal characters),
    so a key containing none of them cannot match: ``rename_key`` skips the regex search for it. Planning a
    90k-key checkpoint through ~10 rules is otherwise dominated by failed searches.
    """
    compiled = getattr(rule, "compiled_sources", None)
    if compiled is None or not _plain_matcher(rule) or compiled.flags & re.IGNORECASE:
        return None
    return _pattern_literals(compiled.pattern, compiled.flags)


@functools.lru_cache(maxsize=4096)
def _pattern_literals(pattern: str | bytes, flags: int) -> tuple[str, ...] | None:
    """``required_literals`` of one pattern (cached: transformers hands out fresh copies of the same rules on
    every load, and parsing their patterns again showed in a small load's profile)."""
    if not isinstance(pattern, str):
        return None
    try:
        parsed = _sre_parse.parse(pattern, flags)
    except Exception:  # pragma: no cover - whatever re accepted, sre_parse accepts
        return None
    items = list(parsed)
    alternatives = items[0][1][1] if len(items) == 1 and items[0][0] is _sre.BRANCH else [parsed]
    literals = []
    for alternative in alternatives:
        body = list(alternative)
        if len(body) == 1 and body[0][0] is _sre.SUBPATTERN:
            body = list(body[0][1][-1])
        literal = _longest_literal(body)
        if len(literal) < 2:
            return None
        literals.append(literal)
    return tuple(literals)


def split_alternatives(pattern: str) -> list[str]:
    """``pattern`` cut at its top-level ``|`` (outside groups, character classes and escapes)."""
    pieces: list[str] = []
    depth = start = 0
    i, n, in_class = 0, len(pattern), False
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if pattern.startswith("]", i + 1) or pattern.startswith("^]", i + 1):  # a leading ] is a member
                i += 2 if pattern[i + 1] == "]" else 3
                continue
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "|" and depth == 0:
            pieces.append(pattern[start:i])
            start = i + 1
        i += 1
    pieces.append(pattern[start:])
    return pieces


@functools.lru_cache(maxsize=4096)
def _alternative_searches(pattern: str, flags: int) -> tuple[Callable[[str], Any], ...] | None:
    """One compiled search per top-level alternative of ``pattern`` (each a named group of transformers'
    joined source regex), or None when the pattern does not split into exactly its parsed alternatives.

    ``A|B`` finds, at the leftmost position where either matches, ``A`` if it matches there, else ``B``; that
    is the earliest of the alternatives' own leftmost matches, ties to the first. Searching each alternative
    alone only in the keys that contain its literal avoids trying every branch at every start position (about
    3x fewer steps on expert keys; docs/perf-notes.md).
    """
    literals = _pattern_literals(pattern, flags)
    if literals is None:
        return None
    pieces = split_alternatives(pattern)
    if len(pieces) != len(literals):
        return None
    try:
        compiled = [re.compile(piece, flags) for piece in pieces]
    except re.error:  # pragma: no cover - a piece of a valid pattern cut at a top-level | is valid
        return None
    if not all(c.groupindex for c in compiled):  # each alternative is a named group (its source pattern)
        return None
    return tuple(c.search for c in compiled)


class _SourceOf(dict[Any, str]):
    """Source pattern by the name of the branch that matched (``g<k>``: the rule's ``k``-th source)."""

    def __init__(self, sources: Sequence[str]) -> None:
        super().__init__((f"g{k}", source) for k, source in enumerate(sources))
        self.sources = sources

    def __missing__(self, group: Any) -> str:  # pragma: no cover - every branch is a named outer group
        raise KeyError(f"a match of no named branch ({group!r}) among sources {list(self.sources)}")


class Prefiltered:
    """A rule with its literal prefilter: ``rename(key)`` skips rules that cannot match."""

    __slots__ = ("direct", "literals", "rule", "searches")

    def __init__(self, rule: Any) -> None:
        self.rule = rule
        self.literals = required_literals(rule)
        # Plain, unscoped rules without a capture group can be applied with the compiled regex directly
        # (the same replacement transformers makes), skipping the per-key method call.
        self.direct = (
            self.literals is not None
            and getattr(rule, "scope_prefix", None) is None
            and "\\1" not in rule.target_patterns[0]
        )
        compiled = rule.compiled_sources if self.direct else None
        self.searches = None if compiled is None else _alternative_searches(compiled.pattern, compiled.flags)

    def rename_all(
        self, keys: list[str], taken: Sequence[Any] | None = None, text: str | None = None
    ) -> list[tuple[int, str, str]]:
        """``(index, renamed key, matched source pattern)`` for every key of ``keys`` the rule matches, in index
        order, skipping the indices where ``taken`` (if given) is not None. ``text``: the keys joined (by a
        character no literal has), to skip the per-key scan for literals that occur in no key at all."""
        literals = self.literals
        if text is not None and literals is not None and not any(lit in text for lit in literals):
            return []
        if not self.direct:
            out: list[tuple[int, str, str]] = []
            for i in _candidates(self, keys):
                if taken is not None and taken[i] is not None:
                    continue
                renamed, pattern = self.rule.rename_source_key(keys[i])
                if pattern is not None:
                    out.append((i, renamed, pattern))
            return out
        assert literals is not None
        if self.searches is None:
            alternatives = [(self.rule.compiled_sources.search, _candidates(self, keys))]
        else:
            alternatives = [
                (search, _containing(keys, literal))
                for search, literal in zip(self.searches, literals, strict=True)
                if text is None or literal in text
            ]
        found: list[tuple[int, Any]] = []  # (index, match) per alternative, in index order
        runs = 0
        for search, indices in alternatives:
            if taken is not None:
                indices = [i for i in indices if taken[i] is None]
            # The searches run in C (map); Python sees only the matches.
            matches = list(map(search, map(keys.__getitem__, indices)))
            run = list(compress(zip(indices, matches, strict=True), matches))
            if run:
                runs += 1
                found.extend(run)
        if not found:
            return []
        if runs > 1:  # several alternatives matched: per key the earliest match, ties to the first alternative
            hits: dict[int, Any] = {}
            for i, match in found:
                earlier = hits.get(i)
                if earlier is None or match.start() < earlier.start():
                    hits[i] = match
            found = sorted(hits.items())
        object.__setattr__(self.rule, "_was_used", True)
        replacement = self.rule.target_patterns[0]
        source_of = _SourceOf(self.rule.source_patterns)
        return [(i, keys[i].replace(m.group(0), replacement, 1), source_of[m.lastgroup]) for i, m in found]

    def rename(self, key: str) -> tuple[str, str | None]:
        literals = self.literals
        if literals is not None and not any(lit in key for lit in literals):
            return key, None
        renamed, pattern = self.rule.rename_source_key(key)
        return renamed, pattern


def _containing(keys: list[str], literal: str) -> list[int]:
    """Indices of ``keys`` that contain ``literal``; the substring tests run in C (map/compress), not in a
    Python loop over every key per rule."""
    return list(compress(range(len(keys)), map(contains, keys, repeat(literal))))


def _candidates(rule: Prefiltered, keys: list[str]) -> list[int]:
    """Indices of ``keys`` that contain one of the rule's required literals (all, without a prefilter)."""
    literals = rule.literals
    if literals is None:
        return list(range(len(keys)))
    if len(literals) == 1:
        return _containing(keys, literals[0])
    hits: set[int] = set()
    for literal in literals:
        hits.update(_containing(keys, literal))
    return sorted(hits)
