"""``hp_fastload.transfer`` on four real gloo ranks, one spawn for the whole module.

Every layout pair is built with torch (``fully_shard``, ``parallelize_module``, ``distribute_tensor`` on a 2-D
mesh), the source filled from transformers' own tiny model (each local shard is ``distribute_tensor`` of that
model's tensor), the destination filled with a marker, then transferred. Each destination must equal, bit for
bit, ``distribute_tensor`` of transformers' model in the destination layout, and, on the same ranks,
``hf.save(src)`` then ``hf.load`` of that directory into a third model of the destination layout. The report must
show every destination byte delivered exactly once (received + copied == needed). The pairs: FSDP2 -> TP and
TP -> FSDP2 (Llama, four ranks), FSDP2 -> EP x FSDP (Mixtral: its stacked experts are per-expert tensors in the
checkpoint), and the same pairs on disjoint ranks (ranks 0-1 hold the source, 2-3 the destination, sub-meshes
of one (2, 2) mesh). A destination of another config raises ``TargetError`` on every rank and stays untouched; a
failure injected on one rank (packing, placing) raises on every rank; an interrupt on one rank (a real SIGINT)
raises ``KeyboardInterrupt`` there and ``PeerInterrupted`` on the others; a transfer afterwards still works.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers.dist import child_environment, run_distributed, run_subchecks, subcheck_values
from tests.helpers.layouts import COLWISE, ROWWISE, block_lists
from tests.helpers.tiny_models import tiny_model

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

ROOT_ENV = "HPF_TRANSFER_ROOT"
WORLD = 4
MARK = 7.0  # what a destination holds before the transfer: no weight of the tiny models equals it


# ------------------------------------------------------------------ layouts on a given mesh (torch's own APIs)
def fsdp(model: nn.Module, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for blocks in block_lists(model):
        for block in blocks:
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def tp(model: nn.Module, mesh: Any) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan: dict[str, Any] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.endswith(COLWISE):
            plan[name] = ColwiseParallel()
        elif (isinstance(module, nn.Linear) and name.endswith(ROWWISE)) or (
            isinstance(module, nn.Embedding) and name.endswith("embed_tokens")
        ):
            plan[name] = RowwiseParallel()
    parallelize_module(model, mesh, plan)


def ep_fsdp(model: nn.Module, mesh: Any) -> None:
    """A (ep, dp) mesh: stacked experts split on the expert dim across ep and on their next dim across dp; every
    other tensor replicated across ep and split on dim 0 across dp."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    for name, module in model.named_modules():
        for pname, param in list(module._parameters.items()):
            if param is None:
                continue
            experts = param.ndim == 3 and "experts" in name
            placements = [Shard(0), Shard(1)] if experts else [Replicate(), Shard(0)]
            dt = distribute_tensor(param.data, mesh, placements, src_data_rank=None)
            module.register_parameter(pname, nn.Parameter(dt, requires_grad=param.requires_grad))


def _meta_model(family: str, overrides: dict[str, Any] | None = None) -> nn.Module:
    from tests.helpers.tiny_models import model_class, tiny_config

    config = tiny_config(family)
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    cls = model_class(family)
    with torch.device("meta"):
        return cls.from_config(config) if cls.__name__.startswith("Auto") else cls(config)


