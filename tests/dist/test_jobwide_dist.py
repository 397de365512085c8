"""``load(..., share="job")`` on 4 gloo ranks in 2 simulated nodes (issue 24): every layout of the issue
(FSDP, TP x DP, HSDP, EP with replicated attention, 2-D) once, bf16 (FSDP, TP x DP, HSDP) or FP8 (EP, 2-D),
bit-exact against transformers' ``from_pretrained`` cut with torch's ``distribute_tensor``; storage bytes
read once per job (T1) and each rank receiving about its own shard (T2); faults: a transient read error
retried, a permanent one raised on every rank naming the file and byte range, a rank failing mid-delivery
named by the others, ranks whose job plans differ raising before any byte; ``share="auto"`` choosing by the
cost model.

One spawn runs every check; each rank builds each family's model once and loads deep copies. Which bytes
each rank needs, on every layout and both families, is tested without a spawn (tests/planning/
test_jobranks.py). The parent writes a bf16 Qwen3-MoE checkpoint in several files (``save_pretrained``) and
an FP8 block-quantized DeepSeek-V3 one, and the references (``from_pretrained``). A small round budget makes
every load take several rounds and chunks.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import quant_checkpoints as qc
from tests.helpers.dist import run_distributed, run_subchecks, subcheck_values
from tests.helpers.tiny_models import model_class

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

ROOT_ENV = "HPF_JOBWIDE_ROOT"
WORLD = 4
RANKS_PER_NODE = 2
BUDGET = 48 << 10  # bytes per rank per round: several rounds even for tiny checkpoints
FAMILIES = {"qwen3_moe": None, "deepseek_v3": (8, 8)}
#: each layout once: bf16 for the replicated layouts, FP8 (dequantized at the receiver) for the expert ones
CASES = [
    ("qwen3_moe", "fsdp"),
    ("qwen3_moe", "tp_dp"),
    ("qwen3_moe", "hsdp"),
    ("deepseek_v3", "ep"),
    ("deepseek_v3", "2d"),
]
_BASE: dict[str, Any] = {}


def _write(root: Path) -> None:
    bf16 = root / "qwen3_moe"
    model = qc.build_model("qwen3_moe", seed=3)
    model.save_pretrained(bf16, max_shard_size="8KB")
    reference = model_class("qwen3_moe").from_pretrained(bf16, dtype=torch.bfloat16)
    torch.save(reference.state_dict(), bf16 / "reference.pt")
    block = FAMILIES["deepseek_v3"]
    assert block is not None
    fp8 = root / "deepseek_v3"
    model = qc.build_model("deepseek_v3", seed=4)
    tensors = qc.quantize_fp8_block(qc.released(model, fp8), block)
    qc.rewrite(fp8, tensors, dict(qc.FP8_CONFIG, weight_block_size=list(block)))
    formula = root / "deepseek_v3-formula"
    model.save_pretrained(formula)
    out = {}
    for key, value in tensors.items():
        if key.endswith("_scale_inv"):
            continue
        if key + "_scale_inv" in tensors:
            value = qc.weight_dequant(value, tensors[key + "_scale_inv"], block, torch.bfloat16)
        out[key] = value
    qc.save_file(out, str(formula / "model.safetensors"), metadata={"format": "pt"})
    reference = model_class("deepseek_v3").from_pretrained(formula, dtype=torch.bfloat16)
    torch.save(reference.state_dict(), fp8 / "reference.pt")


def _tp(name: str, shape: tuple[int, ...]) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    if len(shape) == 3:
        return Shard(1)
    if len(shape) == 2 and name.endswith(("o_proj.weight", "down_proj.weight")):
        return Shard(1)
    return Shard(0) if len(shape) >= 1 and shape[0] >= 2 else Replicate()


def _placements(layout: str, name: str, shape: tuple[int, ...]) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    rows = Shard(0) if len(shape) >= 1 and shape[0] >= 2 else Replicate()
    if layout == "tp_dp":  # data-parallel replicas (across the nodes) of a tensor-parallel layout
        return [Replicate(), _tp(name, shape)]
    if layout == "hsdp":  # replicate on the outer dim, shard on the inner
        return [Replicate(), rows]
    if layout == "ep":  # experts by expert over every rank; attention and the rest replicated
        return [Shard(0)] if ".experts." in name and len(shape) == 3 else [Replicate()]
    # 2d: rows on the outer dim, columns (experts: rows of each expert) on the inner
    inner = Shard(1) if len(shape) >= 2 else Replicate()
    return [rows, inner]


def _build(family: str, layout: str) -> Any:
    import copy

    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    if family not in _BASE:
        _BASE[family] = qc.build_model(family, seed=1)
    model = copy.deepcopy(_BASE[family])
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (WORLD,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        mesh = init_device_mesh("cpu", (WORLD,) if layout == "ep" else (2, 2))
        for name, param in list(model.named_parameters()):
            *path, leaf = name.split(".")
            module = model.get_submodule(".".join(path))
            placements = _placements(layout, name, tuple(param.shape))
            dt = distribute_tensor(param.detach().clone(), mesh, placements, src_data_rank=None)
            setattr(module, leaf, nn.Parameter(dt, requires_grad=False))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def _compare(model: Any, reference: dict[str, torch.Tensor]) -> tuple[list[str], int]:
    from torch.distributed.tensor import DTensor, distribute_tensor

    bad, sharded = [], 0
    for name, param in model.state_dict().items():
        full = reference[name].to(param.dtype)
        if isinstance(param, DTensor):
            expected = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
            local = param.to_local()
            sharded += expected.numel() < full.numel()
        else:
            expected, local = full, param
        if expected.shape != local.shape or not torch.equal(expected, local):
            bad.append(name)
    assert sharded, "no tensor was sharded"
    return bad, sharded


def _load(family: str, layout: str, share: str, **kwargs: Any) -> tuple[list[str], Any]:
    import hp_fastload as hf

    root = Path(os.environ[ROOT_ENV]) / family
    model = _build(family, layout)
    report = hf.load(model, root, share=share, ranks_per_node=RANKS_PER_NODE, share_budget_bytes=BUDGET, **kwargs)
    assert not report.missing_keys and not report.unexpected_keys, report
    bad, _ = _compare(model, torch.load(root / "reference.pt"))
    return bad, report


def _make_check(family: str, layout: str) -> Any:
    def check(rank: int, world: int) -> dict[str, Any]:
        bad, report = _load(family, layout, "job")
        _, none = _load(family, layout, "none") if layout == "hsdp" else ([], None)
        return {
            "bad": bad,
            "read": report.bytes_read,
            "received": report.bytes_received,
            "sent": report.bytes_sent,
            "needed": report.bytes_needed,
            "checkpoint": report.checkpoint_bytes,
            "share": report.share,
            "summary": report.summary(),
            "read_none": none.bytes_read if none is not None else None,
        }

    check.__name__ = f"check_{family}_{layout}"
    return check


def check_transient_read_error_is_retried(rank: int, world: int) -> dict[str, Any]:
    """Rank 1's first chunk read fails with EIO once: retried, the load completes with the same values."""
    from hp_fastload.execute import deliver

    calls = {"n": 0}
    original = deliver.read_chunk

    def flaky(*args: Any, **kwargs: Any) -> None:
        calls["n"] += 1
        if rank == 1 and calls["n"] == 1:
            raise OSError(errno.EIO, "injected transient error")
        original(*args, **kwargs)

    deliver.read_chunk = flaky
    try:
        bad, report = _load("qwen3_moe", "hsdp", "job")
    finally:
        deliver.read_chunk = original
    return {"bad": bad, "calls": calls["n"], "read": report.bytes_read, "checkpoint": report.checkpoint_bytes}


