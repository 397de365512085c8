"""Export benchmark: ``hp_fastload.save`` against its peers on 2 gloo ranks, same run, same models.

    python benches/save_bench.py                 # dense ~1.5 GB bf16 Llama + ~0.75 GB Mixtral, FSDP2 (~5 min)
    python benches/save_bench.py --quick         # tiny models (tests/benches/test_bench_scripts.py); exit 1 on error
    python benches/save_bench.py --ab 7 --models dense moe layers   # hp_save: writes while planning vs plan first

Each (model, method) runs in a fresh 2-rank spawn: the model is built on meta, laid out with FSDP2 (every
decoder layer and the root), materialized and filled with seeded values; then, between barriers, one method
writes a Hugging Face checkpoint:

- ``hp_save``: ``hp_fastload.save(model, out)`` (every rank writes its own shards; fsyncs files and directory);
- ``dcp_hf``: torch DCP ``save`` with ``HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=
  True)`` (a sharded copy, then consolidation; the model's names, stacked experts kept);
- ``gather_save_pretrained``: ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` on every rank,
  then ``save_pretrained(state_dict=...)`` on rank 0.

Per rank: wall seconds, bytes passed to write syscalls (``/proc/self/io`` wchar), peak RSS and its growth
during the method. The output is checked afterwards: every tensor of the hp_fastload and save_pretrained
outputs read back with safetensors and compared. Results: a table on stdout and ``<out>/save_bench.json``.

``--ab ROUNDS`` (issue 40): ``hf.save`` alone, its writes starting while later targets are planned
(``STREAM_WRITES``, as shipped) against the whole plan made first and written in one pass (the order before),
alternated in one 2-rank spawn per model (the order flipped every round), ROUNDS times each. Per mode: the
median seconds of the slower rank, and ``SaveReport.planning_hidden``; per model, the region planning alone
(``PlanStream.plan`` after the key-level plan, timed outside the saves). ``layers``: a model of many small
layers, where planning is the largest share of a save.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ranks import run_ranks
from _rss import PeakRss, rss

METHODS = ["hp_save", "dcp_hf", "gather_save_pretrained"]


def model_configs(quick: bool) -> dict[str, dict[str, Any]]:
    if quick:
        dense = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
        moe = dict(dense, num_local_experts=4, num_experts_per_tok=2)
        return {
            "dense": dict(model_type="llama", vocab_size=256, num_key_value_heads=4, **dense),
            "moe": dict(model_type="mixtral", vocab_size=256, num_key_value_heads=4, **moe),
            "layers": dict(
                model_type="llama", vocab_size=256, num_key_value_heads=4, **dict(dense, num_hidden_layers=8)
            ),
        }
    return {
        # 748M parameters: 1.50 GB bf16
        "dense": dict(
            model_type="llama",
            vocab_size=32000,
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=12,
            num_attention_heads=16,
            num_key_value_heads=16,
        ),
        # 375M parameters, 8 experts x 8 layers stacked in the model (192 released expert tensors): 0.75 GB bf16
        "moe": dict(
            model_type="mixtral",
            vocab_size=32000,
            hidden_size=1024,
            intermediate_size=1408,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=8,
            num_local_experts=8,
            num_experts_per_tok=2,
        ),
        # 64 layers of 576 tensors in all, 66M parameters: 0.13 GB bf16 (planning a larger share of the save)
        "layers": dict(
            model_type="llama",
            vocab_size=8000,
            hidden_size=256,
            intermediate_size=704,
            num_hidden_layers=64,
            num_attention_heads=4,
            num_key_value_heads=4,
        ),
    }


def _io() -> dict[str, int]:
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            key, value = line.split(":")
            out[key.strip()] = int(value)
    return out


def _peakrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _build(config: dict[str, Any]) -> Any:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(config)
    cfg_obj = AutoConfig.for_model(cfg.pop("model_type"), tie_word_embeddings=False, **cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg_obj, dtype=torch.bfloat16)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(1234 + torch.distributed.get_rank())
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local()
            local.copy_(torch.randn(local.shape, generator=g, dtype=torch.float32).to(local.dtype))
    return model


def _method(name: str, model: Any, out: Path) -> None:
    import torch
    import torch.distributed as dist

    if name == "hp_save":
        import hp_fastload as hf

        hf.save(model, out)
    elif name == "dcp_hf":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageWriter
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = get_model_state_dict(model)
        writer = HuggingFaceStorageWriter(str(out), save_distributed=True, enable_consolidation=True)
        dcp.save(state, storage_writer=writer)
    elif name == "gather_save_pretrained":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist.get_rank() == 0:
            model.save_pretrained(out, state_dict=full)
        del full
    else:
        raise ValueError(name)
    torch.distributed.barrier()


def _rank_main(rank: int, world: int, port: int, config: dict[str, Any], method: str, out: str, q: Any) -> None:
    os.environ.update(OMP_NUM_THREADS="1", LOCAL_WORLD_SIZE=str(world))
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model = _build(config)
        dist.barrier()
        io0, rss0, t0 = _io(), rss(), time.perf_counter()
        with PeakRss() as sampler:
            _method(method, model, Path(out))
        seconds = time.perf_counter() - t0
        io1 = _io()
        q.put(
            (
                rank,
                dict(
                    seconds=seconds,
                    wchar=io1["wchar"] - io0["wchar"],
                    write_bytes=io1["write_bytes"] - io0["write_bytes"],
                    peak_rss=sampler.peak,
                    rss_before=rss0,
                    lifetime_peak_rss=_peakrss(),
                ),
            )
        )
    except Exception as exc:  # reported to the parent
        q.put((rank, dict(error=f"{type(exc).__name__}: {exc}")))
    finally:
        dist.destroy_process_group()


def _region_planning(model: Any, out: Path) -> tuple[float, float]:
    """The key-level plan of ``model``'s save against the finished output ``out``, and the region planning
    after it (``PlanStream.plan``), as ``save`` plans them (seconds)."""
    from hp_fastload.api.request import plan_request
    from hp_fastload.planning import front
    from hp_fastload.planning.export import forward_rules
    from hp_fastload.source.index import CheckpointIndex

    index = CheckpointIndex.open(out)
    try:
        request = plan_request(model, weights_mapping=forward_rules(model, None), loader="dcp", strict=False)
        t0 = time.perf_counter()
        stream = front.streamed(model, index, request)
        t1 = time.perf_counter()
        stream.plan()
        return t1 - t0, time.perf_counter() - t1
    finally:
        index.release_maps()


def _ab_main(rank: int, world: int, port: int, config: dict[str, Any], rounds: int, out: str, q: Any) -> None:
    """``hf.save`` with and without the overlap, alternated (see ``--ab``)."""
    os.environ.update(OMP_NUM_THREADS="1", LOCAL_WORLD_SIZE=str(world))
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        import hp_fastload as hf
        from hp_fastload.api import save as save_mod

        model = _build(config)
        for mode in (True, False):  # one untimed save each first (imports, first-call costs)
            save_mod.STREAM_WRITES = mode
            hf.save(model, Path(out) / "warm", overwrite=True)
        runs: list[dict[str, Any]] = []
        for i in range(rounds):
            for mode in ("stream", "plan_first") if i % 2 == 0 else ("plan_first", "stream"):
                save_mod.STREAM_WRITES = mode == "stream"
                target = Path(out) / f"{mode}-{i}"
                dist.barrier()
                t0 = time.perf_counter()
                report = hf.save(model, target)
                seconds = time.perf_counter() - t0
                runs.append(dict(mode=mode, round=i, seconds=seconds, hidden=report.planning_hidden))
                dist.barrier()
                if i < rounds - 1 and rank == 0:  # the last round's two outputs compared after
                    shutil.rmtree(target)
        last = Path(out) / f"stream-{rounds - 1}"
        timed = [_region_planning(model, last) for _ in range(3)]
        key_level, regions = sorted(t[0] for t in timed)[1], sorted(t[1] for t in timed)[1]
        q.put((rank, dict(runs=runs, key_level=key_level, regions=regions)))
    except Exception as exc:  # reported to the parent
        q.put((rank, dict(error=f"{type(exc).__name__}: {exc}")))
    finally:
        dist.destroy_process_group()


def _median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def run_ab(models: list[str], rounds: int, quick: bool, work: Path) -> list[dict[str, Any]]:
    """The ``--ab`` rows: per model, each mode's median seconds (slower rank) and hidden planning (per rank)."""
    rows = []
    for model_name in models:
        out = work / f"ab-{model_name}"
        out.mkdir()
        per_rank = run_ranks(_ab_main, 2, model_configs(quick)[model_name], rounds, str(out), timeout=3600)
        row: dict[str, Any] = dict(model=model_name, ab=per_rank)
        if all("error" not in r for r in per_rank):
            for mode in ("stream", "plan_first"):
                slowest = [
                    max(r["runs"][j]["seconds"] for r in per_rank)
                    for j, run in enumerate(per_rank[0]["runs"])
                    if run["mode"] == mode
                ]
                row[mode] = _median(slowest)
                row[f"{mode}_hidden"] = [
                    _median([run["hidden"] for run in r["runs"] if run["mode"] == mode]) for r in per_rank
                ]
            slowest_of = {
                (run["mode"], run["round"]): max(r["runs"][j]["seconds"] for r in per_rank)
                for j, run in enumerate(per_rank[0]["runs"])
            }
            row["paired"] = _median(
                [slowest_of["plan_first", i] / slowest_of["stream", i] for i in range(rounds)]
            )  # each round's own ratio (both modes back to back), the median over rounds
            row["key_level"] = [r["key_level"] for r in per_rank]
            row["regions"] = [r["regions"] for r in per_rank]
            row["ok"] = _same(out / f"stream-{rounds - 1}", out / f"plan_first-{rounds - 1}")
        rows.append(row)
        print(json.dumps(row), flush=True)
        shutil.rmtree(out, ignore_errors=True)
    return rows


