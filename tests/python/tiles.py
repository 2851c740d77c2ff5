"""Small device functions for the tests, each a TIRx kernel with its NumPy reference.

Row tiles are ROWS rows of a (M, COLS) float32 tensor; 2-D tiles are TILE x TILE blocks.
"""
import numpy as np
from tvm.script import tirx as T

from etc_tvm import await_inputs, device_func, input_check

ROWS, COLS, TILE, THREADS = 4, 32, 16, 128
M, N, K, P = T.int32(), T.int32(), T.int32(), T.int32()


@device_func
def scale_tile(i: T.int32, A: T.Buffer((M, COLS), "float32"), B: T.Buffer((M, COLS), "float32")):
    """B = 2 A + 1 on rows [i*ROWS, (i+1)*ROWS)."""
    T.device_entry()
    tx = T.thread_id([THREADS])
    for r in T.serial(ROWS * COLS // THREADS):
        e = r * THREADS + tx
        row = i * ROWS + e // COLS
        B[row, e % COLS] = A[row, e % COLS] * T.float32(2) + T.float32(1)


@scale_tile.set_reference
def _(i, A, B):
    rows = slice(i * ROWS, (i + 1) * ROWS)
    B[rows] = A[rows] * np.float32(2) + np.float32(1)


@device_func
def mix_tile(i: T.int32, A: T.Buffer((M, COLS), "float32"), B: T.Buffer((M, COLS), "float32"),
             C: T.Buffer((M, COLS), "float32")):
    """C = A / 2 + tanh(B) on rows [i*ROWS, (i+1)*ROWS)."""
    T.device_entry()
    tx = T.thread_id([THREADS])
    for r in T.serial(ROWS * COLS // THREADS):
        e = r * THREADS + tx
        C[i * ROWS + e // COLS, e % COLS] = (A[i * ROWS + e // COLS, e % COLS] * T.float32(0.5)
                                             + T.tanh(B[i * ROWS + e // COLS, e % COLS]))


@mix_tile.set_reference
def _(i, A, B, C):
    rows = slice(i * ROWS, (i + 1) * ROWS)
    C[rows] = A[rows] * np.float32(0.5) + np.tanh(B[rows])


@device_func
def partial_rowsum_tile(i: T.int32, j: T.int32, X: T.Buffer((M, N), "float32"),
                        S: T.Buffer((M, P), "float32")):
    """S[r, j] = sum of X[r, j*TILE:(j+1)*TILE] for the TILE rows r of tile i."""
    T.device_entry()
    tx = T.thread_id([THREADS])
    if tx < TILE:
        S[i * TILE + tx, j] = T.float32(0)
        for c in T.serial(TILE):
            S[i * TILE + tx, j] = S[i * TILE + tx, j] + X[i * TILE + tx, j * TILE + c]


@partial_rowsum_tile.set_reference
def _(i, j, X, S):
    rows = slice(i * TILE, (i + 1) * TILE)
    S[rows, j] = X[rows, j * TILE:(j + 1) * TILE].sum(axis=1)


@device_func
def rowsum_tile(i: T.int32, S: T.Buffer((M, P), "float32"), Y: T.Buffer((M,), "float32")):
    """Y[r] = sum over j of S[r, j] for the TILE rows r of tile i."""
    T.device_entry()
    tx = T.thread_id([THREADS])
    if tx < TILE:
        Y[i * TILE + tx] = T.float32(0)
        for j in T.serial(P):
            Y[i * TILE + tx] = Y[i * TILE + tx] + S[i * TILE + tx, j]


@rowsum_tile.set_reference
def _(i, S, Y):
    rows = slice(i * TILE, (i + 1) * TILE)
    Y[rows] = S[rows].sum(axis=1)


@device_func
def matmul_tile(i: T.int32, j: T.int32, A: T.Buffer((M, K), "float32"),
                B: T.Buffer((K, N), "float32"), C: T.Buffer((M, N), "float32")):
    """C tile (i, j) = A[rows i] @ B[:, cols j], one output element per thread and step."""
    T.device_entry()
    tx = T.thread_id([THREADS])
    for r in T.serial(TILE * TILE // THREADS):
        e = r * THREADS + tx
        C[i * TILE + e // TILE, j * TILE + e % TILE] = T.float32(0)
        for k in T.serial(K):
            C[i * TILE + e // TILE, j * TILE + e % TILE] = (
                C[i * TILE + e // TILE, j * TILE + e % TILE]
                + A[i * TILE + e // TILE, k] * B[k, j * TILE + e % TILE])


@matmul_tile.set_reference
def _(i, j, A, B, C):
    rows, cols = slice(i * TILE, (i + 1) * TILE), slice(j * TILE, (j + 1) * TILE)
    C[rows, cols] = A[rows] @ B[:, cols]


@device_func
def reduce_scatter_tile(i: T.int32, j: T.int32, C: T.Buffer((M, N), "float32"),
                        D: T.Buffer((M, N), "float32")):
    """D tile (i, j) = the sum over ranks of C tile (i, j); with one rank, a copy."""
    T.device_entry()
    tx = T.thread_id([THREADS])
    for r in T.serial(TILE * TILE // THREADS):
        e = r * THREADS + tx
        D[i * TILE + e // TILE, j * TILE + e % TILE] = C[i * TILE + e // TILE, j * TILE + e % TILE]


@reduce_scatter_tile.set_reference
def _(i, j, C, D):
    rows, cols = slice(i * TILE, (i + 1) * TILE), slice(j * TILE, (j + 1) * TILE)
    D[rows, cols] = C[rows, cols]


@T.prim_func(check_well_formed=False)
def _gather_rows(i: T.int32, slot: T.Buffer((4,), "int32"), A: T.Buffer((8,), "float32"),
                 B: T.Buffer((4,), "float32")):
    T.device_entry()
    tx = T.thread_id([4])
    B[tx] = T.float32(0)
    if input_check(slot[tx], 8) != 0:
        B[tx] = A[slot[tx]]


# B[t] = A[slot[t]], each slot checked against A's 8 rows (0 where it is out of range)
gather_tile = device_func(_gather_rows, checks=("slot {value} outside 0..7",))


@device_func
def double_tile(i: T.int32, A: T.Buffer((8,), "float32"), C: T.Buffer((8,), "float32")):
    """C = 2 A on one task of 4 threads (as many as gather_tile's, so they share a kernel)."""
    T.device_entry()
    tx = T.thread_id([4])
    for r in T.serial(2):
        C[r * 4 + tx] = A[r * 4 + tx] * T.float32(2)


@device_func
def weight_row_tile(i: T.int32, row: T.Buffer((P,), "int32"), W: T.Buffer((N, COLS), "float32"),
                    A: T.Buffer((M, COLS), "float32"), B: T.Buffer((M, COLS), "float32")):
    """B = A * W[row[i]] on rows [i*ROWS, (i+1)*ROWS). Its prelude copies the weight row
    into shared memory before the task waits for A's rows."""
    T.device_entry()
    tx = T.thread_id([THREADS])
    w = T.alloc_shared((COLS,), "float32")
    r = T.local_scalar("int32")
    r = row[i]
    if tx < COLS // 4:
        T.ptx.cp.async_.cg.shared.global_(w.ptr_to([tx * 4]), W.ptr_to([r, tx * 4]), 16)
    T.ptx.cp.async_.commit_group()
    T.evaluate(await_inputs())
    T.ptx.cp.async_.wait_group(0)
    T.cuda.cta_sync()
    for q in T.serial(ROWS * COLS // THREADS):
        e = q * THREADS + tx
        B[i * ROWS + e // COLS, e % COLS] = A[i * ROWS + e // COLS, e % COLS] * w[e % COLS]


@weight_row_tile.set_reference
def _(i, row, W, A, B):
    rows = slice(i * ROWS, (i + 1) * ROWS)
    B[rows] = A[rows] * W[row[i]]


@device_func
def pick_row_tile(i: T.int32, pick: T.Buffer((P,), "int32"), row: T.Buffer((P,), "int32")):
    """row[i] = pick[P - 1 - i] (a tensor that weight_row_tile's prelude reads)."""
    T.device_entry()
    tx = T.thread_id([THREADS])
    if tx == 0:
        row[i] = pick[P - 1 - i]


@pick_row_tile.set_reference
def _(i, pick, row):
    row[i] = pick[len(pick) - 1 - i]
