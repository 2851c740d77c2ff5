"""Epilogue tiles: an activation over one ``rows x cols`` tile of an fp32 (M, N) tensor.

Task ``(i, j)`` computes ``Y[i*rows:(i+1)*rows, j*cols:(j+1)*cols] = f(X[same])`` with ``X`` fp32
and ``Y`` fp32 or bf16. The default tile (64 x 64, 128 threads) matches the default GEMM tile, so
a GEMM's output tile (i, j) feeds the activation task (i, j) through an ``"ij->ij"`` edge, and a
bf16 output is the A operand of a following GEMM.

Each thread moves 4 contiguous fp32 per step (one 16-byte load), consecutive threads the
consecutive pieces of a row, so the loads coalesce. M and N are symbolic, multiples of rows and
cols.

Numeric contract, elementwise against float64 ``f`` of the same fp32 input. TVM compiles CUDA
with ``--use_fast_math``: ``expf`` is ``ex2.approx``, division is approximate, and results below
2**-126 flush to zero. ReLU is exact in fp32; GELU (tanh form, as in GPT-2) and SiLU give
``|Y - f(X)| <= 2**-20 * (1 + |X|)``. GELU uses ``0.5 * (1 + tanh(u)) == sigmoid(2u)`` and so
needs only ``expf``: with fast math, ``tanhf`` missed this bound on the H200 (relative errors
up to about 2**-14). A bf16 output adds one rounding, ``2**-8 * |f(X)|``. ``error_bound``
computes this.
"""
from __future__ import annotations

import functools

import numpy as np
from tvm import tirx
from tvm.script import tirx as T

from ..device_func import DeviceFunc, device_func
from ..errors import EtcError

VEC = 4  # fp32 per thread per step: one 16-byte load
_GELU_C = 0.7978845608028654  # sqrt(2 / pi)


def _relu(x):
    return T.max(x, T.float32(0))


def _gelu(x):
    # x * sigmoid(2u) with u = sqrt(2/pi) (x + 0.044715 x^3): the tanh form without tanhf
    return x / (T.float32(1) + T.exp(
        T.float32(-2 * _GELU_C) * (x + T.float32(0.044715) * x * x * x)))


def _silu(x):
    return x / (T.float32(1) + T.exp(-x))


def _identity(x):
    return x


def _np_relu(x):
    return np.maximum(x, 0)


def _np_gelu(x):
    return 0.5 * x * (1 + np.tanh(_GELU_C * (x + 0.044715 * x ** 3)))


def _np_silu(x):
    with np.errstate(over="ignore"):  # exp(-x) = inf for very negative x gives -0, as on CUDA
        return x / (1 + np.exp(-x))


# name -> (TIR expression, NumPy function: evaluated in the input's precision)
ACTIVATIONS = {"relu": (_relu, _np_relu), "gelu": (_gelu, _np_gelu), "silu": (_silu, _np_silu),
               "identity": (_identity, _identity)}
OUT_DTYPES = ("float32", "bfloat16")


@functools.cache
def make_activation_tile(activation: str = "relu", out_dtype: str = "bfloat16", rows: int = 64,
                         cols: int = 64, threads: int = 128, split_k: int = 1) -> DeviceFunc:
    """The tile ``<activation>_<rows>x<cols>_<out>_t<threads>``; one DeviceFunc per
    configuration.

    With ``split_k`` > 1 the input is the (split_k, M, N) fp32 partial products of a split-K
    GEMM (``gemm.make_gemm_tile(split_k=...)``), summed in order before the activation: the
    tile finishes that GEMM (``"identity"`` just sums). The sum adds
    ``split_k * 2**-24 * sum(|partials|)`` to the bound.
    """
    if split_k < 1:
        raise EtcError(f"activation tile: split_k must be positive, got {split_k}")
    if activation not in ACTIVATIONS:
        raise EtcError(f"activation tile: unknown activation {activation!r}; one of "
                       f"{sorted(ACTIVATIONS)}")
    if out_dtype not in OUT_DTYPES:
        raise EtcError(f"activation tile: out_dtype must be one of {OUT_DTYPES}, "
                       f"got {out_dtype!r}")
    if cols % VEC or (rows * cols // VEC) % threads:
        raise EtcError(f"activation tile {rows}x{cols}: rows x cols / {VEC} vectors must divide "
                       f"among {threads} threads")
    f, np_f = ACTIVATIONS[activation]
    steps, vecs_per_row = rows * cols // VEC // threads, cols // VEC
    M, N = (tirx.Var(d, "int32") for d in "MN")

    @T.prim_func
    def act(i: T.int32, j: T.int32, X: T.Buffer((M, N), "float32"),
            Y: T.Buffer((M, N), out_dtype)):
        T.device_entry()
        tx = T.thread_id([threads])
        for s in T.unroll(steps):
            v = T.meta_var(s * threads + tx)  # this thread's 4-vector of the tile
            row = T.meta_var(i * rows + v // vecs_per_row)
            col = T.meta_var(j * cols + v % vecs_per_row * VEC)
            for e in T.vectorized(VEC):
                Y[row, col + e] = T.Cast(out_dtype, f(X[row, col + e]))

    @T.prim_func
    def split_act(i: T.int32, j: T.int32, P: T.Buffer((split_k, M, N), "float32"),
                  Y: T.Buffer((M, N), out_dtype)):
        T.device_entry()
        tx = T.thread_id([threads])
        total = T.alloc_local((VEC,), "float32")
        for s in T.unroll(steps):
            v = T.meta_var(s * threads + tx)
            row = T.meta_var(i * rows + v // vecs_per_row)
            col = T.meta_var(j * cols + v % vecs_per_row * VEC)
            for e in T.vectorized(VEC):
                total[e] = P[0, row, col + e]
            for k in T.serial(split_k - 1):
                for e in T.vectorized(VEC):
                    total[e] = total[e] + P[k + 1, row, col + e]
            for e in T.vectorized(VEC):
                Y[row, col + e] = T.Cast(out_dtype, f(total[e]))

    out = "bf16" if out_dtype == "bfloat16" else "f32"
    name = f"{activation}_{rows}x{cols}_{out}_t{threads}" + (
        f"_sum{split_k}" if split_k > 1 else "")
    tile = device_func((act if split_k == 1 else split_act).with_attr("global_symbol", name))

    @tile.set_reference
    def _(i, j, X, Y):
        rows_, cols_ = slice(i * rows, (i + 1) * rows), slice(j * cols, (j + 1) * cols)
        x = X[rows_, cols_] if split_k == 1 else X[:, rows_, cols_].sum(axis=0, dtype=np.float32)
        Y[rows_, cols_] = np_f(x.astype(np.float32)).astype(Y.dtype)

    return tile


def error_bound(X: np.ndarray, activation: str, out_dtype: str) -> np.ndarray:
    """The elementwise bound on ``|Y - f(X)|`` of the tile (see the module docstring)."""
    x = X.astype(np.float64)
    exact = ACTIVATIONS[activation][1](x)
    bound = np.full_like(x, 2.0 ** -126)  # flushed to zero
    if activation != "relu":
        bound += 2.0 ** -20 * (1 + np.abs(x))
    if out_dtype == "bfloat16":
        bound += 2.0 ** -8 * np.abs(exact)
    return bound


relu_tile = make_activation_tile("relu", "float32")
relu_bf16_tile = make_activation_tile("relu", "bfloat16")
