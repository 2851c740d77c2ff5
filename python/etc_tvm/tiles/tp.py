"""Tensor-parallel tiles: the seed's GEMM + Reduce-Scatter and All-Gather + GEMM at MLP sizes,
on ``wgmma`` (bf16 in, fp32 accumulate), for graphs of world size W (``apps/tp_layers.py``)::

    gemm_scatter  task (i, j)     P[rank, rows of tile i within its owner, cols j], on the
                                  owner of row tile i, = A[rows i] @ B[:, cols j]   (bf16)
    partial_sum   task (i, j)     D[tile (i, j)] = sum over ranks r of P[r, tile (i, j)]
    gather_rows   task (p, i)     G[rank, rows i], on rank p, = A[rows i]
    ring_gemm     task (s, i, j)  C[rows i of source (rank + s) % W, cols j]
                                  = G[source, rows i] @ B[:, cols j]

A tile that writes a symmetric tensor (P, G) addresses it as its own: the rank kernel hands it
the copy of the rank the task notifies, so its stores go over NVLink as they leave the
registers and no separate copy or collective runs. Ranks own ``Q = M / W`` rows each; a row
tile never straddles two owners (Q a multiple of bm).

Numeric contract: the GEMM tiles as ``gemm`` (``K * 2**-22 * |A| @ |B|``), then the bf16
rounding of each partial (``2**-8``); ``partial_sum`` adds the W partials in fp32 in rank order
(deterministic: every launch gives the same bits) and rounds once to bf16. ``rs_error_bound``
composes them.
"""
from __future__ import annotations

import functools

import numpy as np
from tvm import tirx
from tvm.script import tirx as T

from ..device_func import RANK, WORLD_SIZE, DeviceFunc, device_func
from ..errors import EtcError
from .gemm import column_requires
from .wgmma_gemm import WgmmaTile, check_geometry, operand_maps, task_cost

VEC = 8  # bf16 per 16-byte access


def _wgmma_config(bm, bn, bk, stages, threads, loads, stores):
    check_geometry(bm, bn, bk, stages, threads, "bfloat16", stores)
    return (f"{bm}x{bn}x{bk}_s{stages}_t{threads}{'_tma' if loads == 'tma' else ''}"
            f"{'_staged' if stores == 'staged' else ''}")


