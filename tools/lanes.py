#!/usr/bin/env python3
"""The support matrix's lanes: the test suite against other releases of the libraries hp_fastload works with.

A lane is a virtual environment ``.venv-<lane>`` laid over the pinned one (``.venv``, made by ``make build``):
it holds only the lane's own releases, and a ``.pth`` file puts the pinned environment's site-packages
(torch, the built extension, the test tools) behind them, so a lane costs a few small wheels, not another
torch. Lanes:

- ``latest``: the newest releases of transformers, accelerate, safetensors, huggingface_hub, peft and
  torchtitan, resolved when the lane runs (``pip install --upgrade``), torch and numpy as pinned.
- ``oldest``: every lower bound ``pyproject.toml`` declares (``name>=X`` installed as ``name==X``), torch as
  pinned, whose bound must be the pinned release itself (a bound nobody tests is a guess).

``run`` rebuilds the lane's environment, checks that each package it installed is the one Python imports
(``importlib.metadata`` inside the lane), prints the versions, runs pytest on the lane's subset, and names the
versions again on a failure. Exit status: pytest's, or 2 when the lane could not be set up.

    python tools/lanes.py run latest [-- pytest args]
    python tools/lanes.py versions oldest        # what the lane would install, without installing
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE = ROOT / ".venv"

#: Packages the ``latest`` lane upgrades (the Hugging Face stack and the trainers hp_fastload integrates with).
LATEST = ("transformers", "accelerate", "safetensors", "huggingface_hub", "peft", "torchtitan")

#: Packages kept as pinned in every lane: a torch download is gigabytes.
KEEP_PINNED = ("torch",)

#: Test tools: not part of the support matrix, so every lane runs the pinned ones.
TOOLS = ("pytest", "pytest-timeout", "pytest-benchmark")

#: The tests each lane runs: loading and its parity against transformers, the training prologue, quantized
#: checkpoints, export, and the integrations (accelerate/Trainer, torchtitan, torch DCP readers, PEFT); not the
#: ones that exercise hp_fastload's own machinery whatever the libraries (object storage, interrupts, faults,
#: the rehearsal at scale), which the pinned run covers.
SUBSET = (
    *(
        f"tests/api/test_{name}.py"
        for name in (
            "parity",
            "load",
            "load_dist",
            "wrapped_models",
            "from_pretrained",
            "fusion",
            "accelerate",
            "torchtitan",
            "peft",
            "dcp_reader",
            "quant_load_dist",
            "save",
            "save_dist",
        )
    ),
    "tests/convert",
    "tests/model",
    "tests/cli/test_info.py",
)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _release(version: str) -> tuple[int, ...]:
    """``2.15`` and ``2.15.0`` alike: the numeric release, trailing zeros dropped."""
    parts = [int(p) for p in re.findall(r"\d+", version.split("+")[0])]
    while parts and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def pins() -> dict[str, str]:
    """``constraints.txt``'s ``name==version`` lines, by normalized name."""
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            out[_norm(name)] = version.strip()
    return out


