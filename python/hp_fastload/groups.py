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
from typing import Any

from .rules import is_converter, is_renaming

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


def rename_key(
    key: str,
    renamings: Sequence[Any],
    converters: Sequence[Any],
    base_model_prefix: str | None,
    targets: Collection[str],
) -> tuple[str, Any | None, str | None]:
    """``(renamed key, matched converter or None, matched source pattern or None)`` for one key."""
    renamed = key
    for renaming in renamings:
        renamed, _ = renaming.rename_source_key(renamed)
    matched = None
    pattern = None
    for converter in converters:
        candidate, pattern = converter.rename_source_key(renamed)
        if pattern is not None:
            renamed, matched = candidate, converter
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
) -> tuple[list[LoadGroup], list[str]]:
    """Group checkpoint ``keys`` (already in natural order) by the target they rename to.

    Returns ``(groups in first-key order, unexpected checkpoint keys)``. A key whose renamed name is not a
    target is unexpected, unless its converter has several targets, in which case the group is kept and
    the converted outputs decide (one of them may exist).
    """
    renamings = [r for r in rules if is_renaming(r)]
    converters = [r for r in rules if is_converter(r)]
    groups: dict[str, LoadGroup] = {}
    unexpected: list[str] = []
    for key in keys:
        name = map_key(key) if map_key is not None else key
        if name is None:
            continue
        renamed, converter, pattern = rename_key(name, renamings, converters, base_model_prefix, targets)
        if renamed not in targets and (converter is None or len(converter.target_patterns) == 1):
            unexpected.append(key)
            continue
        group = groups.get(renamed)
        if group is None:
            group = groups[renamed] = LoadGroup(renamed, converter)
        elif group.rule is not converter:
            raise ValueError(
                f"checkpoint keys {group.keys[0]!r} and {key!r} both map to {renamed!r} "
                f"through different rules ({group.rule!r} and {converter!r})"
            )
        group.sources.append((pattern if pattern is not None else key, key))
    for group in groups.values():
        if group.rule is None and len(group.sources) > 1:
            raise ValueError(f"checkpoint keys {', '.join(repr(k) for k in group.keys)} all map to {group.target!r}")
    return list(groups.values()), unexpected


def masked_name(name: str) -> str:
    """``name`` with every numeric dotted part replaced by ``#`` (a layer-independent cache key)."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)", "#", name)
