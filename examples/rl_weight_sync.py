"""RL weight sync with ``hp_fastload.transfer``: a trainer under FSDP2 hands its weights to a generation model under
tensor parallelism after every optimizer step, point to point, through the checkpoint's names (no gather of full
parameters, no files).

Two placements:

* same ranks (default): every rank holds a shard of the trainer and a shard of the generator;
* ``--disjoint``: the first half of the ranks train, the second half generate (each half a row of one
  ``(2, world / 2)`` device mesh).

Run it with torchrun (gloo on CPU, NCCL with ``--device cuda``)::

    torchrun --nproc-per-node 4 examples/rl_weight_sync.py --steps 3
    torchrun --nproc-per-node 4 examples/rl_weight_sync.py --steps 3 --disjoint

After each sync, every generator tensor is compared with the trainer's (a digest of each full tensor, computed by
each side on its own ranks and gathered): the generator must hold the trainer's weights bit for bit.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import hp_fastload as hf

COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROWWISE = ("o_proj", "down_proj")


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


def build_trainer(config: Any, mesh: Any, device: str, seed: int = 0) -> nn.Module:
    """The trainer: transformers' model, initialized from ``seed``, each decoder layer and the root under FSDP2."""
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(device)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def build_generator(config: Any, mesh: Any, device: str) -> nn.Module:
    """The generation model: built on meta, its linears tensor-parallel (column-wise in, row-wise out), then
    allocated (uninitialized: the sync fills it)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    plan: dict[str, Any] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.endswith(COLWISE):
            plan[name] = ColwiseParallel()
        elif isinstance(module, nn.Linear) and name.endswith(ROWWISE):
            plan[name] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    model.to_empty(device=device)
    return model.eval()


def digests(model: nn.Module | None) -> dict[str, str]:
    """Every tensor of the state dict, gathered on its own mesh (the model's ranks only), as a digest of its bytes."""
    if model is None:
        return {}
    out = {}
    for name, tensor in model.state_dict().items():
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        data = full.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
        out[name] = hashlib.blake2b(data, digest_size=16).hexdigest()
    return out


def meshes(world: int, disjoint: bool, device: str) -> tuple[Any, Any, bool, bool]:
    """``(trainer mesh, generator mesh, this rank trains, this rank generates)``."""
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    if not disjoint:
        mesh = init_device_mesh(device, (world,))
        return mesh, mesh, True, True
    if world % 2:
        raise ValueError(f"--disjoint needs an even number of ranks, got {world}")
    grid = init_device_mesh(device, (2, world // 2), mesh_dim_names=("role", "shard"))
    trains = rank < world // 2
    return grid["shard"], grid["shard"], trains, not trains


def run(rank: int, world: int, disjoint: bool = False, steps: int = 2, device: str = "cpu") -> list[dict[str, Any]]:
    """The sync loop on this rank (the process group is up); returns one record per step."""
    config = tiny_llama_config()
    trainer_mesh, generator_mesh, trains, generates = meshes(world, disjoint, device)
    trainer = build_trainer(config, trainer_mesh, device) if trains else None
    generator = build_generator(config, generator_mesh, device) if generates else None
    optimizer = torch.optim.SGD(trainer.parameters(), lr=0.1) if trainer is not None else None
    batch = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1)).to(device)
    records = []
    for step in range(steps):
        if trainer is not None and optimizer is not None:  # one training step changes every weight
            loss = trainer(input_ids=batch, labels=batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        report = hf.transfer(trainer, generator)
        if generator is not None:
            with torch.no_grad():
                logits = generator(input_ids=batch).logits  # the generation model runs on what it received
            finite = bool(torch.isfinite(logits.to_local() if hasattr(logits, "to_local") else logits).all())
        else:
            finite = True
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, (digests(trainer) if trains else {}, digests(generator) if generates else {}))
        trained = next(d for d, _ in gathered if d)
        generated = next(g for _, g in gathered if g)
        records.append(
            {
                "step": step,
                "equal": trained == generated,
                "differing": sorted(k for k in trained if trained[k] != generated.get(k)),
                "finite": finite,
                "moved_over_needed": report.moved_over_needed,
                "planned": report.planned,
                "bytes_sent": report.bytes_sent,
                "bytes_received": report.bytes_received,
                "seconds": report.seconds,
            }
        )
        if rank == 0:
            print(f"step {step}: generator == trainer: {trained == generated}; {report.summary()}")
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--disjoint", action="store_true", help="trainer on the first half of the ranks")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        records = run(dist.get_rank(), dist.get_world_size(), args.disjoint, args.steps, args.device)
        if not all(r["equal"] for r in records):
            raise SystemExit("the generator differs from the trainer")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
