"""Decode attention with grouped-query heads over a contiguous KV cache (flash-decoding).

One decode step of B sequences, 32 query heads sharing 4 KV heads (groups of 8), head dim 128,
bf16. Three tiles, chained by tile-level edges (``tests/python/attention_graph.py``)::

    append, task b:       K_cache[b, :, seq_lens[b]] = k_new[b]; likewise V; pos[b] = seq_lens[b]
    split,  task (b,h,s): the 8 query heads of KV head h over tokens [s*chunk, (s+1)*chunk)
                          of 0 .. pos[b]: O_part[b,h,s] (normalised, fp32) and lse[b,h,s]
    merge,  task (b,h):   out[b, 8h:8h+8] = the lse-weighted mean of O_part[b,h,:] (bf16)

Layouts. ``K_cache, V_cache: [B, 4, max_len, 128]`` (kv-head major, "HND"): a split task's
chunk is one contiguous run of ``chunk * 256`` bytes, read as whole DRAM pages (and a later TMA
tile can load it as one box); with ``[B, max_len, 4, 128]`` the same rows would be 256-byte
pieces 1 KB apart. The append writes one 256-byte row per head in either layout.
``O_part: [B, 4, S, 8, 128]`` fp32 and ``lse: [B, 4, S, 8]`` fp32, ``S = ceil(max_len /
chunk)``; lse is in base 2 (scores are pre-scaled by log2(e), so every exponential is one
``ex2``): ``lse = log2(sum_t exp2(x_t))`` over the chunk. B and max_len are symbolic; the
lengths are run-time data.

The cache is state: the append writes into ``K_cache`` and ``V_cache`` in place (they are
inputs that the tile ``updates``, see ``DeviceFunc``), and a split task reads the row it wrote,
so it waits for the append of its sequence (``"bhs->b"``); its ``pos`` output orders the calls
when they run as separate launches. Bounds: a length outside ``[0, max_len)`` (no room for this
step's token) writes nothing, sets ``pos[b] = -1``, and the merge writes NaN for all of that
sequence's output, so a full cache is loud, never a wild write nor a silently shorter context.

Inside a split task (128 threads; half-warp ``rg = tx // 16`` owns rows ``rg, rg + 8, ...`` of
the chunk, lane ``c = tx % 16`` owns dims ``8c .. 8c+7`` of every row)::

    q[8 heads, 8 dims] -> fp32 registers, pre-scaled by log2(e) / sqrt(128)
    K rows: one 16-byte load per thread and row (a half-warp reads one 256-byte row), UNROLL
            rows in flight; 8 partial dots per row (the GQA sharing: each loaded K element
            serves the 8 heads), a 16-lane shuffle sum -> scores[8, chunk] in shared memory
    per head (2 per warp): m = max, p = exp2(score - m), l = sum p   (exact over the chunk)
    V rows: the same loads; acc[8 heads, 8 dims] += p * v in fp32 registers
    half-warps, then warps, summed through shared memory; O_part = acc / l, lse = m + log2(l)

fp32 FMA on CUDA cores, not tensor cores: decode attention moves 2 x 256 bytes per token for
16 x 128 FLOP (8 heads, QK and PV), about 4 FLOP per byte, far below where mma.sync would pay;
the FMA path keeps the numerics simple to bound and the thread layout identical for K and V.

Empty splits: a task whose chunk starts at or beyond the sequence's ``pos[b] + 1`` tokens (every
task of a sequence with ``pos[b] = -1``) writes ``O_part = 0`` and ``lse = -inf``: its merge
weight ``exp2(-inf - M)`` is exactly 0. Split 0 of a valid sequence always holds a token, so
the merge's maximum ``M`` is finite.

Numeric contract (bf16 inputs, fp32 math with TVM's fast math: ``ex2.approx``, ``lg2.approx``,
approximate division), against float64 attention of the same bf16 values (``error_bound``).
With ``x_t`` the exact base-2 score of token t and ``A = sum_t p_t |v_t| / sum_t p_t``:

* a score: q scaled by an fp32 constant, D = 128 exact-input products rounded and summed in fp32:
  ``|dx_t| <= (D + 3) 2**-24 log2(e)/sqrt(D) sum_i |q_i k_ti|``;
* a weight ``exp2(x - m)``: relative ``ln2 (|dx_t| + 2**-23 (|x_t| + max|x|)) + 2**-21``
  (the subtraction, ex2.approx); a split's lse adds ``ln2 (2**-22 + 2**-23 |lse|)`` (lg2.approx,
  the addition) and ``chunk 2**-24`` (the sum l); the merge weight another ex2, ``2**-21``;
* a ratio of weighted sums whose weights are off by a relative rho moves by at most
  ``2 rho A / (1 - rho)``; fp32 sums of at most chunk (then S) terms add ``(chunk + S) 2**-24 A``;
  two approximate divisions ``2**-22 A``;
* the bf16 output rounds: ``2**-8 |o|``.

Each term is rounded up; ``error_bound`` sums them per output element.
"""
from __future__ import annotations

