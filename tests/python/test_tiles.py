"""The tile library without a GPU: NumPy references against float64, CUDA code for sm_90a, and
GEMM -> ReLU (bf16) -> GEMM -> row sum through the reference executor.

The float64 checks use each family's ``error_bound``, the numeric contract its module states;
``test_tiles_gpu`` holds the GPU results to the same bounds.
"""
import re

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import tirx

from etc_tvm import ETensor, EtcError, Tensor, call_device, graph_func
from etc_tvm.build import build
from etc_tvm.executor import RandomOrder, execute
from etc_tvm.tiles import elementwise, gemm, reduction
from etc_tvm.tir_sched.grid_kernel import build_grid_kernel
from etc_tvm.tir_sched.inline import shared_bytes
from etc_tvm.tir_sched.persistent import KernelOptions

from cubin import build_cubin

BF16 = ml_dtypes.bfloat16
SM90A = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm")
BLOCK = 64  # the row and column block of the default tiles
MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"

GEMMS = {  # make_gemm_tile configurations
    "64x64x32_f32": {"bm": 64, "bn": 64, "bk": 32},
    "64x64x32_bf16": {"bm": 64, "bn": 64, "bk": 32, "out_dtype": "bfloat16"},
    "64x64x64_bf16": {"bm": 64, "bn": 64, "bk": 64, "out_dtype": "bfloat16"},
    "128x64x32_f32_3stages": {"bm": 128, "bn": 64, "bk": 32, "stages": 3},
    "128x128x32_f32": {"bm": 128, "bn": 128, "bk": 32},
    "128x128x32_f32_256threads": {"bm": 128, "bn": 128, "bk": 32, "threads": 256},
    "128x128x64_f32": {"bm": 128, "bn": 128, "bk": 64},
    "16x32x64_f32_warps_split_k": {"bm": 16, "bn": 32, "bk": 64, "stages": 4},
    "16x16x64_bf16_warps_split_k": {"bm": 16, "bn": 16, "bk": 64, "out_dtype": "bfloat16"},
    # fewer A chunks a stage (128) than threads: the threads past them load none
    "16x32x64_f32_256threads_idle_loaders": {"bm": 16, "bn": 32, "bk": 64, "stages": 4,
                                             "threads": 256},
}
ACTIVATIONS = [(a, o) for a in ("relu", "gelu", "silu") for o in ("float32", "bfloat16")]


def randn(rng, shape, dtype="float32") -> np.ndarray:
    return rng.standard_normal(shape).astype(BF16 if dtype == "bfloat16" else dtype)


def run_reference(tile, grid, *arrays) -> None:
    """Every task of ``grid`` through ``tile``'s NumPy reference, in order."""
    for coords in np.ndindex(*grid):
        tile.reference(*coords, *arrays)


def poisoned(shape, dtype) -> np.ndarray:
    return np.full(shape, np.nan, BF16 if dtype == "bfloat16" else dtype)


def assert_within(got, want, bound) -> None:
    """``|got - want| <= bound`` elementwise (NaN fails), naming the worst element."""
    err = np.abs(np.asarray(got, np.float64) - want)
    ok = err <= bound
    if not ok.all():
        k = np.unravel_index(np.argmax(np.where(ok, -np.inf, err - bound)), err.shape)
        raise AssertionError(f"{np.count_nonzero(~ok)} of {err.size} elements out of bounds; "
                             f"at {k}: got {got[k]}, want {want[k]}, bound {bound[k]}")


