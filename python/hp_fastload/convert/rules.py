"""Conversion rules: key renamings and layout converters, with transformers v5 semantics.

This module owns hp_fastload's own rule classes (``WeightRenaming``, ``WeightConverter`` and the layout
ops) for use without transformers, and the resolution of the rule list for a model. When transformers is
installed, its own objects are accepted as they are: the loader only relies on the duck-typed surface
both share (``rename_source_key``, ``source_patterns``, ``target_patterns``, ``operations``,
``scope_prefix``, ``add_tensor``, ``convert``, ``was_used``).

Matching semantics (the same as transformers 5.x): source patterns are regexes searched anywhere in the
key; ``*.`` matches any dotted run (``experts.*.w1`` matches every expert); a pattern ending in an
alphanumeric gets a name-boundary guard (``weight`` does not match ``weight_scale_inv``); the first match
is replaced by the first target pattern (``\1`` filled from the one capture group); a ``scope_prefix``
limits a rule to keys under that module. Renamings chain in order, then at most one converter applies.

It does not read tensors or decide regions: see ``convert.groups`` and ``planning``.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeGuard

import torch

from hp_fastload.convert.ops import (
    Chunk,
    Concatenate,
    ConversionOp,
    FuseGroupedQKV,
    Interleave,
    MergeModulelist,
    PermuteForRope,
    Split,
    SplitModulelist,
    Transpose,
)
from hp_fastload.model.wrappers import own_class


def _strip_target_pattern(pattern: str) -> tuple[str, str | None]:
    """Normalize a target pattern: drop ``^``, lookarounds; the first group becomes ``\\1``."""
    pattern = pattern.removeprefix("^")
    pattern = re.sub(r"\(\?.+?\)?\)", "", pattern)
    group = re.search(r"\(.+?\)", pattern)
    captured = None
    if group:
        captured = group.group(0)
        pattern = pattern.replace(captured, r"\1", 1)
    return pattern.replace(r"\.", "."), captured


class Transform:
    """Shared matching machinery of renamings and converters."""

    operations: list[ConversionOp]

    def __init__(self, source_patterns: str | Sequence[str], target_patterns: str | Sequence[str]) -> None:
        sources = [source_patterns] if isinstance(source_patterns, str) else list(source_patterns)
        targets = [target_patterns] if isinstance(target_patterns, str) else list(target_patterns)
        if not sources or not targets:
            raise ValueError(f"{type(self).__name__} needs at least one source and one target pattern")
        self._original_source_patterns = list(sources)
        self._original_target_patterns = list(targets)
        captures = set()
        for i, pattern in enumerate(targets):
            targets[i], captured = _strip_target_pattern(pattern)
            if captured is not None:
                captures.add(captured)
        if len(captures) > 1:
            raise ValueError(f"target patterns use different capture groups: {sorted(captures)}")
        capture = next(iter(captures), None)
        for i, pattern in enumerate(sources):
            if r"\1" in pattern:
                if capture is None:
                    raise ValueError(f"source pattern {pattern!r} uses \\1 but no target pattern has a group")
                pattern = pattern.replace(r"\1", capture, 1)
            if len(sources) == len(targets) and self._original_target_patterns[i].startswith("^"):
                pattern = pattern if pattern.startswith("^") else "^" + pattern
            sources[i] = pattern
        self.source_patterns: list[str] = sources
        self.target_patterns: list[str] = targets
        branches = []
        for i, pattern in sorted(enumerate(sources), key=lambda item: -len(item[1])):
            regex = pattern.replace("*.", r".*\.")
            if re.search(r"[a-zA-Z0-9]$", regex):
                regex += r"(?!\w)"
            branches.append(f"(?P<g{i}>{regex})")
        self.compiled_sources = re.compile("|".join(branches))
        self.scope_prefix: str | None = None
        self.base_model_prefix: str | None = None
        self.collected_tensors: dict[str, list[Any]] = defaultdict(list)
        self.layer_targets: dict[str, set[str]] = defaultdict(set)
        self._was_used = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(source_patterns={self.source_patterns}, target_patterns={self.target_patterns})"

    def rename_source_key(self, source_key: str) -> tuple[str, str | None]:
        """Rename ``source_key``; return ``(new_key, matched source pattern or None)``."""
        prefix = None
        key = source_key
        if self.scope_prefix is not None:
            scope = f"{self.scope_prefix}." if self.scope_prefix else ""
            base = f"{self.base_model_prefix}." if self.base_model_prefix else ""
            if key.startswith(base + scope):
                prefix = base + scope
            elif key.startswith(scope):
                prefix = scope
            else:
                return source_key, None
            key = key.removeprefix(prefix)
        match = self.compiled_sources.search(key)
        if match is None:
            return source_key, None
        self._was_used = True
        group = next(name for name, value in match.groupdict().items() if value is not None)
        pattern = self.source_patterns[int(group[1:])]
        replacement = self.target_patterns[0]
        if r"\1" in replacement:
            replacement = replacement.replace(r"\1", match.group(self.compiled_sources.groupindex[group] + 1))
        renamed = key.replace(match.group(0), replacement, 1)
        return (prefix + renamed if prefix is not None else renamed), pattern

    def add_tensor(self, target_key: str, source_key: str, source_pattern: str, value: Any) -> None:
        self.collected_tensors[source_pattern].append(value)
        self.layer_targets[target_key].add(source_key)

    def _take_collected(self) -> dict[str, list[Any]]:
        collected = {}
        for pattern in list(self.collected_tensors):
            values = self.collected_tensors.pop(pattern)
            collected[pattern] = [v() if callable(v) and not isinstance(v, torch.Tensor) else v for v in values]
        return collected

    def was_used(self) -> bool:
        return self._was_used


class WeightRenaming(Transform):
    """Rename keys only: ``WeightRenaming(r"\\.block_sparse_moe\\.", ".mlp.")``."""

    def convert(self, layer_name: str, model: Any = None, config: Any = None, **_: Any) -> dict[str, list[Any]]:
        collected = self._take_collected()
        return {self.target_patterns[0]: collected[self.source_patterns[0]]}


class WeightConverter(Transform):
    """Rename keys and run layout ops on the collected tensors (stack experts, fuse or split q/k/v, ...)."""

    def __init__(
        self,
        source_patterns: str | Sequence[str],
        target_patterns: str | Sequence[str],
        operations: Sequence[ConversionOp],
    ) -> None:
        super().__init__(source_patterns, target_patterns)
        if not operations:
            raise ValueError("WeightConverter requires at least one operation")
        if len(self.source_patterns) > 1 and len(self.target_patterns) > 1:
            raise ValueError(
                f"source patterns {self.source_patterns} and target patterns {self.target_patterns}: "
                "a converter is one-to-one, one-to-many or many-to-one"
            )
        self.operations = list(operations)

    def convert(self, layer_name: str, model: Any = None, config: Any = None, **_: Any) -> dict[str, Any]:
        collected: dict[str, Any] = self._take_collected()
        for op in self.operations:
            collected = op.convert(
                collected,
                source_patterns=self.source_patterns,
                target_patterns=self.target_patterns,
                full_layer_name=layer_name,
                model=model,
                config=config,
            )
        full_name = layer_name.replace("*.", "0.")
        for out_pattern in collected:
            if out_pattern in full_name:
                head, _sep, tail = full_name.partition(out_pattern)
                return {head + k + tail: v for k, v in collected.items()}
        return collected


class Rule(Protocol):
    """The surface the loader relies on, shared by hp_fastload's rule classes and transformers' own
    ``WeightRenaming`` / ``WeightConverter`` (which are accepted as they are, never wrapped)."""

    source_patterns: list[str]
    target_patterns: list[str]

    def rename_source_key(self, source_key: str) -> tuple[str, str | None]:
        """``(renamed key, the source pattern that matched or None)``; the key unchanged when none matched."""
        ...


class Converter(Rule, Protocol):
    """A rule with layout ops: the keys it renames form one group, converted by ``operations`` in order."""

    operations: list[Any]

    def convert(self, layer_name: str, model: Any = None, config: Any = None, **kwargs: Any) -> Any:
        """Run the ops on the tensors collected with ``add_tensor``."""
        ...

    def add_tensor(self, target_key: str, source_key: str, source_pattern: str, value: Any) -> None:
        """Collect one source tensor for the next ``convert``."""
        ...


def is_renaming(rule: object) -> TypeGuard[Rule]:
    """A renaming: has patterns and ``rename_source_key`` but no ``operations``."""
    return hasattr(rule, "rename_source_key") and not hasattr(rule, "operations")


def is_converter(rule: object) -> TypeGuard[Converter]:
    """A converter: has patterns, ``rename_source_key`` and an op list."""
    return hasattr(rule, "rename_source_key") and isinstance(getattr(rule, "operations", None), list)


_OP_FIELDS: dict[str, tuple[type[ConversionOp], tuple[str, ...]]] = {
    "MergeModulelist": (MergeModulelist, ("dim",)),
    "SplitModulelist": (SplitModulelist, ("dim",)),
    "Concatenate": (Concatenate, ("dim", "num_shards_attribute")),
    "Chunk": (Chunk, ("dim", "num_shards_attribute")),
    "Split": (Split, ("dim",)),
    "Transpose": (Transpose, ("dim0", "dim1", "check_dims")),
    "PermuteForRope": (PermuteForRope, ("subconfig_key", "permute_layer_names", "inverse")),
    "Interleave": (Interleave, ("dim", "inverse")),
    "FuseGroupedQKV": (FuseGroupedQKV, ("num_heads", "num_kv_heads", "inverse")),
}


def from_transformers(rule: Any) -> Any:
    """hp_fastload's own equivalent of a transformers ``WeightRenaming`` / ``WeightConverter``.

    Ops without an equivalent here are kept as they are (they still run, through the deferred path).
    Renamings of subclasses with their own matching (``GroupWeightRename``, ``PrefixChange``...) are
    returned unchanged, since their semantics are not the plain regex ones.
    """
    name = type(rule).__name__
    sources = list(getattr(rule, "_original_source_patterns", rule.source_patterns))
    targets = list(getattr(rule, "_original_target_patterns", rule.target_patterns))
    own: Transform
    if name == "WeightRenaming":
        own = WeightRenaming(sources, targets)
    elif name == "WeightConverter":
        ops: list[Any] = []
        for op in rule.operations:
            spec = _OP_FIELDS.get(type(op).__name__)
            if spec is None:
                ops.append(op)
            else:
                cls, fields = spec
                ops.append(cls(**{f: getattr(op, f) for f in fields}))
        own = WeightConverter(sources, targets, ops)
    else:
        return rule
    own.scope_prefix = rule.scope_prefix
    own.base_model_prefix = rule.base_model_prefix
    return own


def _own_class_view(model: Any) -> Any:
    """``model`` as transformers would see it unwrapped: every module whose class a wrapper swapped (``fully_shard``'s
    ``FSDP<Class>``, see ``own_class``) seen as an instance of its own class.

    transformers looks the conversion rules up by ``type(module).__name__`` and skips classes defined outside
    ``transformers.``; a root wrapped by ``fully_shard`` is ``FSDP<Class>`` from ``torch.distributed`` and would
    lose every class-level rule. Whatever else transformers reads of the model, in any release (``named_modules``,
    ``modules``, ``config``, ``is_custom_code``, the fused modules' attributes...), must still answer as the model
    itself. So the view is no hand-made stand-in with a few methods: each swapped module (and each ancestor of
    one) is a new instance of its own class whose instance dict is a shallow copy of the module's (the same
    config, parameters, buffers and hooks), its children replaced by their views; every untouched subtree is the
    user's module itself. Nothing of the user's model is modified, and no ``__init__`` runs."""
    views: dict[int, Any] = {}

    def view(module: Any) -> Any:
        key = id(module)
        if key in views:
            return views[key]
        children = getattr(module, "_modules", None) or {}
        viewed = {name: (view(child) if child is not None else None) for name, child in children.items()}
        cls: Any = own_class(module)
        if cls is type(module) and all(viewed[name] is child for name, child in children.items()):
            views[key] = module
            return module
        stand_in: Any = cls.__new__(cls)
        state = stand_in.__dict__
        state.update(module.__dict__)
        state["_modules"] = viewed
        views[key] = stand_in
        return stand_in

    return view(model)


def _transformers_mapping(model: Any, key_mapping: Mapping[str, str] | None) -> list[Any] | None:
    if "transformers" not in sys.modules:  # a PreTrainedModel implies transformers is imported; don't pay 4-10 s
        return None
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    return list(
        get_model_conversion_mapping(_own_class_view(model), key_mapping=dict(key_mapping) if key_mapping else None)
    )


def resolve_mapping(
    model: Any,
    weights_mapping: Iterable[Any] | None,
    key_mapping: Mapping[str, str] | None = None,
) -> list[Any]:
    """The ordered rule list for ``model``.

    ``weights_mapping=None``: the model's transformers conversion mapping when transformers is installed
    and ``model`` is a ``PreTrainedModel`` (``key_mapping`` first, as transformers does), looked up by the
    model's own classes whatever wraps them (``fully_shard``'s ``FSDP<Class>``, see ``own_class``), else only the
    ``key_mapping`` renamings. An explicit list: ``key_mapping`` renamings first, then the list. Rules
    that are neither a renaming nor a converter raise ``ValueError`` naming their types.
    """
    rules: list[Any]
    if weights_mapping is None:
        default = _transformers_mapping(model, key_mapping)
        if default is not None:
            rules = default
        else:
            rules = [WeightRenaming(src, dst) for src, dst in (key_mapping or {}).items()]
    else:
        rules = [WeightRenaming(src, dst) for src, dst in (key_mapping or {}).items()]
        rules.extend(weights_mapping)
    unique: list[Any] = []
    seen: set[int] = set()
    for rule in rules:
        if id(rule) not in seen:
            seen.add(id(rule))
            unique.append(rule)
    bad = sorted({type(r).__name__ for r in unique if not (is_renaming(r) or is_converter(r))})
    if bad:
        raise ValueError(
            f"Unsupported weight transforms: {', '.join(bad)} (expected WeightRenaming or WeightConverter)"
        )
    return unique