def check_permanent_read_error_raises_everywhere(rank: int, world: int) -> str:
    """Rank 2's reads keep failing with EIO: every rank raises a ReadError naming rank 2, the file and the
    byte range."""
    from hp_fastload.errors import ReadError
    from hp_fastload.execute import deliver

    original = deliver.read_chunk

    def broken(*args: Any, **kwargs: Any) -> None:
        if rank == 2:
            raise OSError(errno.EIO, "injected permanent error")
        original(*args, **kwargs)

    deliver.read_chunk = broken
    try:
        with pytest.raises(ReadError) as caught:
            _load("qwen3_moe", "2d", "job")
    finally:
        deliver.read_chunk = original
    return str(caught.value)


def check_nccl_only_default_group(rank: int, world: int) -> dict[str, Any]:
    """A default group without a CPU backend (as ``init_process_group("nccl")`` makes): it is told by its device
    types, and a point-to-point of a host tensor on it fails as NCCL's does. The delivery's messages go over a
    gloo group of every rank instead, made once; the values are the same."""
    import torch.distributed as dist

    from hp_fastload.dist import groups

    default = dist.distributed_c10d._get_default_group()
    seen: dict[str, int] = {"default": 0, "other": 0}
    originals = {name: getattr(dist, name) for name in ("isend", "irecv")}

    def guarded(name: str) -> Any:
        def call(tensor: torch.Tensor, *args: Any, group: Any = None, **kwargs: Any) -> Any:
            if (group is None or group is default) and tensor.device.type == "cpu":
                seen["default"] += 1
                raise RuntimeError("No backend type associated with device type cpu")
            seen["other"] += 1
            return originals[name](tensor, *args, group=group, **kwargs)

        return call

    carries = groups._carries_cpu
    groups._carries_cpu = lambda group: group is not default and carries(group)
    dist.isend, dist.irecv = guarded("isend"), guarded("irecv")
    try:
        bad, report = _load("qwen3_moe", "hsdp", "job")
        made = groups._made
        bad_again, _ = _load("qwen3_moe", "hsdp", "job")
        same_group = groups._made is made
    finally:
        dist.isend, dist.irecv = originals["isend"], originals["irecv"]
        groups._carries_cpu = carries
    return {
        "bad": bad + bad_again,
        "seen": seen,
        "received": report.bytes_received,
        "made_once": same_group and made is not None and made[0] is default,
    }


