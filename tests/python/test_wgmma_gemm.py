"""The wgmma GEMM tile without a GPU: its NumPy reference against float64, its shared layout
against the descriptors' reading of it, and its machine code for sm_90a, alone and inside a
persistent megakernel (HGMMA in the SASS, no spill, no serialised wgmma).

``test_wgmma_gemm_gpu`` holds the GPU results to the same bound.
"""
import re

import numpy as np
import pytest

from etc_tvm import ETensor, EtcError, Tensor, call_device, graph_func
from etc_tvm.build import build
from etc_tvm.tiles import wgmma_gemm
from etc_tvm.tir_sched.inline import shared_bytes

from cubin import build_cubin, count, sass
from test_tiles import assert_within, poisoned, randn, run_reference

WGMMA = "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16"

CONFIGS = {  # make_wgmma_gemm_tile configurations
    "128x256x64_f32": {},
    "128x256x64_bf16_s3": {"stages": 3, "out_dtype": "bfloat16"},
    "128x128x64_f32_t128": {"bn": 128, "threads": 128},
    "128x128x128_bf16_t128": {"bn": 128, "bk": 128, "stages": 3, "threads": 128,
                              "out_dtype": "bfloat16"},
    "256x128x64_f32": {"bm": 256, "bn": 128},
    "64x64x64_f32_t128": {"bm": 64, "bn": 64, "threads": 128},
    "128x256x64_bf16_staged": {"out_dtype": "bfloat16", "stores": "staged"},
    "128x128x64_bf16_t128_staged": {"bn": 128, "threads": 128, "out_dtype": "bfloat16",
                                    "stores": "staged"},
    "64x256x32_bf16_t128": {"bm": 64, "bn": 256, "bk": 32, "stages": 5, "threads": 128,
                            "out_dtype": "bfloat16"},  # A in 64-byte swizzled rows
    # swapped: B's panels on the m64 side, the tile's rows the instruction's N
    "96x128x32_f32_t128_swapped": {"bm": 96, "bn": 128, "bk": 32, "stages": 6,
                                   "threads": 128, "swapped": True},
    "40x256x64_bf16_swapped": {"bm": 40, "bn": 256, "bk": 64, "stages": 3,
                               "out_dtype": "bfloat16", "swapped": True},
    # its A stages end 512 bytes past a swizzle atom (b_ring_offset)
    "72x128x32_bf16_t128_swapped": {"bm": 72, "bn": 128, "bk": 32, "stages": 5,
                                    "threads": 128, "out_dtype": "bfloat16",
                                    "swapped": True},
}


def config(name):
    """The full keyword arguments of a configuration, defaults filled in."""
    return {"bm": 128, "bn": 256, "bk": 64, "stages": 4, "threads": 256,
            "out_dtype": "float32", **CONFIGS[name]}


