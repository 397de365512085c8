"""Full scale at reduced scale: the released layouts ``benches/scale.py`` writes, and one rank of a big job
rehearsed (``hp_fastload.rehearse``, ``plan(rank=)``, ``plan_each``) on sparse checkpoints at real widths and
dtypes (few layers, few experts, a small vocabulary), checked bit-exactly against torch's and safetensors'
own results, with the memory and descriptor bounds that broke at full size asserted.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import hp_fastload
from hp_fastload.formats import TORCH_TO_SAFETENSORS
from tests.helpers.docs import run_snippet, snippet
from tests.helpers.quant_checkpoints import weight_dequant
from tests.helpers.tiny_models import FAMILIES, model_class

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches"))
import scale

pytestmark = pytest.mark.timeout(300)

#: real widths, one layer (DeepSeek-V3: its first, dense one), 4 experts, a 1,024-token vocabulary
SMALL_VOCAB = {"vocab_size": 1024}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-235B-A22B at real widths (hidden 4096, 64 heads of 128, experts of 1536), one layer of 4 experts,
    every tensor filled, split into ~30 files."""
    root = tmp_path_factory.mktemp("scale") / "qwen3"
    scale.write_checkpoint(
        root,
        scale.MODELS["qwen3-235b-a22b"],
        layers=1,
        experts=4,
        fill=(r".",),
        overrides=SMALL_VOCAB,
        max_shard_size="8MB",
    )
    return root


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSeek-V3's released FP8 layout at real widths, a dense layer 0 and a MoE layer 1 (4 experts); two
    attention projections of layer 0 and expert 1's down projection of layer 1 filled, the rest holes."""
    root = tmp_path_factory.mktemp("scale") / "deepseek"
    scale.write_checkpoint(
        root,
        scale.MODELS["deepseek-v3"],
        layers=2,
        experts=4,
        fill=(r"layers\.0\.self_attn\.(q_a|kv_a)_proj", r"layers\.1\.mlp\.experts\.1\.down_proj", r"norm"),
        overrides={**SMALL_VOCAB, "first_k_dense_replace": 1},
        max_shard_size="64MB",
    )
    return root


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """gpt-oss-120b's MXFP4 release at real widths (hidden and expert width 2,880: scale rows of 90 groups), 4
    layers of 4 experts; layer 0's experts filled (random codes, scale bytes near 127), the rest holes (scale byte
    0, as the full-scale rehearsal reads them)."""
    root = tmp_path_factory.mktemp("scale") / "gpt_oss"
    scale.write_checkpoint(
        root,
        scale.MODELS["gpt-oss-120b"],
        layers=4,
        experts=4,
        fill=(r"^model\.layers\.0\.mlp\.experts\.",),
        overrides=SMALL_VOCAB,
        max_shard_size="64MB",
    )
    return root


def test_a_cached_checkpoint_comes_back_as_written(tmp_path: Path) -> None:
    """A second ``write_checkpoint`` with the same arguments reuses the files (its stamp matches) and returns
    the first call's description, ``path`` a ``Path`` (``make bench-scale`` over a generated checkpoint failed
    on a string there)."""
    args: dict[str, Any] = {"layers": 1, "experts": 4, "overrides": SMALL_VOCAB, "max_shard_size": "64MB"}
    first = scale.write_checkpoint(tmp_path / "q", scale.MODELS["qwen3-235b-a22b"], **args)
    again = scale.write_checkpoint(tmp_path / "q", scale.MODELS["qwen3-235b-a22b"], **args)
    assert isinstance(again.path, Path), type(again.path)
    assert again == first
    assert len(list(again.path.glob("*.safetensors"))) == first.files


