"""The template-grouping measurement (``benches/template_grouping.py``) compares like with like: the template
path and the per-key path must give the same groups and unexpected keys on the bench layouts it times."""

from __future__ import annotations

from pathlib import Path

import pytest

BENCHES = Path(__file__).resolve().parents[2] / "benches"


@pytest.mark.parametrize("layout", ["moe", "deepseek"])
def test_bench_paths_group_alike(layout, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHES))
    import compare
    import template_grouping

    if layout == "moe":
        config = compare.moe_config(True, None, None)
        keys = [k for k, *_ in compare.moe_keys(config)]
    else:
        config = compare.deepseek_config(True)
        keys = [k for k, *_ in compare.deepseek_keys(config)]
    assert template_grouping.bench_groups(layout, config, keys, reps=1)
