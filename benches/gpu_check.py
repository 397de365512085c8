"""One-command GPU check: H2D ceilings, then a synthetic checkpoint loaded cold and warm into CUDA parameters.

    python benches/gpu_check.py                  # ~16 GB checkpoint, CUDA when present (budget: 8 minutes)
    python benches/gpu_check.py --quick          # tiny; falls back to the CPU when CUDA is absent (tested in CI)

Needs only torch, numpy and hp_fastload from the repo build (no package registry on the GPU machine);
safetensors, fastsafetensors and runai-model-streamer are measured when they import. The checkpoint is
written by hand in the safetensors format (no safetensors package needed).

Steps: preflight (kernel, PCIe link, read_ahead_kb, RAM, disk); H2D ceilings (pinned and pageable, CUDA
events); a Llama-3-8B-shaped bf16 checkpoint (``--size-gb``, default 16, 4 shards; per-tensor checksums
computed at generation); the storage anchors (sequential and parallel cold buffered reads, 0 resident pages
checked with mincore first); then every loader in a fresh process, cold (``posix_fadvise(DONTNEED)`` per file,
0 resident pages verified) and warm, filling plain CUDA tensors (hp_fastload stages CUDA targets through
pinned buffers), each checked against the generation checksums. ``hp_fastload_fp8`` loads the same model
shapes (``--fp8-gb``) from an FP8 checkpoint (e4m3 weights, fp32 128x128 ``weight_scale_inv``) into bf16 CUDA
tensors, dequantized in the engine's copy into the pinned staging, each tensor checked against DeepSeek's
``weight_dequant`` formula computed with torch. ``hp_fastload_mxfp4`` loads gpt-oss-shaped MXFP4 experts
(``--mxfp4-gb``; uint8 ``*_blocks`` of e2m1 pairs and e8m0 ``*_scales``) into bf16 CUDA tensors of transformers'
transposed layout, dequantized by the engine on the region path, each checked against the MXFP4 formula written
with torch (e2m1 table times ``2^(e - 127)``, as ``convert_moe_packed_tensors`` and its transpose).
Prints GB/s and fractions of the ceilings: warm results against the pinned H2D ceiling, cold results against
the parallel cold-read anchor.
Writes ``<out>/gpu_check.json`` and ``<out>/gpu_check.md`` (``<out>``: ``$OUT`` when set, else bench-out/gpu).

On a machine without CUDA everything runs with ``device cpu``: the "H2D" ceilings become host memcpy
(pageable; pinned memory needs CUDA) and the targets are CPU tensors.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import _peers  # noqa: E402  (stdlib-only helpers: mincore, evict, warm, /proc/self/io, cold reads)

LOADERS = (
    "hp_fastload",
    "hp_fastload_r8",
    "hp_fastload_fp8",
    "hp_fastload_mxfp4",
    "st_cuda",
    "st_mmap_copy",
    "fastsafetensors",
    "runai",
)
#: the loaders that read a quantized twin of the checkpoint (its folder suffix)
QUANTIZED = {"hp_fastload_fp8": "_fp8", "hp_fastload_mxfp4": "_mxfp4"}

# ---------------------------------------------------------------------------------------------------------
# Checkpoint: Llama-3-8B shapes, written by hand in the safetensors format


def llama8b_keys(size_gb: float, quick: bool) -> list[tuple[str, tuple[int, ...]]]:
    if quick:
        h, inter, q, kv, vocab = 512, 1024, 512, 128, 2048
    else:
        h, inter, q, kv, vocab = 4096, 14336, 4096, 1024, 128256
    per_layer = 2 * (2 * h * q + 2 * h * kv + 3 * h * inter + 2 * h)
    layers = max(1, round((size_gb * 1e9 - 4 * vocab * h) / per_layer))
    return _peers.llama_keys(h, q, kv, inter, vocab, layers)


def checksum(t: Any) -> list[int]:
    """Two int64 sums of a bf16 tensor's bits (plain, and position-weighted on a stride): catches misplacement."""
    import torch

    bits = t.reshape(-1).view(torch.int16)
    plain = int(bits.to(torch.int64).sum())
    sub = bits[::97].to(torch.int64)
    weighted = int((sub * torch.arange(1, sub.numel() + 1, device=sub.device, dtype=torch.int64) % 1000003).sum())
    return [plain, weighted]


def _cached(meta_path: Path, stamp: str) -> dict[str, Any] | None:
    """The checksums of a checkpoint written earlier with the same ``stamp``, or None."""
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("stamp") == stamp:
            return dict(meta["files"], _cached=True)
    return None


