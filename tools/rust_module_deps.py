#!/usr/bin/env python3
"""The module graph of the Rust crate (rust/), and a check that it has no cycle; also a size cap per file.

Every ``crate::X`` reference in rust/**/*.rs outside comments and literals (``use crate::X...``,
``use crate::{X::.., Y}``, ``crate::X::f(..)`` in code) is an edge from the file's top-level module to
``X``; ``super::`` paths that climb to the crate root count the same. A file's top-level module is its
first component under rust/ (``rust/exec/read.rs`` belongs to ``exec``); ``crate::Name`` for a name the
crate root re-exports (``pub use X::{Name}`` in lib.rs) is an edge to ``X``. lib.rs itself, the crate
root, only declares and re-exports modules and is not a node. Test code counts like any other code.

    python3 tools/rust_module_deps.py             # exit 1 and print a cycle if there is one
    python3 tools/rust_module_deps.py --graph     # also print every module's dependencies, leaves first
    python3 tools/rust_module_deps.py --self-test # check that the checker finds a synthetic cycle

Every file of the crate has at most ``MAX_LINES`` lines, unit tests included (a module's tests may live
beside it in ``<module>/tests.rs``); a file over it is named with its count. Python's modules have their own
cap (tools/check_imports.py).

Exit status: 0 no cycle and every file within the cap, 1 a cycle, 2 a reference the script cannot place (a
typo, or a form it does not parse), so that it cannot pass by missing edges, 3 a file over the cap. Python 3
standard library only.
"""

from __future__ import annotations

import argparse
import io
import itertools
import re
import sys
import tempfile
from pathlib import Path
from typing import TextIO

IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# Lines per .rs file, tests included: Python's cap (tools/check_imports.py).
MAX_LINES = 600


def strip_comments_and_literals(src: str) -> str:
    """The source with comments, string and char literals replaced by spaces (newlines kept)."""
    out: list[str] = []
    i, n = 0, len(src)

    def blank(a: int, b: int) -> None:
        out.append("".join(c if c == "\n" else " " for c in src[a:b]))

    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            blank(i, j)
            i = j
        elif src.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if src.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif src.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            blank(i, j)
            i = j
        elif (m := re.match(r'b?r(#*)"', src[i:])) and not (i and (src[i - 1].isalnum() or src[i - 1] == "_")):
            close = '"' + m.group(1)
            j = src.find(close, i + m.end())
            j = n if j < 0 else j + len(close)
            blank(i, j)
            i = j
        elif c == '"':
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            blank(i, j + 1)
            i = j + 1
        elif c == "'":
            # A char literal ('x', '\n', '\u{..}'), else a lifetime or label ('a).
            m = re.match(r"'(\\(u\{[0-9a-fA-F]*\}|x[0-9a-fA-F]{2}|.)|[^\\'\n])'", src[i:])
            if m:
                blank(i, i + m.end())
                i += m.end()
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def module_path(root: Path, file: Path) -> list[str]:
    """`rust/exec/read.rs` -> ['exec', 'read']; `rust/exec/mod.rs` -> ['exec']; `rust/lib.rs` -> []."""
    parts = list(file.relative_to(root).with_suffix("").parts)
    if parts[-1] == "mod" or parts == ["lib"]:
        parts = parts[:-1]
    return parts


def root_reexports(lib_src: str) -> dict[str, str]:
    """Names re-exported at the crate root, to the module they come from (`pub use dest::DestBuf;`)."""
    names: dict[str, str] = {}
    for m in re.finditer(r"\bpub\s+use\s+(\w+)::(\{[^}]*\}|\w+)\s*;", lib_src):
        for name in IDENT.findall(m.group(2)):
            if name != "self":
                names[name] = m.group(1)
    return names


def crate_targets(code: str) -> list[tuple[str, int]]:
    """First components of every `crate::` path (grouped `crate::{a, b::c}` too), with their lines."""
    found: list[tuple[str, int]] = []
    for m in re.finditer(r"\bcrate\s*::\s*", code):
        line = code.count("\n", 0, m.start()) + 1
        rest = code[m.end() :]
        if rest.startswith("{"):
            depth, j, item_start = 0, 0, True
            while j < len(rest):
                ch = rest[j]
                if ch == "{":
                    depth += 1
                    item_start = depth == 1
                elif ch == "}":
                    depth -= 1
                    if depth == 0:
                        break
                elif ch == "," and depth == 1:
                    item_start = True
                elif item_start and depth == 1 and (w := IDENT.match(rest, j)):
                    found.append((w.group(0), line))
                    item_start = False
                    j = w.end()
                    continue
                j += 1
        elif w := IDENT.match(rest):
            found.append((w.group(0), line))
    return found


def super_targets(code: str, path: list[str]) -> list[tuple[str, int]]:
    """Top-level modules reached by `super::` chains that climb from file module `path` to the root.

    Inline modules (`mod tests { use super::*; }`) are not tracked: a chain is resolved from the file's
    module, and only counted when it lands on the crate root followed by a name (a `use super::*` in the
    test module of a top-level file lands on the root followed by `*` and is ignored).
    """
    found: list[tuple[str, int]] = []
    for m in re.finditer(r"(?<![\w:])((?:super\s*::\s*)+)", code):
        ups = m.group(1).count("super")
        if ups != len(path):
            continue
        if w := IDENT.match(code, m.end()):
            found.append((w.group(0), code.count("\n", 0, m.start()) + 1))
    return found


