"""When a ready ring pays: task costs that data decides, under every execution strategy.

(a) unbalanced: two layers of N tasks; task i of a layer runs reps[i] units of dependent
    arithmetic (reps drawn from 1..16 per run, so no compile-time cost hint can know them);
    task i of the second layer waits for task i of the first;
(b) moe: the MoE graph of tests/python/moe_graph.py (router, top-k, CSR grouping, scatter,
    expert tiles released by the CSR trigger, combine) at larger sizes, fresh routing;
(c) queue overhead: N independent empty tasks; (dynamic - static) per task a CTA runs is the
    ring's cost of one task (pop + push), from the mean over CTAs.

Strategies: static (list-scheduled queues, uniform costs), dynamic (the ring), mixed (the
second layer or the expert tiles in the ring, the rest in queues), barrier, unfused (one
grid launch per call; the expert tiles no trigger releases skipped) and unfused replayed from
a CUDA graph; (a) also runs static and dynamic with 4 persistent CTAs per SM ("-4"). Every
variant is checked against NumPy first. Prints one table per part, writes JSON (``--json``).
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np
import tvm
import tvm_ffi
from tvm.script import tirx as T

from etc_tvm import ETensor, Tensor, build, call_device, device_func, graph_func
from etc_tvm.tir_sched.persistent import KernelOptions
from timing import checked_run, time_interleaved

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))
from moe_graph import make_moe_graph, moe_reference  # noqa: E402

WIDTH, THREADS, UNIT = 128, 128, 512  # UNIT dependent multiply-adds make one rep
DECAY, STEP = 0.999, 0.001  # acc -> acc * DECAY + STEP: contracting, so rounding stays small
N_TASKS = T.int32()
STRATEGIES = ["static", "dynamic", "mixed", "barrier", "unfused", "unfused+graph"]
# the tile is one 128-thread CTA of dependent arithmetic: the unfused grid keeps up to 16 of
# them on an SM, a persistent kernel as many as its CTAs per SM
OCCUPANCY = ["static-4", "dynamic-4"]


@device_func
def work_tile(i: T.int32, X: T.Buffer((N_TASKS, WIDTH), "float32"),
              reps: T.Buffer((N_TASKS,), "int32"), Y: T.Buffer((N_TASKS, WIDTH), "float32")):
    """Y[i] = X[i] after reps[i] * UNIT steps of acc * DECAY + STEP, one column a thread."""
    T.device_entry()
    tx = T.thread_id([THREADS])
    acc = T.local_scalar("float32")
    acc = X[i, tx]
    for _ in T.serial(reps[i] * UNIT):
        acc = acc * T.float32(DECAY) + T.float32(STEP)
    Y[i, tx] = acc


def work_reference(x, reps):
    """The tile's arithmetic in float32, every row at once."""
    acc = x.astype(np.float32).copy()
    steps = reps * UNIT
    for k in range(int(steps.max(initial=0))):
        live = steps > k
        acc[live] = acc[live] * np.float32(DECAY) + np.float32(STEP)
    return acc


@work_tile.set_reference
def _(i, X, reps, Y):
    Y[i] = work_reference(X[i:i + 1], reps[i:i + 1])[0]


def make_unbalanced(ring_layer: str):
    @graph_func
    def unbalanced(x: Tensor(("N", WIDTH)), reps_a: Tensor(("N",), "int32"),
                   reps_b: Tensor(("N",), "int32")):
        n = x.shape[0]
        a_done = ETensor((n,), name="a_done")
        a = call_device(work_tile, tile_num=(n,), args=[x, reps_a], out=Tensor((n, WIDTH)),
                        out_edges={a_done: "i->i"},
                        schedule="dynamic" if ring_layer == "a" else "static")
        return call_device(work_tile, tile_num=(n,), args=[a, reps_b], out=Tensor((n, WIDTH)),
                           in_edges={a_done: "i->i"},
                           schedule="dynamic" if ring_layer == "b" else "static")

    return unbalanced