def lower_bounds() -> dict[str, str]:
    """Every ``name>=X`` of ``pyproject.toml``'s dependencies and optional dependencies (but the lint tools),
    by normalized name; two bounds of one name must agree."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project.get("dependencies", []))
    for extra, reqs in project.get("optional-dependencies", {}).items():
        if extra != "lint":
            specs.extend(reqs)
    bounds: dict[str, str] = {}
    for spec in specs:
        m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?\s*>=\s*([0-9][^,;\s]*)\s*(?:,.*)?", spec)
        if not m:
            continue
        name, version = _norm(m.group(1)), m.group(2)
        if name in TOOLS:
            continue
        if bounds.setdefault(name, version) != version:
            raise SystemExit(f"pyproject.toml gives {name} two lower bounds: {bounds[name]} and {version}")
    return bounds


def requirements(lane: str) -> list[str]:
    """What ``pip install`` is given for ``lane``."""
    pinned = pins()
    if lane == "latest":
        return list(LATEST)
    bounds = lower_bounds()
    for name in KEEP_PINNED:
        if name in bounds and _release(bounds[name]) != _release(pinned.get(name, "")):
            raise SystemExit(
                f"pyproject.toml says {name}>={bounds[name]} but the lanes run {name}=={pinned.get(name)} only: "
                f"raise the bound to the tested release, or add a lane that installs {name}=={bounds[name]}"
            )
    return [f"{name}=={version}" for name, version in sorted(bounds.items()) if name not in KEEP_PINNED]


def _site_packages(python: Path) -> str:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True).stdout.strip()


def setup(lane: str) -> tuple[Path, dict[str, str]]:
    """(the lane's python, {package: version it imports}); exits 2 when the environment cannot be built."""
    base_python = BASE / "bin" / "python"
    if not base_python.exists():
        raise SystemExit(f"{base_python} is missing: run `make build` first")
    env_dir = ROOT / f".venv-{lane}"
    shutil.rmtree(env_dir, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(env_dir)], check=True)
    python = env_dir / "bin" / "python"
    # the pinned environment behind the lane's own packages (processed like a site dir: its .pth files too)
    overlay = Path(_site_packages(python)) / "_hp_fastload_pinned.pth"
    overlay.write_text(f"import site; site.addsitedir({_site_packages(base_python)!r})\n")
    pinned = pins()
    keep = env_dir / "keep-pinned.txt"
    keep.write_text("".join(f"{n}=={pinned[n]}\n" for n in KEEP_PINNED))
    wanted = requirements(lane)
    cmd = [str(python), "-m", "pip", "install", "-q", "--upgrade", "-c", str(keep), *wanted]
    print(f"lane {lane}: pip install {' '.join(wanted)}", flush=True)
    if subprocess.run(cmd).returncode != 0:
        raise SystemExit(2)
    names = [re.split(r"[=<>\[]", w)[0] for w in wanted] + list(KEEP_PINNED)
    code = (
        "import json, sys; from importlib.metadata import version\n"
        "print(json.dumps({n: version(n) for n in sys.argv[1:]}))"
    )
    found = json.loads(
        subprocess.run([str(python), "-c", code, *names], check=True, capture_output=True, text=True).stdout
    )
    for want in wanted:
        if "==" in want:
            name, version = want.split("==")
            if _release(found[name]) != _release(version):
                raise SystemExit(f"lane {lane}: asked for {want} but the lane imports {name} {found[name]}")
    for name in KEEP_PINNED:
        if _release(found[name]) != _release(pinned[_norm(name)]):
            raise SystemExit(f"lane {lane}: {name} {found[name]} is not the pinned {pinned[_norm(name)]}")
    (env_dir / "versions.json").write_text(json.dumps(found, indent=2) + "\n")
    return python, found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["run", "versions"])
    parser.add_argument("lane", choices=["latest", "oldest"])
    parser.add_argument("pytest_args", nargs="*", help="after --: extra pytest arguments (default: the lane's subset)")
    args = parser.parse_args(argv)
    if args.command == "versions":
        print("\n".join(requirements(args.lane)))
        return 0
    start = time.monotonic()
    python, versions = setup(args.lane)
    line = " ".join(f"{n}=={v}" for n, v in versions.items())
    print(f"lane {args.lane}: {line}", flush=True)
    subprocess.run([str(python), "-m", "hp_fastload.cli", "info"], check=True)
    pytest = [str(python), "-m", "pytest", "-q", "-m", "not slow", "-p", "no:cacheprovider"]
    # the pinned environment's executables (SeaweedFS's `weed`, the s3:// tests' server) after the lane's own
    path = os.pathsep.join([str(python.parent), str(BASE / "bin"), os.environ.get("PATH", "")])
    env = {**os.environ, "HP_FASTLOAD_LANE": args.lane, "PATH": path}
    status = subprocess.run([*pytest, *(args.pytest_args or SUBSET)], env=env)
    took = time.monotonic() - start
    verdict = "passed" if status.returncode == 0 else f"FAILED (pytest exit {status.returncode})"
    print(f"lane {args.lane} {verdict} in {took:.0f} s with {line}", flush=True)
    return status.returncode


if __name__ == "__main__":
    sys.exit(main())
