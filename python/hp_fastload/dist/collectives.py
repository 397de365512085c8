"""The object collectives ``save`` runs between ranks (broadcast, gather, its agreement wrapper) and the checks that
the ranks planned the same fallbacks and see the same temporary directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hp_fastload.dist.agree import agree
from hp_fastload.errors import PlanError
from hp_fastload.runtime import dist_active, interrupts_deferred


def check_fallbacks_agree(by_rank: list[list[list[str]]]) -> None:
    """Every rank runs the fallback groups' gathers in the same order: the ranks must have planned the same
    groups, else they would sit in different collectives (checked before any byte is written)."""
    differing = [rank for rank, groups in enumerate(by_rank) if groups != by_rank[0]]
    if differing:
        raise PlanError(
            f"the ranks planned different tensors to convert with torch: rank 0 {by_rank[0]}, rank "
            f"{differing[0]} {by_rank[differing[0]]}; every rank must save the same model with the same rules"
        )


def agree_in_save(stage: str, fn: Any) -> Any:
    """``dist.agree.agree`` for save: a peer that is not in ``save`` is named as such."""
    return agree(stage, fn, "hp_fastload.save")


def broadcast_object(value: Any) -> Any:
    if not dist_active() or torch.distributed.get_world_size() == 1:
        return value
    box = [value if torch.distributed.get_rank() == 0 else None]
    with interrupts_deferred():
        torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(value: Any) -> list[Any]:
    if not dist_active():
        return [value]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    with interrupts_deferred():
        torch.distributed.all_gather_object(out, value)
    return out


def check_visible(tmp: Path, path: Path, first_path: str) -> None:
    """Each rank must see the temporary directory rank 0 created: else the ranks name different directories
    (a relative ``path`` resolved against different working directories) or do not share a file system."""
    if not tmp.is_dir():
        raise FileNotFoundError(
            f"{tmp} (the temporary directory for {path}) does not exist on this rank: rank 0 created it for "
            f"{first_path}. Every rank must name the same directory on a file system they all see (a relative "
            "path resolves against each rank's own working directory)"
        )
