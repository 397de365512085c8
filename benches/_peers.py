"""Worker side of ``benches/compare.py``: system probes, workloads' destinations, the loaders, verification.

Everything here runs inside a fresh worker process started by ``compare.py`` (``--worker``). The orchestrator
never imports torch-heavy peers itself. Nothing in this file is part of the library: it only *calls*
hp_fastload's public API (and, for the emulated rank of 8, skips its cross-rank agreement collectives, which a
single process under torch's ``fake`` process group cannot run).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import math
import mmap
import os
import re
import resource
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def attention_keys(p: str, h: int, q: int, kv: int) -> list[tuple[str, tuple[int, ...]]]:
    """HF q/k/v/o projection names and shapes of the layer prefixed ``p`` (file order)."""
    return [
        (f"{p}.self_attn.q_proj.weight", (q, h)),
        (f"{p}.self_attn.k_proj.weight", (kv, h)),
        (f"{p}.self_attn.v_proj.weight", (kv, h)),
        (f"{p}.self_attn.o_proj.weight", (h, q)),
    ]


def llama_keys(h: int, q: int, kv: int, inter: int, vocab: int, layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """HF Llama tensor names and shapes (hidden ``h``, q/kv projection widths, MLP width), in file order."""
    keys: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}"
        keys += [
            (f"{p}.input_layernorm.weight", (h,)),
            *attention_keys(p, h, q, kv),
            (f"{p}.post_attention_layernorm.weight", (h,)),
            (f"{p}.mlp.gate_proj.weight", (inter, h)),
            (f"{p}.mlp.up_proj.weight", (inter, h)),
            (f"{p}.mlp.down_proj.weight", (h, inter)),
        ]
    keys += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    return keys


def shard_groups(sizes: list[int], shards: int) -> list[list[int]]:
    """Tensor indices per shard file, in order: a new shard starts once the current one holds 1/shards of
    the bytes (what ``save_pretrained``'s size-capped sharding does, at most ``shards`` files)."""
    budget = sum(sizes) / shards
    groups: list[list[int]] = [[]]
    acc = 0.0
    for i, n in enumerate(sizes):
        if acc >= budget and len(groups) < shards:
            groups.append([])
            acc = 0.0
        groups[-1].append(i)
        acc += n
    return groups


PAGE = os.sysconf("SC_PAGE_SIZE")
CORES = os.cpu_count() or 1

# ---------------------------------------------------------------------------------------------------------
# System probes: page-cache residency (mincore), eviction, storage reads, CPU, RSS


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_pages(path: str | os.PathLike[str]) -> tuple[int, int]:
    """(resident, total) pages of ``path`` in the page cache, via mmap + mincore (maps, never faults)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0, 0
    pages = (size + PAGE - 1) // PAGE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), "mmap failed")
        try:
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            resident = sum(1 for b in bytes(vec) if b & 1)
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)
    return resident, pages


def evict(paths: list[str]) -> int:
    """posix_fadvise(DONTNEED) on every file; returns the resident pages left (0 means a verified cold cache).

    Mapped pages cannot be dropped, so hp_fastload's kept file maps (if it was imported) are released first.
    """
    import sys

    if "hp_fastload" in sys.modules:
        sys.modules["hp_fastload"].clear_cache()
    left = 0
    for attempt in range(3):
        left = 0
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd) if attempt else None
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            left += resident_pages(p)[0]
        if left == 0:
            break
        time.sleep(0.05)
    return left


def warm(paths: list[str], chunk: int = 8 << 20) -> float:
    """Read every file once (page cache populated); returns the fraction of pages resident afterwards."""
    buf = bytearray(chunk)
    view = memoryview(buf)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(view):
                pass
    return residency(paths)


def residency(paths: list[str]) -> float:
    res = tot = 0
    for p in paths:
        r, t = resident_pages(p)
        res += r
        tot += t
    return res / tot if tot else 1.0


def io_read_bytes() -> int:
    """Bytes this process made the block layer fetch (/proc/self/io read_bytes; read-ahead included)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


_SAMPLER_CODE = r"""
import select, sys
path = f"/proc/{sys.argv[1]}/status"
period = float(sys.argv[2])

def anon():
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0

for command in sys.stdin:
    if command.strip() != "start":
        break
    peak = anon()
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while not select.select([sys.stdin], [], [], period)[0]:
        peak = max(peak, anon())
    sys.stdin.readline()  # "stop"
    sys.stdout.write(f"{max(peak, anon())}\n")
    sys.stdout.flush()
"""


class AnonSampler:
    """Samples RssAnon every ``period`` seconds from a helper *process*; ``peak`` is the largest value seen.

    A sampling thread in the measured process would take the GIL every period: it made a Python-heavy load
    (20k-tensor MoE) 20% slower in the harness (docs/perf-notes.md, "The RSS sampler"). The helper reads
    ``/proc/<pid>/status`` instead and is reused for every measurement of a worker.
    """

    _proc: subprocess.Popen[str] | None = None

    def __init__(self, period: float = 0.002) -> None:
        self.period = period
        self.peak = rss_anon()

    @classmethod
    def _helper(cls, period: float) -> subprocess.Popen[str]:
        if cls._proc is None or cls._proc.poll() is not None:
            cls._proc = subprocess.Popen(
                [sys.executable, "-c", _SAMPLER_CODE, str(os.getpid()), str(period)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        return cls._proc

    def __enter__(self) -> AnonSampler:
        proc = self._helper(self.period)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("start\n")
        proc.stdin.flush()
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError("RSS sampler process did not start")
        return self

    def __exit__(self, *exc: Any) -> None:
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("stop\n")
        proc.stdin.flush()
        line = proc.stdout.readline().strip()
        self.peak = max(self.peak, int(line) if line else 0, rss_anon())


def read_ahead_kb() -> dict[str, int]:
    out: dict[str, int] = {}
    for p in Path("/sys/block").glob("*/queue/read_ahead_kb"):
        with contextlib.suppress(OSError, ValueError):
            out[p.parent.parent.name] = int(p.read_text())
    return out


# ---------------------------------------------------------------------------------------------------------
# Physical anchors


def memcpy_gbps(nbytes: int, threads: int, repeats: int = 5) -> float:
    """torch copy_ between two prefaulted buffers with ``threads`` intra-op threads (median GB/s)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.zeros(nbytes, dtype=torch.uint8)
        dst.copy_(src)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t)
        return nbytes / statistics.median(times) / 1e9
    finally:
        torch.set_num_threads(old)


def box_copy_gbps(ckpt: str, scenario: str, world: int, rank: int, repeats: int = 5) -> float:
    """The copy ceiling of one placement's boxes: torch ``copy_`` (1 thread) of the same boxes, into the same
    destinations, from anonymous prefaulted memory laid out like the checkpoint's tensors (each tensor at its
    own place, so no box reads another's cached bytes), instead of from a file map.
    """
    import torch

    from hp_fastload.formats import SAFETENSORS_TO_TORCH

    entries = checkpoint_entries(ckpt)
    dests = build_destinations(entries, scenario, world, rank)
    place: dict[str, int] = {}
    size = 0
    for b in dests.boxes:
        if b.key not in place:
            place[b.key] = size
            size += math.prod(b.global_shape) * SAFETENSORS_TO_TORCH[entries[b.key].dtype].itemsize
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        raw = torch.ones(size, dtype=torch.uint8)
        pairs = []
        for b in dests.boxes:
            dtype = SAFETENSORS_TO_TORCH[entries[b.key].dtype]
            start = place[b.key]
            nbytes = math.prod(b.global_shape) * dtype.itemsize
            pairs.append((b.dest, raw[start : start + nbytes].view(dtype).view(b.global_shape)[b.slices]))
        times = []
        for _ in range(repeats + 1):
            t = time.perf_counter()
            for dst, src in pairs:
                dst.copy_(src)
            times.append(time.perf_counter() - t)
        del raw, pairs
        return dests.nbytes / statistics.median(times[1:]) / 1e9
    finally:
        torch.set_num_threads(old)


def cold_read_gbps(paths: list[str], threads: int, chunk: int = 8 << 20) -> dict[str, Any]:
    """Evict, verify 0 resident pages, then buffered ``preadv`` of every file by ``threads`` threads."""
    left = evict(paths)
    jobs: list[tuple[str, int, int]] = []
    for p in paths:
        size = os.path.getsize(p)
        # contiguous ranges per thread, so each thread streams sequentially (read-ahead helps)
        per = -(-size // threads)
        per = -(-per // chunk) * chunk
        jobs += [(p, s, min(size, s + per)) for s in range(0, size, per)]
    total = sum(e - s for _, s, e in jobs)

    def work(job: tuple[str, int, int]) -> None:
        p, s, e = job
        buf = bytearray(chunk)
        fd = os.open(p, os.O_RDONLY)
        try:
            off = s
            while off < e:
                n = os.preadv(fd, [memoryview(buf)[: min(chunk, e - off)]], off)
                if n <= 0:
                    break
                off += n
        finally:
            os.close(fd)

    from concurrent.futures import ThreadPoolExecutor

    io0 = io_read_bytes()
    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, jobs))
    wall = time.perf_counter() - t
    return {
        "threads": threads,
        "bytes": total,
        "seconds": wall,
        "gbps": total / wall / 1e9,
        "resident_pages_before": left,
        "storage_read_bytes": io_read_bytes() - io0,
    }


# ---------------------------------------------------------------------------------------------------------
# Checkpoints: keys, shapes, files


@dataclass
class Entry:
    key: str
    file: str
    dtype: str
    shape: tuple[int, ...]


def checkpoint_entries(ckpt: str) -> dict[str, Entry]:
    from safetensors import safe_open

    out: dict[str, Entry] = {}
    for p in sorted(Path(ckpt).glob("*.safetensors")):
        with safe_open(str(p), "pt") as f:
            for k in f.keys():  # noqa: SIM118 (a safe_open handle)
                sl = f.get_slice(k)
                out[k] = Entry(k, str(p), sl.get_dtype(), tuple(sl.get_shape()))
    return out


def checkpoint_files(ckpt: str) -> list[str]:
    return sorted(str(p) for p in Path(ckpt).glob("*.safetensors"))


# ---------------------------------------------------------------------------------------------------------
# Scenarios -> boxes -> destinations

EXPERT_RE = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
ROWWISE = ("o_proj", "down_proj")


def placement_dim(key: str, ndim: int, scenario: str) -> int | None:
    """Which dim of checkpoint tensor ``key`` is sharded in ``scenario`` (None: the whole tensor)."""
    if ndim != 2 or scenario in ("full", "ep"):
        return None
    if scenario == "s0":
        return 0
    if scenario == "s1":
        return 1
    if scenario == "tp":
        leaf = key.rsplit(".", 2)[-2] if key.endswith(".weight") else ""
        if leaf in COLWISE:
            return 0
        if leaf in ROWWISE:
            return 1
        return None
    raise ValueError(f"unknown scenario {scenario}")


@dataclass
class Box:
    key: str
    file: str
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    dest: Any  # torch.Tensor (a view into ``owner`` for stacked experts)
    global_shape: tuple[int, ...]
    dim: int | None  # sharded dim (None: whole)

    @property
    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.lengths, strict=True))


@dataclass
class Destinations:
    boxes: list[Box]
    stacked: dict[str, dict[str, Any]] = field(default_factory=dict)  # "<prefix>" -> {"gate_up": t, "down": t}
    expert_range: tuple[int, int] | None = None

    @property
    def nbytes(self) -> int:
        return sum(math.prod(b.lengths) * b.dest.element_size() for b in self.boxes)

    def zero(self) -> None:
        for b in self.boxes:
            b.dest.zero_()


def build_destinations(entries: dict[str, Entry], scenario: str, world: int, rank: int) -> Destinations:
    """Local, prefaulted destination tensors of every needed box; experts go into stacked buffers."""
    import torch

    from hp_fastload.formats import SAFETENSORS_TO_TORCH

    experts: dict[str, dict[int, dict[str, Entry]]] = {}
    plain: list[Entry] = []
    for e in entries.values():
        m = EXPERT_RE.match(e.key)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = e
        else:
            plain.append(e)
    boxes: list[Box] = []
    for e in plain:
        dim = placement_dim(e.key, len(e.shape), scenario)
        offsets = [0] * len(e.shape)
        lengths = list(e.shape)
        if dim is not None:
            n = e.shape[dim] // world
            offsets[dim], lengths[dim] = rank * n, n
        dest = torch.zeros(lengths, dtype=SAFETENSORS_TO_TORCH[e.dtype])
        boxes.append(Box(e.key, e.file, tuple(offsets), tuple(lengths), dest, e.shape, dim))
    stacked: dict[str, dict[str, Any]] = {}
    expert_range = None
    for prefix, by_expert in experts.items():
        count = len(by_expert)
        lo, hi = (0, count)
        if scenario == "ep":
            per = count // world
            lo, hi = rank * per, (rank + 1) * per
        elif scenario != "full":
            raise ValueError(f"scenario {scenario} is not defined for expert tensors (use full or ep)")
        expert_range = (lo, hi)
        g = by_expert[0]["gate_proj"]
        d = by_expert[0]["down_proj"]
        dtype = SAFETENSORS_TO_TORCH[g.dtype]
        inter, hidden = g.shape
        gate_up = torch.zeros(hi - lo, 2 * inter, hidden, dtype=dtype)
        down = torch.zeros(hi - lo, *d.shape, dtype=dtype)
        stacked[prefix] = {"gate_up": gate_up, "down": down, "range": (lo, hi), "count": count}
        for ex in range(lo, hi):
            views = {
                "gate_proj": gate_up[ex - lo, :inter],
                "up_proj": gate_up[ex - lo, inter:],
                "down_proj": down[ex - lo],
            }
            for proj, view in views.items():
                e = by_expert[ex][proj]
                boxes.append(Box(e.key, e.file, (0,) * len(e.shape), e.shape, view, e.shape, None))
    return Destinations(boxes, stacked, expert_range)


def verify(dests: Destinations) -> dict[str, Any]:
    """Compares every destination box with safetensors' own slice of the file (bitwise, as int16/uint8)."""
    import torch
    from safetensors import safe_open

    by_file: dict[str, list[Box]] = {}
    for b in dests.boxes:
        by_file.setdefault(b.file, []).append(b)
    bad: list[str] = []
    checked = 0
    for path, boxes in by_file.items():
        with safe_open(path, "pt") as f:
            for b in boxes:
                ref = f.get_slice(b.key)[b.slices]
                if not torch.equal(_bits(b.dest), _bits(ref)):
                    bad.append(b.key)
                checked += 1
    return {"checked": checked, "mismatched": len(bad), "bad": bad[:5]}


def _bits(t: Any) -> Any:
    import torch

    t = t.contiguous()
    size = t.element_size()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size])


# ---------------------------------------------------------------------------------------------------------
# Models wrapping the destinations (hp_fastload.load, transformers, DCP state dicts)


def fake_world(world: int, rank: int) -> Any:
    """A 1-D DeviceMesh of ``world`` ranks in this one process (torch's fake process group), or None."""
    if world == 1:
        return None
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    return init_device_mesh("cpu", (world,))


def as_dtensor(local: Any, mesh: Any, dim: int | None, global_shape: tuple[int, ...]) -> Any:
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if mesh is None:
        return local
    placement = Replicate() if dim is None else Shard(dim)
    stride = [math.prod(global_shape[d + 1 :]) for d in range(len(global_shape))]
    return DTensor.from_local(
        local, mesh, [placement], run_check=False, shape=torch.Size(global_shape), stride=tuple(stride)
    )


def dcp_state_dict(dests: Destinations, mesh: Any) -> dict[str, Any]:
    """Checkpoint-keyed state dict for torch DCP: DTensors over the destinations (plain when whole)."""
    out: dict[str, Any] = {}
    for b in dests.boxes:
        out[b.key] = b.dest if b.dim is None else as_dtensor(b.dest, mesh, b.dim, b.global_shape)
    return out


def model_over(ckpt: str, dests: Destinations, mesh: Any) -> Any:
    """The checkpoint's transformers model, built on meta, whose parameters ARE the destination tensors."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(ckpt)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    by_key = {b.key: b for b in dests.boxes}
    for name, module in list(model.named_modules()):
        for pname, p in list(module.named_parameters(recurse=False)):
            full = f"{name}.{pname}" if name else pname
            if full in by_key:
                b = by_key[full]
                value = as_dtensor(b.dest, mesh, b.dim, b.global_shape)
            elif name in dests.stacked and pname in ("gate_up_proj", "down_proj"):
                st = dests.stacked[name]
                local = st["gate_up" if pname == "gate_up_proj" else "down"]
                value = local
                if mesh is not None:
                    value = as_dtensor(local, mesh, 0, tuple(p.shape))
            else:
                raise RuntimeError(f"model parameter {full} has no destination (shape {tuple(p.shape)})")
            setattr(module, pname, torch.nn.Parameter(value, requires_grad=False))
        for bname, buf in list(module.named_buffers(recurse=False)):
            if buf.is_meta:
                module._buffers[bname] = torch.zeros(buf.shape, dtype=buf.dtype)
    # rotary inv_freq and friends were meta: recompute them the way the model does
    for module in model.modules():
        if hasattr(module, "rope_init_fn") and hasattr(module, "inv_freq"):
            with contextlib.suppress(Exception):
                inv_freq, _ = module.rope_init_fn(module.config, torch.device("cpu"))
                module.inv_freq = inv_freq
    return model


# ---------------------------------------------------------------------------------------------------------
# Loaders over destinations (raw scenarios). Each returns a dict of extra facts (may be empty).


def _group(dests: Destinations) -> dict[str, list[Box]]:
    by_file: dict[str, list[Box]] = {}
    for b in dests.boxes:
        by_file.setdefault(b.file, []).append(b)
    return by_file


def load_st_slice(ckpt: str, dests: Destinations, ctx: dict[str, Any]) -> dict[str, Any]:
    from safetensors import safe_open

    for path, boxes in _group(dests).items():
        with safe_open(path, "pt") as f:
            for b in boxes:
                b.dest.copy_(f.get_slice(b.key)[b.slices])
    return {}


def load_st_loadfile(ckpt: str, dests: Destinations, ctx: dict[str, Any]) -> dict[str, Any]:
    from safetensors.torch import load_file

    for path, boxes in _group(dests).items():
        sd = load_file(path)
        for b in boxes:
            b.dest.copy_(sd[b.key][b.slices])
        del sd
    return {}


def _torch_dcp(threads: int) -> Callable[[str, Destinations, dict[str, Any]], dict[str, Any]]:
    def run(ckpt: str, dests: Destinations, ctx: dict[str, Any]) -> dict[str, Any]:
        import warnings

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        sd = ctx["dcp_state"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(sd, storage_reader=HuggingFaceStorageReader(ckpt, thread_count=threads), no_dist=True)
        return {}

    return run


def load_hp_reader(ckpt: str, dests: Destinations, ctx: dict[str, Any]) -> dict[str, Any]:
    """hp_fastload's own DCP StorageReader (drop-in for torch's), same state dict as the torch DCP peer."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from hp_fastload.api.dcp import HuggingFaceStorageReader

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(ctx["dcp_state"], storage_reader=HuggingFaceStorageReader(ckpt), no_dist=True)
    return {}


