"""``hp-fastload plan CKPT --layout A --transfer-to B``: the message table of ``hf.transfer`` between two layouts of
a tiny Mixtral's config, planned on meta models under the fake process group. Each destination rank's needs must
be what ``hp-fastload plan --all-ranks --layout B`` says that rank reads from the checkpoint (the load plan's
bytes), and every needed byte must arrive once (received or copied)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hp_fastload.cli.main import main
from tests.helpers.tiny_models import tiny_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("transfer_plan") / "mixtral"
    tiny_model("mixtral", seed=5).to(torch.bfloat16).save_pretrained(root)
    return root


def _json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(("source", "destination"), [("fsdp", "tp"), ("tp", "fsdp"), ("fsdp", "2d")])
def test_the_table_delivers_each_destination_byte_once(
    checkpoint: Path, capsys: pytest.CaptureFixture[str], source: str, destination: str
) -> None:
    table = _json(capsys, str(checkpoint), "--world", "4", "--layout", source, "--transfer-to", destination)
    loads = _json(capsys, str(checkpoint), "--world", "4", "--layout", destination, "--all-ranks")
    assert table["needed_by_rank"] == [rank["bytes_needed"] for rank in loads["ranks"]]
    assert [r + c for r, c in zip(table["received_by_rank"], table["copied_by_rank"], strict=True)] == table[
        "needed_by_rank"
    ]
    assert sum(table["sent_by_rank"]) == sum(table["received_by_rank"]) > 0
    assert table["messages"] > 0 and table["rounds"] >= 1 and table["inexact"] == []


def test_the_text_table(checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(checkpoint), "--world", "2", "--layout", "tp", "--transfer-to", "fsdp"]) == 0
    out = capsys.readouterr().out
    assert "source: tp" in out and "destination: fsdp" in out
    assert "moved / needed = 1.00" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:2] in (["0", "1"], ["1", "0"])]
    assert len(rows) == 2 and all(int(row[2]) > 0 for row in rows)
