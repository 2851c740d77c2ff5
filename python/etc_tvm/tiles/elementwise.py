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
from .vectors import copy_16_bytes

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
    tile = device_func((act if split_k == 1 else split_act).with_attr("global_symbol", name),
                       requires=[(M % rows == 0, f"M a multiple of {rows}"),
                                 (N % cols == 0, f"N a multiple of {cols}")])

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


# ------------------------------------------------------------------ decode epilogues (bf16)
# Decode tensors have a few rows (M = 1..16, symbolic) and wide rows, so these tiles own a
# column block of every row: task j covers columns [j*cols, (j+1)*cols) of all M rows, each
# thread moving 8 bf16 (16 bytes) per step. A column block lines up with a GEMV slab (bn), so
# one GEMV task feeds one epilogue task through a "j->j" edge.
BF16_VEC = 8


def _check_decode(kind: str, cols: int, threads: int) -> None:
    if cols % BF16_VEC or threads % 32:
        raise EtcError(f"{kind} tile: cols must be a multiple of {BF16_VEC} and threads whole "
                       f"warps, got cols={cols}, threads={threads}")


@T.inline
def _combine_vectors(j, rows, tx, cols, threads, X, x0, Z, z0, Y, x, z, combine):
    """``Y[m, c + e] = bf16(combine(X[m, x0 + c + e], Z[m, z0 + c + e]))`` in fp32, over the
    8-wide vectors ``[m, c:c+8]`` of rows ``0..rows-1`` and the columns of block ``j``, dealt
    to the threads in turn; ``x`` and ``z`` hold a thread's two input vectors."""
    vecs = T.meta_var(cols // BF16_VEC)
    for t in T.serial((rows * vecs + threads - 1) // threads):
        v = T.meta_var(t * threads + tx)
        if v < rows * vecs:
            m = T.meta_var(v // vecs)
            c = T.meta_var(j * cols + v % vecs * BF16_VEC)
            copy_16_bytes(x.ptr_to([0]), X.ptr_to([m, x0 + c]))
            copy_16_bytes(z.ptr_to([0]), Z.ptr_to([m, z0 + c]))
            for e in T.unroll(BF16_VEC):
                x[e] = T.Cast("bfloat16", combine(T.Cast("float32", x[e]),
                                                  T.Cast("float32", z[e])))
            copy_16_bytes(Y.ptr_to([m, c]), x.ptr_to([0]))


@functools.cache
def make_silu_mul_tile(cols: int = 128, threads: int = 128) -> DeviceFunc:
    """The tile ``silu_mul_c<cols>_t<threads>``: ``Y = silu(gate) * up`` for ``H = [gate | up]``
    of shape (M, 2F), Y (M, F), bf16 in and out, fp32 math (F a multiple of cols).

    Bound: the SiLU contract above times ``|up|``, then one bf16 rounding:
    ``|Y - y| <= 2**-8 |y| + 2**-20 (1 + |gate|) |up|`` (``silu_mul_error_bound``)."""
    _check_decode("silu_mul", cols, threads)
    M, F2, F = (tirx.Var(d, "int32") for d in ("M", "F2", "F"))

    @T.prim_func
    def silu_mul(j: T.int32, H: T.Buffer((M, F2), "bfloat16"), Y: T.Buffer((M, F), "bfloat16")):
        T.device_entry()
        tx = T.thread_id([threads])
        gate = T.alloc_local((BF16_VEC,), "bfloat16")
        up = T.alloc_local((BF16_VEC,), "bfloat16")
        _combine_vectors(j, M, tx, cols, threads, H, 0, H, F2 // 2, Y, gate, up,
                         lambda g, u: _silu(g) * u)

    tile = device_func(silu_mul.with_attr("global_symbol", f"silu_mul_c{cols}_t{threads}"),
                       requires=[(F % cols == 0, f"F a multiple of {cols}"),
                                 (F2 == 2 * F, "H twice as wide as Y")])

    @tile.set_reference
    def _(j, H, Y):
        block, width = slice(j * cols, (j + 1) * cols), H.shape[1] // 2
        gate = H[:, block].astype(np.float32)
        up = H[:, width + j * cols:width + (j + 1) * cols].astype(np.float32)
        Y[:, block] = (_np_silu(gate) * up).astype(Y.dtype)

    return tile


def silu_mul_float64(H: np.ndarray) -> np.ndarray:
    h = H.astype(np.float64)
    gate, up = np.split(h, 2, axis=1)
    return _np_silu(gate) * up


def silu_mul_error_bound(H: np.ndarray) -> np.ndarray:
    """The elementwise bound on ``|Y - silu(gate) * up|`` (see ``make_silu_mul_tile``)."""
    gate, up = np.split(np.abs(H.astype(np.float64)), 2, axis=1)
    return (2.0 ** -8 * np.abs(silu_mul_float64(H)) + 2.0 ** -20 * (1 + gate) * up
            + 2.0 ** -126)


@functools.cache
def make_residual_add_tile(cols: int = 128, threads: int = 128) -> DeviceFunc:
    """The tile ``residual_add_c<cols>_t<threads>``: ``Y = A + B``, bf16 (M, N), added in fp32
    and rounded once: ``|Y - (A + B)| <= 2**-8 |A + B|`` (N a multiple of cols)."""
    _check_decode("residual_add", cols, threads)
    M, N = tirx.Var("M", "int32"), tirx.Var("N", "int32")

    @T.prim_func
    def residual_add(j: T.int32, A: T.Buffer((M, N), "bfloat16"),
                     B: T.Buffer((M, N), "bfloat16"), Y: T.Buffer((M, N), "bfloat16")):
        T.device_entry()
        tx = T.thread_id([threads])
        a = T.alloc_local((BF16_VEC,), "bfloat16")
        b = T.alloc_local((BF16_VEC,), "bfloat16")
        _combine_vectors(j, M, tx, cols, threads, A, 0, B, 0, Y, a, b, lambda p, q: p + q)

    tile = device_func(residual_add.with_attr("global_symbol",
                                              f"residual_add_c{cols}_t{threads}"),
                       requires=[(N % cols == 0, f"N a multiple of {cols}")])

    @tile.set_reference
    def _(j, A, B, Y):
        block = slice(j * cols, (j + 1) * cols)
        Y[:, block] = (A[:, block].astype(np.float32) + B[:, block].astype(np.float32)).astype(
            Y.dtype)

    return tile
