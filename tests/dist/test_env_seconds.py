"""The two waiting bounds read from the environment (``HP_FASTLOAD_PEER_WAIT_S``, ``HP_FASTLOAD_PEER_SILENCE_S``):
defaults, values, and a bad value refused with the variable's name."""

from __future__ import annotations

import pytest

from hp_fastload.dist.bounded import PEER_WAIT_ENV, peer_wait_s
from hp_fastload.dist.liveness import SILENCE_ENV, silence_s


@pytest.mark.parametrize(
    ("env", "read", "default"), [(PEER_WAIT_ENV, peer_wait_s, 10.0), (SILENCE_ENV, silence_s, 30.0)]
)
def test_waiting_bounds(monkeypatch: pytest.MonkeyPatch, env: str, read, default: float) -> None:
    monkeypatch.delenv(env, raising=False)
    assert read() == default
    monkeypatch.setenv(env, "")
    assert read() == default
    monkeypatch.setenv(env, "2.5")
    assert read() == 2.5
    for bad, why in (("soon", "not a number"), ("0", "positive"), ("-1", "positive"), ("nan", "positive")):
        monkeypatch.setenv(env, bad)
        with pytest.raises(ValueError, match=rf"{env}='{bad}'.*{why}"):
            read()
