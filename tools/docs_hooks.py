"""mkdocs hooks of the docs site (mkdocs.yml ``hooks:``): generated sections that cannot go stale.

``<!-- cli-reference -->`` in a page is replaced by every ``hp-fastload`` command with its usage and flags, read
from the argparse parser the command itself runs (``hp_fastload.cli.main.build_parser``), so a new command or
flag appears on the next ``make docs`` without anyone editing the page. ``<!-- api-summary -->`` is replaced by
a table of every name in ``hp_fastload.__all__`` with the first line of its docstring, linked to its entry.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path
from typing import Any

CLI_MARKER = "<!-- cli-reference -->"
API_MARKER = "<!-- api-summary -->"


def _flag(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.dest}`"
    names = ", ".join(f"`{o}`" for o in action.option_strings)
    if action.nargs == 0:
        return names
    metavar = action.metavar or action.dest.upper()
    return f"{names} `{metavar}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|").replace("*", "\\*")


def _command(name: str, parser: argparse.ArgumentParser) -> list[str]:
    usage = " ".join(parser.format_usage().removeprefix("usage: ").split())
    lines = [f"## `hp-fastload {name}`", ""]
    if parser.description:
        lines += [_cell(parser.description), ""]
    lines += ["```text", usage, "```", "", "| argument | choices | default | what it does |", "|---|---|---|---|"]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        choices = ", ".join(f"`{c}`" for c in action.choices) if action.choices else ""
        shown = action.default is not None and action.default is not False and action.default != argparse.SUPPRESS
        default = f"`{action.default}`" if shown else ""
        lines.append(f"| {_flag(action)} | {choices} | {default} | {_cell(action.help or '')} |")
    return [*lines, ""]


def cli_reference() -> str:
    """Markdown for every subcommand of ``hp-fastload``: a heading, its usage line and a table of its arguments."""
    from hp_fastload.cli.main import build_parser

    parser = build_parser()
    (subparsers,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {choice.dest: choice.help for choice in subparsers._choices_actions}
    lines = ["| command | what it does |", "|---|---|"]
    lines += [f"| [`{name}`](#hp-fastload-{name}) | {_cell(helps.get(name) or '')} |" for name in subparsers.choices]
    lines.append("")
    for name, sub in subparsers.choices.items():
        lines += _command(name, sub)
    return "\n".join(lines)


def _kind(obj: object) -> str:
    if inspect.ismodule(obj):
        return "module"
    if inspect.isclass(obj):
        return "exception" if issubclass(obj, BaseException) else "class"
    return "function" if callable(obj) else "constant"


def _first_line(obj: object) -> str:
    doc = inspect.getdoc(obj) if not isinstance(obj, (str, int, float)) else None
    if not doc:
        return ""
    paragraph = " ".join(doc.split("\n\n")[0].split())
    sentence, dot, _ = paragraph.partition(". ")
    return _cell(sentence + dot.strip())


def api_summary() -> str:
    """Markdown table of ``hp_fastload.__all__``: name (linked to its mkdocstrings entry), kind, summary."""
    import hp_fastload

    lines = ["| name | kind | summary |", "|---|---|---|"]
    for name in sorted(hp_fastload.__all__, key=str.lower):
        obj = getattr(hp_fastload, name)
        link = f"[`{name}`](rules.md)" if name == "rules" else f"[`{name}`](#hp_fastload.{name})"
        summary = "" if _kind(obj) in ("module", "constant") else _first_line(obj)
        lines.append(f"| {link} | {_kind(obj)} | {summary} |")
    return "\n".join(lines) + "\n"


def on_config(config: Any) -> Any:
    """Import the package from this checkout's ``python/`` (the sources mkdocstrings reads), not from wherever
    the environment installed it, so that the generated tables and the rendered docstrings agree."""
    source = str(Path(config["config_file_path"]).resolve().parent / "python")
    if source not in sys.path:
        sys.path.insert(0, source)
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_reference())
    if API_MARKER in markdown:
        markdown = markdown.replace(API_MARKER, api_summary())
    return markdown
