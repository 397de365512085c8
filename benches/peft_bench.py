"""A LoRA fine-tune's prologue on 2 gloo ranks: base + adapter loaded into FSDP2 shards, hp_fastload against the
peft + accelerate route a user takes today, same run.

    python benches/peft_bench.py                 # a ~424 MB fp32 Llama (106M parameters) + a rank-16 LoRA, 3 repeats
    python benches/peft_bench.py --quick         # a tiny Llama, 1 repeat (tests/benches/test_bench_scripts.py)

Each (method, repeat) runs in a fresh 2-rank spawn; between barriers:

- ``peft_accelerate``: on every rank ``AutoModelForCausalLM.from_pretrained(base)``,
  ``PeftModel.from_pretrained(model, adapter, is_trainable=True)``, ``AdamW`` over the adapter, then
  ``accelerator.prepare(model, optimizer)`` with ``FullyShardedDataParallelPlugin(fsdp_version=2)`` (the whole
  model on every rank, then ``fully_shard``);
- ``hp_fastload``: ``hp_fastload.from_pretrained(base, parallelize=fsdp2, adapter=adapter, is_trainable=True)``
  (the PEFT model on meta, ``fully_shard`` on every decoder layer and the root, ``to_empty``, each rank reads
  its shards of the base and of the adapter), then ``AdamW`` over the adapter.

Per rank: wall seconds and RSS growth (peak sampled every 5 ms, minus the RSS before the call). The local shards
of every parameter must be bit-equal between the methods (exit 1 otherwise). Both methods read a warm page
cache. Results: a table on stdout and ``<out>/peft_bench.json``.
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

METHODS = ["peft_accelerate", "hp_fastload"]
LORA: dict[str, Any] = dict(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])


def _rank_main(rank: int, world: int, port: int, base: str, adapter: str, method: str, q: Any) -> None:
    try:
        import torch
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=600)
        )
        torch.set_num_threads(1)
        from peft import PeftModel
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import AutoConfig, AutoModelForCausalLM

        import hp_fastload as hf

        accelerator = fsdp2_accelerator(rank, world) if method == "peft_accelerate" else None
        mesh = init_device_mesh("cpu", (world,))

        def parallelize(model: Any) -> None:
            for layer in model.get_base_model().model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)

        # Warm-up outside the timing, the same for both methods: transformers' lazy model modules, peft, FSDP2.
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base))
        from accelerate.utils import fsdp_utils  # noqa: F401

        dist.barrier()
        rss0, t0 = rss(), time.perf_counter()
        with PeakRss() as peak:
            if method == "peft_accelerate":
                assert accelerator is not None
                model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
                model = PeftModel.from_pretrained(model, adapter, is_trainable=True)
                optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
                model, _ = accelerator.prepare(model, optimizer)
            else:
                model = hf.from_pretrained(
                    base, parallelize=parallelize, adapter=adapter, is_trainable=True, dtype=torch.float32
                )
                torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
            dist.barrier()
        seconds = time.perf_counter() - t0
        q.put((rank, {"seconds": seconds, "rss_growth": peak.peak - rss0, "digest": shard_digest(model)}))
        dist.destroy_process_group()
    except BaseException as exc:
        import traceback

        q.put((rank, {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}))


def run_one(base: str, adapter: str, method: str, world: int = 2) -> list[dict[str, Any]]:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return run_ranks(_rank_main, world, base, adapter, method)


def write_checkpoints(out: Path, quick: bool) -> tuple[Path, Path]:
    """The base (transformers' save_pretrained) and a trained-looking adapter (peft's save_pretrained)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    base, adapter = out / "llama", out / "llama_lora"
    torch.manual_seed(0)
    config = LlamaConfig(tie_word_embeddings=False, **model_config(quick))
    AutoModelForCausalLM.from_config(config).save_pretrained(base)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), LoraConfig(**LORA))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.02)
    model.save_pretrained(adapter)
    for f in [*base.glob("*.safetensors"), *adapter.glob("*.safetensors")]:
        f.read_bytes()  # warm the page cache: both methods read warm
    return base, adapter


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 3)
    out = args.out or Path(tempfile.mkdtemp(prefix="hp_peft_bench_"))
    out.mkdir(parents=True, exist_ok=True)
    base, adapter = write_checkpoints(out, args.quick)
    sizes = {p.name: sum(f.stat().st_size for f in p.glob("*.safetensors")) for p in (base, adapter)}

    rows, errors, medians, same = run_alternated(
        METHODS, repeats, lambda method: run_one(str(base), str(adapter), method)
    )
    summary: dict[str, Any] = {"checkpoint_bytes": sizes, "methods": medians}
    summary["local_shards_equal"] = same
    (out / "peft_bench.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    base_mb, adapter_mb = sizes[base.name] / 1e6, sizes[adapter.name] / 1e6
    print(f"base {base_mb:.0f} MB fp32 + LoRA adapter {adapter_mb:.1f} MB, 2 gloo ranks, FSDP2, {repeats} repeats")
    print(f"{'method':<16} {'seconds':>8} {'RSS growth / rank':>18}")
    for method, s in summary["methods"].items():
        print(f"{method:<16} {s['seconds_median']:>8.2f} {s['rss_growth_median_per_rank'] / 1e6:>15.0f} MB")
    print(f"local shards bit-equal between the methods: {same}")
    if errors:
        print(json.dumps(errors, indent=1)[:4000], file=sys.stderr)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
