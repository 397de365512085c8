"""Conversion ops (transformers v5's ``ConversionOp`` family): stack and unstack of module lists, concatenate, chunk,
split, transpose, RoPE permutes (with explicit head counts), interleave, the per-KV-group fused q/k/v. Each runs on
real tensors and on symbolic ones alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


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


def _config_field(config: Any, subconfig_key: str | None, name: str) -> Any:
    if config is not None and subconfig_key is not None:
        config = getattr(config, subconfig_key, config)
    return getattr(config, name, None) if config is not None else None


class PermuteForRope(ConversionOp):
    """Interleaved-pair RoPE rows to rotate-half order, per attention head (``inverse`` undoes it).

    The permute is per head, so the head count must be right: ``num_heads`` (else the config's
    ``num_attention_heads``) for queries, ``num_kv_heads`` (else the config's ``num_key_value_heads``, else the
    query count) for the keys whose source pattern contains one of ``kv_layer_names`` (under grouped-query
    attention the keys have fewer heads). No count at all raises ``ValueError``: there is no default of 1. With
    ``head_dim`` (else the config's ``head_dim``), each tensor's rows are checked against ``heads * head_dim``.
    """

    def __init__(
        self,
        subconfig_key: str | None = None,
        permute_layer_names: Sequence[str] | None = None,
        inverse: bool = False,
        *,
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        kv_layer_names: Sequence[str] = ("k_proj",),
    ) -> None:
        self.subconfig_key = subconfig_key
        self.permute_layer_names = list(permute_layer_names) if permute_layer_names is not None else None
        self.inverse = inverse
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.kv_layer_names = list(kv_layer_names)

    @property
    def reverse_op(self) -> PermuteForRope:
        return PermuteForRope(
            self.subconfig_key,
            self.permute_layer_names,
            not self.inverse,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            kv_layer_names=self.kv_layer_names,
        )

    def heads_for(self, pattern: str, config: Any) -> int:
        """The head count the rows of ``pattern``'s tensor are split by."""
        heads = self.num_heads or _config_field(config, self.subconfig_key, "num_attention_heads")
        if not heads:
            raise ValueError(
                f"PermuteForRope on {pattern!r} needs the attention head count: pass num_heads= (and num_kv_heads= "
                "for grouped-query keys), or load a model whose config has num_attention_heads"
            )
        if any(name in pattern for name in self.kv_layer_names):
            kv = self.num_kv_heads or _config_field(config, self.subconfig_key, "num_key_value_heads")
            return int(kv or heads)
        return int(heads)

    def _permute(self, tensor: Any, pattern: str, config: Any) -> Any:
        heads = self.heads_for(pattern, config)
        rows = tensor.shape[0]
        head_dim = self.head_dim or _config_field(config, self.subconfig_key, "head_dim")
        if head_dim and rows != heads * head_dim:
            raise ValueError(
                f"PermuteForRope on {pattern!r}: {rows} rows are not {heads} heads of {head_dim} "
                "(wrong num_heads / num_kv_heads, or kv_layer_names misses this key?)"
            )
        if rows % (2 * heads):
            raise ValueError(f"PermuteForRope on {pattern!r}: {rows} rows do not split into {heads} heads of pairs")
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
                out[name] = self._permute(_single(values), pattern, kw.get("config"))
            else:
                out[name] = values
        return out


class FuseGroupedQKV(ConversionOp):
    """q, k, v into one fused projection interleaved **per KV group**: ``[n_kv, (q heads of the group, k, v),
    head_dim, ...]`` flattened, the layout of torchtitan's ``FusedQKVLinear`` and Megatron's ``linear_qkv``
    (not a plain concatenation of q, k and v). ``inverse=True`` splits one fused source into the three
    targets. Sources / targets in the order q, k, v; ``num_heads`` and ``num_kv_heads`` are required.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, inverse: bool = False) -> None:
        if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(
                f"FuseGroupedQKV needs num_heads divisible by num_kv_heads, got {num_heads} and {num_kv_heads}"
            )
        self.num_heads, self.num_kv_heads, self.inverse = num_heads, num_kv_heads, inverse

    @property
    def reverse_op(self) -> FuseGroupedQKV:
        return FuseGroupedQKV(self.num_heads, self.num_kv_heads, not self.inverse)

    def _head_dim(self, rows: int, heads: int, what: str) -> int:
        if rows % heads:
            raise ValueError(f"FuseGroupedQKV: {what} has {rows} rows, not a multiple of {heads} heads")
        return rows // heads

    def convert(
        self, inputs: dict[str, Any], source_patterns: list[str], target_patterns: list[str], **kw: Any
    ) -> dict[str, Any]:
        group = self.num_heads // self.num_kv_heads
        if self.inverse:
            if len(inputs) != 1 or len(target_patterns) != 3:
                raise ValueError("FuseGroupedQKV(inverse=True) takes one fused source and three targets (q, k, v)")
            fused = _single(next(iter(inputs.values())))
            hd = self._head_dim(fused.shape[0], self.num_kv_heads * (group + 2), "the fused tensor")
            tail = tuple(fused.shape[1:])
            w = fused.reshape(self.num_kv_heads, group + 2, hd, *tail)
            q, k, v = w[:, :group], w[:, group], w[:, group + 1]
            return {
                target_patterns[0]: q.reshape(-1, *tail),
                target_patterns[1]: k.reshape(-1, *tail),
                target_patterns[2]: v.reshape(-1, *tail),
            }
        if len(target_patterns) != 1 or len(source_patterns) != 3:
            raise ValueError("FuseGroupedQKV takes three sources (q, k, v, in this order) and one target")
        missing = [p for p in source_patterns if p not in inputs]
        if missing:
            raise ValueError(f"FuseGroupedQKV: no tensor for {missing}")
        q, k, v = (_single(inputs[p]) for p in source_patterns)
        hd = self._head_dim(q.shape[0], self.num_heads, "q")
        for name, t in (("k", k), ("v", v)):
            if t.shape[0] != self.num_kv_heads * hd or tuple(t.shape[1:]) != tuple(q.shape[1:]):
                raise ValueError(
                    f"FuseGroupedQKV: {name} is {tuple(t.shape)}, expected ({self.num_kv_heads * hd}, "
                    f"{', '.join(map(str, q.shape[1:]))}) for {self.num_kv_heads} KV heads of {hd}"
                )
        tail = tuple(q.shape[1:])
        parts = [
            q.reshape(self.num_kv_heads, group, hd, *tail),
            k.reshape(self.num_kv_heads, 1, hd, *tail),
            v.reshape(self.num_kv_heads, 1, hd, *tail),
        ]
        return {target_patterns[0]: torch.cat(parts, dim=1).reshape(-1, *tail)}


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
