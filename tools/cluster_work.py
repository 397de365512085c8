"""What the ranks of a :mod:`tools.cluster` run do: build a Llama under a trainer's layout (FSDP2, HSDP, TP x DP)
on meta and allocate its shards, load a checkpoint with ``hp_fastload.load`` (``share`` as asked), and check
every local shard bit for bit against safetensors' own read of the checkpoint cut by torch's own
``distribute_tensor``; optionally ``hp_fastload.save`` it back. The checkpoint is written by transformers'
``save_pretrained`` (:func:`write_llama`).

Faults are placed by :func:`pause_at`: a rank pauses at a chosen read of the job-wide delivery (or write of a
save) after leaving a marker file, until the parent has acted (cut a link, killed a node or the storage) and
says so with a second file, so the fault strikes at the same point in every run, however loaded the host.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["LAYOUTS", "load_body", "write_llama", "write_model"]

LAYOUTS = ("fsdp", "hsdp", "tp+fsdp", "tp", "ep", "2d")  # hp_fastload.model.layouts, as ``hp-fastload plan`` lays out


def write_model(
    root: Path,
    family: str = "llama",
    hidden: int = 128,
    layers: int = 2,
    intermediate: int = 256,
    vocab: int = 2048,
    seed: int = 0,
    shard: str = "512KB",
    experts: int = 4,
) -> Path:
    """A random bf16 Llama (or Mixtral: ``experts`` experts, 2 a token) written by transformers' ``save_pretrained`` in
    files of at most ``shard``; its directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    common = {
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        "max_position_embeddings": 256,
    }
    torch.manual_seed(seed)
    if family == "mixtral":
        model: Any = MixtralForCausalLM(MixtralConfig(**common, num_local_experts=experts, num_experts_per_tok=2))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model = model.to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    out = root / f"{family}-h{hidden}-l{layers}-v{vocab}"
    model.save_pretrained(out, max_shard_size=shard)
    return out


def write_llama(root: Path, **sizes: Any) -> Path:
    return write_model(root, "llama", **sizes)


def build(config_dir: str, layout: str) -> Any:
    """The model of ``config_dir`` built on meta, laid out as ``layout`` by ``hp_fastload.model.layouts`` over
    (nodes x ranks per node) for the 2-D layouts (replicas or FSDP across the nodes), its shards allocated."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hp_fastload.model.layouts import apply_layout

    world, per = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    config = AutoConfig.from_pretrained(config_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    apply_layout(model, layout, world, (world // per, per) if layout in ("hsdp", "tp+fsdp", "2d") else None)
    model.to_empty(device="cpu")
    return model


def check_exact(model: Any, checkpoint: str) -> list[str]:
    """Names of the parameters whose local shard differs, bit for bit, from transformers' ``from_pretrained`` of
    the checkpoint cut by torch's ``distribute_tensor`` (no communication: ``src_data_rank=None``)."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).state_dict()
    bad = []
    for name, param in model.named_parameters():
        ref = reference.get(name)
        if ref is None:
            bad.append(f"{name} (not in from_pretrained's model)")
            continue
        if isinstance(param, DTensor):
            want = distribute_tensor(ref, param.device_mesh, param.placements, src_data_rank=None).to_local()
            got = param.to_local()
        else:
            want, got = ref, param.detach()
        if want.shape != got.shape or not torch.equal(
            want.contiguous().view(torch.uint8), got.detach().contiguous().view(torch.uint8)
        ):
            bad.append(name)
    return bad


def pause_at(module: Any, attr: str, ranks: list[int], call: int, marker: str, seconds: float) -> None:
    """Wraps ``module.attr`` so that on the ranks in ``ranks``, its ``call``-th call (from 1) first writes
    ``marker``, then waits until ``marker + ".go"`` exists (the parent struck) or ``seconds`` passed."""
    inner = getattr(module, attr)
    rank = int(os.environ["RANK"])
    if rank not in ranks:
        return
    count = [0]

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        if count[0] == call:
            Path(marker).write_text(str(time.time()))
            go, end = Path(marker + ".go"), time.monotonic() + seconds
            while not go.exists() and time.monotonic() < end:
                time.sleep(0.01)
        return inner(*args, **kwargs)

    setattr(module, attr, wrapped)


def load_body(spec: dict[str, Any]) -> dict[str, Any]:
    """One rank's run of ``spec``: ``checkpoint`` (a local directory, or ``s3://...`` with ``reference`` the local
    copy to check against; ``{node}`` in it is this rank's node), ``layout``, ``share``, ``budget`` (bytes per
    round), ``pause`` (``pause_at``'s arguments: ``attr`` of ``read_chunk`` / ``write_regions``), ``save_to``
    (a path to save to after the load). Returns the load's measurements and the names that differ."""
    import torch.distributed as dist

    import hp_fastload
    from hp_fastload.api import save as save_mod
    from hp_fastload.execute import deliver

    rank, node = int(os.environ["RANK"]), int(os.environ["GROUP_RANK"])
    checkpoint = str(spec["checkpoint"]).format(node=node)
    reference = str(spec.get("reference", checkpoint)).format(node=node)
    t_build = time.perf_counter()
    model = build(reference, spec.get("layout", "hsdp"))
    build_s = time.perf_counter() - t_build
    pause = spec.get("pause")
    if pause and pause.get("during", "load") == "load":
        pause_at(deliver, "read_chunk", pause["ranks"], pause["call"], pause["marker"], pause["seconds"])
    dist.barrier()
    t0 = time.perf_counter()
    report = hp_fastload.load(
        model, checkpoint, share=spec.get("share", "none"), share_budget_bytes=spec.get("budget"), progress=False
    )
    seconds = time.perf_counter() - t0
    out: dict[str, Any] = {
        "rank": rank,
        "node": node,
        "build_seconds": build_s,
        "seconds": seconds,
        "bytes_read": report.bytes_read,
        "bytes_received": report.bytes_received,
        "bytes_sent": report.bytes_sent,
        "share": report.share,
        "stragglers": list(getattr(report, "stragglers", ())),
        "finished_at": time.time(),
    }
    out["mismatched"] = check_exact(model, reference) if spec.get("check", True) else []
    if spec.get("save_to"):
        if pause and pause.get("during") == "save":
            pause_at(save_mod, "write_regions", pause["ranks"], pause["call"], pause["marker"], pause["seconds"])
        hp_fastload.save(model, spec["save_to"])
    return out


def dump(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2))
