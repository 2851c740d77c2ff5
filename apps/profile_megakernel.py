"""Where the time of a megakernel goes, task by task: the graphs of apps/bench_overhead.py
built to profile (``KernelOptions(profile=True)``) under several strategies.

For each graph and strategy: the per-call table of ``Timeline.summary`` (median wait and body
per task, busy time), the makespan and the median hand-off between consecutive tasks of an
SM; and a Chrome trace per run in ``--out`` (open in Perfetto or chrome://tracing). The second
of two runs is the one shown (the first loads the kernel).
"""
import argparse
from pathlib import Path

import ml_dtypes
import numpy as np

from bench_overhead import chain, make_mlp, make_split_k_mlp
from etc_tvm import build
from etc_tvm.tir_sched.persistent import KernelOptions

WIDTH = 128


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--chain", type=int, default=256, help="links of the chain")
    parser.add_argument("--rows", type=int, default=128, help="MLP rows (a multiple of 16)")
    parser.add_argument("--strategies", nargs="+", default=["static", "dynamic", "barrier"])
    parser.add_argument("--out", default="timelines")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    bf16 = ml_dtypes.bfloat16
    x = rng.standard_normal((args.rows, 2048)).astype(bf16)
    w1, w2 = ((rng.standard_normal((2048, 2048)) / 2048**0.5).astype(bf16) for _ in range(2))
    cases = {
        f"chain{args.chain}": (chain, {"N": args.chain},
                               [rng.standard_normal((args.chain, WIDTH)).astype("float32")]),
        f"mlp{args.rows}": (make_mlp(16, 2048, 2048), {"M": args.rows}, [x, w1, w2]),
        f"mlp{args.rows}-split-k": (make_split_k_mlp(2048, 2048), {"M": args.rows}, [x, w1, w2]),
    }
    for name, (graph, dims, inputs) in cases.items():
        for strategy in args.strategies:
            compiled = build(graph, dims, strategy=strategy, options=KernelOptions(profile=True))
            compiled.profile(*inputs)
            _, timeline = compiled.profile(*inputs)
            print(f"\n{name}, {strategy}\n{timeline.summary()}")
            timeline.write_chrome_trace(out / f"{name}-{strategy}.json")


if __name__ == "__main__":
    main()
