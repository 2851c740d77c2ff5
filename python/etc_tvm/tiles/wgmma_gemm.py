"""A large-tile GEMM for sm_90a on warpgroup MMA (``wgmma``, bf16 in, fp32 accumulate).

Same task convention as ``gemm.make_gemm_tile``: task ``(i, j)`` computes::

    C[i*bm:(i+1)*bm, j*bn:(j+1)*bn] = A[i*bm:(i+1)*bm, :] @ B[:, j*bn:(j+1)*bn]

with ``A`` (M, K) bf16 row-major, ``B`` (K, N) bf16 row-major (weights, not transposed), ``C``
(M, N) fp32 or bf16; M, N, K symbolic multiples of bm, bn, bk (M any size for swapped
tiles). Where ``mma.sync`` makes every warp load its own fragments through ``ldmatrix``,
``wgmma`` reads both operands straight from shared memory through 64-bit matrix
descriptors, so a warpgroup issues one ``m64n<bn>k16`` instruction per 64 rows and 16 of K
and keeps its accumulators in registers.

Shared-memory layout (128-byte swizzle, the layout the descriptors name)::

    ring = [A stage 0 .. A stage S-1][B stage 0 .. B stage S-1], base aligned to 1024 bytes,
           the B stages from the next 1024-byte boundary (``b_ring_offset``)
    A stage: bk/64 panels of  bm rows x 64 bf16 (128 bytes a row)   K-major ("row-major A")
             (bk = 32: one panel of bm rows x 32 bf16, 64 bytes a row, the 64-byte swizzle)
    B stage: bn/64 panels of  bk rows x 64 bf16 (128 bytes a row)   N-major (B as stored)
    16-byte chunk c of panel row r lives at chunk c ^ (r % 8) of that row (64-byte rows:
    c ^ (r // 2 % 4), the XOR of address bits [4:6) with [7:9))

Eight 128-byte rows make one 1024-byte swizzle atom; the hardware applies the XOR on address
bits [4:7) ^ [7:10), so every atom must start 1024-byte aligned: the tile pads its allocation
by 1024 bytes and aligns at run time (the kernels' shared memory promises 64 bytes: see
``etc_tvm.tensor_map``).

Descriptor fields (PTX ISA "matrix descriptor"; offsets in 16-byte units):

- A, K-major, 128B swizzle: start = the m64 block's first row (+32 bytes per k16 step inside a
  128-byte row, +bm*128 per 64-column panel); stride byte offset (SBO) = 1024, the step between
  8-row groups; leading byte offset unused (1). ``imm-trans-a`` = 0.
- A, K-major, 64B swizzle (bk = 32: one 64-byte row a slice): as above with 64-byte rows,
  +32 bytes for the second k16 step; SBO = 512.
- B, MN-major, 128B swizzle: start = row 16*kk of the first N panel; LBO = bk*128, the step
  from one 64-column panel to the next along N; SBO = 1024, the step between 8-row groups of
  K. ``imm-trans-b`` = 1: bf16 is one of the types wgmma may read transposed (MN-major) from
  shared memory, so B needs no transpose in memory.

Swapped (``WgmmaTile(swapped=True)``: C^T = B^T A^T, for tiles whose rows are few and
uneven, a grouped GEMM's rows of one expert): the same ring and fields, the roles exchanged.
Each B panel is an m64 operand, MN-major (its descriptor from the panel on, ``imm-trans-a`` =
1); all bm rows of A are the N operand, K-major (``imm-trans-b`` = 0), bm any multiple of 8.

Pipeline with ``loads="cp.async"``, ``S`` = ``stages`` >= 3, every thread both loads and
computes (no warp roles)::

    prologue: cp.async slices 0 .. S-3 (one commit group each)
    for ko in 0 .. K/bk-1:
        cp.async.wait_group S-3          this thread's copies of slice ko landed
        fence.proxy.async.shared::cta    ...and are visible to the async proxy (wgmma reads)
        wgmma.wait_group 1               this warpgroup's wgmmas of slice ko-2 are done
        bar.sync                         so: slice ko is complete, slot (ko-2)%S is free
        wgmma x (bk/16) x (m64 blocks), commit    (async: overlaps the next iteration's wait)
        cp.async slice ko+S-2 -> slot (ko-2)%S, commit (empty past the end, so counts stay)
    wgmma.wait_group 0; bar.sync; registers -> C

One wgmma batch stays in flight across the barrier, so the tensor cores are not idle while the
CTA synchronises; slices are prefetched S-2 steps ahead.

With ``loads="tma"`` (``WgmmaTile.run_tma``) thread 0 fills a stage with one TMA load a
64-column panel (``cp.async.bulk.tensor``, the hardware applying the same swizzle) through
host-encoded tensor maps of A and B (``etc_tvm.tensor_map``), and the loop has no CTA barrier::

    prologue: mbarrier init (full: 1 arrival + the stage's bytes; empty: one per warpgroup);
              bar.sync; thread 0: fence.proxy.async, loads slices 0 .. S-1
    for ko in 0 .. K/bk-1:
        wgmma.wait_group 1                slice ko-2 retired (ko-1 may still run)
        one thread a warpgroup: arrive empty[(ko-2) % S]
        thread 0: wait empty[(ko-2) % S], load slice ko-2+S into that slot
        wait full[ko % S]                 slice ko landed
        wgmma x (bk/16) x (m64 blocks), commit
    wgmma.wait_group 0; bar.sync; mbarrier inval; registers -> C

Reuse across tasks (persistent megakernel: one CTA runs many tasks in sequence): the tile ends
with every wgmma retired (``wait_group 0``), every load landed (cp.async groups drained, the
trailing groups empty; every TMA stage waited on), the mbarriers invalidated and a CTA
barrier, so the next task, of this tile or another, may reuse the same shared bytes at once.

Numeric contract: as ``gemm``: the bf16 products are exact in fp32, only the fp32 accumulation
rounds, so ``gemm.error_bound`` (``K * 2**-22 * |A| @ |B|``, plus ``2**-8 * |A @ B|`` for bf16
output) bounds ``|C - A @ B|`` against a float64 product.
"""
from __future__ import annotations

