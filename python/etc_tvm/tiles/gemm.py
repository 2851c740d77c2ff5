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

A tile too small to give each warp its own m16 x n16 blocks (16 x 32 on four warps) gives
groups of warps the same warp tiles and splits each K slice's k16 steps over the groups
(``warp_grid``'s wk); the groups' partial sums meet in shared memory at the end, added in
group order. Tasks of few columns then keep every thread issuing loads.

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
# bytes of shared memory a task may use, on any engine: the arena of one persistent CTA an
# SM (227 KB less the kernel's own) holds it; with more CTAs an SM, their share bounds it
SMEM_LIMIT = 200 * 1024
# what ``deepest_stages`` gives an mma ring by default: deeper ones were never timed (a
# caller's ``stages`` may take up to SMEM_LIMIT)
DEFAULT_RING_BYTES = 100 * 1024
OUT_DTYPES = ("float32", "bfloat16")


def warp_grid(bm: int, bn: int, warps: int, bk: int = 16) -> tuple[int, int, int]:
    """(wm, wn, wk): the warps along M, N and K. Each warp tile must be a whole number of
    m16 x n16 blocks (ldmatrix.x4.trans loads B for two n8 mmas); among the fits, the
    squarest warp tile wins, as it loads the fewest fragments per mma. Only a tile too small
    for its warps (16 x 32 on four) splits the k16 steps of a K slice over wk warp groups,
    whose partial sums ``MmaTile.run`` adds at the end: then tasks of few columns keep all
    their threads loading."""
    for wk in (w for w in range(1, warps + 1) if warps % w == 0 and bk % (16 * w) == 0):
        rest = warps // wk
        fits = [(wm, rest // wm) for wm in range(1, rest + 1) if rest % wm == 0
                and bm % (16 * wm) == 0 and bn % (16 * (rest // wm)) == 0]
        if fits:
            return (*min(fits, key=lambda f: abs(bm // f[0] - bn // f[1])), wk)
    raise EtcError(f"gemm tile {bm}x{bn}x{bk}: {warps} warps cannot split it into m16 x n16 "
                   "warp tiles and k16 steps")


def shared_bytes(bm: int, bn: int, bk: int, stages: int, threads: int = 128) -> int:
    """Bytes of shared memory one task of the tile uses: the bf16 A and B rings, and the
    fp32 partial sums where its ``threads`` split K (``warp_grid``)."""
    wk = warp_grid(bm, bn, threads // 32, bk)[2]
    return stages * (bm * (bk + PAD) + bk * (bn + PAD)) * 2 + (wk > 1) * wk * bm * bn * 4


def deepest_stages(bm: int, bn: int, bk: int, most: int = 8, footprint=None,
                   limit: int = DEFAULT_RING_BYTES) -> int:
    """The deepest cp.async ring, up to ``most``, that fits ``limit`` bytes: a tile that
    streams weights through few rows is bound by the loads it keeps in flight, ``stages - 1``
    slices (at 2 stages the MoE grouped GEMMs waited a memory latency per K slice).
    ``footprint``: the tile's bytes for ``(bm, bn, bk, stages)``, this module's
    ``shared_bytes`` by default (``wgmma_gemm.shared_bytes`` for a WgmmaTile)."""
    footprint = footprint or shared_bytes
    fits = [s for s in range(2, most + 1) if footprint(bm, bn, bk, s) <= limit]
    if not fits:
        raise EtcError(f"gemm tile {bm}x{bn}x{bk}: not even 2 stages fit {limit} bytes")
    return fits[-1]


def row_stored(rows, row):
    """Whether a store writes tile row ``row``: ``row < rows``, or True (a Python bool, so
    that the store is unconditional code) where ``rows`` is None."""
    return True if rows is None else row < rows


@T.inline
def store_fragments(tile, C, row0, col0, rows=None):
    # C[row0 + tile row, col0 + tile col] = the accumulators of ``tile`` (an MmaTile or a
    # WgmmaTile: the same fragment interface), cast to C's dtype: pairs of adjacent columns;
    # with ``rows``, only the tile rows below it.
    for m in T.unroll(tile.mi):
        for n in T.unroll(tile.ni):
            for h in T.unroll(2):
                if row_stored(rows, tile.row(m, h)):
                    for v in T.vectorized(2):
                        C[row0 + tile.row(m, h), col0 + tile.col(n, v)] = \
                            T.Cast(C.dtype, tile.frag(m, n, h * 2 + v))


@T.inline
def copy_a_chunk(dst, src, valid, row):
    # One 16-byte cp.async of A row ``row``. With ``valid`` (a predicate of the row), a row
    # that is not reads nothing and lands as zeros: a gathered tile's padding rows, which at
    # few tokens are most of its rows and would otherwise all read the same token's row.
    if valid is None:
        T.ptx.cp.async_.cg.shared.global_(dst, src, 16)
    else:
        T.ptx.cp.async_.cg.shared.global_(dst, src, 16,
                                          T.Select(valid(row), T.uint32(16), T.uint32(0)))


@T.inline
def gather_rows(rows, a_rows, chunks: int, cols: int, threads: int, tx):
    # rows[r] = a_rows(tile row of this thread's chunk r): the same in every stage, so read
    # once a task. Without it the megakernel re-read the index every K slice (its loads of
    # a workspace view that may alias outputs cannot be hoisted past the loop's barriers).
    for r in T.unroll(-(-chunks // threads)):
        if chunks % threads == 0 or r * threads + tx < chunks:
            rows[r] = a_rows((r * threads + tx) // cols)


def gathered_rows(a_rows, chunks: int, cols: int, threads: int, tx):
    """Inside a tile's ``run``: a thread's A rows of its chunks (``gather_rows``) in local
    memory, or None without ``a_rows``."""
    if a_rows is None:
        return None
    rows = T.alloc_local((-(-chunks // threads),), "int32")
    gather_rows(rows, a_rows, chunks, cols, threads, tx)
    return rows


def chunk_source(a_src, a_valid, rows, r, row, k):
    """(address, validity) of A chunk ``r`` (tile row ``row``, column ``k``): ``a_src`` of the
    tile row and ``a_valid``; with gathered ``rows`` (``gather_rows``), ``a_src`` of the A row
    ``rows[r]`` and its sign (a negative row reads nothing)."""
    if rows is None:
        return a_src(row, k), a_valid
    return a_src(T.max(rows[r], 0), k), lambda _: rows[r] >= 0


@T.meta_class
class MmaTile:
    """One ``bm x bn`` fp32 accumulator tile on ``mma.sync.m16n8k16``, fed through a
    ``stages``-deep cp.async ring; the building block of every GEMM-shaped tile.

    The caller says where operand elements live (``a_src(r, k)``: the address of row r of the
    tile, column k of A; ``b_src(k, c)``: row k, tile column c of B), so gathered rows
    (grouped GEMMs) and per-expert weights reuse the same main loop; with ``a_rows`` (tile row
    -> A row, negative for none), ``run`` looks the rows up once and ``a_src`` takes the A
    row. After ``run`` thread ``lane`` of warp ``warp`` holds ``frag(m, n, 2h + v)`` = tile
    element ``(row(m, h), col(n, v))``; ``store`` writes it out, other epilogues read ``frag``.
    The geometry is checked by ``check_geometry`` before a tile is built.
    """

    def __init__(self, bm, bn, bk, threads, stages, tx, warp, lane):
        self.bm, self.bn, self.bk, self.threads, self.stages = bm, bn, bk, threads, stages
        self.wm, self.wn, self.wk = warp_grid(bm, bn, threads // 32, bk)
        self.tm, self.tn = bm // self.wm, bn // self.wn  # the warp tile
        self.mi, self.ni = self.tm // 16, self.tn // 8  # m16 and n8 blocks per warp tile
        self.tx, self.lane = tx, lane
        # warp = (kw, tile warp): tile warp picks the warp tile, kw its k16 steps of a slice
        self.warp = warp if self.wk == 1 else warp % (self.wm * self.wn)
        self.kw = 0 if self.wk == 1 else warp // (self.wm * self.wn)
        self.As = T.alloc_shared((stages, bm, bk + PAD), "bfloat16")
        self.Bs = T.alloc_shared((stages, bk, bn + PAD), "bfloat16")
        if self.wk > 1:
            self.partial = T.alloc_shared(
                (self.wk, self.wm * self.wn * 32, self.mi * self.ni * 4), "float32")
        self.acc = T.alloc_local((self.mi, self.ni, 4), "float32")
        self.a_frag = T.alloc_local((self.mi, 4), "uint32")
        self.b_frag = T.alloc_local((self.ni, 2), "uint32")

    def row(self, m, h):
        """The tile row of accumulator block m, half h (rows g and g + 8, g = lane // 4)."""
        return self.warp // self.wn * self.tm + m * 16 + h * 8 + self.lane // 4

    def col(self, n, v):
        """The tile column of accumulator block n, element v (columns 2t, 2t + 1, t = lane % 4)."""
        return self.warp % self.wn * self.tn + n * 8 + self.lane % 4 * 2 + v

    def frag(self, m, n, e):
        return self.acc[m, n, e]

    @T.inline
    def load_stage(self, a_src, b_src, k_step, a_valid=None, rows=None):
        # Issue (never wait for) the copies of K slice k_step into ring slot k_step % stages.
        self.load_a(a_src, k_step, a_valid, rows)
        self.load_b(b_src, k_step)

    @T.inline
    def load_a(self, a_src, k_step, a_valid=None, rows=None):
        s = T.meta_var(k_step % self.stages)
        a_cols = T.meta_var(self.bk // CHUNK)
        a_chunks = T.meta_var(self.bm * a_cols)
        # Where a stage has fewer chunks than threads (a 16 x 32 router task on 256 threads),
        # the threads past them issue none.
        for r in T.unroll(-(-a_chunks // self.threads)):
            c = T.meta_var(r * self.threads + self.tx)
            if a_chunks % self.threads == 0 or c < a_chunks:
                src, valid = T.meta_var(chunk_source(a_src, a_valid, rows, r, c // a_cols,
                                                     k_step * self.bk + c % a_cols * CHUNK))
                copy_a_chunk(self.As.ptr_to([s, c // a_cols, c % a_cols * CHUNK]), src, valid,
                             c // a_cols)

    @T.inline
    def load_b(self, b_src, k_step):
        s = T.meta_var(k_step % self.stages)
        b_cols = T.meta_var(self.bn // CHUNK)
        b_chunks = T.meta_var(self.bk * b_cols)
        for r in T.unroll(-(-b_chunks // self.threads)):
            c = T.meta_var(r * self.threads + self.tx)
            if b_chunks % self.threads == 0 or c < b_chunks:
                T.ptx.cp.async_.cg.shared.global_(
                    self.Bs.ptr_to([s, c // b_cols, c % b_cols * CHUNK]),
                    b_src(k_step * self.bk + c // b_cols, c % b_cols * CHUNK), 16)

    @T.inline
    def preload_b(self, b_src, num_k):
        # B of the slices run's prologue loads (0 .. stages-2), as one commit group ahead of
        # its groups: from a task's prelude (await_inputs), weights that no producer writes
        # stream while the task waits; run(..., b_preloaded=True) then loads their A alone
        for p in T.unroll(self.stages - 1):
            if p < num_k:
                self.load_b(b_src, p)
        T.ptx.cp.async_.commit_group()

    @T.inline
    def run(self, a_src, b_src, num_k, a_valid=None, a_rows=None, b_preloaded=False):
        # acc = A[tile rows, 0:num_k*bk] @ B[0:num_k*bk, tile cols]; a_valid: copy_a_chunk's;
        # a_rows: the class docstring's; b_preloaded: after preload_b
        for m in T.unroll(self.mi):
            for n in T.unroll(self.ni):
                for e in T.unroll(4):
                    self.acc[m, n, e] = T.float32(0)
        rows = T.meta_var(gathered_rows(a_rows, self.bm * self.bk // CHUNK, self.bk // CHUNK,
                                        self.threads, self.tx))
        # Prologue: slices 0 .. stages-2 in flight, one commit group each.
        for p in T.unroll(self.stages - 1):
            if p < num_k:
                if b_preloaded:
                    self.load_a(a_src, p, a_valid, rows)
                else:
                    self.load_stage(a_src, b_src, p, a_valid, rows)
            T.ptx.cp.async_.commit_group()
        for ko in T.serial(num_k):
            # Refill the slot freed at the end of the previous step; an empty group past the end
            # keeps "all but the newest stages-1 groups" meaning "slice ko has landed".
            if ko + self.stages - 1 < num_k:
                self.load_stage(a_src, b_src, ko + self.stages - 1, a_valid, rows)
            T.ptx.cp.async_.commit_group()
            T.ptx.cp.async_.wait_group(self.stages - 1)
            T.cuda.cta_sync()
            s = T.meta_var(ko % self.stages)
            for kq in T.unroll(self.bk // 16 // self.wk):
                kk = T.meta_var(kq * self.wk + self.kw if self.wk > 1 else kq)
                # Lane l addresses row l % 16, column block l // 16 of a 16x16 block: the
                # x4 load's four 8x8 matrices are then exactly the mma fragment registers.
                for m in T.unroll(self.mi):
                    T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                        self.a_frag[m, 0], self.a_frag[m, 1], self.a_frag[m, 2],
                        self.a_frag[m, 3],
                        self.As.ptr_to([s, self.warp // self.wn * self.tm + m * 16
                                        + self.lane % 16, kk * 16 + self.lane // 16 * 8]))
                for n2 in T.unroll(self.ni // 2):
                    T.ptx.ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16(
                        self.b_frag[2 * n2, 0], self.b_frag[2 * n2, 1],
                        self.b_frag[2 * n2 + 1, 0], self.b_frag[2 * n2 + 1, 1],
                        self.Bs.ptr_to([s, kk * 16 + self.lane % 16,
                                        self.warp % self.wn * self.tn + n2 * 16
                                        + self.lane // 16 * 8]))
                for m in T.unroll(self.mi):
                    for n in T.unroll(self.ni):
                        T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                            self.acc[m, n, 0], self.acc[m, n, 1], self.acc[m, n, 2],
                            self.acc[m, n, 3],
                            self.a_frag[m, 0], self.a_frag[m, 1], self.a_frag[m, 2],
                            self.a_frag[m, 3], self.b_frag[n, 0], self.b_frag[n, 1],
                            self.acc[m, n, 0], self.acc[m, n, 1], self.acc[m, n, 2],
                            self.acc[m, n, 3])
            T.cuda.cta_sync()  # every warp is done with slot ko before it is refilled
        if self.wk > 1:
            self.add_k_partials()

    @T.inline
    def add_k_partials(self):
        # Every warp of a warp tile ends with the sum of its wk groups' partials, added in kw
        # order: the same bits in each, so any of them may run the epilogue (all do).
        me = T.meta_var(self.warp * 32 + self.lane)
        for m in T.unroll(self.mi):
            for n in T.unroll(self.ni):
                for e in T.unroll(4):
                    self.partial[self.kw, me, (m * self.ni + n) * 4 + e] = self.acc[m, n, e]
        T.cuda.cta_sync()
        for m in T.unroll(self.mi):
            for n in T.unroll(self.ni):
                for e in T.unroll(4):
                    self.acc[m, n, e] = self.partial[0, me, (m * self.ni + n) * 4 + e]
                    for j in T.unroll(1, self.wk):
                        self.acc[m, n, e] = self.acc[m, n, e] + self.partial[
                            j, me, (m * self.ni + n) * 4 + e]

    @T.inline
    def store(self, C, row0, col0, rows=None):
        store_fragments(self, C, row0, col0, rows)


def check_geometry(bm: int, bn: int, bk: int, threads: int, stages: int) -> None:
    """Raise unless an ``MmaTile`` of this shape can be built (see the module docstring)."""
    if threads % 32 or bk % 16 or stages < 1:
        raise EtcError(f"gemm tile: threads must be whole warps, bk a multiple of 16 and "
                       f"stages >= 1, got threads={threads}, bk={bk}, stages={stages}")
    warp_grid(bm, bn, threads // 32, bk)
    smem = shared_bytes(bm, bn, bk, stages, threads)
    if smem > SMEM_LIMIT:
        raise EtcError(f"gemm tile {bm}x{bn}x{bk} x{stages} stages needs {smem} bytes of shared "
                       f"memory, more than {SMEM_LIMIT}")


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
    check_geometry(bm, bn, bk, threads, stages)
    M, N, K = (tirx.Var(d, "int32") for d in "MNK")

    @T.inline
    def tile_body(i, j, k0, num_k, A, B, C, tx, warp, lane):
        # C[tile (i, j)] = A[rows i, k0:k0 + num_k*bk] @ B[k0:k0 + num_k*bk, cols j]
        mma = MmaTile(bm, bn, bk, threads, stages, tx, warp, lane)
        mma.run(lambda r, k: A.ptr_to([i * bm + r, k0 + k]),
                lambda k, c: B.ptr_to([k0 + k, j * bn + c]), num_k)
        mma.store(C, i * bm, j * bn)

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
    tile = device_func(gemm.with_attr("global_symbol", name), cost=K // split_k // bk,
                       requires=block_requires(M, N, K, bm, bn, bk, split_k))
    set_block_reference(tile, bm, bn, split_k)
    return tile


def block_requires(M, N, K, bm: int, bn: int, bk: int, split_k: int,
                   ragged_rows: bool = False) -> list:
    """``device_func``'s ``requires`` of a GEMM tile of this module's task convention: M
    (unless ``ragged_rows``), N and K whole blocks, which its grid and K loop assume."""
    return ([] if ragged_rows else [(M % bm == 0, f"M a multiple of {bm}")]) \
        + column_requires(N, K, bn, bk, split_k)


def column_requires(N, K, bn: int, bk: int, split_k: int = 1) -> list:
    """The ``requires`` of a GEMM tile's columns and K loop: whole column blocks, and whole
    K steps in each of ``split_k`` slices."""
    step = split_k * bk
    return [(N % bn == 0, f"N a multiple of {bn}"),
            (K % step == 0, f"K a multiple of {step}" + (" (split_k x bk)" if split_k > 1
                                                          else ""))]


def set_block_reference(tile: DeviceFunc, bm: int, bn: int, split_k: int) -> None:
    """Register the NumPy reference of a GEMM tile of this module's task convention: task
    (i, j) writes C's bm x bn block (i, j), task (i, j, s) with ``split_k`` > 1 the partial
    product over the s-th K slice into P[s]. A row block past M stops at it."""
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


def error_bound(A: np.ndarray, B: np.ndarray, out_dtype: str = "float32") -> np.ndarray:
    """The elementwise bound on ``|C - A @ B|`` of the tile (see the module docstring)."""
    a, b = np.abs(A.astype(np.float64)), np.abs(B.astype(np.float64))
    bound = A.shape[1] * 2.0 ** -22 * (a @ b)
    if out_dtype == "bfloat16":
        bound += 2.0 ** -8 * np.abs(A.astype(np.float64) @ B.astype(np.float64))
    return bound


gemm_tile = make_gemm_tile()
gemm_bf16_tile = make_gemm_tile(out_dtype="bfloat16")
