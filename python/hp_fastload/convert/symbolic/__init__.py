"""Symbolic tensors that record, for every element, which checkpoint element it comes from.

A :class:`RegionTensor` stands in for a real tensor while a checkpoint conversion (transformers'
``ConversionOps`` or any similar code) runs: it has the shape, dtype and strides torch would give the real
result, no data, and a tuple of :class:`Block` s that tile it.  Each block is a box of the tensor whose
elements are read from one checkpoint tensor through an affine index map, followed by elementwise
post-ops (casts and arithmetic with Python scalars)::

    source_index = block.base + block.coeff @ (x - block.offsets)     for x in the box
    value        = apply_post(source[source_index], block.post)

``source_index`` is a multi-index in the checkpoint tensor's own shape and every index a block touches is in
bounds, dim by dim.  A map that is affine only in the source's *flat* offset (flattening several source dims
into one) is therefore cut into one block per contiguous run, e.g. ``leaf(8, 6).reshape(48)`` has 8 blocks.

This module owns:

* the representation (:class:`RegionTensor`, :class:`Block`, :class:`PostOp`);
* tracing of layout ops through ``__torch_function__`` (reshape/view, transpose/permute, squeeze/unsqueeze,
  split/chunk/unbind/narrow/select, basic indexing, expand, cat/stack, casts, scalar arithmetic). torch itself
  validates the arguments and fixes the result's shape, dtype and strides: views and reshapes run on meta
  tensors, elementwise ops on a 0-d CPU tensor (their meta kernels cost milliseconds), and cat/stack apply
  torch's shape and promotion rules directly (their meta kernels are slower than the rules);
* the reference evaluation of a region (:func:`materialize`, :func:`apply_post`).

It does not own: reading bytes, intersecting blocks with a rank's local shard, deciding when a conversion is
deferred (the planner does that when an op raises :class:`UnsupportedRegionOp`), or turning blocks into
contiguous byte runs.

``RegionTensor`` subclasses ``torch.Tensor`` (a data-less meta tensor underneath) so that
``isinstance(x, torch.Tensor)`` checks in conversion code take the same branch as with real tensors (e.g.
``PermuteForRope`` after ``Chunk``).  Anything not known to be describable raises :class:`UnsupportedRegionOp`
(a ``TypeError``): ops between two tensors, value-dependent ops, in-place ops, reductions, advanced indexing.
"""

from hp_fastload.convert.symbolic import concat, elementwise, reshape, views  # noqa: F401  (register the handlers)
from hp_fastload.convert.symbolic.block import Block, row_major_strides
from hp_fastload.convert.symbolic.post import PostOp, apply_post, post_dtype
from hp_fastload.convert.symbolic.tensor import MAX_BLOCKS, RegionTensor, UnsupportedRegionOp, materialize

__all__ = [
    "MAX_BLOCKS",
    "Block",
    "PostOp",
    "RegionTensor",
    "UnsupportedRegionOp",
    "apply_post",
    "materialize",
    "post_dtype",
    "row_major_strides",
]
