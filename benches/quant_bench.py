"""FP8 checkpoints into bf16 models: hp_fastload against transformers and torch DCP, in one run (issue 13).

    python benches/quant_bench.py            # DeepSeek-shaped FP8 checkpoint of ~1.1 GB (64 experts x 10 layers)
    python benches/quant_bench.py --quick    # tiny, seconds (tests/benches/test_bench_scripts.py)

The checkpoint has DeepSeek-V3's layout (per-expert tensors, e4m3 weights with fp32 ``weight_scale_inv`` over
128x128 blocks, ``kv_a_proj_with_mqa`` of 576 rows: a ragged last block) and the ``quantization_config`` the real
one ships. A bf16 checkpoint of the same model gives the bf16 -> bf16 anchor (same output bytes). Every
measurement runs in a fresh worker process on a warm page cache (every file read once first), ``--repeats``
times (median):

- ``hp_load``: ``hp_fastload.load`` into the bf16 model (world 1), or the plan + execution of expert-parallel
  rank 3 of 8 (stacked experts ``Shard(0)`` over torch's fake process group);
- ``hp_load_bf16``: the same loads from the bf16 checkpoint;
- ``hp_dcp_reader`` / ``torch_dcp_reader``: ``dcp.load`` of a checkpoint-keyed bf16 state dict (the rank's own
  experts only, for the EP rank) through hp_fastload's and torch's ``QuantizedHuggingFaceStorageReader``;
- ``transformers``: ``from_pretrained(quantization_config=FineGrainedFP8Config(dequantize=True))`` (world 1;
  the whole load, model construction included).

After timing, a sample of tensors (the ragged ``kv_a_proj_with_mqa``, an attention weight, the rank's first and
last expert, a bf16 tensor) is compared with DeepSeek's ``weight_dequant`` formula written with torch ops.
Outputs ``<out>/quant_bench.json`` and ``<out>/quant_bench.md``; the summary prints the ratios of issue 13's
targets (hp vs the faster peer; FP8 -> bf16 vs bf16 -> bf16).
"""

from __future__ import annotations

import argparse
import json
import math
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
import compare  # noqa: E402

EP_WORLD, EP_RANK = 8, 3


def config(quick: bool, kv_lora_rank: int | None = None) -> dict[str, Any]:
    """DeepSeek-V3's shape, scaled down; ``kv_lora_rank`` overrides the 512 (576-row kv_a_proj_with_mqa)."""
    return dict(
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        hidden_size=256 if quick else 1024,
        intermediate_size=512 if quick else 2048,
        moe_intermediate_size=128 if quick else 512,
        num_attention_heads=2 if quick else 8,
        num_key_value_heads=2 if quick else 8,
        q_lora_rank=128 if quick else 384,
        kv_lora_rank=kv_lora_rank or (64 if quick else 512),
        qk_rope_head_dim=64,
        qk_nope_head_dim=64 if quick else 128,
        v_head_dim=64 if quick else 128,
        vocab_size=1024 if quick else 4096,
        n_routed_experts=16 if quick else 64,
        n_shared_experts=1,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        num_hidden_layers=3 if quick else 11,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        quantization_config={
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        },
    )


def keys(c: dict[str, Any]) -> list[tuple[str, tuple[int, ...], str]]:
    """DeepSeek-V3's FP8 checkpoint layout: every linear an F8_E4M3 weight plus its F32 scale grid."""
    return compare.deepseek_keys(c, weight_dtype="F8_E4M3")


def write(path: Path, c: dict[str, Any], quantized: bool, shards: int = 4, seed: int = 0) -> Path:
    """The FP8 checkpoint (``quantized``) or its bf16 twin (same keys minus the scales, bf16 weights)."""
    import torch
    from safetensors.torch import save_file

    stamp = json.dumps({"c": c, "q": quantized, "shards": shards, "seed": seed}, sort_keys=True)
    marker = path / ".complete"
    if marker.is_file() and marker.read_text() == stamp:
        return path
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    entries = [(k, s, d) for k, s, d in keys(c) if quantized or not k.endswith("_scale_inv")]
    if not quantized:
        entries = [(k, s, "BF16" if d == "F8_E4M3" else d) for k, s, d in entries]
    size = {"BF16": 2, "F32": 4, "F8_E4M3": 1}
    groups = _peers.shard_groups([math.prod(s) * size[d] for _, s, d in entries], shards)
    weight_map: dict[str, str] = {}
    for g, idx in enumerate(groups):
        name = f"model-{g + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for i in idx:
            key, shape, dt = entries[i]
            if dt == "F8_E4M3":
                bits = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
                bits[(bits & 0x7F) == 0x7F] = 0  # no NaN codes
                tensors[key] = bits.view(torch.float8_e4m3fn)
            elif dt == "BF16":
                bits = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=gen) & ~0x4000
                tensors[key] = bits.view(torch.bfloat16)
            else:
                tensors[key] = torch.rand(shape, generator=gen) * 1e-2 + 1e-4
            weight_map[key] = name
        save_file(tensors, str(path / name), metadata={"format": "pt"})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg = dict(c)
    if not quantized:
        cfg.pop("quantization_config")
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    marker.write_text(stamp)
    return path


