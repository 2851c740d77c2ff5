"""etc_tvm in one page: two tiled operators with tile-level dependencies, checked and run.

    y = mix(scale(x), x)     row tile i of mix waits only for row tile i of scale

The graph function is traced into Relax (printed below), instantiated as a task graph for one
batch size and run on the CPU reference executor under a dynamic ready queue, a static
per-SM schedule and a random interleaving; each result is checked against NumPy. It is then
compiled into one persistent megakernel and exported as a library of sm_90a machine code;
where a GPU is present that library is loaded back and run. A machine without a GPU driver
compiles with nvcc (``etc_tvm.build_env``); without nvcc as well, the step is skipped.
"""
import tempfile
from pathlib import Path

import numpy as np
from tvm.script import tirx as T

import etc_tvm
from etc_tvm import ETensor, Tensor, build, call_device, device_func, graph_func, load
from etc_tvm.build import has_gpu
from etc_tvm.executor import RandomOrder, ReadyQueueOrder, StaticOrder, execute
from etc_tvm.task_graph import TaskGraph

ROWS, COLS, THREADS = 8, 64, 128
M = T.int32()


@device_func
def scale_tile(i: T.int32, X: T.Buffer((M, COLS), "float32"), Y: T.Buffer((M, COLS), "float32")):
    T.device_entry()
    tx = T.thread_id([THREADS])
    for r in T.serial(ROWS * COLS // THREADS):
        e = r * THREADS + tx
        Y[i * ROWS + e // COLS, e % COLS] = X[i * ROWS + e // COLS, e % COLS] * T.float32(3)


@scale_tile.set_reference
def _(i, X, Y):
    Y[i * ROWS:(i + 1) * ROWS] = X[i * ROWS:(i + 1) * ROWS] * np.float32(3)


@device_func
def mix_tile(i: T.int32, A: T.Buffer((M, COLS), "float32"), X: T.Buffer((M, COLS), "float32"),
             Y: T.Buffer((M, COLS), "float32")):
    T.device_entry()
    tx = T.thread_id([THREADS])
    for r in T.serial(ROWS * COLS // THREADS):
        e = r * THREADS + tx
        Y[i * ROWS + e // COLS, e % COLS] = (A[i * ROWS + e // COLS, e % COLS]
                                             - X[i * ROWS + e // COLS, e % COLS])


@mix_tile.set_reference
def _(i, A, X, Y):
    rows = slice(i * ROWS, (i + 1) * ROWS)
    Y[rows] = A[rows] - X[rows]


@graph_func
def scale_then_mix(x: Tensor(("B", COLS))):
    B = x.shape[0]
    ready = ETensor((B // ROWS,), name="ready")
    a = call_device(scale_tile, tile_num=(B // ROWS,), args=[x],
                    out=Tensor((B, COLS), name="a"), out_edges={ready: "i->i"})
    return call_device(mix_tile, tile_num=(B // ROWS,), args=[a, x],
                       out=Tensor((B, COLS), name="y"), in_edges={ready: "i->i"})


def main() -> None:
    print(scale_then_mix.script())
    batch = 96
    graph = TaskGraph.build(scale_then_mix, {"B": batch})
    graph.validate()
    print(graph.summary())

    x = np.random.default_rng(0).standard_normal((batch, COLS)).astype("float32")
    want = 2 * x.astype("float64")
    order = graph.topological_order()
    for label, policy in [("dynamic ready queue", ReadyQueueOrder()),
                          ("static, 4 SMs", StaticOrder([order[k::4] for k in range(4)])),
                          ("random interleaving", RandomOrder(seed=1))]:
        y = execute(scale_then_mix, x, order=policy)
        np.testing.assert_allclose(y, want, rtol=1e-6)
        print(f"{label:>22}: correct (max |error| {np.abs(y - want).max():.1e})")

    gpu = has_gpu()
    if not gpu and etc_tvm.BUILD_ENV == etc_tvm.build_env.NO_COMPILER:
        print(f"{'GPU megakernel':>22}: skipped, no GPU and no nvcc here")
        return
    with tempfile.TemporaryDirectory() as tmp:
        library = Path(tmp) / "scale_then_mix.so"
        build(scale_then_mix, {"B": batch}).export(library)
        if not gpu:
            print(f"{'GPU megakernel':>22}: exported {library.name} "
                  f"({library.stat().st_size // 1024} KB, sm_90a machine code); no GPU here "
                  "to run it")
            return
        y = load(library)(x)
    np.testing.assert_allclose(y, want, rtol=1e-6)
    print(f"{'GPU megakernel':>22}: correct (max |error| {np.abs(y - want).max():.1e}), "
          f"run from the exported {library.name}")


if __name__ == "__main__":
    main()
