"""The engine API against safetensors' own reader and torch's own casts."""

from __future__ import annotations

import math
import os
import threading
import time

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import hp_fastload as hf
from hp_fastload import _core, formats
from hp_fastload.execute import requests as packing
from hp_fastload.source.files import open_file
from tests.helpers.bits import bits

BACKENDS = ["mmap", "pread", "auto"]
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2]
ALL_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.complex64,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    *FLOATS,
]
BITS_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype == torch.complex64:
        return torch.randn(shape, dtype=torch.complex64, generator=gen)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 4).to(dtype)
    raw = torch.randint(0, 256, (*shape, torch.empty((), dtype=dtype).element_size()), generator=gen)
    return raw.to(torch.uint8).view(dtype).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


def strided_view(lengths: list[int], dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A view of shape `lengths` into a larger zeroed tensor: dims permuted and padded."""
    n = len(lengths)
    perm = torch.randperm(n, generator=gen).tolist() if n else []
    big_shape = [lengths[p] + 2 for p in perm]
    big = torch.zeros(big_shape, dtype=dtype)
    view = big[tuple(slice(1, 1 + lengths[p]) for p in perm)]
    inverse = [perm.index(d) for d in range(n)]
    return big, view.permute(inverse) if n else view


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_random_boxes_into_strided_views(tmp_path, dtype, backend):
    gen = torch.Generator().manual_seed(hash((str(dtype), backend)) % 2**31)
    shapes = {"a": (7, 5, 3), "b": (11, 9), "c": (13,), "d": ()}
    tensors = {k: random_tensor(s, dtype, gen) for k, s in shapes.items()}
    path = tmp_path / "t.safetensors"
    save_file(tensors, str(path))
    with safe_open(str(path), "pt") as ref:
        for _ in range(6):
            for key, shape in shapes.items():
                offsets = [int(torch.randint(0, s, (), generator=gen)) for s in shape]
                lengths = [
                    int(torch.randint(0, s - o + 1, (), generator=gen)) for o, s in zip(offsets, shape, strict=True)
                ]
                big, out = strided_view(lengths, dtype, gen)
                hf.read_into(path, key, offsets, lengths, out, backend=backend, threads=2)
                want = ref.get_slice(key)[tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))]
                assert same_bits(out, want), (key, offsets, lengths)
                assert int(bits(big).count_nonzero()) == int(bits(out).count_nonzero())


def special_values() -> torch.Tensor:
    tiny = [2.0**-e for e in (6, 7, 9, 10, 14, 15, 16, 17, 24, 25, 26, 126, 127, 133, 149)]
    big = [
        448.0,
        464.0,
        479.9,
        480.0,
        57344.0,
        61439.0,
        61440.0,
        65504.0,
        65519.9,
        65520.0,
        3.3895e38,
        3.4e38,
    ]
    ties = [
        1 + 2.0**-8,
        1 + 3 * 2.0**-8,
        1 + 2.0**-11,
        1 + 3 * 2.0**-11,
        1 + 2.0**-3,
        1 + 3 * 2.0**-4,
        1.5,
        2.5,
    ]
    odd = [1e300, 1e-300, 1 + 2.0**-11 + 2.0**-40, 0.1, 1 / 3]
    vals = [0.0, float("inf"), float("nan"), *tiny, *big, *ties, *odd]
    vals += [v * 1.5 for v in tiny] + [v * 0.75 for v in tiny]
    t = torch.tensor(vals, dtype=torch.float64)
    return torch.cat([t, -t])


def cast_sources(gen: torch.Generator) -> torch.Tensor:
    wide = torch.randn(4000, generator=gen, dtype=torch.float64) * torch.exp2(
        torch.randint(-140, 130, (4000,), generator=gen).double()
    )
    return torch.cat([special_values(), wide])


def assert_same_cast(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-exact except that any NaN matches any NaN (torch's own NaN bits vary between code paths)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    size = want.element_size()
    gb, wb = got.view(BITS_VIEW[size]), want.view(BITS_VIEW[size])
    nan = want.float().isnan() if size == 1 else want.isnan()
    got_nan = got.float().isnan() if size == 1 else got.isnan()
    assert torch.equal(got_nan, nan)
    bad = (gb != wb) & ~nan
    if bad.any():
        i = int(bad.nonzero()[0])
        raise AssertionError(f"{int(bad.sum())} mismatches, e.g. {want[i]!r}: got {gb[i]:#x}, want {wb[i]:#x}")


@pytest.mark.parametrize("src", FLOATS, ids=str)
def test_every_float_cast_matches_torch(tmp_path, src):
    gen = torch.Generator().manual_seed(1)
    values = cast_sources(gen).to(src)
    path = tmp_path / "c.safetensors"
    save_file({"v": values}, str(path))
    for dst in FLOATS:
        for backend in ("mmap", "pread"):
            out = torch.empty(values.shape, dtype=dst)
            hf.read_into(path, "v", [0], list(values.shape), out, backend=backend)
            assert_same_cast(out, values.to(dst))


@pytest.mark.parametrize("src", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_dense_sweeps_match_torch(tmp_path, src):
    """Every 16-bit pattern (and 2^20 random f32 patterns) through every float destination."""
    if src == torch.float32:
        bits = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=torch.Generator().manual_seed(2))
        values = bits.to(torch.int32).view(torch.float32)
    else:
        values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(src)
    path = tmp_path / "s.safetensors"
    save_file({"v": values}, str(path))
    for dst in FLOATS:
        out = torch.empty(values.shape, dtype=dst)
        hf.read_into(path, "v", [0], list(values.shape), out)
        assert_same_cast(out, values.to(dst))


@pytest.mark.parametrize("backend", BACKENDS)
def test_read_many_across_files_in_one_call(tmp_path, backend):
    gen = torch.Generator().manual_seed(3)
    files = {}
    for i in range(3):
        tensors = {f"w{i}.{j}": random_tensor((17, 33), torch.bfloat16, gen) for j in range(3)}
        path = tmp_path / f"m-{i}.safetensors"
        save_file(tensors, str(path))
        files[path] = tensors
    big = torch.zeros(9 * 17, 40, dtype=torch.float32)
    requests = []
    wants = []
    for n, (path, tensors) in enumerate(files.items()):
        f = hf.SafetensorsFile(path) if n % 2 else path
        for j, (key, t) in enumerate(tensors.items()):
            row = (3 * n + j) * 17
            out = big[row : row + 17, 3 : 3 + 20]
            requests.append((f, key, [0, 7], [17, 20], out))
            wants.append((out, t[:, 7:27].float()))
    stats = hf.read_many(requests, threads=2, backend=backend)
    assert stats["bytes_copied"] == 9 * 17 * 20 * 4
    assert stats["runs"] == 9 * 17
    for out, want in wants:
        assert torch.equal(out, want)
    assert big[:, :3].abs().sum() == 0 and big[:, 23:].abs().sum() == 0


def _mixed_requests(tmp_path):
    """Requests of every form ``read_many`` takes: ranks 0-3, casts, strided views, paths and open files,
    a sub-byte dtype (read as bytes), numpy offsets and an ``out`` sharing storage with others."""
    gen = torch.Generator().manual_seed(11)
    a = {"a3": random_tensor((5, 4, 6), torch.bfloat16, gen), "a1": random_tensor((9,), torch.float32, gen)}
    b = {"b2": random_tensor((7, 8), torch.float16, gen), "b0": random_tensor((), torch.bfloat16, gen)}
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"))
    save_file({"q": torch.arange(64, dtype=torch.uint8).view(16, 4)}, str(tmp_path / "q.safetensors"))
    q = tmp_path / "q.safetensors"
    text = q.read_bytes()
    q.write_bytes(text.replace(b'"U8"', b'"F4"').replace(b"[16,4]", b"[16,8]"))  # 16x8 F4 = the same 64 bytes
    fb = hf.SafetensorsFile(tmp_path / "b.safetensors")
    shared = torch.zeros(40, 12, dtype=torch.float32)
    requests = [
        (tmp_path / "a.safetensors", "a3", [1, 0, 2], [3, 4, 3], strided_view([3, 4, 3], torch.bfloat16, gen)[1]),
        (str(tmp_path / "a.safetensors"), "a1", np.array([2]), (5,), torch.zeros(5, dtype=torch.float64)),
        (fb, "b2", [0, 1], [7, 6], shared[0:7, 0:6]),
        (fb, "b2", [3, 0], [2, 8], shared[10:12, 2:10]),
        (fb, "b0", [], [], torch.zeros((), dtype=torch.float32)),
        (q, "q", [2, 0], [3, 8], torch.zeros(12, dtype=torch.uint8)),
        (tmp_path / "a.safetensors", "a3", [0, 0, 0], [0, 4, 6], torch.zeros(0, 4, 6, dtype=torch.bfloat16)),
        (fb, "b2", [6, 7], [1, 1], shared[20:21, 11:12].t()),
    ]
    return requests


def test_read_many_bulk_packing_equals_the_per_request_checks(tmp_path):
    """The bulk packer's rows equal those of the per-request path (``_fill_item``), field for field."""
    requests = _mixed_requests(tmp_path)
    fill = packing.fill_item
    one_by_one = []

    def counted(row, f, key, *args):
        one_by_one.append(key)
        return fill(row, f, key, *args)

    packing.fill_item = counted
    try:
        files, dests, rows = packing.pack_requests(requests)
    finally:
        packing.fill_item = fill
    assert one_by_one == ["q"]  # only the sub-byte request leaves the bulk path
    for k, (source, key, offsets, lengths, out) in enumerate(requests):
        f = open_file(source)
        want = np.zeros(formats.ITEM_WIDTH, dtype=np.int64)
        dest = packing.fill_item(want, f, key, offsets, lengths, out)
        got = rows[k]
        assert files[got[formats.COL_FILE]] is f, k
        assert got[formats.COL_TENSOR] == f.tensor_index(key), k
        assert dests[got[formats.COL_DEST]] == dest, k
        fields = [
            c for c in range(formats.ITEM_WIDTH) if c not in (formats.COL_FILE, formats.COL_TENSOR, formats.COL_DEST)
        ]
        assert got[fields].tolist() == want[fields].tolist(), k
    assert len(set(dests)) == len(dests)
    # and the bytes: each box equals safetensors' own slice
    hf.read_many(requests)
    for source, key, offsets, lengths, out in requests:
        if key == "q":
            continue
        path = source.path if isinstance(source, hf.SafetensorsFile) else str(source)
        with safe_open(path, "pt") as ref:
            want = ref.get_slice(key)[tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))]
        assert torch.equal(out, want.to(out.dtype)), key


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({3: ("b2", [6, 0], [2, 6])}, "dim 0: offset 6 \\+ length 2"),
        ({1: ("nope", [0], [5])}, "no tensor named 'nope'"),
        ({2: ("b2", [0, 1, 0], [7, 6, 1])}, "must have one entry per dim"),
        ({3: ("b2", [3, 0], [2, 7])}, "out has shape \\[2, 8\\] but the box has lengths \\[2, 7\\]"),
        # two bad requests: the first in request order is named, whichever check finds each
        ({2: ("b2", [0, 1], [7, 9]), 1: ("nope", [0], [5])}, "no tensor named 'nope'"),
        ({1: ("a1", [6], [5]), 2: ("nope", [0], [1])}, "offset 6 \\+ length 5 is outside"),
        ({1: ("a1", [2.5], ["x"])}, "must be a sequence of ints"),
    ],
)
def test_read_many_names_the_first_bad_request(tmp_path, bad, message):
    requests = _mixed_requests(tmp_path)
    outs = [r[4].clone() for r in requests]
    for k, (key, offsets, lengths) in bad.items():
        requests[k] = (requests[k][0], key, offsets, lengths, requests[k][4])
    with pytest.raises(hf.PlanError, match=message):
        hf.read_many(requests)
    for (_, _, _, _, out), before in zip(requests, outs, strict=True):
        assert torch.equal(out, before)  # nothing was written