import functools

from tvm import tirx
from tvm.script import tirx as T

from ..device_func import DeviceFunc, device_func
from ..errors import EtcError
from ..tensor_map import TensorMap
from .gemm import (OUT_DTYPES, SMEM_LIMIT, block_requires, chunk_source, copy_a_chunk,
                   error_bound, gathered_rows, row_stored, set_block_reference,
                   store_fragments)

ROW_BYTES = 128  # one 128B-swizzle row: 64 bf16
PANEL = ROW_BYTES // 2  # bf16 columns of one panel
ATOM_BYTES = 1024  # 8 swizzled rows: the alignment the swizzle pattern needs
CHUNK = 8  # bf16 elements per cp.async (16 bytes)
SWIZZLES = {64: 2, 128: 3}  # swizzle bytes -> the CUtensorMapSwizzle encode_matrix_descriptor takes
WARPGROUP = 128
BLOCK_ROWS = 64  # rows of one wgmma (m64)
MAX_ACC_REGS = 128  # fp32 accumulators per thread; more leaves too few registers to run
LOADS = ("cp.async", "tma")
STORES = ("fragments", "staged")  # WgmmaTile.store, WgmmaTile.store_staged
STAGE_PAD = 8  # bf16 a staged row is padded by: the fragments' 4-byte writes miss no bank twice
TMA_LOAD = T.ptx["cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"]

__all__ = ["STORES", "WgmmaTile", "b_ring_offset", "check_geometry", "error_bound",
           "make_wgmma_gemm_tile", "shared_bytes", "operand_maps", "task_cost"]


