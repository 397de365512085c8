"""docs/architecture.md cannot drift from the code: it names every module of the Python package and every module
that rust/lib.rs declares, and the layer contract it quotes is the one import-linter checks (pyproject.toml)."""

from __future__ import annotations

import re
import tomllib

from tests.helpers.docs import ROOT

PAGE = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "python" / "hp_fastload"


def _section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_every_python_module_is_named() -> None:
    text = PAGE.read_text()
    modules = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py"))
    assert len(modules) > 80, modules
    missing = [m for m in modules if f"`{m}`" not in text]
    assert missing == [], f"modules docs/architecture.md does not name: {missing}"


def test_every_rust_module_is_named() -> None:
    declared = re.findall(r"^\s*(?:pub\s+)?mod\s+(\w+)\s*;", (ROOT / "rust" / "lib.rs").read_text(), re.M)
    assert {"exec", "header", "objstore", "python"} <= set(declared), declared
    crate = _section(PAGE.read_text(), "The Rust crate")
    missing = [m for m in declared if f"`{m}`" not in crate]
    assert missing == [], f"rust/lib.rs modules docs/architecture.md does not name: {missing}"


def test_the_layer_contract_is_quoted_as_checked() -> None:
    contract = _section(PAGE.read_text(), "The layer contract")
    block = re.search(r"```toml\n(.*?)```", contract, re.S)
    assert block is not None, "no toml block in the layer contract section"
    quoted = tomllib.loads(block.group(1))["layers"]
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (layers,) = [c["layers"] for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]
    assert quoted == layers
