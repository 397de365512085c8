"""Calibrating the job-wide cost model on this machine (issue 24, T5): the engine's read GB/s, gloo's point-to-point
GB/s and one agreement's latency, measured; then a few real ``load(..., share=...)`` runs on 4 gloo ranks in 2
simulated nodes (``LOCAL_WORLD_SIZE=2``), their transfer phase timed on every rank, against the simulator's
prediction for the same layout (``hp_fastload.api.ranks.simulate``) with the measured numbers.

    .venv/bin/python benches/jobwide_calibrate.py                 # ~200 MB Qwen3-MoE checkpoint in a temp dir
    .venv/bin/python benches/jobwide_calibrate.py --checkpoint DIR --json out.json

On one machine the simulated nodes share its disk (page cache) and its cores: a node's storage bandwidth is the
engine's rate divided among the nodes reading at once, and so is the network's (loopback gloo), which is what
``--storage-gbps`` / ``--network-gbps`` are set to here (see docs/job-wide.md, "Calibration").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORLD = 4
RANKS_PER_NODE = 2
LAYOUTS = (("fsdp", None), ("2d", (2, 2)), ("ep", None))


def write_checkpoint(root: Path, hidden: int, layers: int, experts: int) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3_moe",
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        moe_intermediate_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=hidden // 8,
        num_experts=experts,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(root, max_shard_size="64MB")


def engine_gbps(root: Path, repeats: int = 3) -> float:
    """Warm reads of every tensor of the checkpoint in one engine call (all threads): GB/s, best of ``repeats``."""
    import torch
    from safetensors import safe_open

    import hp_fastload as hf

    requests = []
    for path in sorted(root.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                shape = f.get_slice(key).get_shape()
                dtype = {"BF16": torch.bfloat16, "F32": torch.float32}[f.get_slice(key).get_dtype()]
                out = torch.empty(shape, dtype=dtype)
                requests.append((str(path), key, [0] * len(shape), list(shape), out))
    total = sum(r[4].numel() * r[4].element_size() for r in requests)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        hf.read_many(requests)
        best = min(best, time.perf_counter() - t0)
    return total / best / 1e9


def memcpy_gbps(nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """One thread copying ``nbytes`` into a freshly allocated buffer (as a receiver places the bytes it is sent:
    the kernel zeroes each new page on first touch): GB/s, best of ``repeats``."""
    import numpy as np

    src = np.ones(nbytes, dtype=np.uint8)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst = np.empty_like(src)
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
        del dst
    return nbytes / best / 1e9


def _gloo_rank(rank: int, world: int, port: int, nbytes: int, queue: Any) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    buf = torch.ones(nbytes, dtype=torch.uint8)
    peer = 1 - rank
    times = []
    for _ in range(4):
        dist.barrier()
        t0 = time.perf_counter()
        works = [dist.isend(buf, dst=peer), dist.irecv(torch.empty_like(buf), src=peer)]
        for w in works:
            w.wait()
        times.append(time.perf_counter() - t0)
    lat = []
    for _ in range(20):
        t0 = time.perf_counter()
        out: list[Any] = [None] * world
        dist.all_gather_object(out, None)
        lat.append(time.perf_counter() - t0)
    if rank == 0:
        queue.put((nbytes / min(times[1:]) / 1e9, sorted(lat)[len(lat) // 2]))
    dist.destroy_process_group()


def gloo_gbps(nbytes: int = 64 << 20) -> tuple[float, float]:
    """Two ranks exchanging ``nbytes`` each way at once: GB/s per direction, and one agreement's latency (s)."""
    import torch.multiprocessing as mp
    from tests.helpers.dist import find_free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = find_free_port()
    procs = [ctx.Process(target=_gloo_rank, args=(r, 2, port, nbytes, queue)) for r in range(2)]
    for p in procs:
        p.start()
    result = queue.get(timeout=300)
    for p in procs:
        p.join(60)
    return result