@pytest.fixture
def fake_world() -> Iterator[Any]:
    """A ``fake`` process group of ``world`` ranks as rank ``rank`` (torch's own local shards for that rank)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def start(world: int, rank: int) -> None:
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


def _fsdp_model(path: Path, world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _st(path: Path) -> dict[str, Any]:
    """key -> an open safetensors handle of its file (safetensors' own reader)."""
    index_file = path / "model.safetensors.index.json"
    if not index_file.is_file():
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            index = dict.fromkeys(f.keys(), "model.safetensors")
    else:
        index = json.loads(index_file.read_text())["weight_map"]
    handles = {name: safe_open(str(path / name), "pt") for name in set(index.values())}
    return {key: handles[name] for key, name in index.items()}


def _local_of(full: torch.Tensor, param: Any, rank: int) -> torch.Tensor:
    """torch's own local shard of ``full`` for ``rank`` under FSDP2's ``Shard(0)`` on a 1-D mesh: its chunk
    (``torch.chunk``, DTensor's split of a sharded dim)."""
    from torch.distributed.tensor import Shard

    assert tuple(param.placements) == (Shard(0),), param.placements
    chunks = torch.chunk(full, param.device_mesh.size(), dim=0)
    return chunks[rank] if rank < len(chunks) else full[:0]


def test_released_layouts_are_save_pretrained_headers(tmp_path: Path) -> None:
    """``save.released_tensors`` of a model on meta (the generator's layout) has the keys, shapes and dtypes
    transformers' ``save_pretrained`` writes for the same model materialized, for the families of the five."""
    from hp_fastload.planning.export import released_tensors

    for family in ("qwen3_moe", "deepseek_v3", "gpt_oss"):
        from transformers import AutoConfig

        config = AutoConfig.for_model(family, **FAMILIES[family])
        cls = model_class(family)
        with torch.device("meta"):
            meta = cls.from_config(config, dtype=torch.bfloat16)
        real = cls.from_config(config, dtype=torch.bfloat16)
        real.save_pretrained(tmp_path / family)
        with safe_open(str(tmp_path / family / "model.safetensors"), "pt") as f:
            written = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}  # noqa: SIM118
        ours = {k: (tuple(t.shape), TORCH_TO_SAFETENSORS[t.dtype]) for k, t in released_tensors(meta).items()}
        assert ours == written, family


