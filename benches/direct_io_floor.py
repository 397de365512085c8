"""How fast can a Shard(1) column slice be read from a cold device without read amplification?

Reads ``--run`` bytes every ``--stride`` bytes of a file with ``O_DIRECT`` (no page cache, no read-ahead:
storage reads = needed bytes, rounded to 512-byte sectors) from 1..N threads for a few seconds each, after
evicting the file's cached pages, and prints IOPS and the useful bytes per second. Compare the useful rate
with a buffered cold read of the same slice (every loader in ``benches/compare.py`` reads the whole span
through the kernel's read-ahead): when the device's IOPS ceiling times the run size is below the buffered
rate, "storage reads <= 1.3x needed" and "faster than a buffered reader" cannot both hold on this device.

    python benches/direct_io_floor.py bench-out/data/dense-2.6gb/model-00002-of-00004.safetensors
"""

from __future__ import annotations

import argparse
import mmap
import os
import threading
import time


def measure(path: str, threads: int, stride: int, run: int, seconds: float) -> tuple[float, float]:
    """(IOPS, useful MB/s) of ``run``-byte O_DIRECT reads every ``stride`` bytes from ``threads`` threads."""
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    counts = [0] * threads
    stop = time.perf_counter() + seconds

    def worker(k: int) -> None:
        buf = mmap.mmap(-1, max(run, 4096))  # page-aligned, as O_DIRECT needs
        view = memoryview(buf)[:run]
        offset = (k * (size // threads)) // stride * stride
        n = 0
        while time.perf_counter() < stop:
            os.preadv(fd, [view], offset)
            offset += stride
            if offset + run > size:
                offset = 0
            n += 1
        counts[k] = n

    pool = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    start = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    elapsed = time.perf_counter() - start
    os.close(fd)
    total = sum(counts)
    return total / elapsed, total * run / elapsed / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path")
    ap.add_argument("--stride", type=int, default=8192, help="bytes between run starts (a row of the tensor)")
    ap.add_argument("--run", type=int, default=1024, help="bytes read per row (this rank's columns)")
    ap.add_argument("--threads", default="1,4,16,64")
    ap.add_argument("--seconds", type=float, default=2.0)
    args = ap.parse_args()
    fd = os.open(args.path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    for threads in (int(t) for t in args.threads.split(",")):
        iops, useful = measure(args.path, threads, args.stride, args.run, args.seconds)
        print(
            f"threads {threads:3d}: {iops:8.0f} IOPS, {useful:6.1f} MB/s of needed bytes "
            f"({args.run} B every {args.stride} B)"
        )


if __name__ == "__main__":
    main()
