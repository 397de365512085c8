"""Full scale: the largest open models at their real sizes and job sizes, rehearsed on this machine.

``make bench-scale`` (= ``python benches/scale.py``) writes sparse checkpoints whose headers are the released
ones and rehearses ranks of real trainer layouts on them:

- **Layouts generated exactly.** Each model's config is transformers' own (``DeepseekV3Config()`` defaults for
  DeepSeek-V3; the same architecture with Kimi-K2's sizes; ``Qwen3MoeConfig`` / ``LlamaConfig`` with the
  released sizes of Qwen3-235B-A22B / Llama-3.1-405B; ``GptOssConfig()`` for gpt-oss-120b). The model is built
  on the meta device and its released keys, shapes and dtypes are derived as ``hp_fastload.save`` derives them
  (transformers' tie removal and revert of the conversions, ``save.released_tensors``); the quantized releases
  then replace each quantized weight as the released files hold it (FP8 e4m3 with 128x128 ``weight_scale_inv``
  blocks; MXFP4 ``*_blocks`` / ``*_scales``), and the files are split as ``save_pretrained`` splits
  (``save.shard_files``, ``max_shard_size`` chosen to give about the released number of files). ``config.json``
  is transformers' ``save_pretrained`` of the config, with the release's ``quantization_config``.
- **Data are holes** (each file is its header, then ``truncate``), except the tensors chosen by ``--fill``
  (regular expressions over keys), written with random values: bf16 with the exponent's top bit cleared
  (finite), FP8 by block-quantizing random bf16 with plain torch ops, MXFP4 codes as random bytes with exponents
  near 127.
- **Per rank** (``hp-fastload plan CKPT --layout L --world W --rank r --execute --json``, fresh processes: two
  untimed ones, then ``--repeat`` warm ones, the median reported): plan seconds
  (index open included), the rank's reads (bytes, GB/s against the warm-rows anchor of the same box: the median
  of three passes of ``os.preadv`` over the byte spans the rank's plan reads (``box_spans``: each item's
  contiguous runs, merged per file; at most 64 MiB a request, the first 4 GiB), same threads, each request into
  its own place of one pre-faulted buffer as a loader's bytes land in shards; both after
  two untimed reads of their pages: the first zero-fills a hole, the second moves the page to the kernel's
  active list. ``files_rows_gbps`` keeps the earlier anchor: as many bytes in 64 MiB rows of the same files,
  which sit in other pages, in other folio sizes), peak RSS over the rank's local shard bytes, and peak open
  descriptors. **Time to loaded** (the rehearsal reads as ``load`` does, the regions planned while the first are
  read): its critical path (index, planning left exposed, the planning hidden behind reads, reading, finishing)
  against the box's raw read of the same bytes (``box_bytes`` at the box rows' rate), the issue-40 target.
- **Job** (``hp-fastload plan CKPT --all-ranks --json``): per-node storage bytes and the total, with the
  planning seconds and peak RSS of the whole run.

Usage::

    python benches/scale.py                                  # every model, the default layouts; writes bench-out/scale
    python benches/scale.py --models deepseek-v3 --layouts fsdp:256 --ranks 5
    python benches/scale.py --generate-only --models kimi-k2
    python benches/scale.py --models qwen3-235b-a22b --layers 2 --quick   # reduced scale (real widths)

Results: ``bench-out/scale/scale.json`` and ``scale.md`` (the two tables). Checkpoints are cached under
``bench-out/scale/data/<model>`` (re-generated when the generator's parameters change).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]

#: bump when the generated files change (the cache under bench-out/scale/data is keyed by it)
VERSION = 2
FP8_MAX = 448.0
FP8_BLOCK = (128, 128)


@dataclass(frozen=True)
class ModelSpec:
    """A released model: its transformers config, the release's quantization and file split."""

    name: str
    config: Callable[[], Any]
    quantization: str | None  # "fp8-block", "mxfp4" or None (bf16)
    max_shard_size: str
    #: extra released tensors transformers' model does not hold (DeepSeek-V3's multi-token-prediction layer)
    mtp_layers: int = 0
    notes: str = ""


def _deepseek_v3() -> Any:
    from transformers import DeepseekV3Config

    return DeepseekV3Config()


def _kimi_k2() -> Any:
    from transformers import DeepseekV3Config

    # Kimi-K2-Instruct's config.json: the DeepSeek-V3 architecture with 384 routed experts, 64 heads, one
    # dense layer and a 163,840-token vocabulary (1.04 T parameters)
    return DeepseekV3Config(
        vocab_size=163840,
        n_routed_experts=384,
        num_attention_heads=64,
        num_key_value_heads=64,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.827,
        max_position_embeddings=131072,
        num_nextn_predict_layers=0,
    )


def _qwen3_235b() -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        moe_intermediate_size=1536,
        num_hidden_layers=94,
        num_attention_heads=64,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    )


def _llama_405b() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256,
        hidden_size=16384,
        intermediate_size=53248,
        num_hidden_layers=126,
        num_attention_heads=128,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=128001,
    )