def gemm_graph(cfg):
    tile = wgmma_gemm.make_wgmma_gemm_tile(**cfg)

    @graph_func
    def wgmma_gemm_only(A: Tensor(("M", "K"), "bfloat16"), B: Tensor(("K", "N"), "bfloat16")):
        M, N = A.shape[0], B.shape[1]
        return call_device(tile, tile_num=(M // cfg["bm"], N // cfg["bn"]), args=[A, B],
                           out=Tensor((M, N), cfg["out_dtype"]))

    return wgmma_gemm_only


def chain_graph(cfg):
    """H = A @ W1 (bf16), Y = H @ W2 (fp32): a row block of Y waits for its row block of H."""
    first = wgmma_gemm.make_wgmma_gemm_tile(**{**cfg, "out_dtype": "bfloat16"})
    second = wgmma_gemm.make_wgmma_gemm_tile(**{**cfg, "out_dtype": "float32"})
    bm, bn = cfg["bm"], cfg["bn"]

    @graph_func
    def wgmma_chain(A: Tensor(("M", "K"), "bfloat16"), W1: Tensor(("K", "N"), "bfloat16"),
                    W2: Tensor(("N", "P"), "bfloat16")):
        M, N, P = A.shape[0], W1.shape[1], W2.shape[1]
        h_rows = ETensor((M // bm,), name="h_rows")
        H = call_device(first, tile_num=(M // bm, N // bn), args=[A, W1],
                        out=Tensor((M, N), "bfloat16", name="H"), out_edges={h_rows: "ij->i"})
        return call_device(second, tile_num=(M // bm, P // bn), args=[H, W2],
                           out=Tensor((M, P), "float32", name="Y"), in_edges={h_rows: "ij->i"})

    return wgmma_chain


def chain_float64(A, W1, W2):
    """(Y, bound) of ``chain_graph``: H carries the first GEMM's error and its bf16 rounding
    through |W2|; the second GEMM adds its own."""
    a, w1, w2 = (x.astype(np.float64) for x in (A, W1, W2))
    H = a @ w1
    bound_h = wgmma_gemm.error_bound(A, W1, "bfloat16")
    bound = bound_h @ np.abs(w2) + w2.shape[0] * 2.0 ** -22 * ((np.abs(H) + bound_h) @ np.abs(w2))
    return H @ w2, bound


# ------------------------------------------------------------------ NumPy reference vs float64
@pytest.mark.parametrize("name", ["128x256x64_f32", "128x256x64_bf16_s3", "64x64x64_f32_t128",
                                  "96x128x32_f32_t128_swapped"])
def test_reference_is_within_its_bound(name, rng):
    cfg = config(name)
    M, K, N = 2 * cfg["bm"], 3 * cfg["bk"], 2 * cfg["bn"]
    A, B = randn(rng, (M, K), "bfloat16"), randn(rng, (K, N), "bfloat16")
    C = poisoned((M, N), cfg["out_dtype"])
    run_reference(wgmma_gemm.make_wgmma_gemm_tile(**cfg), (2, 2), A, B, C)
    assert_within(C, A.astype(np.float64) @ B.astype(np.float64),
                  wgmma_gemm.error_bound(A, B, cfg["out_dtype"]))


# ------------------------------------------------------------------ layout vs descriptors
def swizzled_stage(X, rows, cols, row_elems=64):
    """The bytes ``load_stage`` writes for a ``rows x cols`` bf16 tile (as uint16): panels of
    ``row_elems`` columns (128-byte rows; A of 32-column slices: 64-byte rows), 16-byte chunk
    c of row r at chunk c ^ (byte address of the row >> 7) % (chunks a row)."""
    per_row = row_elems // 8
    out = np.zeros(rows * cols, np.uint16)
    for r in range(rows):
        for cc in range(cols // 8):
            panel, c = divmod(cc, per_row)
            dst = panel * rows * row_elems + r * row_elems \
                + (c ^ (r * row_elems * 2 >> 7) % per_row) * 8
            out[dst:dst + 8] = X[r, cc * 8:cc * 8 + 8]
    return out


def read_descriptor(smem, start, lbo, sbo, rows, cols, k_major, swizzle=128):
    """The ``rows x cols`` matrix a descriptor of the 128- or 64-byte swizzle names (element
    units, 1024-byte aligned base), per the canonical layouts, with W = swizzle / 2 elements
    a row: K-major ``((8, m), (W, 1)) : ((W, SBO), (1, -))``, MN-major ``((64, m), (8, k)) :
    ((1, LBO), (64, SBO))``; the swizzle XORs the 16-byte chunk bits of the byte address,
    [4:7) or [4:6), with bits [7:10) or [7:9)."""
    width, chunks = swizzle // 2, swizzle // 16
    out = np.zeros((rows, cols), np.uint16)
    for r in range(rows):
        for c in range(cols):
            if k_major:  # rows = M, cols = K (< W per instruction)
                off = start + r // 8 * sbo + r % 8 * width + c
            else:  # rows = K, cols = N
                off = start + c // 64 * lbo + r // 8 * sbo + r % 8 * 64 + c % 64
            byte = off * 2
            byte ^= (byte >> 7 & chunks - 1) << 4
            out[r, c] = smem[byte // 2]
    return out


@pytest.mark.parametrize("bm, bn, bk", [(128, 256, 64), (64, 128, 128), (64, 256, 32),
                                        (128, 128, 32)])
def test_descriptors_read_back_the_tile_the_loads_wrote(bm, bn, bk, rng):
    """Every (m64 block, k16 step) that a wgmma reads through the tile's descriptor fields is
    the matching block of A and of B (the layout model of the module docstring; A of 32-column
    slices in 64-byte swizzled rows)."""
    A = rng.integers(0, 2 ** 16, (bm, bk), dtype=np.uint16)
    B = rng.integers(0, 2 ** 16, (bk, bn), dtype=np.uint16)
    a_row = min(bk, 64)  # elements of one swizzled A row
    a_smem, b_smem = swizzled_stage(A, bm, bk, a_row), swizzled_stage(B, bk, bn)
    steps = a_row // 16  # k16 steps in one A row
    for kk in range(bk // 16):
        # element offsets, as ``SwizzledRing.a_desc`` / ``b_desc`` move the start address
        b_start = kk * 16 * 64
        got = read_descriptor(b_smem, b_start, lbo=bk * 64, sbo=512, rows=16, cols=bn,
                              k_major=False)
        np.testing.assert_array_equal(got, B[kk * 16:(kk + 1) * 16])
        for m in range(bm // 64):
            a_start = kk // steps * bm * a_row + m * 64 * a_row + kk % steps * 16
            got = read_descriptor(a_smem, a_start, lbo=None, sbo=8 * a_row, rows=64, cols=16,
                                  k_major=True, swizzle=2 * a_row)
            np.testing.assert_array_equal(got, A[m * 64:(m + 1) * 64, kk * 16:(kk + 1) * 16])


@pytest.mark.parametrize("bm, bn, bk", [(96, 128, 32), (40, 256, 64), (8, 64, 128)])
def test_swapped_descriptors_read_back_the_tile_the_loads_wrote(bm, bn, bk, rng):
    """Swapped, each of B's 64-column panels is an m64 operand read MN-major (the B
    descriptor from the panel on) and all bm rows of A one K-major operand of N = bm."""
    A = rng.integers(0, 2 ** 16, (bm, bk), dtype=np.uint16)
    B = rng.integers(0, 2 ** 16, (bk, bn), dtype=np.uint16)
    a_row = min(bk, 64)
    a_smem, b_smem = swizzled_stage(A, bm, bk, a_row), swizzled_stage(B, bk, bn)
    steps = a_row // 16
    for kk in range(bk // 16):
        for panel in range(bn // 64):
            got = read_descriptor(b_smem, kk * 16 * 64 + panel * bk * 64, lbo=bk * 64,
                                  sbo=512, rows=16, cols=64, k_major=False)
            np.testing.assert_array_equal(got, B[kk * 16:(kk + 1) * 16,
                                                 panel * 64:(panel + 1) * 64])
        got = read_descriptor(a_smem, kk // steps * bm * a_row + kk % steps * 16, lbo=None,
                              sbo=8 * a_row, rows=bm, cols=16, k_major=True, swizzle=2 * a_row)
        np.testing.assert_array_equal(got, A[:, kk * 16:(kk + 1) * 16])


@pytest.mark.parametrize("bm, bk, stages", [(72, 32, 5), (72, 32, 8), (40, 64, 3), (8, 32, 7),
                                            (64, 32, 5), (128, 64, 4)])
def test_b_stages_start_on_a_swizzle_atom(bm, bk, stages):
    """The B panels' 128-byte swizzle needs 1024-byte atoms: past A stages ending on 512 bytes
    (72 rows of 32-column slices, five stages), the B ring starts on the next atom; where
    they end on one, it starts right after them (the shared memory as before)."""
    start = wgmma_gemm.b_ring_offset(bm, bk, stages)
    assert start % 1024 == 0 and 0 <= start - stages * bm * bk * 2 < 1024
    assert wgmma_gemm.shared_bytes(bm, 128, bk, stages) == start + stages * bk * 128 * 2 + 1024


# ------------------------------------------------------------------ machine code for sm_90a
def sass_of(source: str, tmp_path) -> str:
    """The SASS of ``source`` built for sm_90a: no spill, no wgmma serialised by ptxas."""
    cubin, report = build_cubin(source, tmp_path)
    assert "serializ" not in report, report[-4000:]  # ptxas C7515 and kin
    return sass(cubin)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_unfused_kernel_runs_on_hgmma(name, tmp_path):
    cfg = config(name)
    M, K, N = 2 * cfg["bm"], 4 * cfg["bk"], 2 * cfg["bn"]
    compiled = build(gemm_graph(cfg), {"M": M, "K": K, "N": N}, strategy="unfused")
    source = compiled.cuda_source()
    swapped = cfg.get("swapped", False)
    n = cfg["bm"] if swapped else cfg["bn"]
    assert WGMMA.format(n=n) in source
    assert "fence.proxy.async.shared::cta" in source
    code = sass_of(source, tmp_path)
    hgmma = f"HGMMA.64x{n}x16.F32.BF16"
    # one per m64 block of a warpgroup and k16 step, per K step (the loop may be unrolled)
    blocks = cfg["bn"] if swapped else cfg["bm"]
    per_step = blocks // (cfg["threads"] // 128) // 64 * cfg["bk"] // 16
    assert count(code, hgmma) % per_step == 0 and count(code, hgmma) >= per_step, code
    # B read MN-major from shared memory: swapped, as the m64 operand
    assert ("tnspA" in code) == swapped and ("tnspB" in code) != swapped
    assert count(code, "LDGSTS.E.BYPASS.128") > 0
    assert count(code, "HMMA.16816.F32.BF16") == 0
    # staged: the tile leaves in 16-byte stores, a thread's share of whole rows
    staged = cfg["bm"] * cfg["bn"] // 8 // cfg["threads"]
    assert count(code, "STG.E.128") == (staged if cfg.get("stores") == "staged" else 0), code
    if swapped:
        # the swapped store trades one element a fragment pair with the lane four over: one
        # butterfly shuffle each, all lanes together (a diverged trade shows as WARPSYNC)
        trades = cfg["bn"] // 64 // (cfg["threads"] // 128) * cfg["bm"] // 8 * 2
        assert count(code, "SHFL.BFLY") == trades and count(code, "WARPSYNC") == 0, code


@pytest.mark.parametrize("name", ["128x256x64_f32", "128x128x64_f32_t128", "256x128x64_f32"])
@pytest.mark.parametrize("strategy", ["unfused", "static"])
def test_tma_loads_run_on_utmaldg_and_hgmma(name, strategy, tmp_path):
    """``loads="tma"``: one TMA load a panel (bk/64 of A, bn/64 of B a stage) through the
    maps the kernel encodes, no per-thread copies; the same wgmma main loop."""
    cfg = {**config(name), "loads": "tma"}
    M, K, N = 2 * cfg["bm"], 4 * cfg["bk"], 2 * cfg["bn"]
    compiled = build(gemm_graph(cfg), {"M": M, "K": K, "N": N}, strategy=strategy, num_sms=4)
    source = compiled.cuda_source()
    kernel = re.search(r"__global__ void[^;{]*\{", source).group(0)  # the definition
    assert kernel.count("const __grid_constant__ CUtensorMap") == 2  # A's and B's
    start = source.index("for (int ko")
    loop = source[start:source.index("wait_group_sync_aligned_0", start)]
    assert "cta_sync" not in loop  # stages hand over on mbarriers, not CTA barriers
    assert "mbarrier_arrive_arrive_shared_b64" in loop and "mbarrier_wait" in loop
    code = sass_of(source, tmp_path)
    assert count(code, "UTMALDG.2D") > 0
    assert count(code, "LDGSTS") == 0
    assert count(code, f"HGMMA.64x{cfg['bn']}x16.F32.BF16") > 0


def test_factory_rejects_unknown_loads():
    with pytest.raises(EtcError, match=r"loads must be one of \('cp.async', 'tma'\)"):
        wgmma_gemm.make_wgmma_gemm_tile(loads="ldg")


def test_megakernel_composes_two_wgmma_gemms(tmp_path):
    """Two calls, one waiting on row blocks of the other, in one persistent kernel: the tile's
    ring is a view of the kernel's arena, and its barriers stay CTA-wide."""
    cfg = config("128x256x64_f32")
    compiled = build(chain_graph(cfg), {"M": 256, "K": 256, "N": 512, "P": 256},
                     strategy="static")
    source = compiled.cuda_source()
    assert "wgmma_chain_megakernel_kernel" in source
    code = sass_of(source, tmp_path)
    assert count(code, "HGMMA.64x256x16.F32.BF16") >= 2 * 4, code


def test_tile_shared_memory_and_threads():
    for name in CONFIGS:
        cfg = config(name)
        tile = wgmma_gemm.make_wgmma_gemm_tile(**cfg)
        want = wgmma_gemm.shared_bytes(cfg["bm"], cfg["bn"], cfg["bk"], cfg["stages"])
        assert shared_bytes(tile) == want <= wgmma_gemm.SMEM_LIMIT
        assert tile.num_threads == cfg["threads"]
    assert wgmma_gemm.make_wgmma_gemm_tile() is wgmma_gemm.make_wgmma_gemm_tile(
        128, 256, 64, 4, 256, "float32")


@pytest.mark.parametrize("kwargs, message", [
    ({"bm": 96}, "bm must be a multiple of 64 per warpgroup"),
    ({"bm": 64}, "bm must be a multiple of 64 per warpgroup"),  # two warpgroups need 128
    ({"bn": 96}, "bn must be 64, 128, 192 or 256"),
    ({"bn": 320}, "bn must be 64, 128, 192 or 256"),
    ({"bk": 48}, "bk must be 32 .* or a multiple of 64"),
    ({"bk": 32, "loads": "tma"}, "TMA loads take slices of whole 64-column panels"),
    ({"stages": 2}, "stages must be >= 3"),
    ({"threads": 192}, "threads must be 128 or 256"),
    ({"threads": 128}, "accumulators per thread"),  # 128 x 256 on one warpgroup
    ({"stages": 5}, "more than"),
    ({"out_dtype": "float16"}, "out_dtype"),
    ({"stores": "rows"}, "stores must be one of"),
    ({"stores": "staged"}, "staged stores write bf16 tiles"),
    ({"bm": 36, "swapped": True}, "bm must be a multiple of 8 up to 256"),
    ({"bm": 264, "bn": 64, "threads": 128, "swapped": True}, "bm must be a multiple of 8"),
    ({"bm": 64, "bn": 192, "swapped": True}, "bn must be a multiple of 128"),
    ({"bm": 96, "bn": 256, "threads": 128, "swapped": True}, "accumulators per thread"),
    ({"bm": 64, "loads": "tma", "swapped": True}, "swapped tiles load by cp.async"),
    ({"bm": 64, "out_dtype": "bfloat16", "stores": "staged", "swapped": True},
     "staged stores write bf16 tiles of rows on the m64 side"),
])
def test_factory_rejects_shapes_it_cannot_run(kwargs, message):
    with pytest.raises(EtcError, match=message):
        wgmma_gemm.make_wgmma_gemm_tile(**kwargs)
