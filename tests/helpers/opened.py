"""What this process still holds of the files under a folder: its open descriptors, its mappings and the
planner threads of ``execute.read.execute_stream`` (the tests that a failed load, rehearsal or save leaves
nothing open)."""

from __future__ import annotations

import os
import threading
from pathlib import Path


def open_under(root: str | Path) -> dict[str, list[str]]:
    """``{"fds": [...], "maps": [...], "planners": [...]}``: the targets of this process's descriptors and
    the files of its mappings under ``root`` (sorted), and the names of its live planner threads."""
    root = str(root)
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(root):
            fds.append(target)
    with open("/proc/self/maps") as maps:
        mapped = sorted({line.split()[-1] for line in maps if root in line})
    planners = [t.name for t in threading.enumerate() if t.name.startswith("hp-fastload-plan")]
    return {"fds": sorted(fds), "maps": mapped, "planners": planners}
