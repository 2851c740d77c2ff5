"""The decode tiles on the GPU, against float64 NumPy within each tile's stated bound.

Each tile runs alone as a one-call graph (strategy "unfused") at decode shapes, and the decode
MLP (RMSNorm -> GEMV -> SiLU-mul -> GEMV -> residual add) runs as one static megakernel built
once for M = 16 and run at M = 1, 3 and 16, on fresh random inputs.
"""
import numpy as np
import pytest

from etc_tvm.build import build
from etc_tvm.tiles import elementwise, gemm, gemv, norm

from test_decode_tiles import BN, EPS, check_decode_mlp, decode_mlp, decode_mlp_inputs, \
    gemv_graph, residual_add_only, rmsnorm_only, silu_mul_only, split_gemv_graph, \
    tensor_core_gemm
from test_tiles import BF16, assert_within, randn

pytestmark = pytest.mark.gpu

ROWS = (1, 3, 16)


def weights(rng, K, N):
    return (randn(rng, (K, N)) / np.sqrt(K)).astype(BF16)


@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("K, N", [(2048, 2048), (2048, 49152), (4096, 4096)])
def test_gemv_tile(M, K, N, rng):
    compiled = build(gemv_graph(), {"M": M, "K": K, "N": N}, strategy="unfused")
    X, W = randn(rng, (M, K), "bfloat16"), weights(rng, K, N)
    Y = compiled(X, W)
    assert Y.shape == (M, N) and Y.dtype == BF16
    assert_within(Y, X.astype(np.float64) @ W.astype(np.float64), gemv.error_bound(X, W))


@pytest.mark.parametrize("strategy", ["unfused", "static"])
@pytest.mark.parametrize("M, K, N, S", [(1, 2048, 2048, 8), (16, 4096, 1024, 4),
                                        (1, 11008, 4096, 8)])  # 86 batches in 8 slices
def test_split_k_gemv_and_sum(strategy, M, K, N, S, rng):
    compiled = build(split_gemv_graph(S), {"M": M, "K": K, "N": N}, strategy=strategy)
    X, W = randn(rng, (M, K), "bfloat16"), weights(rng, K, N)
    assert_within(compiled(X, W), X.astype(np.float64) @ W.astype(np.float64),
                  gemv.error_bound(X, W))


@pytest.mark.parametrize("strategy", ["unfused", "static"])
@pytest.mark.parametrize("engine, rows, bn, M, K, N, S", [
    ("mma", 16, None, 16, 4096, 4096, 8), ("swapped", 16, None, 16, 4096, 4096, 16),
    ("swapped", 16, None, 16, 11008, 4096, 8), ("swapped", 16, None, 16, 4096, 22016, 2),
    ("swapped", 8, None, 8, 2048, 2048, 4), ("swapped", 64, None, 64, 2048, 4096, 1),
    ("swapped", 64, 64, 64, 4096, 4096, 4), ("swapped", 8, None, 1, 4096, 22016, 2),
    ("swapped", 8, None, 3, 11008, 4096, 8), ("swapped", 16, None, 13, 2048, 49152, 1)])
def test_tensor_core_gemm(strategy, engine, rows, bn, M, K, N, S, rng):
    """Few rows on tensor cores at decode shapes, against float64 (a swapped tile's rows past
    M idle); launched twice, the same bits (the slices are summed in order)."""
    compiled = build(tensor_core_gemm(engine, S, rows, bn), {"M": M, "K": K, "N": N},
                     strategy=strategy)
    X, W = randn(rng, (M, K), "bfloat16"), weights(rng, K, N)
    Y = compiled(X, W)
    assert_within(Y, X.astype(np.float64) @ W.astype(np.float64),
                  gemm.error_bound(X, W, "bfloat16"))
    np.testing.assert_array_equal(compiled(X, W), Y)


def test_gemv_serves_every_m_up_to_16_from_one_kernel(rng):
    """Built once for M = 16 (a static megakernel on symbolic shapes), run for each M."""
    K, N = 2048, 4096
    compiled = build(gemv_graph(), samples=[{"M": 16, "K": K, "N": N}], strategy="static")
    W = weights(rng, K, N)
    for M in range(1, 17):
        X = randn(rng, (M, K), "bfloat16")
        assert_within(compiled(X, W), X.astype(np.float64) @ W.astype(np.float64),
                      gemv.error_bound(X, W))


@pytest.mark.parametrize("engine", ["mma", "swapped"])
def test_tensor_core_gemm_on_symbolic_sizes_refuses_only_what_its_tile_cuts(engine, rng):
    """Built once for M up to 64: the mma tile's 16-row blocks refuse M = 40 at launch (rows
    32 .. 39 would go uncomputed), and the call after it runs; the swapped tile takes it."""
    K, N = 2048, 2048
    compiled = build(tensor_core_gemm(engine, 1), samples=[{"M": 64, "K": K, "N": N}],
                     strategy="static")
    W = weights(rng, K, N)
    for M in (48, 40, 32):
        X = randn(rng, (M, K), "bfloat16")
        if engine == "mma" and M == 40:
            with pytest.raises(ValueError, match=r"takes M a multiple of 16, which the sizes "
                                                 r"of A \(M, K\), B \(K, N\), C \(M, N\)"):
                compiled(X, W)
            continue
        assert_within(compiled(X, W), X.astype(np.float64) @ W.astype(np.float64),
                      gemm.error_bound(X, W, "bfloat16"))


@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("H", [2048, 4096])
def test_rmsnorm_tile(M, H, rng):
    compiled = build(rmsnorm_only, {"M": M, "H": H}, strategy="unfused")
    X, w = 3 * randn(rng, (M, H), "bfloat16"), randn(rng, (H,), "bfloat16")
    X = X.astype(BF16)
    assert_within(compiled(X, w), norm.rmsnorm_float64(X, w, EPS), norm.error_bound(X, w, EPS))


@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("F", [5632, 8192])
def test_silu_mul_tile(M, F, rng):
    compiled = build(silu_mul_only, {"M": M, "F2": 2 * F}, strategy="unfused")
    H = (4 * randn(rng, (M, 2 * F))).astype(BF16)
    assert_within(compiled(H), elementwise.silu_mul_float64(H),
                  elementwise.silu_mul_error_bound(H))


@pytest.mark.parametrize("M", ROWS)
def test_residual_add_tile(M, rng):
    compiled = build(residual_add_only, {"M": M, "N": 4096}, strategy="unfused")
    A, B = randn(rng, (M, 4096), "bfloat16"), randn(rng, (M, 4096), "bfloat16")
    exact = A.astype(np.float64) + B.astype(np.float64)
    assert_within(compiled(A, B), exact, 2.0 ** -8 * np.abs(exact))


@pytest.mark.parametrize("hidden, inter", [(2048, 5632), (4096, 1024)])
def test_decode_mlp_megakernel(hidden, inter, rng):
    """One static megakernel for M <= 16, run at each decode M; every intermediate checked
    against float64 of its inputs, and relaunches reproduce it bit for bit (fresh counters)."""
    assert inter % BN == 0 and hidden % BN == 0
    compiled = build(decode_mlp(hidden, inter), samples=[{"M": 16}], strategy="static")
    for M in ROWS:
        inputs = decode_mlp_inputs(rng, M, hidden, inter)
        outputs = compiled(*inputs)
        check_decode_mlp(inputs, outputs)
        again = compiled(*inputs)
        for got, want in zip(again, outputs):
            np.testing.assert_array_equal(got, want)
