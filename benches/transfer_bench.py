"""Transfer benchmark: ``hp_fastload.transfer`` between two live layouts against its peers, on gloo ranks, same run.

    python benches/transfer_bench.py                      # 106M-parameter Llama (fp32, 424 MB), 2 ranks (~3 min)
    python benches/transfer_bench.py --world 4 --repeats 3
    python benches/transfer_bench.py --quick              # tiny model (tests/benches/test_bench_scripts.py)

Per layout pair (``fsdp_tp``: an FSDP2 trainer into a tensor-parallel model on the same ranks; ``tp_fsdp``: back;
``disjoint``: FSDP2 on the first half of the ranks into TP on the second half), one spawn of ``--world`` ranks
builds the source (filled with seeded values) and the destination, then runs each method ``--repeats`` times,
the order flipped every repeat, between barriers:

- ``hp_transfer``: ``hp_fastload.transfer(src, dst)`` as a sync loop calls it (the models unchanged since the
  previous call, so its plan is run again; one untimed call first): each destination byte sent once, point to
  point;
- ``hp_transfer_first``: the same call with the kept plan dropped first: the first call's cost, planning included;
- ``save_load_shm``: ``hp_fastload.save(src, dir)`` into ``/dev/shm`` then ``hp_fastload.load(dst, dir)`` (the
  fastest storage route: tmpfs, no disk; the directory removed after, outside the timing);
- ``gather_distribute``: every source tensor gathered whole on every source rank (``DTensor.full_tensor``), the
  full state dict broadcast to the destination ranks where they are others, and each destination shard cut by
  ``distribute_tensor(full, mesh, placements, src_data_rank=None)`` and copied in (the usual RL weight sync).

Per method: the slowest rank's seconds (median over repeats), the bytes that reached destination shards over
the bytes they hold (``moved / needed``), and the peak RSS growth of a rank during the method (sampled every
5 ms). Every method's destination shards must be bit-equal to the transfer's (a digest per rank). Results: a
table on stdout and ``<out>/transfer_bench.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ranks import model_config, run_ranks
from _rss import PeakRss, rss

METHODS = ["hp_transfer", "hp_transfer_first", "save_load_shm", "gather_distribute"]
#: what ``hp_transfer`` keeps on the models between calls (its plan); ``hp_transfer_first`` drops it first
MEMO = "_hp_transfer_prepared"
PAIRS = ["fsdp_tp", "tp_fsdp", "disjoint"]
COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROWWISE = ("o_proj", "down_proj")


def _fsdp(model: Any, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _tp(model: Any, mesh: Any) -> None:
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan: dict[str, Any] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.endswith(COLWISE):
            plan[name] = ColwiseParallel()
        elif (isinstance(module, nn.Linear) and name.endswith(ROWWISE)) or name.endswith("embed_tokens"):
            plan[name] = RowwiseParallel()
    parallelize_module(model, mesh, plan)


def _build(config: Any, layout: str, mesh: Any, seed: int | None) -> Any:
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    (_fsdp if layout == "fsdp" else _tp)(model, mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed or 0)
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if seed is None:
                local.zero_()
            else:
                local.copy_(torch.randn(local.shape, generator=gen, dtype=local.dtype))
    return model


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def _digest(model: Any) -> str | None:
    import torch

    if model is None:
        return None
    h = hashlib.blake2b(digest_size=16)
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(_local(t).detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _local_bytes(model: Any) -> int:
    if model is None:
        return 0
    return sum(_local(t).numel() * _local(t).element_size() for t in model.state_dict().values())


def _gather_distribute(src: Any, dst: Any, world: int, disjoint: bool) -> int:
    """The usual RL sync: full tensors gathered on the source ranks, sent to the destination ranks if they are
    others (rank ``r`` of the source half to rank ``r + world / 2``), each destination shard cut from them.
    Returns the bytes of full tensors this rank received."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor

    received = 0
    full: dict[str, Any] = {}
    if src is not None:
        for name, t in src.state_dict().items():
            full[name] = t.full_tensor() if isinstance(t, DTensor) else t.detach()
            received += full[name].numel() * full[name].element_size()
    if disjoint:
        rank, half = dist.get_rank(), world // 2
        names = list((src or dst).state_dict())
        if src is not None:
            for name in names:
                dist.send(full[name].contiguous(), rank + half)
        else:
            for name, t in dst.state_dict().items():
                buf = torch.empty(tuple(t.shape), dtype=t.dtype)
                dist.recv(buf, rank - half)
                full[name] = buf
                received += buf.numel() * buf.element_size()
    if dst is not None:
        with torch.no_grad():
            for name, t in dst.state_dict().items():
                if isinstance(t, DTensor):
                    shard = distribute_tensor(full[name], t.device_mesh, t.placements, src_data_rank=None)
                    t.to_local().copy_(shard.to_local())
                else:
                    t.copy_(full[name])
    return received