def test_read_many_bulk_path_refuses_what_the_per_request_checks_refuse(tmp_path):
    requests = _mixed_requests(tmp_path)
    a = tmp_path / "a.safetensors"
    cases = [
        # an offset near 2**63: the bulk bounds test must not overflow into a valid-looking box
        ((a, "a3", [0, 2**63 - 1, 0], [1, 1, 6], torch.zeros(1, 1, 6, dtype=torch.bfloat16)), "dim 1: offset"),
        ((a, "a3", [2**62, 0, 0], [2**62, 4, 6], torch.zeros(1, 4, 6, dtype=torch.bfloat16)), "dim 0: offset"),
        # an out of another rank than the tensor (a flat buffer; and one with more dims)
        ((a, "a3", [0, 0, 0], [2, 3, 4], torch.zeros(24, dtype=torch.bfloat16)), "out has shape \\[24\\]"),
        ((a, "a1", [0], [4], torch.zeros(2, 2)), "out has shape \\[2, 2\\]"),
    ]
    for bad, message in cases:
        batch = [*requests[:2], bad, *requests[2:]]
        with pytest.raises(hf.PlanError, match=message):
            hf.read_many(batch)
        # the first bad request is named even when a later one fails another way
        with pytest.raises(hf.PlanError, match=message):
            hf.read_many([*batch, (a, "nope", [0], [1], torch.zeros(1))])


