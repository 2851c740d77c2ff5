"""The tile library on the GPU, against float64 NumPy within each family's stated bound.

Each tile runs alone as a one-call graph function (strategy "unfused": one grid launch), and
GEMM -> ReLU (bf16) -> GEMM -> row sum runs as one persistent megakernel ("static" and
"barrier"), on fresh random inputs at a few shapes.
"""
import numpy as np
import pytest

from etc_tvm import ETensor, Tensor, call_device, graph_func
from etc_tvm.build import build
from etc_tvm.tiles import elementwise, gemm, reduction

from test_tiles import ACTIVATIONS, BLOCK, GEMMS, assert_within, mlp, mlp_float64, mlp_inputs, \
    randn

pytestmark = pytest.mark.gpu

GEMM_SHAPES = [(64, 128, 64), (128, 512, 128), (256, 1024, 256), (256, 384, 192)]  # M, K, N
GEMM_CASES = [(c, s) for c in sorted(GEMMS) for s in GEMM_SHAPES
              if s[0] % GEMMS[c]["bm"] == 0 and s[2] % GEMMS[c]["bn"] == 0]


def gemm_graph(cfg):
    tile, out = gemm.make_gemm_tile(**cfg), cfg.get("out_dtype", "float32")

    @graph_func
    def gemm_only(A: Tensor(("M", "K"), "bfloat16"), B: Tensor(("K", "N"), "bfloat16")):
        M, N = A.shape[0], B.shape[1]
        return call_device(tile, tile_num=(M // cfg["bm"], N // cfg["bn"]), args=[A, B],
                           out=Tensor((M, N), out))

    return gemm_only


def activation_graph(activation, out):
    tile = elementwise.make_activation_tile(activation, out)

    @graph_func
    def activation_only(X: Tensor(("M", "N"))):
        M, N = X.shape
        return call_device(tile, tile_num=(M // BLOCK, N // BLOCK), args=[X],
                           out=Tensor((M, N), out))

    return activation_only


@graph_func
def row_sum_only(X: Tensor(("M", "N"))):
    return call_device(reduction.row_sum_tile, tile_num=(X.shape[0] // BLOCK,), args=[X],
                       out=Tensor((X.shape[0],)))


@graph_func
def partial_row_sum_only(X: Tensor(("M", "N"))):
    M, N = X.shape
    return call_device(reduction.partial_row_sum_tile, tile_num=(M // BLOCK, N // BLOCK),
                       args=[X], out=Tensor((M, N // BLOCK)))


@pytest.mark.parametrize("config, shape", GEMM_CASES)
def test_gemm_tile(config, shape, rng):
    M, K, N = shape
    out = GEMMS[config].get("out_dtype", "float32")
    compiled = build(gemm_graph(GEMMS[config]), {"M": M, "K": K, "N": N}, strategy="unfused")
    A, B = randn(rng, (M, K), "bfloat16"), randn(rng, (K, N), "bfloat16")
    C = compiled(A, B)
    assert C.shape == (M, N) and C.dtype == (A.dtype if out == "bfloat16" else np.float32)
    assert_within(C, A.astype(np.float64) @ B.astype(np.float64), gemm.error_bound(A, B, out))


@pytest.mark.parametrize("activation, out", ACTIVATIONS)
@pytest.mark.parametrize("M, N", [(64, 64), (256, 448)])
def test_activation_tile(activation, out, M, N, rng):
    compiled = build(activation_graph(activation, out), {"M": M, "N": N}, strategy="unfused")
    X = 4 * randn(rng, (M, N))
    want = elementwise.ACTIVATIONS[activation][1](X.astype(np.float64))
    assert_within(compiled(X), want, elementwise.error_bound(X, activation, out))


@pytest.mark.parametrize("M, N", [(64, 64), (128, 1000), (256, 4096)])
def test_row_sum_tile(M, N, rng):
    compiled = build(row_sum_only, {"M": M, "N": N}, strategy="unfused")
    X = randn(rng, (M, N))
    assert_within(compiled(X), X.astype(np.float64).sum(axis=1), reduction.error_bound(X))


@pytest.mark.parametrize("M, N", [(64, 64), (256, 1024)])
def test_partial_row_sum_tile(M, N, rng):
    compiled = build(partial_row_sum_only, {"M": M, "N": N}, strategy="unfused")
    X = randn(rng, (M, N))
    blocks = X.astype(np.float64).reshape(M, N // BLOCK, BLOCK)
    assert_within(compiled(X), blocks.sum(axis=2),
                  BLOCK * 2.0 ** -24 * np.abs(blocks).sum(axis=2))


@pytest.mark.parametrize("strategy", ["static", "barrier"])
@pytest.mark.parametrize("M, K, N, P", [(64, 128, 64, 64), (256, 512, 384, 256),
                                        (1024, 1024, 512, 256)])
def test_mlp_megakernel(strategy, M, K, N, P, rng):
    compiled = build(mlp, {"M": M, "K": K, "N": N, "P": P}, strategy=strategy)
    X, W1, W2 = mlp_inputs(rng, M, K, N, P)
    want_y, want_s, bound_y, bound_s = mlp_float64(X, W1, W2)
    Y, S = compiled(X, W1, W2)
    assert_within(Y, want_y, bound_y)
    assert_within(S, want_s, bound_s)
    for _ in range(2):  # the event counters start afresh on every launch
        again = compiled(X, W1, W2)
        np.testing.assert_array_equal(again[0], Y)
        np.testing.assert_array_equal(again[1], S)


def split_k_graph(S):
    partial = gemm.make_gemm_tile(bm=16, bn=64, bk=64, split_k=S)
    total = elementwise.make_activation_tile("identity", "float32", rows=16, split_k=S)

    @graph_func
    def split_k_gemm(A: Tensor(("M", "K"), "bfloat16"), B: Tensor(("K", "N"), "bfloat16")):
        M, N = A.shape[0], B.shape[1]
        done = ETensor((M // 16, N // 64), name="slices_done")
        P = call_device(partial, tile_num=(M // 16, N // 64, S), args=[A, B],
                        out=Tensor((S, M, N)), out_edges={done: "ijs->ij"})
        return call_device(total, tile_num=(M // 16, N // 64), args=[P], out=Tensor((M, N)),
                           in_edges={done: "ij->ij"})

    return split_k_gemm


@pytest.mark.parametrize("strategy", ["unfused", "static"])
@pytest.mark.parametrize("M, K, N, S", [(16, 2048, 2048, 8), (64, 1024, 192, 4)])
def test_split_k_gemm_and_sum(strategy, M, K, N, S, rng):
    compiled = build(split_k_graph(S), {"M": M, "K": K, "N": N}, strategy=strategy)
    A, B = randn(rng, (M, K), "bfloat16"), randn(rng, (K, N), "bfloat16")
    exact = A.astype(np.float64) @ B.astype(np.float64)
    slices = np.stack([A[:, s * K // S:(s + 1) * K // S].astype(np.float64)
                       @ B[s * K // S:(s + 1) * K // S].astype(np.float64) for s in range(S)])
    bound = gemm.error_bound(A, B) + S * 2.0 ** -24 * np.abs(slices).sum(axis=0)
    assert_within(compiled(A, B), exact, bound)