def load_fastsafetensors(ckpt: str, dests: Destinations, ctx: dict[str, Any]) -> dict[str, Any]:
    from fastsafetensors import SafeTensorsFileLoader, SingleGroup

    by_file = _group(dests)
    loader = SafeTensorsFileLoader(SingleGroup(), device="cpu", nogds=True, max_threads=CORES, set_numa=False)
    try:
        loader.add_filenames({0: list(by_file)})
        fb = loader.copy_files_to_device()
        try:
            for boxes in by_file.values():
                for b in boxes:
                    b.dest.copy_(fb.get_tensor(b.key)[b.slices])
        finally:
            fb.close()
    finally:
        loader.close()
    return {"odirect": os.environ.get("FASTSAFETENSORS_ODIRECT", "default")}


def load_runai(ckpt: str, dests: Destinations, ctx: dict[str, Any]) -> dict[str, Any]:
    import inspect

    from runai_model_streamer import SafetensorsStreamer

    by_key = {b.key: b for b in dests.boxes}
    files = sorted({b.file for b in dests.boxes})
    kwargs: dict[str, Any] = {"tensor_names": list(by_key)}
    if "owned" in inspect.signature(SafetensorsStreamer.stream_files).parameters:
        kwargs["owned"] = False  # views into its buffer; we copy once into the destination
    with SafetensorsStreamer() as streamer:
        streamer.stream_files(files, **kwargs)
        for name, tensor in streamer.get_tensors():
            b = by_key.get(name)
            if b is not None:
                b.dest.copy_(tensor[b.slices])
    return {"strategy": os.environ.get("RUNAI_STREAMER_FS_STRATEGY", "default")}


