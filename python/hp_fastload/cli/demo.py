"""The main job, end to end: a real checkpoint into a real parallelized model on several CPU ranks.

``python -m hp_fastload.cli demo`` writes a small Mixtral checkpoint with transformers' own
``save_pretrained`` (per-expert tensors, so experts get stacked on load), starts ``world`` gloo ranks,
builds the model on meta (float32), parallelizes it (tensor parallel attention, FSDP2 elsewhere; a 2-D
FSDP x TP mesh with 4 ranks), materializes it, loads it with ``hp_fastload.load`` (which also re-creates the
non-persistent buffers ``to_empty`` left uninitialized), checks every local shard bit-exactly against
``distribute_tensor`` of a single-process ``from_pretrained`` reference, and runs one training step on both:
the loss, and the loss after an SGD step, must agree.
``--checkpoint PATH`` runs the same on a user's checkpoint (a transformers causal LM).
"""

from __future__ import annotations

import json
import math
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from hp_fastload.formats import CONFIG_NAME

DEMO_CONFIG: dict[str, Any] = dict(
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def make_demo_checkpoint(directory: str | os.PathLike[str], seed: int = 0) -> Path:
    """A bf16 Mixtral checkpoint written by transformers' ``save_pretrained`` (about 100 MB)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    path = Path(directory)
    if (path / CONFIG_NAME).is_file() and any(path.glob("*.safetensors")):
        return path
    torch.manual_seed(seed)
    config = MixtralConfig(**DEMO_CONFIG)
    model: Any = MixtralForCausalLM(config)
    model = model.to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    model.save_pretrained(path, max_shard_size="40MB")
    return path


def parallelize(model: torch.nn.Module, world: int) -> dict[str, Any]:
    """Tensor-parallel attention and FSDP2 on a real DeviceMesh; a 2-D (dp, tp) mesh when ``world >= 4``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    inner: Any = getattr(model, "model", model)
    layers: Any = inner.layers
    attn_plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
    }
    if world >= 4 and world % 2 == 0:
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        for layer in layers:
            parallelize_module(layer, mesh["tp"], attn_plan)
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(inner.embed_tokens, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return {"mesh": "dp x tp", "shape": (world // 2, 2)}
    dp = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    tp = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    for layer in layers:
        parallelize_module(layer, tp, attn_plan)
        moe: Any = getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None)
        if moe is not None:
            fully_shard(moe, mesh=dp)
    lm_head: Any = getattr(model, "lm_head", None)
    if lm_head is not None and lm_head.weight is inner.embed_tokens.weight:
        fully_shard([inner.embed_tokens, lm_head], mesh=dp)  # tied: one FSDP group keeps one parameter
    else:
        fully_shard(inner.embed_tokens, mesh=dp)
        if lm_head is not None:
            fully_shard(lm_head, mesh=dp)
    return {"mesh": "tp (attention) + fsdp (experts, embeddings)", "shape": (world,)}


def _one_step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, float]:
    """The loss of a batch, one SGD step on it, and the loss after the step."""
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, foreach=False)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        after = model(input_ids=ids, labels=ids).loss
    full = [x.full_tensor() if hasattr(x, "full_tensor") else x for x in (loss, after)]
    return float(full[0].detach()), float(full[1].detach())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, world: int, port: int, checkpoint: str, out: str, loader: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor
    from transformers import AutoConfig, AutoModelForCausalLM

    import hp_fastload

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    result: dict[str, Any] = {"rank": rank}
    try:
        # The prologue of a training script: build on meta, parallelize, materialize, load. float32 weights from
        # the bf16 checkpoint (an exact cast), so the losses below differ from one process's only by the
        # reduction order of the sharded matmuls.
        config = AutoConfig.from_pretrained(checkpoint)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        layout = parallelize(model, world)
        model.to_empty(device="cpu")  # parameters and non-persistent buffers (rotary inv_freq) are garbage now
        dist.barrier()
        report = hp_fastload.load(model, checkpoint, loader=loader, progress=rank == 0)  # + buffers re-created
        result.update(
            layout=layout,
            summary=report.summary(),
            bytes_read=report.bytes_read,
            checkpoint_bytes=report.checkpoint_bytes,
            seconds=report.seconds,
            missing=list(report.missing_keys),
            unexpected=list(report.unexpected_keys),
            unfilled_buffers=list(report.unfilled_buffers),
        )
        # Reference: transformers' own single-process load, cut with torch's own distribute_tensor.
        reference_model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        reference = reference_model.state_dict()
        checked = mismatched = 0
        bad: list[str] = []
        for name, param in model.state_dict().items():
            if name not in reference:
                continue
            full = reference[name]
            if isinstance(param, DTensor):
                expected = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
                local = param.to_local()
            else:
                expected, local = full, param
            checked += 1
            if expected.shape != local.shape or not torch.equal(
                expected.reshape(-1).view(torch.int32), local.reshape(-1).view(torch.int32)
            ):
                mismatched += 1
                bad.append(name)
        result.update(checked=checked, mismatched=mismatched, bad=bad[:5])
        # One training step on each side: the loss, and the loss after an SGD step, must agree.
        ids = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
        result.update(losses=_one_step(model, ids), reference_losses=_one_step(reference_model, ids))
    except Exception as exc:  # report, then re-raise so the exit code says it
        result["error"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(result, default=str))
        dist.destroy_process_group()


