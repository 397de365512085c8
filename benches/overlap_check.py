"""The destination-overlap check on interleaved boxes: eight [4M, 1] column boxes of one [4M, 8] fp32 tensor
read into ONE [4M, 8] output (interleaved destinations the engine must prove disjoint) against eight separate
outputs (trivially disjoint). Before the check worked on run descriptors, the first form expanded every
repetition: ~5x the data in RAM and ~14x the time of the second.

    python benches/overlap_check.py [--dir DIR] [--rows N]     # prints both forms: median seconds, peak RSS

Each form runs in its own child process so that peak RSS is its own.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time


def run(form: str, path: str, rows: int) -> dict[str, float]:
    import torch

    import hp_fastload as hf

    if form == "one_output":
        out = torch.empty(rows, 8)
        requests = [(path, "w", (0, c), (rows, 1), out[:, c : c + 1]) for c in range(8)]
    else:
        outs = [torch.empty(rows, 1) for _ in range(8)]
        requests = [(path, "w", (0, c), (rows, 1), outs[c]) for c in range(8)]
    hf.read_many(requests)  # page cache warm
    times = []
    for _ in range(3):
        start = time.perf_counter()
        hf.read_many(requests)
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": statistics.median(times), "peak_rss_mib": peak / 2**20}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="where the test file is written (default: a temporary directory)")
    ap.add_argument("--rows", type=int, default=4 << 20, help="rows of the [rows, 8] fp32 tensor")
    ap.add_argument("--form", choices=["one_output", "separate"], help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.form:
        print(json.dumps(run(args.form, args.path, args.rows)))
        return 0
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        import torch
        from safetensors.torch import save_file

        path = os.path.join(tmp, "cols.safetensors")
        save_file({"w": torch.randn(args.rows, 8, generator=torch.Generator().manual_seed(0))}, path)
        data_mib = args.rows * 8 * 4 / 2**20
        print(f"[{args.rows}, 8] fp32 ({data_mib:.0f} MiB), eight [{args.rows}, 1] column boxes")
        for form in ("one_output", "separate"):
            out = subprocess.run(
                [sys.executable, __file__, "--form", form, "--path", path, "--rows", str(args.rows)],
                check=True,
                capture_output=True,
                text=True,
            )
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{form:>10}: {r['seconds']:.3f} s (median of 3), peak RSS {r['peak_rss_mib']:.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
