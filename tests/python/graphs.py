"""Graph functions shared by the tests, built from the tiles in ``tiles``."""
from etc_tvm import ETensor, Tensor, call_device, graph_func

from tiles import (COLS, TILE, ROWS, double_tile, gather_tile, matmul_tile, mix_tile,
                   partial_rowsum_tile, pick_row_tile, reduce_scatter_tile, rowsum_tile,
                   scale_tile, weight_row_tile)


@graph_func
def gemm_reduce_scatter(A: Tensor(("M", "K")), B: Tensor(("K", "N"))):
    """The seed's GEMM + Reduce-Scatter with world size 1: tile-level pipelined."""
    M, N = A.shape[0], B.shape[1]
    E = ETensor((M // TILE, N // TILE), wait_count=1, shard="S[0]", name="E")
    C = call_device(matmul_tile, tile_num=(M // TILE, N // TILE), args=[A, B],
                    out=Tensor((M, N), name="C"), out_edges={E: "ij->ij"})
    return call_device(reduce_scatter_tile, tile_num=(M // TILE, N // TILE), args=[C],
                       out=Tensor((M, N), name="D"), in_edges={E.local_view(): "ij->ij"})


@graph_func
def row_sum(X: Tensor(("M", "N"))):
    """Fan-in: row tile i of the result waits for all N/TILE partial sums of its rows."""
    M, N = X.shape
    done = ETensor((M // TILE,), name="partials_done")
    S = call_device(partial_rowsum_tile, tile_num=(M // TILE, N // TILE), args=[X],
                    out=Tensor((M, N // TILE), name="S"), out_edges={done: "ij->i"})
    return call_device(rowsum_tile, tile_num=(M // TILE,), args=[S], out=Tensor((M,), name="Y"),
                       in_edges={done: "i->i"})


@graph_func
def row_sum_after_all(X: Tensor(("M", "N"))):
    """Fan-in over whole calls: every row tile of the result waits for all the partial sums
    (one element that all of them notify)."""
    M, N = X.shape
    done = ETensor((1,), name="partials_done")
    S = call_device(partial_rowsum_tile, tile_num=(M // TILE, N // TILE), args=[X],
                    out=Tensor((M, N // TILE), name="S"), out_edges={done: "ij->0"})
    return call_device(rowsum_tile, tile_num=(M // TILE,), args=[S], out=Tensor((M,), name="Y"),
                       in_edges={done: "i->0"})


@graph_func
def two_ops(X: Tensor(("M", COLS)), Y: Tensor(("M", COLS))):
    """scale then mix, row tile i of mix waiting on row tile i of scale."""
    M = X.shape[0]
    ready = ETensor((M // ROWS,), name="ready")
    A = call_device(scale_tile, tile_num=(M // ROWS,), args=[X], out=Tensor((M, COLS), name="A"),
                    out_edges={ready: "i->i"})
    return call_device(mix_tile, tile_num=(M // ROWS,), args=[A, Y],
                       out=Tensor((M, COLS), name="B"), in_edges={ready: "i->i"})


@graph_func
def two_ops_ring_mix(X: Tensor(("M", COLS)), Y: Tensor(("M", COLS))):
    """``two_ops`` with mix through the ready ring under the mixed strategy: each mix tile
    has one producer, the queued scale tile of its rows."""
    M = X.shape[0]
    ready = ETensor((M // ROWS,), name="ready")
    A = call_device(scale_tile, tile_num=(M // ROWS,), args=[X], out=Tensor((M, COLS), name="A"),
                    out_edges={ready: "i->i"})
    return call_device(mix_tile, tile_num=(M // ROWS,), args=[A, Y],
                       out=Tensor((M, COLS), name="B"), in_edges={ready: "i->i"},
                       schedule="dynamic")


@graph_func
def gathers(slot: Tensor((4,), "int32"), A: Tensor((8,), "float32")):
    """Two calls of a tile that checks its slots, the first call of the graph among them."""
    B = call_device(gather_tile, tile_num=(1,), args=[slot, A],
                    out=Tensor((4,), "float32", name="B"))
    doubled = ETensor((1,), name="doubled")
    C = call_device(double_tile, tile_num=(1,), args=[A],
                    out=Tensor((8,), "float32", name="C"), out_edges={doubled: "i->0"})
    return call_device(gather_tile, tile_num=(1,), args=[slot, C],
                       out=Tensor((4,), "float32", name="D"),
                       in_edges={doubled: "i->0"}), B


@graph_func
def doubled_gather(slot: Tensor((4,), "int32"), A: Tensor((8,), "float32")):
    """A tile that does not check its inputs, then one that checks its slots."""
    doubled = ETensor((1,), name="doubled")
    C = call_device(double_tile, tile_num=(1,), args=[A],
                    out=Tensor((8,), "float32", name="C"), out_edges={doubled: "i->0"})
    return call_device(gather_tile, tile_num=(1,), args=[slot, C],
                       out=Tensor((4,), "float32", name="D"), in_edges={doubled: "i->0"})


@graph_func
def backward_chain(X: Tensor(("M", COLS))):
    """Row tile i waits on tile i + 1 (up to tile 3): a valid graph whose tasks' ids are not
    a topological order."""
    M = X.shape[0]
    E = ETensor((M // ROWS,), name="E")
    return call_device(scale_tile, tile_num=(M // ROWS,), args=[X], out=Tensor((M, COLS)),
                       in_edges={E: "i->i+1 if i < 3"}, out_edges={E: "i->i"})


@graph_func
def weighted_rows(X: Tensor(("M", COLS)), W: Tensor(("N", COLS)),
                  pick: Tensor(("P",), "int32")):
    """Row tile i of scale, times the weight row that a first call picks for it: the
    weighting task copies its row (its prelude, once the picks are complete) before it waits
    for its tile of scale."""
    M = X.shape[0]
    ready = ETensor((M // ROWS,), name="ready")
    row = call_device(pick_row_tile, tile_num=(M // ROWS,), args=[pick],
                      out=Tensor((pick.shape[0],), "int32", name="row"))
    A = call_device(scale_tile, tile_num=(M // ROWS,), args=[X], out=Tensor((M, COLS), name="A"),
                    out_edges={ready: "i->i"})
    return call_device(weight_row_tile, tile_num=(M // ROWS,), args=[row, W, A],
                       out=Tensor((M, COLS), name="B"), in_edges={ready: "i->i"})