def run_demo(checkpoint: str | None = None, world: int = 2, loader: str = "dcp", timeout: float = 600.0) -> int:
    """Run the demo; returns a process exit code (0 when every shard matched on every rank)."""
    import torch.multiprocessing as mp

    work = Path(tempfile.mkdtemp(prefix="hp_fastload_demo_"))
    if checkpoint is None:
        cache = Path(os.environ.get("HP_FASTLOAD_DEMO_DIR", Path.cwd() / "demo-out" / "mixtral-tiny"))
        started = time.perf_counter()
        checkpoint = str(make_demo_checkpoint(cache))
        took = time.perf_counter() - started
        print(f"checkpoint: {checkpoint} (written by transformers save_pretrained in {took:.1f} s)")
    port = _free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, checkpoint, str(work), loader)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
    results: list[dict[str, Any]] = []
    for r in range(world):
        f = work / f"rank{r}.json"
        results.append(
            json.loads(f.read_text()) if f.is_file() else {"rank": r, "error": "no result (crashed or hung)"}
        )
    ok = not hung and all(p.exitcode == 0 for p in procs)
    for res in results:
        if "error" in res:
            ok = False
            print(f"rank {res['rank']}: ERROR {res['error']}")
            continue
        share = res["bytes_read"] / res["checkpoint_bytes"] if res["checkpoint_bytes"] else 0.0
        rate = res["bytes_read"] / res["seconds"] / 1e9 if res["seconds"] else 0.0
        print(f"rank {res['rank']}: {res['summary']}")
        print(
            f"rank {res['rank']}: read {res['bytes_read']:,} of {res['checkpoint_bytes']:,} checkpoint bytes "
            f"({share:.1%}) in {res['seconds']:.3f} s = {rate:.2f} GB/s; "
            f"{res['checked']} tensors checked against from_pretrained + distribute_tensor, "
            f"{res['mismatched']} mismatched {res['bad'] or ''}"
        )
        (loss, after), (ref_loss, ref_after) = res["losses"], res["reference_losses"]
        close = math.isclose(loss, ref_loss, rel_tol=2e-6) and math.isclose(after, ref_after, rel_tol=2e-5)
        print(
            f"rank {res['rank']}: training step: loss {loss:.6f}, after one SGD step {after:.6f}; single-process "
            f"from_pretrained: {ref_loss:.6f}, {ref_after:.6f} ({'equal' if close else 'DIFFERENT'}); "
            f"non-persistent buffers not re-created: {res['unfilled_buffers'] or 'none'}"
        )
        ok = ok and res["mismatched"] == 0 and res["checked"] > 0 and not res["missing"]
        ok = ok and close and not res["unfilled_buffers"]
    if results and "layout" in results[0]:
        print(f"layout: {results[0]['layout']}")
    print(
        "DEMO OK: every local shard is bit-identical to the reference, buffers re-created, the training step agrees"
        if ok
        else "DEMO FAILED"
    )
    return 0 if ok else 1