def load_hp_read_many(ckpt: str, dests: Destinations, ctx: dict[str, Any]) -> dict[str, Any]:
    import hp_fastload
    from hp_fastload.source import files as engine

    engine.clear_cache()  # parse headers inside the timed region, like every other loader
    stats = hp_fastload.read_many([(b.file, b.key, b.offsets, b.lengths, b.dest) for b in dests.boxes])
    return {k: v for k, v in stats.items() if isinstance(v, int | str)}


def _hp_load(loader: str) -> Callable[[str, Destinations, dict[str, Any]], dict[str, Any]]:
    def run(ckpt: str, dests: Destinations, ctx: dict[str, Any]) -> dict[str, Any]:
        import hp_fastload
        from hp_fastload.source import files as engine

        engine.clear_cache()
        report = hp_fastload.load(ctx["model"], ckpt, loader=loader, strict=True, progress=False)
        path = report.critical_path
        return {
            "hp_bytes_read": report.bytes_read,
            "hp_bytes_needed": report.bytes_needed,
            "critical_path": {**path.as_dict(), "planning_hidden": path.planning_hidden},
        }

    return run


RAW_LOADERS: dict[str, Callable[[str, Destinations, dict[str, Any]], dict[str, Any]]] = {
    "st_slice": load_st_slice,
    "st_loadfile": load_st_loadfile,
    "torch_dcp_t1": _torch_dcp(1),
    "torch_dcp_t2": _torch_dcp(2),
    "fastsafetensors": load_fastsafetensors,
    "runai": load_runai,
    "hp_read_many": load_hp_read_many,
    "hp_dcp_reader": load_hp_reader,
    "hp_dcp": _hp_load("dcp"),
    "hp_legacy": _hp_load("legacy"),
}


