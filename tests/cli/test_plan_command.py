"""``hp-fastload plan`` (issue 15, item 4): the CLI's virtual plans against ``hp_fastload.plan`` on real ranks.

Each layout's model is built on meta from a transformers checkpoint, laid out for 2 ranks and planned by the CLI
in one process (fake process group, virtual ranks, ``--all-ranks --json``); the same layout function then runs
on 2 real gloo ranks, each materializing its model and calling ``hp_fastload.plan``. Bytes, files touched,
region targets and deferred groups must be equal rank for rank. Also: errors are one line, every option has
help, and ``inspect | head`` ends quietly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.tiny_models import TINY_DECODER, config_of

ROOT_ENV = "HPF_CLI_PLAN_ROOT"
#: Odd vocabulary and expert counts: the two ranks' shards differ in size.
_SIZES: dict[str, Any] = dict(TINY_DECODER, vocab_size=65)
CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(_SIZES, tie_word_embeddings=True),
    "qwen3_moe": dict(_SIZES, num_experts=3, num_experts_per_tok=2, moe_intermediate_size=8),
}
#: (family, layout, --mesh) cases
CASES = [
    ("llama", "fsdp", None),
    ("llama", "tp", None),
    ("qwen3_moe", "fsdp", None),
    ("qwen3_moe", "tp", None),
    ("qwen3_moe", "tp+fsdp", "1x2"),
    ("qwen3_moe", "ep", None),
    ("qwen3_moe", "2d", "1x2"),
]


def _cli_python(code: str, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2] / "python"), OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _mesh(text: str | None) -> tuple[int, ...] | None:
    return None if text is None else tuple(int(s) for s in text.split("x"))


def check_real_plans(rank: int, world: int) -> dict[str, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM

    import hp_fastload
    from hp_fastload.model.layouts import apply_layout

    out = {}
    for family, layout, mesh in CASES:
        path = Path(os.environ[ROOT_ENV]) / family
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.bfloat16)
        apply_layout(model, layout, world, _mesh(mesh))
        model.to_empty(device="cpu")
        plan = hp_fastload.plan(model, path)
        out[f"{family}/{layout}"] = {
            "bytes_needed": plan.bytes_needed,
            "files": dict(sorted(plan.read_bytes_by_file().items())),
            "deferred": [d.label for d in plan.deferred],
            "region_targets": len(plan.region_reads),
            "missing": len(plan.report.missing_keys),
        }
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("cli_plan")
    for family, sizes in CONFIGS.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config_of(family, **sizes)).to(torch.bfloat16)
        model.save_pretrained(root / family, max_shard_size="20KB")  # several files: files touched differ by rank
    return root


_RUN_ALL = """
import contextlib, io, json, sys
from hp_fastload.cli import main
out = {}
for case, argv in json.loads(sys.argv[1]).items():
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        status = main(argv)
    out[case] = {"status": status, "stdout": buffer.getvalue()}
print(json.dumps(out))
"""


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_cli_layouts_equal_hp_fastload_plan_on_real_ranks(checkpoints):
    argvs = {}
    for family, layout, mesh in CASES:
        args = ["plan", str(checkpoints / family), "--world", "2", "--layout", layout, "--all-ranks", "--json"]
        argvs[f"{family}/{layout}"] = args + (["--mesh", mesh] if mesh else [])
    # one interpreter runs the CLI's main for every case (each plan starts and ends its own fake process group)
    proc = _cli_python(_RUN_ALL, json.dumps(argvs))
    os.environ[ROOT_ENV] = str(checkpoints)
    try:
        real = run_distributed(check_real_plans, 2, timeout=500)
    finally:
        os.environ.pop(ROOT_ENV)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    results = json.loads(stdout.strip().splitlines()[-1])
    compared = 0
    for case, result in results.items():
        assert result["status"] == 0, case
        virtual = json.loads(result["stdout"])["ranks"]
        for rank in range(2):
            got = {k: virtual[rank][k] for k in real[rank][case]}
            assert got == real[rank][case], f"{case} rank {rank}"
            assert got["missing"] == 0 and got["bytes_needed"] > 0
            compared += 1
    assert compared == 2 * len(CASES)
    # the layouts really differ: a check that compared nothing meaningful would see one number everywhere
    assert len({real[0][case]["bytes_needed"] for case in real[0]}) >= 4
    assert sum(real[0][case] != real[1][case] for case in real[0]) >= 5  # and so do the ranks


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--world", "3", "--layout", "2d"], "layout 2d on 3 ranks: pass --mesh"),
        (["--world", "4", "--rank", "4"], "--rank 4 is not a rank of --world 4 (0..3)"),
        (["--world", "4", "--layout", "tp+fsdp", "--mesh", "2x3"], "--mesh 2x3 does not multiply to --world 4"),
        (["--world", "0"], "--world must be at least 1"),
    ],
)
def test_plan_errors_are_one_line(checkpoints, capsys, args, message):
    from hp_fastload.cli import main

    assert main(["plan", str(checkpoints / "llama"), *args]) == 1
    stderr = capsys.readouterr().err
    assert stderr.splitlines() == [stderr.strip()] and stderr.startswith(f"hp-fastload plan: error: {message}")


def test_a_missing_checkpoint_is_one_line(tmp_path, capsys):
    from hp_fastload.cli import main

    assert main(["plan", str(tmp_path / "nope"), "--world", "2"]) == 1
    stderr = capsys.readouterr().err
    assert len(stderr.strip().splitlines()) == 1, stderr
    assert "checkpoint not found" in stderr and str(tmp_path / "nope") in stderr


def test_every_plan_option_has_help():
    from hp_fastload.cli.main import build_parser

    parser = build_parser()
    plan = parser._subparsers._group_actions[0].choices["plan"]  # type: ignore[union-attr]
    options = [a for a in plan._actions if a.dest != "help"]
    assert {a.dest for a in options} >= {"checkpoint", "world", "rank", "layout", "mesh", "all_ranks", "json"}
    assert all(a.help for a in options), [a.dest for a in options if not a.help]


def test_inspect_into_head_ends_quietly(tmp_path):
    from safetensors.torch import save_file

    save_file({f"layer.{i}.weight": torch.zeros(2) for i in range(5000)}, tmp_path / "model.safetensors")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2] / "python"))
    command = f"{sys.executable} -m hp_fastload.cli inspect {tmp_path} | head -n 2"
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env, timeout=120)
    assert len(done.stdout.splitlines()) == 2
    assert done.stderr == "", done.stderr
