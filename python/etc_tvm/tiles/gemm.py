"""GEMM tiles on Hopper tensor cores (``mma.sync.m16n8k16``, bf16 in, fp32 accumulate).

Task ``(i, j)`` computes one ``bm x bn`` tile of ``C = A @ B``::

    C[i*bm:(i+1)*bm, j*bn:(j+1)*bn] = A[i*bm:(i+1)*bm, :] @ B[:, j*bn:(j+1)*bn]

with ``A`` (M, K) bf16 row-major, ``B`` (K, N) bf16 row-major (weights, not transposed), ``C``
(M, N) fp32 or bf16. M, N and K are symbolic; they must be multiples of bm, bn and bk.

Inside a task (``threads`` threads, one warp tile of ``(bm/wm) x (bn/wn)`` per warp)::

    for each bk-slice of K, ``stages``-deep ring in shared memory:
        cp.async.cg 16-byte chunks:  A[rows, k:k+bk] -> As[s]   B[k:k+bk, cols] -> Bs[s]
        ldmatrix.x4        As[s] -> A fragments (m16 x k16, row-major as mma wants)
        ldmatrix.x4.trans  Bs[s] -> B fragments (k16 x n8, two per load: B is K-major in
                                    memory, mma.row.col wants it column-major, .trans swaps)
        mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32 into fp32 registers
    registers -> C (cast to bf16 for the bf16 variant)

Shared rows are padded by 8 elements (16 bytes): cp.async destinations stay 16-byte aligned and
the eight row addresses of one ldmatrix phase fall into distinct bank groups.

Numeric contract: the bf16 inputs are exact in fp32 and so are their products; only the fp32
accumulation rounds, so against a float64 product of the same bf16 inputs, elementwise
``|C - A @ B| <= K * 2**-22 * (|A| @ |B|)``: twice the unit roundoff of truncated fp32 sums, as
tensor cores may truncate rather than round. The bf16 variant adds its final rounding,
``2**-8 * |A @ B|``. ``error_bound`` computes this.
"""
from __future__ import annotations

import functools

import numpy as np
from tvm import tirx
from tvm.script import tirx as T

from ..device_func import DeviceFunc, device_func
from ..errors import EtcError

PAD = 8  # bf16 elements of padding per shared row (16 bytes)
CHUNK = 8  # bf16 elements per cp.async (16 bytes)
SMEM_LIMIT = 100 * 1024  # bytes per task; the megakernel's arena holds the largest tile
OUT_DTYPES = ("float32", "bfloat16")


