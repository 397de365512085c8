"""Load groups: which checkpoint keys fill which model tensors, through which rule.

Owns the transformers-compatible key resolution (renamings chained, then at most one converter, then the
base-model prefix) over the header key list, in natural order, and the grouping of keys by renamed target:
every key that renames to one target joins one group (many -> one: expert stacks, q/k/v fusion); a converter
with several targets is one group with several outputs (one -> many). No tensor is read here.
"""

from __future__ import annotations

import copy
import functools
import re
import sys
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import contains
from typing import Any

from .errors import shown_key
from .rules import _Transform, is_converter, is_renaming
from .templates import template_groups

if sys.version_info >= (3, 11):  # the regex parser, to derive a rule's literal prefilter
    import re._constants as _sre
    import re._parser as _sre_parse
else:  # pragma: no cover - Python 3.10
    import sre_constants as _sre
    import sre_parse as _sre_parse

__all__ = ["LoadGroup", "build_groups", "rename_key"]


@dataclass
class LoadGroup:
    """One conversion unit.

    Attributes:
        target: the renamed name of the group's first key (the layer name handed to the converter).
        rule: the converter that matched (shared, never mutated), or None for a plain rename.
        sources: ``(source pattern, checkpoint key)`` in natural key order; for a plain rename the
            pattern is the checkpoint key itself.
    """

    target: str
    rule: Any | None
    sources: list[tuple[str, str]] = field(default_factory=list)

    def fresh_transform(self) -> Any:
        """A private copy of the converter to feed tensors into (rules keep per-call state)."""
        return copy.deepcopy(self.rule)

    @property
    def keys(self) -> list[str]:
        return [key for _, key in self.sources]


def _prefix_normalize(key: str, prefix: str | None, targets: Collection[str]) -> str:
    if not prefix:
        return key
    if key.startswith(prefix + "."):
        stripped = key[len(prefix) + 1 :]
        if stripped in targets:
            return stripped
    if f"{prefix}.{key}" in targets:
        return f"{prefix}.{key}"
    return key


def _normalized(names: list[str], prefix: str | None, targets: Collection[str]) -> list[str]:
    """``_prefix_normalize`` of every name, through one dict lookup each (in C) unless some target carries the
    prefix twice: a name that carries it once can only lose it (when the rest is a target without it, like
    ``lm_head.weight``), a name without it can only gain it (when the prefixed name is a target)."""
    if not prefix:
        return names
    dotted = prefix + "."
    doubled = dotted + dotted
    if any(t.startswith(doubled) for t in targets):
        return [_prefix_normalize(n, prefix, targets) for n in names]
    cut = len(dotted)
    change = {dotted + t: t for t in targets if not t.startswith(dotted)}
    change.update((t[cut:], t) for t in targets if t.startswith(dotted))
    out = list(map(change.get, names, names))
    for i in compress(range(len(names)), map(str.startswith, names, repeat(doubled))):
        out[i] = _prefix_normalize(names[i], prefix, targets)
    return out


def _plain_matcher(rule: Any) -> bool:
    """True when ``rule`` matches with the standard regex search (no custom ``rename_source_key``)."""
    method = getattr(type(rule), "rename_source_key", None)
    if method is _Transform.rename_source_key:
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
    every load, and parsing their patterns again was ~2 ms of a small load)."""
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


def _split_alternatives(pattern: str) -> list[str]:
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
    alone only in the keys that contain its literal avoids trying every branch at every start position:
    matching 60k DeepSeek expert keys against the gate/up pair took 1.7 us a key, one branch 0.5 us.
    """
    literals = _pattern_literals(pattern, flags)
    if literals is None:
        return None
    pieces = _split_alternatives(pattern)
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


class _Prefiltered:
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
    """Indices of ``keys`` that contain ``literal``; the substring tests run in C (map/compress): a Python loop
    over 90k keys per rule cost ~15 ms."""
    return list(compress(range(len(keys)), map(contains, keys, repeat(literal))))


def _candidates(rule: _Prefiltered, keys: list[str]) -> list[int]:
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


