"""Load groups: which checkpoint keys fill which model tensors, through which rule.

Owns the transformers-compatible key resolution (renamings chained, then at most one converter, then the
base-model prefix) over the header key list, in natural order, and the grouping of keys by renamed target:
every key that renames to one target joins one group (many -> one: expert stacks, q/k/v fusion); a converter
with several targets is one group with several outputs (one -> many). No tensor is read here.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import contains
from typing import Any

from hp_fastload.convert.patterns import Prefiltered
from hp_fastload.convert.rules import is_converter, is_renaming
from hp_fastload.convert.templates import template_groups
from hp_fastload.errors import shown_key


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


def prefix_normalize(key: str, prefix: str | None, targets: Collection[str]) -> str:
    if not prefix:
        return key
    if key.startswith(prefix + "."):
        stripped = key[len(prefix) + 1 :]
        if stripped in targets:
            return stripped
    if f"{prefix}.{key}" in targets:
        return f"{prefix}.{key}"
    return key


def normalized(names: list[str], prefix: str | None, targets: Collection[str]) -> list[str]:
    """``prefix_normalize`` of every name, through one dict lookup each (in C) unless some target carries the
    prefix twice: a name that carries it once can only lose it (when the rest is a target without it, like
    ``lm_head.weight``), a name without it can only gain it (when the prefixed name is a target)."""
    if not prefix:
        return names
    dotted = prefix + "."
    doubled = dotted + dotted
    if any(t.startswith(doubled) for t in targets):
        return [prefix_normalize(n, prefix, targets) for n in names]
    cut = len(dotted)
    change = {dotted + t: t for t in targets if not t.startswith(dotted)}
    change.update((t[cut:], t) for t in targets if t.startswith(dotted))
    out = list(map(change.get, names, names))
    for i in compress(range(len(names)), map(str.startswith, names, repeat(doubled))):
        out[i] = prefix_normalize(names[i], prefix, targets)
    return out


def rename_key(
    key: str,
    renamings: Sequence[Any],
    converters: Sequence[Any],
    base_model_prefix: str | None,
    targets: Collection[str],
) -> tuple[str, Any | None, str | None]:
    """``(renamed key, matched converter or None, matched source pattern or None)`` for one key.

    ``renamings`` / ``converters`` are rule objects, or ``Prefiltered`` wrappers of them (``build_groups``
    wraps them once for a whole key list).
    """
    renamed = key
    for renaming in renamings:
        if isinstance(renaming, Prefiltered):
            renamed, _ = renaming.rename(renamed)
        else:
            renamed, _ = renaming.rename_source_key(renamed)
    matched = None
    pattern = None
    for converter in converters:
        if isinstance(converter, Prefiltered):
            candidate, pattern = converter.rename(renamed)
            rule = converter.rule
        else:
            candidate, pattern = converter.rename_source_key(renamed)
            rule = converter
        if pattern is not None:
            renamed, matched = candidate, rule
            break
    renamed = prefix_normalize(renamed, base_model_prefix, targets)
    if renamed not in targets and key in targets:
        # The checkpoint already uses the model's names: a rule that would misfire must not win.
        return prefix_normalize(key, base_model_prefix, targets), None, None
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
    renamings = [Prefiltered(r) for r in rules if is_renaming(r)]
    converters = [Prefiltered(r) for r in rules if is_converter(r)]
    if templates:
        templated = template_groups(
            originals,
            names,
            targets,
            renamings,
            converters,
            base_model_prefix,
            lambda name: prefix_normalize(name, base_model_prefix, targets),
            LoadGroup,
        )
        if templated is not None:
            return templated
    # The per-key path. One pass per rule over all keys: renamings chain in order, then the first converter
    # that matches.
    current = list(names)
    # Most rules of a mapping match nothing in a given checkpoint: one substring test on all keys joined
    # rules them out (instead of a scan per key and literal). Rebuilt after a renaming.
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
    finals = normalized(renamed, base_model_prefix, targets)
    present = list(map(contains, repeat(targets), finals))
    converter: Any
    for key, target, hit, name, here in zip(originals, finals, matched, names, present, strict=True):
        if not here:
            if name in targets:
                # The checkpoint already uses the model's names: a rule that would misfire must not win.
                target, hit = prefix_normalize(name, base_model_prefix, targets), None
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