def test_read_many_takes_any_iterable(tmp_path):
    requests = _mixed_requests(tmp_path)
    as_dict = dict(enumerate(requests))
    assert hf.read_many(as_dict.values())["bytes_copied"] == hf.read_many(requests)["bytes_copied"] > 0
    assert hf.read_many(iter(requests))["runs"] == hf.read_many(tuple(requests))["runs"]


def test_zero_dim_and_empty_boxes(tmp_path):
    path = tmp_path / "z.safetensors"
    save_file(
        {"s": torch.tensor(2.5, dtype=torch.bfloat16), "e": torch.zeros(0, 4), "m": torch.ones(3, 4)},
        str(path),
    )
    out = torch.zeros((), dtype=torch.float64)
    hf.read_into(path, "s", [], [], out)
    assert out.item() == 2.5
    empty = torch.zeros(0, 4)
    assert hf.read_into(path, "e", [0, 0], [0, 4], empty)["bytes_copied"] == 0
    part = torch.zeros(3, 0)
    assert hf.read_into(path, "m", [0, 4], [3, 0], part)["runs"] == 0
    assert hf.read_many([])["runs"] == 0


def test_engine_runs_a_prebuilt_item_array(tmp_path):
    path = tmp_path / "n.safetensors"
    w = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    save_file({"w": w}, str(path))
    f = hf.SafetensorsFile(path)
    out = torch.zeros(6, 4)
    items = np.zeros((1, formats.ITEM_WIDTH), dtype=np.int64)
    items[0, formats.COL_TENSOR] = f.tensor_index("w")
    items[0, formats.COL_NDIM] = 2
    items[0, formats.COL_LENGTHS : formats.COL_LENGTHS + 2] = [4, 6]
    items[0, formats.COL_SRC_STRIDES : formats.COL_SRC_STRIDES + 2] = [6, 1]
    items[0, formats.COL_DST_STRIDES : formats.COL_DST_STRIDES + 2] = [1, 4]  # transpose into `out`
    dest = (out.data_ptr(), out.untyped_storage().nbytes(), formats.DTYPE_CODES["F32"])
    stats = _core.execute(
        [f.header], np.asarray([dest], dtype="<i8").tobytes(), items.tobytes(), threads=1, backend="pread"
    )
    assert torch.equal(out, w.t())
    assert stats["backend"] == "pread" and stats["threads"] == 1


