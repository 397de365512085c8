"""The docs pages cannot drift from the code: every Python block of a user-facing page is a named snippet that
a test runs, every error class has its row on the errors page, every environment variable the code reads has
its row on the environment page, and the README's links lead to files that exist. (``make docs`` builds the
site strict: broken links between pages and missing reference targets fail there.)"""

from __future__ import annotations

import re
from pathlib import Path

import hp_fastload
from hp_fastload import errors
from tests.helpers.docs import ROOT, blocks, snippets, user_pages

ERRORS_PAGE = ROOT / "docs" / "reference" / "errors.md"
ENV_PAGE = ROOT / "docs" / "reference" / "environment.md"
#: Where the code reads environment variables: the package and the Rust crate.
SOURCES = [*sorted((ROOT / "python" / "hp_fastload").rglob("*.py")), *sorted((ROOT / "rust").rglob("*.rs"))]
_OWN = re.compile(r"\b(?:HP_FASTLOAD|HYPER_PARALLEL)_[A-Z0-9_]+")
_READ = re.compile(r"""(?:environ\.get|environ\[|getenv|env::var(?:_os)?)\(?\s*["']([A-Z][A-Z0-9_]+)["']""")


def test_every_python_block_is_a_named_snippet() -> None:
    pages = user_pages()
    assert "README.md" in pages and "docs/getting-started.md" in pages and len(pages) > 10, pages
    unnamed = []
    for page in pages:
        for kind, name, lang, body in blocks(page):
            if lang == "python" and kind != "snippet":
                unnamed.append(f"{page}: {body.splitlines()[0] if body else ''}")
            if kind == "snippet":
                assert lang == "python", f"{page}: snippet {name} marks a {lang!r} block"
            if kind == "output":
                assert lang == "text", f"{page}: output {name} marks a {lang!r} block"
    assert unnamed == [], "python blocks without <!-- snippet: NAME -->:\n" + "\n".join(unnamed)


def test_every_snippet_is_run_by_a_test() -> None:
    """A test names the page and the snippet (``snippet("docs/x.md", "name")`` or the page's constant)."""
    here = Path(__file__).resolve()
    tests = {p: p.read_text() for p in (ROOT / "tests").rglob("test_*.py") if p.resolve() != here}
    unrun = []
    count = 0
    for page in user_pages():
        naming = [text for text in tests.values() if f'"{page}"' in text]
        for name in snippets(page):
            count += 1
            if not any(f'"{name}"' in text for text in naming):
                unrun.append(f"{page}#{name}")
    assert count >= 15, count
    assert unrun == [], f"snippets no test runs: {unrun}"


def _exceptions() -> set[str]:
    names = {n for n in errors.__all__ if isinstance(c := getattr(errors, n), type) and issubclass(c, BaseException)}
    public = {n for n in hp_fastload.__all__ if isinstance(getattr(hp_fastload, n), type)}
    names |= {n for n in public if issubclass(getattr(hp_fastload, n), BaseException)}
    assert {"HpFastloadError", "MissingKeysError", "ObjectStoreError"} <= names
    return names


def test_every_error_has_a_row_on_the_errors_page() -> None:
    rows = {m[1] for m in re.finditer(r"^\| `(\w+)`", ERRORS_PAGE.read_text(), re.M)}
    assert sorted(_exceptions() - rows) == [], "errors without a row (when raised) on docs/reference/errors.md"


def _variables_read() -> dict[str, str]:
    found: dict[str, str] = {}
    for path in SOURCES:
        text = path.read_text(errors="replace")
        for name in [*_OWN.findall(text), *_READ.findall(text)]:
            if not name.endswith("_"):  # a prefix (HP_FASTLOAD_S3_*), not a variable
                found.setdefault(name, str(path.relative_to(ROOT)))
    return found


def test_every_environment_variable_has_a_row() -> None:
    read = _variables_read()
    assert {"HP_FASTLOAD_PEER_WAIT_S", "HP_FASTLOAD_S3_DIRECT", "LOCAL_WORLD_SIZE", "AWS_PROFILE"} <= set(read)
    rows = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", ENV_PAGE.read_text()))
    missing = {name: where for name, where in read.items() if name not in rows}
    assert missing == {}, f"variables the code reads that docs/reference/environment.md lacks: {missing}"


def test_readme_links_lead_to_files() -> None:
    text = (ROOT / "README.md").read_text()
    links = [m for m in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text) if "://" not in m]
    assert len(links) >= 10, links
    assert [link for link in links if not (ROOT / link).exists()] == []
