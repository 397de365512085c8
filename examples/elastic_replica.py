"""Elastic data parallelism with ``hp_fastload.transfer``: a new replica joins and is filled from a live one, point to
point, with no checkpoint on storage.

The live replica trains under FSDP2 on the first half of the ranks; the new replica (the same model, the same
FSDP2 layout) is built on meta on the second half, allocated, and filled by one ``hf.transfer(live, new)``
called by every rank (the live ranks pass the live model and None, the new ranks None and the new model). Each
new rank receives exactly its own shards: nothing is gathered.

    torchrun --nproc-per-node 4 examples/elastic_replica.py

The new replica must then hold the live one's weights bit for bit (a digest of each full tensor, each replica
gathering its own on its own ranks).
"""

from __future__ import annotations

import argparse
import hashlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import hp_fastload as hf


def tiny_llama_config(hidden: int = 64, layers: int = 2) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def digests(model: nn.Module) -> dict[str, str]:
    """Every tensor of the state dict, gathered on the replica's own ranks, as a digest of its bytes."""
    out = {}
    for name, tensor in model.state_dict().items():
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        data = full.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
        out[name] = hashlib.blake2b(data, digest_size=16).hexdigest()
    return out


def run(rank: int, world: int, steps: int = 1, device: str = "cpu") -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    if world % 2:
        raise ValueError(f"the example puts each replica on half of the ranks: an even world, not {world}")
    config = tiny_llama_config()
    grid = init_device_mesh(device, (2, world // 2), mesh_dim_names=("replica", "shard"))
    live_side = rank < world // 2
    mesh = grid["shard"]
    if live_side:  # the replica that has been training
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(device)
    else:  # the replica that joins: no weights yet
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if live_side:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        batch = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1)).to(device)
        for _ in range(steps):
            model(input_ids=batch, labels=batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    else:
        model.to_empty(device=device)
    report = hf.transfer(model if live_side else None, None if live_side else model)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (live_side, digests(model)))
    live = next(d for side, d in gathered if side)
    joined = next(d for side, d in gathered if not side)
    if rank == 0:
        print(f"new replica == live replica: {live == joined}; {report.summary()}")
    return {
        "equal": live == joined,
        "received": report.bytes_received,
        "needed": report.bytes_needed,
        "sent": report.bytes_sent,
        "moved_over_needed": report.moved_over_needed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1, help="training steps of the live replica first")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        if args.device == "cuda":
            torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
        out = run(dist.get_rank(), dist.get_world_size(), args.steps, args.device)
        if not out["equal"]:
            raise SystemExit("the new replica differs from the live one")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
