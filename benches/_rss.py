"""Resident-set-size probes shared by the benchmark scripts (``accelerate_bench.py``, ``save_bench.py``)."""

from __future__ import annotations

import os
import threading
from typing import Any


def rss() -> int:
    """This process's resident set size now, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """The largest RSS seen while the block runs (sampled every 5 ms on a thread, and at both ends)."""

    def __init__(self) -> None:
        self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss())

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())
