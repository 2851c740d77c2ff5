"""The decode tiles without a GPU: NumPy references against float64, CUDA for sm_90a (and the
GEMV's 16-byte weight loads in its SASS), and RMSNorm -> GEMV -> SiLU-mul -> GEMV -> residual
add through the reference executor and as one static megakernel on symbolic M.

``test_decode_tiles_gpu`` holds the GPU results to the same bounds.
"""
from pathlib import Path

import numpy as np
import pytest

from etc_tvm import ETensor, EtcError, GraphError, Tensor, call_device, graph_func
from etc_tvm.build import build
from etc_tvm.executor import RandomOrder, execute
from etc_tvm.tiles import elementwise, gemm, gemv, norm

from cubin import build_cubin, sass
from decode_graphs import (BN, EPS, gemv_graph, residual_add_only, rmsnorm_only, silu_mul_only,
                           split_gemv_graph, tensor_core_gemm)
from test_tiles import BF16, assert_within, poisoned, randn, run_reference

ROWS = (1, 3, 16)


# ------------------------------------------------------------------ graphs
def decode_mlp(hidden: int, inter: int):
    """``y = x + down(silu(gate) * up)`` on ``rmsnorm(x)``, every intermediate returned too.

    Tile-level edges: every GEMV slab waits for all normalised rows; SiLU-mul block j waits for
    the two up-projection slabs it reads (gate j and up j: slab j of the F/bn counters is
    notified by slabs j and j + F/bn); the down GEMV needs every activation; residual block j
    waits for down slab j alone.
    """
    rmsnorm = norm.make_rmsnorm_tile(EPS)
    proj = gemv.make_gemv_tile(BN)
    silu_mul = elementwise.make_silu_mul_tile(BN)
    add = elementwise.make_residual_add_tile(BN)

    @graph_func
    def decode_mlp(x: Tensor(("M", hidden), "bfloat16"), w_norm: Tensor((hidden,), "bfloat16"),
                   w_up: Tensor((hidden, 2 * inter), "bfloat16"),
                   w_down: Tensor((inter, hidden), "bfloat16")):
        M = x.shape[0]
        rows_done = ETensor((1,), name="rows_done")
        up_ready = ETensor((inter // BN,), name="up_ready")
        act_done = ETensor((1,), name="act_done")
        down_ready = ETensor((hidden // BN,), name="down_ready")
        n = call_device(rmsnorm, tile_num=(M,), args=[x, w_norm],
                        out=Tensor((M, hidden), "bfloat16", name="n"),
                        out_edges={rows_done: "i->0"})
        h = call_device(proj, tile_num=(2 * inter // BN,), args=[n, w_up],
                        out=Tensor((M, 2 * inter), "bfloat16", name="h"),
                        in_edges={rows_done: "j->0"}, out_edges={up_ready: f"j->j % {inter // BN}"})
        a = call_device(silu_mul, tile_num=(inter // BN,), args=[h],
                        out=Tensor((M, inter), "bfloat16", name="a"),
                        in_edges={up_ready: "j->j"}, out_edges={act_done: "j->0"})
        d = call_device(proj, tile_num=(hidden // BN,), args=[a, w_down],
                        out=Tensor((M, hidden), "bfloat16", name="d"),
                        in_edges={act_done: "j->0"}, out_edges={down_ready: "j->j"})
        y = call_device(add, tile_num=(hidden // BN,), args=[x, d],
                        out=Tensor((M, hidden), "bfloat16", name="y"),
                        in_edges={down_ready: "j->j"})
        return n, h, a, d, y

    return decode_mlp


def decode_mlp_inputs(rng, M, hidden, inter):
    return (randn(rng, (M, hidden), "bfloat16"), randn(rng, (hidden,), "bfloat16"),
            (randn(rng, (hidden, 2 * inter)) / np.sqrt(hidden)).astype(BF16),
            (randn(rng, (inter, hidden)) / np.sqrt(inter)).astype(BF16))


def check_decode_mlp(inputs, outputs) -> None:
    """Each stage against float64 of its own (device-computed) inputs, within its bound."""
    x, w_norm, w_up, w_down = inputs
    n, h, a, d, y = outputs
    assert_within(n, norm.rmsnorm_float64(x, w_norm, EPS), norm.error_bound(x, w_norm, EPS))
    assert_within(h, n.astype(np.float64) @ w_up.astype(np.float64), gemv.error_bound(n, w_up))
    assert_within(a, elementwise.silu_mul_float64(h), elementwise.silu_mul_error_bound(h))
    assert_within(d, a.astype(np.float64) @ w_down.astype(np.float64),
                  gemv.error_bound(a, w_down))
    exact = x.astype(np.float64) + d.astype(np.float64)
    assert_within(y, exact, 2.0 ** -8 * np.abs(exact))


# ------------------------------------------------------------------ NumPy references vs float64
@pytest.mark.parametrize("M", ROWS)
def test_gemv_reference_is_within_its_bound(M, rng):
    K, N = 512, 3 * BN
    X, W, Y = randn(rng, (M, K), "bfloat16"), randn(rng, (K, N), "bfloat16"), \
        poisoned((M, N), "bfloat16")
    run_reference(gemv.gemv_tile, (N // BN,), X, W, Y)
    assert_within(Y, X.astype(np.float64) @ W.astype(np.float64), gemv.error_bound(X, W))


@pytest.mark.parametrize("M", ROWS)
def test_split_k_gemv_and_sum_are_within_the_gemv_bound(M, rng):
    K, N, S = 1024, 2 * BN, 4
    X, W = randn(rng, (M, K), "bfloat16"), randn(rng, (K, N), "bfloat16")
    Y = execute(split_gemv_graph(S), X, W)
    assert_within(Y, X.astype(np.float64) @ W.astype(np.float64), gemv.error_bound(X, W))


@pytest.mark.parametrize("S, batches", [(2, 3), (4, 6), (8, 11)])
def test_split_k_deals_uneven_slices_of_whole_double_batches(S, batches, rng):
    """K / k_step double batches that S does not divide (11008 rows are 86 of them): the
    slices differ by at most one batch, and together cover K once."""
    K, N = batches * gemv.k_step(BN), 2 * BN
    X, W = randn(rng, (3, K), "bfloat16"), randn(rng, (K, N), "bfloat16")
    Y = execute(split_gemv_graph(S), X, W)
    assert_within(Y, X.astype(np.float64) @ W.astype(np.float64), gemv.error_bound(X, W))


@pytest.mark.parametrize("engine, rows, bn", [("mma", 16, None), ("swapped", 8, None),
                                              ("swapped", 40, None), ("swapped", 24, 64)])
@pytest.mark.parametrize("S", [1, 4])
def test_tensor_core_gemms_over_k_slices_are_within_the_gemm_bound(engine, rows, bn, S, rng):
    """Row blocks on tensor cores, whole or over K slices summed in order, on the reference
    executor (two row blocks; a sum task adds the slices of one or two column blocks)."""
    K, N = 1024, 2 * BN
    X, W = randn(rng, (2 * rows, K), "bfloat16"), randn(rng, (K, N), "bfloat16")
    Y = execute(tensor_core_gemm(engine, S, rows, bn), X, W, order=RandomOrder(S))
    assert Y.dtype == BF16
    assert_within(Y, X.astype(np.float64) @ W.astype(np.float64),
                  gemm.error_bound(X, W, "bfloat16"))


@pytest.mark.parametrize("M, rows", [(1, 8), (3, 8), (13, 8), (17, 16)])
@pytest.mark.parametrize("S", [1, 4])
def test_swapped_gemm_takes_any_number_of_rows(M, rows, S, rng):
    """The swapped tile's last row block past M reads nothing and stores nothing: one tile
    of 8 rows serves M = 1 .. 8."""
    K, N = 512, 2 * BN
    X, W = randn(rng, (M, K), "bfloat16"), randn(rng, (K, N), "bfloat16")
    Y = execute(tensor_core_gemm("swapped", S, rows), X, W)
    assert Y.shape == (M, N)
    assert_within(Y, X.astype(np.float64) @ W.astype(np.float64),
                  gemm.error_bound(X, W, "bfloat16"))


@pytest.mark.parametrize("engine, M, K, N, message", [
    ("mma", 24, 512, 256, r"gemm_16x64x64_f32_s4_t128_k4 takes M a multiple of 16, got "
     r"A \(24, 512\), B \(512, 256\), P \(4, 24, 256\)"),
    ("swapped", 3, 500, 256, r"wgmma_gemm_16x128x32_f32_s6_t128_swapped_k4 takes K a multiple "
     r"of 128 \(split_k x bk\), got A \(3, 500\)"),
    ("swapped", 3, 512, 192, r"wgmma_gemm_16x128x32_f32_s6_t128_swapped_k4 takes N a multiple "
     r"of 128, got A \(3, 512\), B \(512, 192\)"),
])
def test_tensor_core_gemm_refuses_shapes_the_kernel_would_cut(engine, M, K, N, message, rng):
    """Rows, columns or K steps past whole blocks would be left out: the call is refused where
    its dims are known, on the reference executor as in a build."""
    X, W = randn(rng, (M, K), "bfloat16"), randn(rng, (K, N), "bfloat16")
    with pytest.raises(GraphError, match=rf"split_gemm: call \w+: {message}"):
        execute(tensor_core_gemm(engine, 4), X, W)
    with pytest.raises(GraphError, match=message):
        build(tensor_core_gemm(engine, 4), {"M": M, "K": K, "N": N}, strategy="unfused")


def test_tensor_core_gemm_rejects_what_it_cannot_run():
    with pytest.raises(ValueError, match="engine"):
        tensor_core_gemm("fma", 2)
    with pytest.raises(ValueError, match="divide"):
        tensor_core_gemm("swapped", 2, bn=256)
    with pytest.raises(EtcError, match="split_k"):
        tensor_core_gemm("swapped", 0)


def test_gemv_reference_rejects_what_the_tile_cannot_run(rng):
    W = randn(rng, (512, BN), "bfloat16")
    with pytest.raises(EtcError, match="1..16"):
        run_reference(gemv.gemv_tile, (1,), randn(rng, (17, 512), "bfloat16"), W,
                      poisoned((17, BN), "bfloat16"))
    with pytest.raises(EtcError, match="multiple of"):
        run_reference(gemv.gemv_tile, (1,), randn(rng, (2, 500), "bfloat16"),
                      randn(rng, (500, BN), "bfloat16"), poisoned((2, BN), "bfloat16"))
    step = gemv.k_step(BN)
    with pytest.raises(EtcError, match="at least 4 double batches"):
        run_reference(gemv.make_gemv_tile(split_k=4), (1, 4), randn(rng, (2, 3 * step),
                      "bfloat16"), randn(rng, (3 * step, BN), "bfloat16"),
                      poisoned((4, 2, BN), "float32"))


@pytest.mark.parametrize("M", ROWS)
def test_rmsnorm_reference_is_within_its_bound(M, rng):
    H = 1024
    X, w, Y = 3 * randn(rng, (M, H), "bfloat16"), randn(rng, (H,), "bfloat16"), \
        poisoned((M, H), "bfloat16")
    run_reference(norm.rmsnorm_tile, (M,), X, w, Y)
    assert_within(Y, norm.rmsnorm_float64(X, w, EPS), norm.error_bound(X, w, EPS))


@pytest.mark.parametrize("M", ROWS)
def test_silu_mul_reference_is_within_its_bound(M, rng):
    F = 2 * BN
    H = (4 * randn(rng, (M, 2 * F))).astype(BF16)
    Y = poisoned((M, F), "bfloat16")
    run_reference(elementwise.make_silu_mul_tile(BN), (F // BN,), H, Y)
    assert_within(Y, elementwise.silu_mul_float64(H), elementwise.silu_mul_error_bound(H))


@pytest.mark.parametrize("M", ROWS)
def test_residual_add_reference_is_within_its_bound(M, rng):
    A, B = randn(rng, (M, 3 * BN), "bfloat16"), randn(rng, (M, 3 * BN), "bfloat16")
    Y = poisoned(A.shape, "bfloat16")
    run_reference(elementwise.make_residual_add_tile(BN), (3,), A, B, Y)
    exact = A.astype(np.float64) + B.astype(np.float64)
    assert_within(Y, exact, 2.0 ** -8 * np.abs(exact))


@pytest.mark.parametrize("M", ROWS)
def test_decode_mlp_on_the_reference_executor_is_within_its_bounds(M, rng):
    inputs = decode_mlp_inputs(rng, M, 256, 384)
    check_decode_mlp(inputs, execute(decode_mlp(256, 384), *inputs))


def test_decode_mlp_result_does_not_depend_on_the_task_order(rng):
    graph, inputs = decode_mlp(256, 256), decode_mlp_inputs(rng, 3, 256, 256)
    first = execute(graph, *inputs)
    for seed in range(2):
        for got, want in zip(execute(graph, *inputs, order=RandomOrder(seed)), first):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("make, kwargs, message", [
    (gemv.make_gemv_tile, {"bn": 512}, "power of two"),
    (gemv.make_gemv_tile, {"bn": 96}, "power of two"),
    (gemv.make_gemv_tile, {"split_k": 0}, "split_k"),
    (gemv.make_gemv_tile, {"out_dtype": "float16"}, "out_dtype"),
    (norm.make_rmsnorm_tile, {"eps": 0.0}, "eps"),
    (elementwise.make_silu_mul_tile, {"cols": 12}, "multiple of 8"),
    (elementwise.make_residual_add_tile, {"threads": 100}, "whole warps"),
])
def test_factories_reject_configurations_they_cannot_run(make, kwargs, message):
    with pytest.raises(EtcError, match=message):
        make(**kwargs)


# ------------------------------------------------------------------ CUDA code for sm_90a
def cubin(source: str, tmp_path) -> Path:
    """``source`` built for sm_90a with no register spilled and no stack frame."""
    out, report = build_cubin(source, tmp_path)
    assert all(line.strip().startswith("0 bytes stack")
               for line in report.splitlines() if "bytes stack frame" in line), report
    return out


ONE_CALL = {  # name: (graph, dims)
    "gemv": (gemv_graph, {"M": 3, "K": 2048, "N": 1024}),
    "gemv_split_k4": (lambda: split_gemv_graph(4), {"M": 16, "K": 2048, "N": 512}),
    "mma_split_k4": (lambda: tensor_core_gemm("mma", 4), {"M": 16, "K": 2048, "N": 512}),
    "swapped_split_k4": (lambda: tensor_core_gemm("swapped", 4), {"M": 16, "K": 2048,
                                                                 "N": 512}),
    "swapped_64_rows": (lambda: tensor_core_gemm("swapped", 1, 64), {"M": 64, "K": 2048,
                                                                    "N": 512}),
    "swapped_64_columns_split_k4": (lambda: tensor_core_gemm("swapped", 4, 64, 64),
                                    {"M": 64, "K": 2048, "N": 512}),
    "swapped_one_row_split_k4": (lambda: tensor_core_gemm("swapped", 4, 8),
                                 {"M": 1, "K": 2048, "N": 512}),
    "rmsnorm": (lambda: rmsnorm_only, {"M": 3, "H": 2048}),
    "silu_mul": (lambda: silu_mul_only, {"M": 3, "F2": 2048}),
    "residual_add": (lambda: residual_add_only, {"M": 3, "N": 1024}),
}


@pytest.mark.parametrize("case", sorted(ONE_CALL))
def test_one_call_graph_compiles_for_sm90a(case, tmp_path):
    graph, dims = ONE_CALL[case]
    cubin(build(graph(), dims, strategy="unfused").cuda_source(), tmp_path)


@pytest.mark.parametrize("case", ["rmsnorm", "silu_mul", "residual_add"])
def test_bf16_vector_tiles_compile_on_symbolic_widths(case, tmp_path):
    """Built for samples, the row width too is a launch's size: the tiles' 16-byte copies
    stay one load or store each (a vectorized bf16x8 access became eight scalar ones, in a
    ``make_uint4`` nvcc refused)."""
    graph, dims = ONE_CALL[case]
    source = build(graph(), samples=[{**dims, "M": 16}], strategy="static").cuda_source()
    assert "make_uint4" not in source
    cubin(source, tmp_path)


def test_gemv_loads_weights_128_bits_at_a_time(tmp_path):
    """The weights arrive by LDG.128, in a megakernel on symbolic M (the R = 1 .. 16 codes in
    one kernel): the main loops of the four R <= 8 codes alone issue 2 * 8 each."""
    source = build(gemv_graph(), samples=[{"M": 16, "K": 2048, "N": 49152}],
                   strategy="static").cuda_source()
    wide = sass(cubin(source, tmp_path)).count("LDG.E.128")
    assert wide >= 4 * 2 * gemv.unroll_for(1), wide


def test_decode_mlp_is_one_static_megakernel_on_symbolic_m(tmp_path):
    """One kernel serves M = 1..16: the sample is M = 16, smaller batches skip the extra
    RMSNorm tasks and the GEMV masks the rows."""
    compiled = build(decode_mlp(2048, 1024), samples=[{"M": 16}], strategy="static")
    source = compiled.cuda_source()
    assert "decode_mlp_megakernel_0_kernel" in source
    cubin(source, tmp_path)