def measure(graph, dims, inputs, want, strategies, rtol) -> dict:
    """Build each strategy, check it against ``want`` (relative L2 error), then time all.
    A label "<strategy>-<k>" runs k persistent CTAs per SM; "<strategy>+graph" replays the
    launches from a CUDA graph."""
    dev = tvm.cuda(0)
    on_device = [tvm.runtime.tensor(x, dev) for x in inputs]
    runs = {}
    for label in strategies:
        strategy, _, ctas = label.replace("+graph", "").partition("-")
        compiled = build(graph, dims, strategy=strategy,
                         options=KernelOptions(ctas_per_sm=int(ctas or 1)))
        runs[label] = checked_run(label, compiled, on_device, want, rtol,
                                  replay=label.endswith("+graph"))
    return time_interleaved(runs, reps=50, warmup=5)


def table(title, rows, labels) -> None:
    print(f"\n{title}")
    print(f"{'case':>10} " + " ".join(f"{label:>14}" for label in labels)
          + f" {'static/dynamic':>15} {'barrier/dynamic':>16}")
    for r in rows:
        print(f"{r['case']:>10} " + " ".join(
            f"{r[label]:>11.1f} us" if label in r else f"{'n/a':>14}" for label in labels)
            + f" {r['static'] / r['dynamic']:>14.2f}x {r['barrier'] / r['dynamic']:>15.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=int, default=4 * 132)
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--json", default="bench_dynamic.json")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    unbalanced, moe, overhead = [], [], []
    with tvm_ffi.use_torch_stream():
        n = args.tasks
        x = rng.standard_normal((n, WIDTH)).astype("float32")
        for case, low, high in (("1x", 1, 1), ("1x-16x", 1, 16)):
            reps_a = rng.integers(low, high + 1, n).astype("int32")
            reps_b = rng.integers(low, high + 1, n).astype("int32")
            want = work_reference(work_reference(x, reps_a), reps_b)
            unbalanced.append({"case": case, **measure(
                make_unbalanced("b"), {"N": n}, [x, reps_a, reps_b], want,
                STRATEGIES + OCCUPANCY, 1e-4)})

        graph = make_moe_graph(128, 32, 4, 128, 16, "tensor")
        for tokens in args.tokens:
            x = rng.standard_normal((tokens, 128)).astype("float32")
            w_router = (rng.standard_normal((128, 32)) / np.sqrt(128)).astype("float32")
            bias = np.zeros(32, "float32")
            w_expert = (rng.standard_normal((32, 128, 128)) / np.sqrt(128)).astype("float32")
            inputs = [x, w_router, bias, w_expert]
            moe.append({"case": f"T={tokens}", **measure(
                graph, {"T": tokens}, inputs, moe_reference(*inputs, 4), STRATEGIES, 1e-4)})

        empty = np.zeros(32 * 132, "int32")
        x = rng.standard_normal((len(empty), WIDTH)).astype("float32")
        row = measure(make_unbalanced("b"), {"N": len(empty)}, [x, empty, empty], x,
                      ["static", "dynamic"], 1e-6)
        per_cta = 2 * len(empty) / 132  # tasks one CTA runs, both layers
        overhead.append({**row, "per task": (row["dynamic"] - row["static"]) / per_cta})

    labels = STRATEGIES
    table(f"(a) two layers of {args.tasks} tasks, reps per task", unbalanced,
          labels + OCCUPANCY)
    table("(b) MoE layer (hidden 128, 32 experts, top-4, 16-row expert tiles)", moe, labels)
    print(f"\n(c) queue overhead: static {overhead[0]['static']:.1f} us, dynamic "
          f"{overhead[0]['dynamic']:.1f} us for {2 * len(empty)} empty tasks: "
          f"{overhead[0]['per task']:.3f} us per task (pop + push)")
    with open(args.json, "w") as f:
        json.dump({"unbalanced": unbalanced, "moe": moe, "overhead": overhead}, f, indent=1)


if __name__ == "__main__":
    main()
