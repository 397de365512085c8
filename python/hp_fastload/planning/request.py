"""``PlanRequest``: what one planning is asked, decided once at the API edge and never changed after.

Every planning caller (``load``, ``plan``, ``save``, the rehearsal, the job-wide plan, ``plan_each``, the
transfer between live models) builds one request and hands it to the one planning entry,
``planning.front.plan``. The request holds the decisions, not the model or the checkpoint: the rules (or the
state-dict adapter) resolved and checked, whether groups are traced into region reads (``trace``; False is the
``legacy`` loader, every group deferred), the strict check, the keys left to others, the replacement stage, the
tensors no checkpoint holds, and the view of the rank planned (``view``: None is this process's own rank; a
``mesh_override`` such as ``model.regions.virtual_rank(r)`` plans another one).

Frozen: a request planned twice (a rank's own plan, then the whole plan of the job) asks the same thing twice.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hp_fastload.planning.replacement import Replacement

__all__ = ["PlanRequest"]


@dataclass(frozen=True, eq=False)
class PlanRequest:
    """One planning's decisions (see the module docstring). ``rules`` is empty when ``adapter`` is set."""

    rules: tuple[Any, ...] = ()
    #: a checked state-dict adapter (``convert.adapter.check_adapter``), replacing the rules
    adapter: Any = None
    #: region reads (the ``dcp`` loader); False plans every group deferred (the ``legacy`` loader)
    trace: bool = True
    strict: bool = True
    external_target_fqns: frozenset[str] = frozenset()
    #: checkpoint keys another mechanism loads (a hyper-parallel caller's own tensors): not planned here
    claimed_source_keys: frozenset[str] = frozenset()
    #: the replacement stage (None: the model's own, ``planning.replacement.replacement_of``)
    replacement: Replacement | None = None
    #: checked regexes searched in model names: tensors no checkpoint holds, not missing
    ignore_missing: tuple[str, ...] = ()
    #: the rank planned: None for this process's own, else a ``mesh_override`` (``model.targets.build_targets``)
    view: Any = None

    @property
    def loader(self) -> str:
        """The loader's name, as ``LoadReport.loader`` reports it."""
        return "dcp" if self.trace else "legacy"

    def seen_as(self, view: Any) -> PlanRequest:
        """The same request for another rank (``view``: a ``mesh_override``)."""
        return dataclasses.replace(self, view=view)

    def relaxed(self) -> PlanRequest:
        """The same request without the strict check (a job-wide or whole plan: the rank's own plan checked)."""
        return dataclasses.replace(self, strict=False)