def rename_key(
    key: str,
    renamings: Sequence[Any],
    converters: Sequence[Any],
    base_model_prefix: str | None,
    targets: Collection[str],
) -> tuple[str, Any | None, str | None]:
    """``(renamed key, matched converter or None, matched source pattern or None)`` for one key.

    ``renamings`` / ``converters`` are rule objects, or ``_Prefiltered`` wrappers of them (``build_groups``
    wraps them once for a whole key list).
    """
    renamed = key
    for renaming in renamings:
        if isinstance(renaming, _Prefiltered):
            renamed, _ = renaming.rename(renamed)
        else:
            renamed, _ = renaming.rename_source_key(renamed)
    matched = None
    pattern = None
    for converter in converters:
        if isinstance(converter, _Prefiltered):
            candidate, pattern = converter.rename(renamed)
            rule = converter.rule
        else:
            candidate, pattern = converter.rename_source_key(renamed)
            rule = converter
        if pattern is not None:
            renamed, matched = candidate, rule
            break
    renamed = _prefix_normalize(renamed, base_model_prefix, targets)
    if renamed not in targets and key in targets:
        # The checkpoint already uses the model's names: a rule that would misfire must not win.
        return _prefix_normalize(key, base_model_prefix, targets), None, None
    return renamed, matched, pattern


def build_groups(
    keys: Sequence[str],
    targets: Collection[str],
    rules: Sequence[Any],
    *,
    base_model_prefix: str | None = None,
    map_key: Callable[[str], str | None] | None = None,
    templates: bool = True,
) -> tuple[list[LoadGroup], list[str]]:
    """Group checkpoint ``keys`` (already in natural order) by the target they rename to.

    Returns ``(groups in first-key order, unexpected checkpoint keys)``. A key whose renamed name is not a
    target is unexpected, unless its converter has several targets, in which case the group is kept and
    the converted outputs decide (one of them may exist).

    The work is done once per key template (``hp_fastload.templates``: layer and expert numbers taken out);
    ``templates=False``, or a case the template path leaves to it, runs the per-key path, whose result the
    template path reproduces exactly.
    """
    if map_key is None:
        originals = names = list(keys)
    else:
        pairs = [(key, map_key(key)) for key in keys]
        originals = [key for key, name in pairs if name is not None]
        names = [name for _, name in pairs if name is not None]
    renamings = [_Prefiltered(r) for r in rules if is_renaming(r)]
    converters = [_Prefiltered(r) for r in rules if is_converter(r)]
    if templates:
        templated = template_groups(
            originals,
            names,
            targets,
            renamings,
            converters,
            base_model_prefix,
            lambda name: _prefix_normalize(name, base_model_prefix, targets),
            LoadGroup,
        )
        if templated is not None:
            return templated
    # The per-key path. One pass per rule over all keys: renamings chain in order, then the first converter
    # that matches.
    current = list(names)
    # Most rules of a mapping match nothing in a given checkpoint: one substring test on all keys joined
    # rules them out (a scan per key and literal cost ~5 ms a rule on 90k keys). Rebuilt after a renaming.
    text = "\n".join(current) if len(current) > 1000 else None
    for rule in renamings:
        hits = rule.rename_all(current, None, text)
        for i, new_key, _ in hits:
            current[i] = new_key
        if hits and text is not None:
            text = "\n".join(current)
    matched: list[tuple[Any, str] | None] = [None] * len(current)
    renamed = list(current)
    taken = None  # until a converter matched, no index needs checking
    for rule in converters:
        for i, new_key, matched_pattern in rule.rename_all(current, taken, text):
            renamed[i], matched[i] = new_key, (rule.rule, matched_pattern)
            taken = matched
    groups: dict[str, LoadGroup] = {}
    unexpected: list[str] = []
    finals = _normalized(renamed, base_model_prefix, targets)
    present = list(map(contains, repeat(targets), finals))
    converter: Any
    for key, target, hit, name, here in zip(originals, finals, matched, names, present, strict=True):
        if not here:
            if name in targets:
                # The checkpoint already uses the model's names: a rule that would misfire must not win.
                target, hit = _prefix_normalize(name, base_model_prefix, targets), None
                here = target in targets
            if not here and (hit is None or len(hit[0].target_patterns) == 1):
                unexpected.append(key)
                continue
        if hit is None:
            converter = pattern = None
        else:
            converter, pattern = hit
        group = groups.get(target)
        if group is None:
            group = groups[target] = LoadGroup(target, converter)
        elif group.rule is not converter:
            raise ValueError(
                f"checkpoint keys {shown_key(group.keys[0])} and {shown_key(key)} both map to {shown_key(target)} "
                f"through different rules ({group.rule!r} and {converter!r})"
            )
        group.sources.append((pattern if pattern is not None else key, key))
    for group in groups.values():
        if group.rule is None and len(group.sources) > 1:
            shown = ", ".join(map(shown_key, group.keys[:10])) + (", ..." if len(group.keys) > 10 else "")
            raise ValueError(f"checkpoint keys {shown} all map to {shown_key(group.target)}")
    return list(groups.values()), unexpected


def masked_name(name: str) -> str:
    """``name`` with every numeric dotted part replaced by ``#`` (a layer-independent cache key)."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)", "#", name)