# ---------------------------------------------------------------------------------------------------------
# Workers (one measurement each, in a fresh process)


def _model(ckpt: str, mesh: Any) -> Any:
    """The bf16 model on CPU; with ``mesh``, its stacked experts are ``Shard(0)`` DTensors over it."""
    import torch
    from torch.distributed.tensor import DTensor, Shard
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(ckpt)
    cfg.quantization_config = None
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    if mesh is not None:
        world = mesh.size()
        for module in model.modules():
            for pname, p in list(module.named_parameters(recurse=False)):
                if p.dim() == 3 and pname in ("gate_up_proj", "down_proj"):
                    n = p.shape[0] // world
                    local = torch.empty((n, *p.shape[1:]), dtype=p.dtype)
                    dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride())
                    setattr(module, pname, torch.nn.Parameter(dt, requires_grad=False))
    return model


def _expert_of(key: str) -> int | None:
    parts = key.split(".")
    if "experts" in parts:
        return int(parts[parts.index("experts") + 1])
    return None


def _state_dict(ckpt: str, world: int, rank: int) -> dict[str, Any]:
    """Checkpoint-keyed bf16 tensors (no scales); an EP rank keeps only its own experts' keys."""
    import torch

    per = None
    out = {}
    index = json.loads((Path(ckpt) / "model.safetensors.index.json").read_text())["weight_map"]
    shapes = {k: s for k, s, _ in keys(json.loads((Path(ckpt) / "config.json").read_text()))}
    experts = json.loads((Path(ckpt) / "config.json").read_text())["n_routed_experts"]
    per = experts // world
    for key in index:
        if key.endswith("_scale_inv"):
            continue
        x = _expert_of(key)
        if x is not None and not rank * per <= x < (rank + 1) * per:
            continue
        out[key] = torch.empty(shapes[key], dtype=torch.bfloat16)
    return out


def _formula(ckpt: str, key: str) -> Any:
    """DeepSeek's ``weight_dequant`` of checkpoint ``key`` with torch ops (fp32, rounded once to bf16); the
    plain tensor for unquantized keys."""
    import torch
    from safetensors import safe_open

    index = json.loads((Path(ckpt) / "model.safetensors.index.json").read_text())["weight_map"]

    def get(k: str) -> Any:
        with safe_open(str(Path(ckpt) / index[k]), framework="pt") as f:
            return f.get_tensor(k)

    t = get(key)
    if key + "_scale_inv" not in index:
        return t.to(torch.bfloat16)
    s = get(key + "_scale_inv").repeat_interleave(128, 0)[: t.shape[0]].repeat_interleave(128, 1)[:, : t.shape[1]]
    return (t.float() * s).to(torch.bfloat16)


def _verify(ckpt: str, loaded: Any, world: int) -> dict[str, int]:
    """Compares a sample of loaded tensors with the formula: ``loaded(key)`` gives the loaded tensor of a
    checkpoint key (None when this rank does not hold it)."""
    import torch

    c = json.loads((Path(ckpt) / "config.json").read_text())
    per = c["n_routed_experts"] // world
    rank = EP_RANK if world > 1 else 0
    last = c["num_hidden_layers"] - 1
    sample = [
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
        f"model.layers.{last}.self_attn.o_proj.weight",
        f"model.layers.{last}.mlp.experts.{rank * per}.gate_proj.weight",
        f"model.layers.{last}.mlp.experts.{rank * per + per - 1}.down_proj.weight",
        "model.embed_tokens.weight",
    ]
    checked = mismatched = 0
    for key in sample:
        got = loaded(key)
        if got is None:
            continue
        checked += 1
        mismatched += not torch.equal(got, _formula(ckpt, key))
    return {"checked": checked, "mismatched": mismatched}


