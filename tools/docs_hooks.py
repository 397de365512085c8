"""mkdocs hooks of the docs site (mkdocs.yml ``hooks:``): generated sections that cannot go stale.

``<!-- cli-reference -->`` in a page is replaced by every ``hp-fastload`` command with its usage and flags, read
from the argparse parser the command itself runs (``hp_fastload.cli.main.build_parser``), so a new command or
flag appears on the next ``make docs`` without anyone editing the page.
"""

from __future__ import annotations

import argparse
from typing import Any

CLI_MARKER = "<!-- cli-reference -->"


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


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if CLI_MARKER in markdown:
        return markdown.replace(CLI_MARKER, cli_reference())
    return markdown
