"""Bit equality: the one definition the tests compare tensors by (no -0.0 == 0.0, NaN == NaN, any dtype)."""

from __future__ import annotations

import torch


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` (any dtype, any strides, any device) as a flat CPU ``uint8`` tensor, in logical
    element order: two tensors are bit-equal exactly when their shapes and dtypes match and these are equal."""
    flat = torch.empty(t.numel(), dtype=t.dtype)
    flat.copy_(t.detach().reshape(-1).cpu())
    return flat.view(torch.uint8)


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, same dtype, same bits."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))
