"""The MoE and RoPE tiles on the GPU at Qwen3-30B-A3B sizes: each tile alone (one grid
launch) and the whole layer as one megakernel (static, dynamic, mixed) or as one grid launch
per call (unfused: the grouped GEMM tiles no trigger releases skipped), on fresh random
routings, against a PyTorch float64 reference within the bounds the tiles state; and the
layer at other models' shapes (``moe_layer.MODELS``)."""
import numpy as np
import pytest
import tvm

from etc_tvm import ExecutionError
from etc_tvm.build import build
from etc_tvm.tiles import moe, rope
from etc_tvm.tir_sched.persistent import KernelOptions

from moe_tile_graphs import (counted_align_graph, one_call_dims, one_call_graphs,
                             routed_tiles_graph)
from test_moe_tiles import (BF16, _load_app, gaussian_routing_inputs, logits_picking, misplace,
                             routed)
from test_tiles import assert_within

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
moe_layer = _load_app("moe_layer")
H, E, K, F, BT = 2048, 128, 8, 768, 16
TOKENS = (1, 16, 128)
STRATEGIES = ("static", "dynamic", "mixed", "unfused")
_compiled = {}


def compiled(name, tokens):
    key = (name, tokens)
    if key not in _compiled:
        graph = one_call_graphs(H, E, K, F)[name]
        _compiled[key] = build(graph, one_call_dims(name, tokens), strategy="unfused")
    return _compiled[key]


@pytest.fixture(scope="module")
def expert_weights():
    """One draw of the 604 M bf16 expert weights for the module: drawing them takes seconds,
    the activations and routings are drawn fresh for every launch."""
    return moe_layer.make_expert_weights(np.random.default_rng(7), H, E, F)


def on_gpu(a):
    """A NumPy array as a torch tensor on the GPU, bf16 as ``torch.bfloat16``."""
    a = np.asarray(a)
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16)).cuda().view(torch.bfloat16)
    return torch.from_numpy(a).cuda()


def f64(a):
    """float64 on the GPU (bf16 arrays converted there)."""
    return on_gpu(a).double()


@pytest.fixture(scope="module")
def expert_weights_gpu(expert_weights):
    """(w_gate, w_up, w_down) in bf16 on the GPU, moved once for the module. The float64
    reference widens one expert's at a time: all of them in float64 are 4.8 GB a pytest
    worker, 77 GB for the 16 workers of ``-n auto`` on 16 cores, nearly all of an H100."""
    w_gate_up, w_down = expert_weights
    return (*(on_gpu(w) for w in moe.split_gate_up(w_gate_up)), on_gpu(w_down))


@pytest.mark.parametrize("name", ("router", "router_mma"))
@pytest.mark.parametrize("tokens", TOKENS)
def test_router_tile(tokens, name, rng):
    x, w = gaussian_routing_inputs(rng, tokens, H, E, K)
    topk, topw = compiled(name, tokens)(x, w)
    want_k, want_w = moe.route(x, w, K)
    np.testing.assert_array_equal(topk, want_k)
    assert_within(topw, want_w, moe.router_weight_bound(x, w, want_w))


@pytest.mark.parametrize("tokens", (1, 37))
def test_topk_tile_breaks_ties_by_lower_index_as_numpy(tokens, rng):
    """Two partial logits whose sums tie exactly, +0 and -0 among the ties at the K-th place:
    the picks are NumPy's stable sort's, the weights its softmax over them."""
    first = rng.choice(np.array([-1.0, 0.0, -0.0, 0.5], np.float32), (tokens, E),
                       p=[0.55, 0.21, 0.21, 0.03])
    second = rng.choice(np.array([0.0, -0.0], np.float32), (tokens, E))
    logits = np.stack([first, second])
    topk, topw = compiled("topk", tokens)(logits)
    want_k, want_w = moe.top_k_of(logits[0] + logits[1], K)
    np.testing.assert_array_equal(topk, want_k)
    np.testing.assert_allclose(topw, want_w, rtol=1e-6)


