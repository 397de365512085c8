"""Loads on a real cluster on one machine (``tools/cluster.py``, ``make bench-cluster``): 2 nodes of 2 gloo ranks
in network namespaces, the checkpoint on SeaweedFS (S3) behind a link of its own, every link shaped with ``tbf``;
``share="none"``, ``"job"`` and ``"auto"`` under FSDP, HSDP, TP x FSDP (Llama) and EP with replicated attention
(Mixtral) at two link settings. Measured per row: the bytes on every link from the interfaces' own counters
(read around the load only: the ranks wait for the parent before and after it), the bytes the storage link
served, each rank's wall time; predicted: ``hp-fastload plan --all-ranks --share job`` given the same rates.
Every load is checked bit for bit against transformers' ``from_pretrained`` cut by ``distribute_tensor``.

    .venv/bin/python benches/cluster_bench.py [--quick] [--json out.json] [--markdown out.md]

Rates stay at tens to hundreds of Mbit/s: the machine has 2 cores, and the links, not the CPU, must be the
bottleneck (gloo and the S3 server move 50 MB/s here with CPU to spare). Jumbo frames (MTU 9000), as in a
data centre: at 1500 the TCP/IP and Ethernet headers alone are 4.6% of the payload.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.cluster import Cluster, Link  # noqa: E402

#: (name, storage link Mbit/s, node link Mbit/s)
SETTINGS = [("storage-bound", 100, 400), ("network-bound", 400, 100)]
SHARES = ("none", "job", "auto")
#: TCP payload of one segment at MTU 9000 (IP and TCP headers with timestamps: 52 bytes)
MSS = 8948
#: (layout, family)
LAYOUTS = [("fsdp", "llama"), ("hsdp", "llama"), ("tp+fsdp", "llama"), ("ep", "mixtral")]


def bench_body(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """A rank's steps: for each, wait for the parent (``ready<i>`` / ``go<i>``: it shapes the links and reads
    the counters), load, wait for the parent again, check the shards."""
    import torch.distributed as dist
    from tools.cluster_work import build, check_exact

    import hp_fastload
    from hp_fastload.execute import job as jobload

    # the delivery's phases of each job-wide load (its DeliveryStats: where a rank's time went), for the profile
    phases: list[dict[str, float]] = []
    inner = jobload.deliver

    def deliver(*args: Any, **kwargs: Any) -> Any:
        stats = inner(*args, **kwargs)
        phases.append({k: round(v, 3) for k, v in vars(stats).items() if k.startswith("seconds_") or k == "rounds"})
        return stats

    jobload.deliver = deliver  # type: ignore[assignment]

    rank = int(os.environ["RANK"])
    sync = Path(spec["sync"])
    model = build(spec["reference"], spec["layout"])

    def handshake(name: str) -> None:
        dist.barrier()
        if rank == 0:
            (sync / name).write_text("1")
            while not (sync / f"{name}.go").exists():
                time.sleep(0.01)
        dist.barrier()

    # one load first, not measured: the S3 client, the headers' first read and the first job plan
    hp_fastload.load(model, spec["checkpoint"], share="job", progress=False)
    out = []
    for i, step in enumerate(spec["steps"]):
        os.environ.update(step.get("env", {}))
        handshake(f"before{i}")
        phases.clear()
        t0 = time.perf_counter()
        report = hp_fastload.load(model, spec["checkpoint"], share=step["share"], progress=False)
        seconds = time.perf_counter() - t0
        handshake(f"after{i}")
        out.append(
            {
                "seconds": seconds,
                "share": report.share,
                "bytes_read": report.bytes_read,
                "bytes_received": report.bytes_received,
                "bytes_sent": report.bytes_sent,
                "stragglers": list(report.stragglers),
                "phases": dict(phases[0]) if phases else {},
                "mismatched": check_exact(model, spec["reference"]) if step.get("check", True) else [],
            }
        )
    return out


def predict(
    checkpoint: Path, layout: str, storage_mbit: float, node_mbit: float, total: bool, nodes: int = 2
) -> dict[str, Any]:
    """``hp-fastload plan --all-ranks --share job`` at these rates (GB/s = Mbit/s / 8000): each node reads at
    the slower of its link and the storage's, all nodes together at the storage's (``total``; ``share="auto"``
    knows no aggregate cap: without ``total`` it is what auto weighs), the network at the node link."""
    s, n = storage_mbit / 8000, node_mbit / 8000
    args = [sys.executable, "-m", "hp_fastload.cli", "plan", str(checkpoint), "--all-ranks", "--share", "job"]
    args += ["--layout", layout, "--world", str(2 * nodes), "--ranks-per-node", "2", "--json"]
    args += ["--storage-gbps", f"{min(s, n)}", "--network-gbps", f"{n}"]
    if total:
        args += ["--storage-total-gbps", f"{s}"]
    if layout in ("hsdp", "tp+fsdp", "2d"):
        args += ["--mesh", f"{nodes}x2"]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    proc = subprocess.run(args, capture_output=True, text=True, env=env, check=True, cwd=ROOT)
    return dict(json.loads(proc.stdout))


def run_layout(c: Cluster, layout: str, checkpoint: Path, url: str, shares: tuple[str, ...]) -> list[dict[str, Any]]:
    steps, meta = [], []
    for setting, storage, node in SETTINGS:
        for share in shares:
            # what share="auto" is told: the rate one node reads the storage at (its link or the storage's), and
            # its network rate
            env = {
                "HP_FASTLOAD_STORAGE_GBPS": str(min(storage, node) / 8000),
                "HP_FASTLOAD_NETWORK_GBPS": str(node / 8000),
            }
            steps.append({"share": share, "env": env})
            meta.append((setting, storage, node, share))
    sync = c.workdir / f"sync-{layout.replace('+', '_')}"
    sync.mkdir()
    spec = {"checkpoint": url, "reference": str(checkpoint), "layout": layout, "steps": steps, "sync": str(sync)}
    run = c.launch(bench_body, (spec,), env=c.s3_env(), timeout=900)
    rows = []
    for i, (setting, storage, node, share) in enumerate(meta):
        run.wait_for(sync / f"before{i}", timeout=300)
        c.shape("storage", Link(rate_mbit=storage))
        for n in range(c.nodes):
            c.shape(f"node{n}", Link(rate_mbit=node))
        before, resent = c.counters(), c.retransmits()
        (sync / f"before{i}.go").write_text("1")
        run.wait_for(sync / f"after{i}", timeout=300)
        after, resent_after = c.counters(), c.retransmits()
        (sync / f"after{i}.go").write_text("1")
        delta = {k: (after[k][0] - before[k][0], after[k][1] - before[k][1]) for k in after}
        retrans = {k: resent_after[k] - resent[k] for k in resent}
        rows.append({"layout": layout, "setting": setting, "storage_mbit": storage, "node_mbit": node,
                     "share_asked": share, "links": delta, "retransmitted_segments": retrans})  # fmt: skip
    outcomes = run.wait(timeout=600)
    bad = [f"{o}\n{o.traceback}" for o in outcomes if not o.ok]
    if bad:
        raise RuntimeError("\n".join(bad))
    for i, row in enumerate(rows):
        per_rank = [o.value[i] for o in outcomes]
        row["share"] = per_rank[0]["share"]
        row["rank_seconds"] = [r["seconds"] for r in per_rank]
        row["seconds"] = max(row["rank_seconds"])
        row["bytes_read"] = [r["bytes_read"] for r in per_rank]
        row["bytes_received"] = [r["bytes_received"] for r in per_rank]
        row["stragglers"] = per_rank[0]["stragglers"]
        row["phases"] = [r["phases"] for r in per_rank]
        row["exact"] = all(not r["mismatched"] for r in per_rank)
    return rows


def evaluate(rows: list[dict[str, Any]], plans: dict[tuple[str, str], dict[str, Any]]) -> None:
    """The targets of issue 38, per row (see the module's docstring of docs/benchmarks.md's section)."""
    by = {(r["layout"], r["setting"], r["share_asked"]): r for r in rows}
    for row in rows:
        nodes = len([k for k in row["links"] if k.startswith("node")])
        plan = plans[(row["layout"], row["setting"])]
        auto_plan = plans[(row["layout"], row["setting"] + "/auto")]
        needs = plan["job_needs_bytes"]
        strategy = row["share"]
        storage_tx = row["links"]["storage"][1]
        row["storage_over_needs"] = storage_tx / needs
        if strategy == "job":
            node_need = [
                a + b for a, b in zip(plan["per_node_storage_bytes"], plan["per_node_received_bytes"], strict=True)
            ]
        else:
            node_need = [sum(plan["per_rank_needed_bytes"][2 * n : 2 * n + 2]) for n in range(nodes)]
        row["node_rx_over_needs"] = [row["links"][f"node{n}"][0] / node_need[n] for n in range(nodes)]
        predicted = plan["predicted_seconds"].get(strategy)
        row["predicted_seconds"] = predicted
        row["model_error"] = predicted / row["seconds"] - 1 if predicted else None
        row["auto_predicted"] = min(("none", "job"), key=lambda s: auto_plan["predicted_seconds"][s])
        none, job = by.get((row["layout"], row["setting"], "none")), by.get((row["layout"], row["setting"], "job"))
        auto = by.get((row["layout"], row["setting"], "auto"))
        if none and job:
            row["fastest"] = "job" if job["seconds"] < none["seconds"] else "none"
            row["none_over_job"] = none["seconds"] / job["seconds"]
        if auto:
            row["auto_ran"] = auto["share"]


def markdown(rows: list[dict[str, Any]], checkpoint_mb: dict[str, float]) -> str:
    head = (
        "| layout | setting (storage / node link, Mbit/s) | share | wall s (max rank) | ranks' s | storage tx MB "
        "| storage / job needs | storage resent MB | node rx MB | node rx / needs | predicted s | model error "
        "| auto ran | measured fastest (none / job) | exact |\n" + "|---" * 15 + "|\n"
    )
    lines = []
    for r in rows:
        share = r["share"] if r["share_asked"] != "auto" else f"auto -> {r['share']}"
        rx = [v[0] / 1e6 for k, v in sorted(r["links"].items()) if k.startswith("node")]
        err = f"{r['model_error']:+.0%}" if r.get("model_error") is not None else "-"
        lines.append(
            f"| {r['layout']} ({checkpoint_mb[r['layout']]:.0f} MB) | {r['setting']} ({r['storage_mbit']} / "
            f"{r['node_mbit']}) | {share} | {r['seconds']:.2f} | {', '.join(f'{s:.2f}' for s in r['rank_seconds'])} "
            f"| {r['links']['storage'][1] / 1e6:.1f} | {r['storage_over_needs']:.3f} | "
            f"{r['retransmitted_segments']['storage'] * MSS / 1e6:.1f} | {', '.join(f'{x:.1f}' for x in rx)} | "
            f"{', '.join(f'{x:.3f}' for x in r['node_rx_over_needs'])} | "
            f"{r['predicted_seconds']:.2f} | {err} | {r.get('auto_ran', '-')} | "
            f"{r.get('fastest', '-')} ({r.get('none_over_job', 0):.2f}x) | "
            f"{'yes' if r['exact'] else 'NO'} |"
        )
    return head + "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny checkpoints, one layout (a smoke run)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    parser.add_argument("--layouts", default=None, help="comma-separated subset of fsdp,hsdp,tp+fsdp,ep")
    parser.add_argument("--nodes", type=int, default=2, help="nodes of 2 ranks (default 2)")
    args = parser.parse_args()
    from tools.cluster_work import write_model

    layouts = LAYOUTS if not args.layouts else [x for x in LAYOUTS if x[0] in args.layouts.split(",")]
    if args.quick:
        layouts = layouts[1:2]
    work = Path(tempfile.mkdtemp(prefix="cluster-bench-"))
    sizes = {} if args.quick else {"hidden": 512, "layers": 4, "vocab": 8192}
    checkpoints = {
        "llama": write_model(work, "llama", intermediate=1376 if sizes else 256, shard="16MB", **sizes),
        "mixtral": write_model(
            work, "mixtral", intermediate=512 if sizes else 128, shard="16MB", experts=2 * args.nodes, **sizes
        ),
    }
    size_mb = {
        family: sum(p.stat().st_size for p in d.glob("*.safetensors")) / 1e6 for family, d in checkpoints.items()
    }
    rows: list[dict[str, Any]] = []
    plans: dict[tuple[str, str], dict[str, Any]] = {}
    for layout, family in layouts:
        for setting, storage, node in SETTINGS:
            plans[(layout, setting)] = predict(checkpoints[family], layout, storage, node, True, args.nodes)
            plans[(layout, setting + "/auto")] = predict(checkpoints[family], layout, storage, node, False, args.nodes)
    with Cluster(args.nodes, 2, node_link=Link(rate_mbit=400), storage_link=Link(rate_mbit=400), mtu=9000) as c:
        urls = {family: c.upload(d, family) for family, d in checkpoints.items()}
        for layout, family in layouts:
            t = time.perf_counter()
            rows += run_layout(c, layout, checkpoints[family], urls[family], SHARES)
            print(f"{layout}: {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    evaluate(rows, plans)
    table = markdown(rows, {layout: size_mb[family] for layout, family in layouts})
    print(table)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "checkpoint_mb": size_mb}, indent=2))
    if args.markdown:
        args.markdown.write_text(table)
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
