"""Conversion rules: key renamings and layout converters, with transformers v5 semantics.

This module owns hp_fastload's own rule classes (``WeightRenaming``, ``WeightConverter`` and the layout
ops) for use without transformers, and the resolution of the rule list for a model. When transformers is
installed, its own objects are accepted as they are: the loader only relies on the duck-typed surface
both share (``rename_source_key``, ``source_patterns``, ``target_patterns``, ``operations``,
``scope_prefix``, ``add_tensor``, ``convert``, ``was_used``).

Matching semantics (the same as transformers 5.x): source patterns are regexes searched anywhere in the
key; ``*.`` matches any dotted run (``experts.*.w1`` matches every expert); a pattern ending in an
alphanumeric gets a name-boundary guard (``weight`` does not match ``weight_scale_inv``); the first match
is replaced by the first target pattern (``\\1`` filled from the one capture group); a ``scope_prefix``
limits a rule to keys under that module. Renamings chain in order, then at most one converter applies.

It does not read tensors or decide regions: see ``groups`` and ``plan``.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from .natural import dot_natural_key, natural_sort_key  # re-exported: natural.py owns key order

__all__ = [
    "Chunk",
    "Concatenate",
    "ConversionOp",
    "Interleave",
    "MergeModulelist",
    "PermuteForRope",
    "Split",
    "SplitModulelist",
    "Transpose",
    "WeightConverter",
    "WeightRenaming",
    "dot_natural_key",
    "from_transformers",
    "is_converter",
    "is_renaming",
    "natural_sort_key",
    "own_class",
    "resolve_mapping",
    "unwrapped",
]


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


class _Transform:
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


class WeightRenaming(_Transform):
    """Rename keys only: ``WeightRenaming(r"\\.block_sparse_moe\\.", ".mlp.")``."""

    def convert(self, layer_name: str, model: Any = None, config: Any = None, **_: Any) -> dict[str, list[Any]]:
        collected = self._take_collected()
        return {self.target_patterns[0]: collected[self.source_patterns[0]]}


class WeightConverter(_Transform):
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


def _single(values: Any) -> Any:
    return values[0] if isinstance(values, list) else values


class ConversionOp:
    """A layout op: ``convert(inputs, source_patterns, target_patterns, **kw) -> {pattern: tensor}``."""

    def convert(
        self, inputs: dict[str, Any], source_patterns: list[str], target_patterns: list[str], **kw: Any
    ) -> dict[str, Any]:
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


class MergeModulelist(ConversionOp):
    """Stack each source's list of tensors along ``dim`` (per-expert weights into one [E, ...] tensor)."""

    def __init__(self, dim: int = 0) -> None:
        self.dim = dim

    def convert(
        self, inputs: dict[str, Any], source_patterns: list[str], target_patterns: list[str], **kw: Any
    ) -> dict[str, Any]:
        single = len(inputs) == 1
        if single and len(target_patterns) != 1:
            raise ValueError("MergeModulelist alone needs exactly one target pattern")
        out = {}
        for pattern, values in inputs.items():
            name = target_patterns[0] if single else pattern
            out[name] = values if not isinstance(values, list) else torch.stack(values, dim=self.dim)
        return out


class SplitModulelist(ConversionOp):
    """Unstack along ``dim``: one output per slice, named by replacing ``*`` with the index."""

    def __init__(self, dim: int = 0) -> None:
        self.dim = dim

    def convert(
        self, inputs: dict[str, Any], source_patterns: list[str], target_patterns: list[str], **kw: Any
    ) -> dict[str, Any]:
        out = {}
        for pattern, values in inputs.items():
            tensor = _single(values)
            count = tensor.size(self.dim)
            template = target_patterns[0] if len(inputs) == 1 else pattern
            pieces = torch.chunk(tensor, count, dim=self.dim)
            out.update({template.replace("*", str(i)): p.squeeze(self.dim) for i, p in enumerate(pieces)})
        return out


class Concatenate(ConversionOp):
    """Concatenate the sources, in declared pattern order, along ``dim`` into the one target."""

    def __init__(self, dim: int = 0, num_shards_attribute: str | None = None) -> None:
        self.dim = dim
        self.num_shards_attribute = num_shards_attribute

    def convert(
        self, inputs: dict[str, Any], source_patterns: list[str], target_patterns: list[str], **kw: Any
    ) -> dict[str, Any]:
        if len(target_patterns) != 1:
            raise ValueError("Concatenate needs exactly one target pattern")
        parts: list[Any] = []
        for pattern in source_patterns:
            if pattern in inputs:
                values = inputs.pop(pattern)
                parts.extend(values if isinstance(values, list) else [values])
        return {target_patterns[0]: torch.cat(parts, dim=self.dim)}


