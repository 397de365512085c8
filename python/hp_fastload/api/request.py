"""The API edge of planning: the public arguments (``weights_mapping``, ``key_mapping``, ``state_dict_adapter``,
``loader``, ``strict``, ``ignore_missing``...) checked and resolved once into a frozen
:class:`~hp_fastload.planning.request.PlanRequest`, the one thing planning is given (``planning.front``).

Owns the loader names (``resolve_hf_loader``: the argument, else ``$HYPER_PARALLEL_HF_LOADER``, else ``dcp``),
the checks that reject contradictory arguments before anything is opened, and the rule resolution (the
model's transformers mapping, the caller's rules, or a torchtitan state-dict adapter): done here once per call,
whatever planning then runs (a rank's own plan, the job-wide whole plan, many virtual ranks).
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from hp_fastload.convert.adapter import check_adapter
from hp_fastload.convert.rules import resolve_mapping
from hp_fastload.planning.replacement import Replacement
from hp_fastload.planning.request import PlanRequest

__all__ = ["DEFAULT_LOADER", "HF_LOADER_ENV", "LOADERS", "SHARES", "plan_request", "resolve_hf_loader", "resolve_share"]

HF_LOADER_ENV = "HYPER_PARALLEL_HF_LOADER"

# The loaders of the hyper-parallel seed, under the seed's names: "legacy" reads whole tensors and converts them
# with torch; "dcp" is the region loader (conversions compiled into checkpoint coordinates, each rank reading only
# its regions). Despite its name it is not torch DCP, which hp_fastload.dcp plugs into as a storage reader.
LOADERS = ("legacy", "dcp")

DEFAULT_LOADER = "dcp"

#: ``load(share=...)``: every rank its own regions, the job-wide plan, the cost model's choice, and the older
#: replica broadcast (``share_replicated=True``).
SHARES = ("none", "job", "auto", "replicated")


def resolve_hf_loader(loader: str | None = None) -> str:
    """The loader name: the argument, else ``$HYPER_PARALLEL_HF_LOADER``, else ``"dcp"`` (case-insensitive)."""
    value = loader if loader is not None else os.environ.get(HF_LOADER_ENV) or DEFAULT_LOADER
    name = str(value).strip().lower()
    if name not in LOADERS:
        raise ValueError(
            f"Unknown pretrained loader {value!r}; expected one of {', '.join(LOADERS)} "
            f"(set through the loader argument or {HF_LOADER_ENV})"
        )
    return name


def resolve_share(share: str | None, share_replicated: bool) -> str:
    """The strategy: ``share`` when given, ``"replicated"`` for the older ``share_replicated=True``, else
    ``"none"``. ``ValueError`` for an unknown name or a contradiction."""
    if share is None:
        return "replicated" if share_replicated else "none"
    name = str(share).strip().lower()
    if name not in SHARES:
        raise ValueError(f"Unknown share {share!r}; expected one of {', '.join(SHARES)}")
    if share_replicated and name != "replicated":
        raise ValueError(f"share={share!r} and share_replicated=True disagree: pass one of them")
    return name


def plan_request(
    model: Any,
    *,
    weights_mapping: Iterable[Any] | None = None,
    key_mapping: Mapping[str, str] | None = None,
    state_dict_adapter: Any = None,
    loader: str | None = None,
    strict: bool = True,
    external_target_fqns: Collection[str] = frozenset(),
    claimed_source_keys: Collection[str] = frozenset(),
    replacement: Replacement | None = None,
    ignore_missing: Iterable[str] = (),
    view: Any = None,
) -> PlanRequest:
    """The request for planning ``model`` (its rules resolved here, once): ``ValueError`` / ``TypeError`` for
    arguments that contradict each other or do not parse (an unknown loader, an adapter with a mapping, an
    ``ignore_missing`` pattern that is not a regex), before any file is opened."""
    adapter = _checked_adapter(state_dict_adapter, weights_mapping, key_mapping)
    patterns = _checked_patterns(ignore_missing)
    trace = resolve_hf_loader(loader) == "dcp"
    rules = () if adapter is not None else tuple(resolve_mapping(model, weights_mapping, key_mapping))
    return PlanRequest(
        rules=rules,
        adapter=adapter,
        trace=trace,
        strict=strict,
        external_target_fqns=frozenset(external_target_fqns),
        claimed_source_keys=frozenset(claimed_source_keys),
        replacement=replacement,
        ignore_missing=patterns,
        view=view,
    )


def _checked_adapter(adapter: Any, weights_mapping: Any, key_mapping: Any) -> Any:
    if adapter is None:
        return None
    if weights_mapping is not None or key_mapping:
        raise ValueError(
            "state_dict_adapter= converts the whole state dict; it cannot be combined with weights_mapping= or "
            "key_mapping= (put the renames into the adapter)"
        )
    return check_adapter(adapter)


def _checked_patterns(patterns: Iterable[str]) -> tuple[str, ...]:
    if isinstance(patterns, str):
        raise TypeError(f"ignore_missing takes a list of regexes, got the string {patterns!r}")
    out = tuple(patterns)
    for pattern in out:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"ignore_missing: {pattern!r} is not a valid regex: {exc}") from None
    return out