def test_sub_byte_reads_into_uint8(tmp_path):
    raw = torch.arange(32, dtype=torch.uint8)
    path = tmp_path / "f4.safetensors"
    save_file({"q": raw.reshape(4, 8)}, str(path))
    # Relabel the tensor as F4 [4, 16] (same bytes): safetensors cannot write F4 from torch.
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = data[8 : 8 + n].decode().replace('"U8"', '"F4"').replace("[4,8]", "[4,16]").encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + data[8 + n :])
    f = hf.SafetensorsFile(path)
    assert f.dtype("q") == "F4" and f.shape("q") == (4, 16) and f.torch_dtype("q") == torch.uint8
    out = torch.zeros(2, 8, dtype=torch.uint8)
    hf.read_into(f, "q", [1, 0], [2, 16], out)
    assert torch.equal(out.reshape(-1), raw[8:24])
    half = torch.zeros(4, dtype=torch.uint8)
    hf.read_into(f, "q", [3, 8], [1, 8], half)
    assert torch.equal(half, raw[28:32])
    with pytest.raises(hf.PlanError, match="byte boundaries"):
        hf.read_into(f, "q", [0, 1], [1, 2], torch.zeros(1, dtype=torch.uint8))
    with pytest.raises(hf.PlanError, match="smaller than a byte"):
        hf.read_into(f, "q", [0, 0], [1, 16], torch.zeros(1, 16))


def test_safetensors_file_api_matches_safe_open(tmp_path):
    path = tmp_path / "api.safetensors"
    tensors = {
        "b": torch.zeros(2, 3, dtype=torch.bfloat16),
        "a": torch.zeros(5, dtype=torch.int64),
        "c": torch.zeros((), dtype=torch.float8_e4m3fn),
    }
    save_file(tensors, str(path), metadata={"format": "pt", "x": "y"})
    f = hf.SafetensorsFile(path)
    with safe_open(str(path), "pt") as ref:
        assert sorted(f.keys()) == sorted(ref.keys())
        assert f.metadata() == ref.metadata()
        for key in ref.keys():  # noqa: SIM118 - safe_open is not a mapping
            sl = ref.get_slice(key)
            assert f.shape(key) == tuple(sl.get_shape())
            assert f.dtype(key) == sl.get_dtype()
            assert f.torch_dtype(key) == tensors[key].dtype
            begin, end = f.offsets(key)
            assert end - begin == tensors[key].numel() * tensors[key].element_size()
    assert len(f) == 3 and "a" in f and "z" not in f
    assert [f.tensor_index(k) for k in f] == list(range(3))  # header (file) order
    with pytest.raises(KeyError):
        f.tensor_index("z")
    with pytest.raises(KeyError, match="no tensor named 'z'"):
        f.shape("z")
    data = path.read_bytes()
    begin, end = f.offsets("a")
    assert data[begin:end] == bytes(40)
    assert f.file_size == len(data) == f.header.file_size
    assert f.header.data_start == 8 + int.from_bytes(data[:8], "little")


