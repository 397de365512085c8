"""Command line, ``hp-fastload <command>`` (``inspect``, ``plan``, ``demo``): the top layer, over ``api``."""

from hp_fastload.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
