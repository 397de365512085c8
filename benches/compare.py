"""hp_fastload against every peer that runs here, in one run: one table, one JSON, one plot, PASS/FAIL targets.

    python benches/compare.py                 # full run (~20 min on 2 cores): 2.6 GB dense + 20k-tensor MoE
    python benches/compare.py --quick         # tiny sizes, seconds; used by tests/benches/test_bench_scripts.py and CI
    python benches/compare.py --warm --baseline benches/baseline.json   # regression guard (exit 1 on a fall)
    python benches/compare.py --from A.json B.json --write-baseline benches/baseline.json   # new baseline

Every configuration (loader x workload x placement x regime) runs in a fresh worker process (``--quick`` groups
them into two workers to stay fast), ``--repeats`` times, and the median is reported. After timing, every
destination byte is compared with safetensors' own slice of the file. Per result: wall time, GB/s of the
*needed* bytes, bytes the process made storage read (``/proc/self/io`` read_bytes), CPU time, peak RSS and
the anonymous memory added during the load. Physical anchors (memcpy with 1 and 2 threads, sequential and
parallel cold reads) are measured in the same run, and the targets of issue 5 are evaluated as ratios.

Regression guard (``--baseline FILE``; not for CI, whose timing is noise): every hp_fastload result becomes ratios
measured in the same run (against the fastest peer of its row, and warm rows against the memcpy anchor); each is
compared with FILE's value for it, and one that fell by more than its noise (the baseline's measured run-to-run
deviation, at least ``GUARD_NOISE_FLOOR``, or this run's own repetition spread if larger) is printed and makes the
exit status 1. The baseline (``benches/baseline.json``) is written with ``--write-baseline`` from one or more runs
and committed deliberately, with the change that moves the speed.

Cold: ``posix_fadvise(DONTNEED)`` on every file, then mincore must report 0 resident pages (``drop_caches``
is refused on this box). Warm: every page resident (checked with mincore) before timing.

Outputs: ``<out>/compare.json``, ``<out>/compare.md``, ``<out>/compare.png``; a full (non-quick) run also copies
the plot to ``docs/benchmarks.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
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

ALL_LOADERS = [
    "hp_dcp",
    "hp_legacy",
    "hp_read_many",
    "hp_dcp_reader",
    "st_slice",
    "st_loadfile",
    "torch_dcp_t1",
    "torch_dcp_t2",
    "fastsafetensors",
    "runai",
    "transformers",
]
LOADER_LABELS = {
    "hp_dcp": "hp_fastload dcp",
    "hp_legacy": "hp_fastload legacy",
    "hp_read_many": "hp read_many",
    "hp_dcp_reader": "hp DCP reader",
    "st_slice": "safetensors get_slice",
    "st_loadfile": "safetensors load_file",
    "torch_dcp_t1": "torch DCP HF t=1",
    "torch_dcp_t2": "torch DCP HF t=2",
    "fastsafetensors": "fastsafetensors",
    "runai": "runai streamer",
    "transformers": "transformers TP",
}
HP = ("hp_dcp", "hp_legacy", "hp_read_many", "hp_dcp_reader")
SAFETENSORS = ("st_slice", "st_loadfile")
WORKLOADS = ("dense", "moe", "e2e", "plan")

# ---------------------------------------------------------------------------------------------------------
# Checkpoints


def dense_config(size_gb: float, quick: bool) -> dict[str, Any]:
    if quick:
        h, inter, heads, kv, hd, vocab, layers = 768, 2048, 12, 4, 64, 4096, 4
    else:
        h, inter, heads, kv, hd, vocab = 4096, 11008, 32, 8, 128, 32000
        per_layer = 2 * (2 * h * heads * hd + 2 * h * kv * hd + 3 * h * inter + 2 * h)
        layers = max(1, round((size_gb * 1e9 - 4 * vocab * h) / per_layer))
    return dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=h,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=hd,
        num_hidden_layers=layers,
        vocab_size=vocab,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )


def dense_keys(c: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    hd = c["head_dim"]
    return _peers.llama_keys(
        c["hidden_size"],
        c["num_attention_heads"] * hd,
        c["num_key_value_heads"] * hd,
        c["intermediate_size"],
        c["vocab_size"],
        c["num_hidden_layers"],
    )


def moe_config(quick: bool, experts: int | None, layers: int | None) -> dict[str, Any]:
    e = experts or (32 if quick else 576)
    n = layers or (2 if quick else 12)
    return dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_hidden_layers=n,
        num_experts=e,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        vocab_size=1024,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )


def moe_keys(c: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    h, hd, inter, e = c["hidden_size"], c["head_dim"], c["moe_intermediate_size"], c["num_experts"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    keys: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (c["vocab_size"], h))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        keys += [
            (f"{p}.input_layernorm.weight", (h,)),
            *_peers.attention_keys(p, h, q, kv),
            (f"{p}.self_attn.q_norm.weight", (hd,)),
            (f"{p}.self_attn.k_norm.weight", (hd,)),
            (f"{p}.post_attention_layernorm.weight", (h,)),
            (f"{p}.mlp.gate.weight", (e, h)),
        ]
        for x in range(e):
            keys += [
                (f"{p}.mlp.experts.{x}.gate_proj.weight", (inter, h)),
                (f"{p}.mlp.experts.{x}.up_proj.weight", (inter, h)),
                (f"{p}.mlp.experts.{x}.down_proj.weight", (h, inter)),
            ]
    keys += [("model.norm.weight", (h,)), ("lm_head.weight", (c["vocab_size"], h))]
    return keys


def deepseek_config(quick: bool) -> dict[str, Any]:
    return dict(
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=16,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        vocab_size=512,
        n_routed_experts=16 if quick else 256,
        n_shared_experts=1,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1 if quick else 3,
        num_hidden_layers=3 if quick else 61,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )


def deepseek_keys(c: dict[str, Any], weight_dtype: str = "BF16") -> list[tuple[str, tuple[int, ...], str]]:
    """DeepSeek-V3's checkpoint layout (per-expert tensors, an F32 ``weight_scale_inv`` over 128x128 blocks per
    linear, whose weight is ``weight_dtype``: "F8_E4M3" as released, "BF16" for the planning benchmark)."""
    h, e, mi, inter = c["hidden_size"], c["n_routed_experts"], c["moe_intermediate_size"], c["intermediate_size"]
    heads, ql, kvl = c["num_attention_heads"], c["q_lora_rank"], c["kv_lora_rank"]
    nope, rope, vd = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    keys: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (c["vocab_size"], h), "BF16")]

    def linear(name: str, out: int, inp: int) -> None:
        keys.append((name + ".weight", (out, inp), weight_dtype))
        keys.append((name + ".weight_scale_inv", (-(-out // 128), -(-inp // 128)), "F32"))

    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        keys += [(f"{p}.input_layernorm.weight", (h,), "BF16"), (f"{p}.post_attention_layernorm.weight", (h,), "BF16")]
        linear(f"{p}.self_attn.q_a_proj", ql, h)
        keys.append((f"{p}.self_attn.q_a_layernorm.weight", (ql,), "BF16"))
        linear(f"{p}.self_attn.q_b_proj", heads * (nope + rope), ql)
        linear(f"{p}.self_attn.kv_a_proj_with_mqa", kvl + rope, h)
        keys.append((f"{p}.self_attn.kv_a_layernorm.weight", (kvl,), "BF16"))
        linear(f"{p}.self_attn.kv_b_proj", heads * (nope + vd), kvl)
        linear(f"{p}.self_attn.o_proj", h, heads * vd)
        if i < c["first_k_dense_replace"]:
            linear(f"{p}.mlp.gate_proj", inter, h)
            linear(f"{p}.mlp.up_proj", inter, h)
            linear(f"{p}.mlp.down_proj", h, inter)
            continue
        keys.append((f"{p}.mlp.gate.weight", (e, h), "BF16"))
        keys.append((f"{p}.mlp.gate.e_score_correction_bias", (e,), "F32"))
        for x in range(e):
            linear(f"{p}.mlp.experts.{x}.gate_proj", mi, h)
            linear(f"{p}.mlp.experts.{x}.up_proj", mi, h)
            linear(f"{p}.mlp.experts.{x}.down_proj", h, mi)
        si = mi * c["n_shared_experts"]
        linear(f"{p}.mlp.shared_experts.gate_proj", si, h)
        linear(f"{p}.mlp.shared_experts.up_proj", si, h)
        linear(f"{p}.mlp.shared_experts.down_proj", h, si)
    keys += [("model.norm.weight", (h,), "BF16"), ("lm_head.weight", (c["vocab_size"], h), "BF16")]
    return keys


def write_checkpoint(
    path: Path, config: dict[str, Any], keys: list[tuple[str, tuple[int, ...], str]], shards: int, seed: int
) -> Path:
    """Random bf16 (no NaN/inf: exponent's top bit cleared) tensors, sharded with an HF index; cached."""
    stamp = json.dumps({"config": config, "shards": shards, "seed": seed, "n": len(keys)}, sort_keys=True)
    marker = path / ".complete"
    if marker.is_file() and marker.read_text() == stamp:
        return path
    import torch
    from safetensors.torch import save_file

    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    dtypes = {"BF16": torch.bfloat16, "F32": torch.float32}
    sizes = [math.prod(s) * dtypes[d].itemsize for _, s, d in keys]
    groups = _peers.shard_groups(sizes, shards)
    weight_map: dict[str, str] = {}
    for g, idx in enumerate(groups):
        name = f"model-{g + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for i in idx:
            key, shape, dt = keys[i]
            if dt == "BF16":
                bits = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=gen) & ~0x4000
                tensors[key] = bits.view(torch.bfloat16)
            else:
                tensors[key] = torch.rand(shape, generator=gen, dtype=torch.float32)
            weight_map[key] = name
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        del tensors
        fd = os.open(path / name, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    (path / "config.json").write_text(json.dumps(config, indent=1))
    marker.write_text(stamp)
    return path


# ---------------------------------------------------------------------------------------------------------
# The matrix of configurations


def matrix(args: argparse.Namespace, paths: dict[str, Path]) -> list[dict[str, Any]]:
    q = args.quick
    regimes = args.regimes
    rank8 = dict(world=8, rank=3)
    one = dict(world=1, rank=0)
    cfgs: list[dict[str, Any]] = []

    def add(kind: str, workload: str, scenario: str, loaders: list[str], regime: str, **kw: Any) -> None:
        if regime not in regimes:
            return
        data = kw.pop("data", workload)
        for loader in loaders:
            if loader not in args.loaders and kind != "plan":
                continue
            cfgs.append(
                dict(
                    kind=kind,
                    workload=workload,
                    ckpt=str(paths[data]),
                    scenario=scenario,
                    loader=loader,
                    regime=regime,
                    repeats=args.repeats,
                    env=_peers.loader_env(loader, regime),
                    **kw,
                )
            )

    raw_all = ["st_slice", "st_loadfile", "torch_dcp_t1", "torch_dcp_t2", "fastsafetensors", "runai", *list(HP)]
    sliced = ["st_slice", "st_loadfile", "torch_dcp_t1", "torch_dcp_t2", "runai", "hp_read_many", "hp_dcp", "hp_legacy"]
    if q and "dense" in args.workloads:  # every peer once, then the targets' rows with the two main loaders
        add("raw", "dense", "full", raw_all, "warm", **one)
        add("raw", "dense", "full", ["st_slice", "runai", "hp_dcp"], "cold", **one)
        for sc in ("s0", "s1"):
            add("raw", "dense", sc, ["st_slice", "hp_dcp"], "warm", **rank8)
        add("raw", "dense", "s1", ["st_slice", "hp_dcp"], "cold", **rank8)
    elif "dense" in args.workloads:
        add("raw", "dense", "full", raw_all, "warm", **one)
        add("raw", "dense", "full", [x for x in raw_all if x not in ("hp_dcp_reader", "hp_legacy")], "cold", **one)
        add("raw", "dense", "s0", sliced, "warm", **rank8)
        add("raw", "dense", "s1", sliced, "warm", **rank8)
        add("raw", "dense", "tp", ["st_slice", "torch_dcp_t2", "hp_read_many", "hp_dcp"], "warm", **rank8)
        add(
            "raw",
            "dense",
            "s1",
            ["st_slice", "st_loadfile", "torch_dcp_t2", "runai", "hp_read_many", "hp_dcp"],
            "cold",
            **rank8,
        )
        # the cold Shard(1) target's own setting (perf_anchors protocol A): rank 0 of 2, half of every row
        add("raw", "dense", "s1", ["st_slice", "torch_dcp_t2", "hp_read_many", "hp_dcp"], "cold", world=2, rank=0)
    if q and "moe" in args.workloads:
        add("raw", "moe", "full", ["st_slice", "hp_dcp"], "warm", **one)
    elif "moe" in args.workloads:
        moe_full = ["st_slice", "st_loadfile", "torch_dcp_t1", "torch_dcp_t2", "fastsafetensors", "runai"]
        add("raw", "moe", "full", [*moe_full, "hp_read_many", "hp_dcp", "hp_legacy"], "warm", **one)
        add("raw", "moe", "ep", ["st_slice", "torch_dcp_t2", "runai", "hp_read_many", "hp_dcp"], "warm", **rank8)
    if "e2e" in args.workloads:
        dense_e2e = ["hp_dcp", "hp_legacy", "torch_dcp_t1", "torch_dcp_t2", "st_slice", "transformers"]
        if q:
            dense_e2e = ["hp_dcp", "st_slice"]
        add("e2e", "e2e-dense", "tp", dense_e2e, "warm", world=2, rank=-1, data="dense", timeout=args.timeout)
        if not q:
            add(
                "e2e",
                "e2e-moe",
                "ep",
                ["hp_dcp", "transformers"],
                "warm",
                world=2,
                rank=-1,
                data="moe",
                timeout=args.timeout,
            )
    if "plan" in args.workloads:
        add("plan", "plan", "ep", ["hp_plan"], "warm", world=8, rank=3)
    return cfgs


# ---------------------------------------------------------------------------------------------------------
# Workers


def run_workers(groups: list[list[dict[str, Any]]], timeout: float, log: Any) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("OMP_NUM_THREADS", str(_peers.CORES))
    env["TRANSFORMERS_VERBOSITY"] = "error"
    env["HF_HUB_OFFLINE"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    with tempfile.TemporaryDirectory(prefix="hp_compare_") as tmp:
        for n, group in enumerate(groups):
            cfg_path, res_path = Path(tmp, f"cfg{n}.json"), Path(tmp, f"res{n}.json")
            cfg_path.write_text(json.dumps(group))
            label = ", ".join(f"{c['workload']}/{c['scenario']}/{c['regime']}/{c['loader']}" for c in group[:3])
            more = f" (+{len(group) - 3})" if len(group) > 3 else ""
            print(f"[{n + 1}/{len(groups)}] {label}{more}", file=log, flush=True)
            start = time.perf_counter()
            err = None
            try:
                proc = subprocess.run(
                    [sys.executable, str(Path(__file__).resolve()), "--worker", str(cfg_path), str(res_path)],
                    env=dict(env, **group[0].get("env", {})) if len(group) == 1 else env,
                    timeout=timeout * len(group),
                    capture_output=True,
                    text=True,
                )
                if proc.returncode != 0:
                    err = f"worker exited {proc.returncode}: {proc.stderr[-1500:]}"
            except subprocess.TimeoutExpired:
                err = f"timeout after {timeout * len(group):.0f} s"
            got = json.loads(res_path.read_text()) if res_path.is_file() else []
            for c in group[len(got) :]:
                got.append(
                    dict(
                        {
                            k: c[k]
                            for k in ("kind", "workload", "scenario", "loader", "regime", "world", "rank", "round")
                            if k in c
                        },
                        error=err or "no result",
                    )
                )
            for r in got:
                r["process_seconds"] = (time.perf_counter() - start) / len(group)
                status = (
                    r.get("error") or f"{r.get('gbps', float('nan')):.2f} GB/s"
                    if r.get("kind") != "anchors"
                    else "anchors"
                )
                if r.get("kind") == "plan" and not r.get("error"):
                    status = f"{r['seconds']:.3f} s for {r['tensors']} tensors"
                print(f"    {r.get('loader', '')}: {str(status)[:300]}", file=log, flush=True)
            results += got
    return results


def merge_rounds(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One result per configuration from its single-repetition rounds (median over the rounds' repetitions)."""
    ident = ("kind", "workload", "scenario", "loader", "regime", "world", "rank")
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    out: list[dict[str, Any]] = []
    for r in results:
        if "round" not in r:
            out.append(r)
            continue
        key = tuple(r.get(k) for k in ident)
        first = merged.get(key)
        if first is None:
            merged[key] = r
            out.append(r)
            continue
        if first.get("error") or r.get("error"):
            first["error"] = first.get("error") or r.get("error")
            continue
        first["repeats"] += r["repeats"]
        first["verify"] = max(first["verify"], r["verify"], key=lambda v: v.get("mismatched", 0))
        first["peak_rss_bytes"] = max(first["peak_rss_bytes"], r["peak_rss_bytes"])
        first["process_seconds"] += r["process_seconds"]
        first.update(_peers.summarize(first["repeats"]))
    for r in out:
        r.pop("round", None)
    return out


# ---------------------------------------------------------------------------------------------------------
# Report: tables, targets, plot


def _row_key(r: dict[str, Any]) -> str:
    world = r.get("world")
    where = (
        "world 1" if world == 1 else f"rank {r.get('rank')} of {world}" if r.get("kind") == "raw" else f"{world} ranks"
    )
    return f"{r['workload']} · {r['scenario']} · {where} · {r['regime']}"


def _ok(r: dict[str, Any] | None) -> bool:
    return bool(r) and not r.get("error") and r.get("verify", {}).get("mismatched", 1) == 0  # type: ignore[union-attr]


def find(results: list[dict[str, Any]], **kw: Any) -> dict[str, Any] | None:
    for r in results:
        if all(r.get(k) == v for k, v in kw.items()):
            return r
    return None


def tables(results: list[dict[str, Any]], anchors: dict[str, Any]) -> str:
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    for r in results:
        if r.get("kind") in ("raw", "e2e"):
            rows.setdefault(_row_key(r), {})[r["loader"]] = r
    loaders = [x for x in ALL_LOADERS if any(x in v for v in rows.values())]
    lines = [
        "| workload · placement · ranks · regime | needed | " + " | ".join(LOADER_LABELS[x] for x in loaders) + " |"
    ]
    lines.append("|---|---:|" + "---:|" * len(loaders))
    for key, by in rows.items():
        needed = next(iter(by.values())).get("needed_bytes") or 0
        cells = []
        best = max((v.get("gbps", 0) for v in by.values() if _ok(v)), default=0)
        for x in loaders:
            v = by.get(x)
            if v is None:
                cells.append("")
            elif v.get("error"):
                cells.append("error")
            elif not _ok(v):
                cells.append(f"{v['gbps']:.2f} ✗wrong")
            else:
                s = f"{v['gbps']:.2f}"
                cells.append(f"**{s}**" if v["gbps"] == best else s)
        lines.append(f"| {key} | {needed / 1e9:.2f} GB | " + " | ".join(cells) + " |")
    out = [
        "GB/s of the needed bytes (median of repeats; best per row in bold; ✗wrong = bytes differ from the file).",
        "",
    ]
    out += lines
    out += ["", "Physical anchors (same run): " + anchor_line(anchors), ""]
    det = [
        "| workload · placement · ranks · regime | loader | s (median) | GB/s | storage read / needed | CPU s "
        "| peak RSS | +anon MiB | verified |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        if r.get("kind") not in ("raw", "e2e"):
            continue
        if r.get("error"):
            det.append(f"| {_row_key(r)} | {r['loader']} | — | — | — | — | — | — | error: {str(r['error'])[:120]} |")
            continue
        needed = r.get("needed_bytes") or 1
        v = r.get("verify", {})
        det.append(
            f"| {_row_key(r)} | {r['loader']} | {r['seconds']:.3f} | {r['gbps']:.2f} | "
            f"{r['storage_read_bytes'] / needed:.2f} | {r['cpu_seconds']:.2f} | "
            f"{r.get('peak_rss_bytes', 0) / 2**30:.2f} GiB | {r.get('anon_added_bytes', 0) / 2**20:.0f} | "
            f"{v.get('checked', 0) - v.get('mismatched', 0)}/{v.get('checked', 0)} |"
        )
    out += ["Per result:", "", *det]
    return "\n".join(out)


def anchor_line(a: dict[str, Any]) -> str:
    if not a or a.get("error"):
        return f"unavailable ({a.get('error') if a else 'not run'})"
    return (
        f"memcpy 1 thread {a['memcpy_1t_gbps']:.2f} GB/s, 2 threads {a['memcpy_2t_gbps']:.2f} GB/s; cold read "
        f"sequential {a['cold_seq_gbps']:.2f} GB/s, parallel ({a['cores']} threads) {a['cold_par_gbps']:.2f} GB/s "
        f"(0 resident pages verified before each: {a['cold_verified']}); read_ahead_kb {a['read_ahead_kb']}"
        + "".join(
            f"; rank 3 of 8 {sc} boxes copied from anonymous memory (torch copy_, 1 thread) {a[k]:.2f} GB/s"
            for sc in ("s0", "s1")
            if (k := f"box_copy_{sc}_gbps") in a
        )
        + (
            f"; page cache in 2 MiB folios after warming the dense checkpoint: {a['file_huge_pages_mib']} MiB"
            if a.get("file_huge_pages_mib") is not None
            else ""
        )
    )


def evaluate_targets(results: list[dict[str, Any]], a: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 5's targets as measured ratios. status: PASS, FAIL or N/A (a needed measurement is missing)."""
    out: list[dict[str, Any]] = []

    def add(name: str, checks: list[tuple[str, float | None, float, str]]) -> None:
        # checks: (label, measured ratio, threshold, comparison ">=" or "<=")
        parts, status = [], "PASS"
        for label, value, thr, op in checks:
            if value is None or (isinstance(value, float) and math.isnan(value)):
                parts.append(f"{label}: n/a")
                status = "N/A" if status != "FAIL" else status
                continue
            good = value >= thr if op == ">=" else value <= thr
            unit = "" if label in ("seconds", "added MiB") else "x"
            parts.append(f"{label} {value:.2f}{unit} ({op} {thr:g}{unit})")
            if not good:
                status = "FAIL"
        out.append({"target": name, "status": status, "detail": "; ".join(parts)})

    def gbps(**kw: Any) -> float | None:
        r = find(results, **kw)
        return r["gbps"] if _ok(r) else None  # type: ignore[index]

    def best(loaders: tuple[str, ...] | list[str], **kw: Any) -> float | None:
        vals = [g for x in loaders if (g := gbps(loader=x, **kw)) is not None]
        return max(vals) if vals else None

    def ratio(x: float | None, y: float | None) -> float | None:
        return x / y if x is not None and y else None

    m1 = a.get("memcpy_1t_gbps")
    m2 = a.get("memcpy_2t_gbps")
    peers = [x for x in ALL_LOADERS if x not in HP and x != "transformers"]
    for sc, mem_thr in (("s0", 1.0), ("s1", 0.8)):
        hp = gbps(workload="dense", scenario=sc, regime="warm", loader="hp_dcp")
        st = best(SAFETENSORS, workload="dense", scenario=sc, regime="warm")
        label = "rows" if sc == "s0" else "columns"
        add(
            f"warm, rank 3 of 8, Shard({sc[1]}) {label}: ≥ {mem_thr}x memcpy(1t), ≥ 1.2x safetensors",
            [("vs memcpy 1t", ratio(hp, m1), mem_thr, ">="), ("vs safetensors", ratio(hp, st), 1.2, ">=")],
        )
    hp = gbps(workload="moe", scenario="full", regime="warm", loader="hp_dcp")
    st = best(SAFETENSORS, workload="moe", scenario="full", regime="warm")
    add(
        "warm, many small tensors (MoE, every expert tensor): ≥ 0.5x memcpy(1t), ≥ 5x safetensors",
        [("vs memcpy 1t", ratio(hp, m1), 0.5, ">="), ("vs safetensors", ratio(hp, st), 5.0, ">=")],
    )
    hp = gbps(workload="dense", scenario="full", regime="cold", loader="hp_dcp")
    peer = best(peers, workload="dense", scenario="full", regime="cold")
    add("cold, full load: ≥ 1.0x the fastest peer", [("vs fastest peer", ratio(hp, peer), 1.0, ">=")])
    for world, rank in ((2, 0), (8, 3)):
        r = find(results, workload="dense", scenario="s1", regime="cold", loader="hp_dcp", world=world)
        if r is None:
            continue
        amp = r["storage_read_bytes"] / r["needed_bytes"] if _ok(r) else None
        hp = gbps(workload="dense", scenario="s1", regime="cold", loader="hp_dcp", world=world)
        st = gbps(workload="dense", scenario="s1", regime="cold", loader="st_slice", world=world)
        add(
            f"cold, rank {rank} of {world} Shard(1): storage reads ≤ 1.3x needed, ≥ 1.5x safetensors",
            [("storage/needed", amp, 1.3, "<="), ("vs safetensors get_slice", ratio(hp, st), 1.5, ">=")],
        )
    hp = gbps(workload="e2e-dense", loader="hp_dcp")
    peer = best([x for x in ALL_LOADERS if x not in HP], workload="e2e-dense")
    add(
        "end to end, 2 gloo ranks, TP DTensors, warm: ≥ 1.1x best peer, ≥ 0.5x memcpy(2t)",
        [("vs best peer", ratio(hp, peer), 1.1, ">="), ("vs memcpy 2t", ratio(hp, m2), 0.5, ">=")],
    )
    hp = gbps(workload="e2e-moe", loader="hp_dcp")
    tr = gbps(workload="e2e-moe", loader="transformers")
    add("end to end MoE, experts stacked: ≥ 1.5x transformers", [("vs transformers", ratio(hp, tr), 1.5, ">=")])
    p = find(results, kind="plan")
    if p and not p.get("error"):
        add(
            f"planning: DeepSeek-V3-layout header ({p['tensors']:,} tensors), rank 3 of 8: ≤ 1 s",
            [("seconds", p["seconds"], 1.0, "<=")],
        )
    else:
        add("planning: DeepSeek-sized header ≤ 1 s", [("seconds", None, 1.0, "<=")])
    mem = [
        r["anon_added_bytes"] / 2**20
        for r in results
        if r.get("kind") == "raw"
        and r.get("loader") in ("hp_dcp", "hp_read_many")
        and _ok(r)
        and r.get("workload") == "dense"
    ]
    add(
        "memory: region path adds ≤ 64 MiB anonymous memory (CPU targets: no staging; max over dense runs, MiB)",
        [("added MiB", max(mem) if mem else None, 64.0, "<=")],
    )
    return out


def plot(results: list[dict[str, Any]], path: Path) -> str:
    rows: dict[str, dict[str, float]] = {}
    for r in results:
        if r.get("kind") in ("raw", "e2e") and _ok(r):
            rows.setdefault(_row_key(r), {})[r["loader"]] = r["gbps"]
    if not rows:
        return "no data"
    loaders = [x for x in ALL_LOADERS if any(x in v for v in rows.values())]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return _plot_svg(rows, loaders, path.with_suffix(".svg"))
    n = len(rows)
    fig, ax = plt.subplots(figsize=(12, 0.55 * n * max(1, len(loaders)) / 3 + 2))
    height = 0.8 / len(loaders)
    cmap = plt.get_cmap("tab20")
    for j, x in enumerate(loaders):
        ys = [i + j * height for i in range(n)]
        vals = [rows[k].get(x, 0.0) for k in rows]
        ax.barh(ys, vals, height=height, label=LOADER_LABELS[x], color=cmap(j), edgecolor="black" if x in HP else None)
    ax.set_yticks([i + 0.4 - height / 2 for i in range(n)])
    ax.set_yticklabels(list(rows), fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("GB/s of the needed bytes (higher is better)")
    ax.set_title("hp_fastload vs peers, same run (2 cores, CPU)")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def _plot_svg(rows: dict[str, dict[str, float]], loaders: list[str], path: Path) -> str:
    colors = [
        "#1f77b4",
        "#ff7f0e",
        "#2ca02c",
        "#d62728",
        "#9467bd",
        "#8c564b",
        "#e377c2",
        "#7f7f7f",
        "#bcbd22",
        "#17becf",
        "#000",
    ]
    top = max((v for r in rows.values() for v in r.values()), default=1.0) or 1.0
    bar, left, width = 8, 330, 600
    y = 20
    parts = []
    for key, by in rows.items():
        parts.append(f'<text x="4" y="{y + 10}" font-size="10">{key}</text>')
        for j, x in enumerate(loaders):
            v = by.get(x)
            if v is None:
                continue
            w = v / top * width
            parts.append(
                f'<rect x="{left}" y="{y}" width="{w:.1f}" height="{bar - 1}" fill="{colors[j % len(colors)]}"/>'
            )
            parts.append(f'<text x="{left + w + 3:.1f}" y="{y + bar - 1}" font-size="7">{v:.2f}</text>')
            y += bar
        y += 8
    legend = "".join(
        f'<rect x="{left + 140 * (j % 4)}" y="{y + 14 * (j // 4)}" width="10" height="10" '
        f'fill="{colors[j % len(colors)]}"/><text x="{left + 14 + 140 * (j % 4)}" y="{y + 9 + 14 * (j // 4)}" '
        f'font-size="10">{LOADER_LABELS[x]}</text>'
        for j, x in enumerate(loaders)
    )
    h = y + 20 + 14 * (len(loaders) // 4 + 1)
    head = f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 60}" height="{h}">'
    path.write_text(head + "".join(parts) + legend + "</svg>")
    return str(path)


# ---------------------------------------------------------------------------------------------------------
# Regression guard: this run's ratios against a stored baseline (benches/baseline.json)

#: Smallest tolerance a guard ratio gets: a ratio must fall by more than this fraction to count as a fall.
#: Measured: the same tree run twice on this shared 2-core box moved single ratios by up to ~12%
#: (docs/perf-notes.md, "Session 9: the regression guard").
GUARD_NOISE_FLOOR = 0.15


def _spread(r: dict[str, Any]) -> float:
    """Relative spread (max - min) / median of one result's repetitions' GB/s (0 with one repetition)."""
    vals = [x["gbps"] for x in r.get("repeats") or [] if isinstance(x, dict) and x.get("gbps")]
    if len(vals) < 2:
        return 0.0
    vals.sort()
    mid = vals[len(vals) // 2]
    return (vals[-1] - vals[0]) / mid if mid else 0.0


def guard_ratios(results: list[dict[str, Any]], anchors: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every hp_fastload result as ratios measured in the same run: against the fastest peer of its row
    ("vs best peer") and, for warm rows, against the memcpy anchor ("vs memcpy": 1 thread for one-process rows,
    2 threads for the 2-rank rows). A result that failed or read wrong bytes has ratio 0 (a fall).
    ``spread`` is the sum of the two operands' relative spreads over their repetitions in this run."""
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    for r in results:
        if r.get("kind") in ("raw", "e2e"):
            rows.setdefault(_row_key(r), {})[r["loader"]] = r
    out: dict[str, dict[str, Any]] = {}
    for key, by in rows.items():
        peers = [v for x, v in by.items() if x not in HP and _ok(v)]
        best_peer = max(peers, key=lambda v: v["gbps"], default=None)
        for loader in (x for x in HP if x in by):
            hp = by[loader]
            ok = _ok(hp)
            if best_peer is not None:
                out[f"{key} | {loader} vs best peer"] = dict(
                    value=hp["gbps"] / best_peer["gbps"] if ok else 0.0,
                    spread=_spread(hp) + _spread(best_peer),
                    peer=best_peer["loader"],
                )
            e2e = hp.get("kind") == "e2e"
            mem = anchors.get("memcpy_2t_gbps" if e2e else "memcpy_1t_gbps")
            if hp.get("regime") == "warm" and mem:
                out[f"{key} | {loader} vs memcpy {'2t' if e2e else '1t'}"] = dict(
                    value=hp["gbps"] / mem if ok else 0.0, spread=_spread(hp), peer="memcpy"
                )
    return out


def write_baseline(
    runs: list[dict[str, dict[str, Any]]], path: Path, source: list[str], recorded: list[dict[str, Any]]
) -> dict[str, Any]:
    """A baseline from one or more runs' guard ratios: per ratio the median over the runs and its noise, the
    largest relative deviation of a run from that median (at least :data:`GUARD_NOISE_FLOOR`)."""
    import statistics

    ratios: dict[str, dict[str, Any]] = {}
    for name in sorted(set().union(*runs)):
        vals = [r[name]["value"] for r in runs if name in r]
        mid = float(statistics.median(vals))
        dev = max((abs(v - mid) / mid for v in vals), default=0.0) if mid else 0.0
        ratios[name] = dict(value=round(mid, 4), noise=round(max(GUARD_NOISE_FLOOR, dev), 4), runs=len(vals))
    doc = dict(
        schema=1,
        about="hp_fastload's ratios against peers measured in the same run; benches/compare.py --baseline "
        "checks a run against it. Update deliberately, with the commit that changes the speed.",
        source=source,
        recorded=recorded,
        ratios=ratios,
    )
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def check_baseline(current: dict[str, dict[str, Any]], baseline: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(falls, notes). A ratio falls when it is below the baseline's value by more than its tolerance: the
    larger of the baseline's measured noise and this run's own spread of the two operands. Ratios the
    baseline has but this run did not measure are notes, not falls (a subset run)."""
    falls, notes = [], []
    for name, base in baseline["ratios"].items():
        cur = current.get(name)
        if cur is None:
            notes.append(f"not measured in this run: {name}")
            continue
        tol = max(base["noise"], cur["spread"])
        floor = base["value"] * (1 - tol)
        line = (
            f"{name}: {cur['value']:.2f}x (baseline {base['value']:.2f}x, tolerance {tol:.0%}, "
            f"{cur['value'] / base['value'] - 1:+.0%})"
            if base["value"]
            else f"{name}: {cur['value']:.2f}x (baseline 0)"
        )
        (falls if cur["value"] < floor else notes).append(line)
    return falls, notes


def _recorded(doc: dict[str, Any]) -> dict[str, Any]:
    """What a baseline keeps about a run: the tree, the machine's load and its memcpy speed."""
    meta, a = doc.get("meta", {}), doc.get("anchors", {})
    return dict(
        git=meta.get("git"),
        loadavg=meta.get("machine", {}).get("loadavg"),
        memcpy_1t_gbps=a.get("memcpy_1t_gbps"),
        memcpy_2t_gbps=a.get("memcpy_2t_gbps"),
    )


def run_guard(
    args: argparse.Namespace, runs: list[dict[str, dict[str, Any]]], source: list[str], recorded: list[dict[str, Any]]
) -> int:
    """--write-baseline / --baseline after a run (or on --from files). Returns the exit status."""
    status = 0
    if args.write_baseline:
        doc = write_baseline(runs, Path(args.write_baseline), source, recorded)
        print(f"\nwrote {len(doc['ratios'])} ratios to {args.write_baseline}")
    if args.baseline:
        import statistics

        if not Path(args.baseline).is_file():
            print(f"no baseline at {args.baseline}: write one with --write-baseline (quiet box, deliberately)")
            return 2
        baseline = json.loads(Path(args.baseline).read_text())
        names = set().union(*runs)
        current = {
            n: dict(
                value=float(statistics.median([r[n]["value"] for r in runs if n in r])),
                spread=max(r[n]["spread"] for r in runs if n in r),
            )
            for n in names
        }
        falls, notes = check_baseline(current, baseline)
        print(f"\nregression guard against {args.baseline}: {len(falls)} of {len(baseline['ratios'])} ratios fell")
        for line in falls:
            print(f"FELL  {line}")
        for line in notes:
            print(f"ok    {line}" if not line.startswith("not measured") else f"--    {line}")
        status = 1 if falls else 0
    return status


# ---------------------------------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny checkpoints, 1 repeat, grouped workers (CI, smoke test)")
    ap.add_argument("--size-gb", type=float, default=2.6, help="dense checkpoint size (default 2.6)")
    ap.add_argument("--moe-experts", type=int, default=None, help="experts per MoE layer (default 576; quick 32)")
    ap.add_argument("--moe-layers", type=int, default=None, help="MoE layers (default 12 -> 20,736 expert tensors)")
    ap.add_argument("--repeats", type=int, default=None, help="repetitions per configuration (default 3; quick 1)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {','.join(WORKLOADS)}")
    ap.add_argument("--loaders", default=",".join(ALL_LOADERS), help="comma list (default: all)")
    ap.add_argument("--cold", action="store_true", help="cold regime only (with --warm: both, the default)")
    ap.add_argument("--warm", action="store_true", help="warm regime only (with --cold: both, the default)")
    ap.add_argument("--out", default=str(ROOT / "bench-out"), help="output folder (default bench-out/)")
    ap.add_argument("--data", default=None, help="checkpoint cache folder (default <out>/data)")
    ap.add_argument(
        "--docs",
        default=None,
        help="also copy the plot here (default: docs/ for a full run: every workload, loader and regime; "
        "none for --quick or a subset)",
    )
    ap.add_argument("--timeout", type=float, default=None, help="seconds per configuration (default 600; quick 120)")
    ap.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="no measuring: rebuild the report from earlier compare.json files (later ones add configurations)",
    )
    ap.add_argument(
        "--baseline",
        metavar="FILE",
        help="regression guard: compare this run's ratios against peers with FILE (e.g. benches/baseline.json); "
        "prints every ratio that fell by more than its noise and exits 1 if any did",
    )
    ap.add_argument(
        "--write-baseline",
        metavar="FILE",
        help="write this run's ratios (with --from: the median and the noise over those runs) as a baseline",
    )
    ap.add_argument(
        "--from",
        dest="from_runs",
        nargs="+",
        metavar="JSON",
        help="no measuring: take the runs for --baseline / --write-baseline from earlier compare.json files",
    )
    ap.add_argument("--worker", nargs=2, metavar=("CONFIG", "RESULT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.timeout = args.timeout or (120.0 if args.quick else 600.0)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    args.loaders = [x.strip() for x in args.loaders.split(",") if x.strip()]
    bad = [w for w in args.workloads if w not in WORKLOADS] + [x for x in args.loaders if x not in ALL_LOADERS]
    if bad:
        ap.error(f"unknown workloads/loaders: {bad}")
    args.regimes = (
        ("cold",) if args.cold and not args.warm else ("warm",) if args.warm and not args.cold else ("warm", "cold")
    )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        _peers.worker_main(*args.worker)
        return 0
    if args.merge:
        return merge(args)
    if args.from_runs:
        docs = [json.loads(Path(p).read_text()) for p in args.from_runs]
        runs = [guard_ratios(d["results"], d["anchors"]) for d in docs]
        return run_guard(args, runs, list(args.from_runs), [_recorded(d) for d in docs])
    started = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = Path(args.data) if args.data else out / "data"
    log = sys.stderr
    print(f"writing checkpoints under {data} ...", file=log, flush=True)
    dc = dense_config(args.size_gb, args.quick)
    mc = moe_config(args.quick, args.moe_experts, args.moe_layers)
    sc = deepseek_config(args.quick)
    paths: dict[str, Path] = {}
    need_dense = {"dense", "e2e"} & set(args.workloads) or True  # anchors read the dense files
    if need_dense:
        paths["dense"] = write_checkpoint(
            data / ("dense-quick" if args.quick else f"dense-{args.size_gb:g}gb"),
            dc,
            [(k, s, "BF16") for k, s in dense_keys(dc)],
            2 if args.quick else 4,
            seed=1,
        )
    if {"moe", "e2e"} & set(args.workloads):
        paths["moe"] = write_checkpoint(
            data / f"moe-{mc['num_hidden_layers']}x{mc['num_experts']}",
            mc,
            [(k, s, "BF16") for k, s in moe_keys(mc)],
            2 if args.quick else 3,
            seed=2,
        )
    if "plan" in args.workloads:
        paths["plan"] = write_checkpoint(
            data / f"deepseek-header-{sc['num_hidden_layers']}x{sc['n_routed_experts']}",
            sc,
            deepseek_keys(sc),
            1 if args.quick else 4,
            seed=3,
        )
    gen_s = time.perf_counter() - started
    anchors_cfg = dict(
        kind="anchors",
        workload="anchors",
        scenario="-",
        loader="anchors",
        regime="-",
        ckpt=str(paths["dense"]),
        memcpy_bytes=(64 << 20) if args.quick else (1 << 30),
        repeats=1 if args.quick else 3,
    )
    cfgs = matrix(args, paths)
    if args.quick:
        e2e = [c for c in cfgs if c["kind"] == "e2e"]
        rest = [c for c in cfgs if c["kind"] != "e2e"]
        groups = [[anchors_cfg, *rest]] + ([e2e] if e2e else [])
    else:
        # Cold rows: one timed repetition per worker, in rounds over every cold configuration, so a drift of the
        # shared disk's throughput spreads over all loaders instead of landing on whichever ran in a bad minute.
        cold = [c for c in cfgs if c["kind"] == "raw" and c["regime"] == "cold"]
        rounds = [[dict(c, repeats=1, warmup=1, round=r)] for r in range(args.repeats) for c in cold]
        groups = [[anchors_cfg]] + [[c] for c in cfgs if c not in cold] + rounds
    results = merge_rounds(run_workers(groups, args.timeout, log))
    anchors = next((r for r in results if r.get("kind") == "anchors"), {})
    results = [r for r in results if r.get("kind") != "anchors"]
    targets = evaluate_targets(results, anchors)
    table = tables(results, anchors)
    png = plot(results, out / "compare.png")
    meta = dict(
        command=" ".join(
            [Path(sys.executable).name, "benches/compare.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        quick=args.quick,
        repeats=args.repeats,
        machine=dict(
            cores=_peers.CORES,
            mem_total_gib=os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30,
            kernel=platform.release(),
            python=platform.python_version(),
            read_ahead_kb=_peers.read_ahead_kb(),
            loadavg=os.getloadavg(),
        ),
        versions=_versions(),
        info=_info(),
        git=_git(),
        checkpoints={
            k: dict(
                path=str(v),
                bytes=sum(p.stat().st_size for p in v.glob("*.safetensors")),
                files=len(list(v.glob("*.safetensors"))),
            )
            for k, v in paths.items()
        },
        generate_seconds=gen_s,
        total_seconds=time.perf_counter() - started,
    )
    doc = dict(schema=1, meta=meta, anchors=anchors, results=results, targets=targets, plot=png)
    (out / "compare.json").write_text(json.dumps(doc, indent=1, default=str))
    target_lines = "\n".join(f"- **{t['status']}** {t['target']} — {t['detail']}" for t in targets)
    md = f"{table}\n\nTargets (issue 5):\n\n{target_lines}\n"
    (out / "compare.md").write_text(md)
    docs = Path(args.docs) if args.docs else (ROOT / "docs" if _full_run(args) else None)
    if docs and Path(png).is_file():
        docs.mkdir(parents=True, exist_ok=True)
        shutil.copy(png, docs / ("benchmarks" + Path(png).suffix))
    print(md)
    for t in targets:
        print(f"{t['status']:4s}  {t['target']}  [{t['detail']}]")
    print(f"\nwrote {out / 'compare.json'}, {out / 'compare.md'}, {png} in {meta['total_seconds']:.0f} s", file=log)
    return run_guard(args, [guard_ratios(results, anchors)], [str(out / "compare.json")], [_recorded(doc)])


def _full_run(args: argparse.Namespace) -> bool:
    """Every workload, loader and regime at full size: only such a run's plot replaces docs/benchmarks.*.
    ``args.workloads`` / ``args.loaders``: the parsed lists."""
    every = set(args.workloads) >= set(WORKLOADS) and set(args.loaders) >= set(ALL_LOADERS)
    return every and not args.quick and args.cold == args.warm


def merge(args: argparse.Namespace) -> int:
    """Rebuilds table, targets and plot from earlier runs; the first file's anchors are kept."""
    docs = [json.loads(Path(p).read_text()) for p in args.merge]
    key = ("kind", "workload", "scenario", "loader", "regime", "world", "rank")
    results: dict[tuple[Any, ...], dict[str, Any]] = {}
    for d in docs:
        for r in d["results"]:
            results[tuple(r.get(k) for k in key)] = r
    merged = list(results.values())
    anchors = docs[0]["anchors"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    targets = evaluate_targets(merged, anchors)
    table = tables(merged, anchors)
    png = plot(merged, out / "compare.png")
    meta = dict(docs[0]["meta"], merged_from=[str(p) for p in args.merge], merged_meta=[d["meta"] for d in docs[1:]])
    doc = dict(schema=1, meta=meta, anchors=anchors, results=merged, targets=targets, plot=png)
    (out / "compare.json").write_text(json.dumps(doc, indent=1, default=str))
    target_lines = "\n".join(f"- **{t['status']}** {t['target']} — {t['detail']}" for t in targets)
    md = f"{table}\n\nTargets (issue 5):\n\n{target_lines}\n"
    (out / "compare.md").write_text(md)
    if args.docs and Path(png).is_file():
        Path(args.docs).mkdir(parents=True, exist_ok=True)
        shutil.copy(png, Path(args.docs) / ("benchmarks" + Path(png).suffix))
    print(md)
    return 0


def _info() -> dict[str, Any]:
    """The versions, the CPU and the kernels' SIMD level (``HP_FASTLOAD_SIMD``) the rows ran with."""
    from hp_fastload.support import info

    return info()


def _git() -> str:
    """HEAD and whether the library files differ from it (engineers edit concurrently; record what ran)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "python", "rust"], cwd=ROOT, capture_output=True, text=True
        )
        return head.stdout.strip() + (" + uncommitted library changes" if dirty.stdout.strip() else "")
    except OSError:
        return "unknown"


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in (
        "torch",
        "safetensors",
        "transformers",
        "numpy",
        "fastsafetensors",
        "runai-model-streamer",
        "hp_fastload",
    ):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


if __name__ == "__main__":
    raise SystemExit(main())