def test_generated_headers_are_the_release_layouts(deepseek: Path) -> None:
    """FP8 weights with 128x128 ``weight_scale_inv`` blocks, the router and norms bf16, the correction bias
    F32, the quantization_config of the release."""
    config = json.loads((deepseek / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    st = _st(deepseek)
    dtype = {k: st[k].get_slice(k).get_dtype() for k in st}
    shape = {k: tuple(st[k].get_slice(k).get_shape()) for k in st}
    assert dtype["model.layers.0.self_attn.q_b_proj.weight"] == "F8_E4M3"
    assert shape["model.layers.0.self_attn.q_b_proj.weight"] == (24576, 1536)
    assert shape["model.layers.0.self_attn.q_b_proj.weight_scale_inv"] == (192, 12)
    assert shape["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"] == (5, 56)  # 576 rows: ragged
    assert dtype["model.layers.1.mlp.experts.2.down_proj.weight"] == "F8_E4M3"
    assert dtype["model.layers.1.mlp.gate.weight"] == "BF16"
    assert dtype["model.layers.1.mlp.gate.e_score_correction_bias"] == "F32"
    assert dtype["lm_head.weight"] == "BF16"


def test_rehearsed_rank_is_bit_exact_and_bounded(qwen3: Path, fake_world: Any) -> None:
    """Rank 2 of FSDP2 over 4: every local shard rehearsed through mapped reads equals torch's chunk of
    safetensors' tensors
    (experts stacked by transformers' rule: gate and up concatenated per expert), and reading it adds less
    than half its bytes to the resident set (mapped checkpoint pages were kept: +100% of them; released in
    windows of a sixteenth of the mapped spans, at least 1 MiB, plus the tasks in flight)."""
    world, rank = 4, 2
    fake_world(world, rank)
    model = _fsdp_model(qwen3, world)
    hp_fastload.rehearse(model, qwen3, rank=rank, threads=2)  # the pages cached: the mapped path below
    report, shards = hp_fastload.rehearse(model, qwen3, rank=rank, threads=2, backend="mmap", keep=True)
    st = _st(qwen3)
    params = dict(model.named_parameters())
    checked = 0
    for name, local in shards.items():
        if ".experts." in name:
            prefix = name.rsplit(".", 1)[0]
            if name.endswith("gate_up_proj"):
                per = [
                    torch.cat(
                        [
                            st[k].get_tensor(k)
                            for k in (f"{prefix}.{e}.gate_proj.weight", f"{prefix}.{e}.up_proj.weight")
                        ]
                    )
                    for e in range(4)
                ]
            else:
                per = [st[k].get_tensor(k) for k in (f"{prefix}.{e}.down_proj.weight" for e in range(4))]
            full = torch.stack(per)
        else:
            full = st[name].get_tensor(name)
        expected = _local_of(full, params[name], rank)
        assert torch.equal(local.view(torch.int16), expected.view(torch.int16)), name
        checked += 1
    assert checked == len(params)
    assert report.bytes_read == report.local_bytes  # bf16 into bf16
    assert report.peak_rss - report.rss_before < report.local_bytes // 2, report.summary()


def test_descriptors_stay_bounded_over_many_files(deepseek: Path, fake_world: Any) -> None:
    """A rank reading from ~15 files with positioned reads holds no more than its workers' descriptors and a
    few kept ones (the engine kept up to 64 files open through the whole call)."""
    files = list(deepseek.glob("*.safetensors"))
    assert len(files) >= 12
    fake_world(16, 0)
    model = _fsdp_model(deepseek, 16)
    report, _ = hp_fastload.rehearse(model, deepseek, rank=5, threads=1, backend="pread")
    assert report.peak_fds - report.fds_before <= 2 * report.threads + 2, report.summary()


def test_a_rank_that_does_not_fit_in_memory_is_refused_before_allocating(
    deepseek: Path, fake_world: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rehearsal allocates the rank's local shards for real: when they exceed the memory available (here the
    machine made to report 1 MiB), a ``PlanError`` naming both sizes comes before any allocation (a rank of
    DeepSeek-V3 under TP 8 x FSDP 32 asks for 38.7 GiB: the kernel killed the process on a 24 GiB machine)."""
    from hp_fastload.api import rehearse as rehearsal

    fake_world(4, 0)
    model = _fsdp_model(deepseek, 4)
    monkeypatch.setattr(rehearsal, "available_bytes", lambda device: 1 << 20)
    allocated: list[Any] = []
    real_empty = torch.empty

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        if torch.device(kwargs.get("device") or "cpu").type != "meta" and args and args[0] != ():
            allocated.append(args[0])  # not the 0-d dtype probes of the size check
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    with pytest.raises(hp_fastload.PlanError, match=r"rank 1 .* GiB on cpu, more than the 0\.00 GiB available"):
        hp_fastload.rehearse(model, deepseek, rank=1, threads=1)
    assert not allocated, allocated[:3]


def test_the_guide_rehearsal_snippet_runs(deepseek: Path, fake_world: Any) -> None:
    """The at-scale guide's "Rehearse one rank" snippet, run as written on the reduced DeepSeek-V3 release (its
    path put in for the example's, the model laid out for 16 ranks on meta), printing what the page shows."""
    fake_world(16, 0)
    model = _fsdp_model(deepseek, 16)
    page = snippet("docs/guides/at-scale.md", "rehearse")
    scope = run_snippet(page, {"model_on_meta": model}, replace={'"/ckpt/DeepSeek-V3"': repr(str(deepseek))})
    printed = scope["__stdout__"]
    assert printed.startswith("rank 5: planned in"), printed
    assert "GB/s" in printed and "open descriptors" in printed, printed


def test_fp8_rank_dequantized_bit_exact(deepseek: Path, fake_world: Any) -> None:
    """Rank 1 of FSDP2 over 4 on the FP8 release: each filled weight's local shard is the published block
    dequantization of safetensors' own fp8 values and scales, chunked as torch shards it (the stacked experts'
    chunk of rank 1 is expert 1); holes read as zeros."""
    world, rank = 4, 1
    fake_world(world, 0)
    model = _fsdp_model(deepseek, world)
    report, shards = hp_fastload.rehearse(model, deepseek, rank=rank, threads=2, keep=True)
    st = _st(deepseek)
    params = dict(model.named_parameters())
    q_a = "model.layers.0.self_attn.q_a_proj.weight"
    full = weight_dequant(st[q_a].get_tensor(q_a), st[q_a].get_tensor(q_a + "_scale_inv"), (128, 128), torch.bfloat16)
    assert full.abs().sum() > 0
    assert torch.equal(shards[q_a].view(torch.int16), _local_of(full, params[q_a], rank).view(torch.int16))
    experts = "model.layers.1.mlp.experts.down_proj"
    key = "model.layers.1.mlp.experts.1.down_proj.weight"
    expert = weight_dequant(st[key].get_tensor(key), st[key].get_tensor(key + "_scale_inv"), (128, 128), torch.bfloat16)
    assert tuple(shards[experts].shape) == (1, *expert.shape)
    assert torch.equal(shards[experts][0].view(torch.int16), expert.view(torch.int16))
    hole = "model.layers.0.mlp.down_proj.weight"
    assert shards[hole].numel() > 0 and not shards[hole].any()
    assert report.local_bytes == sum(t.numel() * t.element_size() for t in shards.values())


def test_plan_each_equals_plan_of_each_rank(deepseek: Path, fake_world: Any) -> None:
    """Sharing the rank-independent planning (groups, traces, quantized claims, unexpected keys) gives every
    rank the plan ``plan(model, path, rank=r)`` makes from scratch; a model on meta plans without a rank."""
    fake_world(4, 0)
    model = _fsdp_model(deepseek, 4)
    each = dict(hp_fastload.plan_each(model, deepseek, range(4)))
    assert [r for r in each] == [0, 1, 2, 3]
    for rank in range(4):
        assert each[rank] == hp_fastload.plan(model, deepseek, rank=rank), rank
    assert each[0] != each[3]
    # Both share the per-plan intersection memo (one intersection per traced block list and region object):
    # it gives the plans that intersecting every target on its own gives.
    from hp_fastload.planning import claims as claims_mod
    from hp_fastload.planning import intersect as intersect_mod

    plain = intersect_mod.region_items
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            claims_mod,
            "region_items",
            lambda target, blocks, index, sources, cache, memo: plain(target, blocks, index, sources),
        )
        for rank in (0, 3):
            assert hp_fastload.plan(model, deepseek, rank=rank) == each[rank], rank
    assert hp_fastload.plan(model, deepseek) == each[0]  # on meta: this process's rank
    assert any("layers.1.mlp.experts" in k for k in each[0].dequant)
    with pytest.raises(ValueError, match="rank or mesh_override"):
        hp_fastload.plan(model, deepseek, rank=1, mesh_override=hp_fastload.as_rank(1))
    with pytest.raises(ValueError, match="non-negative"):
        hp_fastload.as_rank(-1)


class _AnonPeak:
    """The largest anonymous resident set (``RssAnon``: not the checkpoint's mapped pages) seen over a block,
    sampled every 2 ms from a thread (the engine reads without the GIL), and the value when it started."""

    def __init__(self) -> None:
        import threading

        self.before = self.peak = self._now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _now() -> int:
        with open("/proc/self/status", encoding="ascii") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._now())

    def __enter__(self) -> _AnonPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def test_gpt_oss_expert_slice_keeps_its_share_of_the_scales(gpt_oss: Path, fake_world: Any) -> None:
    """One rank of gpt-oss under EP x FSDP (``2d``: experts by expert on 2, their 2,880 inputs over 32, the
    rest Shard(0) over 32): its MXFP4 expert shards equal transformers' own dequantization
    (``convert_moe_packed_tensors``) of the released blocks and scales, cut as DTensor cuts them, and holes read
    as zeros. Reading them adds a small part of the rank's bytes to its anonymous memory: the engine decoded each
    expert's whole scale rows to ``f32`` (90 groups of which the rank's 90 inputs touch 3-4: twice the rank's
    bf16 expert bytes; +1.6 GiB for one rank of gpt-oss-120b at full scale) where it now keeps the columns the
    rank's slice touches."""
    from torch.distributed.tensor import Shard
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from hp_fastload.model.layouts import apply_layout

    dp, ep = 32, 2
    world, rank = dp * ep, 3 * ep + 1  # dp index 3 (inputs 270..360: groups 8..11, ragged), ep index 1
    fake_world(world, rank)
    config = AutoConfig.from_pretrained(gpt_oss)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    apply_layout(model, "2d", world, (dp, ep))
    hp_fastload.rehearse(model, gpt_oss, rank=rank, threads=2)  # the pages cached: the mapped path below
    with _AnonPeak() as anon:
        report, shards = hp_fastload.rehearse(model, gpt_oss, rank=rank, threads=2, backend="mmap", keep=True)
    st = _st(gpt_oss)
    params = dict(model.named_parameters())
    checked = 0
    for layer in range(4):
        for proj in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{layer}.mlp.experts.{proj}"
            param = params[name]
            assert tuple(param.placements) == (Shard(1), Shard(0)), param.placements
            blocks, scales = (st[k].get_tensor(k) for k in (name + "_blocks", name + "_scales"))
            full = convert_moe_packed_tensors(blocks, scales)  # [E, in, out], bf16
            expected = torch.chunk(torch.chunk(full, ep, dim=0)[rank % ep], dp, dim=1)[rank // ep]
            assert torch.equal(shards[name].view(torch.int16), expected.view(torch.int16)), name
            assert bool(expected.any()) == (layer == 0), name  # layer 0 filled, the rest holes
            checked += 1
    assert checked == 8
    expert_bytes = sum(t.numel() * t.element_size() for n, t in shards.items() if ".experts." in n and "bias" not in n)
    grown = anon.peak - anon.before
    assert grown < expert_bytes // 4, (
        f"anonymous memory grew {grown / 2**20:.1f} MiB reading {expert_bytes / 2**20:.1f} MiB of expert shards; "
        + report.summary()
    )