def warp_grid(bm: int, bn: int, warps: int) -> tuple[int, int]:
    """(wm, wn): the warps along M and N. Each warp tile must be a whole number of m16 x n16
    blocks (ldmatrix.x4.trans loads B for two n8 mmas); among the fits, the squarest warp tile
    wins, as it loads the fewest fragments per mma."""
    fits = [(wm, warps // wm) for wm in range(1, warps + 1) if warps % wm == 0
            and bm % (16 * wm) == 0 and bn % (16 * (warps // wm)) == 0]
    if not fits:
        raise EtcError(f"gemm tile {bm}x{bn}: {warps} warps cannot split it into m16 x n16 "
                       "warp tiles")
    return min(fits, key=lambda f: abs(bm // f[0] - bn // f[1]))


def shared_bytes(bm: int, bn: int, bk: int, stages: int) -> int:
    """Bytes of shared memory one task of the tile uses (the bf16 A and B rings)."""
    return stages * (bm * (bk + PAD) + bk * (bn + PAD)) * 2


@functools.cache
def make_gemm_tile(bm: int = 64, bn: int = 64, bk: int = 32, threads: int = 128,
                   out_dtype: str = "float32", stages: int = 2, split_k: int = 1) -> DeviceFunc:
    """The GEMM tile ``gemm_<bm>x<bn>x<bk>_<out>_s<stages>_t<threads>``; one DeviceFunc per
    configuration (cached, so graphs that name the same configuration share one device function).

    ``stages`` is the depth of the cp.async ring (2: double buffering). With ``split_k`` > 1 the
    task is ``(i, j, s)`` and writes the partial product over the s-th of ``split_k`` equal
    slices of K into ``P[s]`` of a (split_k, M, N) output (K a multiple of split_k * bk): more,
    smaller tasks for few rows, and a consumer of K slice s can start before the others.

    Bigger tiles reuse each loaded element more: as one grid launch on a 4096^3 product the
    H200 ran 64x64x32 at 170 TFLOP/s and 128x128x64 (70 KB of shared memory) at 350 TFLOP/s.
    """
    if out_dtype not in OUT_DTYPES:
        raise EtcError(f"gemm tile: out_dtype must be one of {OUT_DTYPES}, got {out_dtype!r}")
    if split_k < 1:
        raise EtcError(f"gemm tile: split_k must be positive, got {split_k}")
    if threads % 32 or bk % 16 or stages < 1:
        raise EtcError(f"gemm tile: threads must be whole warps, bk a multiple of 16 and "
                       f"stages >= 1, got threads={threads}, bk={bk}, stages={stages}")
    wm, wn = warp_grid(bm, bn, threads // 32)
    tm, tn = bm // wm, bn // wn  # the warp tile
    mi, ni = tm // 16, tn // 8  # m16 blocks and n8 blocks per warp tile
    a_loads, b_loads = bm * bk // CHUNK, bk * bn // CHUNK
    if a_loads % threads or b_loads % threads:
        raise EtcError(f"gemm tile {bm}x{bn}x{bk}: its {a_loads} + {b_loads} 16-byte chunks per "
                       f"stage do not divide among {threads} threads")
    smem = shared_bytes(bm, bn, bk, stages)
    if smem > SMEM_LIMIT:
        raise EtcError(f"gemm tile {bm}x{bn}x{bk} x{stages} stages needs {smem} bytes of shared "
                       f"memory, more than {SMEM_LIMIT}")
    a_cols, b_cols = bk // CHUNK, bn // CHUNK  # chunks per shared row
    M, N, K = (tirx.Var(d, "int32") for d in "MNK")

    @T.inline
    def tile_body(i, j, k0, num_k, A, B, C, tx, warp, lane):
        # C[tile (i, j)] = A[rows i, k0:k0 + num_k*bk] @ B[k0:k0 + num_k*bk, cols j]
        As = T.alloc_shared((stages, bm, bk + PAD), "bfloat16")
        Bs = T.alloc_shared((stages, bk, bn + PAD), "bfloat16")
        acc = T.alloc_local((mi, ni, 4), "float32")
        a_frag = T.alloc_local((mi, 4), "uint32")
        b_frag = T.alloc_local((ni, 2), "uint32")
        row0 = T.meta_var(i * bm + warp // wn * tm)  # the warp tile's first row and column
        col0 = T.meta_var(j * bn + warp % wn * tn)

        @T.inline
        def load_stage(k_step):
            # Issue (never wait for) the copies of K slice k_step into ring slot k_step % stages.
            s = T.meta_var(k_step % stages)
            for r in T.unroll(a_loads // threads):
                c = T.meta_var(r * threads + tx)
                T.ptx.cp.async_.cg.shared.global_(
                    As.ptr_to([s, c // a_cols, c % a_cols * CHUNK]),
                    A.ptr_to([i * bm + c // a_cols, k0 + k_step * bk + c % a_cols * CHUNK]), 16)
            for r in T.unroll(b_loads // threads):
                c = T.meta_var(r * threads + tx)
                T.ptx.cp.async_.cg.shared.global_(
                    Bs.ptr_to([s, c // b_cols, c % b_cols * CHUNK]),
                    B.ptr_to([k0 + k_step * bk + c // b_cols, j * bn + c % b_cols * CHUNK]), 16)

        for m in T.unroll(mi):
            for n in T.unroll(ni):
                for e in T.unroll(4):
                    acc[m, n, e] = T.float32(0)
        # Prologue: slices 0 .. stages-2 in flight, one commit group each.
        for p in T.unroll(stages - 1):
            if p < num_k:
                load_stage(p)
            T.ptx.cp.async_.commit_group()
        for ko in T.serial(num_k):
            # Refill the slot freed at the end of the previous step; an empty group past the end
            # keeps "all but the newest stages-1 groups" meaning "slice ko has landed".
            if ko + stages - 1 < num_k:
                load_stage(ko + stages - 1)
            T.ptx.cp.async_.commit_group()
            T.ptx.cp.async_.wait_group(stages - 1)
            T.cuda.cta_sync()
            s = T.meta_var(ko % stages)
            for kk in T.unroll(bk // 16):
                # Lane l addresses row l % 16, column block l // 16 of a 16x16 block: the
                # x4 load's four 8x8 matrices are then exactly the mma fragment registers.
                for m in T.unroll(mi):
                    T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                        a_frag[m, 0], a_frag[m, 1], a_frag[m, 2], a_frag[m, 3],
                        As.ptr_to([s, warp // wn * tm + m * 16 + lane % 16,
                                   kk * 16 + lane // 16 * 8]))
                for n2 in T.unroll(ni // 2):
                    T.ptx.ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16(
                        b_frag[2 * n2, 0], b_frag[2 * n2, 1],
                        b_frag[2 * n2 + 1, 0], b_frag[2 * n2 + 1, 1],
                        Bs.ptr_to([s, kk * 16 + lane % 16,
                                   warp % wn * tn + n2 * 16 + lane // 16 * 8]))
                for m in T.unroll(mi):
                    for n in T.unroll(ni):
                        T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                            acc[m, n, 0], acc[m, n, 1], acc[m, n, 2], acc[m, n, 3],
                            a_frag[m, 0], a_frag[m, 1], a_frag[m, 2], a_frag[m, 3],
                            b_frag[n, 0], b_frag[n, 1],
                            acc[m, n, 0], acc[m, n, 1], acc[m, n, 2], acc[m, n, 3])
            T.cuda.cta_sync()  # every warp is done with slot ko before it is refilled
        # Accumulator element 2h + v of block (m, n) is row g + 8h, column 2t + v (g = lane // 4,
        # t = lane % 4): each thread stores pairs of adjacent columns.
        for m in T.unroll(mi):
            for n in T.unroll(ni):
                for h in T.unroll(2):
                    for v in T.vectorized(2):
                        C[row0 + m * 16 + h * 8 + lane // 4, col0 + n * 8 + lane % 4 * 2 + v] = \
                            T.Cast(out_dtype, acc[m, n, h * 2 + v])


    if split_k == 1:
        @T.prim_func
        def gemm(i: T.int32, j: T.int32, A: T.Buffer((M, K), "bfloat16"),
                 B: T.Buffer((K, N), "bfloat16"), C: T.Buffer((M, N), out_dtype)):
            T.device_entry()
            tx = T.thread_id([threads])
            warp = T.warp_id([threads // 32])
            lane = T.lane_id([32])
            tile_body(i, j, 0, K // bk, A, B, C, tx, warp, lane)
    else:
        @T.prim_func
        def gemm(i: T.int32, j: T.int32, s: T.int32, A: T.Buffer((M, K), "bfloat16"),
                 B: T.Buffer((K, N), "bfloat16"), P: T.Buffer((split_k, M, N), out_dtype)):
            T.device_entry()
            tx = T.thread_id([threads])
            warp = T.warp_id([threads // 32])
            lane = T.lane_id([32])
            Ps = T.decl_buffer((M, N), out_dtype, data=P.data, elem_offset=s * M * N)
            tile_body(i, j, s * (K // split_k), K // split_k // bk, A, B, Ps, tx, warp, lane)

    out = "bf16" if out_dtype == "bfloat16" else "f32"
    name = f"gemm_{bm}x{bn}x{bk}_{out}_s{stages}_t{threads}" + (
        f"_k{split_k}" if split_k > 1 else "")
    # one K step costs about one elementwise pass over the tile
    tile = device_func(gemm.with_attr("global_symbol", name), cost=K // split_k // bk)

    def product(i, j, A, B, ks):
        rows, cols = slice(i * bm, (i + 1) * bm), slice(j * bn, (j + 1) * bn)
        return rows, cols, A[rows, ks].astype(np.float32) @ B[ks, cols].astype(np.float32)

    if split_k == 1:
        @tile.set_reference
        def _(i, j, A, B, C):
            rows, cols, value = product(i, j, A, B, slice(None))
            C[rows, cols] = value.astype(C.dtype)
    else:
        @tile.set_reference
        def _(i, j, s, A, B, P):
            width = A.shape[1] // split_k
            rows, cols, value = product(i, j, A, B, slice(s * width, (s + 1) * width))
            P[s, rows, cols] = value.astype(P.dtype)

    return tile


def error_bound(A: np.ndarray, B: np.ndarray, out_dtype: str = "float32") -> np.ndarray:
    """The elementwise bound on ``|C - A @ B|`` of the tile (see the module docstring)."""
    a, b = np.abs(A.astype(np.float64)), np.abs(B.astype(np.float64))
    bound = A.shape[1] * 2.0 ** -22 * (a @ b)
    if out_dtype == "bfloat16":
        bound += 2.0 ** -8 * np.abs(A.astype(np.float64) @ B.astype(np.float64))
    return bound


gemm_tile = make_gemm_tile()
gemm_bf16_tile = make_gemm_tile(out_dtype="bfloat16")
