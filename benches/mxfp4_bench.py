"""MXFP4 experts into bf16 tensors: the region path against the torch path and a bf16 load, in one run.

    python benches/mxfp4_bench.py              # gpt-oss-20b expert shapes, 8 experts x 2 layers (~400 MB bf16)
    python benches/mxfp4_bench.py --quick      # tiny, seconds (tests/benches/test_bench_scripts.py)
    python benches/mxfp4_bench.py --ep 8 --loaders hp_region,hp_bf16   # expert-parallel rank 3 of 8

The checkpoint holds gpt-oss's MXFP4 experts as it ships them (uint8 ``*_blocks`` of e2m1 pairs, uint8 e8m0
``*_scales``, an ``mxfp4`` ``quantization_config``; ``gpu_check.write_mxfp4_checkpoint``); a bf16 checkpoint of
the same tensors (the transposed layout transformers dequantizes into) is the anchor of the same output bytes.
Every measurement runs in a fresh worker process on a warm page cache, ``--repeats`` times (best and median),
loading a module whose parameter names are the model tensors:

- ``hp_region``: ``hp_fastload.load`` (the engine dequantizes each box in its copy pass);
- ``hp_torch``: the legacy loader, which dequantizes whole tensors with torch (the path MXFP4 took before);
- ``hp_bf16``: ``hp_fastload.load`` of the bf16 twin.

``--ep N`` loads expert-parallel rank 3 of N instead (the stacked experts ``Shard(0)`` DTensors over torch's fake
process group; plan + execution without the cross-rank collectives, as benches/quant_bench.py does): the rank
reads its experts' packed bytes and their scale rows. Every result is compared with the MXFP4 formula written
with torch ops (``gpu_check._mxfp4_reference``).
Writes ``<out>/mxfp4_bench.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import _peers  # noqa: E402
import gpu_check  # noqa: E402

#: the rank an ``--ep`` run loads
EP_RANK = 3


def expert_keys(quick: bool) -> list[tuple[str, tuple[int, ...]]]:
    """Model tensors ``[E, hidden, 2 * inter]`` and ``[E, inter, hidden]`` (gpt-oss-20b: 2880 each)."""
    e, h, inter, layers = (4, 64, 64, 2) if quick else (8, 2880, 2880, 2)
    out: list[tuple[str, tuple[int, ...]]] = []
    for i in range(layers):
        out.append((f"model.layers.{i}.mlp.experts.gate_up_proj", (e, h, 2 * inter)))
        out.append((f"model.layers.{i}.mlp.experts.down_proj", (e, inter, h)))
    return out


def write_bf16(path: Path, keys: list[tuple[str, tuple[int, ...]]]) -> None:
    import torch
    from safetensors.torch import save_file

    if (path / "done").exists():
        return
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    tensors = {k: torch.randn(s, generator=gen).to(torch.bfloat16) for k, s in keys}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "done").write_text("")


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    import hp_fastload as hf

    ckpt, loader = Path(spec["ckpt"]), spec["loader"]
    keys = [(k, tuple(s)) for k, s in spec["keys"]]
    files = sorted(str(p) for p in ckpt.glob("*.safetensors"))
    times = []
    params: dict[str, Any] = {}
    report = None
    world = spec.get("ep", 1)
    mesh = _peers.fake_world(world, EP_RANK) if world > 1 else None
    rank = EP_RANK if world > 1 else 0
    local_shapes = {k: (s[0] // world, *s[1:]) for k, s in keys}
    bytes_read = 0
    for _ in range(spec["repeats"]):
        _peers.warm(files)
        params = {k: torch.zeros(local_shapes[k], dtype=torch.bfloat16) for k, _ in keys}
        model = gpu_check._Tree.build(
            {k: list(s) for k, s in keys},
            "cpu",
            lambda k, s, p=params: _peers.as_dtensor(p[k], mesh, 0, tuple(s)),  # type: ignore[misc]
        )
        t0 = time.perf_counter()
        if mesh is None:
            report = hf.load(model, str(ckpt), strict=True, loader="legacy" if loader == "hp_torch" else "dcp")
            bytes_read = report.bytes_read
        else:  # one rank of a fake world: plan + execute, without the cross-rank agreement collectives
            from hp_fastload.api.request import plan_request
            from hp_fastload.execute.read import execute_plan
            from hp_fastload.planning.front import plan as plan_rank
            from hp_fastload.source.index import CheckpointIndex

            request = plan_request(model, loader="legacy" if loader == "hp_torch" else "dcp")
            plan, context = plan_rank(model, CheckpointIndex.open(ckpt), request)
            bytes_read = execute_plan(plan, context, legacy=loader == "hp_torch").bytes_read
            report = plan.report
        times.append(time.perf_counter() - t0)
    assert report is not None
    exact = None
    if loader != "hp_bf16":
        meta = json.loads((ckpt / "checksums.json").read_text())["files"]
        per = {k: s[0] for k, s in local_shapes.items()}
        exact = all(
            torch.equal(params[k], gpu_check._mxfp4_reference(ckpt, meta, k)[rank * per[k] : (rank + 1) * per[k]])
            for k, _ in keys
        )
    return {
        "best": min(times),
        "median": statistics.median(times),
        "times": times,
        "output_bytes": sum(t.numel() * 2 for t in params.values()),
        "bytes_read": bytes_read,
        "checkpoint_bytes": report.checkpoint_bytes,
        "deferred_targets": len(report.deferred_targets),
        "exact": exact,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench-out"))
    ap.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "hp_fastload_mxfp4_bench"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--loaders", default="hp_region,hp_torch,hp_bf16")
    ap.add_argument("--ep", type=int, default=1, help="load expert-parallel rank 3 of this many (fake world)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    keys = expert_keys(args.quick)
    if args.ep < 1 or any(s[0] % args.ep for _, s in keys) or (args.ep > 1 and args.ep <= EP_RANK):
        ap.error(f"--ep {args.ep}: the world must divide the {keys[0][1][0]} experts and hold rank {EP_RANK}")
    data = Path(args.data) / ("quick" if args.quick else "full")
    gpu_check.write_mxfp4_checkpoint(data / "mxfp4", keys, 2)
    write_bf16(data / "bf16", keys)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    results = []
    for loader in [x for x in args.loaders.split(",") if x]:
        ckpt = data / ("bf16" if loader == "hp_bf16" else "mxfp4")
        spec = {"ckpt": str(ckpt), "loader": loader, "keys": keys, "repeats": args.repeats, "ep": args.ep}
        proc = subprocess.run(
            [sys.executable, __file__, "--worker", json.dumps(spec)], env=env, capture_output=True, text=True
        )
        if proc.returncode != 0:
            results.append({"loader": loader, "error": proc.stderr[-2000:]})
            print(f"{loader}: FAILED\n{proc.stderr[-2000:]}", file=sys.stderr)
            continue
        r = {"loader": loader, **json.loads(proc.stdout.strip().splitlines()[-1])}
        results.append(r)
        print(
            f"{loader:10s} best {r['best']:.3f} s, median {r['median']:.3f} s, "
            f"{r['output_bytes'] / r['best'] / 1e9:.2f} GB/s out, read {r['bytes_read']} B, exact {r['exact']}",
            flush=True,
        )
    by = {r["loader"]: r for r in results if "best" in r}
    if "hp_region" in by and "hp_bf16" in by:
        print(f"region path at {by['hp_bf16']['best'] / by['hp_region']['best']:.2f}x the bf16 load's speed")
    if "hp_region" in by and "hp_torch" in by:
        print(f"region path {by['hp_torch']['best'] / by['hp_region']['best']:.1f}x the torch path")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mxfp4_bench.json").write_text(json.dumps({"keys": keys, "ep": args.ep, "results": results}, indent=1))
    bad = [r for r in results if "error" in r or r.get("exact") is False]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