def _cached_or_fresh(path: Path, meta_path: Path, stamp: str) -> dict[str, Any] | None:
    """The checkpoint written earlier with this ``stamp``, or None with ``path`` made empty for a new one."""
    cached = _cached(meta_path, stamp)
    if cached is None:
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
    return cached


def _write_shards(
    path: Path, entries: list[tuple[str, tuple[int, ...], str]], sizes: list[int], shards: int, data: Any
) -> tuple[dict[str, list[str]], dict[str, str]]:
    """``entries`` ``(key, shape, safetensors dtype)`` of ``sizes`` bytes written into about ``shards``
    safetensors files, one header each; ``data(key, shape, dtype)`` gives a tensor's bytes (a CPU tensor).
    Returns each file's keys and the weight map."""
    files: dict[str, list[str]] = {}
    weight_map: dict[str, str] = {}
    groups = _peers.shard_groups(sizes, shards)
    for g, idx in enumerate(groups):
        name = f"model-{g + 1:05d}-of-{len(groups):05d}.safetensors"
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        off = 0
        for i in idx:
            key, shape, dt = entries[i]
            header[key] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + sizes[i]]}
            off += sizes[i]
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(path / name, "wb") as f:
            f.write(len(raw).to_bytes(8, "little"))
            f.write(raw)
            for i in idx:
                f.write(memoryview(data(*entries[i]).contiguous().numpy()).cast("B"))
                weight_map[entries[i][0]] = name
            f.flush()
            os.fsync(f.fileno())
        files[name] = [entries[i][0] for i in idx]
    return files, weight_map


def write_checkpoint(path: Path, keys: list[tuple[str, tuple[int, ...]]], shards: int, device: str) -> dict[str, Any]:
    """Random bf16 (finite) tensors; generated on ``device`` (fast on a GPU), written with one header per file."""
    stamp = json.dumps({"keys": len(keys), "shape0": keys[0][1], "shards": shards, "v": 1})
    meta_path = path / "checksums.json"
    cached = _cached_or_fresh(path, meta_path, stamp)
    if cached is not None:
        return cached
    import torch

    sizes = [math.prod(s) * 2 for _, s in keys]
    gen = torch.Generator(device=device).manual_seed(0)
    sums: dict[str, list[int]] = {}

    def data(key: str, shape: tuple[int, ...], _: str) -> Any:
        bits = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, device=device, generator=gen) & ~0x4000
        sums[key] = checksum(bits.view(torch.bfloat16))
        return bits.cpu()

    files, weight_map = _write_shards(path, [(k, sh, "BF16") for k, sh in keys], sizes, shards, data)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    out = {"sums": sums, "shapes": {k: list(s) for k, s in keys}, "files": files}
    meta_path.write_text(json.dumps({"stamp": stamp, "files": out}))
    return out


