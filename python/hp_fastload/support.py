"""What this installation runs with: package versions, the CPU, and the SIMD level of the Rust kernels.

``info()`` (and ``hp-fastload info``) says which releases of the libraries hp_fastload works with are
installed, what the CPU offers, and which kernel level is in use (``HP_FASTLOAD_SIMD`` caps it: scalar, avx2,
avx512, avx512vbmi); benchmarks record it beside their numbers. The import of this module checks
``HP_FASTLOAD_SIMD``: a value that names no level is a ``ValueError`` on ``import hp_fastload``, not a silent
run at another level.

It does not decide anything: the kernels read the level in Rust (``rust/simd.rs``).
"""

from __future__ import annotations

import platform
import sys
from importlib import metadata
from typing import Any

import hp_fastload._core as _core

#: The environment variable that caps the kernels' SIMD level.
SIMD_ENV = "HP_FASTLOAD_SIMD"

#: The distributions whose versions ``info()`` reports: hp_fastload's own dependencies and what it integrates
#: with (each ``None`` where it is not installed).
PACKAGES = (
    "hp_fastload",
    "torch",
    "numpy",
    "safetensors",
    "transformers",
    "accelerate",
    "huggingface_hub",
    "peft",
    "torchtitan",
    "tqdm",
)

#: The CPU flags that decide the kernel level (``/proc/cpuinfo`` names).
SIMD_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512vbmi")

_LEVELS = _core.simd_levels()  # raises ValueError at import where HP_FASTLOAD_SIMD names no level


def simd_level() -> str:
    """The SIMD level the Rust kernels run at in this process: the CPU's, capped by ``HP_FASTLOAD_SIMD``."""
    return _LEVELS[0]


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _cpu() -> dict[str, Any]:
    """The CPU's model name and its SIMD flags, from ``/proc/cpuinfo`` where there is one (its first processor)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = set(fields.get("flags", fields.get("Features", "")).split())
    return {
        "model": fields.get("model name") or platform.processor() or platform.machine(),
        "machine": platform.machine(),
        "simd_flags": [f for f in SIMD_FLAGS if f in flags],
    }


def info() -> dict[str, Any]:
    """What this installation runs with, as plain data (JSON-serializable).

    Returns:
        ``{"python": ..., "platform": ..., "packages": {name: version or None}, "cpu": {"model", "machine",
        "simd_flags"}, "simd": {"level": in use, "cpu": the CPU's, "requested": HP_FASTLOAD_SIMD's or None,
        "levels": every level, narrowest first}}``.
    """
    level, detected, requested = _LEVELS
    return {
        "python": platform.python_version(),
        "platform": sys.platform,
        "packages": {name: _version(name) for name in PACKAGES},
        "cpu": _cpu(),
        "simd": {"level": level, "cpu": detected, "requested": requested, "levels": list(_core.SIMD_LEVELS)},
    }


def describe(facts: dict[str, Any] | None = None) -> str:
    """``info()`` as the few lines ``hp-fastload info`` prints."""
    facts = info() if facts is None else facts
    simd = facts["simd"]
    cap = f" (capped by {SIMD_ENV}={simd['requested']})" if simd["requested"] else ""
    cpu = facts["cpu"]
    lines = [
        f"{'python':<17}{facts['python']} ({facts['platform']})",
        f"{'cpu':<17}{cpu['model']} [{cpu['machine']}]: {' '.join(cpu['simd_flags']) or 'no AVX2/AVX-512'}",
        f"{'kernels':<17}{simd['level']}{cap}; this CPU supports {simd['cpu']}",
    ]
    for name, version in facts["packages"].items():
        lines.append(f"{name:<17}{version or '-'}")
    return "\n".join(lines)