def _rank(rank: int, world: int, port: int, pair: str, quick: bool, repeats: int, shm: str, q: Any) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from transformers import LlamaConfig

        import hp_fastload as hf

        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        config = LlamaConfig(**model_config(quick), num_key_value_heads=4, tie_word_embeddings=False)
        disjoint = pair == "disjoint"
        if disjoint:
            sub = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("side", "x"))["x"]
            src = _build(config, "fsdp", sub, seed=1) if rank < world // 2 else None
            dst = _build(config, "tp", sub, seed=None) if rank >= world // 2 else None
        else:
            mesh = init_device_mesh("cpu", (world,))
            src_layout, dst_layout = pair.split("_")
            src = _build(config, src_layout, mesh, seed=1)
            dst = _build(config, dst_layout, mesh, seed=None)
        methods = [m for m in METHODS if not (disjoint and m == "save_load_shm")]
        hf.transfer(src, dst)  # the sync loop's first call, untimed: hp_transfer runs its kept plan
        out: list[dict[str, Any]] = []
        for repeat in range(repeats):
            for method in methods if repeat % 2 == 0 else methods[::-1]:
                if dst is not None:
                    with torch.no_grad():
                        for t in dst.state_dict().values():
                            _local(t).zero_()
                path = Path(shm) / f"{pair}-{repeat}"
                dist.barrier()
                before = rss()
                extra: dict[str, Any] = {}
                with PeakRss() as peak:
                    t0 = time.perf_counter()
                    if method.startswith("hp_transfer"):
                        if method == "hp_transfer_first":
                            for model in (src, dst):
                                if model is not None:
                                    model.__dict__.pop(MEMO, None)
                        report = hf.transfer(src, dst)
                        extra = {
                            "moved_over_needed": report.moved_over_needed,
                            "bytes_sent": report.bytes_sent,
                            "bytes_received": report.bytes_received,
                            "bytes_copied": report.bytes_copied,
                            "planning_seconds": report.seconds_planning,
                            "peak_staging_bytes": report.peak_staging_bytes,
                            "messages": report.messages_sent + report.messages_received,
                            "rounds": report.rounds,
                            "planned": report.planned,
                        }
                    elif method == "save_load_shm":
                        hf.save(src, path, overwrite=True)
                        hf.load(dst, path)
                    else:
                        extra = {"full_bytes_received": _gather_distribute(src, dst, world, disjoint)}
                    seconds = time.perf_counter() - t0
                dist.barrier()
                if rank == 0 and path.exists():
                    shutil.rmtree(path, ignore_errors=True)
                out.append(
                    {
                        "method": method,
                        "repeat": repeat,
                        "seconds": seconds,
                        "rss_growth": peak.peak - before,
                        "digest": _digest(dst),
                        "needed": _local_bytes(dst),
                        "shards": _local_bytes(src) + _local_bytes(dst),
                        **extra,
                    }
                )
        dist.barrier()
        dist.destroy_process_group()
        q.put((rank, {"rows": out}))
    except BaseException as exc:  # reported by the parent
        import traceback

        q.put((rank, {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}))