def build(family: str, layout: Callable[[nn.Module, Any], None], mesh: Any, **overrides: Any) -> nn.Module:
    model = _meta_model(family, overrides)
    layout(model, mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for tensor in model.parameters():
            _local(tensor).fill_(MARK)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def fill_from(model: nn.Module, plain: nn.Module) -> None:
    """Each local shard := ``distribute_tensor`` of transformers' own tensor of that name (no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    full = dict(plain.named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if isinstance(param, DTensor):
                shard = distribute_tensor(full[name].detach(), param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(shard.to_local())
            else:
                param.copy_(full[name])


def mismatches_against_torch(model: nn.Module, plain: nn.Module) -> list[str]:
    """Names whose local shard is not bit-equal to ``distribute_tensor`` of transformers' tensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    full = dict(plain.named_parameters())
    bad = []
    for name, param in model.named_parameters():
        expected = full[name].detach()
        if isinstance(param, DTensor):
            expected = distribute_tensor(expected, param.device_mesh, param.placements, src_data_rank=None).to_local()
        if not _bit_equal(_local(param), expected):
            bad.append(name)
    return bad


def mismatches(a: nn.Module, b: nn.Module) -> list[str]:
    """State-dict entries (and buffers) whose local shards differ in any bit."""
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    bad = [name for name in sa if not _bit_equal(_local(sa[name]), _local(sb[name]))]
    buffers_b = dict(b.named_buffers())
    bad += [name for name, buf in a.named_buffers() if not _bit_equal(buf, buffers_b[name])]
    return bad


def _bit_equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    return bool(torch.equal(x.detach().contiguous().view(torch.uint8), y.detach().contiguous().view(torch.uint8)))


def _local_bytes(model: nn.Module | None) -> int:
    if model is None:
        return 0
    return sum(_local(t).numel() * _local(t).element_size() for t in model.state_dict().values())


def _delivery(report: Any, dst: nn.Module | None) -> dict[str, Any]:
    return {
        "needed": report.bytes_needed,
        "dst_bytes": _local_bytes(dst),
        "ratio": report.moved_over_needed,
        "received": report.bytes_received,
        "sent": report.bytes_sent,
        "copied": report.bytes_copied,
        "messages": report.messages_sent + report.messages_received,
        "direct": report.direct_messages,
        "rounds": report.rounds,
        "staging": report.peak_staging_bytes,
    }


# ------------------------------------------------------------------------------------------------ the pairs
def _same_ranks(
    family: str, src_layout: Any, dst_layout: Any, mesh_of: Callable[[str], Any], tag: str, **options: Any
) -> dict[str, Any]:
    import hp_fastload as hf

    plain = tiny_model(family)
    src = build(family, src_layout, mesh_of("src"))
    fill_from(src, plain)
    dst = build(family, dst_layout, mesh_of("dst"))
    report = hf.transfer(src, dst, **options)
    out = _delivery(report, dst)
    out["vs_torch"] = mismatches_against_torch(dst, plain)
    path = Path(os.environ[ROOT_ENV]) / tag
    hf.save(src, path, overwrite=True)
    reference = build(family, dst_layout, mesh_of("dst"))
    hf.load(reference, path)
    out["vs_save_load"] = mismatches(dst, reference)
    return out


def _flat_mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (WORLD,))


def _grid(names: tuple[str, str]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=names)


def check_llama_fsdp_to_tp(rank: int, world: int) -> dict[str, Any]:
    mesh = _flat_mesh()
    return _same_ranks("llama", fsdp, tp, lambda _: mesh, "fsdp_tp")


def check_llama_tp_to_fsdp(rank: int, world: int) -> dict[str, Any]:
    mesh = _flat_mesh()
    return _same_ranks("llama", tp, fsdp, lambda _: mesh, "tp_fsdp", budget_bytes=1024)


def check_mixtral_fsdp_to_ep_fsdp(rank: int, world: int) -> dict[str, Any]:
    flat, grid = _flat_mesh(), _grid(("ep", "dp"))
    return _same_ranks("mixtral", fsdp, ep_fsdp, lambda side: flat if side == "src" else grid, "moe")


def _disjoint(family: str, src_layout: Any, dst_layout: Any, rank: int, **options: Any) -> dict[str, Any]:
    """Ranks 0-1 hold the source, ranks 2-3 the destination: each on its row of a (side, x) mesh."""
    import hp_fastload as hf

    mesh = _grid(("side", "x"))
    sub = mesh["x"]
    plain = tiny_model(family)
    src = dst = None
    if rank < 2:
        src = build(family, src_layout, sub)
        fill_from(src, plain)
    else:
        dst = build(family, dst_layout, sub)
    report = hf.transfer(src, dst, **options)
    out = _delivery(report, dst)
    out["vs_torch"] = mismatches_against_torch(dst, plain) if dst is not None else []
    out["src_untouched"] = mismatches_against_torch(src, plain) if src is not None else []
    return out


def check_disjoint_llama_fsdp_to_tp(rank: int, world: int) -> dict[str, Any]:
    return _disjoint("llama", fsdp, tp, rank, direct_bytes=256)


def check_disjoint_llama_tp_to_fsdp(rank: int, world: int) -> dict[str, Any]:
    return _disjoint("llama", tp, fsdp, rank)


def check_disjoint_mixtral_fsdp_to_tp(rank: int, world: int) -> dict[str, Any]:
    return _disjoint("mixtral", fsdp, tp, rank)


