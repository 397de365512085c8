"""Any rank of a big job on this machine: ``rehearse(model_on_meta, path, rank=r)`` (one rank's load, executed
and measured), ``plan_each(model, path, ranks)`` (many ranks planned, the rank-independent work done once) and
``as_rank(r)`` (the ``mesh_override`` that names a rank).

Owns the executed dry run: the model's layout is planned for global rank ``r`` (a virtual rank: the model may
live on the meta device, under torch's ``fake`` process group of the job's world size), the rank's local shards
are allocated for real (host memory, or a CUDA device through the pinned stager), the rank's reads run from the
checkpoint (streamed as ``load`` streams them: the regions intersected while the first ones are read), and the run
is measured: bytes, seconds, GB/s, the peak resident set and the open descriptors while reading. The model itself
is not touched; the filled shards can be returned for checking.
"""

from __future__ import annotations

import dataclasses
import math
import os
import resource
import threading
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hp_fastload.api.load import PhaseClock, as_rank
from hp_fastload.api.request import plan_request
from hp_fastload.errors import PlanError
from hp_fastload.execute.read import Overlap, execute_stream
from hp_fastload.execute.staging import DEFAULT_STAGING_BYTES
from hp_fastload.execute.threads import threads_per_rank
from hp_fastload.model.targets import Target, model_tensors
from hp_fastload.model.wrappers import unwrapped
from hp_fastload.planning import front
from hp_fastload.planning.front import Groundwork, groundwork, targets_of
from hp_fastload.planning.items import CriticalPath, LoadPlan
from hp_fastload.runtime import gc_paused
from hp_fastload.source.index import CheckpointIndex
from hp_fastload.source.location import resolve_checkpoint_location

__all__ = ["Rehearsal", "as_rank", "plan_each", "rehearse"]


def plan_each(
    model: nn.Module,
    path: str | os.PathLike[str],
    ranks: Iterable[int],
    *,
    weights_mapping: Iterable[Any] | None = None,
    key_mapping: Mapping[str, str] | None = None,
    strict: bool = False,
    revision: str | None = None,
) -> Iterator[tuple[int, LoadPlan]]:
    """``(rank, plan)`` for each of ``ranks`` of ``model``'s layout (see :func:`as_rank`), equal to
    ``hp_fastload.plan(model, path, rank=rank)`` each. The checkpoint's headers are read once, and the groups,
    their traces and the quantization scan are made once for all ranks (``planning.front.groundwork``):
    each rank only builds its targets, claims and intersects its regions."""
    model = unwrapped(model)
    location = resolve_checkpoint_location(path, revision=revision)
    with gc_paused():
        index = CheckpointIndex.open(location)
        request = plan_request(
            model, weights_mapping=weights_mapping, key_mapping=key_mapping, loader="dcp", strict=strict
        )
        tensors = model_tensors(model)
    work: Groundwork | None = None
    first = True
    for rank in ranks:
        with gc_paused():
            each = request.seen_as(as_rank(rank))
            targets = targets_of(model, each, tensors)
            if first:
                work, first = groundwork(model, index, each, targets), False
            plan, _ = front.plan(model, index, each, targets=targets, groundwork=work)
        yield rank, plan