def write_fp8_checkpoint(path: Path, keys: list[tuple[str, tuple[int, ...]]], shards: int) -> dict[str, Any]:
    """The same model as FP8 (issue 13): every 2-d projection an F8_E4M3 weight with an F32
    ``weight_scale_inv`` per 128x128 block (ceil-sized grid), embeddings and norms BF16, and the
    ``quantization_config`` DeepSeek-V3 ships; ``shapes`` lists the model tensors (not the scales)."""
    stamp = json.dumps({"keys": len(keys), "shape0": keys[0][1], "shards": shards, "v": "fp8-1"})
    meta_path = path / "checksums.json"
    cached = _cached_or_fresh(path, meta_path, stamp)
    if cached is not None:
        return cached
    import torch

    entries: list[tuple[str, tuple[int, ...], str]] = []
    for key, shape in keys:
        if len(shape) == 2 and "embed" not in key and "lm_head" not in key:
            entries.append((key, shape, "F8_E4M3"))
            entries.append((key + "_scale_inv", (-(-shape[0] // 128), -(-shape[1] // 128)), "F32"))
        else:
            entries.append((key, shape, "BF16"))
    size = {"F8_E4M3": 1, "BF16": 2, "F32": 4}
    sizes = [math.prod(sh) * size[d] for _, sh, d in entries]
    gen = torch.Generator().manual_seed(0)

    def data(key: str, shape: tuple[int, ...], dt: str) -> Any:
        if dt == "F8_E4M3":
            t = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
            t[(t & 0x7F) == 0x7F] = 0  # no NaN codes
            return t
        if dt == "F32":
            return torch.rand(shape, generator=gen) * 1e-2 + 1e-4
        return torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=gen) & ~0x4000

    files, _ = _write_shards(path, entries, sizes, shards, data)
    config = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}
    (path / "config.json").write_text(json.dumps(config))
    out = {"sums": {}, "shapes": {k: list(sh) for k, sh in keys}, "files": files, "fp8": True}
    meta_path.write_text(json.dumps({"stamp": stamp, "files": out}))
    return out


def moe_mxfp4_keys(size_gb: float, quick: bool) -> list[tuple[str, tuple[int, ...]]]:
    """gpt-oss-20b's expert tensors (32 experts, hidden and intermediate 2880) as the bf16 model holds them
    (``gate_up_proj`` ``[E, hidden, 2 * inter]``, ``down_proj`` ``[E, inter, hidden]``), layers enough for
    ``size_gb`` of bf16 output; tiny for ``quick``."""
    e, h, inter = (4, 256, 256) if quick else (32, 2880, 2880)
    per_layer = 2 * e * (h * 2 * inter + inter * h)
    layers = 2 if quick else max(1, round(size_gb * 1e9 / per_layer))
    out: list[tuple[str, tuple[int, ...]]] = []
    for i in range(layers):
        out.append((f"model.layers.{i}.mlp.experts.gate_up_proj", (e, h, 2 * inter)))
        out.append((f"model.layers.{i}.mlp.experts.down_proj", (e, inter, h)))
    return out


def write_mxfp4_checkpoint(path: Path, keys: list[tuple[str, tuple[int, ...]]], shards: int) -> dict[str, Any]:
    """The experts as gpt-oss ships them: for a model tensor ``X`` of ``[E, A, B]``, ``X_blocks`` uint8
    ``[E, B, A / 32, 16]`` (random e2m1 pairs) and ``X_scales`` uint8 ``[E, B, A / 32]`` (e8m0 exponents
    120..134), with an MXFP4 ``quantization_config``; ``shapes`` lists the model tensors."""
    stamp = json.dumps({"keys": len(keys), "shape0": keys[0][1], "shards": shards, "v": "mxfp4-1"})
    meta_path = path / "checksums.json"
    cached = _cached_or_fresh(path, meta_path, stamp)
    if cached is not None:
        return cached
    import torch

    entries: list[tuple[str, tuple[int, ...], str]] = []
    for key, (e, a, b) in keys:
        entries.append((key + "_blocks", (e, b, a // 32, 16), "U8"))
        entries.append((key + "_scales", (e, b, a // 32), "U8"))
    sizes = [math.prod(sh) for _, sh, _ in entries]
    gen = torch.Generator().manual_seed(0)

    def data(key: str, shape: tuple[int, ...], _: str) -> Any:
        if key.endswith("_blocks"):
            return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
        return torch.randint(0, 15, shape, dtype=torch.uint8, generator=gen) + 120

    files, _ = _write_shards(path, entries, sizes, shards, data)
    (path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "mxfp4"}}))
    out = {"sums": {}, "shapes": {k: list(sh) for k, sh in keys}, "files": files, "mxfp4": True}
    meta_path.write_text(json.dumps({"stamp": stamp, "files": out}))
    return out


def _mxfp4_reference(ckpt: Path, meta: dict[str, Any], key: str) -> Any:
    """The MXFP4 formula with torch ops: each nibble (low first) through the e2m1 table, times
    ``2^(e - 127)`` of its group of 32, groups joined, dims 1 and 2 swapped, rounded once to bf16."""
    import torch

    blocks, _ = _read_whole(ckpt, meta, key + "_blocks")
    scales, _ = _read_whole(ckpt, meta, key + "_scales")
    lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    values = torch.stack([lut[(blocks & 15).long()], lut[(blocks >> 4).long()]], dim=-1).flatten(-2)
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.flatten(-2).transpose(1, 2).to(torch.bfloat16)


def _read_whole(ckpt: Path, meta: dict[str, Any], key: str) -> Any:
    """A whole tensor read with plain file I/O (no loader involved), as stored (uint8 for F8_E4M3)."""
    import torch

    name = next(n for n, ks in meta["files"].items() if key in ks)
    with open(ckpt / name, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        entry = json.loads(f.read(n))[key]
        a, b = entry["data_offsets"]
        f.seek(8 + n + a)
        data = bytearray(f.read(b - a))
    dtype = {"F8_E4M3": torch.uint8, "U8": torch.uint8, "F32": torch.float32, "BF16": torch.bfloat16}[entry["dtype"]]
    return torch.frombuffer(data, dtype=dtype).reshape(entry["shape"]), entry["dtype"]


def _fp8_reference(ckpt: Path, meta: dict[str, Any], key: str) -> Any:
    """DeepSeek's ``weight_dequant`` with torch ops (fp32 product, rounded once to bf16)."""
    import torch

    t, dtype = _read_whole(ckpt, meta, key)
    if dtype != "F8_E4M3":
        return t
    s, _ = _read_whole(ckpt, meta, key + "_scale_inv")
    s = s.repeat_interleave(128, 0)[: t.shape[0]].repeat_interleave(128, 1)[:, : t.shape[1]]
    return (t.view(torch.float8_e4m3fn).float() * s).to(torch.bfloat16)


# ---------------------------------------------------------------------------------------------------------
# Ceilings


def h2d_ceilings(device: str, nbytes: int, repeats: int = 3) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"bytes": nbytes}
    if device == "cpu":
        out["pageable_gbps"] = _peers.memcpy_gbps(nbytes, 1, repeats)
        out["pageable_2t_gbps"] = _peers.memcpy_gbps(nbytes, _peers.CORES, repeats)
        out["pinned_gbps"] = None
        out["note"] = "no CUDA: host memcpy stands in for H2D; pinned memory needs CUDA"
        return out
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for kind in ("pinned", "pageable"):
        src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=kind == "pinned")
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=kind == "pinned")
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        out[f"{kind}_gbps"] = nbytes / statistics.median(times) / 1e9
        del src
    return out


def preflight() -> dict[str, Any]:
    info: dict[str, Any] = {
        "kernel": platform.release(),
        "python": platform.python_version(),
        "cores": _peers.CORES,
        "read_ahead_kb": _peers.read_ahead_kb(),
    }
    try:
        with open("/proc/meminfo") as f:
            info["meminfo_gib"] = {
                line.split(":")[0]: int(line.split()[1]) / 2**20
                for line in f
                if line.startswith(("MemTotal", "MemAvailable"))
            }
    except OSError:
        pass
    if shutil.which("nvidia-smi"):
        try:
            q = "name,pcie.link.gen.current,pcie.link.width.current,memory.total"
            info["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError) as exc:
            info["nvidia_smi"] = f"failed: {exc}"
    with (
        open("/proc/sys/kernel/io_uring_disabled")
        if os.path.exists("/proc/sys/kernel/io_uring_disabled")
        else open(os.devnull) as f
    ):
        info["io_uring_disabled"] = f.read().strip()
    return info


# ---------------------------------------------------------------------------------------------------------
# Loaders (each in a fresh process: ``--child``)


class _Tree:
    """An nn.Module tree whose parameter names are the checkpoint keys."""

    @staticmethod
    def build(shapes: dict[str, list[int]], device: str, make: Any) -> Any:
        import torch

        root = torch.nn.Module()
        for key, shape in shapes.items():
            *path, leaf = key.split(".")
            mod = root
            for part in path:
                if not hasattr(mod, part):
                    mod.add_module(part, torch.nn.Module())
                mod = getattr(mod, part)
            mod.register_parameter(leaf, torch.nn.Parameter(make(key, shape), requires_grad=False))
        return root


def _child(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    ckpt, loader, regime, device = Path(cfg["ckpt"]), cfg["loader"], cfg["regime"], cfg["device"]
    meta = json.loads((ckpt / "checksums.json").read_text())["files"]
    shapes: dict[str, list[int]] = meta["shapes"]
    files = sorted(str(ckpt / n) for n in meta["files"])
    if device.startswith("cuda"):
        torch.cuda.init()
        torch.empty(1, device=device)
    world, rank = (8, 3) if loader == "hp_fastload_r8" else (1, 0)
    params: dict[str, Any] = {}
    boxes: dict[str, tuple[int | None, int]] = {}  # key -> (sharded dim, local length)
    mesh = None
    if world > 1:
        mesh = _peers.fake_world(world, rank)
    for key, shape in shapes.items():
        dim = _peers.placement_dim(key, len(shape), "tp") if world > 1 else None
        local = list(shape)
        if dim is not None:
            local[dim] //= world
        params[key] = torch.zeros(local, dtype=torch.bfloat16, device=device)
        boxes[key] = (dim, local[dim] if dim is not None else 0)
    needed = sum(t.numel() * 2 for t in params.values())
    if regime == "cold":
        left = _peers.evict(files)
        state: dict[str, Any] = {"resident_pages_before": left, "cold_verified": left == 0}
    else:
        state = {"resident_fraction_before": _peers.residency(files)}
    model = None
    extra: dict[str, Any] = {}
    if loader.startswith("hp_fastload"):
        # hp_fastload.load imports transformers on its first call (to test for a PreTrainedModel), even for a
        # plain module; timed separately here (a library hot spot reported in docs/benchmarks.md).
        t = time.perf_counter()
        with contextlib.suppress(ImportError):
            import transformers  # noqa: F401
        extra["import_transformers_seconds"] = time.perf_counter() - t

        def make(key: str, shape: list[int]) -> Any:
            t = params[key]
            dim = boxes[key][0]
            return _peers.as_dtensor(t, mesh, dim, tuple(shape)) if mesh is not None else t

        model = _Tree.build(shapes, device, make)
    io0, cpu0 = _peers.io_read_bytes(), _peers.cpu_seconds()
    t0 = time.perf_counter()
    if loader.startswith("hp_fastload"):
        import hp_fastload

        report = hp_fastload.load(model, str(ckpt), loader="dcp", strict=True, progress=False)
        extra["hp_bytes_read"] = report.bytes_read
    elif loader == "st_cuda":
        from safetensors import safe_open

        for p in files:
            with safe_open(p, "pt", device=device) as f:
                for k in f.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                    params[k].copy_(f.get_tensor(k))
    elif loader == "st_mmap_copy":
        from safetensors import safe_open

        for p in files:
            with safe_open(p, "pt") as f:
                for k in f.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                    params[k].copy_(f.get_tensor(k))  # pageable H2D from the mmap (vLLM default pattern)
    elif loader == "fastsafetensors":
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup

        fl = SafeTensorsFileLoader(SingleGroup(), device=device, nogds=True, max_threads=min(16, _peers.CORES))
        fl.add_filenames({0: files})
        fb = fl.copy_files_to_device()
        for k in shapes:
            params[k].copy_(fb.get_tensor(k))
        fb.close()
        fl.close()
    elif loader == "runai":
        from runai_model_streamer import SafetensorsStreamer

        with SafetensorsStreamer() as s:
            s.stream_files(files, device=device) if device != "cpu" else s.stream_files(files)
            for k, t in s.get_tensors():
                params[k].copy_(t)
    else:
        raise ValueError(loader)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    result = dict(
        state,
        loader=loader,
        regime=regime,
        device=device,
        seconds=wall,
        needed_bytes=needed,
        gbps=needed / wall / 1e9,
        storage_read_bytes=_peers.io_read_bytes() - io0,
        cpu_seconds=_peers.cpu_seconds() - cpu0,
        peak_host_rss_bytes=_peers.peak_rss(),
        **extra,
    )
    if device.startswith("cuda"):
        result["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
    # correctness: whole tensors against the generation checksums; slices bitwise against a file read
    bad: list[str] = []
    for key, t in params.items():
        dim, n = boxes[key]
        if meta.get("fp8"):
            if not torch.equal(t.cpu(), _fp8_reference(ckpt, meta, key)):
                bad.append(key)
        elif meta.get("mxfp4"):
            if not torch.equal(t.cpu(), _mxfp4_reference(ckpt, meta, key)):
                bad.append(key)
        elif dim is None:
            if checksum(t) != meta["sums"][key]:
                bad.append(key)
        else:
            ref = _read_slice(ckpt, meta, key, dim, rank * n, n)
            if not torch.equal(t.cpu().view(torch.int16), ref.view(torch.int16)):
                bad.append(key)
    result["verify"] = {"checked": len(params), "mismatched": len(bad), "bad": bad[:5]}
    return result


def _read_slice(ckpt: Path, meta: dict[str, Any], key: str, dim: int, start: int, n: int) -> Any:
    """A reference slice read with plain file I/O (no loader involved)."""
    import torch

    name = next(f for f, ks in meta["files"].items() if key in ks)
    with open(ckpt / name, "rb") as f:
        hlen = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(hlen))
        a, b = header[key]["data_offsets"]
        f.seek(8 + hlen + a)
        buf = bytearray(f.read(b - a))
    full = torch.frombuffer(buf, dtype=torch.int16).view(torch.bfloat16).reshape(header[key]["shape"])
    return full.narrow(dim, start, n).contiguous()


def _available(loader: str, device: str) -> str | None:
    """None when the loader can run here, else why not."""
    import importlib.util

    need = {
        "st_cuda": "safetensors",
        "st_mmap_copy": "safetensors",
        "fastsafetensors": "fastsafetensors",
        "runai": "runai_model_streamer",
    }
    mod = need.get(loader)
    if mod and importlib.util.find_spec(mod) is None:
        return f"{mod} not importable"
    if loader == "st_cuda" and device == "cpu":
        return "same as st_mmap_copy on the CPU"
    return None


# ---------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny checkpoint (~40 MB), 1 GiB -> 32 MiB ceilings")
    ap.add_argument("--size-gb", type=float, default=16.0)
    ap.add_argument("--device", default="auto", help="auto (cuda when available), cuda, cuda:N or cpu")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench-out" / "gpu"))
    ap.add_argument("--data", default=None, help="checkpoint folder (default /tmp/hp_gpu_check[_quick])")
    ap.add_argument("--loaders", default=",".join(LOADERS))
    ap.add_argument("--regimes", default="cold,warm")
    ap.add_argument("--budget-s", type=float, default=450.0, help="skip remaining loads past this (default 450)")
    ap.add_argument("--keep-data", action="store_true", help="keep the checkpoint afterwards")
    ap.add_argument("--fp8-gb", type=float, default=4.0, help="bf16-equivalent size of the FP8 model (default 4)")
    ap.add_argument("--mxfp4-gb", type=float, default=4.0, help="bf16 output size of the MXFP4 experts (default 4)")
    ap.add_argument(
        "--scale",
        default="deepseek-v3:fsdp:256:5",
        help="full-scale one-rank rehearsal into CUDA (benches/scale.py's sparse release layout): MODEL:LAYOUT:WORLD:"
        "RANK, '' to skip (default deepseek-v3:fsdp:256:5; skipped without CUDA or transformers)",
    )
    ap.add_argument("--staging-mib", type=int, default=512, help="pinned staging budget of the rehearsal (MiB)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        cfg = json.loads(args.child)
        try:
            res = _child(cfg)
        except Exception as exc:
            import traceback

            res = {
                "loader": cfg["loader"],
                "regime": cfg["regime"],
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()[-2000:],
            }
        print("RESULT " + json.dumps(res))
        return 0

    started = time.perf_counter()
    import torch

    device = args.device
    if device == "auto":
        device = "cuda:0" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        device = "cuda:0"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = Path(args.data or f"/tmp/hp_gpu_check{'_quick' if args.quick else ''}")
    size = 0.04 if args.quick else args.size_gb
    log: dict[str, Any] = {"device": device, "torch": torch.__version__, "preflight": preflight()}
    if device.startswith("cuda"):
        log["gpu"] = torch.cuda.get_device_name(device)
    print(f"device {device}; preflight {json.dumps(log['preflight'])}", flush=True)
    log["ceilings"] = h2d_ceilings(device, (32 << 20) if args.quick else (4 << 30))
    print(f"ceilings {json.dumps(log['ceilings'])}", flush=True)
    t = time.perf_counter()
    meta = write_checkpoint(data, llama8b_keys(size, args.quick), 2 if args.quick else 4, device)
    files = sorted(str(data / n) for n in meta["files"])
    total = sum(os.path.getsize(p) for p in files)
    log["checkpoint"] = {
        "path": str(data),
        "bytes": total,
        "files": len(files),
        "write_seconds": time.perf_counter() - t,
        "cached": bool(meta.get("_cached")),
    }
    print(f"checkpoint {json.dumps(log['checkpoint'])}", flush=True)
    log["storage"] = {
        "cold_seq": _peers.cold_read_gbps(files, 1),
        "cold_par": _peers.cold_read_gbps(files, min(16, max(2, _peers.CORES))),
    }
    seq_gbps, par_gbps = log["storage"]["cold_seq"]["gbps"], log["storage"]["cold_par"]["gbps"]
    print(f"storage: cold sequential {seq_gbps:.2f} GB/s, parallel {par_gbps:.2f} GB/s", flush=True)
    _peers.warm(files)
    fp8_data = data.parent / (data.name + "_fp8")
    fp8_files: list[str] = []
    if "hp_fastload_fp8" in args.loaders.split(","):
        t = time.perf_counter()
        fmeta = write_fp8_checkpoint(fp8_data, llama8b_keys(min(size, args.fp8_gb), args.quick), 2 if args.quick else 4)
        fp8_files = sorted(str(fp8_data / n) for n in fmeta["files"])
        log["fp8_checkpoint"] = {
            "path": str(fp8_data),
            "bytes": sum(os.path.getsize(p) for p in fp8_files),
            "write_seconds": time.perf_counter() - t,
        }
        print(f"fp8 checkpoint {json.dumps(log['fp8_checkpoint'])}", flush=True)
    mxfp4_data = data.parent / (data.name + "_mxfp4")
    mxfp4_files: list[str] = []
    if "hp_fastload_mxfp4" in args.loaders.split(","):
        t = time.perf_counter()
        mkeys = moe_mxfp4_keys(min(size, args.mxfp4_gb), args.quick)
        mmeta = write_mxfp4_checkpoint(mxfp4_data, mkeys, 2 if args.quick else 4)
        mxfp4_files = sorted(str(mxfp4_data / n) for n in mmeta["files"])
        log["mxfp4_checkpoint"] = {
            "path": str(mxfp4_data),
            "bytes": sum(os.path.getsize(p) for p in mxfp4_files),
            "write_seconds": time.perf_counter() - t,
        }
        print(f"mxfp4 checkpoint {json.dumps(log['mxfp4_checkpoint'])}", flush=True)
    own_files = {"hp_fastload_fp8": fp8_files, "hp_fastload_mxfp4": mxfp4_files}
    results: list[dict[str, Any]] = []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    for regime in [r for r in args.regimes.split(",") if r]:
        for loader in [x for x in args.loaders.split(",") if x]:
            why = _available(loader, device)
            if why:
                results.append({"loader": loader, "regime": regime, "skipped": why})
                continue
            if time.perf_counter() - started > args.budget_s:
                results.append({"loader": loader, "regime": regime, "skipped": "time budget spent"})
                continue
            if regime == "warm":
                _peers.warm(own_files.get(loader, files))
            cenv = dict(env)
            if loader == "fastsafetensors" and regime == "warm":
                cenv["FASTSAFETENSORS_ODIRECT"] = "0"
            if loader == "runai":
                cenv["RUNAI_STREAMER_CONCURRENCY"] = str(min(16, _peers.CORES))
                if regime == "warm":
                    cenv["RUNAI_STREAMER_FS_STRATEGY"] = "sync_buffered"
            ckpt = data.parent / (data.name + QUANTIZED[loader]) if loader in QUANTIZED else data
            cfg = {"ckpt": str(ckpt), "loader": loader, "regime": regime, "device": device}
            try:
                proc = subprocess.run(
                    [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(cfg)],
                    env=cenv,
                    capture_output=True,
                    text=True,
                    timeout=max(30.0, args.budget_s + 60 - (time.perf_counter() - started)),
                )
                line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
                res = (
                    json.loads(line[7:]) if line else {"loader": loader, "regime": regime, "error": proc.stderr[-1500:]}
                )
            except subprocess.TimeoutExpired:
                res = {"loader": loader, "regime": regime, "error": "timeout"}
            ceiling = log["ceilings"].get("pinned_gbps") or log["ceilings"].get("pageable_gbps")
            if "gbps" in res:
                res["fraction_of_pinned_h2d"] = res["gbps"] / ceiling if ceiling else None
                res["fraction_of_cold_read"] = res["gbps"] / par_gbps if regime == "cold" and par_gbps else None
            results.append(res)
            print(_line(res), flush=True)
    log["results"] = results
    log["scale"] = scale_rehearsal(args, device, log["ceilings"], data.parent, env, started)
    log["total_seconds"] = time.perf_counter() - started
    md = _table(log)
    (out / "gpu_check.json").write_text(json.dumps(log, indent=1, default=str))
    (out / "gpu_check.md").write_text(md)
    print(md)
    if not args.keep_data and not args.quick:
        shutil.rmtree(data, ignore_errors=True)
        shutil.rmtree(fp8_data, ignore_errors=True)
        shutil.rmtree(mxfp4_data, ignore_errors=True)
    bad = [r for r in results if r.get("error") or r.get("verify", {}).get("mismatched")]
    return 1 if bad else 0


def scale_rehearsal(
    args: argparse.Namespace, device: str, ceilings: dict[str, Any], where: Path, env: dict[str, str], started: float
) -> dict[str, Any]:
    """One rank of a full-size job rehearsed into CUDA memory: ``benches/scale.py`` writes the model's released
    layout as a sparse checkpoint (headers real, data holes), then ``hp-fastload plan --execute --device cuda``
    allocates the rank's local shards on the GPU and reads them through the pinned double-buffered stager
    (``--staging-mib``); GB/s against the pinned H2D ceiling of this run. Skipped cleanly (a reason) without
    CUDA, without transformers (the layouts come from its configs), or past the time budget."""
    if not args.scale:
        return {"skipped": "--scale ''"}
    if not device.startswith("cuda"):
        return {"skipped": "no CUDA device"}
    try:
        import transformers  # noqa: F401
    except ImportError:
        return {"skipped": "transformers is not installed (the layouts are derived from its configs)"}
    if time.perf_counter() - started > args.budget_s:
        return {"skipped": "time budget spent"}
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import scale

    model, layout, world, rank = args.scale.split(":")
    root = where / f"hp_scale_{model}"
    t = time.perf_counter()
    gen = scale.write_checkpoint(root, scale.MODELS[model], fill=scale.DEFAULT_FILL)
    cmd = [
        sys.executable,
        "-m",
        "hp_fastload.cli",
        "plan",
        str(root),
        "--layout",
        layout,
        "--world",
        world,
        "--rank",
        rank,
        "--execute",
        "--json",
        "--device",
        device,
        "--staging-mib",
        str(args.staging_mib),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:], "generate_seconds": time.perf_counter() - t}
    res: dict[str, Any] = json.loads(proc.stdout)
    ceiling = ceilings.get("pinned_gbps")
    res["fraction_of_pinned_h2d"] = res["gbps"] / ceiling if ceiling else None
    res["checkpoint_bytes"] = gen.total_bytes
    res["generate_seconds"] = gen.seconds
    print(
        f"scale {args.scale}: {res['bytes_read'] / 1e9:.2f} GB in {res['read_seconds']:.2f} s = {res['gbps']:.2f} GB/s "
        f"({(res['fraction_of_pinned_h2d'] or 0):.2f} of pinned H2D), plan {res['plan_seconds']:.2f} s, pinned "
        f"staging {res['staging_bytes'] / 2**20:.0f} MiB, peak host RSS {res['peak_rss'] / 2**30:.2f} GiB, fds "
        f"{res['peak_fds']}",
        flush=True,
    )
    if not args.keep_data:
        shutil.rmtree(root, ignore_errors=True)
    return res


def _line(r: dict[str, Any]) -> str:
    if r.get("error"):
        return f"{r['regime']:4s} {r['loader']:16s} ERROR {r['error'][:300]}"
    frac = r.get("fraction_of_cold_read") if r["regime"] == "cold" else r.get("fraction_of_pinned_h2d")
    what = "cold-read anchor" if r["regime"] == "cold" else "H2D ceiling"
    v = r["verify"]
    return (
        f"{r['regime']:4s} {r['loader']:16s} {r['seconds']:7.2f} s {r['gbps']:6.2f} GB/s "
        f"({(frac or 0):.0%} of {what}) read {r['storage_read_bytes'] / 1e9:.2f} GB, "
        f"verified {v['checked'] - v['mismatched']}/{v['checked']}"
    )


def _table(log: dict[str, Any]) -> str:
    c = log["ceilings"]
    s = log["storage"]
    cold_ok = s["cold_seq"]["resident_pages_before"] == 0 and s["cold_par"]["resident_pages_before"] == 0
    lines = [
        f"device {log['device']} ({log.get('gpu', 'no GPU')}), torch {log['torch']}, checkpoint "
        f"{log['checkpoint']['bytes'] / 1e9:.1f} GB in {log['checkpoint']['files']} files",
        f"ceilings: pinned H2D {c.get('pinned_gbps') or float('nan'):.2f} GB/s, "
        f"pageable {c.get('pageable_gbps') or float('nan'):.2f} GB/s; "
        f"cold read sequential {s['cold_seq']['gbps']:.2f} GB/s, parallel {s['cold_par']['gbps']:.2f} GB/s "
        f"(0 resident pages before: {cold_ok})",
        "",
        "| regime | loader | s | GB/s | of pinned H2D | of cold read | storage read GB | verified |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in log["results"]:
        if "gbps" not in r:
            why = r.get("skipped") or "error: " + str(r.get("error"))[:100]
            lines.append(f"| {r['regime']} | {r['loader']} | | | | | | {why} |")
            continue
        v = r["verify"]
        fh, fc = r.get("fraction_of_pinned_h2d"), r.get("fraction_of_cold_read")
        lines.append(
            f"| {r['regime']} | {r['loader']} | {r['seconds']:.2f} | {r['gbps']:.2f} | "
            f"{'' if fh is None else f'{fh:.0%}'} | {'' if fc is None else f'{fc:.0%}'} | "
            f"{r['storage_read_bytes'] / 1e9:.2f} | {v['checked'] - v['mismatched']}/{v['checked']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
