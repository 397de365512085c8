"""Public conversion-rule surface, ``hp_fastload.rules``: the rule and op classes a user passes as
``weights_mapping``, the transformers bridge and the key order. They live in ``hp_fastload.convert`` (rules and
ops), ``hp_fastload.model.wrappers`` and ``hp_fastload.source.natural``; this module only names them."""

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
from hp_fastload.convert.rules import (
    WeightConverter,
    WeightRenaming,
    from_transformers,
    is_converter,
    is_renaming,
    resolve_mapping,
)
from hp_fastload.model.wrappers import own_class, unwrapped
from hp_fastload.source.natural import dot_natural_key, natural_sort_key

__all__ = [
    "Chunk",
    "Concatenate",
    "ConversionOp",
    "FuseGroupedQKV",
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