@dataclass
class Rehearsal:
    """One rank's rehearsed load.

    ``local_bytes``: the rank's local shards (allocated for this run); ``bytes_read``: what the engine read;
    ``peak_rss``: the process's peak resident set while reading (``VmHWM`` reset before the reads; mapped
    checkpoint pages included), ``rss_before`` the resident set when the reads started; ``peak_fds``: the most
    open descriptors seen while reading (sampled every 5 ms), ``fds_before`` the count before.
    The rehearsal reads as ``load`` does: the key-level plan first, the region intersections made while the
    engine reads the first targets. ``plan_seconds`` is the planning on the rank's critical path, the index
    open included (``critical_path.index + critical_path.planning``: the key-level plan, the intersections no
    read covered, the plan's totals after reading); ``critical_path.planning_hidden`` is the planning done
    while the engine read. ``read_seconds`` is ``critical_path.reading``: the engine's wall time, less the
    exposed planning. ``critical_path`` is the rank's time to loaded (index, planning, reading, finishing:
    unmapping the files), without the allocation of its shards (a trainer's model holds them before its load).
    """

    rank: int
    world: int | None
    targets: int
    local_bytes: int
    bytes_needed: int
    bytes_read: int
    plan_seconds: float
    read_seconds: float
    threads: int
    device: str
    rss_before: int
    peak_rss: int
    fds_before: int
    peak_fds: int
    staging_bytes: int = 0
    critical_path: CriticalPath = dataclasses.field(default_factory=CriticalPath)

    @property
    def gbps(self) -> float:
        """GB/s (10^9) of the bytes read over the read time."""
        return self.bytes_read / self.read_seconds / 1e9 if self.read_seconds > 0 else 0.0

    @property
    def rss_over_local(self) -> int:
        """Peak resident bytes above the rank's local shards (the memory target's measure)."""
        return self.peak_rss - self.local_bytes

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["gbps"] = self.gbps
        out["rss_over_local"] = self.rss_over_local
        return out

    def _phases(self) -> str:
        """The critical path's phases (its hidden planning is said with the planning time)."""
        return dataclasses.replace(self.critical_path, planning_hidden=0.0).summary()

    def summary(self) -> str:
        return (
            f"rank {self.rank}: planned in {self.plan_seconds:.3f} s (+{self.critical_path.planning_hidden:.3f} s "
            f"hidden behind the reads); read {self.bytes_read / 1e9:.3f} GB in "
            f"{self.read_seconds:.3f} s ({self.gbps:.2f} GB/s, {self.threads} threads) into "
            f"{self.local_bytes / 1e9:.3f} GB of local shards on {self.device}; peak RSS "
            f"{self.peak_rss / 2**30:.2f} GiB ({self.rss_over_local / 2**30:+.2f} GiB over the shards); open "
            f"descriptors {self.fds_before} -> peak {self.peak_fds}"
            + (f"; pinned staging {self.staging_bytes / 2**20:.0f} MiB" if self.staging_bytes else "")
            + f"; time to loaded {self.critical_path.total:.3f} s: {self._phases()}"
        )