class Chunk(ConversionOp):
    """Split the one source into equal pieces along ``dim``, one per target pattern.

    With ``num_shards_attribute``, the count comes from that field of the (text) config and the single
    target pattern's ``*`` is replaced by the piece index.
    """

    def __init__(self, dim: int = 0, num_shards_attribute: str | None = None) -> None:
        self.dim = dim
        self.num_shards_attribute = num_shards_attribute

    def convert(
        self, inputs: dict[str, Any], source_patterns: list[str], target_patterns: list[str], **kw: Any
    ) -> dict[str, Any]:
        if len(inputs) != 1:
            raise ValueError("Chunk takes exactly one source")
        tensor = _single(next(iter(inputs.values())))
        targets = list(target_patterns)
        if self.num_shards_attribute is not None:
            if len(targets) != 1:
                raise ValueError("Chunk with num_shards_attribute needs exactly one target pattern")
            config = kw["config"]
            config = config.get_text_config() if hasattr(config, "get_text_config") else config
            count = int(getattr(config, self.num_shards_attribute))
            targets = [targets[0].replace("*", str(i)) for i in range(count)]
        pieces = torch.chunk(tensor, len(targets), dim=self.dim)
        return {t: p.contiguous() for t, p in zip(targets, pieces, strict=True)}


class Split(ConversionOp):
    """Split the one source along ``dim`` into pieces sized like each target's (global) parameter."""

    def __init__(self, dim: int = 0) -> None:
        self.dim = dim

    def convert(
        self, inputs: dict[str, Any], source_patterns: list[str], target_patterns: list[str], **kw: Any
    ) -> dict[str, Any]:
        if len(inputs) != 1:
            raise ValueError("Split takes exactly one source")
        tensor = _single(next(iter(inputs.values())))
        model, layer = kw["model"], kw["full_layer_name"]
        sizes = [model.get_parameter(layer.replace(target_patterns[0], t)).shape[self.dim] for t in target_patterns]
        pieces = torch.split(tensor, sizes, dim=self.dim)
        return {t: p.contiguous() for t, p in zip(target_patterns, pieces, strict=True)}


class Transpose(ConversionOp):
    """Swap ``dim0`` and ``dim1``; with ``check_dims``, only when the tensor does not already fit the target."""

    def __init__(self, dim0: int = 0, dim1: int = 1, check_dims: bool = False) -> None:
        self.dim0, self.dim1, self.check_dims = dim0, dim1, check_dims

    def convert(
        self, inputs: dict[str, Any], source_patterns: list[str], target_patterns: list[str], **kw: Any
    ) -> dict[str, Any]:
        if len(inputs) != 1:
            raise ValueError("Transpose takes exactly one source")
        if len(target_patterns) > 1:
            if len(source_patterns) != 1:
                raise ValueError("Transpose cannot pick an intermediate pattern")
            name = source_patterns[0]
        else:
            name = target_patterns[0]
        tensor = _single(next(iter(inputs.values())))
        if self.check_dims:
            expected = kw["model"].get_parameter(kw["full_layer_name"]).shape
            if tuple(tensor.shape) == tuple(expected):
                return {name: tensor}
        return {name: torch.transpose(tensor, self.dim0, self.dim1).contiguous()}


class PermuteForRope(ConversionOp):
    """Interleaved-pair RoPE rows to rotate-half order, per attention head (``inverse`` undoes it)."""

    def __init__(
        self,
        subconfig_key: str | None = None,
        permute_layer_names: Sequence[str] | None = None,
        inverse: bool = False,
    ) -> None:
        self.subconfig_key = subconfig_key
        self.permute_layer_names = list(permute_layer_names) if permute_layer_names is not None else None
        self.inverse = inverse

    def _permute(self, tensor: Any, config: Any) -> Any:
        if self.subconfig_key is not None:
            config = getattr(config, self.subconfig_key, config)
        heads = getattr(config, "num_attention_heads", 1)
        rows = tensor.shape[0]
        half = rows // heads // 2
        inner = (2, half) if self.inverse else (half, 2)
        if tensor.ndim == 2:
            return tensor.view(heads, *inner, tensor.shape[1]).transpose(1, 2).reshape(rows, tensor.shape[1])
        if tensor.ndim == 1:
            return tensor.view(heads, *inner).transpose(1, 2).reshape(rows)
        return tensor

    def convert(
        self, inputs: dict[str, Any], source_patterns: list[str], target_patterns: list[str], **kw: Any
    ) -> dict[str, Any]:
        out = {}
        for pattern, values in inputs.items():
            if len(source_patterns) == 1 and len(target_patterns) == 1:
                name = target_patterns[0]
            elif len(source_patterns) == 1 or len(target_patterns) == 1:
                name = pattern
            else:
                raise ValueError("PermuteForRope cannot pick an output pattern")
            if self.permute_layer_names is None or any(n in pattern for n in self.permute_layer_names):
                if isinstance(values, list) and len(values) > 1:
                    raise ValueError("PermuteForRope expects a single tensor per key")
                out[name] = self._permute(_single(values), kw.get("config"))
            else:
                out[name] = values
        return out


