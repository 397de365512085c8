"""Command line: ``hp-fastload <command>``.

Each subcommand is a ``_register_<name>(subparsers)`` function that adds its parser and sets ``func``;
:func:`main` dispatches to it. To add a command, write its register function and append it to
``_COMMANDS``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import unicodedata
from collections.abc import Callable, Sequence
from typing import Any

from hp_fastload.errors import HpFastloadError
from hp_fastload.source.files import SafetensorsFile
from hp_fastload.source.objstore import ObjectLocation, is_object_url, list_safetensors, open_objects


def _safetensors_files(path: str) -> list[SafetensorsFile]:
    """The files ``inspect`` lists: ``path`` itself, a directory's ``*.safetensors``, or, for an ``s3://`` URL,
    the object itself (``.safetensors``) or the ``*.safetensors`` objects under the prefix (headers only, fetched
    with ranged GETs)."""
    if is_object_url(path):
        location = ObjectLocation.parse(path)
        urls = [location.url] if location.is_single_object else list_safetensors(location.url)
        if not urls:
            raise FileNotFoundError(f"{path}: no *.safetensors objects under this prefix")
        return open_objects(urls)
    return [SafetensorsFile(p) for p in _safetensors_paths(path)]


def _safetensors_paths(path: str) -> list[str]:
    if os.path.isdir(path):
        found = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
        if not found:
            raise FileNotFoundError(f"{path}: no *.safetensors files in this directory")
        return found
    return [path]


def _printable(text: str) -> str:
    """``text`` safe to print on a terminal: control characters (escape sequences, NUL), format characters
    (bidi overrides such as RLO, zero-width marks), line/paragraph separators, surrogates and unassigned
    code points are written as ``\\xNN`` / ``\\uNNNN`` / ``\\UNNNNNNNN``, and a backslash as ``\\\\`` (so
    the output is unambiguous). Other characters, non-ASCII letters included, print as they are."""
    if text.isprintable() and "\\" not in text:
        return text
    out = []
    for ch in text:
        if ch == "\\":
            out.append("\\\\")
        elif unicodedata.category(ch) in _UNPRINTABLE:
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
        else:
            out.append(ch)
    return "".join(out)


_UNPRINTABLE = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})


def _inspect(args: argparse.Namespace) -> int:
    report: list[dict[str, Any]] = []
    for f in _safetensors_files(args.path):
        path = f.path
        tensors = []
        for key in f:
            begin, end = f.offsets(key)
            tensors.append({"name": key, "dtype": f.dtype(key), "shape": list(f.shape(key)), "bytes": end - begin})
        report.append({"path": path, "file_size": f.file_size, "metadata": f.metadata(), "tensors": tensors})
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    total_tensors = total_bytes = 0
    for entry in report:
        data = sum(t["bytes"] for t in entry["tensors"])
        count, size = len(entry["tensors"]), entry["file_size"]
        print(f"{_printable(entry['path'])}: {count} tensors, {data} data bytes, file {size} bytes")
        for t in entry["tensors"]:
            numel = math.prod(t["shape"])
            name = _printable(t["name"])
            print(f"  {name}  {t['dtype']}  {t['shape']}  {t['bytes']} bytes  ({numel} elements)")
        total_tensors += len(entry["tensors"])
        total_bytes += data
    if len(report) > 1:
        print(f"total: {len(report)} files, {total_tensors} tensors, {total_bytes} data bytes")
    return 0


def _register_inspect(subparsers: Any) -> None:
    p = subparsers.add_parser("inspect", help="list the tensors of a safetensors file or directory")
    p.add_argument("path", help="a .safetensors file or a directory of them (or s3://bucket/prefix[/x.safetensors])")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=_inspect)


def _demo(args: argparse.Namespace) -> int:
    from hp_fastload.cli.demo import run_demo

    return run_demo(checkpoint=args.checkpoint, world=args.world, loader=args.loader)


def _register_demo(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo", help="load a checkpoint into a parallelized model on gloo CPU ranks and check every shard"
    )
    p.add_argument("--checkpoint", help="a transformers causal-LM checkpoint (default: a generated Mixtral)")
    p.add_argument("--world", type=int, default=2, help="number of ranks (4 gives a 2-D FSDP x TP mesh)")
    p.add_argument("--loader", default="dcp", choices=["dcp", "legacy"])
    p.set_defaults(func=_demo)


def _mesh(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a mesh like 2x4") from None
    if len(shape) != 2 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a mesh like 2x4 (two positive sizes)")
    return shape


def _rehearse(args: argparse.Namespace) -> int:
    from hp_fastload.api.ranks import rehearse_rank

    description, report, build_s = rehearse_rank(
        args.checkpoint,
        args.layout,
        args.world,
        args.rank,
        args.mesh,
        args.auto_class,
        threads=args.threads,
        device=args.device,
        staging_bytes=args.staging_mib << 20,
    )
    if args.json:
        row = {"layout": args.layout, "description": description, "world": args.world, "build_seconds": build_s}
        json.dump({**row, **report.as_dict()}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    print(f"layout {args.layout}: {description}; model built on meta in {build_s:.2f} s")
    print(f"rank {args.rank} of {args.world} executed: {report.summary()}")
    return 0


def _simulate(args: argparse.Namespace) -> int:
    """``plan --all-ranks --share job``: the job-wide plan of the layout and its predicted cold starts."""
    from hp_fastload.api.ranks import simulate

    result = simulate(
        args.checkpoint,
        args.layout,
        args.world,
        mesh=args.mesh,
        auto_class=args.auto_class,
        ranks_per_node=args.ranks_per_node,
        storage_gbps=args.storage_gbps,
        network_gbps=args.network_gbps,
        storage_total_gbps=args.storage_total_gbps,
        network_total_gbps=args.network_total_gbps,
        intra_node_gbps=args.intra_node_gbps,
        memory_gbps=args.memory_gbps,
        round_latency_s=args.round_latency_ms / 1e3,
        budget_bytes=args.budget_mib << 20,
    )
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    gb = 1e9
    print(f"layout {args.layout}: {result['layout']}; {result['nodes']} nodes of {result['ranks_per_node']} ranks")
    print(
        f"job needs {result['job_needs_bytes'] / gb:.3f} GB of a {result['checkpoint_bytes'] / gb:.3f} GB checkpoint; "
        f"storage traffic: {result['storage_bytes'] / gb:.3f} GB shared (job), "
        f"{result['storage_bytes_without_sharing'] / gb:.3f} GB without sharing"
    )
    print(f"{'node':>6} {'storage GB':>12} {'sent GB':>10} {'received GB':>12}")
    for n, (r, o, i) in enumerate(
        zip(
            result["per_node_storage_bytes"],
            result["per_node_sent_bytes"],
            result["per_node_received_bytes"],
            strict=True,
        )
    ):
        print(f"{n:>6} {r / gb:>12.3f} {o / gb:>10.3f} {i / gb:>12.3f}")
    print(f"{'rank':>6} {'needs GB':>10} {'received GB':>12} {'read GB':>9}")
    for r, (need, got, read) in enumerate(
        zip(
            result["per_rank_needed_bytes"],
            result["per_rank_received_bytes"],
            result["per_rank_read_bytes"],
            strict=True,
        )
    ):
        print(f"{r:>6} {need / gb:>10.3f} {got / gb:>12.3f} {read / gb:>9.3f}")
    t4, cpu = result["t4_plan_seconds"], result["t4_plan_cpu_seconds"]
    print(
        f"T1 read/needed {result['t1_read_over_needed']:.4f}; T2 max received/needed "
        f"{result['t2_max_received_over_needed']:.4f}; T3 node read balance {result['t3_node_read_balance']:.3f}, "
        f"median request {result['t3_median_request_bytes'] / 2**20:.1f} MiB over {result['chunks']} chunks, "
        f"{result['rounds']} rounds; T4 job-wide planning {t4['t4']:.2f} s ({cpu['t4']:.2f} s CPU): whole plan "
        f"{t4['whole_plan']:.2f} s, all ranks' needs {t4['all_ranks_needs']:.2f} s, job plan {t4['job_plan']:.2f} s "
        f"(headers {t4['headers']:.2f} s, shared with the rank's own load)"
    )
    print(f"predicted cold start at {args.storage_gbps} GB/s storage and {args.network_gbps} GB/s network per node:")
    for strategy, seconds in result["predicted_seconds"].items():
        phases = result["predicted_phases"][strategy]
        shown = ", ".join(f"{name} {t:.2f}" for name, t in phases.items()) if len(phases) > 1 else ""
        print(f"  {strategy:>5}: {seconds:10.2f} s" + (f"  ({shown})" if shown else ""))
    return 0


def _plan(args: argparse.Namespace) -> int:
    from hp_fastload.api.ranks import plan_ranks

    if args.transfer_to is not None:
        return _transfer_plan(args)
    if args.execute:
        if args.all_ranks:
            raise ValueError("--execute rehearses one rank (--rank); it cannot be combined with --all-ranks")
        return _rehearse(args)
    if args.share == "job":
        if not args.all_ranks:
            raise ValueError("--share job plans the whole job: add --all-ranks")
        return _simulate(args)

    ranks = list(range(args.world)) if args.all_ranks else [args.rank]
    description, plans, build_s = plan_ranks(
        args.checkpoint, args.layout, args.world, ranks, args.mesh, args.auto_class
    )
    if args.json:
        rows = [{k: v for k, v in vars(p).items() if k != "summary"} for p in plans]
        json.dump({"layout": description, "world": args.world, "ranks": rows}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    print(f"layout {args.layout}: {description}; model built on meta in {build_s:.2f} s")
    if not args.all_ranks:
        p = plans[0]
        print(
            f"rank {p.rank} of {args.world}: reads {p.bytes_needed:,} bytes from {len(p.files)} files, "
            f"{p.region_targets} region targets, {len(p.deferred)} deferred groups, missing {p.missing}, "
            f"unexpected {p.unexpected}; planned in {p.seconds:.3f} s ({p.cpu_seconds:.3f} s CPU)"
        )
        print("\n".join(map(_printable, p.summary.splitlines())))
        return 0
    print(f"{'rank':>6} {'bytes':>16} {'files':>6} {'deferred':>9} {'missing':>8}")
    for p in plans:
        print(f"{p.rank:>6} {p.bytes_needed:>16,} {len(p.files):>6} {len(p.deferred):>9} {p.missing:>8}")
    per_node = args.ranks_per_node
    print(f"per node ({per_node} ranks each):")
    print(f"{'node':>6} {'bytes':>16} {'files':>6}")
    for node in range(0, args.world, per_node):
        group = plans[node : node + per_node]
        files = {f for p in group for f in p.files}
        print(f"{node // per_node:>6} {sum(p.bytes_needed for p in group):>16,} {len(files):>6}")
    total = sum(p.bytes_needed for p in plans)
    print(f"total storage traffic of the job: {total:,} bytes over {args.world} ranks")
    wall, cpu = sum(p.seconds for p in plans), sum(p.cpu_seconds for p in plans)
    print(f"planned {len(plans)} ranks in {wall:.2f} s ({cpu:.2f} s CPU) after the model's build ({build_s:.2f} s)")
    return 0


def _transfer_plan(args: argparse.Namespace) -> int:
    from hp_fastload.api.transfer_dry import dry_run

    run = dry_run(
        args.checkpoint,
        args.layout,
        args.transfer_to,
        args.world,
        source_mesh=args.mesh,
        destination_mesh=args.transfer_mesh,
        auto_class=args.auto_class,
        budget_bytes=args.budget_mib << 20,
    )
    if args.json:
        plan = run.plan
        json.dump(
            {
                "source": run.source,
                "destination": run.destination,
                "rounds": plan.rounds,
                "messages": len(plan.msg_src),
                "needed_by_rank": plan.needed_by_rank.tolist(),
                "sent_by_rank": plan.sent_by_rank().tolist(),
                "received_by_rank": plan.received_by_rank().tolist(),
                "copied_by_rank": plan.copied_by_rank().tolist(),
                "inexact": run.inexact,
            },
            sys.stdout,
            indent=2,
        )
        sys.stdout.write("\n")
        return 0
    print(run.text())
    return 0


def _register_plan(subparsers: Any) -> None:
    from hp_fastload.model.layouts import LAYOUTS

    p = subparsers.add_parser(
        "plan",
        help="what each rank of a parallel layout reads from a transformers checkpoint (planned on this machine)",
        description="Build the model on the meta device from the checkpoint's config.json, lay it out as "
        "--layout over --world ranks under a fake process group, and plan the load of one rank (or all): bytes, "
        "files touched, deferred groups. Reads headers only.",
    )
    p.add_argument(
        "checkpoint",
        help="a transformers checkpoint directory (config.json + *.safetensors), Hub id or s3://bucket/prefix",
    )
    p.add_argument("--world", type=int, default=8, help="number of ranks of the job (default 8)")
    p.add_argument("--rank", type=int, default=0, help="the rank to plan (default 0; ignored with --all-ranks)")
    p.add_argument(
        "--layout",
        choices=list(LAYOUTS),
        default="tp+fsdp",
        help="fsdp: FSDP2 per layer and root; tp: tensor parallel linears and embedding; tp+fsdp: tensor-parallel "
        "attention on the inner mesh dim, FSDP2 on the outer; ep: experts sharded by expert, the rest replicated; "
        "2d: experts by expert on the inner dim and FSDP-like on the outer; hsdp: FSDP2 on the inner dim, replicated "
        "on the outer (default tp+fsdp)",
    )
    p.add_argument(
        "--mesh",
        type=_mesh,
        default=None,
        help="the 2-D mesh of tp+fsdp, 2d and hsdp as OUTERxINNER, e.g. 2x4 (default WORLD/2 x 2)",
    )
    p.add_argument("--all-ranks", action="store_true", help="plan every rank: a per-rank and a per-node table")
    p.add_argument(
        "--execute",
        action="store_true",
        help="rehearse --rank: allocate its local shards for real, read them from the checkpoint and report bytes, "
        "seconds, GB/s, peak RSS and open descriptors",
    )
    p.add_argument("--threads", type=int, default=None, help="engine threads for --execute (default: the cores)")
    p.add_argument("--device", default="cpu", help="where --execute puts the local shards: cpu (default) or cuda")
    p.add_argument(
        "--staging-mib", type=int, default=512, help="pinned staging of --execute --device cuda, MiB (default 512)"
    )
    p.add_argument(
        "--ranks-per-node", type=int, default=8, help="ranks per node for the --all-ranks node table (default 8)"
    )
    p.add_argument("--auto-class", default=None, help="the transformers class to build (default AutoModelForCausalLM)")
    p.add_argument(
        "--share",
        choices=["none", "job"],
        default="none",
        help="job (with --all-ranks): the job-wide plan (each byte read once per job, each rank sent its own bytes), "
        "per-node storage and network bytes and predicted cold starts of the strategies none / node / job",
    )
    p.add_argument("--storage-gbps", type=float, default=2.0, help="storage GB/s one node reads at (default 2.0)")
    p.add_argument("--network-gbps", type=float, default=12.5, help="network GB/s per node and direction (12.5)")
    p.add_argument(
        "--storage-total-gbps", type=float, default=None, help="the file system's aggregate GB/s cap (default none)"
    )
    p.add_argument(
        "--network-total-gbps", type=float, default=None, help="the network's aggregate GB/s cap (default none)"
    )
    p.add_argument(
        "--intra-node-gbps",
        type=float,
        default=None,
        help="GB/s between ranks of one node (default: free, as over NVLink; gloo on one host: its loopback rate)",
    )
    p.add_argument(
        "--memory-gbps",
        type=float,
        default=None,
        help="GB/s one rank copies received bytes at (default: free; a host core: about 5-10)",
    )
    p.add_argument(
        "--round-latency-ms", type=float, default=0.0, help="one round's agreement and message latency, ms (0)"
    )
    p.add_argument("--budget-mib", type=int, default=512, help="staging + messages per rank per round (MiB)")
    p.add_argument(
        "--transfer-to",
        choices=list(LAYOUTS),
        default=None,
        help="the message table of hf.transfer from --layout to this layout on the same --world ranks (pieces, "
        "messages, rounds, bytes moved per sender and receiver); --budget-mib is the transfer's window",
    )
    p.add_argument("--transfer-mesh", type=_mesh, default=None, help="the 2-D mesh of --transfer-to, as --mesh")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=_plan)


def _info(args: argparse.Namespace) -> int:
    from hp_fastload.support import describe, info

    facts = info()
    print(json.dumps(facts, indent=2) if args.json else describe(facts))
    return 0


def _register_info(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "info", help="versions of the libraries, the CPU's SIMD flags and the kernel level in use (HP_FASTLOAD_SIMD)"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=_info)


_COMMANDS: list[Callable[[Any], None]] = [_register_inspect, _register_demo, _register_plan, _register_info]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every registered subcommand."""
    parser = argparse.ArgumentParser(prog="hp-fastload", description=__doc__.splitlines()[0] if __doc__ else None)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for register in _COMMANDS:
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``hp-fastload``; returns the exit status. Errors are one line on stderr; a reader that
    stops early (``hp-fastload inspect ... | head``) ends the output quietly."""
    args = build_parser().parse_args(argv)
    if getattr(args, "ranks_per_node", 1) < 1:
        print(f"hp-fastload {args.command}: error: --ranks-per-node must be at least 1", file=sys.stderr)
        return 2
    try:
        status: int = args.func(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # the reader went away: point stdout at /dev/null so the interpreter's final flush cannot fail again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except Exception as exc:  # a bad checkpoint or config (transformers raises many types): one line, no traceback
        text = " ".join(str(exc).split()) or type(exc).__name__
        if not isinstance(exc, (HpFastloadError, OSError, ValueError, RuntimeError, ImportError)):
            text = f"{type(exc).__name__}: {text}"  # an unusual type says what it is
        print(f"hp-fastload {args.command}: error: {_printable(text)}", file=sys.stderr)  # names from files: escaped
        return 1
    return status


if __name__ == "__main__":  # pragma: no cover - `python -m hp_fastload.cli` runs cli/__main__.py
    sys.exit(main())