def build_graph(root: Path) -> tuple[dict[str, set[str]], list[str]]:
    """The module graph of the crate under `root`, and the references that could not be placed."""
    files = sorted(root.rglob("*.rs"))
    lib = root / "lib.rs"
    reexports = root_reexports(strip_comments_and_literals(lib.read_text())) if lib.exists() else {}
    modules = {p[0] for f in files if (p := module_path(root, f))}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    unplaced: list[str] = []
    for f in files:
        path = module_path(root, f)
        if not path:
            continue  # the crate root: declarations and re-exports
        code = strip_comments_and_literals(f.read_text())
        refs = crate_targets(code) + super_targets(code, path)
        for name, line in refs:
            target = name if name in modules else reexports.get(name)
            if target is None:
                unplaced.append(f"{f.relative_to(root.parent)}:{line}: crate::{name} is no module of the crate")
            elif target != path[0]:
                graph[path[0]].add(target)
    return graph, unplaced


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a list of modules (first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the DFS stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def layers(graph: dict[str, set[str]]) -> list[list[str]]:
    """Modules by layer: each uses only modules of earlier layers (the graph must be acyclic)."""
    level: dict[str, int] = {}

    def depth(node: str) -> int:
        if node not in level:
            level[node] = 1 + max((depth(d) for d in graph.get(node, ()) if d in graph), default=-1)
        return level[node]

    for node in graph:
        depth(node)
    out: list[list[str]] = [[] for _ in range(max(level.values(), default=-1) + 1)]
    for node, lv in level.items():
        out[lv].append(node)
    return [sorted(layer) for layer in out]


def oversized(root: Path, max_lines: int = MAX_LINES) -> list[str]:
    """The files under `root` with more than `max_lines` lines, each with its count."""
    found: list[str] = []
    for f in sorted(root.rglob("*.rs")):
        n = len(f.read_text().splitlines())
        if n > max_lines:
            found.append(f"{f.relative_to(root.parent)}: {n} lines")
    return found


def check(root: Path, show_graph: bool, out: TextIO = sys.stdout) -> int:
    """Prints the result for the crate under `root`; returns the exit status."""
    graph, unplaced = build_graph(root)
    if unplaced:
        print("references the module graph cannot place:", *unplaced, sep="\n  ", file=out)
        return 2
    if big := oversized(root):
        print(f"Rust files over {MAX_LINES} lines (split them by concern):", *big, sep="\n  ", file=out)
        return 3
    cycle = find_cycle(graph)
    if cycle:
        print("module cycle: " + " -> ".join(cycle), file=out)
        for a, b in itertools.pairwise(cycle):
            print(f"  {a} uses crate::{b}", file=out)
        return 1
    if show_graph:
        for i, layer in enumerate(layers(graph)):
            for node in layer:
                deps = ", ".join(sorted(graph[node])) or "-"
                print(f"layer {i}  {node:<9} -> {deps}", file=out)
    edges = sum(len(d) for d in graph.values())
    print(f"rust module graph: {len(graph)} modules, {edges} edges, no cycle, files <= {MAX_LINES} lines", file=out)
    return 0


SELF_TEST_FILES = {
    "lib.rs": "pub mod a;\npub mod b;\npub mod c;\npub mod sub;\npub use c::Thing;\n",
    "a.rs": '//! a\nuse crate::b::B; // crate::c in a comment is no edge\nconst S: &str = "crate::c";\n',
    "b.rs": "use crate::{c::C, sub};\nfn f<'a>(x: &'a str) -> char { let _ = crate::Thing; 'x' }\n",
    "c.rs": "/* crate::a */ pub struct C;\npub struct Thing;\n",
    "sub/mod.rs": "mod inner;\n",
    "sub/inner.rs": "use super::super::c::C;\n#[cfg(test)]\nmod tests {\n    use super::*;\n}\n",
}


def self_test() -> int:
    """Builds a small crate without a cycle, checks its edges, then closes a cycle and checks it is found."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "rust"
        for name, text in SELF_TEST_FILES.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(text)
        graph, unplaced = build_graph(root)
        want = {"a": {"b"}, "b": {"c", "sub"}, "c": set(), "sub": {"c"}}
        assert not unplaced, unplaced
        assert graph == want, graph
        assert find_cycle(graph) is None
        assert check(root, False, out=io.StringIO()) == 0
        # c -> a closes a -> b -> c -> a, through a grouped use in test code.
        (root / "c.rs").write_text("pub struct C;\npub struct Thing;\n#[cfg(test)]\nmod t { use crate::{a}; }\n")
        cycle = find_cycle(build_graph(root)[0])
        assert cycle == ["a", "b", "c", "a"], cycle
        assert check(root, False, out=io.StringIO()) == 1
        # An unknown crate:: name is an error, not a missing edge.
        (root / "c.rs").write_text("use crate::nothere::X;\n")
        assert check(root, False, out=io.StringIO()) == 2
        # A file one line over the cap is named, with its count; one at the cap is not.
        (root / "c.rs").write_text("pub struct C;\npub struct Thing;\n")
        (root / "sub" / "inner.rs").write_text("// x\n" * MAX_LINES)
        assert check(root, False, out=io.StringIO()) == 0
        (root / "sub" / "inner.rs").write_text("// x\n" * (MAX_LINES + 1))
        said = io.StringIO()
        assert check(root, False, out=said) == 3
        assert f"rust/sub/inner.rs: {MAX_LINES + 1} lines" in said.getvalue(), said.getvalue()
    print("rust_module_deps self-test: ok (a synthetic cycle and a file over the cap are found)")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent / "rust")
    parser.add_argument("--graph", action="store_true", help="print each module's dependencies")
    parser.add_argument("--self-test", action="store_true", help="check the checker on a synthetic crate")
    args = parser.parse_args()
    if args.self_test:
        return self_test()
    return check(args.root, args.graph)


if __name__ == "__main__":
    sys.exit(main())