def loader_env(loader: str, regime: str) -> dict[str, str]:
    """Fair settings: peers' thread counts = cores; buffered I/O for warm runs (O_DIRECT re-reads storage)."""
    env: dict[str, str] = {}
    if loader == "fastsafetensors" and regime == "warm":
        env["FASTSAFETENSORS_ODIRECT"] = "0"
    if loader == "runai":
        env["RUNAI_STREAMER_CONCURRENCY"] = str(CORES)
        if regime == "warm":
            env["RUNAI_STREAMER_FS_STRATEGY"] = "sync_buffered"
    return env


# ---------------------------------------------------------------------------------------------------------
# One raw configuration (a worker runs one or several)


def run_raw(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    ckpt, loader, scenario, regime = cfg["ckpt"], cfg["loader"], cfg["scenario"], cfg["regime"]
    world, rank, repeats = cfg["world"], cfg["rank"], cfg["repeats"]
    result: dict[str, Any] = dict(
        kind="raw",
        workload=cfg["workload"],
        scenario=scenario,
        loader=loader,
        regime=regime,
        world=world,
        rank=rank,
    )
    if "round" in cfg:
        result["round"] = cfg["round"]
    for k in ("FASTSAFETENSORS_ODIRECT", "RUNAI_STREAMER_CONCURRENCY", "RUNAI_STREAMER_FS_STRATEGY"):
        os.environ.pop(k, None)
    for k, v in loader_env(loader, regime).items():
        os.environ[k] = v
    result["env"] = loader_env(loader, regime)
    entries = checkpoint_entries(ckpt)
    files = checkpoint_files(ckpt)
    mesh = fake_world(world, rank)
    dests = build_destinations(entries, scenario, world, rank)
    ctx: dict[str, Any] = {}
    if loader.startswith("torch_dcp") or loader == "hp_dcp_reader":
        ctx["dcp_state"] = dcp_state_dict(dests, mesh)
    if loader in ("hp_dcp", "hp_legacy"):
        ctx["model"] = model_over(ckpt, dests, mesh)
    fn = RAW_LOADERS[loader]
    needed = dests.nbytes
    result["needed_bytes"] = needed
    result["file_bytes"] = sum(os.path.getsize(p) for p in files)
    result["tensors"] = len(dests.boxes)
    reps: list[dict[str, Any]] = []
    warmup = cfg.get("warmup", 0)  # untimed first repetitions (first-call costs of a single-repetition worker)
    for rep_no in range(warmup + repeats):
        dests.zero()
        if regime == "cold":
            left = evict(files)
            state = {"resident_pages_before": left, "cold_verified": left == 0}
        else:
            frac = residency(files)
            if frac < 1.0:
                frac = warm(files)
            state = {"resident_fraction_before": frac}
        anon0 = rss_anon()
        io0, cpu0 = io_read_bytes(), cpu_seconds()
        with AnonSampler() as sampler:
            t0 = time.perf_counter()
            extra = fn(ckpt, dests, ctx)
            wall = time.perf_counter() - t0
        rep = dict(
            state,
            seconds=wall,
            gbps=needed / wall / 1e9,
            storage_read_bytes=io_read_bytes() - io0,
            cpu_seconds=cpu_seconds() - cpu0,
            anon_added_bytes=sampler.peak - anon0,
            **extra,
        )
        if rep_no >= warmup:
            reps.append(rep)
    result["verify"] = verify(dests)
    result["repeats"] = reps
    result.update(summarize(reps))
    result["peak_rss_bytes"] = peak_rss()
    result["dest_bytes"] = needed
    del ctx, dests
    torch.distributed.destroy_process_group() if mesh is not None else None
    return result


def summarize(reps: list[dict[str, Any]]) -> dict[str, Any]:
    def med(k: str) -> float:
        vals = [r[k] for r in reps if k in r]
        return float(statistics.median(vals)) if vals else float("nan")

    return {
        "seconds": med("seconds"),
        "seconds_min": min(r["seconds"] for r in reps),
        "gbps": med("gbps"),
        "storage_read_bytes": med("storage_read_bytes"),
        "cpu_seconds": med("cpu_seconds"),
        "anon_added_bytes": max(r["anon_added_bytes"] for r in reps),
    }


# ---------------------------------------------------------------------------------------------------------
# End to end: 2 real gloo ranks filling DTensor models


def _e2e_rank(rank: int, world: int, port: int, cfg: dict[str, Any], conn: Any) -> None:
    out: dict[str, Any] = {"rank": rank}
    try:
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world),
            OMP_NUM_THREADS="1",
        )
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        out.update(_e2e_body(rank, world, cfg))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # report, never hang the parent
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()[-3000:]
    conn.send(out)
    conn.close()


