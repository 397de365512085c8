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

from .engine import SafetensorsFile
from .errors import HpFastloadError


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
    for path in _safetensors_paths(args.path):
        f = SafetensorsFile(path)
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
    p.add_argument("path", help="a .safetensors file or a directory of them")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=_inspect)


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(checkpoint=args.checkpoint, world=args.world, loader=args.loader)


def _register_demo(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo", help="load a checkpoint into a parallelized model on gloo CPU ranks and check every shard"
    )
    p.add_argument("--checkpoint", help="a transformers causal-LM checkpoint (default: a generated Mixtral)")
    p.add_argument("--world", type=int, default=2, help="number of ranks (4 gives a 2-D FSDP x TP mesh)")
    p.add_argument("--loader", default="dcp", choices=["dcp", "legacy"])
    p.set_defaults(func=_demo)


def _plan(args: argparse.Namespace) -> int:
    from .demo import plan_for_rank

    print(plan_for_rank(args.checkpoint, world=args.world, rank=args.rank))
    return 0


def _register_plan(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan", help="what one rank of a (virtual) TP + FSDP layout reads from a transformers checkpoint"
    )
    p.add_argument("checkpoint", help="a transformers causal-LM checkpoint directory")
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--rank", type=int, default=0)
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
    """Entry point of ``hp-fastload``; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        status: int = args.func(args)
    except (HpFastloadError, OSError) as exc:
        print(f"hp-fastload {args.command}: error: {exc}", file=sys.stderr)
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