def check_plan_reused(rank: int, world: int) -> dict[str, Any]:
    """A second call with the same models runs the first call's plan (the source changed in place meanwhile);
    a new destination model is planned again."""
    import hp_fastload as hf

    mesh = _flat_mesh()
    src = build("llama", fsdp, mesh)
    fill_from(src, tiny_model("llama", seed=1))
    dst = build("llama", tp, mesh)
    first = hf.transfer(src, dst)
    later = tiny_model("llama", seed=2)
    fill_from(src, later)  # a training step: the same tensors, new values
    second = hf.transfer(src, dst)
    fresh = build("llama", tp, mesh)
    third = hf.transfer(src, fresh)
    return {
        "planned": [first.planned, second.planned, third.planned],
        "second": mismatches_against_torch(dst, later),
        "third": mismatches_against_torch(fresh, later),
    }


def check_deferred_conversion(rank: int, world: int) -> dict[str, Any]:
    """A source loaded through a value-changing conversion of ``model.norm.weight`` (times 4: no exact region
    form) into a TP destination with the plain rules: that tensor goes the deferred path (gathered whole,
    reverted by transformers, loaded by ``load``'s plan), the rest as regions; the destination must equal
    ``save(src, weights_mapping=...)`` then ``load``, bit for bit."""
    import hp_fastload as hf
    from tests.helpers.tiny_models import scale_mapping

    mesh = _flat_mesh()
    plain = tiny_model("llama")
    src = build("llama", fsdp, mesh)
    fill_from(src, plain)
    mapping = scale_mapping(["model.norm.weight"])
    dst = build("llama", tp, mesh)
    report = hf.transfer(src, dst, src_weights_mapping=mapping)
    again = hf.transfer(src, dst, src_weights_mapping=mapping)
    path = Path(os.environ[ROOT_ENV]) / "deferred"
    hf.save(src, path, overwrite=True, weights_mapping=mapping)
    reference = build("llama", tp, mesh)
    hf.load(reference, path)
    return {
        "deferred": list(report.deferred),
        "planned": [report.planned, again.planned],
        "vs_save_load": mismatches(dst, reference),
        "norm_changed": not _bit_equal(_local(dst.model.norm.weight), _local(src.model.norm.weight)),
    }


def _plain_layout(model: nn.Module, mesh: Any) -> None:
    """No layout: every tensor whole on its rank."""


def check_plain_destination_and_a_bystander(rank: int, world: int) -> dict[str, Any]:
    """FSDP2 on ranks 0-1 into a whole (plain) model on rank 2; rank 3 holds neither and only takes part. Twice:
    the second call runs the first call's plan on every rank, the bystander's included."""
    import hp_fastload as hf

    sub = _grid(("side", "x"))["x"]
    plain = tiny_model("llama")
    src = dst = None
    if rank < 2:
        src = build("llama", fsdp, sub)
        fill_from(src, plain)
    elif rank == 2:
        dst = build("llama", _plain_layout, None)
    reports = [hf.transfer(src, dst), hf.transfer(src, dst)]
    return {
        "planned": [r.planned for r in reports],
        "vs_torch": mismatches_against_torch(dst, plain) if dst is not None else [],
        **_delivery(reports[1], dst),
    }


# ------------------------------------------------------------------------------------------ refusals and faults
def _outcome(call: Callable[[], Any]) -> str:
    try:
        call()
    except Exception as exc:  # the type and message are the outcome
        return f"{type(exc).__name__}: {exc}"
    return "returned"


def check_mismatch(rank: int, world: int) -> dict[str, Any]:
    import hp_fastload as hf

    mesh = _flat_mesh()
    plain = tiny_model("llama")
    src = build("llama", fsdp, mesh)
    fill_from(src, plain)
    dst = build("llama", tp, mesh, intermediate_size=32)
    before = {n: _local(t).clone() for n, t in dst.state_dict().items()}
    outcome = _outcome(lambda: hf.transfer(src, dst))
    after = dst.state_dict()
    untouched = all(_bit_equal(before[n], _local(after[n])) for n in before)
    # a missing tensor: the destination without its lm_head tied to nothing is another layout (tied embeddings)
    dst_tied = build("llama", tp, mesh, tie_word_embeddings=True)
    missing = _outcome(lambda: hf.transfer(src, dst_tied))
    dst_dtype = build("llama", fsdp, mesh)
    dst_dtype.to(torch.float16)
    dtype = _outcome(lambda: hf.transfer(src, dst_dtype))
    return {"outcome": outcome, "untouched": untouched, "missing": missing, "dtype": dtype}


