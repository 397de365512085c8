"""The package's import rules, checked on its source (``make lint``); import-linter checks the layer order.

1. No import cycle between modules (imports inside functions count: a lazy import is still a dependency).
2. No private name (``_x``) imported from another module; ``_core``, the extension, is the one exception.
3. No module imports the root package (``hp_fastload/__init__.py`` re-exports everything, so that would be a
   cycle in disguise); the extension is imported as ``import hp_fastload._core as _core``.
4. No module over ``MAX_LINES`` lines.

Usage: ``python tools/check_imports.py [PACKAGE_DIR]`` (default ``python/hp_fastload``); exits 1 and prints
every violation. ``--self-test`` runs the checks on a small package built to break each rule.
"""

from __future__ import annotations

import ast
import sys
import tempfile
from pathlib import Path

MAX_LINES = 600


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(root: Path, path: Path) -> list[tuple[str, list[str], int]]:
    """(imported module, names, line) for every import of the package's own modules in ``path``."""
    package = root.name
    this = module_name(root, path)
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] == package]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = this.split(".") if is_pkg else this.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] == package:
                out.append((mod, [a.name for a in node.names], node.lineno))
    return out


def check(root: Path) -> list[str]:
    problems: list[str] = []
    modules = {module_name(root, p): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    root_imports: list[tuple[str, str]] = []
    for mod, path in modules.items():
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            problems.append(f"{path}: {lines} lines (at most {MAX_LINES}): split it by concern")
        for target, names, line in imports_of(root, path):
            where = f"{path}:{line}"
            resolved = []
            for name in names or [""]:
                sub = f"{target}.{name}" if name else target
                resolved.append(sub if sub in modules else target)
                if name.startswith("_") and name != "_core" and sub not in modules:
                    problems.append(f"{where}: imports the private name {name} from {target}")
            if target == root.name and mod != root.name and any(f"{target}.{n}" not in modules for n in names or [""]):
                root_imports.append((mod, where))
            for dep in resolved:
                if dep in modules and dep != mod and not (dep == root.name and names == ["_core"]):
                    graph[mod].add(dep)
    # Parent packages are imported before their modules: a package's __init__ importing its own modules is
    # not a cycle with them, so edges from a module to its ancestors are the only ones left out.
    for mod in graph:
        graph[mod] = {d for d in graph[mod] if not mod.startswith(d + ".")}
    # The root package re-exports the public names: a module the root depends on must not import it back
    # (the command line, which nothing imports, may use ``import hp_fastload as hf`` like any user).
    below_root = reachable(graph, root.name)
    for mod, where in root_imports:
        if mod in below_root:
            problems.append(f"{where}: imports the root package {root.name}; import from the defining module")
    for cycle in cycles(graph):
        problems.append("import cycle: " + " -> ".join([*cycle, cycle[0]]))
    return problems


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def self_test() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        pkg = Path(tmp) / "pkg"
        (pkg / "sub").mkdir(parents=True)
        (pkg / "__init__.py").write_text("from pkg.a import f\nfrom pkg.sub import c\n")
        (pkg / "a.py").write_text("from pkg.b import g\n\ndef f():\n    return g\n")
        (pkg / "b.py").write_text("def g():\n    from pkg.a import f\n    return f\n")
        (pkg / "sub" / "__init__.py").write_text("")
        (pkg / "sub" / "c.py").write_text("from pkg.b import _hidden\nfrom pkg import f\n" + "x = 1\n" * 601)
        problems = check(pkg)
    expected = ["import cycle: pkg.a -> pkg.b", "private name _hidden", "imports the root package", "603 lines"]
    missing = [e for e in expected if not any(e in p for p in problems)]
    assert not missing, f"self-test: not detected: {missing}; found: {problems}"
    print("check_imports self-test: every rule fires")


def main(argv: list[str]) -> int:
    if "--self-test" in argv:
        self_test()
        return 0
    root = Path(argv[0] if argv else "python/hp_fastload")
    problems = check(root)
    for p in problems:
        print(p)
    print(f"check_imports: {len(problems)} problem(s) in {root}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