def _from_model(model: Any, world: int) -> Any:
    """Checkpoint key -> the loaded model tensor (stacked experts sliced back)."""
    c = model.config
    per = c.n_routed_experts // world
    first = EP_RANK * per if world > 1 else 0

    def get(key: str) -> Any:
        x = _expert_of(key)
        if x is None:
            p = model.get_parameter(key)
            return p.to_local() if hasattr(p, "to_local") else p
        prefix = key.split(".experts.")[0] + ".experts"
        experts = model.get_submodule(prefix)
        i, mi = x - first, c.moe_intermediate_size
        if key.endswith("down_proj.weight"):
            stacked = experts.down_proj
            return (stacked.to_local() if hasattr(stacked, "to_local") else stacked)[i]
        stacked = experts.gate_up_proj
        local = stacked.to_local() if hasattr(stacked, "to_local") else stacked
        return local[i, :mi] if key.endswith("gate_proj.weight") else local[i, mi:]

    return get


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    import warnings

    import torch

    warnings.simplefilter("ignore")
    ckpt, loader, world = spec["ckpt"], spec["loader"], spec["world"]
    files = _peers.checkpoint_files(ckpt)
    mesh = _peers.fake_world(world, EP_RANK) if world > 1 else None
    times = []
    out_bytes = 0
    verify: dict[str, int] | None = None
    for _ in range(spec["repeats"]):
        _peers.warm(files)
        if loader in ("hp_load", "hp_load_bf16"):
            model = _model(ckpt, mesh)
            out_bytes = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 2 for p in model.parameters())
            t0 = time.perf_counter()
            if mesh is None:
                import hp_fastload as hf

                hf.load(model, ckpt)
            else:  # one rank of a fake world: plan + execute, without the cross-rank agreement collectives
                from hp_fastload.api.request import plan_request
                from hp_fastload.execute.read import execute_plan
                from hp_fastload.planning.front import plan
                from hp_fastload.source.index import CheckpointIndex

                planned, context = plan(model, CheckpointIndex.open(Path(ckpt)), plan_request(model, loader="dcp"))
                execute_plan(planned, context)
            times.append(time.perf_counter() - t0)
            verify = _verify(ckpt, _from_model(model, world), world) if loader == "hp_load" else None
            del model
        elif loader in ("hp_dcp_reader", "torch_dcp_reader"):
            import torch.distributed.checkpoint as dcp

            if loader == "hp_dcp_reader":
                from hp_fastload.api.dcp import QuantizedHuggingFaceStorageReader as Reader
            else:
                from torch.distributed.checkpoint.quantized_hf_storage import (
                    QuantizedHuggingFaceStorageReader as Reader,
                )
            state = _state_dict(ckpt, world, EP_RANK if world > 1 else 0)
            out_bytes = sum(t.numel() * 2 for t in state.values())
            t0 = time.perf_counter()
            dcp.load(state, storage_reader=Reader(ckpt, target_dtype=torch.bfloat16), no_dist=True)
            times.append(time.perf_counter() - t0)
            verify = _verify(ckpt, state.get, world)
            del state
        elif loader == "transformers":
            from transformers import AutoModelForCausalLM, FineGrainedFP8Config

            t0 = time.perf_counter()
            model = AutoModelForCausalLM.from_pretrained(
                ckpt, dtype=torch.bfloat16, quantization_config=FineGrainedFP8Config(dequantize=True)
            )
            times.append(time.perf_counter() - t0)
            out_bytes = sum(p.numel() * 2 for p in model.parameters())
            verify = _verify(ckpt, _from_model(model, 1), 1)
            del model
        else:
            raise ValueError(loader)
    return {"seconds": statistics.median(times), "times": times, "output_bytes": out_bytes, "verify": verify}