def b_ring_offset(bm: int, bk: int, stages: int) -> int:
    """Where the B stages start, bytes from the ring's aligned base: past the A stages, on a
    swizzle atom (A stages of 32-column slices and a swapped tile's rows, a multiple of 8,
    end on 512 bytes only)."""
    return -(-stages * bm * bk * 2 // ATOM_BYTES) * ATOM_BYTES


def shared_bytes(bm: int, bn: int, bk: int, stages: int) -> int:
    """Bytes of shared memory one task uses: the bf16 A and B rings plus the alignment slack."""
    return b_ring_offset(bm, bk, stages) + stages * bk * bn * 2 + ATOM_BYTES


def check_geometry(bm: int, bn: int, bk: int, stages: int, threads: int,
                   out_dtype: str = "float32", stores: str = "fragments",
                   swapped: bool = False) -> None:
    """Reject the shapes the layout, the instruction and the register file cannot take, and
    ``stores`` ("fragments": ``WgmmaTile.store``; "staged": ``store_staged``, of bf16 tiles:
    its padded rows, ``bm * (bn + 8)`` elements, always fit the ring, whose 3 or more stages
    of slices at least 32 deep hold ``96 * (bm + bn)``: the accumulator limit keeps
    ``bm * bn`` within 32768). ``swapped``: ``WgmmaTile``'s."""
    name = f"wgmma gemm tile {bm}x{bn}x{bk}" + (" (swapped)" if swapped else "")
    if stores not in STORES:
        raise EtcError(f"{name}: stores must be one of {STORES}, got {stores!r}")
    if stores == "staged" and (out_dtype != "bfloat16" or swapped):
        raise EtcError(f"{name}: staged stores write bf16 tiles of rows on the m64 side, not "
                       f"{out_dtype}{' swapped' if swapped else ''} ones")
    if out_dtype not in OUT_DTYPES:
        raise EtcError(f"{name}: out_dtype must be one of {OUT_DTYPES}, got {out_dtype!r}")
    if threads not in (WARPGROUP, 2 * WARPGROUP):
        raise EtcError(f"{name}: threads must be 128 or 256 (one or two warpgroups), "
                       f"got {threads}")
    groups = threads // WARPGROUP
    if swapped:
        if bm <= 0 or bm % 8 or bm > 256:
            raise EtcError(f"{name}: bm must be a multiple of 8 up to 256: the tile's rows are "
                           "the N of one wgmma")
        if bn <= 0 or bn % (PANEL * groups):
            raise EtcError(f"{name}: bn must be a multiple of {PANEL * groups}: each of the "
                           f"{groups} warpgroups takes whole 64-column panels, its m64 blocks")
    elif bm <= 0 or bm % (64 * groups):
        raise EtcError(f"{name}: bm must be a multiple of 64 per warpgroup ({64 * groups} for "
                       f"{threads} threads): wgmma computes m64 blocks")
    elif bn <= 0 or bn % PANEL or bn > 256:
        raise EtcError(f"{name}: bn must be 64, 128, 192 or 256: one wgmma spans the tile's N "
                       "(at most 256) in 64-column swizzle panels")
    if bk <= 0 or bk % PANEL and bk != PANEL // 2:
        raise EtcError(f"{name}: bk must be 32 (A in 64-byte swizzled rows) or a multiple of "
                       f"64 (128-byte rows)")
    if stages < 3:
        raise EtcError(f"{name}: stages must be >= 3: one wgmma batch stays in flight while "
                       f"the slot two steps back is refilled, got {stages}")
    acc = bm * bn // (2 * 64 * groups)  # either way: bm * bn / threads
    if acc > MAX_ACC_REGS:
        raise EtcError(f"{name}: {acc} fp32 accumulators per thread with {threads} threads, "
                       f"more than {MAX_ACC_REGS}: use 256 threads or a smaller tile")
    smem = shared_bytes(bm, bn, bk, stages)
    if smem > SMEM_LIMIT:
        raise EtcError(f"{name} x{stages} stages needs {smem} bytes of shared memory, more "
                       f"than {SMEM_LIMIT}")


@T.meta_class
class SwizzledRing:
    """The ``stages``-deep ring of A and B tiles in swizzled shared memory: B's panels in
    128-byte rows; A's in 128-byte rows too, or, for slices of 32 columns (bk = 32), in
    64-byte rows with the 64-byte swizzle (16-byte chunk c of row r at c ^ (r // 2) % 4,
    8-row groups of 512 bytes), so that a shallower slice buys more stages in flight.

    One ``shared.dyn`` allocation (so the unfused kernel sizes it at launch and the megakernel
    maps it into its arena), aligned to 1024 bytes at run time; offsets below are bytes from
    that aligned base.
    """

    def __init__(self, bm: int, bn: int, bk: int, stages: int, threads: int):
        self.bm, self.bn, self.bk, self.stages, self.threads = bm, bn, bk, stages, threads
        self.a_row = min(bk, PANEL) * 2  # bytes of one swizzled A row: 64 or 128
        self.a_stage = bm * bk * 2  # bytes of one A stage
        self.b_stage = bk * bn * 2
        self.b_ring = b_ring_offset(bm, bk, stages)
        self.smem = T.alloc_buffer((shared_bytes(bm, bn, bk, stages) // 2,), "bfloat16",
                                   scope="shared.dyn")
        self.base = T.local_scalar("int32")  # bf16 elements from the allocation to the base

    @T.inline
    def init(self):
        addr = T.meta_var(T.cuda.cvta_generic_to_shared(self.smem.ptr_to([0])))
        self.base = T.Cast("int32", (T.uint32(ATOM_BYTES) - (addr & T.uint32(ATOM_BYTES - 1)))
                           & T.uint32(ATOM_BYTES - 1)) // 2

    def at(self, byte):
        """A pointer ``byte`` bytes past the aligned base."""
        return self.smem.ptr_to([self.base + byte // 2])

    @T.inline
    def load_stage(self, slot, a_src, b_src, k0, tx, a_valid=None, rows=None):
        # Issue (never wait for) the 16-byte copies of the tile's A rows, columns k0:+bk, and
        # B rows k0:+bk into ring slot ``slot``; chunk c of a 128-byte panel row r goes to
        # c ^ r%8, of a 64-byte one to c ^ (r//2)%4. rows: gemm.chunk_source's.
        self.load_a(slot, a_src, k0, tx, a_valid, rows)
        self.load_b(slot, b_src, k0, tx)

    @T.inline
    def load_a(self, slot, a_src, k0, tx, a_valid=None, rows=None):
        # (a swapped tile's rows may leave the last chunks to some of the threads)
        a_cols, chunks = T.meta_var((self.bk // CHUNK, self.bm * self.bk // CHUNK))
        row_bytes, per_row = T.meta_var((self.a_row, self.a_row // 16))
        for r in T.unroll(-(-chunks // self.threads)):
            c = T.meta_var(r * self.threads + tx)
            row, cc = T.meta_var((c // a_cols, c % a_cols))
            if chunks % self.threads == 0 or c < chunks:
                src, valid = T.meta_var(chunk_source(a_src, a_valid, rows, r, row,
                                                     k0 + cc * CHUNK))
                copy_a_chunk(self.at(slot * self.a_stage + cc // per_row * (self.bm * row_bytes)
                                     + row * row_bytes
                                     + (cc % per_row ^ row * row_bytes // ROW_BYTES % per_row)
                                     * 16), src, valid, row)

    @T.inline
    def load_b(self, slot, b_src, k0, tx):
        b_cols = T.meta_var(self.bn // CHUNK)
        for r in T.unroll(self.bk * b_cols // self.threads):
            c = T.meta_var(r * self.threads + tx)
            row, cc = T.meta_var((c // b_cols, c % b_cols))
            T.ptx.cp.async_.cg.shared.global_(
                self.at(self.b_ring + slot * self.b_stage + cc // 8 * (self.bk * ROW_BYTES)
                        + row * ROW_BYTES + (cc % 8 ^ row % 8) * 16),
                b_src(k0 + row, cc * CHUNK), 16)

    @T.inline
    def load_stage_tma(self, slot, full, a_map, a_row, b_map, b_row, b_col, k0):
        # One thread: arm the slot's barrier with the stage's bytes, then one TMA load a
        # 64-column panel (the hardware applies the same 128-byte swizzle as load_stage);
        # B's K rows start at map row ``b_row``.
        T.ptx.mbarrier.arrive.expect_tx.shared.b64(
            full.ptr_to([slot]), T.uint32(self.a_stage + self.b_stage))
        for p in T.unroll(self.bk // PANEL):
            T.evaluate(TMA_LOAD(
                T.cuda.cvta_generic_to_shared(self.at(slot * self.a_stage
                                                      + p * (self.bm * ROW_BYTES))),
                T.address_of(a_map), k0 + p * PANEL, a_row,
                T.cuda.cvta_generic_to_shared(full.ptr_to([slot]))))
        for q in T.unroll(self.bn // PANEL):
            T.evaluate(TMA_LOAD(
                T.cuda.cvta_generic_to_shared(self.at(self.b_ring + slot * self.b_stage
                                                      + q * (self.bk * ROW_BYTES))),
                T.address_of(b_map), b_col + q * PANEL, b_row + k0,
                T.cuda.cvta_generic_to_shared(full.ptr_to([slot]))))

    @T.inline
    def encode(self, desc, a_row):
        # desc[0]: A from row ``a_row`` of slot 0 (K-major: SBO = one 8-row group, LBO unused);
        # desc[1]: B from row 0 of slot 0 (MN-major: LBO = one 64-column panel, SBO = one
        # 8-row group of 128-byte rows).
        T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc[0]),
                                              self.at(a_row * self.a_row), 1,
                                              8 * self.a_row // 16, SWIZZLES[self.a_row])
        T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc[1]), self.at(self.b_ring),
                                              self.bk * ROW_BYTES // 16, ATOM_BYTES // 16,
                                              SWIZZLES[ROW_BYTES])

    def a_desc(self, desc, slot, kk, m):
        """A's descriptor for m64 block ``m`` (of this warpgroup) and k16 step ``kk``: the
        start address moves by whole rows, panels and 32-byte steps inside a swizzled row."""
        steps = self.a_row // 32  # k16 steps in one A row
        step = kk // steps * (self.bm * self.a_row) + m * 64 * self.a_row + kk % steps * 32
        return desc[0] + T.Cast("uint64", slot * (self.a_stage // 16) + step // 16)

    def b_desc(self, desc, slot, kk, panel=0):
        """B's descriptor for k16 step ``kk``: 16 rows (two swizzle atoms) further; from its
        64-column ``panel`` on."""
        return desc[1] + T.Cast("uint64", slot * (self.b_stage // 16) + kk * 16 * ROW_BYTES // 16
                                + panel * (self.bk * ROW_BYTES // 16))


@T.meta_class
class WgmmaTile:
    """One ``bm x bn`` fp32 accumulator tile on ``wgmma``, fed through a ``SwizzledRing``: the
    main loop and epilogue of every wgmma-shaped tile, with ``gemm.MmaTile``'s interface.

    The caller says where operand elements live (``a_src(r, k)``: the address of row r of the
    tile, column k of A; ``b_src(k, c)``: row k, tile column c of B), so gathered rows and
    per-expert or per-rank operands reuse the same loop. After ``run``, ``frag(m, n, e)``
    holds tile element ``(row(m, e // 2), col(n, e % 2))`` of this thread (m: the warpgroup's
    m64 blocks, n: the n8 blocks, as the mma.m16n8 C fragment); ``store`` writes the tile out,
    other epilogues read ``frag``. The geometry is checked by ``check_geometry`` first.

    ``swapped``: the tile computes ``C^T = B^T A^T``: B's 64-column panels, as they lie in
    the ring, are the instructions' m64 side (read MN-major, ``imm-trans-a`` = 1) and the
    tile's rows their N (``m64n<bm>k16``, A's panels read K-major, ``imm-trans-b`` = 0), so
    that bm is any multiple of 8 up to 256: a grouped GEMM's tile of an expert's rows then
    pads them to 8, not 64. Each warpgroup holds ``bn / 64 / warpgroups`` panels. The
    accumulators hold C transposed: ``frag(m, n, e)`` is tile element ``(row(n, e % 2),
    col(m, e // 2))``, m the warpgroup's panels, n the n8 blocks of rows."""

    def __init__(self, bm, bn, bk, stages, threads, tx, warp, lane, swapped=False):
        self.bm, self.bn, self.bk, self.stages = bm, bn, bk, stages
        self.tx, self.warp, self.lane = tx, warp, lane
        self.swapped = swapped
        self.groups = threads // WARPGROUP
        self.wg_rows = 0 if swapped else bm // self.groups  # rows per warpgroup
        # m64 blocks per warpgroup; accumulators per m64 block and thread
        self.mt = bn // PANEL // self.groups if swapped else self.wg_rows // 64
        self.regs = (bm if swapped else bn) // 2
        self.mi, self.ni = self.mt, self.regs // 4
        self.prefetch = stages - 2
        self.wgmma = getattr(T.ptx.wgmma.mma_async.sync.aligned,
                             f"m64n{bm if swapped else bn}k16").f32.bf16.bf16
        self.ring = SwizzledRing(bm, bn, bk, stages, threads)
        self.acc = T.alloc_local((self.mt, self.regs), "float32")
        self.desc = T.alloc_local((2,), "uint64")

    def row(self, m, h):
        """The tile row of m64 block m, half h: 16 rows a warp, g = lane // 4 and g + 8
        (swapped: of n8 block m, element h: rows 2t, 2t + 1, t = lane % 4)."""
        if self.swapped:
            return m * 8 + self.lane % 4 * 2 + h
        return self.warp // 4 * self.wg_rows + m * 64 + self.warp % 4 * 16 + self.lane // 4 \
            + h * 8

    def col(self, n, v):
        """The tile column of n8 block n, element v (columns 2t, 2t + 1, t = lane % 4;
        swapped: of the warpgroup's panel n, half v: 16 columns a warp, lane // 4 and + 8)."""
        if self.swapped:
            return (self.warp // 4 * self.mt + n) * PANEL + self.warp % 4 * 16 \
                + self.lane // 4 + v * 8
        return n * 8 + self.lane % 4 * 2 + v

    def frag(self, m, n, e):
        return self.acc[m, n * 4 + e]

    @T.inline
    def begin(self):
        # the ring's aligned base, the descriptors, zero accumulators
        self.ring.init()
        self.ring.encode(self.desc, 0 if self.swapped else self.warp // 4 * self.wg_rows)
        for m in T.unroll(self.mt):
            for e in T.unroll(self.regs):
                self.acc[m, e] = T.float32(0)

    @T.inline
    def issue(self, slot, live_blocks=None):
        # this warpgroup's wgmmas of the slice in ``slot``, one commit group; with
        # ``live_blocks``, only those of the tile's first live_blocks m64 blocks, where the
        # warpgroup holds several (a branch around a warpgroup's one block made ptxas
        # serialise every wgmma of a claimed kernel, C7520: an empty block's products are
        # zeros, its loads none)
        T.ptx.wgmma.fence.sync.aligned()
        if live_blocks is None or self.mt == 1:
            self.issue_blocks(slot, self.mt)
        else:
            self.issue_live(slot, live_blocks - self.warp // 4 * self.mt, self.mt)
        T.ptx.wgmma.commit_group.sync.aligned()

    @T.inline
    def issue_live(self, slot, mine, blocks):
        # the wgmmas of this warpgroup's first ``mine`` blocks (warpgroup-uniform), as one
        # straight run of wgmmas for each count up to ``blocks``: a branch around each
        # wgmma makes ptxas fence the accumulators before it
        if blocks == 1:
            if mine >= 1:
                self.issue_blocks(slot, 1)
        elif mine >= blocks:
            self.issue_blocks(slot, blocks)
        else:
            self.issue_live(slot, mine, blocks - 1)

    @T.inline
    def issue_blocks(self, slot, blocks):
        ring, acc, desc = T.meta_var((self.ring, self.acc, self.desc))
        for kk in T.unroll(self.bk // 16):
            for m in T.unroll(blocks):
                if self.swapped:  # B's panel (MN-major) times the tile's rows (K-major)
                    self.wgmma(*[acc[m, e] for e in range(self.regs)],
                               ring.b_desc(desc, slot, kk, self.warp // 4 * self.mt + m),
                               ring.a_desc(desc, slot, kk, 0), True, 1, 1, 1, 0)
                else:
                    self.wgmma(*[acc[m, e] for e in range(self.regs)],
                               ring.a_desc(desc, slot, kk, m), ring.b_desc(desc, slot, kk),
                               True, 1, 1, 0, 1)

    @T.inline
    def mma_step(self, ko, live_blocks=None):
        # this warpgroup's wgmmas of slice ko-2 retired, then a barrier (so: every
        # warpgroup's, and that slot may be refilled); then slice ko's wgmmas
        T.ptx.wgmma.wait_group.sync.aligned(1)
        T.cuda.cta_sync()
        self.issue(ko % self.stages, live_blocks)

    @T.inline
    def preload_b(self, b_src, num_k):
        # gemm.MmaTile.preload_b: B of run's prologue slices (0 .. stages-3), one commit group
        self.ring.init()
        for p in T.unroll(self.prefetch):
            if p < num_k:
                self.ring.load_b(p, b_src, p * self.bk, self.tx)
        T.ptx.cp.async_.commit_group()

    @T.inline
    def run(self, a_src, b_src, num_k, a_valid=None, live_blocks=None, a_rows=None,
            b_preloaded=False):
        # a_valid: gemm.copy_a_chunk's; live_blocks: the m64 blocks of the tile, from the
        # first, that hold rows (CTA-uniform): the others' products are zero and not issued,
        # so their accumulators stay zero; a_rows: gemm.MmaTile's; b_preloaded: after
        # preload_b
        ring, stages, prefetch = T.meta_var((self.ring, self.stages, self.prefetch))
        rows = T.meta_var(gathered_rows(a_rows, self.bm * self.bk // CHUNK, self.bk // CHUNK,
                                        ring.threads, self.tx))
        self.begin()
        for p in T.unroll(prefetch):
            if p < num_k:
                if b_preloaded:
                    ring.load_a(p, a_src, p * self.bk, self.tx, a_valid, rows)
                else:
                    ring.load_stage(p, a_src, b_src, p * self.bk, self.tx, a_valid, rows)
            T.ptx.cp.async_.commit_group()
        for ko in T.serial(num_k):
            T.ptx.cp.async_.wait_group(prefetch - 1)
            T.ptx.fence.proxy.async_.shared__cta()
            self.mma_step(ko, live_blocks)
            if ko + prefetch < num_k:
                ring.load_stage((ko + prefetch) % stages, a_src, b_src,
                                (ko + prefetch) * self.bk, self.tx, a_valid, rows)
            T.ptx.cp.async_.commit_group()
        T.ptx.wgmma.wait_group.sync.aligned(0)
        T.cuda.cta_sync()  # no warpgroup still reads the ring when the next task refills it

    @T.inline
    def run_tma(self, a_map, a_row, b_map, b_col, num_k, b_row=0, live_blocks=None):
        """``run`` with the stages loaded by TMA through ``a_map`` (box bm x 64 of A from
        row ``a_row``) and ``b_map`` (box bk x 64 of B from column ``b_col``, its K rows
        from map row ``b_row``: a slab of stacked weights), both with the 128-byte
        swizzle, and no CTA barrier in the loop (``live_blocks``: ``run``'s; every row of
        the box is read, as TMA copies whole boxes): each stage has a *full*
        mbarrier, which thread 0 arms with the stage's bytes as it issues the loads, and an
        *empty* one, on which each warpgroup arrives once its wgmmas of the stage retired.
        Thread 0 refills a slot after its empty barrier completes, so every slot but the
        one being read is in flight (the cp.async loop keeps one fewer). Parities are the
        stage's use count; the barriers are set up and invalidated within the task, so the
        next task of the kernel finds plain shared memory."""
        ring, stages, groups = T.meta_var((self.ring, self.stages, self.groups))
        full = T.alloc_shared((stages,), "uint64")
        empty = T.alloc_shared((stages,), "uint64")
        self.begin()
        if self.tx == 0:
            for s in T.unroll(stages):
                T.ptx.mbarrier.init.shared.b64(full.ptr_to([s]), T.uint32(1))
                T.ptx.mbarrier.init.shared.b64(empty.ptr_to([s]), T.uint32(groups))
        T.cuda.cta_sync()
        if self.tx == 0:
            # the loads (async proxy) come after generic-proxy writes: operands other tasks
            # of the kernel stored, and the shared bytes of this CTA's previous task
            T.ptx.fence.proxy.async_()
            for p in T.unroll(stages):
                if p < num_k:
                    ring.load_stage_tma(p, full, a_map, a_row, b_map, b_row, b_col,
                                        p * self.bk)
        for ko in T.serial(num_k):
            # slice ko-2 retired (ko-1's wgmmas may still run): release its slot, which
            # thread 0 refills; then slice ko. The wait heads the step rather than following
            # the issue, so that no wgmma group is pending across the loop's back edge: in a
            # kernel that also holds a cp.async wgmma tile, ptxas serialised every wgmma of
            # the kernel (C7515) when it was
            T.ptx.wgmma.wait_group.sync.aligned(1)
            if ko > 1:
                if self.tx % WARPGROUP == 0:
                    T.ptx.mbarrier.arrive.shared.b64(empty.ptr_to([(ko - 2) % stages]),
                                                     T.uint32(1))
                if self.tx == 0:
                    if ko - 2 + stages < num_k:
                        T.cuda.mbarrier_wait(empty.ptr_to([(ko - 2) % stages]),
                                             ((ko - 2) // stages) % 2)
                        ring.load_stage_tma((ko - 2) % stages, full, a_map, a_row, b_map,
                                            b_row, b_col, (ko - 2 + stages) * self.bk)
            T.cuda.mbarrier_wait(full.ptr_to([ko % stages]), (ko // stages) % 2)
            self.issue(ko % stages, live_blocks)
        T.ptx.wgmma.wait_group.sync.aligned(0)
        T.cuda.cta_sync()
        if self.tx == 0:
            for s in T.unroll(stages):
                T.ptx.mbarrier.inval.shared.b64(full.ptr_to([s]))
                T.ptx.mbarrier.inval.shared.b64(empty.ptr_to([s]))

    @T.inline
    def store(self, C, row0, col0, rows=None):
        # rows: ``store_fragments``'
        if self.swapped:
            self.store_swapped(C, row0, col0, rows)
        else:
            store_fragments(self, C, row0, col0, rows)

    @T.inline
    def store_swapped(self, C, row0, col0, rows=None):
        # A thread's two elements of an instruction lie in one column (rows 2t, 2t + 1); the
        # lane four over holds the next column. The pair trade one element, so that each
        # holds two adjacent columns of one row, which leave in one store (and the bf16
        # conversion reads the traded registers: converting accumulator pairs straight from
        # the wgmma's registers, ptxas serialised every wgmma of the kernel, C7514). The
        # trade's operands live in registers of their own: as one expression, the simplifier
        # moved the shuffle into the arms of the Select, and each lane shuffled under its own
        # branch, diverged.
        odd = T.meta_var(self.lane // 4 % 2)
        room = T.local_scalar("int32")  # with rows: those at or past this thread's first
        if rows is not None:
            room = rows - self.row(0, odd)
        for m in T.unroll(self.mi):
            for n in T.unroll(self.ni):
                for h in T.unroll(2):
                    mine = T.meta_var((self.frag(m, n, 2 * h), self.frag(m, n, 2 * h + 1)))
                    trade = T.alloc_local((2,), "float32")  # sent, received
                    trade[0] = T.Select(odd == 1, mine[0], mine[1])
                    trade[1] = T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), trade[0], 4, 32, 32)
                    pair = T.alloc_local((2,), "float32")
                    pair[0] = T.Select(odd == 1, trade[1], mine[0])
                    pair[1] = T.Select(odd == 1, mine[1], trade[1])
                    if row_stored(None if rows is None else room, n * 8):
                        for v in T.vectorized(2):
                            C[row0 + self.row(n, odd), col0 + self.col(m, h) - odd + v] = \
                                T.Cast(C.dtype, pair[v])

    @T.inline
    def store_as(self, stores, C, row0, col0):
        # ``store`` or ``store_staged``, as ``stores`` (``STORES``) says
        if stores == "staged":
            self.store_staged(C, row0, col0)
        else:
            self.store(C, row0, col0)

    @T.inline
    def store_staged(self, C, row0, col0):
        # ``store`` through the idle ring (after ``run``; from the allocation's start, which
        # 16-byte accesses need aligned, not the swizzle's base): the bf16 tile goes to
        # shared memory first, then out in row-contiguous 16-byte stores. ``store`` writes
        # 16 bytes of a row an instruction (4 lanes' column pairs, 8 rows), half a 32-byte
        # sector each: where C is a peer's copy, across NVLink, every sector then goes whole.
        ring, threads, pitch, chunks = T.meta_var(
            (self.ring, self.groups * WARPGROUP, self.bn + STAGE_PAD, self.bn // CHUNK))
        for m in T.unroll(self.mi):
            for n in T.unroll(self.ni):
                for h in T.unroll(2):
                    for v in T.vectorized(2):
                        ring.smem[self.row(m, h) * pitch + self.col(n, v)] = \
                            T.Cast("bfloat16", self.frag(m, n, h * 2 + v))
        T.cuda.cta_sync()
        for q in T.unroll(self.bm * chunks // threads):
            r, c = T.meta_var(((q * threads + self.tx) // chunks,
                               (q * threads + self.tx) % chunks * CHUNK))
            for v in T.vectorized(CHUNK):
                C[row0 + r, col0 + c + v] = ring.smem[r * pitch + c + v]


def operand_maps(loads: str, a: str, bm: int, bk: int, tile: str, b: str = "B") -> list[TensorMap]:
    """The tensor maps of a wgmma tile whose stages ``loads`` fill: none for "cp.async"; for
    "tma" (``WgmmaTile.run_tma``), rows of the A operand, parameter ``a`` (box bm x 64), and
    of the B operand, parameter ``b`` (bk x 64), with the 128-byte swizzle of the ring.
    ``tile`` names the tile in the error for any other ``loads``."""
    if loads not in LOADS:
        raise EtcError(f"{tile}: loads must be one of {LOADS}, got {loads!r}")
    if loads == "tma" and bk % PANEL:
        raise EtcError(f"{tile}: TMA loads take slices of whole 64-column panels (bk a "
                       f"multiple of 64), got bk={bk}")
    if loads != "tma":
        return []
    return [TensorMap(a, box=(bm, PANEL), swizzle=ROW_BYTES),
            TensorMap(b, box=(bk, PANEL), swizzle=ROW_BYTES)]


def task_cost(K, bm: int, bn: int, bk: int):
    """The cost hint of a task that runs a bm x bn tile over K (symbolic): one K step is
    about bm*bn/4096 elementwise passes of a 64x64 tile."""
    return K // bk * max(1, bm * bn // 4096)


def make_wgmma_gemm_tile(bm: int = 128, bn: int = 256, bk: int = 64, stages: int = 4,
                         threads: int = 256, out_dtype: str = "float32",
                         loads: str = "cp.async", stores: str = "fragments",
                         swapped: bool = False, split_k: int = 1) -> DeviceFunc:
    """The tile ``wgmma_gemm_<bm>x<bn>x<bk>_<out>_s<stages>_t<threads>``; one DeviceFunc per
    configuration, however the arguments are spelled (graphs naming one configuration share
    one device function).

    Each of the ``threads // 128`` warpgroups owns ``bm / warpgroups`` rows of the tile and
    issues one ``wgmma.m64n<bn>k16`` per 64 of them per k16 step. The default, 128 x 256 x 64
    with 4 stages on two warpgroups (192 KB of shared memory, 128 accumulators a thread), is
    the shape compute-bound Hopper GEMMs use; 128 x 128 on one warpgroup composes with the
    128-thread tiles of the library. ``loads``: "cp.async" (every thread copies 16 bytes at
    a time) or "tma" (one thread, one TMA load a 64-column panel, through tensor maps of A
    and B that the kernels encode; ``run_tma``). ``stores``: ``STORES``, "fragments"
    (``WgmmaTile.store``) or "staged" (``store_staged``; bf16 tiles). ``swapped``
    (cp.async loads): ``WgmmaTile``'s, bm any multiple of 8, and M any size: the rows of
    the last row block past M read nothing and are not stored (the grid takes
    ``ceil(M / bm)`` row blocks), so that one tile of 8 rows serves M = 1 .. 8.

    With ``split_k`` > 1 the task is ``(i, j, s)`` and writes the partial product over the
    s-th of ``split_k`` equal slices of K into ``P[s]`` of a (split_k, M, N) output (K a
    multiple of split_k * bk), as ``gemm.make_gemm_tile``'s: at a few rows the weights are
    the bytes, and a weight panel's K slices on several SMs stream them at once.
    """
    return _make_tile(bm, bn, bk, stages, threads, out_dtype, loads, stores, swapped, split_k)


@functools.cache
def _make_tile(bm: int, bn: int, bk: int, stages: int, threads: int,
               out_dtype: str, loads: str, stores: str, swapped: bool,
               split_k: int) -> DeviceFunc:
    check_geometry(bm, bn, bk, stages, threads, out_dtype, stores, swapped)
    staged = stores == "staged"
    M, N, K = (tirx.Var(d, "int32") for d in "MNK")
    maps = operand_maps(loads, "A", bm, bk, "wgmma gemm tile")
    tma = loads == "tma"
    if tma and swapped:
        raise EtcError(f"wgmma gemm tile {bm}x{bn}x{bk}: swapped tiles load by cp.async, "
                       "not TMA")
    if split_k < 1 or split_k > 1 and tma:
        raise EtcError(f"wgmma gemm tile {bm}x{bn}x{bk}: split_k must be positive, and 1 "
                       f"with TMA loads (whole boxes of K), got {split_k} with {loads}")

    @T.inline
    def product(i, j, k0, num_k, A, B, C, tx, warp, lane, by_tma, ragged):
        # C[tile (i, j)] = A[rows i, k0:k0 + num_k*bk] @ B[k0:k0 + num_k*bk, cols j]; a
        # ragged (swapped) tile's rows past M read nothing and are not stored
        tile = WgmmaTile(bm, bn, bk, stages, threads, tx, warp, lane, swapped)
        if by_tma:
            tile.run_tma(maps[0].var, i * bm, maps[1].var, j * bn, num_k)
        elif ragged:
            tile.run(lambda r, k: A.ptr_to([T.min(i * bm + r, M - 1), k0 + k]),
                     lambda k, c: B.ptr_to([k0 + k, j * bn + c]), num_k,
                     a_valid=lambda r: i * bm + r < M)
        else:
            tile.run(lambda r, k: A.ptr_to([i * bm + r, k0 + k]),
                     lambda k, c: B.ptr_to([k0 + k, j * bn + c]), num_k)
        if ragged:
            tile.store(C, i * bm, j * bn, M - i * bm)
        else:
            tile.store_as(stores, C, i * bm, j * bn)

    if split_k == 1:
        # with TMA the maps' variables are free: each kernel binds them
        @T.prim_func(check_well_formed=not tma)
        def wgmma_gemm(i: T.int32, j: T.int32, A: T.Buffer((M, K), "bfloat16"),
                       B: T.Buffer((K, N), "bfloat16"), C: T.Buffer((M, N), out_dtype)):
            T.device_entry()
            tx = T.thread_id([threads])
            warp = T.warp_id([threads // 32])
            lane = T.lane_id([32])
            product(i, j, 0, K // bk, A, B, C, tx, warp, lane, tma, swapped)
    else:
        @T.prim_func
        def wgmma_gemm(i: T.int32, j: T.int32, s: T.int32, A: T.Buffer((M, K), "bfloat16"),
                       B: T.Buffer((K, N), "bfloat16"),
                       P: T.Buffer((split_k, M, N), out_dtype)):
            T.device_entry()
            tx = T.thread_id([threads])
            warp = T.warp_id([threads // 32])
            lane = T.lane_id([32])
            Ps = T.decl_buffer((M, N), out_dtype, data=P.data, elem_offset=s * M * N)
            product(i, j, s * (K // split_k), K // split_k // bk, A, B, Ps, tx, warp, lane,
                    False, swapped)

    out = "bf16" if out_dtype == "bfloat16" else "f32"
    name = f"wgmma_gemm{'_tma' if tma else ''}_{bm}x{bn}x{bk}_{out}_s{stages}_t{threads}" \
        f"{'_staged' if staged else ''}{'_swapped' if swapped else ''}" \
        f"{f'_k{split_k}' if split_k > 1 else ''}"
    tile = device_func(wgmma_gemm.with_attr("global_symbol", name),
                       cost=task_cost(K // split_k, bm, bn, bk), tensor_maps=maps,
                       requires=block_requires(M, N, K, bm, bn, bk, split_k,
                                               ragged_rows=swapped))
    set_block_reference(tile, bm, bn, split_k)
    return tile