def test_header_entry_fields_match_the_file(tmp_path):
    """``SafetensorsFile.entry`` gives each tensor's record by name: dtype and shape as safetensors reads them,
    the byte range and order of the header JSON (read here with ``json``), immutable."""
    import json

    path = tmp_path / "entries.safetensors"
    tensors = {
        "w": torch.ones(3, 2, dtype=torch.bfloat16),
        "v": torch.arange(7, dtype=torch.int32),
        "s": torch.ones(()),
    }
    save_file(tensors, str(path))
    f = hf.SafetensorsFile(path)
    data = path.read_bytes()
    meta = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    in_file_order = sorted((k for k in meta if k != "__metadata__"), key=lambda k: meta[k]["data_offsets"][0])
    with safe_open(str(path), "pt") as ref:
        for position, key in enumerate(in_file_order):
            entry = f.entry(key)
            assert isinstance(entry, hf.HeaderEntry)
            assert entry.position == position
            assert entry.dtype == ref.get_slice(key).get_dtype()
            assert entry.shape == tuple(ref.get_slice(key).get_shape())
            assert (entry.begin, entry.end) == tuple(meta[key]["data_offsets"])
            assert entry.nbytes == tensors[key].numel() * tensors[key].element_size()
            assert repr(entry).startswith(f"HeaderEntry(position={position}, dtype={entry.dtype}")
    with pytest.raises(AttributeError):
        f.entry("w").shape = (1,)  # type: ignore[misc]
    with pytest.raises(KeyError, match="no tensor named 'z'"):
        f.entry("z")


def test_open_file_cache_reuses_and_invalidates(tmp_path):
    path = tmp_path / "cache.safetensors"
    save_file({"w": torch.ones(4)}, str(path))
    first = open_file(path)
    assert open_file(str(path)) is first
    time.sleep(0.01)
    save_file({"w": torch.ones(8)}, str(path))
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    second = open_file(path)
    assert second is not first and second.shape("w") == (8,)


def test_core_constants():
    assert _core.MAX_NDIM == 8
    assert _core.ITEM_WIDTH == 7 + 3 * 8 == formats.COL_SCALE + 1
    assert _core.SCALE_WIDTH == 3 + 2 * 8
    assert set(_core.CAST_FLOATS) == {"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2", "F8_E8M0"}
    assert set(formats.SAFETENSORS_TO_TORCH) <= set(_core.DTYPE_CODES)
    assert len(set(_core.DTYPE_CODES.values())) == len(_core.DTYPE_CODES)


@pytest.mark.slow
def test_gil_is_released_during_reads(tmp_path):
    rows, cols = 6400, 8192  # 100 MiB of bf16, read as f32
    path = tmp_path / "gil.safetensors"
    save_file({"w": torch.ones(rows, cols, dtype=torch.bfloat16)}, str(path))
    out = torch.empty(rows, cols, dtype=torch.float32)
    f = hf.SafetensorsFile(path)
    samples: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            samples.append(time.perf_counter())
            for _ in range(200):
                pass

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        time.sleep(0.02)
        windows = []
        for _ in range(3):
            t0 = time.perf_counter()
            hf.read_into(f, "w", [0, 0], [rows, cols], out, threads=1, backend="pread")
            windows.append((t0, time.perf_counter()))
    finally:
        stop.set()
        ticker.join()
    assert out[-1, -1].item() == 1.0
    inside = 0
    for t0, t1 in windows:
        margin = (t1 - t0) * 0.25
        inside += sum(1 for s in samples if t0 + margin < s < t1 - margin)
    assert inside > 10, f"{inside} ticks ran during {len(windows)} reads of {math.prod(out.shape) * 4} bytes"


def test_threads_per_rank_shares_the_node(monkeypatch):
    from hp_fastload.execute.threads import threads_per_rank

    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert threads_per_rank() == max(1, min(_core.DEFAULT_THREADS, cores))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores * 4))
    assert threads_per_rank() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert threads_per_rank() == max(1, min(_core.DEFAULT_THREADS, cores // 2))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not a number")
    assert threads_per_rank() == max(1, min(_core.DEFAULT_THREADS, cores))
