"""Where a load's wall time goes (issue 40): ``LoadReport.critical_path`` of the small rows, with the peers of
each row measured alternately in the same run.

    python benches/critical_path.py --data bench-out/data          # the checkpoints benches/compare.py writes
    python benches/critical_path.py --data DIR --rows moe-ep --rounds 9

Rows (all warm, the harness of ``benches/_peers.py``):

- ``e2e-tp``: 2 gloo ranks, TP, fresh destinations per repetition: ``hp_fastload.load`` vs safetensors, the
  slowest rank's seconds; hp's phases are those of its slowest rank.
- ``moe-ep``: the MoE expert-parallel rank 3 of 8 (one process, torch's fake world): ``load`` vs ``read_many`` of
  the same boxes vs safetensors handed the exact keys.
- ``dense-s0`` / ``dense-s1`` / ``dense-tp``: rank 3 of 8 of the dense checkpoint, rows, columns, TP: ``load``
  vs ``read_many`` vs safetensors.

Each round runs every loader of a row once, in turn; medians over the rounds, ratios within the run. Prints one
table and writes ``--out`` (JSON). The full-size rows are ``hp-fastload plan CKPT --layout L --world W --rank r
--execute --json`` (its ``critical_path``) on the sparse checkpoints of ``benches/scale.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _peers  # noqa: E402

RAW_ROWS = {
    "moe-ep": ("moe", "ep"),
    "dense-s0": ("dense", "s0"),
    "dense-s1": ("dense", "s1"),
    "dense-tp": ("dense", "tp"),
}
RAW_LOADERS = ("hp_dcp", "hp_read_many", "st_slice")


def checkpoint(data: Path, kind: str) -> str:
    """The folder of ``data`` holding compare.py's ``kind`` checkpoint (``dense-2.6gb``, ``moe-12x576``, ``dense-quick``
    ...): the one written last when there are several."""
    found = sorted(data.glob(f"{kind}-*/config.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(
            f"no {kind}-* checkpoint under {data} (write one with benches/compare.py --data {data})"
        )
    return str(found[-1].parent)


def _median_phases(paths: list[dict[str, float]]) -> dict[str, float]:
    return {phase: statistics.median(p[phase] for p in paths) for phase in paths[0]} if paths else {}


def e2e_row(data: Path, rounds: int, repeats: int) -> dict[str, Any]:
    seconds: dict[str, list[float]] = {"hp_dcp": [], "st_slice": []}
    paths: list[dict[str, float]] = []
    for _ in range(rounds):
        for loader in seconds:
            cfg = dict(
                workload="e2e-dense",
                ckpt=checkpoint(data, "dense"),
                scenario="tp",
                loader=loader,
                world=2,
                repeats=repeats,
                timeout=600,
            )
            result = _peers.run_e2e(cfg)
            if "error" in result:
                raise RuntimeError(f"e2e {loader}: {result['error']}\n{result.get('traceback')}")
            seconds[loader] += [r["seconds"] for r in result["repeats"]]
            paths += [r["critical_path"] for r in result["repeats"] if "critical_path" in r]
    return _row("e2e-tp", seconds, paths)


def raw_row(name: str, data: Path, rounds: int) -> dict[str, Any]:
    kind, scenario = RAW_ROWS[name]
    ckpt = checkpoint(data, kind)
    entries = _peers.checkpoint_entries(ckpt)
    files = _peers.checkpoint_files(ckpt)
    dests = _peers.build_destinations(entries, scenario, 8, 3)
    ctx = {"model": _peers.model_over(ckpt, dests, _MESH)}
    seconds: dict[str, list[float]] = {loader: [] for loader in RAW_LOADERS}
    paths: list[dict[str, float]] = []
    for round_no in range(rounds + 1):  # round 0 untimed (first-call costs)
        for loader in RAW_LOADERS:
            dests.zero()
            if _peers.residency(files) < 1.0:
                _peers.warm(files)
            t0 = time.perf_counter()
            extra = _peers.RAW_LOADERS[loader](ckpt, dests, ctx)
            wall = time.perf_counter() - t0
            if round_no:
                seconds[loader].append(wall)
                if "critical_path" in extra:
                    paths.append(extra["critical_path"])
    verdict = _peers.verify(dests)
    if verdict.get("mismatched"):
        raise RuntimeError(f"{name}: {verdict}")
    return _row(name, seconds, paths)


def _row(name: str, seconds: dict[str, list[float]], paths: list[dict[str, float]]) -> dict[str, Any]:
    med = {loader: statistics.median(values) for loader, values in seconds.items()}
    hp = med["hp_dcp"]
    return dict(
        row=name,
        seconds=med,
        hp_speedup={loader: med[loader] / hp for loader in med if loader != "hp_dcp"},
        critical_path=_median_phases(paths),
        samples=seconds,
    )


def show(row: dict[str, Any]) -> str:
    parts = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in row["seconds"].items())
    ratios = ", ".join(f"{v:.2f}x {k}" for k, v in row["hp_speedup"].items())
    phases = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in row["critical_path"].items())
    return f"{row['row']}: {parts}; load = {ratios}\n    load's phases (ms, medians): {phases}"


_MESH: Any = None


def main(argv: list[str] | None = None) -> int:
    global _MESH
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="the checkpoint folder of benches/compare.py (its --data)")
    ap.add_argument("--rows", default="e2e-tp," + ",".join(RAW_ROWS))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--e2e-rounds", type=int, default=2)
    ap.add_argument("--e2e-repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    data = Path(args.data)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    out = []
    if "e2e-tp" in rows:  # forks its ranks: before this process joins a (fake) world
        out.append(e2e_row(data, args.e2e_rounds, args.e2e_repeats))
        print(show(out[-1]), flush=True)
    raw = [r for r in rows if r in RAW_ROWS]
    if raw:
        _MESH = _peers.fake_world(8, 3)
        for name in raw:
            out.append(raw_row(name, data, args.rounds))
            print(show(out[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
