"""The wgmma GEMM tile on the GPU, against float64 NumPy within ``gemm.error_bound``.

Alone (strategy "unfused": one grid launch, one CTA per task), and as two dependent calls in
one persistent megakernel ("static"), where one CTA runs many tasks of the tile in sequence and
so reuses its shared ring; fresh random inputs at a few shapes, then 100 launches that must
give the same bits. Both ways of loading the stages: cp.async and TMA.
"""
import numpy as np
import pytest

from etc_tvm.build import build
from etc_tvm.tiles import wgmma_gemm

from test_tiles import assert_within, randn
from test_wgmma_gemm import CONFIGS, chain_float64, chain_graph, config, gemm_graph

pytestmark = pytest.mark.gpu

SHAPES = [(128, 64, 256), (256, 512, 512), (512, 1024, 768), (1024, 4096, 1024)]  # M, K, N


def shapes(name):
    """SHAPES the tile divides; a swapped tile's rows (a multiple of 8) often divide none of
    them, so it takes 3 and 17 row blocks of its own."""
    cfg = config(name)
    fits = [s for s in SHAPES if s[0] % cfg["bm"] == 0 and s[1] % cfg["bk"] == 0
            and s[2] % cfg["bn"] == 0]
    if cfg.get("swapped"):
        fits += [(3 * cfg["bm"], 256, 2 * cfg["bn"]), (17 * cfg["bm"], 2048, 4 * cfg["bn"])]
    return fits


CASES = [(name, s, loads) for name in sorted(CONFIGS) for s in shapes(name)
         for loads in wgmma_gemm.LOADS
         # TMA: whole 64-column panels, tiles that are not swapped
         if loads != "tma" or config(name)["bk"] % 64 == 0 and not config(name).get("swapped")]


def inputs(rng, M, K, N):
    return randn(rng, (M, K), "bfloat16"), randn(rng, (K, N), "bfloat16")


@pytest.mark.parametrize("name, shape, loads", CASES)
def test_unfused(name, shape, loads, rng):
    cfg, (M, K, N) = {**config(name), "loads": loads}, shape
    compiled = build(gemm_graph(cfg), {"M": M, "K": K, "N": N}, strategy="unfused")
    A, B = inputs(rng, M, K, N)
    C = compiled(A, B)
    assert C.shape == (M, N)
    assert C.dtype == (A.dtype if cfg["out_dtype"] == "bfloat16" else np.float32)
    assert_within(C, A.astype(np.float64) @ B.astype(np.float64),
                  wgmma_gemm.error_bound(A, B, cfg["out_dtype"]))


@pytest.mark.parametrize("M, K, N, P", [(128, 256, 256, 256), (512, 1024, 1024, 512),
                                        (2048, 512, 1024, 1024)])
@pytest.mark.parametrize("name", ["128x256x64_f32", "128x128x64_f32_t128"])
@pytest.mark.parametrize("loads", wgmma_gemm.LOADS)
def test_static_megakernel(name, loads, M, K, N, P, rng):
    """More tasks than SMs at the larger shapes: CTAs run several tasks back to back (with
    TMA: their mbarriers set up and invalidated in each task)."""
    cfg = {**config(name), "loads": loads}
    if M % cfg["bm"] or N % cfg["bn"] or P % cfg["bn"]:
        pytest.skip("shape is not a multiple of the tile")
    compiled = build(chain_graph(cfg), {"M": M, "K": K, "N": N, "P": P}, strategy="static")
    A, W1 = inputs(rng, M, K, N)
    W2 = randn(rng, (N, P), "bfloat16")
    want, bound = chain_float64(A, W1, W2)
    Y = compiled(A, W1, W2)
    assert_within(Y, want, bound)


@pytest.mark.parametrize("name", ["96x128x32_f32_t128_swapped", "72x128x32_bf16_t128_swapped"])
@pytest.mark.parametrize("strategy", ["static", "dynamic"])
def test_swapped_chain_megakernel(name, strategy, rng):
    """Swapped tiles in a megakernel: H = A @ W1 in bf16 tiles of 96 or 72 rows (both
    stores of the traded fragments), Y = H @ W2 waiting on H's row blocks."""
    cfg = config(name)
    M, K, N, P = 9 * cfg["bm"], 512, 2 * cfg["bn"], cfg["bn"]
    compiled = build(chain_graph(cfg), {"M": M, "K": K, "N": N, "P": P}, strategy=strategy)
    A, W1 = inputs(rng, M, K, N)
    W2 = randn(rng, (N, P), "bfloat16")
    want, bound = chain_float64(A, W1, W2)
    assert_within(compiled(A, W1, W2), want, bound)


def test_dynamic_megakernel_tma_chain(rng):
    """The second GEMM's TMA loads read what the first one's tasks stored in the same kernel,
    in the order the ready ring gives (the proxy fence before the loads)."""
    cfg = {**config("128x256x64_f32"), "loads": "tma"}
    M, K, N, P = 2048, 512, 1024, 1024
    compiled = build(chain_graph(cfg), {"M": M, "K": K, "N": N, "P": P}, strategy="dynamic")
    A, W1 = inputs(rng, M, K, N)
    W2 = randn(rng, (N, P), "bfloat16")
    want, bound = chain_float64(A, W1, W2)
    assert_within(compiled(A, W1, W2), want, bound)


@pytest.mark.parametrize("loads", wgmma_gemm.LOADS)
@pytest.mark.parametrize("strategy", ["unfused", "static"])
def test_repeated_launches_are_identical(strategy, loads, rng):
    """Per-launch state (counters, the ring, the accumulators, the mbarriers) starts afresh:
    100 runs, one result, bit for bit."""
    cfg = {**config("128x256x64_f32"), "loads": loads}
    M, K, N = 1024, 1024, 2048
    compiled = build(gemm_graph(cfg), {"M": M, "K": K, "N": N}, strategy=strategy)
    A, B = inputs(rng, M, K, N)
    first = compiled(A, B)
    assert_within(first, A.astype(np.float64) @ B.astype(np.float64),
                  wgmma_gemm.error_bound(A, B))
    for _ in range(100):
        np.testing.assert_array_equal(compiled(A, B), first)
