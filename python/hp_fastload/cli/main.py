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


def _plan(args: argparse.Namespace) -> int:
    from hp_fastload.api.ranks import plan_ranks

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
            f"unexpected {p.unexpected}; planned in {p.seconds:.3f} s"
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
        "2d: experts by expert on the inner dim and FSDP-like on the outer (default tp+fsdp)",
    )
    p.add_argument(
        "--mesh",
        type=_mesh,
        default=None,
        help="the 2-D mesh of tp+fsdp and 2d as OUTERxINNER, e.g. 2x4 (default WORLD/2 x 2)",
    )
    p.add_argument("--all-ranks", action="store_true", help="plan every rank: a per-rank and a per-node table")
    p.add_argument(
        "--ranks-per-node", type=int, default=8, help="ranks per node for the --all-ranks node table (default 8)"
    )
    p.add_argument("--auto-class", default=None, help="the transformers class to build (default AutoModelForCausalLM)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=_plan)


_COMMANDS: list[Callable[[Any], None]] = [_register_inspect, _register_demo, _register_plan]


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
