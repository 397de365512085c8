"""The Python snippets of the docs pages, for the tests that run them as written.

A snippet is a fenced ``python`` block preceded by a hidden marker line ``<!-- snippet: NAME -->``; the output
it shows, when it shows one, is a fenced ``text`` block preceded by ``<!-- output: NAME -->``. In the output,
``...`` stands for any text (timings, sizes), as in doctest's ELLIPSIS. ``tests/docs/test_pages.py`` checks
that every ``python`` block of the user-facing pages has a marker and that some test names it.

Usage::

    from tests.helpers.docs import run_snippet, snippet

    scope = run_snippet(snippet("docs/getting-started.md", "first-load"), replace={'"Qwen/Qwen3-0.6B"': repr(path)})
    scope["model"]  # what the snippet bound
"""

from __future__ import annotations

import contextlib
import dataclasses
import doctest
import io
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

#: The pages whose Python snippets a reader copies: each must be run by a test (contributor notes are not).
USER_PAGES = ("README.md", "docs/index.md", "docs/getting-started.md", "docs/guides/*.md", "docs/how-it-works/*.md")

_BLOCK = re.compile(r"^(?:<!-- (snippet|output): ([\w.-]+) -->\n)?```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)


@dataclasses.dataclass(frozen=True)
class Snippet:
    page: str  # relative to the repository root
    name: str
    code: str
    output: str | None  # the output the page shows, or None


def user_pages() -> list[str]:
    """The user-facing pages, relative to the repository root."""
    return sorted(str(p.relative_to(ROOT)) for pattern in USER_PAGES for p in ROOT.glob(pattern))


def blocks(page: str) -> list[tuple[str | None, str | None, str, str]]:
    """Every fenced block of ``page``: (marker kind, marker name, language, body)."""
    text = (ROOT / page).read_text()
    return [(m[1], m[2], m[3], m[4]) for m in _BLOCK.finditer(text)]


def snippets(page: str) -> dict[str, Snippet]:
    """The marked Python snippets of ``page`` by name, each with the output the page shows for it."""
    found = blocks(page)
    outputs = {name: body for kind, name, _, body in found if kind == "output" and name}
    result = {}
    for kind, name, lang, body in found:
        if kind == "snippet" and name:
            assert lang == "python", f"{page}: snippet {name} is a {lang!r} block"
            assert name not in result, f"{page}: two snippets named {name}"
            result[name] = Snippet(page, name, body, outputs.get(name))
    missing = set(outputs) - set(result)
    assert not missing, f"{page}: outputs without a snippet: {sorted(missing)}"
    return result


def snippet(page: str, name: str) -> Snippet:
    found = snippets(page)
    assert name in found, f"{page} has no snippet {name!r} (has {sorted(found)})"
    return found[name]


def output_matches(shown: str, printed: str) -> bool:
    """Whether ``printed`` is what the page shows, ``...`` standing for any text (whitespace normalized)."""
    checker = doctest.OutputChecker()
    return checker.check_output(shown, printed, doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)


def run_snippet(
    s: Snippet, scope: Mapping[str, Any] | None = None, replace: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Run snippet ``s`` in a copy of ``scope`` after the textual replacements ``replace`` (each must occur:
    a page that no longer says what the test replaces fails here), check what it printed against the output the
    page shows, and return the namespace it ran in (``__stdout__``: what it printed)."""
    code = s.code
    for old, new in (replace or {}).items():
        assert old in code, f"{s.page}#{s.name} no longer contains {old!r}"
        code = code.replace(old, new)
    namespace: dict[str, Any] = dict(scope or {})
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"{s.page}#{s.name}", "exec"), namespace)
    printed = out.getvalue()
    if s.output is not None:
        assert output_matches(s.output, printed), f"{s.page}#{s.name} printed:\n{printed}\nthe page shows:\n{s.output}"
    namespace["__stdout__"] = printed
    return namespace
