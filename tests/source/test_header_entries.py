"""A big header's entries are built when asked for (``SafetensorsFile`` above ``EAGER_ENTRIES`` tensors):
the same keys, order, membership, entries and index answers as the eager dict, checked against
safetensors' own reads of a file written by ``save_file``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hp_fastload.api.read import read_many
from hp_fastload.source import files as engine
from hp_fastload.source.files import SafetensorsFile
from hp_fastload.source.index import CheckpointIndex


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    g = torch.Generator().manual_seed(1)
    tensors = {}
    for i in range(12):
        tensors[f"layers.{i}.w"] = torch.randn(3, i + 1, generator=g)
        tensors[f"layers.{i}.b"] = torch.randn(i + 2, generator=g).to(torch.bfloat16)
        tensors[f"layers.{i}.q"] = torch.randint(-5, 5, (2, 2), generator=g, dtype=torch.int8)
    path = tmp_path_factory.mktemp("lazy") / "model.safetensors"
    save_file(tensors, str(path))
    return path


def _opened(path: Path, eager: int, monkeypatch: pytest.MonkeyPatch) -> SafetensorsFile:
    engine.clear_cache()
    monkeypatch.setattr(engine, "EAGER_ENTRIES", eager)
    return SafetensorsFile(path)


def test_lazy_entries_answer_like_the_eager_dict_and_safetensors(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lazy = _opened(ckpt, 0, monkeypatch)
    eager = _opened(ckpt, 1 << 20, monkeypatch)
    assert not lazy._entries and len(eager._entries) == 36  # the two paths under test
    raw = ckpt.read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    header.pop("__metadata__", None)
    in_file_order = sorted(header, key=lambda k: header[k]["data_offsets"])
    assert list(lazy) == lazy.keys() == list(eager) == in_file_order
    assert len(lazy) == len(eager) == len(in_file_order)
    with safe_open(str(ckpt), "pt") as st:
        for position, key in enumerate(in_file_order):
            a, b = lazy.entry(key), eager.entry(key)
            assert (a.position, a.dtype, a.shape, a.begin, a.end) == (b.position, b.dtype, b.shape, b.begin, b.end)
            assert (a.position, [a.begin, a.end]) == (position, header[key]["data_offsets"])
            assert (a.dtype, list(a.shape)) == (st.get_slice(key).get_dtype(), st.get_slice(key).get_shape())
            assert key in lazy
    for missing in ("layers.12.w", "layers.1", "", 3, None):
        assert missing not in lazy
    with pytest.raises(KeyError, match=r"no tensor named 'layers\.12\.w'"):
        lazy.entry("layers.12.w")


def test_a_lazy_index_locates_detects_and_reads_like_an_eager_one(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    answers = []
    for eager in (0, 1 << 20):
        engine.clear_cache()
        monkeypatch.setattr(engine, "EAGER_ENTRIES", eager)
        index = CheckpointIndex.open(ckpt)
        assert bool(index.files[0]._entries) == bool(eager)
        located = [index.locate(k)[1:] for k in index]
        answers.append((index.keys(), located, sorted(index.keys_not_stored_as(["F32", "BF16"]))))
        out = torch.empty(3, 5)
        read_many([(index.files[0], "layers.4.w", (0, 0), (3, 5), out)])
        with safe_open(str(ckpt), "pt") as st:
            assert torch.equal(out, st.get_tensor("layers.4.w"))
    assert answers[0] == answers[1]
    assert answers[0][2] == sorted(f"layers.{i}.q" for i in range(12))  # the I8 tensors
