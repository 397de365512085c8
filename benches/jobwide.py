"""Job-wide plan at scale (issue 24): the simulator (``hp-fastload plan --all-ranks --share job``) on a checkpoint
with DeepSeek-V3's structure (61 layers, 256 routed experts, its key names and conversion rules) and tiny
dimensions, written with transformers' ``save_pretrained``; prints T1-T4 and the predicted cold starts.

    .venv/bin/python benches/jobwide.py --world 64 --layout 2d --mesh 8x8 --ranks-per-node 8

Byte counts scale with the dimensions, the plan's structure (and the planning time, T4) with the key count.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def write_checkpoint(root: Path, layers: int, experts: int) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "deepseek_v3",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=experts,
        num_experts_per_tok=8,
        n_shared_experts=1,
        first_k_dense_replace=3,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        n_group=8,
        topk_group=4,
        tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(root, max_shard_size="20MB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=64)
    parser.add_argument("--layout", default="2d")
    parser.add_argument("--mesh", default="8x8")
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--checkpoint", default=None, help="reuse a checkpoint directory written before")
    args = parser.parse_args()
    from hp_fastload.api.ranks import simulate

    root = Path(args.checkpoint) if args.checkpoint else Path(tempfile.mkdtemp(prefix="hpf_jobwide_"))
    if not (root / "config.json").exists():
        t0 = time.perf_counter()
        write_checkpoint(root, args.layers, args.experts)
        print(f"wrote {root} in {time.perf_counter() - t0:.1f} s")
    mesh = tuple(int(x) for x in args.mesh.split("x")) if args.mesh else None
    result = simulate(str(root), args.layout, args.world, mesh=mesh, ranks_per_node=args.ranks_per_node)
    for key in ("per_rank_needed_bytes", "per_rank_received_bytes", "per_rank_read_bytes"):
        result.pop(key)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
