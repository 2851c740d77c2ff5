"""The decode tiles as one-call graph functions (each tile alone: the GEMV, split-K GEMV with
its ordered sum, RMSNorm, SiLU-and-multiply, residual add), shared by the tests and
apps/bench_tiles.py."""
from etc_tvm import ETensor, Tensor, call_device, graph_func
from etc_tvm.tiles import elementwise, gemv, norm

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
