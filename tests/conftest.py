"""Shared test configuration. Helpers live in ``tests/helpers`` (bit equality, shard writers, tiny models,
spawned gloo ranks); the folders mirror the package's layers (``source``, ``model``, ``convert``, ``planning``,
``execute``, ``dist``, ``api``, ``cli``) and ``benches`` holds the smoke runs of the benchmark scripts.

``make test`` runs everything but the ``slow`` tests (the benchmark-script smoke runs); ``make test-slow`` runs
those, and CI (``.ci/run``) runs both.
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test under ``tests/benches`` runs a benchmark script end to end: mark it ``slow``."""
    for item in items:
        if "benches" in item.path.parts[-2:-1]:
            item.add_marker(pytest.mark.slow)
