"""Host staging between device shards and the engine: double-buffered slabs (pinned when CUDA is there) for loads (host
to device, overlapped with the next reads) and saves (device to host, overlapped with the writes), with the batch
and staging budgets.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from hp_fastload.planning.items import Reads

DEFAULT_BATCH_BYTES = 1 << 30

DEFAULT_STAGING_BYTES = 512 << 20


class Slabs:
    """Two reusable host slabs of ``budget // 2`` bytes (pinned when CUDA is there) and a side stream: the
    double buffering that staging uses in both directions (``execute``'s stager for loads, ``save``'s for
    exports). Only a request larger than a slab gets a slab of its own size."""

    ALIGN = 64

    def __init__(self, budget: int) -> None:
        self.slab_bytes = max(budget // 2, self.ALIGN)
        self.pin = torch.cuda.is_available()
        self.stream = torch.cuda.Stream() if self.pin else None
        self.slabs: list[torch.Tensor | None] = [None, None]
        self.current = 0
        self.used = 0

    def _slab(self, nbytes: int) -> torch.Tensor:
        """The current slab, replaced by a larger one when it holds fewer than ``nbytes`` bytes (views handed
        out of the previous one keep it alive)."""
        slab = self.slabs[self.current]
        if slab is None or slab.numel() < nbytes:
            slab = torch.empty(max(nbytes, self.slab_bytes), dtype=torch.uint8, pin_memory=self.pin)
            self.slabs[self.current] = slab
        return slab

    def fits(self, local: torch.Tensor) -> bool:
        """Whether ``local`` still fits the current slab (an empty slab takes anything)."""
        nbytes = local.numel() * local.element_size()
        return self.used == 0 or self.used + nbytes <= self.slab_bytes


def staging_chunks(local: torch.Tensor, reads: Reads, slab_bytes: int) -> Iterator[tuple[torch.Tensor, Reads]]:
    """``(rows of local, reads clipped to them)`` in blocks of whole rows that fit a staging slab."""
    nbytes = local.numel() * local.element_size()
    if nbytes <= slab_bytes or local.dim() == 0 or local.shape[0] < 2:
        yield local, reads
        return
    total_rows = local.shape[0]
    rows = max(1, slab_bytes // (nbytes // total_rows))
    for r0 in range(0, total_rows, rows):
        r1 = min(r0 + rows, total_rows)
        clipped = reads.clip_rows(r0, r1)
        if len(clipped):
            yield local[r0:r1], clipped


class LoadStager(Slabs):
    """Host staging for device targets: two reusable slabs of ``budget // 2`` bytes (pinned when CUDA is there).

    Each engine batch reads into one slab; its host-to-device copies are then queued on a side stream and the
    next batch reads into the other slab while they run (double buffering). A slab is reused only after the
    copies out of it have finished, so staging memory stays at ``budget`` however large the checkpoint. A target
    larger than a slab is staged in row blocks that fit one (``batch.staging_chunks``); only a single row larger than
    a slab gets a slab of its own size.
    """

    def __init__(self, budget: int) -> None:
        super().__init__(budget)
        self.events: list[Any] = [None, None]

    def staging_for(self, local: torch.Tensor) -> torch.Tensor:
        """A host tensor shaped like ``local``, carved from the current slab."""
        nbytes = local.numel() * local.element_size()
        if self.used == 0 and self.events[self.current] is not None:
            self.events[self.current].synchronize()  # the copies out of this slab's last batch are done
            self.events[self.current] = None
        slab = self._slab(self.used + nbytes)
        view = slab[self.used : self.used + nbytes].view(local.dtype).view(local.shape)
        self.used += -(-nbytes // self.ALIGN) * self.ALIGN
        return view

    def copy(self, local: torch.Tensor, staging: torch.Tensor) -> None:
        if self.stream is None:
            local.copy_(staging)
            return
        with torch.cuda.stream(self.stream):
            local.copy_(staging, non_blocking=True)

    def flip(self) -> None:
        """The current slab's batch was read and its copies queued: mark it and switch slabs."""
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record(self.stream)
            self.events[self.current] = event
        self.current = 1 - self.current
        self.used = 0

    def finish(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    @property
    def allocated(self) -> int:
        """Bytes of staging memory held (both slabs)."""
        return sum(slab.numel() for slab in self.slabs if slab is not None)


class D2HStager(Slabs):
    """Host staging for device shards: two reusable slabs of ``budget // 2`` bytes (pinned when CUDA is there).

    A shard's rows are copied into the current slab on a side stream (non-blocking); when a slab is full its
    batch waits, and it is written only after the next slab's copies have been queued, so the device-to-host
    copies of one slab overlap the positioned writes of the other. Memory stays at ``budget`` (a block of rows
    larger than a slab gets a slab of its own size); rows are cut as the load's staging cuts them.
    """

    def stage(self, rows: torch.Tensor) -> torch.Tensor:
        """A host copy of ``rows`` in the current slab (queued, not finished: see ``event``)."""
        nbytes = rows.numel() * rows.element_size()
        slab = self._slab(self.used + nbytes)
        view = slab[self.used : self.used + nbytes].view(rows.dtype).view(rows.shape)
        if self.stream is not None and rows.device.type == "cuda":
            self.stream.wait_stream(torch.cuda.current_stream(rows.device))
            with torch.cuda.stream(self.stream):
                view.copy_(rows, non_blocking=True)
        else:
            view.copy_(rows)
        self.used += -(-nbytes // self.ALIGN) * self.ALIGN
        return view

    def event(self) -> Any:
        """Marks the copies queued so far (None without CUDA: they are done) and switches slabs."""
        event = None
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record(self.stream)
        self.current = 1 - self.current
        self.used = 0
        return event
