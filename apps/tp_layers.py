"""The two halves of a tensor-parallel MLP as graph functions of world size W, on the wgmma
tiles of ``etc_tvm.tiles.tp`` (bf16, 128 x 128 tiles loaded by cp.async by default; the
keyword arguments pick the tile's shape, ring, threads, loads and stores):

    ag_gemm_layer   the up projection, column parallel: rank r holds row block r of the
                    activations A (M x H) and column block r of the weights (H x N); every rank
                    needs every row, so the rows are gathered while the GEMM runs.
        gather (W x M/bm)  --rows_ready "pi->p, rank"-->  ring_gemm (W x M/bm x N/bn)
        gather task (p, i) puts row tile i into rank p's ``gathered`` and notifies element
        (p, rank) there; ring GEMM step s takes source (rank + s) % W, own rows first.

    gemm_rs_layer   the down projection, row parallel: rank r holds columns K_r of A (M x K_r)
                    and rows K_r of the weights (K_r x N); the partial products are summed
                    over ranks and row block r kept.
        gemm_scatter (M/bm x N/bn)  --partial_ready "ij->ij", W notifies an element,
        sharded on rows-->  partial_sum (M/W/bm x N/bn) on the owner

Run ``python apps/tp_layers.py`` to check both on the CPU reference executor (W ranks
simulated); ``apps/bench_tp.py`` runs them on the GPUs under torchrun.
"""
import functools

import numpy as np

from etc_tvm import ETensor, Tensor, call_device, graph_func
from etc_tvm.tiles import tp


@functools.cache
def ag_gemm_layer(world_size: int, bm: int = 128, bn: int = 128, bk: int = 64,
                  stages: int = 4, threads: int = 128, loads: str = "cp.async",
                  stores: str = "fragments"):
    """``ag_gemm(A: M x K, B: K x N) -> C: W*M x N`` (all bf16) on each of W ranks."""
    W = world_size
    gather = tp.make_gather_rows_tile(bm, threads)
    ring = tp.make_ring_gemm_tile(bm, bn, bk, stages, threads, loads, stores)

    @graph_func(world_size=W)
    def ag_gemm(A: Tensor(("M", "K"), "bfloat16"), B: Tensor(("K", "N"), "bfloat16")):
        M, K, N = A.shape[0], A.shape[1], B.shape[1]
        rows_ready = ETensor((W, W), shard="S[0]", name="rows_ready")
        G = call_device(gather, tile_num=(W, M // bm), args=[A],
                        out=Tensor((W, M, K), "bfloat16", name="gathered", symmetric=True),
                        out_edges={rows_ready: "pi->p, rank"})
        return call_device(ring, tile_num=(W, M // bm, N // bn), args=[G, B],
                           out=Tensor((W * M, N), "bfloat16", name="C"),
                           in_edges={rows_ready.local_view(): "sij->0, (rank + s) % world_size"})

    return ag_gemm


@functools.cache
def gemm_rs_layer(world_size: int, bm: int = 128, bn: int = 128, bk: int = 64,
                  stages: int = 4, threads: int = 128, loads: str = "cp.async",
                  stores: str = "fragments"):
    """``gemm_rs(A: M x K_r, B: K_r x N) -> D: M/W x N`` (all bf16) on each of W ranks."""
    W = world_size
    gemm = tp.make_gemm_scatter_tile(bm, bn, bk, stages, threads, loads, stores)
    total = tp.make_partial_sum_tile(bm, bn, threads)

    @graph_func(world_size=W)
    def gemm_rs(A: Tensor(("M", "K"), "bfloat16"), B: Tensor(("K", "N"), "bfloat16")):
        M, N = A.shape[0], B.shape[1]
        partial_ready = ETensor((M // bm, N // bn), wait_count=W, shard="S[0]",
                                name="partial_ready")
        P = call_device(gemm, tile_num=(M // bm, N // bn), args=[A, B],
                        out=Tensor((W, M // W, N), "bfloat16", name="partials", symmetric=True),
                        out_edges={partial_ready: "ij->ij"})
        return call_device(total, tile_num=(M // W // bm, N // bn), args=[P],
                           out=Tensor((M // W, N), "bfloat16", name="D"),
                           in_edges={partial_ready.local_view(): "ij->ij"})

    return gemm_rs


def main() -> None:
    import ml_dtypes

    from etc_tvm.executor import RandomOrder, execute_ranks
    from etc_tvm.tiles import gemm

    bf16, rng, W = ml_dtypes.bfloat16, np.random.default_rng(0), 2
    M, K, N = 256, 128, 256
    A = rng.standard_normal((M, K * W)).astype(bf16)
    B = (rng.standard_normal((K * W, N)) / np.sqrt(K * W)).astype(bf16)
    slices = [(A[:, r * K:(r + 1) * K], B[r * K:(r + 1) * K]) for r in range(W)]
    outs = execute_ranks(gemm_rs_layer(W), [list(s) for s in slices], order=RandomOrder(0))
    exact = A.astype(np.float64) @ B.astype(np.float64)
    bound = tp.rs_error_bound(*zip(*slices))
    worst = max(float(np.max(np.abs(out.astype(np.float64) - exact[r * M // W:(r + 1) * M // W])
                             / bound[r * M // W:(r + 1) * M // W])) for r, out in enumerate(outs))
    print(f"GEMM + Reduce-Scatter, W={W}: max error / bound {worst:.3f}")
    rows = [A[r * M // W:(r + 1) * M // W, :K] for r in range(W)]
    cols = [np.ascontiguousarray(B[:K, r * N // W:(r + 1) * N // W]) for r in range(W)]
    outs = execute_ranks(ag_gemm_layer(W), [[a, b] for a, b in zip(rows, cols)],
                         order=RandomOrder(0))
    full = np.concatenate(rows)
    worst = max(float(np.max(np.abs(out.astype(np.float64) - full.astype(np.float64) @ cols[r])
                             / gemm.error_bound(full, cols[r], "bfloat16")))
                for r, out in enumerate(outs))
    print(f"All-Gather + GEMM, W={W}: max error / bound {worst:.3f}")


if __name__ == "__main__":
    main()
