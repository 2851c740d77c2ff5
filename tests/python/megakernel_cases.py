"""The graphs the GPU megakernel tests run, with inputs and float64 references, and the
persistent kernels they are built into.

Each case: (graph function, dims, inputs from a NumPy generator, float64 reference function).
"""
import numpy as np

import graphs
from etc_tvm import KernelOptions
from etc_tvm.schedule import list_schedule, round_robin_schedule
from test_executor import chain
from tiles import COLS, ROWS, TILE


def f32(rng, *shape):
    return rng.standard_normal(shape).astype("float32")


def f64(*arrays):
    return [np.asarray(a, np.float64) for a in arrays]


def _scale(x):
    return 2 * x + 1


CASES = {
    "dependent_chain": (chain, {"M": 64 * ROWS}, lambda r: [f32(r, 64 * ROWS, COLS)],
                        lambda x: _scale(*f64(x))),
    "two_ops": (graphs.two_ops, {"M": 300 * ROWS},
                lambda r: [f32(r, 300 * ROWS, COLS), f32(r, 300 * ROWS, COLS)],
                lambda x, y: _scale(f64(x)[0]) / 2 + np.tanh(f64(y)[0])),
    "two_ops_ring_mix": (graphs.two_ops_ring_mix, {"M": 300 * ROWS},
                         lambda r: [f32(r, 300 * ROWS, COLS), f32(r, 300 * ROWS, COLS)],
                         lambda x, y: _scale(f64(x)[0]) / 2 + np.tanh(f64(y)[0])),
    "fan_in_row_sum": (graphs.row_sum, {"M": 20 * TILE, "N": 12 * TILE},
                       lambda r: [f32(r, 20 * TILE, 12 * TILE)],
                       lambda x: f64(x)[0].sum(axis=1)),
    "fan_in_whole_call": (graphs.row_sum_after_all, {"M": 20 * TILE, "N": 12 * TILE},
                          lambda r: [f32(r, 20 * TILE, 12 * TILE)],
                          lambda x: f64(x)[0].sum(axis=1)),
    "gemm_reduce_scatter": (graphs.gemm_reduce_scatter, {"M": 8 * TILE, "K": 64, "N": 12 * TILE},
                            lambda r: [f32(r, 8 * TILE, 64), f32(r, 64, 12 * TILE)],
                            lambda a, b: np.matmul(*f64(a, b))),
    "prelude_weighted_rows": (graphs.weighted_rows, {"M": 300 * ROWS, "N": 7, "P": 300},
                              lambda r: [f32(r, 300 * ROWS, COLS), f32(r, 7, COLS),
                                         r.integers(0, 7, 300).astype("int32")],
                              lambda x, w, pick: _scale(f64(x)[0])
                              * f64(w)[0][pick[::-1]].repeat(ROWS, axis=0)),
}
RTOL, ATOL = 1e-5, 1e-4  # float32 arithmetic against float64

# the persistent kernels of a graph: name -> ``build``'s strategy, scheduler and options
MEGAKERNELS = {
    "static": dict(strategy="static", scheduler=list_schedule, options=KernelOptions()),
    "static_round_robin": dict(strategy="static", scheduler=round_robin_schedule,
                               options=KernelOptions()),
    "static_claimed": dict(strategy="static", scheduler=list_schedule,
                           options=KernelOptions(claim=True)),
    "dynamic": dict(strategy="dynamic", scheduler=list_schedule, options=KernelOptions()),
    "mixed": dict(strategy="mixed", scheduler=list_schedule, options=KernelOptions()),
    "barrier": dict(strategy="barrier", scheduler=list_schedule, options=KernelOptions()),
    "barrier_claimed": dict(strategy="barrier", scheduler=list_schedule,
                            options=KernelOptions(claim=True)),
}
