"""Decode GEMV tiles: ``Y = X @ W`` for a few activation rows (M = 1..16) against bf16 weights.

At decode the weights are read once per token and dwarf everything else, so the tile is built
for weight bandwidth, not for reuse. ``X`` (M, K) and ``W`` (K, N) are bf16, row-major (W not
transposed); M, K and N are symbolic, and M may be any 1..``MAX_ROWS`` at run time.

Work split. Task ``j`` owns the ``bn``-column slab ``W[:, j*bn:(j+1)*bn]``; with ``split_k`` S
the task is ``(j, s)`` and owns K slice s of that slab, writing its fp32 partial product to
``P[s]`` of a (S, M, N) output that ``make_gemv_sum_tile`` adds up (in order) and rounds to bf16.
Split-K gives small-N GEMVs (o_proj, down_proj at hidden 2048) enough tasks to cover 132 SMs. A
second tile rather than fp32 atomics into a zeroed output: the result is deterministic, needs no
zeroing launch, and the sum tile is where the bf16 rounding happens; its extra traffic, S * M *
N * 4 bytes, is small next to the K * N * 2 bytes of weights.

Inside a task (``threads`` threads; ``bn / 8`` column groups of 8 columns, ``G`` row groups)::

    thread (row group g, column group c) reads the 16-byte vectors W[k, c*8:(c+1)*8] for the
    rows k = g, g + G, g + 2G, ... of its K slice; the lanes of one warp load whole 256-byte
    row pieces, so every load is one coalesced LDG.128.
    U vectors per batch, two batches of registers: batch b+1 is issued before batch b is used,
    so U to 2U loads (16 * U to 32 * U bytes) per thread are in flight at any time.
    acc[m, e] += float(X[m, k]) * float(W[k, c*8 + e])  for the R rows of X (fp32 FMAs; X is
    read from global, a warp-wide broadcast that L1 serves)
    warp shuffles add the row groups of a warp; shared memory adds the warps; threads store
    consecutive columns.

M is a run-time value: the tile branches once on it to code unrolled for R = 1, 2, 4, 8 or 16
rows, so M = 1 runs 8 FMAs per loaded vector, not 128. Rows R > M read
row M - 1 (an address that exists) and are never stored. The R = 16 code does 128 FMAs per
16-byte vector, near the FMA issue rate of the H200 at full bandwidth: past M = 8 the tile is
close to compute bound (the tensor-core GEMM tile with bm = 16 is the alternative there).

K must be a multiple of ``k_step(...)`` and N of bn. Split-K deals the K / k_step double
batches out to the slices as evenly as whole batches allow (slice s: batches
``s * n // S .. (s + 1) * n // S - 1``), so S need not divide them; S <= n.

Numeric contract: bf16 products are exact in fp32; the fp32 sums (in any order, split-K's
partial sums included) give ``|Y - X @ W| <= K * 2**-24 * (|X| @ |W|)`` against float64; a bf16
output adds ``2**-8 * |X @ W|``. ``error_bound`` computes this; relative to ``|X| @ |W|`` it is
about 2**-8 for bf16 output and K * 2**-24 for fp32 partials.
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
MAX_ROWS = 16  # activation rows a task serves; M may be any 1..16 at run time
OUT_DTYPES = ("float32", "bfloat16")


def unroll_for(rows: int) -> int:
    """Vectors per batch for ``rows`` activation rows: 8 (16 to 32 in flight per thread) while
    the 8 * rows fp32 accumulators leave room, 4 at 16 rows to stay under 255 registers."""
    return 8 if rows <= 8 else 4


def k_step(bn: int = 128, threads: int = 128) -> int:
    """The K rows one double batch of the tile covers: K slices must be multiples of it."""
    return 2 * unroll_for(1) * threads // (bn // VEC)


def _check(bn: int, threads: int, split_k: int, out_dtype: str) -> None:
    groups = bn // VEC
    if bn % VEC or groups > WARP or WARP % groups or threads % WARP:
        raise EtcError(f"gemv tile: bn must be 8 * a power of two up to 256 and threads whole "
                       f"warps, got bn={bn}, threads={threads}")
    if split_k < 1:
        raise EtcError(f"gemv tile: split_k must be positive, got {split_k}")
    if out_dtype not in OUT_DTYPES:
        raise EtcError(f"gemv tile: out_dtype must be one of {OUT_DTYPES}, got {out_dtype!r}")


@functools.cache
def make_gemv_tile(bn: int = 128, split_k: int = 1, threads: int = 128,
                   out_dtype: str = "bfloat16") -> DeviceFunc:
    """The tile ``gemv_n<bn>_<out>_t<threads>[_k<split_k>]``.

    split_k = 1: task ``j``, ``Y[:, slab j] = X @ W[:, slab j]`` in ``out_dtype``.
    split_k = S: task ``(j, s)``, ``P[s, :, slab j]`` = the fp32 product over K slice s.
    """
    if split_k > 1:
        out_dtype = "float32"
    _check(bn, threads, split_k, out_dtype)
    groups = bn // VEC  # column groups (threads across a slab row)
    per_warp = WARP // groups  # row groups per warp
    G = threads // groups  # row groups per CTA
    warps = threads // WARP
    M, N, K = (tirx.Var(d, "int32") for d in "MNK")
    step = k_step(bn, threads)

    @T.inline
    def gemv_body(j, s, X, W, Y, tx, warp, lane, red):
        # Y[:M, j*bn:(j+1)*bn] (a view: P[s] under split-K) = X[:, slice s] @ W[slice s, slab j]
        if split_k == 1:
            k0, kslice = T.meta_var((0, K))
        else:
            k0 = T.meta_var(s * (K // step) // split_k * step)
            kslice = T.meta_var(((s + 1) * (K // step) // split_k - s * (K // step) // split_k)
                                * step)
        c = T.meta_var(lane // per_warp)  # column group: lanes of one row group are adjacent
        g = T.meta_var(warp * per_warp + lane % per_warp)  # row group
        col = T.meta_var(j * bn + c * VEC)

        @T.inline
        def rows_body(R, U):
            acc = T.alloc_local((R, VEC), "float32")
            wv = T.alloc_local((2, U, VEC), "bfloat16")
            xv = T.alloc_local((R,), "float32")
            batches = T.meta_var(kslice // (U * G))

            @T.inline
            def load(buf, b):
                for u in T.unroll(U):
                    copy_16_bytes(wv.ptr_to([buf, u, 0]),
                                  W.ptr_to([k0 + (b * U + u) * G + g, col]))

            @T.inline
            def use(buf, b):
                for u in T.unroll(U):
                    for m in T.unroll(R):
                        xv[m] = T.Cast("float32", X[T.min(m, M - 1), k0 + (b * U + u) * G + g])
                    for m in T.unroll(R):
                        for e in T.unroll(VEC):
                            acc[m, e] = acc[m, e] + xv[m] * T.Cast("float32", wv[buf, u, e])

            for m in T.unroll(R):
                for e in T.unroll(VEC):
                    acc[m, e] = T.float32(0)
            load(0, 0)
            for b2 in T.serial(batches // 2):
                load(1, 2 * b2 + 1)
                use(0, 2 * b2)
                if 2 * b2 + 2 < batches:
                    load(0, 2 * b2 + 2)
                use(1, 2 * b2 + 1)
            for m in T.unroll(R):
                for e in T.unroll(VEC):
                    if per_warp > 1:
                        acc[m, e] = T.cuda.warp_sum(acc[m, e], per_warp)
                    if lane % per_warp == 0:
                        red[warp, m, c * VEC + e] = acc[m, e]
            T.cuda.cta_sync()
            for t in T.unroll(-(-R * bn // threads)):
                o = T.meta_var(t * threads + tx)
                if o < R * bn and o // bn < M:
                    xv[0] = red[0, o // bn, o % bn]  # xv[0] is free now: the warps' sum
                    for w in T.unroll(warps - 1):
                        xv[0] = xv[0] + red[w + 1, o // bn, o % bn]
                    Y[o // bn, j * bn + o % bn] = T.Cast(out_dtype, xv[0])

        if M <= 1:
            rows_body(1, unroll_for(1))
        elif M <= 2:
            rows_body(2, unroll_for(2))
        elif M <= 4:
            rows_body(4, unroll_for(4))
        elif M <= 8:
            rows_body(8, unroll_for(8))
        else:
            rows_body(MAX_ROWS, unroll_for(MAX_ROWS))

    if split_k == 1:
        @T.prim_func
        def gemv(j: T.int32, X: T.Buffer((M, K), "bfloat16"), W: T.Buffer((K, N), "bfloat16"),
                 Y: T.Buffer((M, N), out_dtype)):
            T.device_entry()
            tx = T.thread_id([threads])
            warp = T.warp_id([warps])
            lane = T.lane_id([WARP])
            red = T.alloc_shared((warps, MAX_ROWS, bn), "float32")
            gemv_body(j, 0, X, W, Y, tx, warp, lane, red)
    else:
        @T.prim_func
        def gemv(j: T.int32, s: T.int32, X: T.Buffer((M, K), "bfloat16"),
                 W: T.Buffer((K, N), "bfloat16"), P: T.Buffer((split_k, M, N), "float32")):
            T.device_entry()
            tx = T.thread_id([threads])
            warp = T.warp_id([warps])
            lane = T.lane_id([WARP])
            red = T.alloc_shared((warps, MAX_ROWS, bn), "float32")
            Ps = T.decl_buffer((M, N), "float32", data=P.data, elem_offset=s * M * N)
            gemv_body(j, s, X, W, Ps, tx, warp, lane, red)

    out = "bf16" if out_dtype == "bfloat16" else "f32"
    name = f"gemv_n{bn}_{out}_t{threads}" + (f"_k{split_k}" if split_k > 1 else "")
    # cost: the weight rows a task streams, in units of one double batch
    tile = device_func(gemv.with_attr("global_symbol", name),
                       cost=K // split_k // step, requires=[
                           (tirx.And(1 <= M, M <= MAX_ROWS), f"M of 1 to {MAX_ROWS}"),
                           (N % bn == 0, f"N a multiple of {bn}"),
                           (K % step == 0, f"K a multiple of {step}")])

    def product(j, X, W, ks):
        M_, K_ = X.shape
        if M_ > MAX_ROWS or M_ < 1:
            raise EtcError(f"{name}: M = {M_} rows, the tile serves 1..{MAX_ROWS}")
        if K_ % step or K_ // step < split_k:
            raise EtcError(f"{name}: K = {K_} must be a multiple of {step}, with at least "
                           f"{split_k} double batches of {step} rows")
        cols = slice(j * bn, (j + 1) * bn)
        return cols, X[:, ks].astype(np.float32) @ W[ks, cols].astype(np.float32)

    if split_k == 1:
        @tile.set_reference
        def _(j, X, W, Y):
            cols, value = product(j, X, W, slice(None))
            Y[:, cols] = value.astype(Y.dtype)
    else:
        @tile.set_reference
        def _(j, s, X, W, P):
            batches = X.shape[1] // step
            cols, value = product(j, X, W, slice(s * batches // split_k * step,
                                                 (s + 1) * batches // split_k * step))
            P[s, :, cols] = value

    return tile


@functools.cache
def make_gemv_sum_tile(split_k: int, cols: int = 1024, threads: int = 128) -> DeviceFunc:
    """The tile ``gemv_sum<split_k>_c<cols>_t<threads>``: task ``j`` adds the split-K partials
    ``P[:, :, j*cols:(j+1)*cols]`` in order of s and rounds them to bf16 ``Y`` (all M rows;
    N a multiple of cols). Each thread adds 4 adjacent columns (16-byte loads) of a row."""
    if split_k < 1 or cols % 4 or threads % WARP:
        raise EtcError(f"gemv sum tile: split_k >= 1, cols a multiple of 4 and whole warps, "
                       f"got split_k={split_k}, cols={cols}, threads={threads}")
    vecs = cols // 4
    M, N = tirx.Var("M", "int32"), tirx.Var("N", "int32")

    @T.prim_func
    def gemv_sum(j: T.int32, P: T.Buffer((split_k, M, N), "float32"),
                 Y: T.Buffer((M, N), "bfloat16")):
        T.device_entry()
        tx = T.thread_id([threads])
        total = T.alloc_local((4,), "float32")
        for t in T.serial((M * vecs + threads - 1) // threads):
            v = T.meta_var(t * threads + tx)
            if v < M * vecs:
                m = T.meta_var(v // vecs)
                n = T.meta_var(j * cols + v % vecs * 4)
                for e in T.vectorized(4):
                    total[e] = P[0, m, n + e]
                for s in T.unroll(split_k - 1):
                    for e in T.vectorized(4):
                        total[e] = total[e] + P[s + 1, m, n + e]
                for e in T.unroll(4):
                    Y[m, n + e] = T.Cast("bfloat16", total[e])

    name = f"gemv_sum{split_k}_c{cols}_t{threads}"
    tile = device_func(gemv_sum.with_attr("global_symbol", name),
                       requires=[(N % cols == 0, f"N a multiple of {cols}")])

    @tile.set_reference
    def _(j, P, Y):
        block = slice(j * cols, (j + 1) * cols)
        total = P[0, :, block].copy()
        for s in range(1, split_k):
            total += P[s, :, block]
        Y[:, block] = total.astype(Y.dtype)

    return tile


def error_bound(X: np.ndarray, W: np.ndarray, out_dtype: str = "bfloat16") -> np.ndarray:
    """The elementwise bound on ``|Y - X @ W|`` of the tile (see the module docstring)."""
    x, w = X.astype(np.float64), W.astype(np.float64)
    bound = X.shape[1] * 2.0 ** -24 * (np.abs(x) @ np.abs(w))
    if out_dtype == "bfloat16":
        bound += 2.0 ** -8 * np.abs(x @ w)
    return bound + 2.0 ** -133  # bf16 subnormals of the output


gemv_tile = make_gemv_tile()