import functools
import math

import ml_dtypes
import numpy as np
from tvm import tirx
from tvm.script import tirx as T

from ..device_func import DeviceFunc, device_func
from ..errors import EtcError

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 4, 128
GROUP = Q_HEADS // KV_HEADS  # query heads per KV head
THREADS = 128
VEC = 8  # bf16 per 16-byte load
LANES = HEAD_DIM // VEC  # threads that hold one row: a half-warp
ROW_GROUPS = THREADS // LANES  # rows a CTA loads at once
WARPS = THREADS // 32
SCALE_LOG2 = math.log2(math.e) / math.sqrt(HEAD_DIM)  # scores in base 2: exp2 is one ex2
NEG_INF = float("-inf")
BF16 = ml_dtypes.bfloat16


def num_splits(max_len, chunk: int):
    """Split tasks per (sequence, KV head): enough chunks to cover the cache."""
    return (max_len + chunk - 1) // chunk


@functools.cache
def make_kv_append_tile() -> DeviceFunc:
    """The tile ``kv_append``: task b writes this step's K and V rows of sequence b, all 4 KV
    heads, at ``seq_lens[b]``; one 16-byte vector per thread (64 for K, 64 for V)."""
    B, L = tirx.Var("B", "int32"), tirx.Var("L", "int32")

    @T.prim_func
    def kv_append(b: T.int32, k_new: T.Buffer((B, KV_HEADS, HEAD_DIM), "bfloat16"),
                  v_new: T.Buffer((B, KV_HEADS, HEAD_DIM), "bfloat16"),
                  seq_lens: T.Buffer((B,), "int32"),
                  K_cache: T.Buffer((B, KV_HEADS, L, HEAD_DIM), "bfloat16"),
                  V_cache: T.Buffer((B, KV_HEADS, L, HEAD_DIM), "bfloat16"),
                  pos: T.Buffer((B,), "int32")):
        T.device_entry()
        tx = T.thread_id([THREADS])
        at = T.local_scalar("int32")
        at = seq_lens[b]
        half = T.meta_var(KV_HEADS * LANES)  # vectors per cache: K by tx < half, V by the rest
        h = T.meta_var(tx % half // LANES)
        col = T.meta_var(tx % LANES * VEC)
        if at >= 0 and at < L:
            if tx < half:
                for e in T.vectorized(VEC):
                    K_cache[b, h, at, col + e] = k_new[b, h, col + e]
            else:
                for e in T.vectorized(VEC):
                    V_cache[b, h, at, col + e] = v_new[b, h, col + e]
        if tx == 0:
            pos[b] = T.if_then_else(at >= 0 and at < L, at, -1)

    tile = device_func(kv_append.with_attr("global_symbol", "kv_append"),
                       updates=("K_cache", "V_cache"))

    @tile.set_reference
    def _(b, k_new, v_new, seq_lens, K_cache, V_cache, pos):
        at = int(seq_lens[b])
        if 0 <= at < K_cache.shape[2]:
            K_cache[b, :, at] = k_new[b]
            V_cache[b, :, at] = v_new[b]
            pos[b] = at
        else:
            pos[b] = -1

    return tile


@functools.cache
def make_decode_split_tile(chunk: int = 256, unroll: int = 4) -> DeviceFunc:
    """The tile ``decode_split_c<chunk>``: task (b, h, s), the partial attention of the 8 query
    heads of KV head h over the s-th chunk of sequence b's ``pos[b] + 1`` tokens.

    ``unroll`` rows per thread are loaded before the first is used (loads in flight).
    """
    if chunk % (ROW_GROUPS * unroll) or chunk % 32:
        raise EtcError(f"decode split tile: chunk must be a multiple of {ROW_GROUPS} x unroll "
                       f"and of 32, got chunk={chunk}, unroll={unroll}")
    steps = chunk // ROW_GROUPS // unroll
    B, L, S = (tirx.Var(d, "int32") for d in "BLS")

    @T.inline
    def load_rows(kv, Cache, b, h, start, it, rg, col, count):
        # ``unroll`` rows of this half-warp, one 16-byte load each; rows past count stay unread
        for u in T.unroll(unroll):
            if (it * unroll + u) * ROW_GROUPS + rg < count:
                for e in T.vectorized(VEC):
                    kv[u, e] = Cache[b, h, start + (it * unroll + u) * ROW_GROUPS + rg, col + e]

    @T.prim_func
    def decode_split(b: T.int32, h: T.int32, s: T.int32,
                     q: T.Buffer((B, Q_HEADS, HEAD_DIM), "bfloat16"),
                     K_cache: T.Buffer((B, KV_HEADS, L, HEAD_DIM), "bfloat16"),
                     V_cache: T.Buffer((B, KV_HEADS, L, HEAD_DIM), "bfloat16"),
                     pos: T.Buffer((B,), "int32"),
                     O_part: T.Buffer((B, KV_HEADS, S, GROUP, HEAD_DIM), "float32"),
                     lse: T.Buffer((B, KV_HEADS, S, GROUP), "float32")):
        T.device_entry()
        tx = T.thread_id([THREADS])
        warp = T.warp_id([WARPS])
        lane = T.lane_id([32])
        scores = T.alloc_shared((GROUP, chunk), "float32")
        partial = T.alloc_shared((WARPS, GROUP, HEAD_DIM), "float32")
        stats = T.alloc_shared((2, GROUP), "float32")  # per head: max, sum
        qr = T.alloc_local((GROUP, VEC), "float32")
        qv = T.alloc_local((VEC,), "bfloat16")
        kv = T.alloc_local((unroll, VEC), "bfloat16")
        dot = T.alloc_local((GROUP,), "float32")
        acc = T.alloc_local((GROUP, VEC), "float32")
        red = T.alloc_local((2,), "float32")
        count = T.local_scalar("int32")
        rg = T.meta_var(tx // LANES)
        c = T.meta_var(tx % LANES)
        col = T.meta_var(tx % LANES * VEC)
        start = T.meta_var(s * chunk)
        # tokens of this chunk: pos[b] + 1 in all (0 without a valid append), capped at L
        count = T.min(T.min(T.max(pos[b] + 1, 0), L) - start, chunk)
        if count <= 0:
            for half in T.unroll(2):
                for e in T.vectorized(VEC // 2):
                    O_part[b, h, s, rg, col + half * (VEC // 2) + e] = T.float32(0)
            if tx < GROUP:
                lse[b, h, s, tx] = T.float32(NEG_INF)
        else:
            for g in T.unroll(GROUP):
                for e in T.vectorized(VEC):
                    qv[e] = q[b, h * GROUP + g, col + e]
                for e in T.unroll(VEC):
                    qr[g, e] = T.Cast("float32", qv[e]) * T.float32(SCALE_LOG2)
            # scores = q . k for the 8 heads; each K element loaded once serves all 8
            for it in T.serial(steps):
                load_rows(kv, K_cache, b, h, start, it, rg, col, count)
                for u in T.unroll(unroll):
                    for g in T.unroll(GROUP):
                        dot[g] = T.float32(0)
                        for e in T.unroll(VEC):
                            dot[g] = dot[g] + qr[g, e] * T.Cast("float32", kv[u, e])
                        dot[g] = T.cuda.warp_sum(dot[g], LANES)
                    if (it * unroll + u) * ROW_GROUPS + rg < count:
                        for g in T.unroll(GROUP):
                            if c == g:
                                scores[g, (it * unroll + u) * ROW_GROUPS + rg] = dot[g]
            T.cuda.cta_sync()
            # softmax statistics of the chunk, two heads per warp
            for k in T.unroll(GROUP // WARPS):
                red[0] = T.float32(NEG_INF)
                for j in T.serial(chunk // 32):
                    if j * 32 + lane < count:
                        red[0] = T.max(red[0], scores[warp * 2 + k, j * 32 + lane])
                red[0] = T.cuda.warp_max(red[0])
                red[1] = T.float32(0)
                for j in T.serial(chunk // 32):
                    if j * 32 + lane < count:
                        scores[warp * 2 + k, j * 32 + lane] = T.exp2(
                            scores[warp * 2 + k, j * 32 + lane] - red[0])
                        red[1] = red[1] + scores[warp * 2 + k, j * 32 + lane]
                red[1] = T.cuda.warp_sum(red[1])
                if lane == 0:
                    stats[0, warp * 2 + k] = red[0]
                    stats[1, warp * 2 + k] = red[1]
            T.cuda.cta_sync()
            # acc = p @ v over this thread's rows and dims
            for g in T.unroll(GROUP):
                for e in T.unroll(VEC):
                    acc[g, e] = T.float32(0)
            for it in T.serial(steps):
                load_rows(kv, V_cache, b, h, start, it, rg, col, count)
                for u in T.unroll(unroll):
                    if (it * unroll + u) * ROW_GROUPS + rg < count:
                        for g in T.unroll(GROUP):
                            for e in T.unroll(VEC):
                                acc[g, e] = acc[g, e] + scores[
                                    g, (it * unroll + u) * ROW_GROUPS + rg] * T.Cast(
                                    "float32", kv[u, e])
            # the two half-warps of a warp, then the warps through shared memory
            for g in T.unroll(GROUP):
                for e in T.unroll(VEC):
                    acc[g, e] = acc[g, e] + T.tvm_warp_shuffle_xor(
                        T.uint32(0xFFFFFFFF), acc[g, e], 16, 32, 32)
            if lane < LANES:
                for g in T.unroll(GROUP):
                    for half in T.unroll(2):
                        for e in T.vectorized(VEC // 2):
                            partial[warp, g, col + half * (VEC // 2) + e] = \
                                acc[g, half * (VEC // 2) + e]
            T.cuda.cta_sync()
            # thread tx finishes head tx // 16, dims 8 (tx % 16) ..
            for e in T.unroll(VEC):
                acc[0, e] = partial[0, rg, col + e]
                for w in T.unroll(WARPS - 1):
                    acc[0, e] = acc[0, e] + partial[w + 1, rg, col + e]
            for half in T.unroll(2):
                for e in T.vectorized(VEC // 2):
                    O_part[b, h, s, rg, col + half * (VEC // 2) + e] = \
                        acc[0, half * (VEC // 2) + e] / stats[1, rg]
            if c == 0:
                lse[b, h, s, rg] = stats[0, rg] + T.log2(stats[1, rg])

    tile = device_func(decode_split.with_attr("global_symbol", f"decode_split_c{chunk}"),
                       cost=chunk / 64, requires=[(L <= S * chunk, f"L at most S x {chunk}")])

    @tile.set_reference
    def _(b, h, s, q, K_cache, V_cache, pos, O_part, lse):
        length = min(max(int(pos[b]) + 1, 0), K_cache.shape[2])
        rows = slice(s * chunk, min((s + 1) * chunk, length))
        if rows.start >= length:
            O_part[b, h, s] = 0
            lse[b, h, s] = NEG_INF
            return
        heads = slice(h * GROUP, (h + 1) * GROUP)
        qs = q[b, heads].astype(np.float32) * np.float32(SCALE_LOG2)
        x = qs @ K_cache[b, h, rows].astype(np.float32).T  # (8, tokens)
        m = x.max(axis=1, keepdims=True)
        p = np.exp2(x - m)
        total = p.sum(axis=1, dtype=np.float32)
        O_part[b, h, s] = (p @ V_cache[b, h, rows].astype(np.float32)) / total[:, None]
        lse[b, h, s] = m[:, 0] + np.log2(total)

    return tile


@functools.cache
def make_decode_merge_tile() -> DeviceFunc:
    """The tile ``decode_merge``: task (b, h) rescales the splits of KV head h's 8 query heads
    by ``exp2(lse_s - max lse)`` and writes their normalised sum as bf16; thread tx owns head
    ``tx // 16``, dims ``8 (tx % 16) ..`` (two 16-byte fp32 loads per split, one bf16 store)."""
    B, S = tirx.Var("B", "int32"), tirx.Var("S", "int32")

    @T.prim_func
    def decode_merge(b: T.int32, h: T.int32,
                     O_part: T.Buffer((B, KV_HEADS, S, GROUP, HEAD_DIM), "float32"),
                     lse: T.Buffer((B, KV_HEADS, S, GROUP), "float32"),
                     pos: T.Buffer((B,), "int32"),
                     out: T.Buffer((B, Q_HEADS, HEAD_DIM), "bfloat16")):
        T.device_entry()
        tx = T.thread_id([THREADS])
        acc = T.alloc_local((VEC,), "float32")
        part = T.alloc_local((VEC,), "float32")
        res = T.alloc_local((VEC,), "bfloat16")
        top = T.local_scalar("float32")
        weight = T.local_scalar("float32")
        total = T.local_scalar("float32")
        g = T.meta_var(tx // LANES)
        col = T.meta_var(tx % LANES * VEC)
        top = T.float32(NEG_INF)
        for s in T.serial(S):
            top = T.max(top, lse[b, h, s, g])
        total = T.float32(0)
        for e in T.unroll(VEC):
            acc[e] = T.float32(0)
        for s in T.serial(S):
            weight = T.exp2(lse[b, h, s, g] - top)  # 0 for an empty split (lse = -inf)
            total = total + weight
            for e in T.vectorized(VEC // 2):
                part[e] = O_part[b, h, s, g, col + e]
            for e in T.vectorized(VEC // 2):
                part[VEC // 2 + e] = O_part[b, h, s, g, col + VEC // 2 + e]
            for e in T.unroll(VEC):
                acc[e] = acc[e] + weight * part[e]
        for e in T.unroll(VEC):
            res[e] = T.Cast("bfloat16", T.if_then_else(pos[b] >= 0, acc[e] / total,
                                                      T.float32(float("nan"))))
        for e in T.vectorized(VEC):
            out[b, h * GROUP + g, col + e] = res[e]

    tile = device_func(decode_merge.with_attr("global_symbol", "decode_merge"))

    @tile.set_reference
    def _(b, h, O_part, lse, pos, out):
        heads = slice(h * GROUP, (h + 1) * GROUP)
        if pos[b] < 0:
            out[b, heads] = np.nan
            return
        weight = np.exp2(lse[b, h] - lse[b, h].max(axis=0))  # (S, 8)
        total = weight.sum(axis=0, dtype=np.float32)
        value = np.einsum("sg,sgd->gd", weight, O_part[b, h]) / total[:, None]
        out[b, heads] = value.astype(out.dtype)

    return tile


def cache_with_step(k_new, v_new, K_cache, V_cache, seq_lens):
    """The caches after this step's append (copies; an out-of-range length changes nothing)."""
    K, V = K_cache.copy(), V_cache.copy()
    for b, at in enumerate(seq_lens):
        if 0 <= at < K.shape[2]:
            K[b, :, at], V[b, :, at] = k_new[b], v_new[b]
    return K, V


def attention_float64(q, k_new, v_new, K_cache, V_cache, seq_lens):
    """Decode attention in float64 with this step's token appended: ``(out, A, x)`` with
    ``out`` (B, 32, 128), the weighted mean ``A`` of |v| (B, 32, 128) and, per head, the
    base-2 scores' bounds ``(max |x|, max score error)`` (B, 32, 2). NaN rows for sequences
    whose length leaves no room."""
    K, V = cache_with_step(k_new, v_new, K_cache, V_cache, seq_lens)
    B = q.shape[0]
    out = np.full((B, Q_HEADS, HEAD_DIM), np.nan)
    mean_abs = np.full((B, Q_HEADS, HEAD_DIM), np.nan)
    scores = np.full((B, Q_HEADS, 2), np.nan)
    qd = q.astype(np.float64)
    for b in range(B):
        if not 0 <= seq_lens[b] < K.shape[2]:
            continue
        n = int(seq_lens[b]) + 1
        for g in range(Q_HEADS):
            k = K[b, g // GROUP, :n].astype(np.float64)
            v = V[b, g // GROUP, :n].astype(np.float64)
            x = (k @ qd[b, g]) * SCALE_LOG2
            p = np.exp2(x - x.max())
            out[b, g] = p @ v / p.sum()
            mean_abs[b, g] = p @ np.abs(v) / p.sum()
            dx = (HEAD_DIM + 3) * 2.0 ** -24 * SCALE_LOG2 * (np.abs(k) @ np.abs(qd[b, g]))
            scores[b, g] = np.abs(x).max(), dx.max()
    return out, mean_abs, scores


def error_bound(q, k_new, v_new, K_cache, V_cache, seq_lens, chunk: int = 256):
    """``(want, bound)``: float64 attention and the elementwise bound on the tiles' bf16 output
    against it (see the module docstring); NaN where a sequence has no room (the tiles write
    NaN there too)."""
    want, mean_abs, scores = attention_float64(q, k_new, v_new, K_cache, V_cache, seq_lens)
    splits = num_splits(K_cache.shape[2], chunk)
    x_max, dx = scores[..., 0], scores[..., 1]
    ln2 = math.log(2)
    lse_max = x_max + math.log2(chunk)
    rho = (ln2 * (dx + 2.0 ** -22 * x_max) + 2.0 ** -21  # a token's weight within its split
           + ln2 * (2.0 ** -22 + 2.0 ** -23 * lse_max) + chunk * 2.0 ** -24  # the split's lse
           + 2.0 ** -21)  # the merge weight
    rate = 2 * rho / (1 - rho) + (chunk + splits) * 2.0 ** -24 + 2.0 ** -22
    return want, 2.0 ** -8 * np.abs(want) + rate[..., None] * mean_abs


kv_append_tile = make_kv_append_tile()
decode_split_tile = make_decode_split_tile()
decode_merge_tile = make_decode_merge_tile()
