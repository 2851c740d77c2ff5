"""The decode tiles as one-call graph functions (each tile alone: the GEMV, split-K GEMV with
its ordered sum, the tensor-core GEMMs over row blocks, RMSNorm, SiLU-and-multiply, residual
add), shared by the tests and apps/bench_tiles.py."""
import functools

from etc_tvm import ETensor, Tensor, call_device, graph_func
from etc_tvm.tiles import elementwise, gemm, gemv, norm, wgmma_gemm

BN = 128  # GEMV slab, also the epilogues' column block
EPS = 1e-6


def gemv_graph(bn=BN):
    tile = gemv.make_gemv_tile(bn)

    @graph_func
    def gemv_only(X: Tensor(("M", "K"), "bfloat16"), W: Tensor(("K", "N"), "bfloat16")):
        return call_device(tile, tile_num=(W.shape[1] // bn,), args=[X, W],
                           out=Tensor((X.shape[0], W.shape[1]), "bfloat16"))

    return gemv_only


def split_gemv_graph(split_k, bn=BN):
    """GEMV over ``split_k`` K slices, then their sum: sum task j waits for the slices of
    slab j only."""
    partial = gemv.make_gemv_tile(bn, split_k=split_k)
    total = gemv.make_gemv_sum_tile(split_k, cols=bn)

    @graph_func
    def split_gemv(X: Tensor(("M", "K"), "bfloat16"), W: Tensor(("K", "N"), "bfloat16")):
        M, N = X.shape[0], W.shape[1]
        slices_done = ETensor((N // bn,), name="slices_done")
        P = call_device(partial, tile_num=(N // bn, split_k), args=[X, W],
                        out=Tensor((split_k, M, N), name="P"), out_edges={slices_done: "js->j"})
        return call_device(total, tile_num=(N // bn,), args=[P],
                           out=Tensor((M, N), "bfloat16"), in_edges={slices_done: "j->j"})

    return split_gemv


def tensor_core_gemm(engine: str, split_k: int, rows: int = 16, bn: int | None = None):
    """``rows``-row blocks of X @ W on tensor cores, for few rows: "mma" (the gemm tile, 64
    columns a task on ``mma.sync``, a 4-deep ring of 64-deep K slices; M a multiple of
    ``rows``) or "swapped" (the wgmma tile with the weights on the instruction's m64 side
    and the rows its N, 128 columns a task, a 6-deep ring of 32-deep slices: a quarter of an
    SM's shared memory; any M, the last block's rows past it idle).
    With ``split_k`` > 1 the tasks write partial products over K slices, and the GEMV's
    ordered sum adds them, each sum task waiting for the slices of its ``BN`` columns."""
    if engine == "mma":
        bn = bn or 64
        make = functools.partial(gemm.make_gemm_tile, bm=rows, bn=bn, bk=64, threads=128,
                                 stages=4)
    elif engine == "swapped":
        bn = bn or 128
        make = functools.partial(wgmma_gemm.make_wgmma_gemm_tile, bm=rows, bn=bn, bk=32,
                                 stages=6, threads=128, swapped=True)
    else:
        raise ValueError(f"engine must be 'mma' or 'swapped', got {engine!r}")

    def blocks(M):
        return M // rows if engine == "mma" else (M + rows - 1) // rows

    if split_k == 1:
        tile = make(out_dtype="bfloat16")

        @graph_func
        def gemm_only(X: Tensor(("M", "K"), "bfloat16"), W: Tensor(("K", "N"), "bfloat16")):
            M, N = X.shape[0], W.shape[1]
            return call_device(tile, tile_num=(blocks(M), N // bn), args=[X, W],
                               out=Tensor((M, N), "bfloat16"))

        return gemm_only
    if BN % bn:
        raise ValueError(f"bn={bn} must divide the sum's {BN} columns")
    partial = make(split_k=split_k)
    total = gemv.make_gemv_sum_tile(split_k, cols=BN)

    @graph_func
    def split_gemm(X: Tensor(("M", "K"), "bfloat16"), W: Tensor(("K", "N"), "bfloat16")):
        M, N = X.shape[0], W.shape[1]
        done = ETensor((N // BN,), name="slices_done")
        P = call_device(partial, tile_num=(blocks(M), N // bn, split_k), args=[X, W],
                        out=Tensor((split_k, M, N), name="P"),
                        out_edges={done: f"ijs->j // {BN // bn}"})
        return call_device(total, tile_num=(N // BN,), args=[P], out=Tensor((M, N), "bfloat16"),
                           in_edges={done: "j->j"})

    return split_gemm


@graph_func
def rmsnorm_only(X: Tensor(("M", "H"), "bfloat16"), w: Tensor(("H",), "bfloat16")):
    return call_device(norm.make_rmsnorm_tile(EPS), tile_num=(X.shape[0],), args=[X, w],
                       out=Tensor(X.shape, "bfloat16"))


@graph_func
def silu_mul_only(H: Tensor(("M", "F2"), "bfloat16")):
    M, F = H.shape[0], H.shape[1] // 2
    return call_device(elementwise.make_silu_mul_tile(BN), tile_num=(F // BN,), args=[H],
                       out=Tensor((M, F), "bfloat16"))


@graph_func
def residual_add_only(A: Tensor(("M", "N"), "bfloat16"), B: Tensor(("M", "N"), "bfloat16")):
    return call_device(elementwise.make_residual_add_tile(BN), tile_num=(A.shape[1] // BN,),
                       args=[A, B], out=Tensor(A.shape, "bfloat16"))