# ------------------------------------------------------------------ NumPy references vs float64
@pytest.mark.parametrize("config", ["64x64x32_f32", "64x64x32_bf16", "128x128x32_f32"])
def test_gemm_reference_is_within_its_bound(config, rng):
    cfg = GEMMS[config]
    out = cfg.get("out_dtype", "float32")
    M, K, N = 2 * cfg["bm"], 320, 3 * cfg["bn"]
    A, B, C = randn(rng, (M, K), "bfloat16"), randn(rng, (K, N), "bfloat16"), poisoned((M, N), out)
    run_reference(gemm.make_gemm_tile(**cfg), (M // cfg["bm"], N // cfg["bn"]), A, B, C)
    want = A.astype(np.float64) @ B.astype(np.float64)
    assert C.dtype == (BF16 if out == "bfloat16" else np.float32)
    assert_within(C, want, gemm.error_bound(A, B, out))


@pytest.mark.parametrize("activation, out", ACTIVATIONS)
def test_activation_reference_is_within_its_bound(activation, out, rng):
    M, N = 2 * BLOCK, 3 * BLOCK
    X, Y = 4 * randn(rng, (M, N)), poisoned((M, N), out)
    run_reference(elementwise.make_activation_tile(activation, out), (2, 3), X, Y)
    want = elementwise.ACTIVATIONS[activation][1](X.astype(np.float64))
    assert_within(Y, want, elementwise.error_bound(X, activation, out))


def test_row_sums_are_within_their_bound(rng):
    M, N = 2 * BLOCK, 5 * BLOCK
    X, Y = randn(rng, (M, N)), poisoned((M,), "float32")
    run_reference(reduction.row_sum_tile, (2,), X, Y)
    assert_within(Y, X.astype(np.float64).sum(axis=1), reduction.error_bound(X))
    P = poisoned((M, 5), "float32")
    run_reference(reduction.partial_row_sum_tile, (2, 5), X, P)
    blocks = X.astype(np.float64).reshape(M, 5, BLOCK)
    assert_within(P, blocks.sum(axis=2), BLOCK * 2.0 ** -24 * np.abs(blocks).sum(axis=2))


def test_split_k_gemm_then_sum_is_within_the_gemm_bound(rng):
    """Partial products over 4 K slices, summed by the identity epilogue, equal the product."""
    M, N, K, S = 32, 192, 1024, 4
    A, B = randn(rng, (M, K), "bfloat16"), randn(rng, (K, N), "bfloat16")
    P, C = poisoned((S, M, N), "float32"), poisoned((M, N), "float32")
    run_reference(gemm.make_gemm_tile(bm=16, bn=64, bk=64, split_k=S), (M // 16, N // 64, S),
                  A, B, P)
    run_reference(elementwise.make_activation_tile("identity", "float32", rows=16, split_k=S),
                  (M // 16, N // 64), P, C)
    exact = A.astype(np.float64) @ B.astype(np.float64)
    partial_sums = S * 2.0 ** -24 * np.abs(P.astype(np.float64)).sum(axis=0)
    assert_within(C, exact, gemm.error_bound(A, B) + partial_sums)


# ------------------------------------------------------------------ CUDA code for sm_90a
def gemm_case(config, M=256, N=256, K=256):
    cfg = GEMMS[config]
    return (gemm.make_gemm_tile(**cfg), (M // cfg["bm"], N // cfg["bn"]),
            [("A", (M, K), "bfloat16"), ("B", (K, N), "bfloat16"),
             ("C", (M, N), cfg.get("out_dtype", "float32"))])


def activation_case(activation, out, M=128, N=192):
    return (elementwise.make_activation_tile(activation, out), (M // BLOCK, N // BLOCK),
            [("X", (M, N), "float32"), ("Y", (M, N), out)])


KERNEL_CASES = {
    **{f"gemm_{c}": (lambda c=c: gemm_case(c)) for c in GEMMS},
    **{f"{a}_{o}": (lambda a=a, o=o: activation_case(a, o)) for a, o in ACTIVATIONS},
    "row_sum": lambda: (reduction.row_sum_tile, (2,),
                        [("X", (128, 200), "float32"), ("Y", (128,), "float32")]),
    "partial_row_sum": lambda: (reduction.partial_row_sum_tile, (2, 3),
                                [("X", (128, 192), "float32"), ("P", (128, 3), "float32")]),
    "gemm_16x64x64_split_k4": lambda: (
        gemm.make_gemm_tile(bm=16, bn=64, bk=64, split_k=4), (2, 3, 4),
        [("A", (32, 1024), "bfloat16"), ("B", (1024, 192), "bfloat16"),
         ("P", (4, 32, 192), "float32")]),
    "relu_16x64_bf16_sum4": lambda: (
        elementwise.make_activation_tile("relu", "bfloat16", rows=16, split_k=4), (2, 3),
        [("P", (4, 32, 192), "float32"), ("Y", (32, 192), "bfloat16")]),
}


@pytest.mark.parametrize("case", sorted(KERNEL_CASES))
def test_tile_compiles_for_sm90a(case, tmp_path):
    tile, grid, params = KERNEL_CASES[case]()
    buffers = [tirx.decl_buffer(shape, dtype, name) for name, shape, dtype in params]
    name = f"{tile.name}_grid"
    kernel = build_grid_kernel(tile, grid, buffers, name)
    with SM90A:
        executable = tvm.compile(tvm.IRModule({name: kernel}), target=SM90A, tir_pipeline="tirx")
    source = executable.mod.imports[0].inspect_source("cuda")
    assert f"{name}_kernel" in source
    if case.startswith("gemm"):
        for instruction in (MMA, "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
                            "cp.async.cg.shared.global"):
            assert instruction in source
    build_cubin(source, tmp_path)


@pytest.mark.parametrize("config", sorted(GEMMS))
def test_gemm_shared_memory_fits_a_task(config):
    cfg = GEMMS[config]
    tile = gemm.make_gemm_tile(**cfg)
    assert shared_bytes(tile) == gemm.shared_bytes(
        cfg["bm"], cfg["bn"], cfg["bk"], cfg.get("stages", 2), cfg.get("threads", 128)) \
        <= gemm.SMEM_LIMIT
    assert tile.num_threads == cfg.get("threads", 128)


def test_gemm_ring_depth_is_bounded_by_one_ctas_arena_not_by_two():
    """An mma ring asked for may take what one persistent CTA an SM holds (a 16 x 96 tile of
    12 stages and its K-split partial sums, 195 KB), as a wgmma ring may; a stage more is
    refused, naming the bytes. The default ring stays within ``DEFAULT_RING_BYTES``."""
    assert gemm.shared_bytes(16, 96, 64, 12) == 12 * (16 * 72 + 64 * 104) * 2 \
        + 2 * 16 * 96 * 4 <= gemm.SMEM_LIMIT
    gemm.check_geometry(16, 96, 64, 128, 12)
    assert gemm.deepest_stages(16, 96, 64, most=16, limit=gemm.SMEM_LIMIT) == 12
    assert gemm.shared_bytes(16, 96, 64, gemm.deepest_stages(16, 96, 64)) \
        <= gemm.DEFAULT_RING_BYTES < gemm.shared_bytes(16, 96, 64, 6)
    over = gemm.shared_bytes(16, 96, 64, 13)
    with pytest.raises(EtcError, match=f"16x96x64 x13 stages needs {over} bytes of shared "
                                       f"memory, more than {gemm.SMEM_LIMIT}"):
        gemm.check_geometry(16, 96, 64, 128, 13)


@pytest.mark.parametrize("bm, bn, bk, warps, grid", [
    (64, 64, 32, 4, (2, 2, 1)), (16, 64, 64, 4, (1, 4, 1)), (128, 128, 32, 8, (2, 4, 1)),
    (16, 32, 64, 4, (1, 2, 2)), (16, 16, 64, 4, (1, 1, 4)), (16, 16, 32, 4, None)])
def test_warps_split_k_only_where_the_tile_is_too_small_for_them(bm, bn, bk, warps, grid):
    """(wm, wn, wk): a 16 x 32 tile on four warps splits each K slice's k16 steps over two
    warp groups; one of 16 x 16 over four, which a 32-deep slice cannot feed."""
    if grid is None:
        with pytest.raises(EtcError, match="cannot split it"):
            gemm.warp_grid(bm, bn, warps, bk)
    else:
        assert gemm.warp_grid(bm, bn, warps, bk) == grid


def test_default_tiles_share_one_thread_count():
    """One megakernel runs every task with one thread count."""
    tiles = [gemm.gemm_tile, gemm.gemm_bf16_tile, elementwise.relu_tile,
             elementwise.relu_bf16_tile, reduction.row_sum_tile, reduction.partial_row_sum_tile]
    assert {t.num_threads for t in tiles} == {128}


def test_a_configuration_is_one_device_function():
    assert gemm.make_gemm_tile() is gemm.gemm_tile
    assert elementwise.make_activation_tile("relu", "bfloat16") is elementwise.relu_bf16_tile


@pytest.mark.parametrize("make, kwargs, message", [
    (gemm.make_gemm_tile, {"bk": 24}, "bk a multiple of 16"),
    (gemm.make_gemm_tile, {"threads": 96, "bm": 16, "bn": 16}, "cannot split"),
    (gemm.make_gemm_tile, {"bm": 256, "bn": 128, "bk": 64, "stages": 4}, "more than"),
    (gemm.make_gemm_tile, {"out_dtype": "float16"}, "out_dtype"),
    (elementwise.make_activation_tile, {"activation": "tanh"}, "unknown activation"),
    (elementwise.make_activation_tile, {"cols": 6}, "divide"),
    (reduction.make_row_sum_tile, {"rows": 6}, "whole warps"),
    (reduction.make_partial_row_sum_tile, {"cols": 48}, "multiple of 32"),
])
def test_factories_reject_configurations_they_cannot_run(make, kwargs, message):
    with pytest.raises(EtcError, match=message):
        make(**kwargs)


# ------------------------------------------------------------------ GEMM -> ReLU -> GEMM -> sum
@graph_func
def mlp(X: Tensor(("M", "K"), "bfloat16"), W1: Tensor(("K", "N"), "bfloat16"),
        W2: Tensor(("N", "P"), "bfloat16")):
    """Y = relu(X @ W1) @ W2, bf16 between the GEMMs, and S = the row sums of Y.

    Tile-level edges: ReLU tile (i, j) waits for GEMM tile (i, j); a row block of the second
    GEMM waits for every ReLU tile of that row block (``"ij->i"`` counts N/64 of them); the row
    sum of block i waits for every tile of row block i of Y.
    """
    M, N, P = X.shape[0], W1.shape[1], W2.shape[1]
    c_tile = ETensor((M // BLOCK, N // BLOCK), name="c_tile")
    h_rows = ETensor((M // BLOCK,), name="h_rows")
    y_rows = ETensor((M // BLOCK,), name="y_rows")
    C = call_device(gemm.gemm_tile, tile_num=(M // BLOCK, N // BLOCK), args=[X, W1],
                    out=Tensor((M, N), "float32", name="C"), out_edges={c_tile: "ij->ij"})
    H = call_device(elementwise.relu_bf16_tile, tile_num=(M // BLOCK, N // BLOCK), args=[C],
                    out=Tensor((M, N), "bfloat16", name="H"), in_edges={c_tile: "ij->ij"},
                    out_edges={h_rows: "ij->i"})
    Y = call_device(gemm.gemm_tile, tile_num=(M // BLOCK, P // BLOCK), args=[H, W2],
                    out=Tensor((M, P), "float32", name="Y"), in_edges={h_rows: "ij->i"},
                    out_edges={y_rows: "ij->i"})
    S = call_device(reduction.row_sum_tile, tile_num=(M // BLOCK,), args=[Y],
                    out=Tensor((M,), "float32", name="S"), in_edges={y_rows: "i->i"})
    return Y, S


def mlp_inputs(rng, M, K, N, P):
    return (randn(rng, (M, K), "bfloat16"), randn(rng, (K, N), "bfloat16"),
            randn(rng, (N, P), "bfloat16"))


def mlp_float64(X, W1, W2):
    """(Y, S) of ``mlp`` in float64, with the bounds the tiles' contracts compose to.

    The device rounds relu(C) to bf16, so H is off by the first GEMM's error plus one bf16
    rounding; the second GEMM carries that through |W2| and adds its own, the sum likewise.
    """
    x, w1, w2 = (a.astype(np.float64) for a in (X, W1, W2))
    H = np.maximum(x @ w1, 0)
    bound_c = gemm.error_bound(X, W1)
    bound_h = bound_c * (1 + 2.0 ** -8) + 2.0 ** -8 * H
    Y = H @ w2
    bound_y = bound_h @ np.abs(w2) + w2.shape[0] * 2.0 ** -22 * ((H + bound_h) @ np.abs(w2))
    S = Y.sum(axis=1)
    bound_s = bound_y.sum(axis=1) + Y.shape[1] * 2.0 ** -24 * (np.abs(Y) + bound_y).sum(axis=1)
    return Y, S, bound_y, bound_s


def test_mlp_on_the_reference_executor_is_within_its_bound(rng):
    X, W1, W2 = mlp_inputs(rng, 128, 256, 192, 128)
    Y, S = execute(mlp, X, W1, W2)
    want_y, want_s, bound_y, bound_s = mlp_float64(X, W1, W2)
    assert_within(Y, want_y, bound_y)
    assert_within(S, want_s, bound_s)


def test_mlp_result_does_not_depend_on_the_task_order(rng):
    inputs = mlp_inputs(rng, 192, 128, 128, 64)
    first = execute(mlp, *inputs)
    for seed in range(3):
        for got, want in zip(execute(mlp, *inputs, order=RandomOrder(seed)), first):
            np.testing.assert_array_equal(got, want)


MLP_DIMS = {"M": 128, "K": 256, "N": 192, "P": 128}  # the megakernels compiled below


@pytest.mark.parametrize("strategy", ["static", "barrier"])
def test_mlp_megakernel_compiles_for_sm90a(strategy, tmp_path):
    """The tiles inline into one persistent kernel: warp ids remapped, shared memory in the
    kernel's arena."""
    compiled = build(mlp, MLP_DIMS, strategy=strategy)
    source = compiled.cuda_source()
    assert "mlp_megakernel_kernel" in source and MMA in source
    build_cubin(source, tmp_path)


@pytest.mark.parametrize("strategy", ["static", "barrier", "dynamic"])
def test_megakernel_bounds_its_registers_for_its_ctas_an_sm(strategy, tmp_path):
    """Three CTAs an SM, cooperatively launched, must be co-resident: the kernel asks ptxas
    for them, so that its registers stay within 65536 / (3 x 128)."""
    compiled = build(mlp, MLP_DIMS, strategy=strategy, options=KernelOptions(ctas_per_sm=3))
    source = compiled.cuda_source()
    assert re.search(r"__global__ void __launch_bounds__\(128, 3\) mlp_\w*megakernel_kernel",
                     source)
    _, report = build_cubin(source, tmp_path)
    assert max(int(n) for n in re.findall(r"Used (\d+) registers", report)) <= 65536 // 384