def _e2e_body(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import warnings

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    ckpt, loader, scenario = cfg["ckpt"], cfg["loader"], cfg["scenario"]
    entries = checkpoint_entries(ckpt)
    reps: list[dict[str, Any]] = []
    verdict: dict[str, Any] = {}
    needed = 0
    for _ in range(cfg["repeats"]):
        model = None
        dests = None
        phases: dict[str, float] = {}
        t_build = time.perf_counter()
        if loader != "transformers":
            mesh = init_device_mesh("cpu", (world,))
            dests = build_destinations(entries, scenario, world, rank)
            needed = dests.nbytes
            model = model_over(ckpt, dests, mesh)
        build = time.perf_counter() - t_build
        dist.barrier()
        io0, cpu0 = io_read_bytes(), cpu_seconds()
        t0 = time.perf_counter()
        if loader in ("hp_dcp", "hp_legacy"):
            import hp_fastload
            from hp_fastload.source import files as engine

            engine.clear_cache()
            report = hp_fastload.load(model, ckpt, loader=loader.split("_")[1], strict=True, progress=False)
            phases = {**report.critical_path.as_dict(), "planning_hidden": report.critical_path.planning_hidden}
        elif loader.startswith("torch_dcp"):
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint import HuggingFaceStorageReader

            assert model is not None
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load(
                    model.state_dict(),
                    storage_reader=HuggingFaceStorageReader(ckpt, thread_count=int(loader[-1])),
                )
        elif loader == "st_slice":
            assert dests is not None
            load_st_slice(ckpt, dests, {})
        elif loader == "transformers":
            from transformers import AutoModelForCausalLM
            from transformers.distributed import DistributedConfig

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = AutoModelForCausalLM.from_pretrained(
                    ckpt, dtype=torch.bfloat16, distributed_config=DistributedConfig(tp_plan="auto")
                )
        else:
            raise ValueError(f"unknown e2e loader {loader}")
        wall = time.perf_counter() - t0
        io1, cpu1 = io_read_bytes(), cpu_seconds()
        if loader == "transformers":
            needed, verdict = verify_model(model, entries)
        elif dests is not None:
            verdict = verify(dests)
        reps.append(
            dict(
                seconds=wall,
                build_seconds=build,
                storage_read_bytes=io1 - io0,
                cpu_seconds=cpu1 - cpu0,
                anon_added_bytes=0,
                gbps=needed / wall / 1e9 if needed else 0.0,
                **({"critical_path": phases} if phases else {}),
            )
        )
        del model, dests
        dist.barrier()
    return {"needed_bytes": needed, "repeats": reps, "verify": verdict, "peak_rss_bytes": peak_rss()}


def verify_model(model: Any, entries: dict[str, Entry]) -> tuple[int, dict[str, Any]]:
    """Local shards of a (transformers-loaded) model against the file: plain names and stacked experts."""
    import torch
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor, distribute_tensor

    handles: dict[str, Any] = {}

    def ref(key: str) -> Any:
        e = entries[key]
        if e.file not in handles:
            handles[e.file] = safe_open(e.file, "pt")
        return handles[e.file].get_tensor(key)

    checked = bad = needed = 0
    bad_keys: list[str] = []
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        full: Any
        if name in entries:
            full = ref(name)
        elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            prefix = name.rsplit(".", 1)[0]
            n = p.shape[0]
            if name.endswith("gate_up_proj"):
                full = torch.stack(
                    [
                        torch.cat([ref(f"{prefix}.{e}.gate_proj.weight"), ref(f"{prefix}.{e}.up_proj.weight")])
                        for e in range(n)
                    ]
                )
            else:
                full = torch.stack([ref(f"{prefix}.{e}.down_proj.weight") for e in range(n)])
        else:
            continue
        if isinstance(p, DTensor):
            # torch's own sharding of the file's tensor (transformers' TP plan shards packed gate_up_proj with
            # _StridedShard, which a hand-written narrow would get wrong); src_data_rank=None: no collectives.
            full = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
        checked += 1
        needed += local.numel() * local.element_size()
        if tuple(full.shape) != tuple(local.shape) or not torch.equal(_bits(full), _bits(local)):
            bad += 1
            bad_keys.append(name)
    return needed, {"checked": checked, "mismatched": bad, "bad": bad_keys[:5]}


def run_e2e(cfg: dict[str, Any]) -> dict[str, Any]:
    """Forks ``world`` ranks right after imports (no torch thread pools yet), gathers per-rank results."""
    import multiprocessing as mp
    import socket

    # import everything the ranks need BEFORE forking (no thread pools started by imports), so ranks start fast
    import safetensors.torch  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401

    import hp_fastload  # noqa: F401

    world = cfg["world"]
    ctx = mp.get_context("fork")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    files = checkpoint_files(cfg["ckpt"])
    frac = warm(files)
    pipes, procs = [], []
    for r in range(world):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_e2e_rank, args=(r, world, port, cfg, child))
        p.start()
        pipes.append(parent)
        procs.append(p)
    outs: list[dict[str, Any]] = []
    deadline = time.time() + cfg.get("timeout", 600)
    for parent in pipes:
        left = max(1.0, deadline - time.time())
        outs.append(parent.recv() if parent.poll(left) else {"error": "timeout"})
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
    result: dict[str, Any] = dict(
        kind="e2e",
        workload=cfg["workload"],
        scenario=cfg["scenario"],
        loader=cfg["loader"],
        regime="warm",
        world=world,
        rank=-1,
        resident_fraction_before=frac,
        ranks=outs,
    )
    errors = [o.get("error") for o in outs if o.get("error")]
    if errors:
        result["error"] = errors[0]
        result["traceback"] = next((o.get("traceback") for o in outs if o.get("traceback")), None)
        return result
    nrep = min(len(o["repeats"]) for o in outs)
    per_rep = []
    for i in range(nrep):
        slowest = max(o["repeats"][i]["seconds"] for o in outs)
        total = sum(o["needed_bytes"] for o in outs)
        slow_rank = max(outs, key=lambda o: o["repeats"][i]["seconds"])["repeats"][i]
        per_rep.append(
            dict(
                seconds=slowest,
                **({"critical_path": slow_rank["critical_path"]} if "critical_path" in slow_rank else {}),
                gbps=total / slowest / 1e9,
                storage_read_bytes=sum(o["repeats"][i]["storage_read_bytes"] for o in outs),
                cpu_seconds=sum(o["repeats"][i]["cpu_seconds"] for o in outs),
                anon_added_bytes=0,
            )
        )
    result["needed_bytes"] = sum(o["needed_bytes"] for o in outs)
    result["repeats"] = per_rep
    result.update(summarize(per_rep))
    result["verify"] = {
        "checked": sum(o["verify"].get("checked", 0) for o in outs),
        "mismatched": sum(o["verify"].get("mismatched", 0) for o in outs),
        "bad": [k for o in outs for k in o["verify"].get("bad", [])][:5],
    }
    result["peak_rss_bytes"] = max(o["peak_rss_bytes"] for o in outs)
    return result