def summarize(pair: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    methods = sorted({r["method"] for r in ranks[0]["rows"]}, key=METHODS.index)
    digests_ok = True
    for method in methods:
        repeats = sorted({r["repeat"] for r in ranks[0]["rows"] if r["method"] == method})
        slowest = []
        growth = []
        for repeat in repeats:
            per_rank = [next(r for r in rk["rows"] if r["method"] == method and r["repeat"] == repeat) for rk in ranks]
            slowest.append(max(r["seconds"] for r in per_rank))
            growth.append(max(r["rss_growth"] for r in per_rank))
            reference = [
                next(r for r in rk["rows"] if r["method"] == "hp_transfer" and r["repeat"] == repeat)["digest"]
                for rk in ranks
            ]
            digests_ok &= [r["digest"] for r in per_rank] == reference
        first = [next(r for r in rk["rows"] if r["method"] == method) for rk in ranks]
        row: dict[str, Any] = {
            "seconds_median": statistics.median(slowest),
            "seconds": slowest,
            "rss_growth_median_max_rank": statistics.median(growth),
            "shards_max_rank": max(r["shards"] for r in first),
        }
        needed = sum(r["needed"] for r in first)
        if method.startswith("hp_transfer"):
            row["planned"] = sorted({r["planned"] for rk in ranks for r in rk["rows"] if r["method"] == method})
            row["moved_over_needed"] = first[0]["moved_over_needed"]
            row["planning_seconds_max_rank"] = max(r["planning_seconds"] for r in first)
            row["peak_staging_max_rank"] = max(r["peak_staging_bytes"] for r in first)
            row["messages"] = sum(r["messages"] for r in first) // 2
            row["rounds"] = first[0]["rounds"]
        elif method == "gather_distribute":
            row["moved_over_needed"] = sum(r["full_bytes_received"] for r in first) / needed
        else:
            row["moved_over_needed"] = None  # written whole, then read: 2 x the checkpoint through tmpfs
        rows[method] = row
    base = rows["hp_transfer"]["seconds_median"]
    for row in rows.values():
        row["x_slower_than_transfer"] = row["seconds_median"] / base
    return {"pair": pair, "methods": rows, "digests_equal": digests_ok}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, one repeat")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--pairs", nargs="+", default=PAIRS, choices=PAIRS)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    repeats = args.repeats or (1 if args.quick else 3)
    out = Path(args.out or tempfile.mkdtemp(prefix="hp_transfer_bench_"))
    out.mkdir(parents=True, exist_ok=True)
    shm = tempfile.mkdtemp(prefix="hp_transfer_bench_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    results = []
    failed = False
    try:
        for pair in args.pairs:
            ranks = run_ranks(_rank, args.world, pair, args.quick, repeats, shm)
            errors = [r["error"] for r in ranks if "error" in r]
            if errors:
                print(f"{pair}: {errors[0]}", file=sys.stderr)
                results.append({"pair": pair, "error": errors[0]})
                failed = True
                continue
            results.append(summarize(pair, ranks))
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    (out / "transfer_bench.json").write_text(json.dumps({"world": args.world, "results": results}, indent=2))
    print(f"{'pair':<10} {'method':<18} {'seconds':>8} {'x transfer':>10} {'moved/needed':>12} {'peak RSS +MB':>12}")
    for result in results:
        if "error" in result:
            continue
        for method, row in result["methods"].items():
            moved = row["moved_over_needed"]
            ratio, growth = row["x_slower_than_transfer"], row["rss_growth_median_max_rank"] / 1e6
            print(
                f"{result['pair']:<10} {method:<18} {row['seconds_median']:>8.3f} {ratio:>10.2f} "
                f"{'-' if moved is None else f'{moved:.2f}':>12} {growth:>12.1f}"
            )
        failed |= not result["digests_equal"]
        if not result["digests_equal"]:
            print(f"{result['pair']}: a method's destination shards differ from the transfer's", file=sys.stderr)
    print(f"results: {out / 'transfer_bench.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