def _load_rank(rank: int, world: int, root: str, layout: str, mesh: Any, share: str, repeats: int) -> dict[str, Any]:
    """One rank of a measured run: the model laid out on meta, materialized, loaded once to warm the page cache,
    then ``repeats`` times with the transfer phase timed (``run_job`` for ``job``, ``execute_stream`` for
    ``none``, each entered after a barrier) and the job's phases (``DeliveryStats``) kept."""
    import torch

    import hp_fastload as hf
    import hp_fastload.api.load as load_module
    import hp_fastload.execute.job as job_module
    from hp_fastload.api.ranks import meta_model
    from hp_fastload.model.layouts import apply_layout
    from hp_fastload.source.location import resolve_checkpoint_location

    os.environ["LOCAL_WORLD_SIZE"] = str(RANKS_PER_NODE)
    model = meta_model(resolve_checkpoint_location(root), None)
    apply_layout(model, layout, world, mesh)
    model.to_empty(device="cpu")
    spans: list[float] = []
    delivered: list[Any] = []
    name = "run_job" if share == "job" else "execute_stream"
    original = getattr(load_module, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        torch.distributed.barrier()
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spans.append(time.perf_counter() - t0)

    setattr(load_module, name, timed)
    deliver = job_module.deliver

    def kept(*args: Any, **kwargs: Any) -> Any:
        stats = deliver(*args, **kwargs)
        delivered.append(stats)
        return stats

    job_module.deliver = kept
    hf.load(model, root, share=share, strict=False, ranks_per_node=RANKS_PER_NODE)  # warm the page cache
    runs = []
    for _ in range(repeats):
        spans.clear()
        delivered.clear()
        report = hf.load(model, root, share=share, strict=False, ranks_per_node=RANKS_PER_NODE)
        phases = {k[8:]: v for k, v in vars(delivered[-1]).items() if k.startswith("seconds_")} if delivered else {}
        runs.append({"seconds": spans[-1], "phases": phases})
    return {"runs": runs, "read": report.bytes_read, "received": report.bytes_received}


def measured_runs(
    root: Path, engine: float, gloo: float, latency: float, memcpy: float, repeats: int
) -> list[dict[str, Any]]:
    """Each layout and share measured (the slowest rank of each repeat; their median) beside the prediction.

    The simulated nodes share this machine, so the prediction runs per host (``ranks_per_host=WORLD``): the
    host reads at the engine's rate, every byte between ranks crosses its loopback at gloo's rate, and a rank
    copies at the memcpy rate times its share of the cores."""
    import statistics

    from tests.helpers.dist import run_distributed

    from hp_fastload.api.ranks import simulate

    share_of_cores = min(1.0, (os.cpu_count() or 1) / WORLD)
    rates = {
        "storage_gbps": engine,
        "network_gbps": gloo,
        "intra_node_gbps": gloo,
        "memory_gbps": memcpy * share_of_cores,
        "round_latency_s": latency,
        "ranks_per_host": WORLD,
    }
    rows = []
    for layout, mesh in LAYOUTS:
        sim = simulate(str(root), layout, WORLD, mesh=mesh, ranks_per_node=RANKS_PER_NODE, **rates)
        for share in ("none", "job"):
            per_rank = run_distributed(_load_rank, WORLD, str(root), layout, mesh, share, repeats, timeout=600)
            slowest = [max(r["runs"][i]["seconds"] for r in per_rank) for i in range(repeats)]
            measured = statistics.median(slowest)
            at = slowest.index(sorted(slowest)[len(slowest) // 2])  # the repeat whose time is the median
            phases = {
                k: max(r["runs"][at]["phases"].get(k, 0.0) for r in per_rank) for k in per_rank[0]["runs"][at]["phases"]
            }
            predicted = sim["predicted_seconds"][share]
            rows.append(
                {
                    "layout": layout,
                    "share": share,
                    "measured_s": measured,
                    "measured_each_s": slowest,
                    "predicted_s": predicted,
                    "error": predicted / measured - 1,
                    "measured_phases_max_s": phases,
                    "predicted_phases_s": sim["predicted_phases"][share],
                    "read_GB": sum(r["read"] for r in per_rank) / 1e9,
                    "received_GB": sum(r["received"] for r in per_rank) / 1e9,
                    "rounds": sim["rounds"],
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None, help="a Qwen3-MoE checkpoint directory (written if missing)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5, help="measured loads per layout and share (median)")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    root = Path(args.checkpoint) if args.checkpoint else Path(tempfile.mkdtemp(prefix="hpf_calibrate_"))
    if not (root / "config.json").exists():
        write_checkpoint(root, args.hidden, args.layers, args.experts)
    engine = engine_gbps(root)
    gloo, latency = gloo_gbps()
    memcpy = memcpy_gbps()
    measured = {"engine_GBps": engine, "gloo_GBps": gloo, "memcpy_GBps": memcpy, "agreement_latency_s": latency}
    print(json.dumps(measured), flush=True)
    rows = measured_runs(root, engine, gloo, latency, memcpy, args.repeats)
    if args.json:
        Path(args.json).write_text(json.dumps({**measured, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