def run_one(
    config: dict[str, Any], method: str, out: Path, world: int = 2, timeout: float = 1200
) -> list[dict[str, Any]]:
    return run_ranks(_rank_main, world, config, method, str(out), timeout=timeout)


def _tensors(root: Path) -> dict[str, Any]:
    from safetensors import safe_open

    out = {}
    for file in sorted(root.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                out[key] = f.get_tensor(key)
    return out


def _same(a: Path, b: Path) -> bool:
    import torch

    ta, tb = _tensors(a), _tensors(b)
    return ta.keys() == tb.keys() and all(torch.equal(ta[k].view(torch.int16), tb[k].view(torch.int16)) for k in ta)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--models", nargs="*", default=["dense", "moe"])
    parser.add_argument("--methods", nargs="*", default=METHODS)
    parser.add_argument("--ab", type=int, default=0, metavar="ROUNDS", help="hp_save streamed vs plan first")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    work = Path(tempfile.mkdtemp(prefix="hp_save_bench_", dir=args.out))
    if args.ab:
        return _report_ab(run_ab(args.models, args.ab, args.quick, work), work)
    rows = []
    try:
        for model_name in args.models:
            config = model_configs(args.quick)[model_name]
            keep: dict[str, Path] = {}
            for method in args.methods:
                out = work / f"{model_name}-{method}"
                per_rank = run_one(config, method, out)
                size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) if out.exists() else 0
                row = dict(model=model_name, method=method, ranks=per_rank, output_bytes=size)
                rows.append(row)
                print(json.dumps(row), flush=True)
                if method in ("hp_save", "gather_save_pretrained") and all("error" not in r for r in per_rank):
                    keep[method] = out
                else:
                    shutil.rmtree(out, ignore_errors=True)
            if len(keep) == 2:
                same = _same(keep["hp_save"], keep["gather_save_pretrained"])
                rows.append(dict(model=model_name, check="hp_save tensors == save_pretrained tensors", ok=same))
                print(json.dumps(rows[-1]), flush=True)
            for path in keep.values():
                shutil.rmtree(path, ignore_errors=True)
    finally:
        (work / "save_bench.json").write_text(json.dumps(rows, indent=1))
        print(f"results: {work / 'save_bench.json'}")
    print()
    print(
        "| model | method | seconds (max rank) | written per rank (MB, wchar) "
        "| peak RSS during save, per rank (GB) | RSS growth (GB) |"
    )
    print("|---|---|---:|---|---|---|")
    for row in rows:
        if "method" not in row:
            continue
        ranks = row["ranks"]
        if any("error" in r for r in ranks):
            print(f"| {row['model']} | {row['method']} | error: {ranks} | | | |")
            continue
        print(
            f"| {row['model']} | {row['method']} | {max(r['seconds'] for r in ranks):.2f} | "
            + " / ".join(f"{r['wchar'] / 1e6:.0f}" for r in ranks)
            + " | "
            + " / ".join(f"{r['peak_rss'] / 1e9:.2f}" for r in ranks)
            + " | "
            + " / ".join(f"{(r['peak_rss'] - r['rss_before']) / 1e9:.2f}" for r in ranks)
            + " |"
        )
    failed = [r for r in rows if any("error" in x for x in r.get("ranks", ())) or r.get("ok") is False]
    return 1 if failed else 0


def _report_ab(rows: list[dict[str, Any]], work: Path) -> int:
    (work / "save_bench.json").write_text(json.dumps(rows, indent=1))
    print(f"results: {work / 'save_bench.json'}")
    print()
    print(
        "| model | plan first (s) | streamed (s) | plan first / streamed (median of rounds' ratios) "
        "| planning hidden per rank (ms) "
        "| key-level plan / region planning per rank (ms) |"
    )
    print("|---|---:|---:|---:|---|---|")
    for row in rows:
        if "stream" not in row:
            print(f"| {row['model']} | error: {row['ab']} | | | | |")
            continue
        print(
            f"| {row['model']} | {row['plan_first']:.3f} | {row['stream']:.3f} | "
            f"{row['plan_first'] / row['stream']:.3f}x ({row['paired']:.3f}x) | "
            + " / ".join(f"{h * 1e3:.1f}" for h in row["stream_hidden"])
            + " | "
            + " / ".join(
                f"{k * 1e3:.1f} + {r * 1e3:.1f}" for k, r in zip(row["key_level"], row["regions"], strict=True)
            )
            + " |"
        )
    return 0 if all(row.get("ok") for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
