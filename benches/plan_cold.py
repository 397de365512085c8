"""One rank planned in a fresh process, as the CLI plans it, in CPU seconds: ``hp-fastload plan CKPT --layout L
--world W --rank R --json`` run once per tree and repetition, the trees alternating (an A/B in one sitting on a
shared box, where a lone wall time says nothing). The number read is the rank's ``cpu_seconds``: process CPU
seconds (every thread) from ``plan_each``'s call to its yield, the index open included, the model's build on
meta not.

Usage::

    python benches/plan_cold.py CKPT [--layout fsdp] [--world 256] [--rank 5] [--repeat 4] [--tree NAME=PYTHONPATH ...]

Without ``--tree`` the one tree is this checkout's ``python/``; e.g. ``--tree main=/work/main/python --tree
new=python`` compares another checkout's tree (with its own built extension) against this one. Prints each run
and, per tree, the median and the minimum.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cold_plan(tree: str, checkpoint: str, layout: str, world: int, rank: int) -> dict[str, float]:
    """The rank's ``cpu_seconds`` and ``seconds`` (and its bytes) from a fresh ``hp-fastload plan`` process."""
    env = dict(os.environ, PYTHONPATH=tree)
    args = ["plan", checkpoint, "--layout", layout, "--world", str(world), "--rank", str(rank), "--json"]
    proc = subprocess.run(
        [sys.executable, "-m", "hp_fastload.cli", *args], env=env, capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"hp-fastload {' '.join(args)} ({tree}) failed:\n{proc.stderr[-3000:]}")
    row = json.loads(proc.stdout)["ranks"][0]
    return {"cpu": row["cpu_seconds"], "wall": row["seconds"], "bytes": row["bytes_needed"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("checkpoint")
    parser.add_argument("--layout", default="fsdp")
    parser.add_argument("--world", type=int, default=256)
    parser.add_argument("--rank", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=4)
    parser.add_argument("--tree", action="append", default=[], help="NAME=PYTHONPATH (repeatable)")
    args = parser.parse_args(argv)
    trees = [t.split("=", 1) for t in args.tree] or [["this", str(ROOT / "python")]]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, _ in trees}
    for i in range(args.repeat):
        for name, path in trees:
            row = cold_plan(str(Path(path).resolve()), args.checkpoint, args.layout, args.world, args.rank)
            runs[name].append(row)
            print(f"{i + 1} {name:>6}: {row['cpu']:.3f} s CPU ({row['wall']:.3f} s wall), {row['bytes']:,} bytes")
    for name, rows in runs.items():
        cpu = [r["cpu"] for r in rows]
        print(f"{name:>6}: median {statistics.median(cpu):.3f} s CPU, min {min(cpu):.3f} over {len(cpu)} runs")
    if len({r["bytes"] for rows in runs.values() for r in rows}) > 1:
        print("the trees planned different bytes")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
