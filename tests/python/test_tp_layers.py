"""The tensor-parallel MLP layers on the wgmma tiles (apps/tp_layers.py): every rank's result on
the CPU reference executor against float64 within the tiles' bounds, for several world sizes
and task orders; and each rank's kernel built for sm_90a with NVSHMEM (no GPU)."""

import re

import ml_dtypes
import numpy as np
import pytest

from etc_tvm import distributed
from etc_tvm.errors import EtcError
from etc_tvm.executor import DynamicQueueOrder, RandomOrder, ReadyQueueOrder, execute_ranks
from etc_tvm.tiles import gemm, tp

from test_moe_tiles import _load_app
from test_tiles import assert_within

tp_layers = _load_app("tp_layers")
BF16 = ml_dtypes.bfloat16
TILE = 128
# named, so that every test process collects the same ids (pytest-xdist)
ORDERS = [pytest.param(ReadyQueueOrder(), id="ready"),
          pytest.param(RandomOrder(0), id="random-0"), pytest.param(RandomOrder(1), id="random-1"),
          pytest.param(DynamicQueueOrder(2, rank_local=True),  # the ranks' own dynamic kernels
                       id="dynamic-rank-local")]


def draw(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(BF16)


@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("order", ORDERS)
def test_gemm_reduce_scatter_rows_match_float64(W, order, rng):
    M, K, N = W * TILE, 64, 2 * TILE  # K: this rank's slice
    A, B = draw(rng, (M, K * W)), draw(rng, (K * W, N), 1 / np.sqrt(K * W))
    slices = [(A[:, r * K:(r + 1) * K], B[r * K:(r + 1) * K]) for r in range(W)]
    exact = A.astype(np.float64) @ B.astype(np.float64)
    bound = tp.rs_error_bound(*zip(*slices))
    rows = M // W
    for r, D in enumerate(execute_ranks(tp_layers.gemm_rs_layer(W), [list(s) for s in slices],
                                        order=order)):
        assert D.shape == (rows, N) and D.dtype == BF16
        assert_within(D, exact[r * rows:(r + 1) * rows], bound[r * rows:(r + 1) * rows])


@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("order", ORDERS)
def test_all_gather_gemm_columns_match_float64(W, order, rng):
    M, K, N = TILE, 128, W * TILE  # M: this rank's rows
    A, B = draw(rng, (M * W, K)), draw(rng, (K, N), 1 / np.sqrt(K))
    cols = N // W
    inputs = [[A[r * M:(r + 1) * M], np.ascontiguousarray(B[:, r * cols:(r + 1) * cols])]
              for r in range(W)]
    for r, C in enumerate(execute_ranks(tp_layers.ag_gemm_layer(W), inputs, order=order)):
        b = inputs[r][1]
        assert C.shape == (M * W, cols)
        assert_within(C, A.astype(np.float64) @ b.astype(np.float64),
                      gemm.error_bound(A, b, "bfloat16"))


@pytest.mark.parametrize("layer, dims, peer, strategy, loads, stores", [
    ("gemm_rs_layer", {"M": 2 * TILE, "K": 64, "N": TILE}, "etc_peer(partials_ptr", "static",
     "cp.async", "fragments"),
    ("gemm_rs_layer", {"M": 2 * TILE, "K": 64, "N": TILE}, "etc_peer(partials_ptr", "dynamic",
     "cp.async", "fragments"),
    ("ag_gemm_layer", {"M": TILE, "K": 64, "N": TILE}, "etc_peer(gathered_ptr", "static",
     "cp.async", "fragments"),
    ("gemm_rs_layer", {"M": 2 * TILE, "K": 64, "N": TILE}, "etc_peer(partials_ptr", "static",
     "tma", "fragments"),
    ("ag_gemm_layer", {"M": TILE, "K": 64, "N": TILE}, "etc_peer(gathered_ptr", "static",
     "tma", "fragments"),
    ("gemm_rs_layer", {"M": 2 * TILE, "K": 64, "N": TILE}, "etc_peer(partials_ptr", "static",
     "tma", "staged"),
    ("ag_gemm_layer", {"M": TILE, "K": 64, "N": TILE}, "etc_peer(gathered_ptr", "static",
     "tma", "staged")])
def test_rank_kernels_compile_with_wgmma_and_peer_stores(layer, dims, peer, strategy, loads,
                                                          stores, nvshmem_home):
    program = distributed.build_rank(getattr(tp_layers, layer)(2, loads=loads, stores=stores),
                                     dims, 1, strategy=strategy, num_sms=4)
    kernel = program.executable.mod.imports[0].inspect_source("cuda")
    # staged: the GEMM tiles' output (a peer's partials, or this rank's C) in 16-byte stores
    out = "partials_peer" if layer == "gemm_rs_layer" else "C_ptr"
    assert (f"*(uint4*)({out} + " in kernel) == (stores == "staged")
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16" in kernel
    assert peer in kernel
    # TMA: the A (or gathered) and B maps, encoded by the rank kernel's host part
    signature = re.search(r"__global__ void[^;{]*\{", kernel).group(0)  # the definition
    assert signature.count("const __grid_constant__ CUtensorMap") == (2 if loads == "tma" else 0)
    assert ("cp_async_bulk_tensor" in kernel) == (loads == "tma")
    assert "etc_rank" not in kernel and "etc_world_size" not in kernel


@pytest.mark.parametrize("factory, name", [(tp.make_gemm_scatter_tile, "gemm_scatter"),
                                           (tp.make_ring_gemm_tile, "ring_gemm")])
def test_gemm_tiles_refuse_unknown_loads(factory, name):
    with pytest.raises(EtcError, match=rf"{name} tile: loads must be one of "
                                       r"\('cp.async', 'tma'\), got 'ldg'"):
        factory(loads="ldg")


def test_partial_sum_tile_rejects_vectors_that_do_not_divide():
    with pytest.raises(EtcError, match="8-element vectors must divide among 128 threads"):
        tp.make_partial_sum_tile(8, 8)
