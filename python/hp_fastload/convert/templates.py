"""Load groups built once per key template instead of once per key.

Owns the template side of :func:`hp_fastload.convert.groups.build_groups`: a checkpoint's keys collapsed to templates
(``rust/keys.rs``: every numeric dotted component — a layer or an expert number — taken out as ``#``), each rule
applied once per template, the renamed names checked against the model's targets once per distinct name, and
the groups assembled with numpy. A 90k-tensor DeepSeek-V3 header has 37 templates; renaming and grouping its
keys one by one in Python cost ~0.1 s.

Exactness is by construction, not by sampling: a rule is applied to a template only when its regex is *number
blind* (:func:`number_blind`: the match, its span and its branch are the same for every instance of the
template, whatever its numbers), its match starts and ends at component boundaries, and the first occurrence of
the matched text (transformers replaces the first occurrence, which may come before the match) is provably the
match in every instance. A template that fails any of these is split into its keys, which the rule then renames
one by one exactly as the per-key path does; the result is the per-key path's, group for group (tests compare
the two on every family). What this module cannot decide — an error to raise, a key that is already a target
name when its renamed one is not — returns None, and the caller runs the per-key path, which raises or decides.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np

import hp_fastload._core as _core
from hp_fastload.convert.regex_ast import constants as _sre
from hp_fastload.convert.regex_ast import parser as _sre_parse

MARKER = "#"


#: Templates (after splitting) up to which the template path goes on whatever the key count.
SPLIT_FLOOR = 1024


_DIGITS = frozenset("0123456789")


#: A numeric component as ``rust/keys.rs`` defines one (no leading zero, at most 18 digits), bounded by dots.
_NUMERIC = re.compile(r"(?<![^.])(?:0|[1-9][0-9]{0,17})(?![^.])")


def mask(name: str) -> str:
    """``name`` with every numeric component replaced by the marker (``rust/keys.rs``'s template of it)."""
    return _NUMERIC.sub(MARKER, name)


def _class_digits(items: Any) -> str:
    """Which ASCII digits a character class (``IN`` items) matches: ``"none"``, ``"all"`` or ``"some"``."""
    negate = False
    hit: set[str] = set()
    categories = {
        _sre.CATEGORY_DIGIT: True,
        _sre.CATEGORY_WORD: True,
        _sre.CATEGORY_NOT_SPACE: True,
        _sre.CATEGORY_NOT_DIGIT: False,
        _sre.CATEGORY_NOT_WORD: False,
        _sre.CATEGORY_SPACE: False,
    }
    for op, arg in items:
        if op is _sre.NEGATE:
            negate = True
        elif op is _sre.LITERAL:
            if chr(arg) in _DIGITS:
                hit.add(chr(arg))
        elif op is _sre.RANGE:
            hit.update(d for d in _DIGITS if arg[0] <= ord(d) <= arg[1])
        elif op is _sre.CATEGORY:
            if arg not in categories:
                return "some"  # a category whose digits this does not know: not blind
            if categories[arg]:
                hit.update(_DIGITS)
        else:
            return "some"
    if negate:
        hit = set(_DIGITS) - hit
    return "all" if len(hit) == 10 else "none" if not hit else "some"


def _atom(op: Any, arg: Any) -> str | None:
    """The digits a one-character token matches (``"none"``/``"all"``/``"some"``), None for other tokens."""
    if op is _sre.LITERAL:
        return "some" if chr(arg) in _DIGITS else "none"
    if op is _sre.NOT_LITERAL:
        return "some" if chr(arg) in _DIGITS else "all"
    if op is _sre.ANY:
        return "all"
    if op is _sre.IN:
        return _class_digits(arg)
    return None


def _plain(op: Any, arg: Any) -> bool:
    """A literal that is neither a digit nor a dot: the character before or after it is never part of a
    numeric component (those are bounded by dots)."""
    return op is _sre.LITERAL and chr(arg) not in _DIGITS and chr(arg) != "."


def _fixed_digits(tokens: list[tuple[Any, Any]]) -> bool:
    """Whether ``tokens`` open with digit literals and then a plain literal (``1w`` of ``w.1w``): such digits
    are never part of a numeric component."""
    for op, arg in tokens:
        if op is not _sre.LITERAL:
            return False
        if chr(arg) not in _DIGITS:
            return _plain(op, arg)
    return False


_STARTS = {_sre.AT_BEGINNING, _sre.AT_BEGINNING_STRING, _sre.AT_BEGINNING_LINE}


_ENDS = {_sre.AT_END, _sre.AT_END_STRING, _sre.AT_END_LINE}


def _blind(tokens: list[tuple[Any, Any]], after_plain: bool, after_repeat: bool) -> bool:
    """Whether the token sequence matches number-blindly, given whether the token before it matched a
    character that is no part of a number and no dot (``after_plain``: a letter, or a digit of ``w1``) or was
    an unbounded repeat of a digit-matching atom (``after_repeat``)."""
    if not tokens:
        return True  # the end of the pattern: a greedy repeat before it took the whole tail
    (op, arg), rest = tokens[0], tokens[1:]
    if op is _sre.SUBPATTERN:
        return _blind(list(arg[-1]) + rest, after_plain, after_repeat)
    if op is _sre.BRANCH:
        return all(_blind(list(alt) + rest, after_plain, after_repeat) for alt in arg[1])
    if after_repeat:  # what may follow `.*` / `\d+`: something that cannot end it inside a number
        single = _atom(op, arg) if op is not _sre.LITERAL else None
        follows = (
            (op is _sre.LITERAL and chr(arg) not in _DIGITS)
            or single == "none"
            or (single == "all" and bool(rest) and _plain(*rest[0]))  # `.*.w2`: that one is before the w
            or (op is _sre.AT and arg in _ENDS)
            or (op in (_sre.ASSERT, _sre.ASSERT_NOT) and arg[0] == 1 and len(arg[1]) == 1)
        )
        if not follows:
            return False
        if op in (_sre.ASSERT, _sre.ASSERT_NOT):
            inner = next(iter(arg[1]))
            digits = _atom(*inner)
            if digits != ("none" if op is _sre.ASSERT else "all"):
                return False
    if op is _sre.LITERAL:
        if chr(arg) in _DIGITS and not after_plain and not _fixed_digits(rest):
            return False  # a digit that could be (part of) a layer or expert number
        return _blind(rest, _plain(op, arg) or chr(arg) in _DIGITS, False)
    digits = _atom(op, arg)
    if digits is not None:  # one character
        if digits == "some":
            return False
        if digits == "all" and not after_plain and not (rest and _plain(*rest[0])):
            return False  # it could match one digit of a number (of one length but not another)
        return _blind(rest, False, False)
    if op in (_sre.MAX_REPEAT, _sre.MIN_REPEAT):
        low, high, sub = arg
        sub = list(sub)
        if len(sub) != 1 or _atom(*sub[0]) is None:
            return False
        digits = _atom(*sub[0])
        if digits == "some":
            return False
        if digits == "none":
            return _blind(rest, False, False)
        if high != _sre.MAXREPEAT or low > 1 or (op is _sre.MIN_REPEAT and not rest):
            return False
        return _blind(rest, False, True)
    if op is _sre.AT:
        if arg in _STARTS:
            return _blind(rest, False, False)
        return arg in _ENDS and _blind(rest, False, False)
    if op in (_sre.ASSERT, _sre.ASSERT_NOT):
        direction, sub = arg
        sub = list(sub)
        if direction != 1 or len(sub) != 1 or _atom(*sub[0]) in (None, "some"):
            return False
        return _blind(rest, after_plain, False)
    return False  # back references, atomic groups, possessive repeats, lookbehinds, word boundaries


@functools.lru_cache(maxsize=4096)
def number_blind(pattern: str, flags: int = 0) -> bool:
    """Whether ``re.search(pattern, key)`` is the same for every key of one template: it matches all of them
    or none, at the same place relative to the template's text, in the same branch, with whole numbers inside
    or outside the match. A conservative test on the parsed regex: digit literals only next to a letter
    (``w1``), no class matching some digits but not all, a digit-matching atom only as an unbounded repeat
    (``.*``, ``\\d+``, ``[^.]+``) that nothing can end inside a number, or as one character next to a letter
    (``.`` in ``mlp.experts``), no back reference, lookbehind or word boundary. Transformers' conversion
    patterns pass."""
    try:
        parsed = _sre_parse.parse(pattern, flags)
    except Exception:  # pragma: no cover - whatever re compiled, its parser parses
        return False
    return _blind(list(parsed), False, False)


class _Template:
    """Keys of one template in their current (renamed) form: ``text`` with markers, the key-number column of
    each marker (``slots``), the keys (indices into the name list) and the matched converter."""

    __slots__ = ("keys", "match", "origin", "slots", "text")

    def __init__(self, text: str, slots: list[int], keys: np.ndarray[Any, Any], origin: str) -> None:
        self.text = text
        self.slots = slots
        self.keys = keys
        self.origin = origin  # the template of the keys' names before any renaming
        self.match: tuple[Any, str | None] | None = None


def _fill(text: str, numbers: Sequence[int]) -> tuple[str, list[tuple[int, int, int]]]:
    """The name of ``text`` with ``numbers`` in its markers, and each marker's (name start, name end,
    template position)."""
    pieces = text.split(MARKER)
    out = [pieces[0]]
    at = len(pieces[0])
    spans = []
    tpos = len(pieces[0])
    for number, piece in zip(numbers, pieces[1:], strict=True):
        digits = str(number)
        spans.append((at, at + len(digits), tpos))
        out.append(digits)
        out.append(piece)
        at += len(digits) + len(piece)
        tpos += 1 + len(piece)
    return "".join(out), spans


def _whole_markers(text: str) -> bool:
    """Every marker of ``text`` is a whole dotted component."""
    n = len(text)
    return all(
        (i == 0 or text[i - 1] == ".") and (i == n - 1 or text[i + 1] == ".") for i in range(n) if text[i] == MARKER
    )


def _renamed(
    template: _Template, name: str, spans: list[tuple[int, int, int]], match: Any, replacement: str
) -> str | None:
    """The template's text with ``match`` replaced, or None when the template cannot be renamed as a whole
    (the caller splits it into its keys). ``name`` and ``spans``: its first key's name and the markers' places
    in it (``_fill``), where ``match`` was found."""
    start, end = match.span()
    shift_start = shift_end = 0
    for a, b, _ in spans:
        if a < start < b or a < end < b:
            return None  # the match cuts a number
        if b <= start:
            shift_start += (b - a) - 1
        if b <= end:
            shift_end += (b - a) - 1
    t_start, t_end = start - shift_start, end - shift_end
    text = template.text
    matched = text[t_start:t_end]
    # transformers replaces the first occurrence of the matched text: it is the match in every key when
    # the match opens with plain text found nowhere earlier in the template (see the module docstring).
    lead = 0
    while lead < len(matched) and matched[lead] != MARKER and matched[lead] not in _DIGITS:
        lead += 1
    if lead == 0 or text.find(matched[:lead]) != t_start or name.find(match.group(0)) != start:
        return None
    new = text[:t_start] + replacement + text[t_end:]
    if not _whole_markers(new):
        return None
    template.slots = [s for (_, _, p), s in zip(spans, template.slots, strict=True) if p < t_start or p >= t_end]
    return new


def _split(template: _Template, numbers: np.ndarray[Any, Any]) -> list[_Template]:
    """One template per key (current name as text, no markers)."""
    out = []
    for i in template.keys.tolist():
        name, _ = _fill(template.text, numbers[i, template.slots].tolist())
        single = _Template(name, [], np.array([i], dtype=np.int64), template.origin)
        single.match = template.match
        out.append(single)
    return out


def _apply(
    templates: list[_Template],
    numbers: np.ndarray[Any, Any],
    rule: Any,
    blind: bool,
    converter: bool,
    limit: int,
) -> list[_Template] | None:
    """``rule`` applied to every template (converters: to those no converter matched yet); None when its
    replacement text has the marker, or when splitting templates into keys would leave more than ``limit``
    templates (the per-key path is then cheaper). ``blind``: the rule is a plain, number-blind regex rename."""
    literals = rule.literals
    search = rule.rule.compiled_sources.search if blind else None
    replacement = rule.rule.target_patterns[0] if blind else ""
    if MARKER in replacement:
        return None
    out: list[_Template] = []
    used = False
    for template in templates:
        if converter and template.match is not None:
            out.append(template)
            continue
        name, spans = _fill(template.text, numbers[template.keys[0], template.slots].tolist())
        if (
            literals is not None
            and not any(lit in name for lit in literals)
            and (not template.slots or not any(_DIGITS.intersection(lit) for lit in literals))
        ):
            out.append(template)  # no key of it can contain a digit-free literal its first key lacks
            continue
        if search is not None:
            match = search(name)
            if match is None:
                out.append(template)
                continue
            pattern = _source_pattern(rule.rule, match)
            text = _renamed(template, name, spans, match, replacement) if pattern is not None else None
            if text is not None:
                used = True
                template.text = text
                if converter:
                    template.match = (rule.rule, pattern)
                out.append(template)
                continue
        if template.slots and len(out) + len(template.keys) + 1 > limit:
            return None
        pieces = _split(template, numbers) if template.slots else [template]
        for piece in pieces:  # one key: the rule exactly as the per-key path applies it
            new, pattern = rule.rule.rename_source_key(piece.text)
            if pattern is not None:
                used = True
                if MARKER in new:
                    return None
                piece.text = new
                if converter:
                    piece.match = (rule.rule, pattern)
            out.append(piece)
    if used:
        object.__setattr__(rule.rule, "_was_used", True)
    return out


def _source_pattern(rule: Any, match: Any) -> str | None:
    """The source pattern of the branch that matched (transformers names branch ``k`` ``g<k>``), as the
    per-key path finds it; None for a regex of another form (the template is split)."""
    group = match.lastgroup
    if not group or group[0] != "g" or not group[1:].isdigit() or int(group[1:]) >= len(rule.source_patterns):
        return None
    return str(rule.source_patterns[int(group[1:])])


def template_groups(
    originals: Sequence[str],
    names: list[str],
    targets: Collection[str],
    renamings: Sequence[Any],
    converters: Sequence[Any],
    prefix: str | None,
    normalize: Callable[[str], str],
    make_group: Any,
) -> tuple[list[Any], list[str]] | None:
    """``build_groups``' result for ``names`` (``originals``: the checkpoint keys they stand for), or None
    when the per-key path must decide. ``renamings`` / ``converters``: ``groups._Prefiltered`` rules, in
    order; ``normalize(name)``: the base-model prefix normalization of a renamed name (``prefix`` is that
    prefix); ``make_group(target, rule, sources)`` builds a ``LoadGroup``."""
    made = _core.key_templates(names)
    target_made = _core.key_templates(list(targets))
    if made is None or target_made is None:
        return None
    texts, ids_bytes, numbers_bytes, width = made
    ids = np.frombuffer(ids_bytes, dtype=np.uint32)
    numbers = np.frombuffer(numbers_bytes, dtype=np.int64).reshape(len(names), width)
    target_texts = set(target_made[0])
    dotted = f"{prefix}." if prefix else ""
    if mask(dotted) != dotted or MARKER in dotted:
        return None  # a prefix with a number in it: whether a name starts with it is not the template's to say
    order = np.argsort(ids, kind="stable")
    bounds = np.cumsum(np.bincount(ids, minlength=len(texts)))
    templates = []
    start = 0
    for text, end in zip(texts, bounds.tolist(), strict=True):
        templates.append(_Template(text, list(range(text.count(MARKER))), order[start:end], text))
        start = end
    # Rules that see numbers split templates into keys; past a quarter of the keys as templates, the per-key
    # path (one C-level pass per rule) is the cheaper of the two.
    limit = max(SPLIT_FLOOR, len(names) // 4)
    for rule in renamings:
        applied = _apply(templates, numbers, rule, rule.direct and _rule_blind(rule), False, limit)
        if applied is None:
            return None
        templates = applied
    for rule in converters:
        applied = _apply(templates, numbers, rule, rule.direct and _rule_blind(rule), True, limit)
        if applied is None:
            return None
        templates = applied

    # Each template's distinct final names: a group each when a target (or a multi-target converter's).
    gid = np.full(len(names), -1, dtype=np.int64)
    group_of: dict[str, int] = {}
    group_rule: list[Any] = []
    group_target: list[str] = []
    pattern_of = np.empty(len(names), dtype=object)  # the source pattern of each grouped key (None: itself)
    # Keys left out (and multi-target converter keys whose name is not a target), by their names' template.
    unexpected_checks: list[tuple[str, np.ndarray[Any, Any]]] = []
    for template in templates:
        rule, pattern = template.match if template.match is not None else (None, None)
        multi = rule is not None and len(rule.target_patterns) > 1
        text = template.text
        stripped = text[len(dotted) :] if dotted and text.startswith(dotted) else None
        candidates = [text] + ([stripped] if stripped is not None else []) + ([dotted + text] if dotted else [])
        if not multi and template.slots and not any(mask(c) in target_texts for c in candidates):
            unexpected_checks.append((template.origin, template.keys))
            continue
        unique, inverse = _distinct_rows(numbers[template.keys][:, template.slots])
        row_gid = np.full(len(unique), -1, dtype=np.int64)
        absent = np.zeros(len(unique), dtype=bool)
        for u, row in enumerate(unique.tolist()):
            name, _ = _fill(text, row)
            final = normalize(name)
            if final not in targets:
                absent[u] = True
                if not multi:
                    continue
            g = group_of.get(final)
            if g is None:
                g = group_of[final] = len(group_target)
                group_target.append(final)
                group_rule.append(rule)
            elif group_rule[g] is not rule:
                return None  # two rules map to one target: the per-key path names the keys
            row_gid[u] = g
        picked = row_gid[inverse]
        gid[template.keys] = picked
        if absent.any():
            unexpected_checks.append((template.origin, template.keys[absent[inverse]]))
        if pattern is not None:
            pattern_of[template.keys] = pattern
    # A key left out whose own name is a target: the per-key path loads it under that name.
    for origin, left in unexpected_checks:
        if origin in target_texts and any(map(targets.__contains__, map(names.__getitem__, left.tolist()))):
            return None
    kept = np.flatnonzero(gid >= 0)
    if len(kept) == 0:
        return [], list(originals)
    by_group = kept[np.argsort(gid[kept], kind="stable")]
    counts = np.bincount(gid[kept], minlength=len(group_target))
    firsts = by_group[np.concatenate(([0], np.cumsum(counts)[:-1]))]
    keys = list(map(originals.__getitem__, by_group.tolist()))
    patterns: list[Any] = pattern_of[by_group].tolist()
    groups = []
    start = 0
    for g, count in enumerate(counts.tolist()):
        end = start + count
        rule = group_rule[g]
        if rule is None:
            if count > 1:
                return None  # several keys map to one target: the per-key path raises
            groups.append(make_group(group_target[g], None, [(keys[start], keys[start])]))
        else:
            sources = list(zip(patterns[start:end], keys[start:end], strict=True))
            groups.append(make_group(group_target[g], rule, sources))
        start = end
    groups = [groups[g] for g in np.argsort(firsts, kind="stable").tolist()]
    unexpected = list(map(originals.__getitem__, np.flatnonzero(gid < 0).tolist()))
    return groups, unexpected


def _distinct_rows(rows: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """``np.unique(rows, axis=0, return_inverse=True)``, in one pass when equal rows are already adjacent in
    sorted order (keys come in natural order, so a template's rows do unless a dropped number came first)."""
    if rows.shape[1] == 0:
        return np.zeros((1, 0), dtype=np.int64), np.zeros(len(rows), dtype=np.int64)
    step = rows[1:] - rows[:-1]
    changed = step != 0
    moved = changed.any(axis=1)
    first = np.argmax(changed, axis=1)
    if bool((step[np.arange(len(step)), first][moved] > 0).all()):
        inverse = np.concatenate(([0], np.cumsum(moved)))
        return rows[np.concatenate(([True], moved))], inverse
    unique, inverse = np.unique(rows, axis=0, return_inverse=True)
    return unique, inverse.reshape(-1)


def _rule_blind(rule: Any) -> bool:
    compiled = rule.rule.compiled_sources
    return number_blind(compiled.pattern, compiled.flags)
