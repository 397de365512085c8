"""Where a ``load(..., share="job")`` rank's time goes before its first delivery round, at full size: one rank
of a job planned in this process as ``load`` plans it (its own plan with the groundwork made once, the
``StorageMap``, every rank's needs from the whole plan, the check of its own needs, ``plan_job``), then what
``run_job`` and ``deliver`` compute before the first reads (the tensors the rank reads for itself alone, its
received bytes' tables, round 1's messages), on the checkpoint's model built on meta and laid out under torch's
fake process group (headers only; nothing is read, no collective).

    python benches/jobwide_plan.py CHECKPOINT [--layout 2d] [--world 256] [--mesh 32x8] [--repeat 3]

With ``--no-groundwork`` the whole plan is made from scratch (as before issue 40's session 20). Prints the median
seconds of each step over ``--repeat`` runs, and the plan's digest (equal between runs and variants: the same
plan). The sparse DeepSeek-V3 of ``benches/scale.py --generate-only`` is the issue's full-size row.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--layout", default="2d")
    parser.add_argument("--world", type=int, default=256)
    parser.add_argument("--mesh", default="32x8", help="OUTERxINNER for 2-D layouts ('' for 1-D)")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-groundwork", action="store_true", help="the whole plan made from scratch")
    args = parser.parse_args()

    from hp_fastload.api.load import as_rank
    from hp_fastload.api.ranks import laid_out
    from hp_fastload.api.request import plan_request
    from hp_fastload.planning import front
    from hp_fastload.planning.jobneeds import StorageMap, rank_needs
    from hp_fastload.planning.jobranks import all_rank_needs, packed_keys
    from hp_fastload.planning.jobwide import plan_job
    from hp_fastload.source.index import CheckpointIndex

    mesh = tuple(int(x) for x in args.mesh.lower().split("x")) if args.mesh else None
    from hp_fastload.execute.deliver import MemoryStorage

    steps = ("own plan", "StorageMap", "needs", "check", "plan_job", "before round 1")
    spent: dict[str, list[float]] = {s: [] for s in (*steps, "total")}
    digests = set()
    gc.disable()  # as load runs it (gc_paused)
    with laid_out(args.checkpoint, args.layout, args.world, mesh) as (model, description, location, _):
        index = CheckpointIndex.open(location)
        request = plan_request(model, loader="dcp", strict=False)
        mine = request.seen_as(as_rank(args.rank))
        for _ in range(args.repeat):
            marks = [time.perf_counter()]
            targets = front.targets_of(model, mine)
            work = None if args.no_groundwork else front.groundwork(model, index, mine, targets)
            own, _ = front.plan(model, index, mine, targets=targets, groundwork=work)
            marks.append(time.perf_counter())
            smap = StorageMap.of_index(index)
            marks.append(time.perf_counter())
            extra = {} if work is None else {"groundwork": work}  # (--no-groundwork runs on older trees too)
            needs = all_rank_needs(model, index, smap, args.world, request, **extra)
            marks.append(time.perf_counter())
            if rank_needs(own, smap, packed_keys(own, index)) != needs[args.rank]:
                raise SystemExit("the rank's own plan differs from the job plan's needs for it")
            marks.append(time.perf_counter())
            job = plan_job(needs, smap, ranks_per_node=args.ranks_per_node)
            marks.append(time.perf_counter())
            job.self_read_keys(args.rank)
            MemoryStorage(job, job.needs[args.rank])
            job.messages(args.rank, 0)
            marks.append(time.perf_counter())
            for i, step in enumerate(steps):
                spent[step].append(marks[i + 1] - marks[i])
            spent["total"].append(marks[-1] - marks[0])
            digests.add(job.digest)
            del job, needs, own, work
            gc.collect()
    print(f"{description}, rank {args.rank}: {_digest_line(digests)}; medians of {args.repeat} runs, s")
    for step, values in spent.items():
        print(f"  {step:15s} {statistics.median(values):7.3f}")


def _digest_line(digests: set[str]) -> str:
    return f"digest {next(iter(digests))}" if len(digests) == 1 else f"digests differ between runs: {digests}"


if __name__ == "__main__":
    main()
