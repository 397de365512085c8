"""The execution side of a plan: what a ``LoadPlan`` names by key, live. ``LoadContext`` holds the model,
the open checkpoint index, the targets (FQN -> ``Target``), the deferred groups' torch computes (one per
``LoadPlan.deferred`` entry, in order) and the rules that fired; ``PendingGroup`` is a deferred group while
planning (its compute and claimed targets), split into the plan's plain ``DeferredGroup`` and its compute.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hp_fastload.model.targets import Target
from hp_fastload.planning.items import DeferredGroup
from hp_fastload.source.index import CheckpointIndex

#: A deferred group's conversion: its checkpoint tensors (whole) -> its outputs.
Compute = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


@dataclass
class PendingGroup:
    """A deferred group being planned: read ``keys`` whole, ``compute`` the outputs, copy each claimed
    output's local part into its target (``claims``: output name -> target)."""

    label: str
    keys: list[str]
    compute: Compute
    claims: dict[str, Target] = field(default_factory=dict)
    reason: str = ""

    def plain(self, index: CheckpointIndex) -> DeferredGroup:
        claims = {n: t.names[0] for n, t in self.claims.items()}
        nbytes = [index.locate(k).nbytes for k in self.keys]
        return DeferredGroup(self.label, tuple(self.keys), claims, self.reason, tuple(nbytes))


@dataclass(eq=False)
class LoadContext:
    """What executing a ``LoadPlan`` needs live (see the module docstring)."""

    model: Any
    index: CheckpointIndex
    targets: dict[str, Target]
    computes: list[Compute]
    used_rules: list[Any] = field(default_factory=list)
    used_base_rules: list[Any] = field(default_factory=list)
    used_replacement_rules: list[Any] = field(default_factory=list)

    def target(self, name: str) -> Target:
        """The target a plan names (a region read's key, a deferred claim's value)."""
        return self.targets[name]
