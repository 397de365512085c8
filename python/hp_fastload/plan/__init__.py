"""Planning: checkpoint headers + rules + model layout -> this rank's read items. Never touches tensor bytes.

The package's modules, each owning one part (its first lines say what):

- ``items``: the plan's plain data (``ReadItem``, ``Reads``, ``DeferredGroup``, ``LoadPlan``, ``LoadReport``);
- ``context``: the execution side (``LoadContext``: model, index, targets, computes; ``PendingGroup``);
- ``trace``: running each load group's conversion symbolically through the real rule objects, the trace
  cache, the meta-tensor validation of what cannot be traced;
- ``regions``: intersecting traced blocks with a target's local region into exact read items;
- ``claims``: claiming converted outputs for model targets (tied aliases, shapes, first claim wins);
- ``replacement``: the second planning stage of a model whose modules were replaced;
- ``orchestrate``: ``plan_load``, which runs them in order, makes the report and the strict check, and
  returns the plan with its context.

Groups whose ops cannot be traced (they read values or combine tensors elementwise) become
``DeferredGroup``s: read whole, converted with torch, sliced locally. The legacy loader plans every group as
deferred. ``LoadPlan.summary()`` prints a plan, and ``hp_fastload.plan(...)`` answers what a (possibly
virtual) rank reads without reading anything.
"""

from __future__ import annotations

from ..engine import gc_paused
from .context import LoadContext, PendingGroup
from .items import DeferredGroup, LoadPlan, LoadReport, ReadItem, Reads
from .orchestrate import plan_load
from .regions import VECTOR_BLOCKS, BlockCache, region_items
from .replacement import Replacement, SourceModelView, replacement_of
from .trace import ConversionError

__all__ = [
    "VECTOR_BLOCKS",
    "BlockCache",
    "ConversionError",
    "DeferredGroup",
    "LoadContext",
    "LoadPlan",
    "LoadReport",
    "PendingGroup",
    "ReadItem",
    "Reads",
    "Replacement",
    "SourceModelView",
    "gc_paused",
    "plan_load",
    "region_items",
    "replacement_of",
]