class Interleave(ConversionOp):
    """De-interleave ``[a0, b0, a1, b1, ...]`` into ``[a0, a1, ..., b0, b1, ...]`` along ``dim``."""

    def __init__(self, dim: int = 0, inverse: bool = False) -> None:
        self.dim, self.inverse = dim, inverse

    def convert(
        self, inputs: dict[str, Any], source_patterns: list[str], target_patterns: list[str], **kw: Any
    ) -> dict[str, Any]:
        tensor = _single(next(iter(inputs.values())))
        shape = list(tensor.shape)
        size = shape[self.dim]
        shape[self.dim : self.dim + 1] = [2, size // 2] if self.inverse else [size // 2, 2]
        out = tensor.reshape(shape).transpose(self.dim, self.dim + 1).reshape(tensor.shape).contiguous()
        return {target_patterns[0]: out}


def is_renaming(rule: Any) -> bool:
    """A renaming: has patterns and ``rename_source_key`` but no ``operations``."""
    return hasattr(rule, "rename_source_key") and not hasattr(rule, "operations")


def is_converter(rule: Any) -> bool:
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
    own: _Transform
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


def own_class(module: Any) -> type:
    """The class ``module`` was built as, under any class-swapping wrapper.

    ``fully_shard`` (FSDP2) and the composable ``replicate`` replace a module's class with a generated
    ``type(f"FSDP{cls.__name__}", (FSDPModule, cls), ...)``. Such a class is recognized by its shape (two bases,
    the first from ``torch.distributed``, its name the second's name behind a prefix) and peeled off, as many
    times as the wrappers were stacked. Any other class is returned as it is.
    """
    cls = type(module)
    while True:
        bases = cls.__bases__
        if len(bases) != 2:
            return cls
        wrapper, inner = bases
        if not (
            getattr(wrapper, "__module__", "").startswith("torch.distributed")
            and cls.__name__ != inner.__name__
            and cls.__name__.endswith(inner.__name__)
        ):
            return cls
        cls = inner


def unwrapped(model: Any) -> Any:
    """The module a forwarding wrapper holds, under any number of them: ``torch.compile``'s ``OptimizedModule``
    (``_orig_mod``) and ``DistributedDataParallel`` (``module``). Their parameters are the inner module's own
    tensors under a prefix (``_orig_mod.``, ``module.``) that no checkpoint has, and the inner module is what
    the conversion rules are looked up on; loading into it writes the same tensors. Class-swapping wrappers
    (``fully_shard``) keep the names and are handled by :func:`own_class`."""
    from torch.nn.parallel import DistributedDataParallel

    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # never imported: nothing was compiled
    compiled: Any = getattr(eval_frame, "OptimizedModule", None)
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif compiled is not None and isinstance(model, compiled) and isinstance(model._orig_mod, torch.nn.Module):
            model = model._orig_mod
        else:
            return model


class _ModelView:
    """What ``get_model_conversion_mapping`` reads of a model (``named_modules``, ``base_model_prefix``), with
    every class-swapped ``PreTrainedModel`` seen as an instance of its own class. transformers looks the
    conversion rules up by ``type(module).__name__`` and skips classes defined outside ``transformers.``; a
    root wrapped by ``fully_shard`` is ``FSDP<Class>`` from ``torch.distributed`` and would lose every
    class-level rule. The user's model is not touched: each wrapped submodule is stood in for by a bare,
    uninitialized instance of its own class that carries only its ``config``."""

    def __init__(self, model: Any, pretrained: Any) -> None:
        self._model = model
        self._pretrained = pretrained
        self.base_model_prefix = getattr(own_class(model), "base_model_prefix", model.base_model_prefix)

    def named_modules(self, *args: Any, **kwargs: Any) -> Iterable[tuple[str, Any]]:
        for name, module in self._model.named_modules(*args, **kwargs):
            cls: Any = own_class(module)
            if cls is not type(module) and isinstance(module, self._pretrained):
                stand_in: Any = cls.__new__(cls)
                stand_in.__dict__["config"] = module.config  # no __init__ ran: only the instance dict
                module = stand_in
            yield name, module


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
    view: Any = _ModelView(model, PreTrainedModel)
    return list(get_model_conversion_mapping(view, key_mapping=dict(key_mapping) if key_mapping else None))


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
