"""Fixtures of the cluster tests (``tools/cluster.py``): a checkpoint written once per session, and the skip
with its reason where network namespaces cannot be made (not root, no ``ip`` / ``tc``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tools import cluster


@pytest.fixture(scope="session")
def cluster_ready() -> None:
    reason = cluster.unavailable()
    if reason is not None:
        pytest.skip(f"no cluster on this machine: {reason}")


@pytest.fixture(scope="session")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A small bf16 Llama (about 1.7 MB, several files) written by transformers' ``save_pretrained``."""
    from tools.cluster_work import write_llama

    yield write_llama(tmp_path_factory.mktemp("cluster-llama"))
