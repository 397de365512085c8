"""torchtitan's own HF load against hp_fastload, on one checkpoint and the same parallel layouts.

Three ways to fill a torchtitan 0.3.0 model parallelized by torchtitan's own function, on 2 gloo ranks:

* ``torchtitan``: ``CheckpointManager.dcp_load(from_hf=True)`` with torch's ``HuggingFaceStorageReader``;
* ``drop-in``: the same, with ``hp_fastload.dcp.HuggingFaceStorageReader`` (only the read step changes);
* ``adapter``: ``hp_fastload.load(model, path, state_dict_adapter=adapter)``.

Each is timed (median of ``--repeat`` runs, the slowest rank of each run; wall and process CPU seconds) on a
fresh model per run; the shards are checked bit-equal to torchtitan's own. Usage::

    python benches/torchtitan_bench.py --scale 8 --layers 4 --repeat 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from tests.helpers import titan
from tests.helpers.dist import run_distributed

LAYOUTS = [("llama3", "fsdp"), ("llama3", "tp"), ("llama3", "fsdp_ac"), ("qwen3_moe", "fsdp"), ("deepseek_v3", "fsdp")]


def _dropin_adapter(adapter: Any) -> Any:
    from hp_fastload.dcp import HuggingFaceStorageReader

    adapter.get_hf_storage_reader = lambda path, from_quantized=False: HuggingFaceStorageReader(path)
    return adapter


def _one(way: str, name: str, layout: str, world: int, path: Path, kw: dict[str, Any]) -> tuple[float, Any]:
    import torch.distributed as dist

    import hp_fastload as hf

    model, cfg = titan.parallel_model(name, layout, world, **kw)
    adapter = titan.adapter(name, cfg)
    dist.barrier()
    start = time.perf_counter()
    cpu = time.process_time()
    if way == "torchtitan":
        titan.torchtitan_load(model, adapter, path)
    elif way == "drop-in":
        titan.torchtitan_load(model, _dropin_adapter(adapter), path)
    else:
        hf.load(model, path, state_dict_adapter=adapter)
    seconds = time.perf_counter() - start
    return seconds, time.process_time() - cpu, titan.local_state(model)


def _body(rank: int, world: int, name: str, layout: str, path: str, repeat: int, kw: dict[str, Any]) -> Any:
    import torch.distributed as dist

    times: dict[str, list[float]] = {"torchtitan": [], "drop-in": [], "adapter": []}
    cpus: dict[str, list[float]] = {way: [] for way in times}
    reference = None
    equal = {}
    for _ in range(repeat):
        for way in times:
            seconds, cpu, state = _one(way, name, layout, world, Path(path), kw)
            slowest = torch.tensor([seconds, cpu])
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            times[way].append(float(slowest[0]))
            cpus[way].append(float(slowest[1]))
            if reference is None:
                reference = state
            equal[way] = all(torch.equal(reference[k], state[k]) for k in reference)
    median = {way: statistics.median(ts) for way, ts in times.items()}
    return median, {way: statistics.median(cs) for way, cs in cpus.items()}, equal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=8, help="width multiplier of the tiny configs")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--only", default="", help="comma-separated model:layout pairs")
    args = parser.parse_args()
    kw = {"scale": args.scale, "layers": args.layers}
    chosen = [tuple(p.split(":")) for p in args.only.split(",")] if args.only else LAYOUTS
    print(
        f"torchtitan 0.3.0, {args.world} gloo ranks, scale {args.scale}, {args.layers} layers, median of {args.repeat}"
    )
    print(
        "| model | layout | checkpoint MB | torchtitan ms | drop-in ms | adapter ms | adapter speed-up "
        "| torchtitan CPU ms | adapter CPU ms | CPU ratio | bit-equal |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, layout in chosen:
            path = Path(tmp) / name
            if not path.exists():
                titan.write_checkpoint(name, path, **kw)
            mb = (path / "model.safetensors").stat().st_size / 1e6
            results = run_distributed(_body, args.world, name, layout, str(path), args.repeat, kw, timeout=1200)
            times, cpus, _ = results[0]
            ok = all(all(e.values()) for _, _, e in results)
            print(
                f"| {name} | {layout} | {mb:.1f} | {times['torchtitan'] * 1e3:.0f} | {times['drop-in'] * 1e3:.0f} | "
                f"{times['adapter'] * 1e3:.0f} | {times['torchtitan'] / times['adapter']:.2f}x | "
                f"{cpus['torchtitan'] * 1e3:.0f} | {cpus['adapter'] * 1e3:.0f} | "
                f"{cpus['torchtitan'] / cpus['adapter']:.2f}x | {ok} |"
            )


if __name__ == "__main__":
    main()