# ---------------------------------------------------------------------------------------------------------
# The run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench-out"))
    ap.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "hp_fastload_quant_bench"))
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    repeats = args.repeats or (1 if args.quick else 3)
    c = config(args.quick)
    data = Path(args.data) / ("quick" if args.quick else "full")
    fp8 = write(data / "fp8", c, quantized=True)
    bf16 = write(data / "bf16", c, quantized=False)
    # transformers refuses the 576-row kv_a_proj_with_mqa (it derives the block from the 5-row scale grid): it
    # is timed, with hp_fastload, on a twin whose kv_a_proj has 512 rows (every dim a multiple of 128)
    mult = write(data / "fp8_mult", config(args.quick, 448 if not args.quick else None), quantized=True)
    runs = [
        ("hp_load", mult, 1),
        ("transformers", mult, 1),
        ("hp_load", fp8, 1),
        ("hp_load_bf16", bf16, 1),
        ("hp_dcp_reader", fp8, 1),
        ("torch_dcp_reader", fp8, 1),
        ("transformers", fp8, 1),
        ("hp_load", fp8, EP_WORLD),
        ("hp_load_bf16", bf16, EP_WORLD),
        ("hp_dcp_reader", fp8, EP_WORLD),
        ("torch_dcp_reader", fp8, EP_WORLD),
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    results = []
    for loader, ckpt, world in runs:
        spec = {"ckpt": str(ckpt), "loader": loader, "world": world, "repeats": repeats, "checkpoint": ckpt.name}
        proc = subprocess.run(
            [sys.executable, __file__, "--worker", json.dumps(spec)], env=env, capture_output=True, text=True
        )
        if proc.returncode != 0:
            results.append({**spec, "error": proc.stderr[-2000:]})
            print(f"{loader} world {world}: FAILED\n{proc.stderr[-2000:]}", file=sys.stderr)
            continue
        r = {**spec, **json.loads(proc.stdout.strip().splitlines()[-1])}
        r["gbps"] = r["output_bytes"] / r["seconds"] / 1e9
        results.append(r)
        print(f"{loader:18s} {ckpt.name:9s} world {world}: {r['seconds']:.3f} s, {r['gbps']:.2f} GB/s", flush=True)
    table = _table(results, fp8)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from hp_fastload.support import describe, info

    facts = info()  # the versions, the CPU and the kernels' SIMD level (HP_FASTLOAD_SIMD) these rows ran with
    (out / "quant_bench.json").write_text(json.dumps({"config": c, "results": results, "info": facts}, indent=1))
    table += "\n" + "\n".join(f"    {line}" for line in describe(facts).splitlines()[:3]) + "\n"
    (out / "quant_bench.md").write_text(table)
    print(table)
    return 0 if all("error" not in r for r in results) else 1


def _table(results: list[dict[str, Any]], fp8: Path) -> str:
    size = sum(os.path.getsize(p) for p in _peers.checkpoint_files(str(fp8)))
    lines = [
        f"FP8 checkpoint: {size / 1e9:.2f} GB; warm page cache; median seconds; GB/s of bf16 output bytes. "
        "fp8_mult: the same with kv_a_proj_with_mqa of 512 rows (transformers refuses 576 over a 5-row grid)",
        "",
        "| loader | checkpoint | layout | seconds | GB/s | time / hp_load's | checked (mismatched) |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    by = {(r["loader"], r["checkpoint"], r["world"]): r for r in results if "error" not in r}
    for r in results:
        layout = "world 1" if r["world"] == 1 else f"EP rank {EP_RANK} of {r['world']}"
        head = f"| {r['loader']} | {r['checkpoint']} | {layout} |"
        if "error" in r:
            why = r["error"].strip().splitlines()[-1][:120] if r["error"].strip() else "failed"
            lines.append(f"{head} failed | | | {why} |")
            continue
        ck = "fp8" if r["checkpoint"] == "bf16" else r["checkpoint"]
        hp = by.get(("hp_load", ck, r["world"]))
        speed = f"{r['seconds'] / hp['seconds']:.1f}x" if hp else ""
        v = r.get("verify")
        check = f"{v['checked']} ({v['mismatched']})" if v else "-"
        lines.append(f"{head} {r['seconds']:.3f} | {r['gbps']:.2f} | {speed} | {check} |")
    lines.append("")
    for world in (1, EP_WORLD):
        hp, bf = by.get(("hp_load", "fp8", world)), by.get(("hp_load_bf16", "bf16", world))
        peer = by.get(("torch_dcp_reader", "fp8", world))
        if world == 1 and ("hp_load", "fp8_mult", 1) in by and ("transformers", "fp8_mult", 1) in by:
            ratio = by[("transformers", "fp8_mult", 1)]["seconds"] / by[("hp_load", "fp8_mult", 1)]["seconds"]
            lines.append(f"world 1: hp_load vs transformers (fp8_mult): {ratio:.1f}x (target >= 3x)")
        if hp and peer:
            ratio = peer["seconds"] / hp["seconds"]
            lines.append(f"world {world}: hp_load vs torch's quantized reader: {ratio:.1f}x (target >= 3x)")
        if hp and bf:
            lines.append(
                f"world {world}: FP8->bf16 at {bf['seconds'] / hp['seconds']:.2f}x the speed of bf16->bf16 "
                "(target >= 0.7x)"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