def _gpt_oss_120b() -> Any:
    from transformers import GptOssConfig

    return GptOssConfig()


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("deepseek-v3", _deepseek_v3, "fp8-block", "4.3GB", mtp_layers=1, notes="DeepseekV3Config()"),
        ModelSpec("kimi-k2", _kimi_k2, "fp8-block", "17GB", notes="DeepSeek-V3 architecture, 384 experts"),
        ModelSpec("qwen3-235b-a22b", _qwen3_235b, None, "4GB"),
        ModelSpec("llama-3.1-405b", _llama_405b, None, "4.3GB"),
        ModelSpec("gpt-oss-120b", _gpt_oss_120b, "mxfp4", "4.7GB"),
    )
}

QUANTIZATION_CONFIGS: dict[str, dict[str, Any]] = {
    "fp8-block": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(FP8_BLOCK),
    },
    "mxfp4": {
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    },
}


# ---------------------------------------------------------------------------------------------------------
# The released layout


def model_config(
    spec: ModelSpec, layers: int | None = None, experts: int | None = None, overrides: dict[str, Any] | None = None
) -> Any:
    """The spec's transformers config, optionally with fewer layers / experts (real widths kept) and other
    ``overrides`` (e.g. a small vocabulary for the test suite)."""
    config = spec.config()
    for name, value in (overrides or {}).items():
        setattr(config, name, value)
    if layers is not None:
        config.num_hidden_layers = layers
        if hasattr(config, "layer_types") and config.layer_types is not None:
            config.layer_types = config.layer_types[:layers]
    if experts is not None:
        for attr in ("n_routed_experts", "num_experts", "num_local_experts"):
            if hasattr(config, attr):
                setattr(config, attr, experts)
        if hasattr(config, "n_group") and getattr(config, "n_group", 1) > 1:
            config.n_group = config.topk_group = 1
    return config


def meta_model(config: Any) -> Any:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def _is_fp8_weight(key: str, shape: Sequence[int]) -> bool:
    """DeepSeek-V3's release quantizes every 2-D projection weight of the decoder layers (attention, dense and
    expert MLPs, the MTP layer's ``eh_proj``); embeddings, heads, norms and the router stay bf16."""
    return (
        key.rsplit(".", 2)[-2].split("_proj")[0] != key.rsplit(".", 2)[-2]  # q_a_proj, kv_a_proj_with_mqa, ...
        and key.endswith(".weight")
        and len(shape) == 2
        and ".layers." in key
        and "shared_head" not in key
        and not key.endswith("mlp.gate.weight")
    )


