"""Row-reduction tiles: fp32 row sums, whole rows or one column block at a time (for fan-in).

    row_sum, task i:                Y[r] = sum(X[r, :])
    partial_row_sum, task (i, j):   P[r, j] = sum(X[r, j*cols:(j+1)*cols])

for the ``rows`` rows r of row block i. ``row_sum`` over ``P`` finishes what ``partial_row_sum``
started: a row block of the result then waits (``"ij->i"``) for all of its column blocks. X is
fp32 (M, N), row-major; M, N and P's width are symbolic, M a multiple of rows (and N of cols for
the partial sums).

One warp per row: lane l adds columns l, l+32, ... (each step reads 128 contiguous bytes), then a
shuffle tree (``T.cuda.warp_sum``) combines the 32 lane sums and lane 0 stores. The ``rows /
warps`` rows of a warp run one after another; the default 64 rows matches the GEMM row block.

Numeric contract: fp32 accumulation in some order, so against a float64 sum,
``|Y - sum(X)| <= n * 2**-24 * sum(|X|)`` for n summed terms (N, or cols). This bound holds
for any order, so it covers the NumPy reference's pairwise sum too. ``error_bound`` computes it.
"""
from __future__ import annotations

import functools

import numpy as np
from tvm import tirx
from tvm.script import tirx as T

from ..device_func import DeviceFunc, device_func
from ..errors import EtcError

WARP = 32


def _warps(rows: int, threads: int) -> int:
    if threads % WARP or rows % (threads // WARP):
        raise EtcError(f"row reduction tile: {threads} threads must be whole warps that divide "
                       f"its {rows} rows")
    return threads // WARP


@functools.cache
def make_row_sum_tile(rows: int = 64, threads: int = 128) -> DeviceFunc:
    """The tile ``row_sum_<rows>_t<threads>``: Y[r] = sum over all N columns of X[r, :]."""
    warps = _warps(rows, threads)
    M, N = (tirx.Var(d, "int32") for d in "MN")

    @T.prim_func
    def row_sum(i: T.int32, X: T.Buffer((M, N), "float32"), Y: T.Buffer((M,), "float32")):
        T.device_entry()
        tx = T.thread_id([threads])  # noqa: F841 (declares the thread count)
        warp = T.warp_id([warps])
        lane = T.lane_id([WARP])
        acc = T.alloc_local((1,), "float32")
        for r in T.serial(rows // warps):
            row = T.meta_var(i * rows + r * warps + warp)
            acc[0] = T.float32(0)
            for c in T.serial((N + WARP - 1) // WARP):
                if c * WARP + lane < N:
                    acc[0] = acc[0] + X[row, c * WARP + lane]
            acc[0] = T.cuda.warp_sum(acc[0])
            if lane == 0:
                Y[row] = acc[0]

    name = f"row_sum_{rows}_t{threads}"
    tile = device_func(row_sum.with_attr("global_symbol", name),
                       requires=[(M % rows == 0, f"M a multiple of {rows}")])

    @tile.set_reference
    def _(i, X, Y):
        block = slice(i * rows, (i + 1) * rows)
        Y[block] = X[block].sum(axis=1, dtype=np.float32)

    return tile


@functools.cache
def make_partial_row_sum_tile(rows: int = 64, cols: int = 64, threads: int = 128) -> DeviceFunc:
    """The tile ``partial_row_sum_<rows>x<cols>_t<threads>``: P[r, j] = sum of
    X[r, j*cols:(j+1)*cols]."""
    warps = _warps(rows, threads)
    if cols % WARP:
        raise EtcError(f"partial row sum tile: cols must be a multiple of {WARP}, got {cols}")
    M, N, NP = tirx.Var("M", "int32"), tirx.Var("N", "int32"), tirx.Var("NP", "int32")

    @T.prim_func
    def partial_row_sum(i: T.int32, j: T.int32, X: T.Buffer((M, N), "float32"),
                        P: T.Buffer((M, NP), "float32")):
        T.device_entry()
        tx = T.thread_id([threads])  # noqa: F841 (declares the thread count)
        warp = T.warp_id([warps])
        lane = T.lane_id([WARP])
        acc = T.alloc_local((1,), "float32")
        for r in T.serial(rows // warps):
            row = T.meta_var(i * rows + r * warps + warp)
            acc[0] = T.float32(0)
            for c in T.unroll(cols // WARP):
                acc[0] = acc[0] + X[row, j * cols + c * WARP + lane]
            acc[0] = T.cuda.warp_sum(acc[0])
            if lane == 0:
                P[row, j] = acc[0]

    name = f"partial_row_sum_{rows}x{cols}_t{threads}"
    tile = device_func(partial_row_sum.with_attr("global_symbol", name),
                       requires=[(M % rows == 0, f"M a multiple of {rows}"),
                                 (N % cols == 0, f"N a multiple of {cols}"),
                                 (NP * cols == N, f"P of N / {cols} columns")])

    @tile.set_reference
    def _(i, j, X, P):
        block = slice(i * rows, (i + 1) * rows)
        P[block, j] = X[block, j * cols:(j + 1) * cols].sum(axis=1, dtype=np.float32)

    return tile


def error_bound(X: np.ndarray) -> np.ndarray:
    """The bound on ``|Y - X.sum(axis=1)|`` of a sum over X's rows (see the module docstring)."""
    return X.shape[1] * 2.0 ** -24 * np.abs(X.astype(np.float64)).sum(axis=1)


row_sum_tile = make_row_sum_tile()
partial_row_sum_tile = make_partial_row_sum_tile()
