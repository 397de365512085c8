"""``HuggingFaceCheckpointer``: the hyper-parallel seed's checkpointer interface (``load`` into ``state["model"]`` with
the ``LoadReport`` in ``state["load_report"]``) over ``hp_fastload.load``.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable
from typing import Any

from torch import nn

from hp_fastload.api.load import load, resolve_hf_loader


class HuggingFaceCheckpointer:
    """Checkpointer for Hugging Face safetensors checkpoints (hyper-parallel's contract): ``load`` fills a
    model, ``save`` exports it (``hp_fastload.save``).

    Args:
        loader: ``"dcp"`` (exact region reads) or ``"legacy"`` (whole tensors, sliced on the host); None
            reads ``$HYPER_PARALLEL_HF_LOADER``, default ``"dcp"``. Resolved here, so a bad value fails
            before any file is opened.
        weights_mapping: the rule list; None uses the model's transformers conversion mapping.
    """

    def __init__(self, *, loader: str | None = None, weights_mapping: Iterable[Any] | None = None) -> None:
        self.loader = resolve_hf_loader(loader)
        self.weights_mapping = list(weights_mapping) if weights_mapping is not None else None

    def save(
        self,
        path: str | os.PathLike[str],
        state: dict[str, Any] | nn.Module,
        *,
        global_step: int | None = None,
        save_async: bool = False,
        **save_kwargs: Any,
    ) -> Any:
        """Export ``state["model"]`` (or a module) as a Hugging Face checkpoint: ``hp_fastload.save`` with this
        checkpointer's ``weights_mapping``; every rank calls it. Returns the ``SaveReport``. The seed's
        ``global_step`` is accepted and not stored (the format has no place for it); ``save_async`` is refused."""
        from hp_fastload.api.save import save

        if save_async:
            raise NotImplementedError("save_async: the Hugging Face export is synchronous (it returns once published)")

        model = state.get("model") if isinstance(state, dict) else state
        if not isinstance(model, nn.Module):
            raise TypeError(f"state['model'] must be an nn.Module to export, got {type(model).__name__}")
        save_kwargs.setdefault("weights_mapping", self.weights_mapping)
        return save(model, path, **save_kwargs)

    def load(
        self,
        path: str | os.PathLike[str],
        state: dict[str, Any],
        *,
        strict_model: bool = True,
        extra_state_skeleton: Any = None,
        external_target_fqns: Collection[str] = frozenset(),
        claimed_source_keys: Collection[str] = frozenset(),
        **load_kwargs: Any,
    ) -> dict[str, Any]:
        """Fill ``state["model"]`` in place; sets and returns ``state`` with ``state["load_report"]``."""
        if extra_state_skeleton is not None:
            raise ValueError(
                "a pretrained Hugging Face checkpoint carries no training state: extra_state_skeleton must be None"
            )
        if not path:
            raise ValueError("pretrained_path must be provided when load_base_model=True")
        model = state.get("model")
        if not isinstance(model, nn.Module):
            raise TypeError(
                "state['model'] must be a live nn.Module (loading writes into its distributed parameters in "
                f"place), got {type(model).__name__}"
            )
        state["load_report"] = load(
            model,
            path,
            weights_mapping=self.weights_mapping,
            strict=strict_model,
            loader=self.loader,
            external_target_fqns=external_target_fqns,
            claimed_source_keys=claimed_source_keys,
            **load_kwargs,
        )
        return state