@pytest.mark.parametrize("routing", moe_layer.ROUTINGS)
@pytest.mark.parametrize("tokens", TOKENS + (3, 4096))  # 3: 24 threads with pairs
def test_align_tile(tokens, routing, rng):
    topk = routed(rng, tokens, routing, E, K)
    tiles = moe.max_tiles(tokens, E, K, BT)
    got = compiled("align", tokens)(topk)
    for g, w in zip(got, moe.align_reference(topk, E, BT, tiles)[:2]):
        np.testing.assert_array_equal(g, w)
    counts, indptr, pair_row, pair_tile, sorted_token, tile_expert = got
    want = moe.align_reference(topk, E, BT, tiles)
    np.testing.assert_array_equal(pair_row, want[2])
    np.testing.assert_array_equal(pair_tile, want[2] // BT)
    np.testing.assert_array_equal(sorted_token, want[3])
    np.testing.assert_array_equal(tile_expert, want[4])


@pytest.mark.parametrize("experts", (E, 30))  # 30: threads without an expert
@pytest.mark.parametrize("routing", moe_layer.ROUTINGS)
@pytest.mark.parametrize("tokens", (1, 2, 4))
def test_tile_from_logits(tokens, routing, experts, rng):
    """Each tile's expert and the tokens of its rows as a routed gate_up task finds them
    from the router's two partial logits (``moe.tile_from_logits``): align's tile_expert and
    sorted_token of the same picks."""
    key = ("routed_tiles", experts, tokens)
    if key not in _compiled:
        _compiled[key] = build(routed_tiles_graph(experts, K), {"T": tokens},
                               strategy="unfused")
    topk = routed(rng, tokens, routing, experts, K)
    first = logits_picking(topk, experts, rng)[0]
    tile_expert, sorted_token = _compiled[key](np.stack([first, np.zeros_like(first)]))
    _, _, _, want_tokens, want_experts = moe.align_reference(
        topk, experts, BT, moe.max_tiles(tokens, experts, K, BT))
    np.testing.assert_array_equal(tile_expert, want_experts)
    np.testing.assert_array_equal(sorted_token, want_tokens)


@pytest.mark.parametrize("routing", moe_layer.ROUTINGS)
@pytest.mark.parametrize("tokens", TOKENS + (3, 100, 4096))  # 100: a partial last chunk
def test_align_over_chunks(tokens, routing, rng):
    """Count, offsets and place, each a grid launch: every output as one align task's."""
    topk = routed(rng, tokens, routing, E, K)
    want = moe.align_reference(topk, E, BT, moe.max_tiles(tokens, E, K, BT))
    counts, indptr, pair_row, pair_tile, sorted_token, tile_expert = \
        compiled("align_chunked", tokens)(topk)
    for got, exact in zip((counts, indptr, pair_row, pair_tile, sorted_token, tile_expert),
                          (*want[:3], want[2] // BT, *want[3:])):
        np.testing.assert_array_equal(got, exact)


@pytest.mark.parametrize("routing", moe_layer.ROUTINGS)
@pytest.mark.parametrize("tokens", TOKENS + (3, 100, 4096))
def test_align_over_chunks_with_place_offsets(tokens, routing, rng):
    """Count, then place tasks that sum the counts themselves: one align task's outputs."""
    topk = routed(rng, tokens, routing, E, K)
    want = moe.align_reference(topk, E, BT, moe.max_tiles(tokens, E, K, BT))
    pair_row, pair_tile, sorted_token, exp_indptr, tile_expert = \
        compiled("align_rows", tokens)(topk)
    for got, exact in zip((exp_indptr, pair_row, pair_tile, sorted_token, tile_expert),
                          (*want[1:3], want[2] // BT, *want[3:])):
        np.testing.assert_array_equal(got, exact)


@pytest.mark.parametrize("routing", moe_layer.ROUTINGS)
@pytest.mark.parametrize("tokens", TOKENS + (3, 100, 4096))
def test_topk_counts_then_align_rows(tokens, routing, rng):
    """Top-k tasks that count their picks per expert, then place tasks that sum those rows:
    the picks, each block's counts, and one align task's outputs."""
    check_counted_align(compiled("topk_align", tokens), tokens, routing, E, rng)


@pytest.mark.parametrize("experts", (30, 600))  # one expert a load; more columns than threads
@pytest.mark.parametrize("tokens", (100, 1000))
def test_topk_counts_then_align_rows_for_other_expert_counts(experts, tokens, rng):
    run = build(counted_align_graph(experts, K), {"T": tokens}, strategy="unfused")
    for routing in moe_layer.ROUTINGS:
        check_counted_align(run, tokens, routing, experts, rng)


def check_counted_align(run, tokens, routing, experts, rng, block_tokens=8):
    topk = routed(rng, tokens, routing, experts, K)
    logits = logits_picking(topk, experts, rng)
    want = moe.align_reference(topk, experts, BT, moe.max_tiles(tokens, experts, K, BT))
    picks, block_counts, pair_row, pair_tile, sorted_token, exp_indptr, tile_expert = \
        run(logits)
    np.testing.assert_array_equal(picks, topk)
    np.testing.assert_array_equal(block_counts, [
        np.bincount(topk[b:b + block_tokens].ravel(), minlength=experts)
        for b in range(0, tokens, block_tokens)])
    for got, exact in zip((exp_indptr, pair_row, pair_tile, sorted_token, tile_expert),
                          (*want[1:3], want[2] // BT, *want[3:])):
        np.testing.assert_array_equal(got, exact)


@pytest.mark.parametrize("strategy", ["static", "dynamic", "unfused"])
@pytest.mark.parametrize("name, bad", [("align", E), ("align_chunked", -2)])
def test_align_stops_at_an_expert_id_outside_the_experts(name, bad, strategy, rng):
    """An expert id outside 0..E-1 is an error that names the align task that found it and
    the value, and the kernel ends (no out-of-range shared memory write, no hang); then a good
    routing runs on the same library (its stop record fresh)."""
    run = build(one_call_graphs(H, E, K, F)[name], one_call_dims(name, 100), strategy=strategy)
    topk = routed(rng, 100, "random", E, K)
    topk[41, 2] = bad
    with pytest.raises(ExecutionError, match=rf"task align\w*\(\d+\) on SM \d+: topk holds the "
                                             rf"expert id {bad}, outside 0\.\.{E - 1}"):
        run(topk)
    topk[41, 2] = 0
    np.testing.assert_array_equal(run(topk)[0], moe.align_reference(
        topk, E, BT, moe.max_tiles(100, E, K, BT))[0])


@pytest.mark.parametrize("strategy", ["static", "dynamic", "unfused"])
@pytest.mark.parametrize("tile, fault", [("gate_up", "hole"), ("gate_up", "token"),
                                         ("down", "hole")])
def test_grouped_gemms_stop_at_a_pair_after_padding_or_a_token_past_x(tile, fault, strategy,
                                                                      rng, expert_weights):
    """A pair after a padding row of its tile (which the tile would leave unstored) and, in
    gate_up, a token past x's rows (which it would gather) are errors that name the task and
    the row, and the kernel ends (no read outside x, no hang); then a good routing runs on
    the same library."""
    tokens = 100
    x, _ = moe_layer.make_routing_inputs(rng, tokens, H, E)
    w_gate_up, w_down = expert_weights
    tiles = moe.max_tiles(tokens, E, K, BT)
    _, indptr, pair_row, sorted_token, tile_expert = moe.align_reference(
        routed(rng, tokens, "random", E, K), E, BT, tiles)
    bad = sorted_token.copy()
    row = misplace(bad, BT, fault, tokens)
    g = row // BT
    why = (rf"sorted_token\[{row}\] holds a pair after a padding row \(-1\) of its tile"
           if fault == "hole" else rf"sorted_token holds the token {tokens + 5}, past x's rows")
    run = build(one_call_graphs(H, E, K, F)[tile], one_call_dims(tile, tokens),
                strategy=strategy)
    a, w = (x, w_gate_up) if tile == "gate_up" else (
        compiled("gate_up", tokens)(x, w_gate_up, sorted_token, tile_expert, indptr), w_down)
    with pytest.raises(ExecutionError, match=rf"task {tile}\w*\({g},\d+\) on SM \d+: {why}"):
        run(a, w, bad, tile_expert, indptr)
    rows = pair_row.ravel()
    np.testing.assert_array_equal(
        run(a, w, sorted_token, tile_expert, indptr)[rows],
        compiled(tile, tokens)(a, w, sorted_token, tile_expert, indptr)[rows])


@pytest.mark.parametrize("tokens", TOKENS)
def test_grouped_gemms_and_combine(tokens, rng, expert_weights):
    x, _ = moe_layer.make_routing_inputs(rng, tokens, H, E)
    w_gate_up, w_down = expert_weights
    topk = routed(rng, tokens, "random", E, K)
    tiles = moe.max_tiles(tokens, E, K, BT)
    _, indptr, pair_row, sorted_token, tile_expert = moe.align_reference(topk, E, BT, tiles)
    h = compiled("gate_up", tokens)(x, w_gate_up, sorted_token, tile_expert, indptr)
    w_gate, w_up = moe.split_gate_up(w_gate_up)
    rows, experts, tok = pair_row.ravel(), topk.ravel(), np.repeat(np.arange(tokens), K)
    for e in np.unique(experts):
        mine = experts == e
        assert_within(h[rows[mine]], *moe.gate_up_reference(x[tok[mine]], w_gate[e], w_up[e]))
    y = compiled("down", tokens)(h, w_down, sorted_token, tile_expert, indptr)
    hr, wd = h[rows].astype(np.float64), w_down[experts].astype(np.float64)
    assert_within(y[rows], np.einsum("pf,pfh->ph", hr, wd),
                  F * 2.0 ** -22 * np.einsum("pf,pfh->ph", np.abs(hr), np.abs(wd)))
    topw = rng.dirichlet(np.ones(K), tokens).astype(np.float32)
    out = compiled("combine", tokens)(topw, pair_row, pair_row // BT, y)
    ys = y[pair_row]
    assert_within(out, np.einsum("tk,tkh->th", topw.astype(np.float64), ys.astype(np.float64)),
                  moe.combine_bound(topw, ys))


@pytest.mark.parametrize("tokens", TOKENS)
def test_qk_norm_rope_tile(tokens, rng):
    q = (3 * rng.standard_normal((tokens, 32 * 128))).astype(BF16)
    k = rng.standard_normal((tokens, 4 * 128)).astype(BF16)
    qw = (1 + 0.1 * rng.standard_normal(128)).astype(BF16)
    kw = (1 + 0.1 * rng.standard_normal(128)).astype(BF16)
    positions = rng.integers(0, 200_000, tokens).astype(np.int32)
    q_out, k_out = compiled("qk_norm_rope", tokens)(q, k, qw, kw, positions)
    for got, x, w, heads in ((q_out, q, qw, 32), (k_out, k, kw, 4)):
        want = rope.qk_norm_rope_exact(x, w, positions, heads, 128)[0]
        assert_within(got, want, rope.error_bound(x, w, positions, heads, 128))


_layers = {}


@pytest.mark.parametrize("routing", moe_layer.ROUTINGS)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_layer_megakernel(strategy, tokens, routing, rng, expert_weights, expert_weights_gpu):
    key = (strategy, tokens)
    if key not in _layers:
        _layers[key] = build(moe_layer.make_moe_layer(), {"T": tokens}, strategy=strategy)
    for _ in range(3):  # fresh routings through one compiled kernel
        check_layer(_layers[key], tokens, routing, rng, expert_weights, expert_weights_gpu)


def check_layer(run, tokens, routing, rng, expert_weights, expert_weights_gpu,
                y_dtype="float32"):
    """One fresh routing through ``run`` against the float64 layer, within the tiles' bound
    (down's output stored as ``y_dtype``)."""
    inputs = (*moe_layer.make_routing_inputs(rng, tokens, H, E, routing), *expert_weights)
    want, bound = moe_layer.moe_layer_reference(*inputs, K, y_dtype=y_dtype)
    np.testing.assert_allclose(
        moe_layer.layer_float64_torch(f64(inputs[0]), f64(inputs[1]), *expert_weights_gpu, K),
        want, rtol=1e-9, atol=1e-9)
    assert_within(run(*inputs), want, bound)


@pytest.mark.parametrize("tokens", (1, 7))
@pytest.mark.parametrize("strategy", ("barrier", "dynamic"))
@pytest.mark.parametrize("splits", (8, 32))
def test_split_router_layer_megakernel(splits, strategy, tokens, rng, expert_weights,
                                       expert_weights_gpu):
    """The router over splits of the hidden rows, 8 experts a task, two CTAs an SM, as
    bench_moe runs one token: 8 splits are 128 tasks of 256 rows; 32 splits, of 64 rows,
    leave half of a task's threads idle in the sums."""
    graph = moe_layer.make_moe_layer(experts_per_task=8, router_splits=splits, ctas_per_sm=2)
    run = build(graph, {"T": tokens}, strategy=strategy, options=KernelOptions(ctas_per_sm=2))
    for routing in moe_layer.ROUTINGS:
        check_layer(run, tokens, routing, rng, expert_weights, expert_weights_gpu)


@pytest.mark.parametrize("tokens", (16, 100))
@pytest.mark.parametrize("strategy", ("barrier", "dynamic", "unfused"))
def test_mma_router_layer_megakernel(strategy, tokens, rng, expert_weights, expert_weights_gpu):
    """The router on tensor cores (blocks of 16 tokens, 32 experts; 100: a partial block)."""
    options = moe_layer.options_for(tokens, router_engine="mma", ctas_per_sm=2)
    run = build(moe_layer.make_moe_layer(**options), {"T": tokens}, strategy=strategy,
                options=KernelOptions(ctas_per_sm=2))
    for routing in moe_layer.ROUTINGS:
        check_layer(run, tokens, routing, rng, expert_weights, expert_weights_gpu)


@pytest.mark.parametrize("bn, down_bn", [(32, None), (48, 64)])
@pytest.mark.parametrize("tokens", (1, 16))
@pytest.mark.parametrize("strategy", ("barrier", "dynamic"))
def test_narrow_task_layer_megakernel(strategy, tokens, bn, down_bn, rng, expert_weights,
                                      expert_weights_gpu):
    """Grouped-GEMM tasks of 32 or 48 columns (warps splitting K; down tasks of 64 columns
    with 48), blocked weights, two CTAs an SM."""
    graph = moe_layer.make_moe_layer(bn=bn, down_bn=down_bn, ctas_per_sm=2,
                                     router_splits=moe_layer.router_splits_for(tokens),
                                     blocked_weights=True)
    run = build(graph, {"T": tokens}, strategy=strategy, options=KernelOptions(ctas_per_sm=2))
    blocked = moe_layer.blocked_expert_weights(*expert_weights, 16, bn, down_bn)
    for routing in moe_layer.ROUTINGS:
        check_layer(lambda x, w_router, *_: run(x, w_router, *blocked), tokens, routing, rng,
                    expert_weights, expert_weights_gpu)


@pytest.mark.parametrize("tokens, tile_rows, engine", [(16, 16, "mma"), (512, 64, "wgmma")])
def test_blocked_weight_layer_megakernel(tokens, tile_rows, engine, rng, expert_weights,
                                         expert_weights_gpu):
    graph = moe_layer.make_moe_layer(tile_rows=tile_rows, engine=engine, blocked_weights=True)
    run = build(graph, {"T": tokens}, strategy="dynamic")
    blocked = moe_layer.blocked_expert_weights(*expert_weights, tile_rows)
    check_layer(lambda x, w_router, *_: run(x, w_router, *blocked), tokens, "random", rng,
                expert_weights, expert_weights_gpu)


@pytest.mark.parametrize("tile_rows", [64, 128])
@pytest.mark.parametrize("strategy", ["static", "dynamic"])
def test_wgmma_layer_megakernel(strategy, tile_rows, rng, expert_weights, expert_weights_gpu):
    """64- and 128-row expert tiles on warpgroup MMA, as bench_moe --engine wgmma runs them
    (--tile-rows 128: at 1024 tokens most experts' pairs fit one tile), with the combine's
    whole-row tasks of ``combine_cols_for`` 512 tokens."""
    graph = moe_layer.make_moe_layer(tile_rows=tile_rows, engine="wgmma",
                                     combine_cols=moe_layer.combine_cols_for(512))
    check_layer(build(graph, {"T": 512}, strategy=strategy), 512, "random", rng,
                expert_weights, expert_weights_gpu)


@pytest.mark.parametrize("routing", ["random", "one_expert"])
@pytest.mark.parametrize("strategy", ["barrier", "dynamic"])
def test_128_row_wgmma_tiles_with_one_or_two_blocks_of_rows(strategy, routing, rng,
                                                            expert_weights,
                                                            expert_weights_gpu):
    """At 1024 tokens an expert averages 64 pairs: its 128-row tile holds rows in one m64
    block or in both, and the wgmmas of a block without rows are not issued; one expert as
    every token's first choice fills several tiles."""
    graph = moe_layer.make_moe_layer(**moe_layer.options_for(1024, tile_rows=128,
                                                              ctas_per_sm=2))
    run = build(graph, {"T": 1024}, strategy=strategy, options=KernelOptions(ctas_per_sm=2))
    check_layer(run, 1024, routing, rng, expert_weights, expert_weights_gpu)


@pytest.mark.parametrize("tokens", (1, 7, 20))
@pytest.mark.parametrize("strategy", ["barrier", "static", "dynamic", "unfused"])
def test_fused_route_layer_megakernel(strategy, tokens, rng, expert_weights,
                                      expert_weights_gpu):
    """Top-k and align as one task (20 tokens: its picks over two blocks of the tensor-core
    router's 16 tokens), as bench_moe runs it where align is one task, two CTAs an SM, every
    routing."""
    graph = moe_layer.make_moe_layer(**moe_layer.options_for(tokens, fused_route=True,
                                                              ctas_per_sm=2))
    run = build(graph, {"T": tokens}, strategy=strategy, options=KernelOptions(ctas_per_sm=2))
    for routing in moe_layer.ROUTINGS:
        check_layer(run, tokens, routing, rng, expert_weights, expert_weights_gpu)


@pytest.mark.parametrize("tokens, bn", [(512, 128), (1024, 256)])
@pytest.mark.parametrize("strategy", ["static", "dynamic", "unfused"])
def test_shallow_slice_layer_megakernel(strategy, tokens, bn, rng, expert_weights,
                                        expert_weights_gpu):
    """Grouped GEMMs of 32-column K slices (A in 64-byte swizzled rows, the rings 5 and 8
    stages deep), two CTAs an SM, blocked weights (the static kernel claiming), every
    routing."""
    graph = moe_layer.make_moe_layer(**moe_layer.options_for(
        tokens, engine="wgmma", bn=bn, bk=32, ctas_per_sm=2, blocked_weights=True))
    compiled = build(graph, {"T": tokens}, strategy=strategy,
                     options=KernelOptions(ctas_per_sm=2, claim=strategy == "static"))
    blocked = moe_layer.blocked_expert_weights(*expert_weights, 64, bn)
    for routing in moe_layer.ROUTINGS:
        check_layer(lambda x, w_router, *_: compiled(x, w_router, *blocked), tokens, routing,
                    rng, expert_weights, expert_weights_gpu)


@pytest.mark.parametrize("bn, ctas_per_sm", [(256, 1), (128, 2)])
@pytest.mark.parametrize("tokens", (100, 1024))
@pytest.mark.parametrize("strategy", ["static", "barrier", "dynamic", "unfused"])
def test_two_warpgroup_layer_megakernel(strategy, tokens, bn, ctas_per_sm, rng, expert_weights,
                                        expert_weights_gpu):
    """128 x ``bn`` tasks on two warpgroups of one m64 block each (256 threads; 128 x 256 at
    one CTA an SM, 128 x 128 at two; the static and barrier kernels claiming), every routing:
    a warpgroup whose block holds no rows multiplies zeros and stores nothing."""
    options = moe_layer.options_for(tokens, tile_rows=128, bn=bn, down_bn=bn, threads=256,
                                    ctas_per_sm=ctas_per_sm, blocked_weights=True)
    compiled = build(moe_layer.make_moe_layer(**options), {"T": tokens}, strategy=strategy,
                     options=KernelOptions(ctas_per_sm=ctas_per_sm,
                                           claim=strategy in ("static", "barrier")))
    blocked = moe_layer.blocked_expert_weights(*expert_weights, 128, bn, bn)
    for routing in moe_layer.ROUTINGS:
        check_layer(lambda x, w_router, *_: compiled(x, w_router, *blocked), tokens, routing,
                    rng, expert_weights, expert_weights_gpu)


@pytest.mark.parametrize("tokens, tile_rows, threads, bk, ctas_per_sm", [
    (1024, 96, 128, 32, 2), (1024, 80, 256, 64, 1), (1024, 72, 128, 32, 3),
    (100, 24, 128, 32, 2), (1, 8, 128, 64, 2)])
@pytest.mark.parametrize("strategy", ["static", "barrier", "dynamic", "unfused"])
def test_swapped_layer_megakernel(strategy, tokens, tile_rows, threads, bk, ctas_per_sm, rng,
                                  expert_weights, expert_weights_gpu):
    """Grouped GEMMs on swapped wgmma tiles (the weights on the m64 side, the tile's rows
    the instruction's N): tiles of 96, 80 and 72 rows (at 1024 tokens an expert's pairs
    mostly fit one; 72 rows in 5-stage rings at three CTAs an SM, whose A stages end off a
    swizzle atom), 24 and 8 rows, one and two warpgroups, blocked weights, every routing
    (the static and barrier kernels claiming)."""
    options = moe_layer.options_for(tokens, engine="swapped", tile_rows=tile_rows, bk=bk,
                                    threads=threads, ctas_per_sm=ctas_per_sm,
                                    blocked_weights=True)
    compiled = build(moe_layer.make_moe_layer(**options), {"T": tokens}, strategy=strategy,
                     options=KernelOptions(ctas_per_sm=ctas_per_sm,
                                           claim=strategy in ("static", "barrier")))
    blocked = moe_layer.blocked_expert_weights(*expert_weights, tile_rows, options["bn"],
                                               options["down_bn"])
    for routing in moe_layer.ROUTINGS:
        check_layer(lambda x, w_router, *_: compiled(x, w_router, *blocked), tokens, routing,
                    rng, expert_weights, expert_weights_gpu)


@pytest.mark.parametrize("tokens, tile_rows, blocked", [(512, 64, True), (1024, 128, False)])
@pytest.mark.parametrize("strategy", ["static", "dynamic", "unfused"])
def test_tma_down_layer_megakernel(strategy, tokens, tile_rows, blocked, rng, expert_weights,
                                   expert_weights_gpu):
    """Down tiles that fill their rings by TMA (``down_loads="tma"``), two CTAs an SM (the
    static kernel claiming): h's rows and the weight slab in whole boxes, through maps of the
    blocked (E, H/bn, F, bn) or in-place (E, F, H) weights; 128-row tiles with rows in one
    m64 block or both; one expert as every token's first choice fills several tiles."""
    graph = moe_layer.make_moe_layer(**moe_layer.options_for(
        tokens, tile_rows=tile_rows, ctas_per_sm=2, blocked_weights=blocked, down_loads="tma"))
    compiled = build(graph, {"T": tokens}, strategy=strategy,
                     options=KernelOptions(ctas_per_sm=2, claim=strategy == "static"))
    weights = moe_layer.blocked_expert_weights(*expert_weights, tile_rows, down_loads="tma") \
        if blocked else expert_weights
    for routing in ("random", "one_expert"):
        check_layer(lambda x, w_router, *_: compiled(x, w_router, *weights), tokens, routing,
                    rng, expert_weights, expert_weights_gpu)


@pytest.mark.parametrize("tokens", (1, 16, 1024))
@pytest.mark.parametrize("strategy", ["static", "barrier"])
def test_claimed_layer_megakernel(strategy, tokens, rng, expert_weights, expert_weights_gpu):
    """CTAs that claim their tasks at run time (``KernelOptions.claim``), on the layer as
    bench_moe runs it, every routing: the tiles of unused experts are claimed and skipped, the
    peek before a task's notifies lets its next task skip waits its producers completed."""
    graph = moe_layer.make_moe_layer(**moe_layer.options_for(tokens, ctas_per_sm=2))
    run = build(graph, {"T": tokens}, strategy=strategy,
                options=KernelOptions(ctas_per_sm=2, claim=True))
    for routing in moe_layer.ROUTINGS:
        check_layer(run, tokens, routing, rng, expert_weights, expert_weights_gpu)


@pytest.mark.parametrize("tokens", (1, 100))
def test_deepest_rings_of_two_ctas_an_sm_launch(tokens, rng, expert_weights,
                                                expert_weights_gpu):
    """64 x 64 wgmma rings as deep as two CTAs an SM allow (6 stages): the cooperative
    launch takes them, as it refused the 7 that an arena limit of half the SM's shared memory
    let through."""
    graph = moe_layer.make_moe_layer(tile_rows=64, bn=64, engine="wgmma", ctas_per_sm=2)
    run = build(graph, {"T": tokens}, strategy="barrier", options=KernelOptions(ctas_per_sm=2))
    check_layer(run, tokens, "random", rng, expert_weights, expert_weights_gpu)


@pytest.mark.parametrize("tokens", (100, 512, 2048))
@pytest.mark.parametrize("strategy", ["barrier", "dynamic", "unfused"])
def test_bf16_y_layer_megakernel(strategy, tokens, rng, expert_weights, expert_weights_gpu):
    """Down's output stored in bf16 and read back by the combine, as bench_moe --y-dtype
    bfloat16 runs it (blocked weights, the tokens' defaults: at 100 tokens swapped 16-row
    tiles at four CTAs an SM, at 512 tokens swapped 48-row tiles, at 2048 tokens swapped
    152-row tiles on two warpgroups, two CTAs an SM)."""
    options = check_bench_layer(strategy, tokens, rng, expert_weights, expert_weights_gpu)
    want = {100: ("swapped", 128, 4), 512: ("swapped", 128, 4),
            2048: ("swapped", 256, 2)}[tokens]
    assert (options["engine"], options["threads"], options["ctas_per_sm"]) == want


def check_bench_layer(strategy, tokens, rng, expert_weights, expert_weights_gpu) -> dict:
    """The layer as bench_moe builds it for ``tokens`` (``options_for``: its tiles, threads
    and CTAs an SM, blocked weights, y in bf16), every routing through one kernel; its
    options."""
    options = moe_layer.options_for(tokens, blocked_weights=True, y_dtype="bfloat16")
    run = build(moe_layer.make_moe_layer(**options), {"T": tokens}, strategy=strategy,
                options=KernelOptions(ctas_per_sm=options["ctas_per_sm"]))
    blocked = moe_layer.blocked_expert_weights(*expert_weights, options["tile_rows"],
                                               options["bn"], options["down_bn"])
    for routing in moe_layer.ROUTINGS:
        check_layer(lambda x, w_router, *_: run(x, w_router, *blocked), tokens, routing, rng,
                    expert_weights, expert_weights_gpu, "bfloat16")
    return options


@pytest.mark.parametrize("tokens", (1101, 2048))  # 1101: a partial last combine block
@pytest.mark.parametrize("strategy", ["static", "barrier", "dynamic", "unfused"])
def test_combine_blocks_layer_megakernel(strategy, tokens, rng, expert_weights,
                                         expert_weights_gpu):
    """Combine tasks of 2 tokens (``pair_tile[2*b:2*b+2, :]`` in-edges), the tokens'
    defaults otherwise (blocked weights, y in bf16; the static and barrier kernels claiming)."""
    check_claimed_bench_layer(strategy, tokens, rng, expert_weights, expert_weights_gpu,
                              combine_tokens=2)


def check_claimed_bench_layer(strategy, tokens, rng, expert_weights, expert_weights_gpu,
                              **options):
    """The layer with ``options`` over the tokens' defaults (blocked weights, y in bf16), the
    static and barrier kernels claiming, every routing through one kernel."""
    options = moe_layer.options_for(tokens, blocked_weights=True, y_dtype="bfloat16",
                                    **options)
    run = build(moe_layer.make_moe_layer(**options), {"T": tokens}, strategy=strategy,
                options=KernelOptions(ctas_per_sm=options["ctas_per_sm"],
                                      claim=strategy in ("static", "barrier")))
    blocked = moe_layer.blocked_expert_weights(*expert_weights, options["tile_rows"],
                                               options["bn"], options["down_bn"])
    for routing in moe_layer.ROUTINGS:
        check_layer(lambda x, w_router, *_: run(x, w_router, *blocked), tokens, routing, rng,
                    expert_weights, expert_weights_gpu, "bfloat16")


@pytest.mark.parametrize("tokens, rows, bn", [(2, 8, 64), (15, 8, 64), (256, 24, 128)])
@pytest.mark.parametrize("strategy", ["static", "barrier", "dynamic", "unfused"])
def test_few_token_swapped_layer_megakernel(strategy, tokens, rows, bn, rng, expert_weights,
                                            expert_weights_gpu):
    """Swapped grouped GEMM tiles at few tokens, as bench_moe builds the layer (8-row tiles of
    64-column tasks below 16 tokens, four CTAs an SM; the static and barrier kernels
    claiming), every routing: one expert's pairs then fill several tiles of 8 rows."""
    options = moe_layer.options_for(tokens)
    assert (options["engine"], options["tile_rows"], options["bn"]) == ("swapped", rows, bn)
    check_claimed_bench_layer(strategy, tokens, rng, expert_weights, expert_weights_gpu)


@pytest.mark.parametrize("tokens", (600, 1024, 2048))
@pytest.mark.parametrize("strategy", ["static", "barrier", "dynamic", "unfused"])
def test_offsets_task_layer_megakernel(strategy, tokens, rng, expert_weights,
                                       expert_weights_gpu):
    """Align in three calls (one offsets task between the count and place calls, where the
    default's place tasks sum the counts themselves), the tokens' defaults otherwise (600: a
    partial last chunk)."""
    check_claimed_bench_layer(strategy, tokens, rng, expert_weights, expert_weights_gpu,
                              place_offsets=False)


@pytest.mark.parametrize("tokens", (600, 1024, 2048))
@pytest.mark.parametrize("strategy", ["static", "barrier", "dynamic", "unfused"])
def test_topk_counts_layer_megakernel(strategy, tokens, rng, expert_weights, expert_weights_gpu):
    """Align in one call: the top-k tasks count their picks, the place tasks sum those rows
    (600: a partial last chunk and top-k block), the tokens' defaults otherwise."""
    check_claimed_bench_layer(strategy, tokens, rng, expert_weights, expert_weights_gpu,
                              topk_counts=True)


@pytest.mark.parametrize("tokens", (600, 1024))
@pytest.mark.parametrize("strategy", ["static", "barrier", "dynamic", "unfused"])
def test_count_call_layer_megakernel(strategy, tokens, rng, expert_weights, expert_weights_gpu):
    """Align in two calls (a count call, then place tasks that sum its rows), where the
    default's top-k tasks count their picks themselves."""
    check_claimed_bench_layer(strategy, tokens, rng, expert_weights, expert_weights_gpu,
                              topk_counts=False)


@pytest.mark.parametrize("tokens", (1101,))  # a partial last combine block
@pytest.mark.parametrize("strategy", ["static", "dynamic", "unfused"])
def test_combine_prefetch_layer_megakernel(strategy, tokens, rng, expert_weights,
                                           expert_weights_gpu):
    """Combine tasks that first ask for their rows of y in L2 (bulk prefetches), the tokens'
    defaults otherwise (blocked weights, y in bf16; the static kernel claiming)."""
    options = moe_layer.options_for(tokens, blocked_weights=True, y_dtype="bfloat16",
                                    combine_prefetch=True)
    run = build(moe_layer.make_moe_layer(**options), {"T": tokens}, strategy=strategy,
                options=KernelOptions(ctas_per_sm=options["ctas_per_sm"],
                                      claim=strategy == "static"))
    blocked = moe_layer.blocked_expert_weights(*expert_weights, options["tile_rows"],
                                               options["bn"], options["down_bn"])
    for routing in moe_layer.ROUTINGS:
        check_layer(lambda x, w_router, *_: run(x, w_router, *blocked), tokens, routing, rng,
                    expert_weights, expert_weights_gpu, "bfloat16")


@pytest.mark.parametrize("tokens", (1100,))  # partial last router and top-k blocks
@pytest.mark.parametrize("strategy", ("barrier", "dynamic", "unfused"))
def test_wide_router_layer_megakernel(strategy, tokens, rng, expert_weights,
                                      expert_weights_gpu):
    """Router tasks of 32 tokens x 64 experts beside top-k tasks of 8 (the default from 1024
    tokens), as bench_moe runs the layer."""
    options = check_bench_layer(strategy, tokens, rng, expert_weights, expert_weights_gpu)
    assert (options["router_tokens"], options["block_tokens"]) == (32, 8)


@pytest.mark.parametrize("tokens", (600,))  # 10 chunks of 64 tokens, the last of 24
@pytest.mark.parametrize("strategy", ("barrier", "dynamic"))
def test_align_over_chunks_layer_megakernel(strategy, tokens, rng, expert_weights,
                                            expert_weights_gpu):
    """The layer with align over several CTAs in one call (the default from 512 to 1024
    tokens), as bench_moe runs it."""
    options = check_bench_layer(strategy, tokens, rng, expert_weights, expert_weights_gpu)
    assert options["align_tokens"] == moe.ALIGN_CHUNK_TOKENS and options["topk_counts"]


def test_graphs_captured_between_builds_keep_their_memory(rng, expert_weights):
    """Two task widths of the layer, barrier and unfused, each built and captured before the
    next is built (as bench_moe --configs does), then replayed in turns, each replay checked:
    a later build's constants and a later capture's buffers must not land in the memory an
    earlier graph launches on (its VM call handed it back to the pool)."""
    x, w_router = moe_layer.make_routing_inputs(rng, 1, H, E)
    want, bound = moe_layer.moe_layer_reference(x, w_router, *expert_weights, K)
    replays = {}
    for bn in (64, 32):
        graph = moe_layer.make_moe_layer(bn=bn, router_splits=8, ctas_per_sm=2,
                                         blocked_weights=True)
        weights = moe_layer.blocked_expert_weights(*expert_weights, 16, bn)
        on_device = [tvm.runtime.tensor(a, tvm.cuda(0)) for a in (x, w_router, *weights)]
        for strategy in ("barrier", "unfused"):
            run = build(graph, {"T": 1}, strategy=strategy,
                        options=KernelOptions(ctas_per_sm=2, timeout_s=0.5))
            replays[bn, strategy] = run.capture(*on_device)[0]
    for _ in range(3):
        for replay in replays.values():
            replay()
            torch.cuda.synchronize()
            assert_within(replay.checked(), want, bound)


@pytest.mark.parametrize("tokens", (1, 3, 4))
@pytest.mark.parametrize("strategy", ["static", "barrier", "dynamic", "mixed", "unfused"])
def test_routed_gate_up_layer_megakernel(strategy, tokens, rng, expert_weights,
                                         expert_weights_gpu):
    """gate_up tasks that route themselves from the router's logits and wait for the router
    only (``routed_gate_up``), the tokens' defaults otherwise, every routing: their rows of h
    are those align gives the down tasks."""
    check_claimed_bench_layer(strategy, tokens, rng, expert_weights, expert_weights_gpu,
                              routed_gate_up=True)


@pytest.mark.parametrize("tokens", (1, 16, 1024))
@pytest.mark.parametrize("strategy", ["static", "barrier", "dynamic", "unfused"])
def test_early_weights_layer_megakernel(strategy, tokens, rng, expert_weights,
                                        expert_weights_gpu):
    """Down tasks whose prelude issues their first weight slices before they wait for h
    (``early_weights``), the tokens' defaults otherwise (blocked weights, y in bf16; the
    static and barrier kernels claiming): the tasks of unused tiles, which the trigger skips
    after their prelude ran, leave no copy in flight."""
    check_claimed_bench_layer(strategy, tokens, rng, expert_weights, expert_weights_gpu,
                              early_weights=True)


@pytest.mark.parametrize("model", [m for m in moe_layer.MODELS if m != "qwen3-30b-a3b"])
def test_other_models_layer_megakernel(model, rng):
    """The layer at other models' shapes (``moe_layer.MODELS``) as ``bench_moe --model``
    builds it at 1, 16 and 1024 tokens: ``options_for`` (Mixtral's 8 experts: router tasks of
    8 on CUDA cores at every size; gpt-oss's 2880 hidden rows: down tasks of 64 columns,
    combine tasks of 320), blocked weights, y in bf16, the claimed static kernel and the
    dynamic one; every routing below 1024 tokens, a random one there (the float64 bound of
    1024 tokens takes a minute on the host)."""
    shape = moe_layer.MODELS[model]
    hidden, experts, top_k = shape["hidden"], shape["experts"], shape["top_k"]
    weights = moe_layer.make_expert_weights(rng, hidden, experts, shape["intermediate"])
    layouts = {}  # the blocked weights of each pair of task widths, laid out once
    for tokens in (1, 16, 1024):
        options = moe_layer.options_for(tokens, **shape, blocked_weights=True,
                                        y_dtype="bfloat16")
        widths = (options["bn"], options["down_bn"])
        if widths not in layouts:
            layouts[widths] = moe_layer.blocked_expert_weights(*weights, options["tile_rows"],
                                                               *widths)
        blocked = layouts[widths]
        graph = moe_layer.make_moe_layer(**options)
        runs = [build(graph, {"T": tokens}, strategy=strategy, options=KernelOptions(
                    ctas_per_sm=options["ctas_per_sm"], claim=claim))
                for strategy, claim in (("static", True), ("dynamic", False))]
        for routing in moe_layer.ROUTINGS if tokens < 1024 else ("random",):
            x, w_router = moe_layer.make_routing_inputs(rng, tokens, hidden, experts, routing)
            want, bound = moe_layer.moe_layer_reference(x, w_router, *weights, top_k,
                                                        y_dtype="bfloat16")
            for run in runs:
                assert_within(run(x, w_router, *blocked), want, bound)
