"""A tile that loads through a tensor map: task i copies rows 64i..64i+63 of A (R, 64) bf16 to
B, the rows landing in shared memory by one TMA load (``cp.async.bulk.tensor``) that an
mbarrier counts in. The barrier is set up and invalidated within the task, so the shared
bytes are plain memory again for the next task of the kernel."""
import numpy as np
from tvm import tirx
from tvm.script import tirx as T

from etc_tvm import Tensor, call_device, device_func, graph_func
from etc_tvm.tensor_map import TensorMap

ROWS, COLS = 64, 64
ALIGN = 128  # bytes
A_MAP = TensorMap("A", box=(ROWS, COLS))
# cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes
LOAD = T.ptx["cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"]
R = tirx.Var("R", "int32")


@T.prim_func(check_well_formed=False)  # A_MAP.var is free until a kernel encodes the map
def tma_rows_func(i: T.int32, A: T.Buffer((R, COLS), "bfloat16"),
                  B: T.Buffer((R, COLS), "bfloat16")):
    T.device_entry()
    tx = T.thread_id([128])
    # a TMA destination is 128-byte aligned; the kernels' shared memory promises 64 bytes
    rows = T.alloc_shared((ROWS * COLS + ALIGN // 2,), "bfloat16")
    base = T.local_scalar("int32")
    base = T.Cast("int32", (T.uint32(ALIGN) - (T.cuda.cvta_generic_to_shared(rows.ptr_to([0]))
                                               & T.uint32(ALIGN - 1))) & T.uint32(ALIGN - 1)) // 2
    bar = T.alloc_shared((1,), "uint64")
    if tx == 0:
        T.ptx.mbarrier.init.shared.b64(bar.ptr_to([0]), T.uint32(1))
    T.cuda.cta_sync()
    if tx == 0:
        T.ptx.mbarrier.arrive.expect_tx.shared.b64(bar.ptr_to([0]), T.uint32(ROWS * COLS * 2))
        T.evaluate(LOAD(T.cuda.cvta_generic_to_shared(rows.ptr_to([base])),
                        T.address_of(A_MAP.var), 0, i * ROWS,
                        T.cuda.cvta_generic_to_shared(bar.ptr_to([0]))))
    T.cuda.mbarrier_wait(bar.ptr_to([0]), 0)
    for k in T.serial(ROWS * COLS // 128):
        B[i * ROWS + (k * 128 + tx) // COLS, (k * 128 + tx) % COLS] = rows[base + k * 128 + tx]
    T.cuda.cta_sync()
    if tx == 0:
        T.ptx.mbarrier.inval.shared.b64(bar.ptr_to([0]))


tma_rows = device_func(tma_rows_func.with_attr("global_symbol", "tma_rows"),
                       tensor_maps=[A_MAP])


@tma_rows.set_reference
def _(i, A, B):
    B[i * ROWS:(i + 1) * ROWS] = A[i * ROWS:(i + 1) * ROWS]


@graph_func
def tma_copy(A: Tensor(("R", COLS), "bfloat16")):
    return call_device(tma_rows, tile_num=(A.shape[0] // ROWS,), args=[A],
                       out=Tensor((A.shape[0], COLS), "bfloat16"))


def random_rows(rng, rows: int) -> np.ndarray:
    import ml_dtypes

    return rng.standard_normal((rows, COLS)).astype(ml_dtypes.bfloat16)