def _faulty(rank: int, where: str, failing: int) -> str:
    import hp_fastload as hf
    import hp_fastload.execute.transfer as ex

    mesh = _flat_mesh()
    plain = tiny_model("llama")
    src = build("llama", fsdp, mesh)
    fill_from(src, plain)
    dst = build("llama", tp, mesh)
    real = getattr(ex, where)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise OSError(f"injected {where} fault on rank {rank}")

    if rank == failing:
        setattr(ex, where, broken)
    try:
        return _outcome(lambda: hf.transfer(src, dst, direct_bytes=1 << 40))
    finally:
        setattr(ex, where, real)


def check_fault_in_packing(rank: int, world: int) -> str:
    return _faulty(rank, "pack_message", 1)


def check_fault_in_placing(rank: int, world: int) -> str:
    return _faulty(rank, "place_message", 2)


def check_interrupt(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 packs slowly (2 s) and gets a real SIGINT 0.3 s in: it raises ``KeyboardInterrupt``, the others
    ``PeerInterrupted`` naming it, all well before the slow pack would have ended; then a transfer works."""
    import hp_fastload as hf
    import hp_fastload.execute.transfer as ex

    mesh = _flat_mesh()
    plain = tiny_model("llama")
    src = build("llama", fsdp, mesh)
    fill_from(src, plain)
    dst = build("llama", tp, mesh)
    real = ex.pack_message

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(2.0)
        return real(*args, **kwargs)

    outcome = "returned"
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = None
    if rank == 0:
        ex.pack_message = slow
        timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT))
    start = time.perf_counter()
    try:
        if timer is not None:
            timer.start()
        try:
            hf.transfer(src, dst, direct_bytes=1 << 40)
        except KeyboardInterrupt:
            outcome = "KeyboardInterrupt"
        except hf.PeerInterrupted as exc:
            outcome = f"PeerInterrupted {exc.ranks}"
        seconds = time.perf_counter() - start
        if timer is not None:
            timer.join()
        time.sleep(0.05)
    finally:
        ex.pack_message = real
        signal.signal(signal.SIGINT, previous)
    fresh = build("llama", tp, mesh)
    hf.transfer(src, fresh)
    return {"outcome": outcome, "seconds": seconds, "again": mismatches_against_torch(fresh, plain)}


CHECKS = [
    check_llama_fsdp_to_tp,
    check_llama_tp_to_fsdp,
    check_mixtral_fsdp_to_ep_fsdp,
    check_disjoint_llama_fsdp_to_tp,
    check_disjoint_llama_tp_to_fsdp,
    check_disjoint_mixtral_fsdp_to_tp,
    check_plan_reused,
    check_deferred_conversion,
    check_plain_destination_and_a_bystander,
    check_mismatch,
    check_fault_in_packing,
    check_fault_in_placing,
    check_interrupt,
]


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="hp_transfer_test-") as root, child_environment({ROOT_ENV: root}):
        return run_distributed(run_subchecks, WORLD, checks=CHECKS, timeout=240)


def _exact_and_once(values: list[dict[str, Any]], same_ranks: bool) -> None:
    for rank, got in enumerate(values):
        assert got["vs_torch"] == [], (rank, got)
        if same_ranks:
            assert got["vs_save_load"] == [], (rank, got)
        assert got["needed"] == got["dst_bytes"], (rank, got)
        assert got["ratio"] == 1.0, (rank, got)
    assert sum(v["received"] for v in values) == sum(v["sent"] for v in values) > 0
    assert sum(v["received"] + v["copied"] for v in values) == sum(v["dst_bytes"] for v in values)


@pytest.mark.parametrize("check", ["check_llama_fsdp_to_tp", "check_llama_tp_to_fsdp", "check_mixtral_fsdp_to_ep_fsdp"])
def test_same_ranks_bit_exact_and_each_byte_once(ranks: list[dict[str, Any]], check: str) -> None:
    _exact_and_once(subcheck_values(ranks, check), same_ranks=True)


def test_a_small_window_cuts_the_transfer_into_rounds(ranks: list[dict[str, Any]]) -> None:
    """``budget_bytes=1024``: many rounds, each rank's packed messages of a round within the window."""
    for rank, got in enumerate(subcheck_values(ranks, "check_llama_tp_to_fsdp")):
        assert got["rounds"] > 3, (rank, got)
        assert 0 < got["staging"] <= 1024, (rank, got)


def test_large_pieces_go_shard_to_shard(ranks: list[dict[str, Any]]) -> None:
    """``direct_bytes=256``: the FSDP2 rows and TP column blocks of 256 bytes or more are messages of their own,
    sent from the source shard and received into the destination shard."""
    for rank, got in enumerate(subcheck_values(ranks, "check_disjoint_llama_fsdp_to_tp")):
        assert got["direct"] > 0, (rank, got)


@pytest.mark.parametrize(
    "check",
    ["check_disjoint_llama_fsdp_to_tp", "check_disjoint_llama_tp_to_fsdp", "check_disjoint_mixtral_fsdp_to_tp"],
)
def test_disjoint_ranks_bit_exact_and_each_byte_once(ranks: list[dict[str, Any]], check: str) -> None:
    values = subcheck_values(ranks, check)
    _exact_and_once(values, same_ranks=False)
    for rank, got in enumerate(values):
        assert got["src_untouched"] == [], (rank, got)
        if rank < 2:  # source ranks send, receive nothing, copy nothing
            assert got["received"] == got["copied"] == got["needed"] == 0 and got["sent"] > 0, (rank, got)
        else:
            assert got["sent"] == 0 and got["received"] == got["needed"] > 0, (rank, got)


def test_a_second_call_with_the_same_models_runs_the_same_plan(ranks: list[dict[str, Any]]) -> None:
    for rank, got in enumerate(subcheck_values(ranks, "check_plan_reused")):
        assert got["planned"] == [True, False, True], (rank, got)
        assert got["second"] == [] and got["third"] == [], (rank, got)


def test_a_conversion_without_a_region_form_goes_whole(ranks: list[dict[str, Any]]) -> None:
    for rank, got in enumerate(subcheck_values(ranks, "check_deferred_conversion")):
        assert got["deferred"] == ["model.norm.weight"], (rank, got)
        assert got["vs_save_load"] == [] and got["norm_changed"], (rank, got)
        assert got["planned"] == [True, False], (rank, got)


def test_a_whole_destination_on_one_rank_with_a_bystander(ranks: list[dict[str, Any]]) -> None:
    values = subcheck_values(ranks, "check_plain_destination_and_a_bystander")
    for rank, got in enumerate(values):
        assert got["planned"] == [True, False], (rank, got)
        assert got["vs_torch"] == [] and got["ratio"] == 1.0, (rank, got)
    assert values[2]["received"] == values[2]["needed"] == values[2]["dst_bytes"] > 0
    assert values[3]["received"] == values[3]["sent"] == values[3]["needed"] == 0
    assert values[0]["sent"] + values[1]["sent"] == values[2]["received"]


def test_a_layout_mismatch_raises_on_every_rank_before_any_byte_moves(ranks: list[dict[str, Any]]) -> None:
    for rank, got in enumerate(subcheck_values(ranks, "check_mismatch")):
        assert got["outcome"].startswith("TargetError"), (rank, got)
        assert "dimension" in got["outcome"] and "mlp" in got["outcome"], (rank, got)
        assert got["untouched"], (rank, got)
        assert got["missing"].startswith("TargetError") and "lm_head.weight" in got["missing"], (rank, got)
        assert got["dtype"].startswith("TargetError") and "float16" in got["dtype"], (rank, got)


@pytest.mark.parametrize(("check", "failing"), [("check_fault_in_packing", 1), ("check_fault_in_placing", 2)])
def test_a_failure_on_one_rank_raises_on_every_rank(ranks: list[dict[str, Any]], check: str, failing: int) -> None:
    for rank, outcome in enumerate(subcheck_values(ranks, check)):
        assert outcome.startswith("OSError"), (rank, outcome)
        assert f"fault on rank {failing}" in outcome, (rank, outcome)


def test_an_interrupt_on_one_rank_stops_every_rank(ranks: list[dict[str, Any]]) -> None:
    values = subcheck_values(ranks, "check_interrupt")
    assert values[0]["outcome"] == "KeyboardInterrupt", values[0]
    for rank, got in enumerate(values[1:], start=1):
        assert got["outcome"] == "PeerInterrupted [0]" or got["outcome"] == "PeerInterrupted (0,)", (rank, got)
    for rank, got in enumerate(values):
        assert got["seconds"] < 1.8, (rank, got)  # the slow pack (2 s) was cut short
        assert got["again"] == [], (rank, got)
