"""accelerate's own load against hp_fastload's, on 2 gloo ranks with accelerate's real FSDP2 code, same run.

    python benches/accelerate_bench.py               # a ~420 MB fp32 Llama (106M parameters), 3 repeats
    python benches/accelerate_bench.py --quick       # a tiny Llama, 1 repeat (tests/benches/test_bench_scripts.py)

Each (method, repeat) runs in a fresh 2-rank spawn. Every rank creates an ``Accelerator`` with
``FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")`` and sets its state
to ``DistributedType.FSDP`` (on CPU accelerate would otherwise fall back to DDP), then, between barriers:

- ``accelerate``: ``AutoModelForCausalLM.from_pretrained(path)`` on every rank, ``AdamW``,
  ``accelerator.prepare(model, optimizer)`` (the whole model on every rank, then ``fully_shard``);
- ``hp_fastload``: ``hp_fastload.integrations.prepare_pretrained(accelerator, path, optimizer=AdamW)`` (meta
  model, ``prepare``, each rank reads its shards).

Per rank: wall seconds and RSS growth (peak sampled every 5 ms minus the RSS before the call). The local shards'
digests must agree between the methods (exit 1 otherwise). The page cache is warmed once before the runs (both
methods read warm). Results: a table on stdout and ``<out>/accelerate_bench.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ranks import fsdp2_accelerator, model_config, run_alternated, run_ranks, shard_digest
from _rss import PeakRss, rss

METHODS = ["accelerate", "hp_fastload"]


def _rank_main(rank: int, world: int, port: int, path: str, method: str, q: Any) -> None:
    try:
        import torch
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=600)
        )
        torch.set_num_threads(1)
        from transformers import AutoModelForCausalLM

        import hp_fastload.integrations

        accelerator = fsdp2_accelerator(rank, world)
        # Warm-up outside the timing, the same for both methods: transformers' lazy model modules and FSDP2.
        from accelerate.utils import fsdp_utils  # noqa: F401
        from torch.distributed.fsdp import fully_shard  # noqa: F401
        from transformers import AutoConfig

        with torch.device("meta"):
            AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        dist.barrier()
        rss0, t0 = rss(), time.perf_counter()
        with PeakRss() as peak:
            if method == "accelerate":
                model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
                model, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
            else:
                model, _ = hp_fastload.integrations.prepare_pretrained(
                    accelerator, path, optimizer=torch.optim.AdamW, dtype=torch.float32
                )
            dist.barrier()
        seconds = time.perf_counter() - t0
        q.put((rank, {"seconds": seconds, "rss_growth": peak.peak - rss0, "digest": shard_digest(model)}))
        dist.destroy_process_group()
    except BaseException as exc:
        import traceback

        q.put((rank, {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}))


def run_one(path: str, method: str, world: int = 2) -> list[dict[str, Any]]:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return run_ranks(_rank_main, world, path, method)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 3)
    out = args.out or Path(tempfile.mkdtemp(prefix="hp_accelerate_bench_"))
    out.mkdir(parents=True, exist_ok=True)

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = out / "llama"
    config = LlamaConfig(tie_word_embeddings=False, **model_config(args.quick))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    for f in path.glob("*.safetensors"):
        f.read_bytes()  # warm the page cache: both methods read warm

    rows, errors, medians, same = run_alternated(METHODS, repeats, lambda method: run_one(str(path), method))
    summary: dict[str, Any] = {"checkpoint_bytes": size, "methods": medians}
    summary["local_shards_equal"] = same
    (out / "accelerate_bench.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    print(f"checkpoint: {size / 1e6:.0f} MB fp32, 2 gloo ranks, FSDP2 via accelerate, {repeats} repeats (median)")
    print(f"{'method':<12} {'seconds':>8} {'RSS growth / rank':>18}")
    for method, s in summary["methods"].items():
        print(f"{method:<12} {s['seconds_median']:>8.2f} {s['rss_growth_median_per_rank'] / 1e6:>15.0f} MB")
    print(f"local shards bit-equal between the methods: {same}")
    if errors:
        print(json.dumps(errors, indent=1)[:4000], file=sys.stderr)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