# ---------------------------------------------------------------------------------------------------------
# Planning: a DeepSeek-sized header, one virtual rank of 8


def expert_parallel_model(checkpoint: str, world: int, rank: int) -> Any:
    """The checkpoint's causal LM on meta, its stacked experts ``Shard(0)`` over ``world`` ranks of torch's fake
    process group (as rank ``rank``), every other parameter replicated: the planning row's model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    mesh = fake_world(world, rank)
    config = AutoConfig.from_pretrained(checkpoint)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    for name, module in list(model.named_modules()):
        for pname, p in list(module.named_parameters(recurse=False)):
            dim = 0 if pname in ("gate_up_proj", "down_proj") and name.endswith("experts") else None
            local_shape = list(p.shape)
            if dim is not None:
                local_shape[0] //= world
            local = torch.empty(local_shape, dtype=p.dtype, device="meta")
            setattr(
                module, pname, torch.nn.Parameter(as_dtensor(local, mesh, dim, tuple(p.shape)), requires_grad=False)
            )
    return model


def run_plan(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    import hp_fastload
    from hp_fastload.model.regions import virtual_rank

    ckpt, world, rank = cfg["ckpt"], cfg["world"], cfg["rank"]
    model = expert_parallel_model(ckpt, world, rank)
    from hp_fastload.source import files as engine

    times = []
    plan = None
    for _ in range(cfg["repeats"]):
        engine.clear_cache()
        t = time.perf_counter()
        plan = hp_fastload.plan(model, ckpt, mesh_override=virtual_rank(rank))
        times.append(time.perf_counter() - t)
    assert plan is not None
    tensors = sum(len(engine.SafetensorsFile(p)) for p in checkpoint_files(ckpt))
    torch.distributed.destroy_process_group()
    return dict(
        kind="plan",
        workload=cfg["workload"],
        scenario="ep",
        loader="hp_plan",
        regime="warm",
        world=world,
        rank=rank,
        tensors=tensors,
        seconds=statistics.median(times),
        seconds_min=min(times),
        repeats=[{"seconds": t} for t in times],
        loaded=len(plan.report.loaded_keys),
        missing=len(plan.report.missing_keys),
        unexpected=len(plan.report.unexpected_keys),
        needed_bytes=plan.bytes_needed,
        verify={"checked": 1, "mismatched": 0 if not plan.report.missing_keys else 1, "bad": []},
    )


# ---------------------------------------------------------------------------------------------------------
# Anchors


def run_anchors(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    files = checkpoint_files(cfg["ckpt"])
    nbytes = cfg["memcpy_bytes"]
    out: dict[str, Any] = dict(kind="anchors", read_ahead_kb=read_ahead_kb(), cores=CORES)
    out["memcpy_1t_gbps"] = memcpy_gbps(nbytes, 1)
    out["memcpy_2t_gbps"] = memcpy_gbps(nbytes, 2)
    if cfg.get("box_copy", True):
        for sc in ("s0", "s1"):
            out[f"box_copy_{sc}_gbps"] = box_copy_gbps(cfg["ckpt"], sc, 8, 3)
    seq = [cold_read_gbps(files, 1) for _ in range(cfg["repeats"])]
    par = [cold_read_gbps(files, CORES) for _ in range(cfg["repeats"])]
    out["cold_seq"] = seq
    out["cold_par"] = par
    out["cold_seq_gbps"] = statistics.median(r["gbps"] for r in seq)
    out["cold_par_gbps"] = statistics.median(r["gbps"] for r in par)
    out["cold_verified"] = all(r["resident_pages_before"] == 0 for r in seq + par)
    warm(files)
    # Warm mapped reads depend on the page cache's folio sizes: files read by plain sequential reads (as `warm`
    # does) are cached in 2 MiB folios that map with one PMD each when memory allows, forced read-ahead leaves
    # small folios; Shard(1) column reads measured 2.5x apart between the two (docs/perf-notes.md, session 5).
    out["file_huge_pages_mib"] = file_huge_pages_mib()
    del torch
    return out


def file_huge_pages_mib() -> int | None:
    """``FileHugePages`` of ``/proc/meminfo`` (page cache held in PMD-sized folios), MiB; None where absent."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("FileHugePages:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return None


def run_one(cfg: dict[str, Any]) -> dict[str, Any]:
    kind = cfg["kind"]
    try:
        if kind == "raw":
            return run_raw(cfg)
        if kind == "e2e":
            return run_e2e(cfg)
        if kind == "plan":
            return run_plan(cfg)
        if kind == "anchors":
            return run_anchors(cfg)
        raise ValueError(kind)
    except Exception as exc:
        return dict(
            {
                k: cfg[k]
                for k in ("kind", "workload", "scenario", "loader", "regime", "world", "rank", "round")
                if k in cfg
            },
            error=f"{type(exc).__name__}: {exc}",
            traceback=traceback.format_exc()[-3000:],
        )


def worker_main(config_path: str, result_path: str) -> None:
    with open(config_path) as f:
        cfgs = json.load(f)
    results = []
    for cfg in cfgs:
        for k, v in cfg.get("env", {}).items():
            os.environ[k] = v
        results.append(run_one(cfg))
        with open(result_path, "w") as f:  # partial results survive a later crash or timeout
            json.dump(results, f)


def chunks(seq: list[Any], n: int) -> Iterator[list[Any]]:
    for i in range(0, len(seq), n):
        yield seq[i : i + n]
