"""Default rules of a model whose root ``fully_shard`` wrapped (issue 15, item 0).

``fully_shard(model)`` swaps the root's class for torch's generated ``FSDP<Class>``; transformers'
``get_model_conversion_mapping`` looks rules up by class name and skips classes defined outside transformers, so
the class-level renames (``^embed_out.`` -> ``lm_head.``, the ``language_model.`` prefixes) would be lost. Each
architecture of ``tiny_models.ROOT_RULE_FAMILIES`` is written by transformers' ``save_pretrained`` (which
writes those legacy names), built on meta, root-wrapped by a real ``fully_shard`` on a 1-rank and on a 2-rank
gloo mesh, loaded strict by ``hp_fastload.load`` and compared bit for bit with transformers' own
``from_pretrained``. One spawn runs every architecture.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.bits import bits
from tests.helpers.dist import child_environment, run_distributed, run_subchecks, subcheck_values
from tests.helpers.tiny_models import ROOT_RULE_FAMILIES, root_rule_class, root_rule_config

ROOT_ENV = "HPF_WRAPPED_ROOT"
FAMILIES = sorted(ROOT_RULE_FAMILIES)


def meta_model(family: str) -> Any:
    with torch.device("meta"):
        return root_rule_class(family)(root_rule_config(family))


def _wrapped_load(family: str, mesh: Any) -> list[str]:
    """Mismatches (or missing keys) of a root-wrapped strict load against transformers' from_pretrained."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import hp_fastload

    path = Path(os.environ[ROOT_ENV]) / family
    reference = root_rule_class(family).from_pretrained(path, dtype=torch.float32).state_dict()
    model = meta_model(family)
    fully_shard(model, mesh=mesh)
    assert type(model).__name__.startswith("FSDP")
    model.to_empty(device="cpu")
    hp_fastload.load(model, path, strict=True)
    bad = []
    for name, value in model.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if name in reference and not torch.equal(bits(full), bits(reference[name].to(full.dtype))):
            bad.append(name)
    return bad


def check_root_wrapped(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    meshes = init_device_mesh("cpu", (world, 1), mesh_dim_names=("shard", "solo"))
    out: dict[str, Any] = {}
    for family in FAMILIES:
        for label, mesh in (("1 rank", meshes["solo"]), (f"{world} ranks", meshes["shard"])):
            try:
                out[f"{family} on {label}"] = _wrapped_load(family, mesh)
            except Exception as exc:
                out[f"{family} on {label}"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"
    return out


@pytest.fixture(scope="module")
def wrapped_runs(tmp_path_factory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("wrapped_root")
    for family in FAMILIES:
        torch.manual_seed(0)
        model = root_rule_class(family)(root_rule_config(family))
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p))
        model.save_pretrained(root / family)
    with child_environment({ROOT_ENV: str(root)}):
        per_rank = run_distributed(run_subchecks, 2, checks=[check_root_wrapped], timeout=500)
    return subcheck_values(per_rank, "check_root_wrapped")


@pytest.mark.parametrize("family", FAMILIES)
def test_mapping_is_the_same_under_a_class_swapping_wrapper(family):
    from torch.distributed.fsdp import FSDPModule

    from hp_fastload.convert.rules import resolve_mapping
    from hp_fastload.model.wrappers import own_class

    def described(rules: list[Any]) -> list[str]:  # the scope matters: a sub-model's rules are scoped to it
        return [f"{rule!r} scope={rule.scope_prefix!r} base={rule.base_model_prefix!r}" for rule in rules]

    model = meta_model(family)
    plain = described(resolve_mapping(model, None))
    cls = type(model)
    # the class fully_shard generates: (FSDPModule, cls), named FSDP<cls>, defined in torch.distributed
    model.__class__ = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__module__": FSDPModule.__module__})
    assert own_class(model) is cls
    assert described(resolve_mapping(model, None)) == plain
    assert type(model) is not cls  # the model itself is left wrapped


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", FAMILIES)
def test_root_wrapped_strict_load_equals_from_pretrained(wrapped_runs, family):
    for label in ("1 rank", "2 ranks"):
        results = [per_rank[f"{family} on {label}"] for per_rank in wrapped_runs]
        assert results == [[], []], f"{family} on {label}: {results}"
