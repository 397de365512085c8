"""CPU seconds of planning a torchtitan model's load through its state-dict adapter, one process, model on meta.

Builds a torchtitan 0.3.0 model (``tests.helpers.titan``) on meta, writes its checkpoint once with torchtitan's
own ``to_hf``, and times ``hp_fastload.plan(model, path, state_dict_adapter=...)`` in process CPU seconds
(min, first quartile and median of ``--repeat`` plans after one warm-up). Usage::

    python benches/titan_plan.py --model llama3 --scale 4 --layers 4 --repeat 15
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from tests.helpers import titan


def main() -> None:
    import hp_fastload as hf

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3", choices=titan.NAMES)
    parser.add_argument("--scale", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    kw = {"scale": args.scale, "layers": args.layers}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / args.model
        titan.write_checkpoint(args.model, path, **kw)
        cfg = titan.config(args.model, **kw)
        with torch.device("meta"):
            model = cfg.build()
        adapter = titan.adapter(args.model, cfg)
        hf.plan(model, path, state_dict_adapter=adapter)
        times = []
        for _ in range(args.repeat):
            start = time.process_time()
            hf.plan(model, path, state_dict_adapter=adapter)
            times.append(time.process_time() - start)
    times.sort()
    print(
        f"{args.model} scale {args.scale} {args.layers} layers: plan CPU ms min {times[0] * 1e3:.1f} "
        f"q1 {times[len(times) // 4] * 1e3:.1f} median {times[len(times) // 2] * 1e3:.1f}"
    )


if __name__ == "__main__":
    main()