def _status_bytes(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` in bytes (0 where there is none)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak resident set (``VmHWM``) of this process; False where it cannot be."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # the listing's own descriptor
    except OSError:
        return 0


class _FdSampler:
    """The most open descriptors seen, sampled every ``interval`` s from a thread (the engine runs without the
    GIL, so the sampler runs alongside it)."""

    def __init__(self, interval: float = 0.005) -> None:
        self.peak = _open_fds()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.peak = max(self.peak, _open_fds())

    def __enter__(self) -> _FdSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _open_fds())


def available_bytes(device: torch.device) -> int | None:
    """Memory a rehearsal may allocate on ``device``: the kernel's ``MemAvailable`` for the host, the free memory
    of a CUDA device; None when unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _materialize(
    filled: Iterable[str], targets: Mapping[str, Target], device: torch.device, rank: int
) -> tuple[dict[str, Target], dict[str, torch.Tensor], int]:
    """Real local shards for every target named in ``filled`` (those the plan fills, known from its claims
    before any region is made: ``PlanStream.target_names``): ``(name -> writable target, name -> shard,
    bytes)``. Host shards are touched once (zeroed) so that the reads measure reading, not first faults.
    ``PlanError`` before any allocation when they would not fit in the memory ``device`` has available (a rank
    of a big layout can hold more than one machine: the kernel would kill the process half way instead)."""
    names = set(filled)
    unique = {id(targets[name]): targets[name] for name in names}
    needed = sum(math.prod(t.region.local_shape) * t.dtype.itemsize for t in unique.values())
    available = available_bytes(device)
    if available is not None and needed > available:
        raise PlanError(
            f"rehearsing rank {rank} allocates its local shards for real: {needed / 2**30:,.2f} GiB on {device}, "
            f"more than the {available / 2**30:,.2f} GiB available there. Rehearse it on a machine with more "
            "memory, or plan it without executing (hp-fastload plan without --execute; hp_fastload.plan)"
        )
    made: dict[int, Target] = {}
    shards: dict[str, torch.Tensor] = {}
    for name in sorted(names):
        target = targets[name]
        target.check()
        new = made.get(id(target))
        if new is None:
            local = torch.empty(target.region.local_shape, dtype=target.dtype, device=device)
            if device.type == "cpu":
                local.zero_()
            new = dataclasses.replace(target, tensor=local, device=local.device, is_dtensor=False, virtual=False)
            made[id(target)] = new
        shards[name] = new.tensor
    out = {name: made.get(id(t), t) for name, t in targets.items()}
    return out, shards, needed


def _world_of(model: nn.Module) -> int | None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_world_size())
    return None


@gc_paused()
def rehearse(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    rank: int,
    threads: int | None = None,
    device: str | torch.device = "cpu",
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    backend: str | None = None,
    weights_mapping: Iterable[Any] | None = None,
    key_mapping: Mapping[str, str] | None = None,
    external_target_fqns: Collection[str] = frozenset(),
    revision: str | None = None,
    keep: bool = False,
) -> tuple[Rehearsal, dict[str, torch.Tensor]]:
    """Plan global rank ``rank`` of ``model``'s layout (the model may be on meta; see :func:`as_rank`), allocate
    its local shards on ``device``, read them from ``path`` and measure the run. As ``load``: the key-level plan
    (``planning.front.streamed``) names the shards to allocate, and the regions are intersected while the
    engine reads the first ones (``execute.read.execute_stream``); a failure there raises with the
    checkpoint's maps released.

    Returns the :class:`Rehearsal` and, with ``keep=True``, the filled local shards by target name (else an empty
    dict: the shards are freed before returning). CUDA shards are filled through the pinned double-buffered
    stager of ``staging_bytes`` in all; ``backend`` is the engine's (None: auto). Nothing is written into ``model``.
    """
    model = unwrapped(model)
    device = torch.device(device)
    if threads is None:
        threads = threads_per_rank()
    clock = PhaseClock()
    location = resolve_checkpoint_location(path, revision=revision)
    index = CheckpointIndex.open(location)
    clock.lap("index")
    request = plan_request(
        model,
        weights_mapping=weights_mapping,
        key_mapping=key_mapping,
        loader="dcp",
        strict=False,
        external_target_fqns=external_target_fqns,
        view=as_rank(rank),
    )
    # the key-level plan (every claim, name and shape): the targets to allocate are known, their regions are
    # intersected while the engine reads the first ones (as load does)
    stream = front.streamed(model, index, request)
    clock.lap("planning")
    targets, shards, local_bytes = _materialize(stream.target_names(), stream.context.targets, device, rank)
    context = dataclasses.replace(stream.context, targets=targets)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    _reset_peak_rss()
    rss_before = _status_bytes("VmRSS")
    overlap = Overlap()
    with _FdSampler() as fds:
        fds_before = fds.peak
        clock.skip()
        try:
            stats = execute_stream(
                stream.regions(),
                stream.deferred,
                context,
                dequant=stream.dequant,
                threads=threads,
                backend=backend,
                staging_bytes=staging_bytes,
                overlap=overlap,
            )
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            clock.lap("reading")
        finally:
            context.index.release_maps()
            clock.lap("finishing")
    peak = _status_bytes("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    clock.overlapped(overlap)
    plan = stream.plan()  # (every region made: the plan's totals)
    clock.lap("planning")
    _, critical_path = clock.done()
    report = Rehearsal(
        rank=rank,
        world=_world_of(model),
        targets=len({id(t) for t in targets.values() if not t.virtual}),
        local_bytes=local_bytes,
        bytes_needed=plan.bytes_needed,
        bytes_read=stats.bytes_read,
        plan_seconds=critical_path.index + critical_path.planning,
        read_seconds=critical_path.reading,
        threads=threads,
        device=str(device),
        rss_before=rss_before,
        peak_rss=peak,
        fds_before=fds_before,
        peak_fds=fds.peak,
        staging_bytes=int(stats.extra.get("staging_bytes", 0)),
        critical_path=critical_path,
    )
    return report, (shards if keep else {})
