"""Qwen3 attention prologue: per-head RMSNorm of q and k, then rotary embedding (neox layout).

Task t handles token t: for every q head and k head (D = head_dim),

    xn   = x * rsqrt(mean(x**2) + eps) * w          (w: learned, one per dim, q and k apart)
    out[d]       = xn[d] * cos(a_d) - xn[d + D/2] * sin(a_d)       d < D/2
    out[d + D/2] = xn[d + D/2] * cos(a_d) + xn[d] * sin(a_d)
    a_d  = positions[t] * theta ** (-2d / D)

q (T, Hq*D) and k (T, Hk*D) bf16 in, bf16 out; positions (T,) int32 is runtime data. One warp
per head (lane l holds dims ``l*P .. l*P+P-1`` of each half, P = D/64), the sum of squares a
warp shuffle; the D/2 (cos, sin) pairs of the token are computed once per task into shared
memory, in float64 and rounded to fp32. Why float64: positions reach 1e5 and more, the fp32
angle alone is off by ``|a| * 2**-24`` (0.006 rad at 1e5) and fast-math ``sinf`` is only accurate
near 0; float64 costs D/2 sin/cos per token, next to nothing.

Numeric contract, against float64 of the same bf16 inputs: the sum of squares, rsqrt.approx and
the products give xn within ``2**-18 * |xn|``; the fp32 cos/sin within ``2**-24``; the rotation adds
two roundings; the output one bf16 rounding: ``|out - out64| <= 2**-8 * |out64| + 2**-16 *
(|xn64[d]| + |xn64[d + D/2]|)``. ``error_bound`` computes it.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from tvm import tirx
from tvm.script import tirx as T

from ..device_func import DeviceFunc, device_func
from ..errors import EtcError

WARP = 32


@functools.cache
def make_qk_norm_rope_tile(q_heads: int = 32, kv_heads: int = 4, head_dim: int = 128,
                           eps: float = 1e-6, theta: float = 1e6,
                           threads: int = 128) -> DeviceFunc:
    """The tile ``qk_norm_rope_<Hq>q<Hk>k_d<D>``: task t normalises and rotates token t's q
    and k heads."""
    Hq, Hk, D = q_heads, kv_heads, head_dim
    if D % (2 * WARP) or threads % WARP:
        raise EtcError(f"qk_norm_rope tile: head_dim {D} must be a multiple of {2 * WARP} and "
                       f"threads {threads} whole warps")
    P, half, warps = D // (2 * WARP), D // 2, threads // WARP
    log_theta = math.log(theta)
    ntok = tirx.Var("T", "int32")

    @T.prim_func
    def qk_norm_rope(t: T.int32, q: T.Buffer((ntok, Hq * D), "bfloat16"),
                     k: T.Buffer((ntok, Hk * D), "bfloat16"), q_weight: T.Buffer((D,), "bfloat16"),
                     k_weight: T.Buffer((D,), "bfloat16"), positions: T.Buffer((ntok,), "int32"),
                     q_out: T.Buffer((ntok, Hq * D), "bfloat16"),
                     k_out: T.Buffer((ntok, Hk * D), "bfloat16")):
        T.device_entry()
        tx = T.thread_id([threads])
        warp = T.warp_id([warps])
        lane = T.lane_id([WARP])
        cs = T.alloc_shared((2, half), "float32")
        a = T.alloc_local((P,), "float32")
        b = T.alloc_local((P,), "float32")
        for r in T.serial((half + threads - 1) // threads):
            if r * threads + tx < half:
                d = T.meta_var(r * threads + tx)
                angle = T.meta_var(T.Cast("float64", positions[t]) * T.exp(
                    T.float64(-2.0 * log_theta / D) * T.Cast("float64", d)))
                cs[0, d] = T.Cast("float32", T.cos(angle))
                cs[1, d] = T.Cast("float32", T.sin(angle))
        T.cuda.cta_sync()

        @T.inline
        def one_head(X, W, Y, base):
            ss = T.local_scalar("float32")
            ss = T.float32(0)
            for j in T.unroll(P):
                a[j] = T.Cast("float32", X[t, base + lane * P + j])
                b[j] = T.Cast("float32", X[t, base + half + lane * P + j])
                ss = ss + a[j] * a[j] + b[j] * b[j]
            ss = T.cuda.warp_sum(ss)
            scale = T.meta_var(T.rsqrt(ss / T.float32(D) + T.float32(eps)))
            for j in T.unroll(P):
                d = T.meta_var(lane * P + j)
                xa = T.meta_var(a[j] * scale * T.Cast("float32", W[d]))
                xb = T.meta_var(b[j] * scale * T.Cast("float32", W[half + d]))
                a[j] = xa
                b[j] = xb
            for j in T.unroll(P):
                d = T.meta_var(lane * P + j)
                Y[t, base + d] = T.Cast("bfloat16", a[j] * cs[0, d] - b[j] * cs[1, d])
                Y[t, base + half + d] = T.Cast("bfloat16", b[j] * cs[0, d] + a[j] * cs[1, d])

        for r in T.serial((Hq + warps - 1) // warps):
            if r * warps + warp < Hq:
                one_head(q, q_weight, q_out, (r * warps + warp) * D)
        for r in T.serial((Hk + warps - 1) // warps):
            if r * warps + warp < Hk:
                one_head(k, k_weight, k_out, (r * warps + warp) * D)

    name = f"qk_norm_rope_{Hq}q{Hk}k_d{D}_t{threads}"
    tile = device_func(qk_norm_rope.with_attr("global_symbol", name))

    @tile.set_reference
    def _(t, q, k, q_weight, k_weight, positions, q_out, k_out):
        cos, sin = rotary(positions[t:t + 1], D, theta)
        for X, W, Y, heads in ((q, q_weight, q_out, Hq), (k, k_weight, k_out, Hk)):
            x = X[t].astype(np.float32).reshape(heads, D)
            xn = x / np.sqrt((x * x).mean(axis=1, keepdims=True) + np.float32(eps)) \
                * W.astype(np.float32)
            Y[t] = rotate(xn, cos.astype(np.float32), sin.astype(np.float32)).reshape(-1) \
                .astype(Y.dtype)

    return tile


def rotary(positions: np.ndarray, head_dim: int, theta: float):
    """(cos, sin) of shape (len(positions), D/2), float64."""
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angle = positions.astype(np.float64)[:, None] * inv_freq
    return np.cos(angle), np.sin(angle)


def rotate(xn: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Neox (half-split) rotation of (..., D) by (D/2,) or broadcastable cos and sin."""
    half = xn.shape[-1] // 2
    x1, x2 = xn[..., :half], xn[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def qk_norm_rope_exact(x, weight, positions, heads: int, head_dim: int, eps: float = 1e-6,
                       theta: float = 1e6):
    """float64 (out, xn) of (T, heads*D) bf16 activations: what the tile approximates."""
    xs = x.astype(np.float64).reshape(len(x), heads, head_dim)
    xn = xs / np.sqrt((xs * xs).mean(axis=2, keepdims=True) + eps) * weight.astype(np.float64)
    cos, sin = rotary(positions, head_dim, theta)
    out = rotate(xn, cos[:, None, :], sin[:, None, :])
    return out.reshape(len(x), -1), xn.reshape(len(x), -1)


def error_bound(x, weight, positions, heads: int, head_dim: int, eps: float = 1e-6,
                theta: float = 1e6) -> np.ndarray:
    """The elementwise bound on ``|out - out64|`` (see the module docstring)."""
    out, xn = qk_norm_rope_exact(x, weight, positions, heads, head_dim, eps, theta)
    half = head_dim // 2
    pairs = np.abs(xn).reshape(len(x), heads, 2, half).sum(axis=2)
    mix = np.concatenate([pairs, pairs], axis=-1).reshape(len(x), -1)
    return 2.0 ** -8 * np.abs(out) + 2.0 ** -16 * mix + 2.0 ** -126
