"""RMSNorm tile: ``Y[i] = X[i] * rsqrt(mean(X[i]**2) + eps) * w`` for one row per task.

X and Y are bf16 (M, H), w is the bf16 (H,) weight; M and H are symbolic, H a multiple of 8.
One task per row (``tile_num=(M,)``) because decode has few rows and each is short: a row of
hidden 4096 is 8 KB, two 16-byte loads per thread at 128 threads.

Each thread adds the squares of its 8-element vectors in fp32, a warp shuffle tree and shared
memory add the warps, every thread reads the total; a second pass (the row is in L1 by then)
scales, multiplies by w and rounds once to bf16. Unlike PyTorch's reference modules there is no
intermediate bf16 rounding of ``X * rstd``: all the math is fp32.

Numeric contract against float64 of the same formula on the same bf16 inputs: the fp32 sum of H
positive squares is off by at most ``H * 2**-24`` relative, so rstd by half that; ``rsqrtf``
(fast math) and the two products add about ``2**-20``; the bf16 output adds ``2**-8``:
``|Y - y| <= (2**-8 + H * 2**-25 + 2**-20) * |y|``. ``error_bound`` computes this.
"""
from __future__ import annotations

import functools

import numpy as np
from tvm import tirx
from tvm.script import tirx as T

from ..device_func import DeviceFunc, device_func
from ..errors import EtcError
from .vectors import copy_16_bytes

VEC = 8  # bf16 per 16-byte load
WARP = 32


@functools.cache
def make_rmsnorm_tile(eps: float = 1e-6, threads: int = 128) -> DeviceFunc:
    """The tile ``rmsnorm_eps<eps, as 1em06>_t<threads>``: task ``i`` normalises row i."""
    if threads % WARP or not eps > 0:
        raise EtcError(f"rmsnorm tile: threads must be whole warps and eps positive, got "
                       f"threads={threads}, eps={eps}")
    warps = threads // WARP
    M, H = tirx.Var("M", "int32"), tirx.Var("H", "int32")

    @T.prim_func
    def rmsnorm(i: T.int32, X: T.Buffer((M, H), "bfloat16"), w: T.Buffer((H,), "bfloat16"),
                Y: T.Buffer((M, H), "bfloat16")):
        T.device_entry()
        tx = T.thread_id([threads])
        warp = T.warp_id([warps])
        lane = T.lane_id([WARP])
        partial = T.alloc_shared((warps,), "float32")
        xv = T.alloc_local((VEC,), "bfloat16")
        wv = T.alloc_local((VEC,), "bfloat16")
        acc = T.alloc_local((1,), "float32")
        acc[0] = T.float32(0)
        for t in T.serial((H // VEC + threads - 1) // threads):
            if (t * threads + tx) * VEC < H:
                copy_16_bytes(xv.ptr_to([0]), X.ptr_to([i, (t * threads + tx) * VEC]))
                for e in T.unroll(VEC):
                    acc[0] = acc[0] + T.Cast("float32", xv[e]) * T.Cast("float32", xv[e])
        acc[0] = T.cuda.warp_sum(acc[0])
        if lane == 0:
            partial[warp] = acc[0]
        T.cuda.cta_sync()
        acc[0] = partial[0]
        for k in T.unroll(warps - 1):
            acc[0] = acc[0] + partial[k + 1]
        acc[0] = T.rsqrt(acc[0] / T.Cast("float32", H) + T.float32(eps))
        for t in T.serial((H // VEC + threads - 1) // threads):
            if (t * threads + tx) * VEC < H:
                copy_16_bytes(xv.ptr_to([0]), X.ptr_to([i, (t * threads + tx) * VEC]))
                copy_16_bytes(wv.ptr_to([0]), w.ptr_to([(t * threads + tx) * VEC]))
                for e in T.unroll(VEC):
                    xv[e] = T.Cast("bfloat16", T.Cast("float32", xv[e]) * acc[0]
                                   * T.Cast("float32", wv[e]))
                copy_16_bytes(Y.ptr_to([i, (t * threads + tx) * VEC]), xv.ptr_to([0]))

    tag = f"{eps:.3g}".replace("-", "m").replace("+", "").replace(".", "p")  # 1e-06 -> 1em06
    tile = device_func(rmsnorm.with_attr("global_symbol", f"rmsnorm_eps{tag}_t{threads}"),
                       requires=[(H % VEC == 0, f"H a multiple of {VEC}")])

    @tile.set_reference
    def _(i, X, w, Y):
        x = X[i].astype(np.float32)
        rstd = np.float32(1) / np.sqrt(np.mean(x * x, dtype=np.float32) + np.float32(eps))
        Y[i] = (x * rstd * w.astype(np.float32)).astype(Y.dtype)

    return tile


def rmsnorm_float64(X: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """The exact RMSNorm of the bf16 inputs, in float64."""
    x = X.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w.astype(np.float64)


def error_bound(X: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """The elementwise bound on ``|Y - rmsnorm(X)|`` of the tile (see the module docstring)."""
    y = np.abs(rmsnorm_float64(X, w, eps))
    return (2.0 ** -8 + X.shape[-1] * 2.0 ** -25 + 2.0 ** -20) * y + 2.0 ** -133


rmsnorm_tile = make_rmsnorm_tile()
