"""``hp-fastload info`` / ``hp_fastload.info()``: versions, CPU flags and the kernel level, and the
``HP_FASTLOAD_SIMD`` switch as a user sets it (each case a fresh interpreter: the level is read once per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata

import pytest

import hp_fastload as hf

LEVELS = ("scalar", "avx2", "avx512", "avx512vbmi")


def _cpu_level() -> str:
    """The level this CPU supports, read from /proc/cpuinfo here (not through hp_fastload)."""
    with open("/proc/cpuinfo") as f:
        flags = set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
    if {"avx512f", "avx512bw"} <= flags:
        return "avx512vbmi" if "avx512vbmi" in flags else "avx512"
    return "avx2" if "avx2" in flags else "scalar"


def _info(env_value: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "HP_FASTLOAD_SIMD"}
    if env_value is not None:
        env["HP_FASTLOAD_SIMD"] = env_value
    return subprocess.run(
        [sys.executable, "-m", "hp_fastload.cli", "info", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_info_reports_installed_versions_and_the_level_in_use():
    facts = hf.info()
    assert facts["packages"]["torch"] == metadata.version("torch")
    assert facts["packages"]["transformers"] == metadata.version("transformers")
    assert facts["simd"]["levels"] == list(LEVELS)
    requested = os.environ.get("HP_FASTLOAD_SIMD") or None
    cpu = facts["simd"]["cpu"]
    want = cpu if requested is None else LEVELS[min(LEVELS.index(requested), LEVELS.index(cpu))]
    assert facts["simd"]["level"] == want
    assert json.loads(json.dumps(facts)) == facts


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="no /proc/cpuinfo to check the detection against")
def test_the_detected_level_is_the_cpus():
    assert hf.info()["simd"]["cpu"] == _cpu_level()


@pytest.mark.parametrize("asked", [None, "scalar", "avx2", "AVX512", "avx512vbmi", "auto"])
def test_the_switch_caps_the_level_and_never_raises_it(asked):
    run = _info(asked)
    assert run.returncode == 0, run.stderr
    simd = json.loads(run.stdout)["simd"]
    cpu = _cpu_level()
    want = cpu if asked in (None, "auto") else LEVELS[min(LEVELS.index(asked.lower()), LEVELS.index(cpu))]
    assert (simd["cpu"], simd["level"]) == (cpu, want)
    assert simd["requested"] == (None if asked in (None, "auto") else asked.lower())


def test_a_switch_that_names_no_level_fails_the_import_with_the_choices():
    run = _info("avx3")
    assert run.returncode != 0
    assert "HP_FASTLOAD_SIMD" in run.stderr and "avx3" in run.stderr and "avx512vbmi" in run.stderr
    assert "ValueError" in run.stderr