def check_auto_follows_the_cost_model(rank: int, world: int) -> dict[str, Any]:
    """``share="auto"`` on the HSDP layout (replicas on both nodes): a slow storage and a fast network make the
    job plan the faster (each byte read once), a fast storage and a slow network every rank reading alone;
    the values are exact either way."""
    from hp_fastload.execute import job

    out: dict[str, Any] = {}
    for name, storage, network in (("slow storage", "0.001", "1000"), ("slow network", "1000", "0.001")):
        os.environ[job.STORAGE_GBPS_ENV], os.environ[job.NETWORK_GBPS_ENV] = storage, network
        try:
            bad, report = _load("qwen3_moe", "hsdp", "auto")
        finally:
            del os.environ[job.STORAGE_GBPS_ENV], os.environ[job.NETWORK_GBPS_ENV]
        out[name] = {"bad": bad, "share": report.share}
    return out


def check_ranks_disagreeing_on_the_plan_raise_everywhere(rank: int, world: int) -> dict[str, Any]:
    """Ranks 2 and 3 say one rank per node, ranks 0 and 1 two: their job plans differ (the digest covers the
    nodes), so every rank raises ``PlanError`` at the digest's agreement, before any byte is delivered (every
    shard still as ``_build`` zeroed it) and with no checkpoint file left mapped."""
    import hp_fastload as hf
    from hp_fastload.errors import PlanError

    root = Path(os.environ[ROOT_ENV]) / "qwen3_moe"
    model = _build("qwen3_moe", "hsdp")
    with pytest.raises(PlanError) as caught:
        hf.load(model, root, share="job", ranks_per_node=1 if rank >= 2 else 2, share_budget_bytes=BUDGET)
    untouched = all(not p.to_local().any() for p in model.parameters())
    with open("/proc/self/maps") as maps:
        mapped = [line for line in maps if str(root) in line]
    return {"message": str(caught.value), "untouched": untouched, "mapped": mapped}


def check_rank_failing_mid_delivery_is_named(rank: int, world: int) -> str:
    """Rank 3 raises while packing its messages (after the reads were agreed): it raises its own error, the
    others raise naming rank 3 once their wait for it times out (last check: the group is left unusable)."""
    from hp_fastload.execute import deliver

    original = deliver._pack

    def failing(*args: Any, **kwargs: Any) -> Any:
        if rank == 3:
            raise RuntimeError("injected failure while packing")
        return original(*args, **kwargs)

    deliver._pack = failing
    deliver.WAIT_TIMEOUT_S = 2.0
    try:
        with pytest.raises(RuntimeError) as caught:
            _load("qwen3_moe", "ep", "job")
    finally:
        deliver._pack = original
    return str(caught.value)