@functools.cache
def make_gemm_scatter_tile(bm: int = 128, bn: int = 128, bk: int = 64, stages: int = 4,
                           threads: int = 128, loads: str = "cp.async",
                           stores: str = "fragments") -> DeviceFunc:
    """The tile ``gemm_scatter_<bm>x<bn>x<bk>``: task (i, j) computes this rank's partial
    product ``A[rows i] @ B[:, cols j]`` (A: M x K_r, B: K_r x N, this rank's K slice) and
    stores it in bf16 into ``P[rank]`` (P: W x Q x N, symmetric) of the rank that owns row
    tile i, at the tile's rows within that rank's Q. ``loads``: as the wgmma GEMM tile's;
    ``stores``: straight from the fragments, or staged through the ring into row-contiguous
    16-byte stores (``wgmma_gemm.STORES``)."""
    config = _wgmma_config(bm, bn, bk, stages, threads, loads, stores)
    M, N, K, R, Q = (tirx.Var(d, "int32") for d in ("M", "N", "K", "R", "Q"))
    maps = operand_maps(loads, "A", bm, bk, "gemm_scatter tile")
    tma = loads == "tma"

    @T.prim_func(check_well_formed=not tma)  # with TMA the maps' variables are free
    def gemm_scatter(i: T.int32, j: T.int32, A: T.Buffer((M, K), "bfloat16"),
                     B: T.Buffer((K, N), "bfloat16"), P: T.Buffer((R, Q, N), "bfloat16")):
        T.device_entry()
        tx = T.thread_id([threads])
        warp = T.warp_id([threads // 32])
        lane = T.lane_id([32])
        mine = T.decl_buffer((Q, N), "bfloat16", data=P.data, elem_offset=RANK * Q * N)
        tile = WgmmaTile(bm, bn, bk, stages, threads, tx, warp, lane)
        if tma:
            tile.run_tma(maps[0].var, i * bm, maps[1].var, j * bn, K // bk)
        else:
            tile.run(lambda r, k: A.ptr_to([i * bm + r, k]),
                     lambda k, c: B.ptr_to([k, j * bn + c]), K // bk)
        tile.store_as(stores, mine, i * bm - i * bm // Q * Q, j * bn)

    tile = device_func(gemm_scatter.with_attr("global_symbol", f"gemm_scatter_{config}"),
                       cost=task_cost(K, bm, bn, bk), tensor_maps=maps,
                       requires=[(Q % bm == 0, f"Q a multiple of {bm}"),
                                 (M == R * Q, "M = R x Q"),
                                 *column_requires(N, K, bn, bk)])

    @tile.set_reference
    def _(i, j, A, B, P, *, rank, peers):
        rows, cols = slice(i * bm, (i + 1) * bm), slice(j * bn, (j + 1) * bn)
        owner, local = divmod(i * bm, P.shape[1])
        peers[owner].P[rank, local:local + bm, cols] = (
            A[rows].astype(np.float32) @ B[:, cols].astype(np.float32)).astype(P.dtype)

    return tile


@functools.cache
def make_partial_sum_tile(rows: int = 128, cols: int = 128, threads: int = 128) -> DeviceFunc:
    """The tile ``partial_sum_<rows>x<cols>``: task (i, j) writes ``D[tile (i, j)]`` (Q x N,
    bf16) = the fp32 sum, in rank order, of the R partials ``P[r, tile (i, j)]``."""
    if cols % VEC or (rows * cols // VEC) % threads:
        raise EtcError(f"partial_sum tile {rows}x{cols}: its 8-element vectors must divide "
                       f"among {threads} threads")
    N, R, Q = (tirx.Var(d, "int32") for d in ("N", "R", "Q"))
    per_thread, row_vecs = rows * cols // VEC // threads, cols // VEC

    @T.prim_func
    def partial_sum(i: T.int32, j: T.int32, P: T.Buffer((R, Q, N), "bfloat16"),
                    D: T.Buffer((Q, N), "bfloat16")):
        T.device_entry()
        tx = T.thread_id([threads])
        acc = T.alloc_local((VEC,), "float32")
        part = T.alloc_local((VEC,), "bfloat16")
        for q in T.unroll(per_thread):
            v = T.meta_var(q * threads + tx)
            row, col = T.meta_var((i * rows + v // row_vecs, j * cols + v % row_vecs * VEC))
            for e in T.unroll(VEC):
                acc[e] = T.float32(0)
            for r in T.serial(R):
                for e in T.vectorized(VEC):
                    part[e] = P[r, row, col + e]
                for e in T.unroll(VEC):
                    acc[e] = acc[e] + T.Cast("float32", part[e])
            for e in T.vectorized(VEC):
                D[row, col + e] = T.Cast("bfloat16", acc[e])

    tile = device_func(partial_sum.with_attr("global_symbol",
                                             f"partial_sum_{rows}x{cols}_t{threads}"),
                       requires=[(Q % rows == 0, f"Q a multiple of {rows}"),
                                 (N % cols == 0, f"N a multiple of {cols}")])

    @tile.set_reference
    def _(i, j, P, D):
        span = (slice(i * rows, (i + 1) * rows), slice(j * cols, (j + 1) * cols))
        acc = np.zeros((rows, cols), np.float32)
        for r in range(P.shape[0]):
            acc = acc + P[(r, *span)].astype(np.float32)
        D[span] = acc.astype(D.dtype)

    return tile


def rs_error_bound(A_slices, B_slices) -> np.ndarray:
    """Bound on ``|D - sum_r A_r @ B_r|`` (float64 of the same bf16 inputs) for every row of
    the reduce-scattered product: each partial within the GEMM bound plus its bf16 rounding,
    the W - 1 fp32 additions, and the bf16 rounding of D."""
    exact = sum(a.astype(np.float64) @ b.astype(np.float64) for a, b in zip(A_slices, B_slices))
    bound = sum(a.shape[1] * 2.0 ** -22 * (np.abs(a.astype(np.float64))
                                           @ np.abs(b.astype(np.float64)))
                + 2.0 ** -8 * np.abs(a.astype(np.float64) @ b.astype(np.float64))
                for a, b in zip(A_slices, B_slices))
    return bound * (1 + len(A_slices) * 2.0 ** -23) + 2.0 ** -8 * np.abs(exact) + 2.0 ** -126


@functools.cache
def make_gather_rows_tile(rows: int = 128, threads: int = 128) -> DeviceFunc:
    """The tile ``gather_rows_<rows>``: task (p, i) copies row tile i of this rank's A (M x K,
    bf16) into ``G[rank]`` (G: W x M x K, symmetric) of rank p, 16 bytes a thread a step."""
    M, K, R = (tirx.Var(d, "int32") for d in ("M", "K", "R"))

    @T.prim_func
    def gather_rows(p: T.int32, i: T.int32, A: T.Buffer((M, K), "bfloat16"),
                    G: T.Buffer((R, M, K), "bfloat16")):
        T.device_entry()
        tx = T.thread_id([threads])
        for q in T.serial((rows * K // VEC + threads - 1) // threads):
            v = T.meta_var(q * threads + tx)
            if v < rows * K // VEC:
                for e in T.vectorized(VEC):
                    G[RANK, i * rows + v // (K // VEC), v % (K // VEC) * VEC + e] = \
                        A[i * rows + v // (K // VEC), v % (K // VEC) * VEC + e]

    tile = device_func(gather_rows.with_attr("global_symbol", f"gather_rows_{rows}_t{threads}"),
                       requires=[(M % rows == 0, f"M a multiple of {rows}"),
                                 (K % VEC == 0, f"K a multiple of {VEC}")])

    @tile.set_reference
    def _(p, i, A, G, *, rank, peers):
        span = slice(i * rows, (i + 1) * rows)
        peers[p].G[rank, span] = A[span]

    return tile


@functools.cache
def make_ring_gemm_tile(bm: int = 128, bn: int = 128, bk: int = 64, stages: int = 4,
                        threads: int = 128, loads: str = "cp.async",
                        stores: str = "fragments") -> DeviceFunc:
    """The tile ``ring_gemm_<bm>x<bn>x<bk>``: task (s, i, j) multiplies row tile i of source
    rank ``(rank + s) % W``'s gathered rows ``G[source]`` (G: W x M x K) by this rank's
    columns B (K x N) into the source's rows of C (Q = W*M x N, bf16): step s = 0 is this rank's
    own rows, which need no transfer. ``loads``: as the wgmma GEMM tile's (G's map sees its
    W*M rows); ``stores``: as ``make_gemm_scatter_tile``'s."""
    config = _wgmma_config(bm, bn, bk, stages, threads, loads, stores)
    M, N, K, R, Q = (tirx.Var(d, "int32") for d in ("M", "N", "K", "R", "Q"))
    maps = operand_maps(loads, "G", bm, bk, "ring_gemm tile")
    tma = loads == "tma"

    @T.prim_func(check_well_formed=not tma)  # with TMA the maps' variables are free
    def ring_gemm(s: T.int32, i: T.int32, j: T.int32, G: T.Buffer((R, M, K), "bfloat16"),
                  B: T.Buffer((K, N), "bfloat16"), C: T.Buffer((Q, N), "bfloat16")):
        T.device_entry()
        tx = T.thread_id([threads])
        warp = T.warp_id([threads // 32])
        lane = T.lane_id([32])
        source = T.meta_var((RANK + s) % WORLD_SIZE)
        tile = WgmmaTile(bm, bn, bk, stages, threads, tx, warp, lane)
        if tma:
            tile.run_tma(maps[0].var, source * M + i * bm, maps[1].var, j * bn, K // bk)
        else:
            tile.run(lambda r, k: G.ptr_to([source, i * bm + r, k]),
                     lambda k, c: B.ptr_to([k, j * bn + c]), K // bk)
        tile.store_as(stores, C, source * M + i * bm, j * bn)

    tile = device_func(ring_gemm.with_attr("global_symbol", f"ring_gemm_{config}"),
                       cost=task_cost(K, bm, bn, bk), tensor_maps=maps,
                       requires=[(M % bm == 0, f"M a multiple of {bm}"),
                                 (Q == R * M, "Q = R x M"),
                                 *column_requires(N, K, bn, bk)])

    @tile.set_reference
    def _(s, i, j, G, B, C, *, rank, world_size):
        source, m = (rank + s) % world_size, G.shape[1]
        rows, cols = slice(i * bm, (i + 1) * bm), slice(j * bn, (j + 1) * bn)
        C[source * m + i * bm:source * m + (i + 1) * bm, cols] = (
            G[source, rows].astype(np.float32) @ B[:, cols].astype(np.float32)).astype(C.dtype)

    return tile