def _mtp_tensors(config: Any, released: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's released multi-token-prediction layer ``model.layers.<num_hidden_layers>``: a MoE decoder
    layer (the keys of the last layer, renumbered) plus its ``embed_tokens``, ``enorm``, ``hnorm``, ``eh_proj``
    and ``shared_head``. transformers' model has no such layer (its loader ignores the keys)."""
    last = config.num_hidden_layers - 1
    h, v = config.hidden_size, config.vocab_size
    prefix = f"model.layers.{last}."
    out = {f"model.layers.{layer}." + k[len(prefix) :]: t for k, t in released.items() if k.startswith(prefix)}
    p = f"model.layers.{layer}."

    def meta(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.bfloat16, device="meta")

    out.update(
        {
            p + "embed_tokens.weight": meta(v, h),
            p + "enorm.weight": meta(h),
            p + "hnorm.weight": meta(h),
            p + "eh_proj.weight": meta(h, 2 * h),
            p + "shared_head.norm.weight": meta(h),
            p + "shared_head.head.weight": meta(v, h),
        }
    )
    return out


def released_layout(
    spec: ModelSpec, layers: int | None = None, experts: int | None = None, overrides: dict[str, Any] | None = None
) -> tuple[Any, dict[str, torch.Tensor], dict[str, Any] | None, int]:
    """``(config, key -> meta tensor as released, quantization_config, parameter count)``.

    The bf16 layout is ``hp_fastload.save``'s (transformers' revert of the model's conversions on meta
    tensors); the quantized releases replace each quantized weight by the tensors the release holds."""
    from hp_fastload.planning.export import released_tensors

    config = model_config(spec, layers, experts, overrides)
    model = meta_model(config)
    parameters = sum(p.numel() for p in model.parameters())
    # Every tensor of these releases is bf16 but DeepSeek's e_score_correction_bias (below); transformers >= 5.25
    # keeps some modules of the model in fp32 (the MoE routers), which the released files do not.
    released = {k: t.to(torch.bfloat16) if t.dtype == torch.float32 else t for k, t in released_tensors(model).items()}
    for i in range(spec.mtp_layers if layers is None else 0):
        released.update(_mtp_tensors(config, released, config.num_hidden_layers + i))
    if spec.quantization is None:
        return config, released, None, parameters
    out: dict[str, torch.Tensor] = {}
    for key, t in released.items():
        if key.endswith("e_score_correction_bias"):
            out[key] = torch.empty(t.shape, dtype=torch.float32, device="meta")  # F32 in the release
        elif spec.quantization == "fp8-block" and _is_fp8_weight(key, t.shape):
            rows, cols = t.shape
            out[key] = torch.empty(t.shape, dtype=torch.float8_e4m3fn, device="meta")
            grid = (-(-rows // FP8_BLOCK[0]), -(-cols // FP8_BLOCK[1]))
            out[key + "_scale_inv"] = torch.empty(grid, dtype=torch.float32, device="meta")
        elif spec.quantization == "mxfp4" and key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, x, y = t.shape  # the model's [E, in, out]; the release holds the transpose in 32-groups along in
            out[key + "_blocks"] = torch.empty((e, y, x // 32, 16), dtype=torch.uint8, device="meta")
            out[key + "_scales"] = torch.empty((e, y, x // 32), dtype=torch.uint8, device="meta")
        else:
            out[key] = t
    return config, out, dict(QUANTIZATION_CONFIGS[spec.quantization]), parameters


# ---------------------------------------------------------------------------------------------------------
# Writing the sparse checkpoint


def _seed(key: str, seed: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest(), "little") >> 1


def random_bf16(shape: Sequence[int], gen: torch.Generator) -> torch.Tensor:
    """Random finite bf16: random bits with the exponent's top bit cleared."""
    bits = torch.randint(-(2**15), 2**15, tuple(shape), dtype=torch.int16, generator=gen) & ~0x4000
    return bits.view(torch.bfloat16)


def fp8_block_quantize(w: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Block FP8 e4m3 with plain torch ops: one fp32 scale per ``block`` (ragged last blocks), ``q = w / s``."""
    rows, cols = w.shape
    bm, bn = block
    gr, gc = -(-rows // bm), -(-cols // bn)
    padded = torch.zeros(gr * bm, gc * bn, dtype=torch.float32)
    padded[:rows, :cols] = w.float()
    blocks = padded.reshape(gr, bm, gc, bn)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-8) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).reshape(gr * bm, gc * bn)[:rows, :cols].to(torch.float8_e4m3fn)
    return q.contiguous(), scale.contiguous()


def _fill_values(key: str, meta: torch.Tensor, released: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Random values for ``key`` (and, for an FP8 weight, its scale; for MXFP4 blocks, none other)."""
    gen = torch.Generator().manual_seed(_seed(key, seed))
    shape = tuple(meta.shape)
    if meta.dtype == torch.float8_e4m3fn:
        q, s = fp8_block_quantize(random_bf16(shape, gen).float().clamp(-1e4, 1e4))
        return {key: q, key + "_scale_inv": s}
    if key.endswith("_scales") and meta.dtype == torch.uint8:  # MXFP4 exponents near 2^0
        return {key: torch.randint(120, 135, shape, dtype=torch.uint8, generator=gen)}
    if meta.dtype == torch.uint8:
        return {key: torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)}
    if meta.dtype == torch.float32:
        return {key: torch.rand(shape, generator=gen, dtype=torch.float32) + 0.5}
    return {key: random_bf16(shape, gen).to(meta.dtype)}


def _stamp(spec: ModelSpec, layers: int | None, experts: int | None, fill: Sequence[str], seed: int) -> str:
    return json.dumps(
        {"model": spec.name, "layers": layers, "experts": experts, "fill": list(fill), "seed": seed, "v": VERSION},
        sort_keys=True,
    )


@dataclass
class Generated:
    path: Path
    files: int
    tensors: int
    total_bytes: int
    filled: list[str] = field(default_factory=list)
    filled_bytes: int = 0
    parameters: int = 0
    seconds: float = 0.0


def write_checkpoint(
    root: Path,
    spec: ModelSpec,
    *,
    layers: int | None = None,
    experts: int | None = None,
    fill: Sequence[str] = (),
    seed: int = 0,
    max_shard_size: str | int | None = None,
    overrides: dict[str, Any] | None = None,
) -> Generated:
    """Write ``spec``'s released checkpoint at ``root`` as sparse files (cached: a matching ``.complete`` stamp
    keeps it). ``fill``: regular expressions (``re.search``) over released keys whose data is written."""
    from hp_fastload.planning.export import shard_files

    stamp = _stamp(spec, layers, experts, fill, seed) + str(max_shard_size) + json.dumps(overrides, sort_keys=True)
    marker = root / ".complete"
    if marker.is_file() and marker.read_text().split("\n", 1)[0] == stamp:
        cached = Generated(**json.loads(marker.read_text().split("\n", 1)[1]))
        cached.path = Path(cached.path)  # the stamp keeps it as a string
        return cached
    started = time.perf_counter()
    config, released, quantization_config, parameters = released_layout(spec, layers, experts, overrides)
    files, index = shard_files(released, max_shard_size or spec.max_shard_size, parameters)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    config.save_pretrained(root)
    raw = json.loads((root / "config.json").read_text())
    raw["architectures"] = [_architecture(config)]
    raw["dtype"] = "bfloat16"
    if quantization_config is not None:
        raw["quantization_config"] = quantization_config
    (root / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    if index is not None:
        (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    patterns = [re.compile(p) for p in fill]
    filled: list[str] = []
    filled_bytes = 0
    total = 0
    for name, header, size, order in files:
        path = root / name
        with open(path, "wb") as f:
            f.write(header)
            f.truncate(size)
        total += size
        chosen = [k for k in order if any(p.search(k) for p in patterns) and not k.endswith("_scale_inv")]
        if not chosen:
            continue
        offsets = _data_offsets(header)
        fd = os.open(path, os.O_WRONLY)
        try:
            for key in chosen:
                for k, value in _fill_values(key, released[key], released, seed).items():
                    begin, end = offsets[k]
                    data = value.contiguous().view(torch.uint8).numpy().tobytes()
                    assert len(data) == end - begin, (k, len(data), end - begin)
                    os.pwrite(fd, data, len(header) + begin)
                    filled.append(k)
                    filled_bytes += len(data)
        finally:
            os.close(fd)
    generated = Generated(
        path=root,
        files=len(files),
        tensors=len(released),
        total_bytes=total,
        filled=filled,
        filled_bytes=filled_bytes,
        parameters=parameters,
        seconds=time.perf_counter() - started,
    )
    record = {k: (str(v) if isinstance(v, Path) else v) for k, v in generated.__dict__.items()}
    marker.write_text(stamp + "\n" + json.dumps(record))
    return generated


def _architecture(config: Any) -> str:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM._model_mapping[type(config)].__name__


def _data_offsets(header: bytes) -> dict[str, tuple[int, int]]:
    n = int.from_bytes(header[:8], "little")
    parsed = json.loads(header[8 : 8 + n])
    return {k: tuple(v["data_offsets"]) for k, v in parsed.items() if k != "__metadata__"}  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------------------
# Measuring


def _cli(args: Sequence[str], timeout: float = 3600) -> tuple[dict[str, Any], float, int]:
    """``hp-fastload`` in a fresh process: (its JSON, wall seconds, peak RSS of the process in bytes).

    The peak is the process's own ``VmHWM`` (its address space's high-water mark), not ``ru_maxrss``: Linux carries
    ``ru_maxrss`` over ``fork`` and ``exec``, so a child of this script reported the script's own peak (2.66 GiB
    after writing the filled tensors of a checkpoint) whenever that was larger than its own."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    code = (
        "import sys\n"
        "from hp_fastload.cli import main\n"
        "status = main(sys.argv[1:])\n"
        "hwm = next(line for line in open('/proc/self/status') if line.startswith('VmHWM:'))\n"
        "sys.stderr.write('\\nPEAK_RSS ' + str(int(hwm.split()[1]) * 1024) + '\\n')\n"
        "sys.exit(status)\n"
    )
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"hp-fastload {' '.join(args)} failed:\n{proc.stderr[-4000:]}")
    peak = int(proc.stderr.rsplit("PEAK_RSS ", 1)[1].split()[0])
    return json.loads(proc.stdout), wall, peak


def timed_preadv(requests: Sequence[tuple[str | Path, int, int]], threads: int, runs: int, reused: bool) -> list[float]:
    """GB/s of ``os.preadv`` of ``requests`` (path, offset, bytes), ``threads`` threads taking every
    ``threads``-th one: each into its own place of one pre-faulted buffer, or (``reused``) into the start of one
    pre-faulted buffer per thread. Two untimed passes (a page's first read zero-fills a hole into the page
    cache; its second moves it to the kernel's active list, a cost per page that the rank's reads paid before
    they were timed too), then ``runs`` timed ones."""
    total = sum(n for _, _, n in requests)
    places = list(itertools.accumulate((n for _, _, n in requests), initial=0))
    size = max((n for _, _, n in requests), default=0) if reused else total
    buffers = [bytearray(size) for _ in range(threads if reused else 1)]
    for b in buffers:
        b[::4096] = b"\x01" * len(b[::4096])

    def run() -> float:
        fds = {p: os.open(p, os.O_RDONLY) for p in {p for p, _, _ in requests}}

        def worker(t: int) -> None:
            view = memoryview(buffers[t if reused else 0])
            for i in range(t, len(requests), threads):
                path, offset, n = requests[i]
                at = 0 if reused else places[i]
                os.preadv(fds[path], [view[at : at + n]], offset)

        pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
        started = time.perf_counter()
        for th in pool:
            th.start()
        for th in pool:
            th.join()
        elapsed = time.perf_counter() - started
        for fd in fds.values():
            os.close(fd)
        return total / elapsed / 1e9

    run()
    run()
    return [run() for _ in range(runs)]


def warm_rows_anchor(
    paths: Iterable[Path], nbytes: int, threads: int, row: int = 64 << 20, runs: int = 3
) -> list[float]:
    """GB/s of ``os.preadv`` of ``nbytes`` in contiguous ``row``-byte rows spread over ``paths``, ``threads``
    threads into one pre-faulted buffer each (``timed_preadv``), ``runs`` times: the files-rows rate the
    per-rank rows kept from before the box anchor."""
    files = [p for p in paths if p.stat().st_size > row]
    jobs: list[tuple[Path, int]] = []
    budget = nbytes
    k = 0
    while budget > 0 and files:
        path = files[k % len(files)]
        size = path.stat().st_size
        offset = ((k // len(files)) * row * 7) % max(1, size - row)
        jobs.append((path, offset - offset % 4096))
        budget -= row
        k += 1
    return timed_preadv([(path, offset, row) for path, offset in jobs], threads, runs, reused=True)


def evict_others(data: Path, keep: Path) -> int:
    """Drops the page-cache pages of every checkpoint under ``data`` but ``keep`` (``POSIX_FADV_DONTNEED``: clean
    pages, no privilege needed); the number of files."""
    count = 0
    for path in data.glob("*/*.safetensors"):
        if path.parent == keep:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        count += 1
    return count


def mem_available() -> int:
    """``MemAvailable`` of /proc/meminfo in bytes (0 where absent)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


#: An item whose box is more runs than this is counted as its byte hull (one span) by ``box_spans``.
MAX_RUNS_PER_ITEM = 1 << 16


def item_runs(base: int, strides: Sequence[int], lengths: Sequence[int]) -> list[tuple[int, int]]:
    """A strided box of a tensor as contiguous element runs ``(start, count)``: trailing dims that continue one
    another (``stride[j] == lengths[j + 1] * stride[j + 1]``, the last with stride 1) make one run, the others
    enumerate the runs; more than ``MAX_RUNS_PER_ITEM`` runs (or no unit stride): the box's hull."""
    dims = [(st, n) for st, n in zip(strides, lengths, strict=True) if n != 1]
    if not dims:
        return [(base, 1)]
    run, k = 1, len(dims)
    while k > 0 and dims[k - 1][0] == run:
        run *= dims[k - 1][1]
        k -= 1
    outer = dims[:k]
    count = 1
    for _, n in outer:
        count *= n
    if run == 1 or count > MAX_RUNS_PER_ITEM:
        last = base + sum(st * (n - 1) for st, n in dims)
        return [(base, last - base + 1)]
    starts = [base]
    for st, n in outer:
        starts = [s0 + i * st for s0 in starts for i in range(n)]
    return [(s0, run) for s0 in starts]


def box_spans(checkpoint: Path, layout: Layout, rank: int) -> list[tuple[str, int, int]]:
    """The file byte spans of every read the rank's plan makes (region items as their contiguous runs, deferred
    groups as whole tensors), merged per file: the same box the rehearsal reads, for the warm-rows anchor. In a
    child process (laying a model out starts a fake process group)."""
    code = (
        "import json, sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "import scale\n"
        "print(json.dumps(scale._box_spans_here(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], "
        "int(sys.argv[6]))))\n"
    )
    mesh = f"{layout.mesh[0]}x{layout.mesh[1]}" if layout.mesh else ""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    args = [str(Path(__file__).resolve().parent), str(checkpoint), layout.layout, layout.world, mesh, rank]
    proc = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)], env=env, capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"box spans of {checkpoint} {layout.label} rank {rank} failed:\n{proc.stderr[-4000:]}")
    return [tuple(x) for x in json.loads(proc.stdout)]


def _box_spans_here(checkpoint: str, layout: str, world: int, mesh: str, rank: int) -> list[tuple[str, int, int]]:
    import hp_fastload as hf
    from hp_fastload.api.ranks import laid_out
    from hp_fastload.planning.jobranks import packed_keys
    from hp_fastload.source.index import CheckpointIndex

    shape = tuple(int(x) for x in mesh.split("x")) if mesh else None
    by_file: dict[str, list[tuple[int, int]]] = {}
    with laid_out(checkpoint, layout, world, shape) as (model, _, location, _):
        plan = hf.plan(model, checkpoint, rank=rank)
        index = CheckpointIndex.open(location)
        packed = packed_keys(plan, index)

        def add(key: str, runs: Iterable[tuple[int, int]]) -> None:
            entry = index.locate(key)
            begin, _ = entry.file.offsets(key)
            spans = by_file.setdefault(str(entry.file.path), [])
            if key in packed:  # MXFP4 blocks: the plan's items count 4-bit codes, two a byte
                spans.extend((begin + start // 2, begin + (start + count + 1) // 2) for start, count in runs)
                return
            size = entry.nbytes // max(1, math.prod(entry.shape))
            spans.extend((begin + start * size, begin + (start + count) * size) for start, count in runs)

        for reads in plan.region_reads.values():
            for item in reads:
                add(item.source, item_runs(item.storage_base, item.storage_strides, item.lengths))
        for group in plan.deferred:
            for key in group.keys:
                add(key, [(0, max(1, math.prod(index.locate(key).shape)))])
    out: list[tuple[str, int, int]] = []
    for path, spans in sorted(by_file.items()):
        spans.sort()
        merged = [list(spans[0])]
        for a, b in spans[1:]:
            if a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        out.extend((path, a, b) for a, b in merged)
    return out


def box_rows_anchor(
    spans: Sequence[tuple[str, int, int]],
    threads: int,
    row: int = 64 << 20,
    runs: int = 3,
    limit: int = 4 << 30,
    reused: bool = False,
) -> list[float]:
    """GB/s of ``os.preadv`` of the rank's own spans (``box_spans``; longer ones in ``row``-byte requests; the
    first ``limit`` bytes of them), ``threads`` threads taking every ``threads``-th request, warm: the same pages
    as the rehearsal's, read as plainly as they can be. Each request lands at its own place in one pre-faulted
    buffer, as a loader's bytes land in the shards (``reused``: into one reused buffer per thread instead, which
    stays in the CPU caches when the requests are a few MiB: a rate no loader writing real shards gets). Two
    untimed passes, then ``runs`` timed ones."""
    requests: list[tuple[str, int, int]] = []
    total = 0
    for path, a, b in spans:
        for k in range(a, b, row):
            n = min(row, b - k, limit - total)
            if n <= 0:
                break
            requests.append((path, k, n))
            total += n
    return timed_preadv(requests, threads, runs, reused)


@dataclass(frozen=True)
class Layout:
    layout: str
    world: int
    mesh: tuple[int, int] | None = None

    @property
    def label(self) -> str:
        mesh = f" {self.mesh[0]}x{self.mesh[1]}" if self.mesh else ""
        return f"{self.layout}{mesh} @{self.world}"

    def args(self) -> list[str]:
        out = ["--layout", self.layout, "--world", str(self.world)]
        if self.mesh:
            out += ["--mesh", f"{self.mesh[0]}x{self.mesh[1]}"]
        return out


def parse_layout(text: str) -> Layout:
    """``fsdp:256``, ``tp+fsdp:1024:128x8``, ``2d:256:32x8``, ``hsdp:1024:8x128``."""
    parts = text.split(":")
    mesh = None
    if len(parts) == 3:
        a, b = parts[2].lower().split("x")
        mesh = (int(a), int(b))
    return Layout(parts[0], int(parts[1]), mesh)


#: The default job sizes: FSDP2 over 256 and 1,024 ranks; TP 8 x FSDP; EP x FSDP (2-D); HSDP.
DEFAULT_LAYOUTS = ("fsdp:256", "fsdp:1024", "tp+fsdp:256:32x8", "2d:256:32x8", "hsdp:1024:8x128")
DEFAULT_JOB_LAYOUTS = ("fsdp:1024",)


def per_rank(
    path: Path, layout: Layout, rank: int, threads: int, device: str = "cpu", repeat: int = 3
) -> dict[str, Any]:
    """One rank rehearsed in fresh processes: the first run brings the rank's bytes into the page cache (a
    sparse file's holes are zero-filled then: its rate is ``first_gbps``), the second reads them again, which
    moves each page to the kernel's active list (a cost per page that only a page's second read pays:
    ``second_gbps``), the next ``repeat`` read them warm, as the warm-rows anchor does; the row is the run of
    median rate (every rate in ``gbps_runs``). A rank whose local shards do not fit in this machine's memory is a
    row with ``skipped`` (the rehearsal refuses it before allocating) rather than the end of the run."""
    args = ["plan", str(path), *layout.args(), "--rank", str(rank), "--execute", "--json", "--threads", str(threads)]
    if device != "cpu":
        args += ["--device", device]
    try:
        first, _, _ = _cli(args)
    except RuntimeError as exc:
        said = next((line for line in str(exc).splitlines() if "allocates its local shards for real" in line), None)
        if said is None:
            raise
        return {"rank": rank, "skipped": said.split("error: ", 1)[-1]}
    second, _, _ = _cli(args)
    runs = [_cli(args) for _ in range(max(1, repeat))]
    rates = [r[0]["gbps"] for r in runs]
    report, wall, peak = sorted(runs, key=lambda r: r[0]["gbps"])[len(runs) // 2]
    report["gbps_runs"] = rates
    report["first_gbps"] = first["gbps"]
    report["second_gbps"] = second["gbps"]
    plan_only, _, _ = _cli(["plan", str(path), *layout.args(), "--rank", str(rank), "--json"])
    report["plan_seconds_cold_process"] = plan_only["ranks"][0]["seconds"]
    report["wall_seconds"] = wall
    report["process_peak_rss"] = peak
    return report


def job(path: Path, layout: Layout, ranks_per_node: int = 8) -> dict[str, Any]:
    report, wall, peak = _cli(["plan", str(path), *layout.args(), "--all-ranks", "--json"], timeout=7200)
    ranks = report["ranks"]
    nodes = []
    for first in range(0, layout.world, ranks_per_node):
        group = ranks[first : first + ranks_per_node]
        nodes.append(sum(r["bytes_needed"] for r in group))
    return {
        "layout": layout.label,
        "world": layout.world,
        "seconds": wall,
        "peak_rss": peak,
        "total_bytes": sum(r["bytes_needed"] for r in ranks),
        "node_bytes_min": min(nodes),
        "node_bytes_max": max(nodes),
        "nodes": len(nodes),
        "plan_seconds_sum": sum(r["seconds"] for r in ranks),
    }


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f}"


def like_for_like(row: dict[str, Any]) -> float:
    """The box's time over the rank's for the same work: the box copying, at its measured rate, the larger of
    the bytes the rank's reads page through (``box_bytes``: a cut along a tensor's inner dim, as EP x FSDP cuts
    gpt-oss's transposed experts, takes a few bytes of every row, and storage and the page cache deal in
    whole pages) and the bytes the rank writes (``local_bytes``: a dequantizing rank writes 2-4x what it
    reads). For a bf16 rank reading whole rows both are its read bytes, and this is "x box rows"."""
    if not row.get("anchor_gbps") or not row.get("read_seconds"):
        return float("nan")
    work = max(row.get("box_bytes", 0), row["local_bytes"])
    return work / 1e9 / row["anchor_gbps"] / row["read_seconds"]


def time_to_loaded(row: dict[str, Any]) -> None:
    """The rank's time to loaded (its rehearsal's critical path, the planning hidden behind reads not in it) and
    the box's raw read of the same bytes (``box_bytes``, at least the bytes read, at the box rows' median
    rate), into ``row``."""
    path = row["critical_path"]
    row["loaded_seconds"] = sum(v for k, v in path.items() if k != "planning_hidden")
    box = max(row.get("box_bytes", 0), row["bytes_read"])
    row["box_read_seconds"] = box / 1e9 / row["anchor_gbps"] if row.get("anchor_gbps") else float("nan")
    row["loaded_over_box_read"] = row["loaded_seconds"] / row["box_read_seconds"]


def loaded_table(result: dict[str, Any]) -> list[str]:
    lines = ["", "### Time to loaded (the rehearsed rank's critical path) against the box's raw read", ""]
    lines += [
        "| model | layout | rank | index s | planning s | hidden s | reading s | finishing s | loaded s "
        "| box raw read s | x box raw read |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["per_rank"]:
        if "loaded_seconds" not in row:
            continue
        path = row["critical_path"]
        lines.append(
            f"| {row['model']} | {row['layout_label']} | {row['rank']} | {path['index']:.3f} | "
            f"{path['planning']:.3f} | {path.get('planning_hidden', 0.0):.3f} | {path['reading']:.3f} | "
            f"{path['finishing']:.3f} | {row['loaded_seconds']:.3f} | {row['box_read_seconds']:.3f} | "
            f"{row['loaded_over_box_read']:.2f} |"
        )
    return lines


def tables(result: dict[str, Any]) -> str:
    lines = ["### Per rank (one rank rehearsed: local shards allocated, its reads executed; warm)", ""]
    lines += [
        "| model | layout | rank | plan s | read GB | read s | GB/s | box rows GB/s | x box rows | files rows GB/s "
        "| local GB | written GB/s | x box rows, written | x box, like for like | RSS - local GiB | fds "
        "| first, second run GB/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["per_rank"]:
        if "skipped" in row:
            lines.append(f"| {row['model']} | {row['layout_label']} | {row['rank']} | {row['skipped']} |")
            continue
        ratio = row["gbps"] / row["anchor_gbps"] if row.get("anchor_gbps") else float("nan")
        # A dequantizing rank writes more bytes than it reads (bf16 from FP8: 2x; from MXFP4: 4x), the box's
        # copy as many as it reads: the written rate is the like-for-like one for those rows.
        written = row["local_bytes"] / row["read_seconds"] / 1e9 if row["read_seconds"] else float("nan")
        written_ratio = written / row["anchor_gbps"] if row.get("anchor_gbps") else float("nan")
        like = like_for_like(row)
        nan = float("nan")
        lines.append(
            f"| {row['model']} | {row['layout_label']} | {row['rank']} | {row['plan_seconds']:.3f} | "
            f"{_gb(row['bytes_read'])} | {row['read_seconds']:.2f} | {row['gbps']:.2f} | "
            f"{row.get('anchor_gbps', nan):.2f} | {ratio:.2f} | {row.get('files_rows_gbps', nan):.2f} | "
            f"{_gb(row['local_bytes'])} | {written:.2f} | {written_ratio:.2f} | {like:.2f} | "
            f"{row['rss_over_local'] / 2**30:+.2f} | {row['peak_fds']} "
            f"(threads {row['threads']}) | {row.get('first_gbps', nan):.2f}, {row.get('second_gbps', nan):.2f} |"
        )
    lines += loaded_table(result)
    lines += ["", "### Job (`--all-ranks`: every rank planned in one process)", ""]
    lines += [
        "| model | layout | ranks | wall s | peak RSS GiB | total storage GB | per node GB (min-max) | checkpoint GB |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["jobs"]:
        lines.append(
            f"| {row['model']} | {row['layout']} | {row['world']} | {row['seconds']:.1f} | "
            f"{row['peak_rss'] / 2**30:.2f} | {_gb(row['total_bytes'])} | {_gb(row['node_bytes_min'])}-"
            f"{_gb(row['node_bytes_max'])} | {_gb(row['checkpoint_bytes'])} |"
        )
    return "\n".join(lines) + "\n"


DEFAULT_FILL = (
    r"^model\.layers\.0\.self_attn\.",  # the first layer's attention
    r"^model\.norm\.",
    r"\.layers\.\d+\.(input|post_attention)_layernorm\.",
    # MXFP4 exponents: holes read as byte 0 (2^-127), which sends every tile to the wide decode; real
    # checkpoints' scales are near 2^0 (1/16 of the codes' bytes: 3.6 GB for gpt-oss-120b)
    r"\.experts\.\w+_scales$",
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument("--layouts", default=",".join(DEFAULT_LAYOUTS), help="per-rank layouts, e.g. fsdp:256")
    parser.add_argument("--job-layouts", default=",".join(DEFAULT_JOB_LAYOUTS), help="--all-ranks layouts ('' none)")
    parser.add_argument("--ranks", default="5", help="comma-separated ranks to rehearse per layout")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--repeat", type=int, default=3, help="warm fresh-process rehearsals per rank (the median is reported)"
    )
    parser.add_argument("--layers", type=int, default=None, help="reduced scale: this many layers (real widths)")
    parser.add_argument("--experts", type=int, default=None, help="reduced scale: this many experts")
    parser.add_argument("--fill", default=None, help="comma-separated key regexes to fill (default: layer 0, norms)")
    parser.add_argument("--out", default=str(ROOT / "bench-out" / "scale"))
    parser.add_argument("--generate-only", action="store_true")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fill = tuple(args.fill.split(",")) if args.fill else DEFAULT_FILL
    from hp_fastload.support import info

    result: dict[str, Any] = {"per_rank": [], "jobs": [], "generated": {}, "threads": args.threads, "info": info()}
    results_path = out / "scale.json"
    for name in args.models.split(","):
        spec = MODELS[name]
        gen = write_checkpoint(out / "data" / name, spec, layers=args.layers, experts=args.experts, fill=fill)
        result["generated"][name] = {k: v for k, v in gen.__dict__.items() if k not in ("filled", "path")}
        print(
            f"{name}: {gen.tensors:,} tensors in {gen.files} files, {gen.total_bytes / 1e9:,.1f} GB "
            f"({gen.parameters / 1e9:,.1f} B parameters), {gen.filled_bytes / 1e9:.2f} GB filled; "
            f"{gen.seconds:.1f} s",
            flush=True,
        )
        if args.generate_only:
            continue
        shards = sorted(gen.path.glob("*.safetensors"))
        # the other models' cached pages would put this model's rows under reclaim (a full page cache made the
        # same rank read at half its rate): only this checkpoint is left cached, and memory is reported
        result["generated"][name]["evicted_other_files"] = evict_others(out / "data", gen.path)
        result["generated"][name]["mem_available_before"] = mem_available()
        for text in filter(None, args.layouts.split(",")):
            layout = parse_layout(text)
            for rank in (int(r) for r in args.ranks.split(",")):
                row = per_rank(gen.path, layout, rank % layout.world, args.threads, args.device, args.repeat)
                row.update(model=name, layout_label=layout.label)
                result["per_rank"].append(row)
                if "skipped" in row:
                    print(f"  {layout.label} rank {row['rank']}: skipped: {row['skipped']}", flush=True)
                    continue
                spans = box_spans(gen.path, layout, rank % layout.world)
                row["box_bytes"] = sum(b - a for _, a, b in spans)
                row["box_spans"] = len(spans)
                anchors = box_rows_anchor(spans, args.threads, runs=3)
                row["anchor_gbps_runs"] = anchors
                row["anchor_gbps"] = sorted(anchors)[len(anchors) // 2]
                reused = box_rows_anchor(spans, args.threads, runs=3, reused=True)
                row["box_rows_reused_gbps"] = sorted(reused)[len(reused) // 2]
                rows_elsewhere = warm_rows_anchor(shards, min(row["bytes_read"], 4 << 30), args.threads, runs=3)
                row["files_rows_gbps"] = sorted(rows_elsewhere)[len(rows_elsewhere) // 2]
                time_to_loaded(row)
                print(
                    f"  {layout.label} rank {row['rank']}: plan {row['plan_seconds']:.3f} s, "
                    f"{row['bytes_read'] / 1e9:.2f} GB at {row['gbps']:.2f} GB/s "
                    f"(box rows {row['anchor_gbps']:.2f}), RSS-local {row['rss_over_local'] / 2**30:+.2f} GiB, "
                    f"fds {row['peak_fds']}; loaded in {row['loaded_seconds']:.3f} s = "
                    f"{row['loaded_over_box_read']:.2f}x the box's raw read",
                    flush=True,
                )
                results_path.write_text(json.dumps(result, indent=2, default=str))
        for text in filter(None, args.job_layouts.split(",")):
            layout = parse_layout(text)
            row = job(gen.path, layout)
            row.update(model=name, checkpoint_bytes=gen.total_bytes)
            result["jobs"].append(row)
            print(
                f"  job {layout.label}: {row['seconds']:.1f} s, peak RSS {row['peak_rss'] / 2**30:.2f} GiB, "
                f"total {row['total_bytes'] / 1e9:,.1f} GB",
                flush=True,
            )
            results_path.write_text(json.dumps(result, indent=2, default=str))
    results_path.write_text(json.dumps(result, indent=2, default=str))
    if not args.generate_only:
        text = tables(result)
        (out / "scale.md").write_text(text)
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
