"""The cost of a dependency: a dependent chain of N small tasks under every strategy.

    static              one persistent kernel; each hop a notify -> wait across SMs
    barrier             the same kernel with barriers between operators (a single call here,
                        so its internal chain stays: the same as static)
    unfused             each task its own kernel launch, in stream order
    unfused+cudagraph   those launches replayed from a CUDA graph

Per-hop overhead is the slope of the median time over N (launch and set-up costs cancel).
Prints one table and writes JSON (``--json``). Run on the GPU machine.
"""
from __future__ import annotations

import argparse
import json
import statistics

import numpy as np
import torch
import tvm
import tvm_ffi
from tvm.script import tirx as T

from etc_tvm import ETensor, Tensor, call_device, device_func, graph_func
from etc_tvm.build import build
from etc_tvm.executor import execute

WIDTH, THREADS = 128, 128
N_ROWS = T.int32()


@device_func
def hop_tile(i: T.int32, X: T.Buffer((N_ROWS, WIDTH), "float32"),
             Y: T.Buffer((N_ROWS, WIDTH), "float32")):
    """Y[i] = X[i] + Y[i-1][0]: one row per task, reading what the previous task wrote."""
    T.device_entry()
    tx = T.thread_id([THREADS])
    if i > 0:
        Y[i, tx] = X[i, tx] + Y[i - 1, 0]
    else:
        Y[i, tx] = X[i, tx]


@hop_tile.set_reference
def _(i, X, Y):
    Y[i] = X[i] + (Y[i - 1, 0] if i > 0 else 0)


@graph_func
def chain(x: Tensor(("N", WIDTH))):
    n = x.shape[0]
    link = ETensor((n,), name="link")
    return call_device(hop_tile, tile_num=(n,), args=[x], out=Tensor((n, WIDTH), name="y"),
                       in_edges={link: "i->i-1 if i > 0"}, out_edges={link: "i->i"})


VARIANTS = {"static": "static", "barrier": "barrier", "unfused": "unfused",
            "unfused+cudagraph": "unfused"}


def time_us(fn, reps: int = 200, warmup: int = 20) -> float:
    """Median over ``reps`` of the device time of one call, from CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--json", default="bench_overhead.json")
    args = parser.parse_args()
    dev = tvm.cuda(0)
    rows = []
    with tvm_ffi.use_torch_stream():
        for n in args.lengths:
            x = np.random.default_rng(n).standard_normal((n, WIDTH)).astype("float32")
            want = execute(chain, x)
            row = {"N": n}
            for label, strategy in VARIANTS.items():
                compiled = build(chain, {"N": n}, strategy=strategy)
                x_dev = tvm.runtime.tensor(x, dev)
                if label.endswith("cudagraph"):
                    run, outputs = compiled.capture(x_dev)
                    run()
                    torch.cuda.synchronize()
                    got = outputs[0].numpy()
                else:
                    got = compiled(x)
                    run = lambda: compiled.run(x_dev)  # noqa: E731
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
                row[label] = time_us(run)
            rows.append(row)
    report(rows, list(VARIANTS))
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)


def report(rows, labels) -> None:
    ns = [r["N"] for r in rows]
    print(f"{'N':>6} " + " ".join(f"{label:>18}" for label in labels)
          + f" {'unfused/static':>15} {'cudagraph/static':>17}")
    for r in rows:
        print(f"{r['N']:>6} " + " ".join(f"{r[label]:>15.1f} us" for label in labels)
              + f" {r['unfused'] / r['static']:>14.2f}x {r['unfused+cudagraph'] / r['static']:>16.2f}x")
    if len(rows) > 1:
        print("per-hop (slope over N): " + ", ".join(
            f"{label} {np.polyfit(ns, [r[label] for r in rows], 1)[0]:.3f} us"
            for label in labels))


if __name__ == "__main__":
    main()