def _all_checks(rank: int, world: int) -> dict[str, Any]:
    os.environ["LOCAL_WORLD_SIZE"] = str(RANKS_PER_NODE)
    checks = [_make_check(*case) for case in CASES] + [
        check_transient_read_error_is_retried,
        check_permanent_read_error_raises_everywhere,
        check_nccl_only_default_group,
        check_auto_follows_the_cost_model,
        check_ranks_disagreeing_on_the_plan_raise_everywhere,
        check_rank_failing_mid_delivery_is_named,  # last: it leaves the group unusable
    ]
    return run_subchecks(rank, world, checks)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("jobwide")
    _write(root)
    os.environ[ROOT_ENV] = str(root)
    try:
        return run_distributed(_all_checks, WORLD, timeout=300)
    finally:
        os.environ.pop(ROOT_ENV, None)


@pytest.mark.parametrize(("family", "layout"), CASES)
def test_job_share_values_and_bytes(outcomes: list[dict[str, Any]], family: str, layout: str) -> None:
    per_rank = subcheck_values(outcomes, f"check_{family}_{layout}")
    for rank, got in enumerate(per_rank):
        assert got["bad"] == [], (rank, got["bad"])
        assert got["share"] == "job", got["summary"]
        assert "received" in got["summary"] and "sent" in got["summary"]
    checkpoint = per_rank[0]["checkpoint"]
    read = sum(got["read"] for got in per_rank)
    # T1: every checkpoint byte is needed by some rank in these layouts, and read once (no replica reads it twice)
    assert checkpoint <= read <= 1.02 * checkpoint, (read, checkpoint)
    for got in per_rank:  # T2: a rank receives about what its shards need, never a broadcast of whole tensors
        assert got["received"] <= 1.05 * got["needed"], got
    assert sum(got["sent"] for got in per_rank) == sum(got["received"] for got in per_rank)
    if per_rank[0]["read_none"] is not None:  # the replicated layouts read twice without sharing
        assert sum(got["read_none"] for got in per_rank) >= 1.9 * checkpoint
        assert any(got["received"] > 0 for got in per_rank)


def test_transient_read_error_is_retried(outcomes: list[dict[str, Any]]) -> None:
    per_rank = subcheck_values(outcomes, "check_transient_read_error_is_retried")
    for got in per_rank:
        assert got["bad"] == []
    assert per_rank[1]["calls"] >= 2  # the failed chunk was read again
    assert sum(got["read"] for got in per_rank) <= 1.02 * per_rank[0]["checkpoint"]


def test_permanent_read_error_raises_everywhere(outcomes: list[dict[str, Any]]) -> None:
    for message in subcheck_values(outcomes, "check_permanent_read_error_raises_everywhere"):
        assert "rank 2" in message, message
        assert ".safetensors: reading bytes [" in message and "after 4 attempts" in message, message


def test_nccl_only_default_group_sends_over_gloo(outcomes: list[dict[str, Any]]) -> None:
    per_rank = subcheck_values(outcomes, "check_nccl_only_default_group")
    for got in per_rank:
        assert got["bad"] == [], got
        assert got["seen"]["default"] == 0, got  # no host message was posted on the NCCL-like default group
        assert got["made_once"], got  # one gloo group for the default group, reused by the second load
    assert sum(got["seen"]["other"] for got in per_rank) > 0  # hsdp: replicas exchange bytes
    assert sum(got["received"] for got in per_rank) > 0


def test_auto_follows_the_cost_model(outcomes: list[dict[str, Any]]) -> None:
    for got in subcheck_values(outcomes, "check_auto_follows_the_cost_model"):
        assert got["slow storage"] == {"bad": [], "share": "job"}, got
        assert got["slow network"] == {"bad": [], "share": "none"}, got


def test_ranks_disagreeing_on_the_plan_raise_everywhere(outcomes: list[dict[str, Any]]) -> None:
    for got in subcheck_values(outcomes, "check_ranks_disagreeing_on_the_plan_raise_everywhere"):
        assert "Agreeing on the job-wide plan: the ranks disagree (rank 0 vs ranks [2, 3])" in got["message"], got
        assert got["untouched"], got  # no byte reached a shard
        assert got["mapped"] == [], got


def test_rank_failing_mid_delivery_is_named(outcomes: list[dict[str, Any]]) -> None:
    messages = subcheck_values(outcomes, "check_rank_failing_mid_delivery_is_named")
    assert "injected failure while packing" in messages[3]
    for rank in (0, 1, 2):  # a rank waiting for rank 3's message names it; one that got past that round
        # waits for rank 3 in the next agreement, which says the others did not arrive
        assert "lost rank 3" in messages[rank] or "waited for the other ranks" in messages[rank], messages[rank]
