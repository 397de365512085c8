"""Export benchmark: ``hp_fastload.save`` against its peers on 2 gloo ranks, same run, same models.

    python benches/save_bench.py                 # dense ~1.5 GB bf16 Llama + ~0.75 GB Mixtral, FSDP2 (~5 min)
    python benches/save_bench.py --quick         # tiny models (tests/benches/test_bench_scripts.py); exit 1 on error

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
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    work = Path(tempfile.mkdtemp(prefix="hp_save_bench_", dir=args.out))
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


if __name__ == "__main__":
    raise SystemExit(main())
