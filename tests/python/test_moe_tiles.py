"""The MoE and RoPE tiles without a GPU: NumPy references against float64 within each tile's
stated bound, the whole MoE layer on the CPU reference executor under static, dynamic and
mixed task orders, and the generated CUDA (each tile alone, the layer as one megakernel)
compiled for sm_90a."""
import functools
import importlib.util
import re
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm.script import tirx as T

from etc_tvm import EtcError, Tensor, call_device, graph_func
from etc_tvm.errors import ExecutionError, GraphError
from etc_tvm.build import build
from etc_tvm.executor import (DynamicQueueOrder, MixedOrder, RandomOrder, ReadyQueueOrder,
                              StaticOrder, execute)
from etc_tvm.relax_passes import UnfusedTransform
from etc_tvm.schedule import DynamicPlan, mixed_schedule
from etc_tvm.task_graph import TaskGraph
from etc_tvm.tiles import moe, rope
from etc_tvm.tir_sched.events import ARM_BIAS, EventLayout
from etc_tvm.tir_sched.persistent import KernelOptions

from cubin import build_cubin, sass
from moe_tile_graphs import (counted_align_graph, one_call_dims, one_call_graphs,
                             routed_tiles_graph)
from test_tiles import assert_within, poisoned


def completion_counter(graph, dims) -> tuple[int, str]:
    """The tasks of the call of ``graph`` that writes exp_indptr, and the counter of its
    completion as the generated CUDA points at it."""
    tasks = TaskGraph.build(graph, dims)
    (call,) = [c for c in tasks.calls
               if any(tasks.tensors[t].name == "exp_indptr" for t in c.outputs)]
    return call.num_tasks, f"(&(counters_ptr[{EventLayout.of(tasks).done[call.index]}]))"


def completion_notify(graph, dims) -> str:
    """The notify that completes that call, of one task (``PersistentKernel._completion``)."""
    num_tasks, counter = completion_counter(graph, dims)
    assert num_tasks == 1
    return f"etc_notify({counter});"


def _load_app(name):
    """apps/<name>.py as the module ``name`` (the GPU tests import it too)."""
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[2] / "apps" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


moe_layer = _load_app("moe_layer")
HOT, ROUTINGS, make_inputs = moe_layer.HOT, moe_layer.ROUTINGS, moe_layer.make_inputs
make_moe_layer, moe_layer_reference = moe_layer.make_moe_layer, moe_layer.moe_layer_reference

BF16 = ml_dtypes.bfloat16
H, E, K, F, BT = 128, 16, 4, 64, 16  # the small configuration (Qwen3: 2048, 128, 8, 768, 16)
TOKENS = (1, 7, 20)


@functools.cache
def small_layer():
    return make_moe_layer(H, E, K, F, combine_cols=64)


def run_tasks(tile, grid, *arrays):
    for coords in np.ndindex(*grid):
        tile.reference(*coords, *arrays)


def gaussian_routing_inputs(rng, tokens, hidden=H, experts=E, top_k=K, draws=100):
    """bf16 x and w_router with every token's top_k-th and (top_k+1)-th logit apart by more
    than twice the fp32 logit bound. The tokens with a near tie are redrawn, not the whole draw
    (``moe.routing_margins``: a token's margin does not depend on the others): at 128 tokens
    nearly every whole draw holds a tie."""
    w = (rng.standard_normal((hidden, experts)) / np.sqrt(hidden)).astype(BF16)
    x = rng.standard_normal((tokens, hidden)).astype(BF16)
    for _ in range(draws):
        tied = np.flatnonzero(moe.routing_margins(x, w, top_k) <= 0)
        if tied.size == 0:
            return x, w
        x[tied] = rng.standard_normal((len(tied), hidden)).astype(BF16)
    raise AssertionError(f"tokens {tied.tolist()} still have a near tie after {draws} draws")


# ------------------------------------------------------------------ references vs float64
def route_with_tiles(x, w, experts_per_task=8, splits=1, engine="fma", block_tokens=8):
    """topk, topw of the router and top-k tiles' references, on poisoned outputs."""
    tokens, blocks = x.shape[0], moe.ceil_div(x.shape[0], block_tokens)
    logits = poisoned((splits, tokens, E), "float32")
    run_tasks(moe.make_router_tile(H, E, block_tokens, experts_per_task, splits=splits,
                                   engine=engine),
              (blocks, splits, E // experts_per_task), x, w, logits)
    topk, topw = np.full((tokens, K), -1, np.int32), poisoned((tokens, K), "float32")
    run_tasks(moe.make_topk_tile(E, K, block_tokens, splits=splits), (blocks,), logits, topk,
              topw)
    return topk, topw


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("splits, engine, block_tokens, experts_per_task",
                         [(1, "fma", 8, 8), (4, "fma", 8, 8), (1, "mma", 16, 16),
                          (2, "mma", 16, 16)])
def test_router_reference_is_within_its_bound(tokens, splits, engine, block_tokens,
                                              experts_per_task, rng):
    x, w = gaussian_routing_inputs(rng, tokens)
    topk, topw = route_with_tiles(x, w, experts_per_task, splits, engine, block_tokens)
    want_k, want_w = moe.route(x, w, K)
    np.testing.assert_array_equal(topk, want_k)
    assert_within(topw, want_w, moe.router_weight_bound(x, w, want_w))
    np.testing.assert_allclose(topw.sum(axis=1), 1, rtol=1e-6)


def test_gaussian_bf16_weights_have_their_scale():
    """The layer's weights are drawn by 16-bit quantiles: bf16, reproducible from the
    generator, mean 0 and the standard deviation asked for, tails cut near 4.3 sigma."""
    draw = moe_layer.gaussian_bf16(np.random.default_rng(3), (64, 1024), 0.02)
    assert draw.dtype == BF16 and draw.shape == (64, 1024)
    np.testing.assert_array_equal(
        draw.view(np.uint16),
        moe_layer.gaussian_bf16(np.random.default_rng(3), (64, 1024), 0.02).view(np.uint16))
    values = draw.astype(np.float64)
    assert abs(values.mean()) < 0.02 * 0.02 and abs(values.std() / 0.02 - 1) < 0.01
    assert np.abs(values).max() / 0.02 < 4.4


def test_router_splits_must_divide_the_hidden_rows():
    with pytest.raises(EtcError, match="3 splits on 'fma' must divide hidden 128 into "
                                       "multiples of 8 rows"):
        moe.make_router_tile(H, E, splits=3)
    with pytest.raises(EtcError, match="32 splits on 'fma' must divide hidden 128"):
        moe.make_router_tile(H, E, splits=32)
    with pytest.raises(EtcError, match="4 splits on 'mma' must divide hidden 128 into "
                                       "multiples of 64"):
        moe.make_router_tile(H, E, 16, 16, splits=4, engine="mma")
    with pytest.raises(EtcError, match="engine must be one of"):
        moe.make_router_tile(H, E, engine="wgmma")


@pytest.mark.parametrize("experts, engine, most, threads, want", [
    (128, "fma", 16, 128, 16), (128, "mma", 64, 128, 64), (64, "mma", 32, 128, 32),
    (8, "fma", 16, 128, 8),  # Mixtral
    (40, "fma", 16, 128, 8), (48, "fma", 16, 128, 16), (48, "mma", 32, 128, 16),
    (8, "mma", 32, 128, None), (40, "mma", 32, 128, None), (60, "fma", 16, 128, None),
    # eight warps share 16 tokens x 32 experts, not 16 x 16
    (64, "mma", 32, 256, 32), (16, "mma", 32, 256, None)])
def test_router_tasks_take_the_most_experts_that_fit(experts, engine, most, threads, want):
    assert moe.router_experts_for(experts, engine, most, threads) == want


def test_router_tasks_must_fit_the_experts():
    with pytest.raises(EtcError, match=r"12 experts a task on 'fma' do not fit the 60 experts "
                                       r"and 128 threads \(a multiple of 8"):
        moe.make_router_tile(H, 60, experts_per_task=12)
    with pytest.raises(EtcError, match="8 experts a task on 'mma' do not fit the 8 experts"):
        moe.make_router_tile(H, 8, 16, 8, engine="mma")


@pytest.mark.parametrize("tokens", (1, 20, 130, 600))
@pytest.mark.parametrize("hidden, experts, top_k, intermediate", [
    (H, 8, 2, F),  # Mixtral's experts
    (H, 40, 8, F),  # Granite 3.0 3B's
    (192, 16, 4, 192)])  # 3 x 64 hidden rows, as gpt-oss's 2880 are 45 x 64
def test_layers_of_other_shapes_match_float64(tokens, hidden, experts, top_k, intermediate):
    """``options_for`` fits each choice to the shapes (``test_layer_options_fit_the_models``
    says which), and the layer it builds is right under every size."""
    options = moe_layer.options_for(tokens, hidden=hidden, experts=experts, top_k=top_k,
                                    intermediate=intermediate)
    inputs = make_inputs(np.random.default_rng(tokens), tokens, hidden, experts, intermediate)
    want, bound = moe_layer_reference(*inputs, top_k)
    assert_within(execute(make_moe_layer(**options), *inputs, order=RandomOrder(5)), want,
                  bound)


@pytest.mark.parametrize("model, tokens, want", [
    # 8 experts: router tasks of 8, on CUDA cores at every size (no tensor-core block fits)
    ("mixtral-8x7b", 16, ("fma", 8, 8, 128, 128, 512)),
    ("mixtral-8x7b", 1024, ("fma", 8, 1, 256, 256, 4096)),
    # 2880 hidden rows: down tasks of 64 columns, combine tasks of 320 (a multiple of them
    # that divides the rows), no router splits on tensor cores (1440 is not 64-row slices)
    ("gpt-oss-120b", 1, ("fma", 16, 8, 64, 64, 320)),
    ("gpt-oss-120b", 16, ("mma", 32, 1, 128, 64, 320)),
    ("qwen3-next-80b-a3b", 1024, ("mma", 64, 1, 128, 128, 2048)),
])
def test_layer_options_fit_the_models(model, tokens, want):
    options = moe_layer.options_for(tokens, **moe_layer.MODELS[model])
    keys = ("router_engine", "experts_per_task", "router_splits", "bn", "down_bn",
            "combine_cols")
    assert tuple(options[k] for k in keys) == want


def test_two_warpgroup_swapped_tiles_need_two_panels_to_divide_the_columns():
    """From 97 rows swapped tiles run on two warpgroups, a 64-column panel each: where 128
    columns do not divide the hidden rows (gpt-oss), wgmma tiles take those tokens."""
    assert moe_layer.grouped_engine_for(2048, 128, 8) == "swapped"
    assert moe_layer.grouped_engine_for(2048, 128, 8, hidden=2880, intermediate=2880) == "wgmma"
    assert moe_layer.grouped_engine_for(1024, 128, 8, hidden=2880, intermediate=2880) == \
        "swapped"  # 80 rows: one warpgroup


def test_one_round_columns_give_each_cta_one_task_of_each_gemm():
    """Where every pair is its own 16-row tile, a round of 128 tasks a GEMM at one CTA an SM,
    in widths of whole 32 columns up to 128 that divide the GEMM's columns: Qwen3-30B-A3B's
    and OLMoE's one token; not Qwen3-235B's (192 columns), Qwen3-Next's (80), Mixtral's
    (448), past 16 pairs, or off the mma tiles."""
    def columns(model, tokens=1, engine="mma"):
        shape = moe_layer.MODELS[model]
        return moe_layer.one_round_columns_for(tokens, shape["top_k"], shape["experts"],
                                               shape["hidden"], shape["intermediate"], engine)

    assert columns("qwen3-30b-a3b") == (96, 128)
    assert columns("olmoe-1b-7b") == (128, 128)
    for model in ("qwen3-235b-a22b", "qwen3-next-80b-a3b", "mixtral-8x7b", "gpt-oss-120b"):
        assert columns(model) is None, model
    assert columns("qwen3-30b-a3b", tokens=3) is None
    assert columns("qwen3-30b-a3b", engine="wgmma") is None
    calls = TaskGraph.build(make_moe_layer(**moe_layer.options_for(1)), {"T": 1}).calls
    tasks = {c.fn.name.split("_")[0]: c.num_tasks for c in calls}
    assert tasks["gate"] == tasks["down"] == moe_layer.ROUND_TASKS
    # asked-for CTAs an SM or columns: the layer's other choices, as before
    assert moe_layer.options_for(1, ctas_per_sm=2)["bn"] == 64
    assert moe_layer.options_for(1, bn=64)["ctas_per_sm"] == 2


def test_task_columns_halve_until_they_divide_the_columns():
    assert moe_layer.task_columns(80, 2048, 768, engine="swapped") == (128, 128)
    assert moe_layer.task_columns(80, 2880, 2880, engine="swapped") == (128, 64)
    assert moe_layer.task_columns(16, 2880, 2880, engine="mma") == (64, 64)
    assert moe_layer.task_columns(80, 2880, 2880, engine="swapped", bn=128) == (128, 64)
    assert moe_layer.task_columns(80, 2880, 2880, engine="swapped", down_bn=128) == (128, 128)


def test_few_experts_at_few_tokens_take_narrower_down_tasks():
    """Mixtral's 2 experts at one token: 256 down tasks of 32 columns for 264 CTA slots, not
    128 of 64; where twice the tasks would pass a round (Qwen3's 8 experts, 256 tasks of 64;
    Mixtral at two tokens, 4 experts) or an expert may take more than a tile, no change."""
    def down_bn(model, tokens, **options):
        return moe_layer.options_for(tokens, **moe_layer.MODELS[model], **options)["down_bn"]

    assert down_bn("mixtral-8x7b", 1) == 32
    assert down_bn("mixtral-8x7b", 2) == 64
    assert down_bn("qwen3-30b-a3b", 1, ctas_per_sm=2) == 64
    assert down_bn("mixtral-8x7b", 1, down_bn=64) == 64  # asked for: kept
    # one expert, or a round of 4 CTAs an SM, would take 16 columns: not past the narrowest
    assert moe_layer.down_columns_for(1, 1, 8, 4096, 64) == moe_layer.MIN_DOWN_COLUMNS == 32
    assert moe_layer.down_columns_for(1, 2, 8, 4096, 64, ctas_per_sm=4) == 32
    assert moe_layer.down_columns_for(17, 1, 8, 4096, 64) == 64  # 17 pairs: not one tile each


def test_layer_options_refuse_experts_no_router_task_covers():
    with pytest.raises(ValueError, match="no router task on 'fma' covers 60 experts"):
        moe_layer.options_for(1, experts=60)


def test_down_tasks_that_do_not_divide_the_hidden_rows_are_refused_by_the_down_tile():
    """``down_bn=128`` asked for 192 hidden rows: the layer's options still resolve (no
    combine width fits, so the default's), and the down tile says what does not divide."""
    options = moe_layer.options_for(16, hidden=192, intermediate=192, down_bn=128)
    with pytest.raises(EtcError, match="H=192 of bn=128"):
        make_moe_layer(**options)


def test_router_breaks_ties_by_lower_index():
    """Experts 2 and 5 have the same router column: equal logits, 2 goes first."""
    x = np.ones((3, H), BF16)
    w = np.zeros((H, E))
    w[:, [2, 5]] = 1 / H
    w[:, 9] = 0.5 / H
    topk, topw = route_with_tiles(x, w.astype(BF16), splits=2)
    np.testing.assert_array_equal(topk[:, :3], [[2, 5, 9]] * 3)
    np.testing.assert_array_equal(topk[:, 3], [0] * 3)  # the lowest of the zero logits


def routed(rng, tokens, routing, experts=E, top_k=K):
    """topk (T, K) int32 of a routing: random; every token on expert HOT first; odd experts
    idle."""
    if routing == "random":
        ids = [rng.choice(experts, top_k, replace=False) for _ in range(tokens)]
    elif routing == "one_expert":
        ids = [[HOT, *rng.choice(np.delete(np.arange(experts), HOT), top_k - 1, replace=False)]
               for _ in range(tokens)]
    else:
        ids = [rng.choice(np.arange(0, experts, 2), top_k, replace=False) for _ in range(tokens)]
    return np.asarray(ids, np.int32).reshape(tokens, top_k)


def aligned(topk, tiles):
    """The align tile's outputs for ``topk``, through its reference."""
    out = [np.full(s, -7, np.int32) for s in
           ((E,), (E + 1,), topk.shape, topk.shape, (tiles * BT,), (tiles,))]
    run_tasks(moe.make_align_tile(E, K, BT), (1,), topk, *out)
    return out


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("tokens", (1, 7, 40, 300))
def test_align_reference_builds_the_padded_csr(tokens, routing, rng):
    topk = routed(rng, tokens, routing)
    tiles = moe.max_tiles(tokens, E, K, BT)
    counts, indptr, pair_row, pair_tile, sorted_token, tile_expert = aligned(topk, tiles)
    np.testing.assert_array_equal(counts, np.bincount(topk.ravel(), minlength=E))
    assert indptr[0] == 0 and indptr[E] <= tiles
    np.testing.assert_array_equal(np.diff(indptr), -(-counts // BT))
    for e in range(E):  # (t, k) row-major within the expert, from its first tile on
        np.testing.assert_array_equal(pair_row[topk == e], indptr[e] * BT + np.arange(counts[e]))
        np.testing.assert_array_equal(tile_expert[indptr[e]:indptr[e + 1]], e)
    np.testing.assert_array_equal(pair_tile, pair_row // BT)
    assert (tile_expert[indptr[E]:] == E).all()
    np.testing.assert_array_equal(sorted_token[pair_row.ravel()], np.repeat(np.arange(tokens), K))
    assert (np.delete(sorted_token, pair_row.ravel()) == -1).all()
    if routing == "one_expert":
        assert counts[HOT] == tokens
    if routing == "idle_experts":
        assert (counts[1::2] == 0).all()


def aligned_by_chunks(topk, tiles, chunk_tokens):
    """The outputs of align over several CTAs (count, offsets, place) for ``topk``, through
    their references, each chunk's task in turn."""
    chunks = -(-len(topk) // chunk_tokens)
    chunk_counts, chunk_row = (np.full((chunks, E), -7, np.int32) for _ in range(2))
    counts, indptr, tile_expert = (np.full(n, -7, np.int32) for n in (E, E + 1, tiles))
    pair_row, pair_tile = np.full(topk.shape, -7, np.int32), np.full(topk.shape, -7, np.int32)
    sorted_token = np.full(tiles * BT, -7, np.int32)
    run_tasks(moe.make_align_count_tile(E, K, chunk_tokens), (chunks,), topk, chunk_counts)
    run_tasks(moe.make_align_offsets_tile(E, BT), (1,), chunk_counts, counts, indptr,
              chunk_row, tile_expert)
    exp_indptr = np.full(E + 1, -7, np.int32)
    run_tasks(moe.make_align_place_tile(E, K, BT, chunk_tokens), (chunks,), topk, counts,
              indptr, chunk_row, pair_row, pair_tile, sorted_token, exp_indptr)
    return counts, exp_indptr, pair_row, pair_tile, sorted_token, tile_expert


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("tokens, chunk_tokens", [(1, 8), (7, 8), (40, 8), (300, 16),
                                                  (300, 128), (17, 1)])
def test_align_over_chunks_writes_what_one_align_task_writes(tokens, chunk_tokens, routing,
                                                             rng):
    """Every output, every row of sorted_token included (the padding's -1 split among the
    place tasks), whether chunks divide the tokens or not."""
    topk = routed(rng, tokens, routing)
    tiles = moe.max_tiles(tokens, E, K, BT)
    for got, want in zip(aligned_by_chunks(topk, tiles, chunk_tokens), aligned(topk, tiles)):
        np.testing.assert_array_equal(got, want)


def aligned_by_row_tasks(topk, tiles, chunk_tokens):
    """(exp_indptr, pair_row, pair_tile, sorted_token, tile_expert) of align in two calls
    (count, then place tasks that sum the counts themselves), through their references."""
    chunks = -(-len(topk) // chunk_tokens)
    chunk_counts = np.full((chunks, E), -7, np.int32)
    exp_indptr, tile_expert = np.full(E + 1, -7, np.int32), np.full(tiles, -7, np.int32)
    pair_row, pair_tile = np.full(topk.shape, -7, np.int32), np.full(topk.shape, -7, np.int32)
    sorted_token = np.full(tiles * BT, -7, np.int32)
    run_tasks(moe.make_align_count_tile(E, K, chunk_tokens), (chunks,), topk, chunk_counts)
    run_tasks(moe.make_align_rows_tile(E, K, BT, chunk_tokens), (chunks,), topk, chunk_counts,
              pair_row, pair_tile, sorted_token, exp_indptr, tile_expert)
    return exp_indptr, pair_row, pair_tile, sorted_token, tile_expert


def logits_picking(topk, experts, rng):
    """(1, T, experts) fp32 logits whose top-K, in order, is ``topk`` (T, K)."""
    tokens, top_k = topk.shape
    logits = rng.uniform(-1, 0, (1, tokens, experts)).astype(np.float32)
    np.put_along_axis(logits[0], topk, np.arange(top_k, 0, -1, dtype=np.float32), axis=1)
    return logits


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("tokens, chunk_tokens, block_tokens", [
    (1, 8, 8), (7, 8, 8), (40, 16, 8), (300, 64, 8), (300, 128, 16), (17, 2, 1)])
def test_place_tasks_summing_top_k_counts_write_what_one_align_task_writes(
        tokens, chunk_tokens, block_tokens, routing, rng):
    """Top-k tasks that count their picks per expert, then place tasks that sum those rows
    (several a chunk; the last chunk and block partial): every output but the counts."""
    topk = routed(rng, tokens, routing)
    tiles, blocks = moe.max_tiles(tokens, E, K, BT), -(-tokens // block_tokens)
    picks = np.full(topk.shape, -7, np.int32), np.full(topk.shape, np.nan, np.float32)
    block_counts = np.full((blocks, E), -7, np.int32)
    run_tasks(moe.make_topk_tile(E, K, block_tokens, counts=True), (blocks,),
              logits_picking(topk, E, rng), *picks, block_counts)
    np.testing.assert_array_equal(picks[0], topk)
    for b in range(blocks):
        rows = topk[b * block_tokens:(b + 1) * block_tokens]
        np.testing.assert_array_equal(block_counts[b], np.bincount(rows.ravel(), minlength=E))
    out = [np.full(topk.shape, -7, np.int32), np.full(topk.shape, -7, np.int32),
           np.full(tiles * BT, -7, np.int32), np.full(E + 1, -7, np.int32),
           np.full(tiles, -7, np.int32)]
    run_tasks(moe.make_align_rows_tile(E, K, BT, chunk_tokens, count_tokens=block_tokens),
              (-(-tokens // chunk_tokens),), topk, block_counts, *out)
    _, indptr, pair_row, pair_tile, sorted_token, tile_expert = aligned(topk, tiles)
    for got, want in zip(out, (pair_row, pair_tile, sorted_token, indptr, tile_expert)):
        np.testing.assert_array_equal(got, want)


def test_count_rows_must_divide_the_chunks():
    with pytest.raises(EtcError, match="count_tokens 24 must divide chunk_tokens 64"):
        moe.make_align_rows_tile(E, K, BT, 64, count_tokens=24)


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("tokens, chunk_tokens", [(1, 8), (7, 8), (40, 8), (300, 16),
                                                  (300, 128), (17, 1)])
def test_place_tasks_with_their_own_offsets_write_what_one_align_task_writes(
        tokens, chunk_tokens, routing, rng):
    """Every output but the counts, each tile's expert included (a share a task)."""
    topk = routed(rng, tokens, routing)
    tiles = moe.max_tiles(tokens, E, K, BT)
    _, *want = aligned(topk, tiles)
    for got, expected in zip(aligned_by_row_tasks(topk, tiles, chunk_tokens), want):
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("tile, bad", [("align", -1), ("align", E), ("align_count", E + 3)])
def test_align_names_an_expert_id_outside_the_experts(tile, bad, rng):
    """In the references an id outside 0..E-1 in topk is an error that says which tile found
    it, where and what (so does a kernel: ``expert_id_checks``)."""
    topk = routed(rng, 70, "random")
    topk[41, 2] = bad
    tiles = moe.max_tiles(70, E, K, BT)
    with pytest.raises(ExecutionError, match=rf"{tile}: topk\[41, 2\] = {bad} is no expert "
                       rf"id of 0\.\.{E - 1}"):
        aligned(topk, tiles) if tile == "align" else aligned_by_chunks(topk, tiles, 32)


def test_align_checks_expert_ids_where_a_kernel_can_stop():
    """Each expert id a walk loads goes through its tile's input check, ``etc_input_check``
    with the stop record, the task and the check's number (count's 0, place's 1): in a
    persistent kernel the task it runs, in a grid launch the call's first task (count's 0,
    place's 5, after 4 count tasks and 1 offsets task) plus the CTA."""
    graph = one_call_graphs(128, 32, 4, 64)["align_chunked"]
    static = build(graph, {"T": 100}, strategy="static", num_sms=132).cuda_source()
    calls = set(re.findall(r"etc_input_check\((walk_ahead_ptr\w*)\[\d+\], 32, "
                           r"\(&\(status_ptr\[0\]\)\), t, (\d)\) == 0", static))
    assert calls == {("walk_ahead_ptr", "0"), ("walk_ahead_ptr_1", "1")}, calls
    unfused = build(graph, {"T": 100}, strategy="unfused")
    calls = set(re.findall(r"etc_input_check\(walk_ahead_ptr\[\d+\], 32, "
                           r"\(&\(status_ptr\[0\]\)\), (.*?), (\d)\) == 0",
                           unfused.cuda_source()))
    assert calls == {("((int)blockIdx.x)", "0"), ("(((int)blockIdx.x) + 5)", "1")}, calls
    assert unfused.meta.has_status and len(unfused.meta.checks) == 2


def misplace(sorted_token, tile_rows, fault, tokens) -> int:
    """Put one fault into an alignment's ``sorted_token``, in a tile with pairs and padding:
    "hole", its first pair moved past its padding; "token", a token past the ``tokens``. The
    row at fault."""
    held = (sorted_token.reshape(-1, tile_rows) >= 0).sum(axis=1)
    g = int(np.flatnonzero((held > 0) & (held < tile_rows))[0])
    if fault == "token":
        sorted_token[g * tile_rows] = tokens + 5
        return g * tile_rows
    row = g * tile_rows + int(held[g])
    sorted_token[row], sorted_token[g * tile_rows] = sorted_token[g * tile_rows], -1
    return row


@pytest.mark.parametrize("fault", ["hole", "token"])
@pytest.mark.parametrize("tile", ["gate_up", "down"])
def test_grouped_gemms_name_a_pair_after_padding_or_a_token_past_x(tile, fault, rng):
    """A grouped GEMM tile stores the rows below its count of pairs, so a tile's pairs must
    come first (align lays them so): a pair after a padding row is an error that names the
    task and the row, as is a token past x's rows in gate_up, which gathers them (so does a
    kernel: ``pair_row_checks``); down reads rows of h by position, whatever token they
    hold."""
    tokens = 20
    tiles = moe.max_tiles(tokens, E, K, BT)
    _, indptr, _, _, sorted_token, tile_expert = aligned(routed(rng, tokens, "random"), tiles)
    row = misplace(sorted_token, BT, fault, tokens)
    x, _, w_gate_up, w_down = make_inputs(rng, tokens, H, E, F)
    if tile == "gate_up":
        run = functools.partial(run_tasks, moe.make_gate_up_tile(H, F, E), (tiles, 2 * F // 64),
                                x, w_gate_up, sorted_token, tile_expert, indptr,
                                np.zeros((tiles * BT, F), BF16))
    else:
        run = functools.partial(run_tasks, moe.make_down_tile(F, H, E), (tiles, H // 64),
                                np.zeros((tiles * BT, F), BF16), w_down, sorted_token,
                                tile_expert, indptr, np.zeros((tiles * BT, H), np.float32))
    if fault == "token" and tile == "down":
        run()
        return
    want = (rf"sorted_token\[{row}\] holds a pair after the padding row \d+ \(-1\) of tile "
            rf"{row // BT}" if fault == "hole" else
            rf"sorted_token\[{row}\] holds the token {tokens + 5}, past x's {tokens} rows")
    with pytest.raises(ExecutionError, match=rf"{tile}\({row // BT}, 0\): {want}"):
        run()


def test_grouped_gemms_check_their_rows_where_a_kernel_can_stop():
    """Each thread checks its row of the tile after the count (``count_pair_rows``): gate_up
    with both of ``pair_row_checks`` (a pair after padding; a token past x's rows, which
    its gather then reads as padding), down with the first."""
    graphs = one_call_graphs(128, 32, 4, 64)
    for name, checks, gathers in (("gate_up", {"0", "1"}, 1), ("down", {"0"}, 0)):
        source = build(graphs[name], one_call_dims(name, 20, 32, 4), strategy="static",
                       num_sms=132).cuda_source()
        assert set(re.findall(r"etc_input_check\([^;]*, t, (\d)\)", source)) == checks, name
        # the gathered row's token, or -1 (nothing read) past the 20 tokens
        clamps = re.findall(r"\(\(sorted_token_ptr\[([^]]*)\] < 20\) \? "
                            r"sorted_token_ptr\[([^]]*)\] : -1\)", source)
        assert len(clamps) == gathers and all(a == b for a, b in clamps), name


def test_align_over_chunks_refuses_empty_chunks():
    with pytest.raises(EtcError, match="chunk_tokens must be positive"):
        moe.make_align_count_tile(E, K, 0)


@pytest.mark.parametrize("tokens", (1, 2, 3, 16, 17, 100, 1024))
@pytest.mark.parametrize("experts, top_k, tile_rows", [(128, 8, 16), (8, 2, 4), (16, 4, 64)])
def test_max_tiles_holds_the_thinnest_routing(tokens, experts, top_k, tile_rows):
    """Token t picks experts t*K .. t*K + K - 1 (mod E): the pairs spread as thinly as a
    routing can, so every busy expert pads a partial tile. The bound holds, and is reached
    while T*K <= E."""
    topk = (np.arange(tokens)[:, None] * top_k + np.arange(top_k)) % experts
    tiles = moe.max_tiles(tokens, experts, top_k, tile_rows)
    used = moe.align_reference(topk, experts, tile_rows, tiles)[1][experts]
    assert used <= tiles
    if tokens * top_k <= experts:
        assert used == tiles == tokens * top_k


def test_interleaved_weights_split_back():
    gate, up = np.arange(2 * 3 * 32).reshape(2, 3, 32), -np.arange(2 * 3 * 32).reshape(2, 3, 32)
    both = moe.interleave_gate_up(gate, up)
    np.testing.assert_array_equal(both[:, :, :8], gate[:, :, :8])
    np.testing.assert_array_equal(both[:, :, 8:16], up[:, :, :8])
    for got, want in zip(moe.split_gate_up(both), (gate, up)):
        np.testing.assert_array_equal(got, want)


def test_blocked_columns_round_trip():
    w = np.arange(2 * 3 * 8).reshape(2, 3, 8)
    blocked = moe.block_columns(w, 4)
    assert blocked.shape == (2, 2, 3, 4)
    np.testing.assert_array_equal(blocked[:, 1], w[:, :, 4:])
    np.testing.assert_array_equal(moe.unblock_columns(blocked), w)
    with pytest.raises(EtcError, match="8 columns are no multiple of bn=3"):
        moe.block_columns(w, 3)


@pytest.mark.parametrize("tile_rows, engine", [(16, "mma"), (64, "wgmma")])
def test_blocked_weight_layer_is_the_same_layer(tile_rows, engine, rng):
    """Blocked weights change where the tiles read, not what they compute: both layers give
    the same bits."""
    x, w_router, w_gate_up, w_down = make_inputs(rng, 9, H, E, F)
    layers = [make_moe_layer(H, E, K, F, tile_rows=tile_rows, combine_cols=128, engine=engine,
                             blocked_weights=blocked) for blocked in (False, True)]
    blocked = moe_layer.blocked_expert_weights(w_gate_up, w_down, tile_rows)
    np.testing.assert_array_equal(execute(layers[1], x, w_router, *blocked),
                                  execute(layers[0], x, w_router, w_gate_up, w_down))


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("tokens", TOKENS)
def test_grouped_gemms_and_combine_references_are_within_their_bounds(tokens, routing, rng):
    """gate_up, down and combine over a real alignment: h, y and out against float64 of the
    same inputs; padding rows and unused tiles are not stored (left NaN)."""
    x, _, w_gate_up, w_down = make_inputs(rng, tokens, H, E, F)
    topk = routed(rng, tokens, routing)
    tiles = moe.max_tiles(tokens, E, K, BT)
    _, indptr, pair_row, pair_tile, sorted_token, tile_expert = aligned(topk, tiles)
    h = poisoned((tiles * BT, F), "bfloat16")
    run_tasks(moe.make_gate_up_tile(H, F, E), (tiles, 2 * F // 64), x, w_gate_up, sorted_token,
              tile_expert, indptr, h)
    w_gate, w_up = moe.split_gate_up(w_gate_up)
    rows = pair_row.ravel()
    experts = topk.ravel()
    tok = np.repeat(np.arange(tokens), K)
    for e in np.unique(experts):
        mine = experts == e
        assert_within(h[rows[mine]], *moe.gate_up_reference(x[tok[mine]], w_gate[e], w_up[e]))
    unstored = np.flatnonzero(sorted_token < 0)  # padding rows, unused tiles
    assert len(unstored) > (tiles - indptr[E]) * BT  # padding rows among them
    assert np.isnan(h[unstored].astype(np.float32)).all()

    y = poisoned((tiles * BT, H), "float32")
    run_tasks(moe.make_down_tile(F, H, E), (tiles, H // 64), h, w_down, sorted_token,
              tile_expert, indptr, y)
    for r, e in zip(rows, experts):
        hr = h[r].astype(np.float64)
        wd = np.abs(w_down[e].astype(np.float64))
        assert_within(y[r], hr @ w_down[e].astype(np.float64), F * 2.0 ** -22 * (np.abs(hr) @ wd))
    assert np.isnan(y[unstored]).all()

    topw = rng.dirichlet(np.ones(K), tokens).astype(np.float32)
    ys = y[pair_row]
    want = np.einsum("tk,tkh->th", topw.astype(np.float64), ys.astype(np.float64))
    for combine_tokens in (1, 3):  # 3: a partial last block at 1, 7 and 20 tokens
        out = poisoned((tokens, H), "bfloat16")
        run_tasks(moe.make_combine_tile(H, K, 64, tokens=combine_tokens),
                  (-(-tokens // combine_tokens), H // 64), topw, pair_row, pair_tile, y, out)
        assert_within(out, want, moe.combine_bound(topw, ys))


@pytest.mark.parametrize("routing", ["random", "one_expert"])
def test_expert_gemms_alone_are_the_layers_gemms(routing, rng):
    """``make_expert_gemms``: gate_up -> down of the layer's tiles on a routing given as
    inputs; y's rows of every (token, k) pair against float64, in any task order."""
    tokens = 21
    x, _, w_gate_up, w_down = make_inputs(rng, tokens, H, E, F)
    topk = routed(rng, tokens, routing)
    dims = moe_layer.expert_gemm_dims(tokens, E, K, BT)
    _, indptr, pair_row, _, sorted_token, tile_expert = aligned(topk, dims["tiles"])
    graph = moe_layer.make_expert_gemms(H, E, F, tile_rows=BT, top_k=K, combine_cols=64)
    y = execute(graph, x, w_gate_up, w_down, sorted_token, tile_expert, indptr,
                order=RandomOrder(3))
    assert y.shape == (dims["rows"], H)
    w_gate, w_up = moe.split_gate_up(w_gate_up)
    for e in np.unique(topk):
        token, k = np.nonzero(topk == e)
        h64, bound_h = moe.gate_up_reference(x[token], w_gate[e], w_up[e])
        wd = w_down[e].astype(np.float64)
        assert_within(y[pair_row[token, k]], h64 @ wd, bound_h @ np.abs(wd)
                      + F * 2.0 ** -22 * ((np.abs(h64) + bound_h) @ np.abs(wd)))


@pytest.mark.parametrize("tokens", (1, 5))
def test_qk_norm_rope_reference_is_within_its_bound(tokens, rng):
    Hq, Hk, D = 4, 2, 128
    q = (3 * rng.standard_normal((tokens, Hq * D))).astype(BF16)
    k = rng.standard_normal((tokens, Hk * D)).astype(BF16)
    qw = (1 + 0.1 * rng.standard_normal(D)).astype(BF16)
    kw = (1 + 0.1 * rng.standard_normal(D)).astype(BF16)
    positions = rng.integers(0, 200_000, tokens).astype(np.int32)
    q_out, k_out = poisoned(q.shape, "bfloat16"), poisoned(k.shape, "bfloat16")
    run_tasks(rope.make_qk_norm_rope_tile(Hq, Hk, D), (tokens,), q, k, qw, kw, positions,
              q_out, k_out)
    for got, x, w, heads in ((q_out, q, qw, Hq), (k_out, k, kw, Hk)):
        want = rope.qk_norm_rope_exact(x, w, positions, heads, D)[0]
        assert_within(got, want, rope.error_bound(x, w, positions, heads, D))


def test_rotation_at_position_zero_is_the_norm_alone(rng):
    x = rng.standard_normal((2, 128))
    out, xn = rope.qk_norm_rope_exact(x, np.ones(128), np.zeros(2), 1, 128)
    np.testing.assert_allclose(out, xn)
    np.testing.assert_allclose((xn * xn).mean(axis=1), 1, rtol=1e-5)


# ------------------------------------------------------------------ the layer, executed
def deal(order, queues):
    return [order[k::queues] for k in range(queues)]


def _mixed(task_graph, ctas):
    schedule, ring_calls = mixed_schedule(task_graph, ctas)
    names = {task_graph.calls[c].fn.name.split("_")[0] for c in ring_calls}
    assert names == {"gate", "down"}
    return MixedOrder(schedule.queues, ring_calls)


ORDERS = {
    "static5": lambda tg: StaticOrder(deal(tg.topological_order(), 5)),
    "static3-seeded": lambda tg: StaticOrder(deal(tg.topological_order(), 3), seed=4),
    "dynamic3": lambda tg: DynamicQueueOrder(3),
    "ready": lambda tg: ReadyQueueOrder(),
    "mixed3": lambda tg: _mixed(tg, 3),
    "mixed1": lambda tg: _mixed(tg, 1),
    "random0": lambda tg: RandomOrder(0),
}


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("tokens", TOKENS)
def test_layer_matches_float64_under_every_order(tokens, routing, order):
    rng = np.random.default_rng(hash((tokens, routing)) % 2**32)
    inputs = make_inputs(rng, tokens, H, E, F, routing)
    graph = small_layer()
    out = execute(graph, *inputs, order=ORDERS[order](TaskGraph.build(graph, {"T": tokens})))
    assert out.dtype == BF16 and out.shape == (tokens, H)
    want, bound = moe_layer_reference(*inputs, K)
    assert_within(out, want, bound)


@pytest.mark.parametrize("tokens", (1, 7))
def test_layer_with_split_router_matches_float64(tokens, rng):
    """Router tasks over 4 splits of the hidden rows, their partial logits summed by top-K."""
    graph = make_moe_layer(H, E, K, F, combine_cols=64, router_splits=4)
    router = next(c for c in TaskGraph.build(graph, {"T": tokens}).calls
                  if c.fn.name.startswith("router"))
    assert router.grid == (1, 4, E // 16)
    inputs = make_inputs(rng, tokens, H, E, F)
    want, bound = moe_layer_reference(*inputs, K)
    assert_within(execute(graph, *inputs, order=RandomOrder(3)), want, bound)


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("tokens", TOKENS)
def test_layer_with_bf16_y_matches_float64(tokens, routing, rng):
    """Down's output stored in bf16: within the bound that counts its rounding, and the
    fp32 layer's bound alone does not cover the rounding's share everywhere."""
    graph = make_moe_layer(H, E, K, F, combine_cols=64, y_dtype="bfloat16")
    inputs = make_inputs(rng, tokens, H, E, F, routing)
    out = execute(graph, *inputs, order=RandomOrder(4))
    want, bound = moe_layer_reference(*inputs, K, y_dtype="bfloat16")
    assert_within(out, want, bound)
    assert (bound > moe_layer_reference(*inputs, K)[1]).all()


ALIGN_CALLS = {3: {}, 2: {"place_offsets": True},
               1: {"place_offsets": True, "topk_counts": True}}


@pytest.mark.parametrize("calls", ALIGN_CALLS)
@pytest.mark.parametrize("order", ["random0", "mixed3", "dynamic3"])
@pytest.mark.parametrize("tokens, chunk", [(7, 8), (20, 8), (20, 16)])
def test_layer_with_align_over_chunks_matches_float64(tokens, chunk, order, calls):
    """Align over several CTAs, in three calls, in two (``place_offsets``) or in one
    (``topk_counts``), under several orders: chunks of one top-k block (1 and 3 chunks), and
    of two (20 tokens: the last chunk waits on one block)."""
    rng = np.random.default_rng(tokens)
    graph = make_moe_layer(H, E, K, F, combine_cols=64, align_tokens=chunk,
                           **ALIGN_CALLS[calls])
    tasks = {c.fn.name: c.num_tasks for c in TaskGraph.build(graph, {"T": tokens}).calls
             if c.fn.name.startswith(("align", "topk"))}
    chunks, blocks = -(-tokens // chunk), -(-tokens // 8)
    rows = f"align_rows_16_top4_bt16_c{chunk}" + ("_n8" if chunk != 8 else "") + "_t128"
    assert tasks == {
        3: {"topk_16_top4_b8_s1_t128": blocks, f"align_count_16_top4_c{chunk}_t128": chunks,
            "align_offsets_16_bt16_t128": 1,
            f"align_place_16_top4_bt16_c{chunk}_t128": chunks},
        2: {"topk_16_top4_b8_s1_t128": blocks, f"align_count_16_top4_c{chunk}_t128": chunks,
            f"align_rows_16_top4_bt16_c{chunk}_t128": chunks},
        1: {"topk_16_top4_b8_s1_t128_counts": blocks, rows: chunks}}[calls]
    inputs = make_inputs(rng, tokens, H, E, F)
    out = execute(graph, *inputs, order=ORDERS[order](TaskGraph.build(graph, {"T": tokens})))
    want, bound = moe_layer_reference(*inputs, K)
    assert_within(out, want, bound)


def test_place_offsets_take_align_over_several_ctas():
    with pytest.raises(ValueError, match="place_offsets folds align's offsets"):
        make_moe_layer(H, E, K, F, place_offsets=True)
    assert not moe_layer.options_for(16, place_offsets=True)["place_offsets"]
    assert not moe_layer.options_for(16)["place_offsets"]
    assert moe_layer.options_for(1024)["place_offsets"]
    assert not moe_layer.options_for(1024, place_offsets=False)["place_offsets"]


def test_topk_counts_take_place_offsets():
    with pytest.raises(ValueError, match="topk_counts hands the top-k tasks' counts"):
        make_moe_layer(H, E, K, F, align_tokens=8, topk_counts=True)
    assert not moe_layer.options_for(16, topk_counts=True)["topk_counts"]
    assert not moe_layer.options_for(1024, place_offsets=False, topk_counts=True)["topk_counts"]


@pytest.mark.parametrize("tokens, block_tokens, counts", [
    (16, 16, False), (512, 16, True), (1024, 8, True), (1100, 8, False), (2048, 8, False)])
def test_top_k_tasks_count_while_few_rows_of_counts_are_summed(tokens, block_tokens, counts):
    options = moe_layer.options_for(tokens)
    assert (options["block_tokens"], options["topk_counts"]) == (block_tokens, counts)
    assert not moe_layer.options_for(tokens, topk_counts=False)["topk_counts"]
    assert moe_layer.options_for(tokens, topk_counts=True)["topk_counts"] == (tokens >= 512)


def test_routing_triggers_arm_with_the_last_align_call():
    """Every ETensor armed at run time (the gate_up and down triggers read exp_indptr, the
    combine's waits pair_tile) is armed by the place call's completion, the routing's last:
    were one armed by the offsets call's, that task's CTA would arm thousands of tasks while
    holding a place task it claimed ahead."""
    for place_offsets, name in ((False, "align_place"), (True, "align_rows")):
        graph = make_moe_layer(**moe_layer.options_for(1024, place_offsets=place_offsets))
        task_graph = TaskGraph.build(graph, {"T": 1024})
        place = next(c.index for c in task_graph.calls if c.fn.name.startswith(name))
        gates = task_graph.gates()
        assert gates and all(calls == {place} for calls in gates.values()), gates


@pytest.mark.parametrize("align_tokens", [12, -8])
def test_align_tokens_must_be_whole_top_k_blocks(align_tokens):
    with pytest.raises(ValueError, match=f"align_tokens {align_tokens} must be 0 .one align "
                       "task. or a positive multiple of block_tokens 8"):
        make_moe_layer(H, E, K, F, align_tokens=align_tokens)


@pytest.mark.parametrize("option", moe_layer.SIZE_OPTIONS)
def test_options_for_refuses_a_size_below_one(option):
    """0 is not "the layer's choice" (None is)."""
    with pytest.raises(ValueError, match=f"options_for: {option}=0: a size must be positive"):
        moe_layer.options_for(16, **{option: 0})


@pytest.mark.parametrize("tokens, shape, message", [
    (0, {}, "tokens=0"), (-3, {}, "tokens=-3"), (2.0, {}, "tokens=2.0"),
    (1, {"experts": 0}, "experts=0"), (1, {"top_k": 0}, "top_k=0"),
    (1, {"hidden": 0, "intermediate": -1}, "hidden=0, intermediate=-1"),
])
def test_options_for_refuses_tokens_or_a_shape_below_one(tokens, shape, message):
    # before, 0 experts divided by zero, -3 tokens was a math domain error, the rest passed
    with pytest.raises(ValueError, match=f"options_for: {message}: the tokens and the layer's "
                                         "shape are positive integers"):
        moe_layer.options_for(tokens, **shape)


def test_options_for_refuses_more_picks_than_experts():
    with pytest.raises(ValueError, match="top_k=32 picks more experts than the 16 there are"):
        moe_layer.options_for(1, experts=16, top_k=32)


@pytest.mark.parametrize("tokens, align_tokens", [(1, 0), (128, 0), (511, 0), (512, 64),
                                                  (4096, 64)])
def test_align_runs_over_several_ctas_from_512_tokens(tokens, align_tokens):
    options = moe_layer.options_for(tokens)
    assert (options["align_tokens"], options["fused_route"]) == (align_tokens, not align_tokens)
    one_task = moe_layer.options_for(tokens, align_tokens=0)
    assert (one_task["align_tokens"], one_task["fused_route"]) == (0, True)
    split = moe_layer.options_for(tokens, fused_route=False)
    assert (split["align_tokens"], split["fused_route"]) == (align_tokens, False)


@pytest.mark.parametrize("make", [
    lambda: moe.make_down_tile(64, 128, 16, y_dtype="float16"),
    lambda: moe.make_combine_tile(128, 4, 64, y_dtype="int8")])
def test_y_must_be_fp32_or_bf16(make):
    with pytest.raises(EtcError, match=r"y_dtype must be one of \('float32', 'bfloat16'\)"):
        make()


def k_loops(source: str) -> list[str]:
    """The bodies of the generated CUDA's K loops (``for (int ko...``), braces included."""
    bodies = []
    for loop in re.finditer(r"for \(int ko\w* = 0;", source):
        start = depth = source.index("{", loop.end())
        for end in range(start, len(source)):
            depth = depth + {"{": 1, "}": -1}.get(source[end], 0) if end > start else 1
            if depth == 0:
                break
        bodies.append(source[start:end + 1])
    return bodies


def test_combine_waits_on_its_pairs_in_one_round():
    """The claimed static layer at 1024 tokens (combine tasks of 2 tokens, 8 pairs each):
    warp 0's lanes wait on the 16 pairs' tiles at once, a pair a lane, with no loop over the
    tokens (which made one round of loads a token)."""
    options = moe_layer.options_for(1024, blocked_weights=True, y_dtype="bfloat16")
    assert options["combine_tokens"] == 2
    source = build(make_moe_layer(**options), {"T": 1024}, strategy="static", num_sms=132,
                   options=KernelOptions(ctas_per_sm=options["ctas_per_sm"],
                                         claim=True)).cuda_source()
    wait = source.index("etc_wait((&(counters_ptr[(pair_tile_ptr[")
    lanes = source[source.rindex("tvm_builtin_cuda_any_sync", 0, wait):wait]
    assert "for (" not in lanes and "if (((int)threadIdx.x) < 16)" in lanes
    assert "threadIdx.x" in source[wait:source.index("\n", wait)]


@pytest.mark.parametrize("tokens", (1, 1024, 2048))
def test_grouped_gemm_k_loops_read_no_row_index(tokens):
    """A gathered tile's A rows (sorted_token) are looked up once a task, not every K slice:
    the megakernel could not hoist those loads (16-row mma tiles at one token, 64 x 256 and
    128 x 256 wgmma tiles at 1024 and 2048)."""
    options = moe_layer.options_for(tokens, blocked_weights=True, y_dtype="bfloat16")
    source = build(make_moe_layer(**options), {"T": tokens}, strategy="static", num_sms=132,
                   options=KernelOptions(ctas_per_sm=options["ctas_per_sm"],
                                         claim=True)).cuda_source()
    loops = k_loops(source)
    assert len(loops) >= 2 and all("mma" in body for body in loops), len(loops)
    assert not [body for body in loops if "sorted_token" in body]
    assert "sorted_token" in source


@pytest.mark.parametrize("tokens", (7, 20))
def test_layer_with_combine_tasks_of_several_tokens_matches_float64(tokens, rng):
    """Combine tasks of 3 tokens (a partial last block at 7 and 20), each waiting on the
    tiles of its tokens' pairs through ``pair_tile[3*b:3*b+3, :]``."""
    graph = make_moe_layer(H, E, K, F, combine_cols=64, combine_tokens=3)
    combine = next(c for c in TaskGraph.build(graph, {"T": tokens}).calls
                   if c.fn.name.startswith("combine"))
    assert combine.fn.name.endswith("_b3") and combine.grid == (-(-tokens // 3), H // 64)
    inputs = make_inputs(rng, tokens, H, E, F)
    want, bound = moe_layer_reference(*inputs, K)
    for order in (RandomOrder(7), ReadyQueueOrder()):
        assert_within(execute(graph, *inputs, order=order), want, bound)


def test_combine_tasks_of_several_tokens_compile_for_sm90a(tmp_path):
    """The claimed static layer of 2048 tokens with combine tasks of 2 tokens."""
    options = moe_layer.options_for(2048, blocked_weights=True, y_dtype="bfloat16",
                                    combine_tokens=2)
    names = compile_layer(make_moe_layer(**options), 2048, tmp_path, "static",
                          options["ctas_per_sm"])
    assert "combine_2048_top8_c2048_t256_b2_ybf16" in names, names


def test_combine_tasks_that_prefetch_their_rows_compile_for_sm90a(tmp_path):
    """The claimed static layer of 2048 tokens whose combine tasks first ask for their 32 rows
    of y in L2: one bulk prefetch (UBLKPF) a row, from one thread each."""
    options = moe_layer.options_for(2048, blocked_weights=True, y_dtype="bfloat16",
                                    combine_prefetch=True)
    graph = make_moe_layer(**options)
    assert "combine_2048_top8_c2048_t256_b4_l2_ybf16" in {
        c.fn.name for c in TaskGraph.build(graph, {"T": 2048}).calls}
    source = build(graph, {"T": 2048}, strategy="static", num_sms=132,
                   options=KernelOptions(ctas_per_sm=options["ctas_per_sm"], claim=True)
                   ).cuda_source()
    assert "cp.async.bulk.prefetch.L2.global" in source
    cubin, _ = build_cubin(source, tmp_path, allow_spills=True)
    assert "UBLKPF.L2" in sass(cubin)


def test_combine_prefetch_takes_whole_16_byte_rows():
    moe.make_combine_tile(2048, 8, 8, 128, "bfloat16", prefetch=True)  # 16 bytes a row
    with pytest.raises(EtcError, match="multiple of 16 bytes; cols=4 of bfloat16 make 8"):
        moe.make_combine_tile(2048, 8, 4, 128, "bfloat16", prefetch=True)


def test_bf16_y_layer_compiles_for_sm90a(tmp_path):
    graph = make_moe_layer(**moe_layer.options_for(512, engine="wgmma", ctas_per_sm=2,
                                                   blocked_weights=True, y_dtype="bfloat16"))
    names = compile_layer(graph, 512, tmp_path, "dynamic", ctas_per_sm=2)
    assert {"down_768x2048_e128_64x256x32_s5_t128_wgmma_blocked_ybf16",
            "combine_2048_top8_c2048_t128_b2_ybf16"} <= names, names


@pytest.mark.parametrize("tokens", (1, 1024))
def test_early_weights_layer_compiles_for_sm90a(tokens, tmp_path):
    """Down tasks that load their first weight slices in their prelude, in the static kernel
    as bench_moe builds it (claimed), the tiles' defaults otherwise: no wgmma serialised."""
    options = moe_layer.options_for(tokens, blocked_weights=True, y_dtype="bfloat16",
                                    early_weights=True)
    graph = make_moe_layer(**options)
    _, report = build_cubin(build(graph, {"T": tokens}, strategy="static", num_sms=132,
                                  options=KernelOptions(ctas_per_sm=options["ctas_per_sm"],
                                                        claim=True)).cuda_source(),
                            tmp_path, allow_spills=True)
    assert "serializ" not in report, report[-4000:]
    down = next(c for c in TaskGraph.build(graph, {"T": tokens}).calls
                if c.fn.name.startswith("down"))
    assert down.fn.name.endswith("_early") and down.fn.prelude_reads == ("w_down",
                                                                         "tile_expert")


@pytest.mark.parametrize("order", ["random0", "static5", "dynamic3"])
@pytest.mark.parametrize("option, engine, tile_rows, tokens", [
    ("early_weights", "mma", 16, 7), ("early_weights", "wgmma", 64, 20),
    ("early_weights", "swapped", 24, 20), ("routed_gate_up", "mma", 16, 1),
    ("routed_gate_up", "mma", 16, 4), ("routed_gate_up", "swapped", 8, 3)])
def test_layer_with_early_weights_or_routed_gate_up_matches_float64(option, engine, tile_rows,
                                                                    tokens, order):
    """The down tasks' prelude runs on the reference executor too (as the whole task, once
    its waits are done), and the gate_up tasks that route themselves do (the unused tiles'
    doing nothing): the same layer."""
    graph = make_moe_layer(H, E, K, F, combine_cols=128, tile_rows=tile_rows, engine=engine,
                           **{option: True})
    rng = np.random.default_rng(tokens)
    inputs = make_inputs(rng, tokens, H, E, F)
    out = execute(graph, *inputs, order=ORDERS[order](TaskGraph.build(graph, {"T": tokens})))
    want, bound = moe_layer_reference(*inputs, K)
    assert_within(out, want, bound)


def compile_one_token_kernels(graph, tmp_path) -> None:
    """The one-token ``graph``'s claimed static and dynamic kernels at one CTA an SM on 132
    SMs, compiled for sm_90a (``build_cubin``: no spill)."""
    for strategy, claim in (("static", True), ("dynamic", False)):
        build_cubin(build(graph, {"T": 1}, strategy=strategy, num_sms=132,
                          options=KernelOptions(ctas_per_sm=1, claim=claim)).cuda_source(),
                    tmp_path)


def test_one_cta_an_sm_layer_with_deep_rings_compiles_and_matches_float64(tmp_path):
    """One token on one CTA an SM, as ``bench_moe --ctas-per-sm 1 --bn 96 --down-bn 128
    --stages 10`` builds it: 128 gate_up tasks of 96 columns and 128 down tasks of 128, one
    of each an SM, through 10-stage rings (165 and 193 KB, past what two CTAs an SM hold).
    The claimed static and the dynamic kernels compile for sm_90a without spills; the small
    layer of the same task widths matches float64 on the reference executor."""
    options = moe_layer.options_for(1, blocked_weights=True, y_dtype="bfloat16",
                                    ctas_per_sm=1, bn=96, down_bn=128, stages=10)
    graph = make_moe_layer(**options)
    calls = {c.fn.name: c.num_tasks for c in TaskGraph.build(graph, {"T": 1}).calls}
    assert calls["gate_up_2048x768_e128_16x96x64_s10_t128_blocked_routed_top8_s8"] == 128
    assert calls["down_768x2048_e128_16x128x64_s10_t128_blocked_ybf16_early"] == 128
    compile_one_token_kernels(graph, tmp_path)
    inputs = make_inputs(np.random.default_rng(1), 1, H, E, 192)  # 2F and F: 96s and 64s
    small = make_moe_layer(H, E, K, 192, bn=96, down_bn=128, combine_cols=128, stages=10,
                           ctas_per_sm=1, blocked_weights=True, routed_gate_up=True,
                           early_weights=True)
    weights = moe_layer.blocked_expert_weights(*inputs[2:], BT, 96, 128)
    want, bound = moe_layer_reference(*inputs, K)
    assert_within(execute(small, *inputs[:2], *weights, order=RandomOrder(seed=1)), want, bound)


def test_down_stages_deepen_gate_up_ring_alone(tmp_path):
    """``down_stages`` sets down's ring apart from ``stages`` (bench_moe ``--down-stages``):
    one token on 10-stage gate_up rings with down's at the default 5 stages (4 slices of 128
    columns issued before its wait), whose claimed static and dynamic kernels compile for
    sm_90a without spills; down's alone deepened leaves gate_up's; a ring of no stages is
    refused."""
    options = moe_layer.options_for(1, blocked_weights=True, y_dtype="bfloat16", stages=10,
                                    down_stages=5)
    graph = make_moe_layer(**options)
    calls = {c.fn.name: c.num_tasks for c in TaskGraph.build(graph, {"T": 1}).calls}
    assert calls["gate_up_2048x768_e128_16x96x64_s10_t128_blocked_routed_top8_s8"] == 128
    assert calls["down_768x2048_e128_16x128x64_s5_t128_blocked_ybf16_early"] == 128
    compile_one_token_kernels(graph, tmp_path)
    deep_down = make_moe_layer(**moe_layer.options_for(1, down_stages=8))
    names = [c.fn.name for c in TaskGraph.build(deep_down, {"T": 1}).calls]
    assert any(n.startswith("gate_up_") and "_s5_" in n for n in names), names
    assert any(n.startswith("down_") and "_s8_" in n for n in names), names
    with pytest.raises(ValueError, match="down_stages=0"):
        moe_layer.options_for(1, down_stages=0)
    with pytest.raises(EtcError, match="stages=0"):  # not taken for "the default"
        make_moe_layer(down_stages=0)


def test_routed_gate_up_layer_compiles_for_sm90a(tmp_path):
    """gate_up tasks that route themselves from the router's logits, in the static kernel as
    bench_moe builds it at one token (claimed): they wait for the router's element, not for
    the route task, and read no routing tensor; no register spilled."""
    options = moe_layer.options_for(1, blocked_weights=True, y_dtype="bfloat16",
                                    routed_gate_up=True)
    graph = make_moe_layer(**options)
    build_cubin(build(graph, {"T": 1}, strategy="static", num_sms=132,
                      options=KernelOptions(ctas_per_sm=options["ctas_per_sm"],
                                            claim=True)).cuda_source(), tmp_path)
    tasks = TaskGraph.build(graph, {"T": 1})
    gate_up = next(c for c in tasks.calls if c.fn.name.startswith("gate_up"))
    assert gate_up.fn.name.endswith("_routed_top8_s8")
    assert [p.name for p in gate_up.fn.buffer_params] == ["x", "w_gate_up", "logits", "h"]
    assert [(e.etensor, str(e.map)) for e in gate_up.in_edges] == [("logits_ready",
                                                                    "gn->0")]
    assert not tasks.completion_waits(gate_up)


def test_routed_gate_up_refuses_more_tokens_than_it_routes():
    graph = make_moe_layer(H, E, K, F, combine_cols=128, routed_gate_up=True)
    inputs = make_inputs(np.random.default_rng(0), 5, H, E, F)
    with pytest.raises(GraphError, match=r"call h: gate_up\w*_routed_top4_s1 takes T <= 4: "
                       r"the tile routes itself .* got x \(5, 128\)"):
        execute(graph, *inputs)
    with pytest.raises(ValueError, match="router_tokens 2 must cover the 4 tokens"):
        make_moe_layer(H, E, K, F, combine_cols=128, routed_gate_up=True, block_tokens=2)


def test_routed_gate_up_refuses_an_h_without_room_for_every_tile():
    """A routed task writes its tile's rows wherever its tile is used: h must hold
    max_tiles(T) tiles of rows (4 at one token of top-4 over 16 experts), whatever the grid."""
    tile = moe.make_gate_up_tile(H, F, E, BT, routing=moe.LogitRouting(K, 1))

    @graph_func
    def one_tile(x: Tensor(("T", H), "bfloat16"), w: Tensor((E, H, 2 * F), "bfloat16"),
                 logits: Tensor((1, "T", E), "float32")):
        return call_device(tile, tile_num=(1, 2 * F // 64), args=[x, w, logits],
                           out=Tensor((BT, F), "bfloat16"))

    x, _, w, _ = make_inputs(np.random.default_rng(0), 1, H, E, F)
    with pytest.raises(GraphError, match=r"takes rows >= 16 x max_tiles\(T\): h holds every "
                       r"tile a routing can use, got .*\(16, 64\)"):
        execute(one_tile, x, w, np.zeros((1, 1, E), np.float32))


@pytest.mark.parametrize("experts", (128, 30))
def test_tile_from_logits_compiles_for_sm90a(experts, tmp_path):
    """What a routed gate_up task runs to find its tile, alone (the GPU test compares it with
    align's): its warp scan shuffles on every lane."""
    source = build(routed_tiles_graph(experts, 8), {"T": 3}, strategy="unfused").cuda_source()
    assert re.search(r"__shfl_up_sync\(\(uint\)4294967295, run\w*\[0\], 16, 32\);\n"
                     r" *if \(16 <=", source)
    build_cubin(source, tmp_path)


def test_early_weights_are_cp_async_copies():
    with pytest.raises(EtcError, match="early_weights issues cp.async copies"):
        moe.make_down_tile(768, 2048, 128, 64, 128, 64, 128, 4, "wgmma", loads="tma",
                           early_weights=True)


def innermost_loops(code: str) -> list[list[str]]:
    """The instructions of each innermost loop of SASS ``code``: the span from a backward
    branch's target to the branch, holding no other backward branch."""
    loops = []
    for function in re.split(r"\n\s*Function : ", code)[1:]:
        body = [(int(a, 16), op.strip()) for a, op in
                re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", function)]
        back = [(int(m.group(1), 16), at) for at, op in body
                if (m := re.search(r"\bBRA(?:\.\w+)*\s+(0x[0-9a-f]+)", op))
                and int(m.group(1), 16) < at]
        loops += [[op for at, op in body if lo <= at <= hi] for lo, hi in back
                  if not any(lo <= a and b < hi for a, b in back if (a, b) != (lo, hi))]
    return loops


def vector_built_uniforms(loop: list[str]) -> list[str]:
    """The ``R2UR`` of SASS ``loop`` whose vector register the loop computed rather than
    copied from a uniform one: values (wgmma descriptors) rebuilt in the vector datapath
    every iteration. A copy out of a uniform register and back is ptxas rematerialising a
    loop-invariant value under uniform-register pressure (two instructions, no arithmetic)."""
    made, found = {}, []
    for second, op in [(False, op) for op in loop] + [(True, op) for op in loop]:
        name, _, rest = re.sub(r"^@!?U?P\w+\s+", "", op).partition(" ")
        args = [a.strip().split(".")[0] for a in rest.split(",")]
        if name == "R2UR" and second:
            source = made.get(args[1], ("", []))
            if not (source[0] in ("MOV", "IMAD.U32", "IMAD.MOV.U32")
                    and all(a == "RZ" or a.startswith("UR") for a in source[1])
                    and any(a.startswith("UR") for a in source[1])):
                found.append(op)
        elif args and re.fullmatch(r"R\d+", args[0]):
            made[args[0]] = (name, args[1:])
    return found


@pytest.mark.parametrize("tokens", (1, 1024))
@pytest.mark.parametrize("model", [m for m in moe_layer.MODELS if m != "qwen3-30b-a3b"])
def test_other_models_static_layers_compile_without_spills(model, tokens, tmp_path):
    """The claimed static kernel as ``bench_moe --model`` builds it compiles for sm_90a, no
    register spilled (the tiles, rings and CTAs an SM ``options_for`` picks for that shape)."""
    options = moe_layer.options_for(tokens, **moe_layer.MODELS[model], blocked_weights=True,
                                    y_dtype="bfloat16")
    build_cubin(build(make_moe_layer(**options), {"T": tokens}, strategy="static",
                      num_sms=132, options=KernelOptions(ctas_per_sm=options["ctas_per_sm"],
                                                         claim=True)).cuda_source(), tmp_path)


@pytest.mark.parametrize("strategy", ["dynamic", "mixed"])
def test_ring_layers_at_1024_tokens_leave_room_for_four_ctas_an_sm(strategy, tmp_path):
    """The ring kernels as ``bench_moe`` builds them at 1024 tokens, four CTAs an SM of the
    largest arena: their static shared memory fits what ``arena_limit`` leaves it (checked by
    ``build_cubin``), or the cooperative launch fails."""
    options = moe_layer.options_for(1024, **moe_layer.QWEN3_30B_A3B, blocked_weights=True,
                                    y_dtype="bfloat16")
    assert options["ctas_per_sm"] == 4
    build_cubin(build(make_moe_layer(**options), {"T": 1024}, strategy=strategy, num_sms=132,
                      options=KernelOptions(ctas_per_sm=4)).cuda_source(), tmp_path,
                allow_spills=True)


@pytest.mark.parametrize("calls", ALIGN_CALLS)
def test_claimed_static_layer_keeps_wgmma_descriptors_in_uniform_registers(calls, tmp_path):
    """The static kernel as bench_moe builds it at 1024 tokens (claimed): its wgmma K loops
    build their descriptors in uniform registers, as the tiles' own grids do. The flag that
    guards a task's body after its trigger scan is read as a uniform value (``etc_uniform``);
    read as a plain shared word, it made ptxas take every task body for divergent code and
    rebuild the descriptors in vector registers (32 R2UR a K step of vector-built values).
    With align in one, two or three calls, no register is spilled."""
    options = moe_layer.options_for(1024, blocked_weights=True, y_dtype="bfloat16",
                                    **{"place_offsets": False, **ALIGN_CALLS[calls]})
    source = build(make_moe_layer(**options), {"T": 1024}, strategy="static", num_sms=132,
                   options=KernelOptions(ctas_per_sm=options["ctas_per_sm"], claim=True)
                   ).cuda_source()
    cubin, _ = build_cubin(source, tmp_path)
    wgmma = [loop for loop in innermost_loops(sass(cubin))
             if any("HGMMA." in op for op in loop)]
    assert len(wgmma) == 2, [len(loop) for loop in wgmma]  # gate_up's and down's K loops
    for loop in wgmma:
        assert not vector_built_uniforms(loop), "\n".join(loop)


def test_vector_built_uniforms_tells_copies_from_arithmetic():
    copied = ["IMAD.U32 R12, RZ, RZ, UR6", "R2UR UR29, R12",
              "HGMMA.64x80x16.F32.BF16 R24, gdesc[UR8], R24"]
    rebuilt = ["IADD3 R124, P1, R109, R122, RZ", "R2UR UR12, R124.reuse", "@P0 BRA 0x100"]
    carried = ["R2UR UR13, R125", "IMAD.X R125, R23, 0x1, R122, P1"]
    assert vector_built_uniforms(copied) == []
    assert vector_built_uniforms(rebuilt) == ["R2UR UR12, R124.reuse"]
    assert vector_built_uniforms(carried) == ["R2UR UR13, R125"]


def test_layer_routings_are_what_they_say(rng):
    for routing in ROUTINGS:
        topk, _ = moe.route(*make_inputs(rng, 20, H, E, F, routing)[:2], K)
        counts = np.bincount(topk.ravel(), minlength=E)
        if routing == "one_expert":
            assert (topk[:, 0] == HOT).all()
        if routing == "idle_experts":
            assert (counts[1::2] == 0).all() and (counts[::2] > 0).any()


@pytest.mark.parametrize("routing", ROUTINGS)
def test_unused_expert_tiles_are_skipped(routing, rng):
    """Only the tiles below exp_indptr[E] run a grouped-GEMM body; every task still runs once."""
    tokens = 7
    inputs = make_inputs(rng, tokens, H, E, F, routing)
    graph = small_layer()
    tg = TaskGraph.build(graph, {"T": tokens})
    runs = {}
    originals = {}
    for name, fn in graph.device_funcs.items():
        if name.startswith(("gate_up", "down")):
            originals[name] = fn.reference
            runs[name] = []
            fn.set_reference(lambda *a, _n=name, _f=fn.reference: (runs[_n].append(a[:2]),
                                                                    _f(*a)))
    trace = []
    try:
        execute(graph, *inputs, order=RandomOrder(2), trace=trace)
    finally:
        for name, fn in originals.items():
            graph.device_funcs[name].set_reference(fn)
    assert sorted(trace) == list(range(tg.num_tasks))
    topk, _ = moe.route(*inputs[:2], K)
    used = int(np.sum(-(-np.bincount(topk.ravel(), minlength=E) // BT)))
    gate_up_runs = next(v for n, v in runs.items() if n.startswith("gate_up"))
    down_runs = next(v for n, v in runs.items() if n.startswith("down"))
    assert sorted({g for g, _ in gate_up_runs}) == list(range(used))
    assert len(gate_up_runs) == used * 2 * F // 64 and len(down_runs) == used * H // 64


def test_layer_graph_is_valid_for_qwen3_sizes():
    """The full-size graph instantiates and validates for 1 and 4096 tokens."""
    graph = make_moe_layer()
    for tokens in (1, 4096):
        tg = TaskGraph.build(graph, {"T": tokens})
        tg.validate()


# ------------------------------------------------------------------ CUDA for sm_90a
@pytest.mark.parametrize("name", ["router", "router_mma", "align", "align_rows", "topk_align",
                                  "gate_up", "down", "combine", "qk_norm_rope"])
def test_each_tile_alone_compiles_for_sm90a(name, tmp_path):
    graph = one_call_graphs(2048, 128, 8, 768)[name]
    source = build(graph, one_call_dims(name, 16), strategy="unfused").cuda_source()
    if name in ("router_mma", "gate_up", "down"):
        assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in source
    build_cubin(source, tmp_path, allow_spills=True)


@pytest.mark.parametrize("experts, wide_loads", [(30, False), (600, True)])
def test_count_sums_compile_for_any_expert_count(experts, wide_loads, tmp_path):
    """The counting top-k and place pair where the count rows' experts are no quads (one
    expert a load) and where their quads outnumber the threads (two columns a thread)."""
    source = build(counted_align_graph(experts, 8), {"T": 1000}, strategy="unfused"
                   ).cuda_source()
    cubin, _ = build_cubin(source, tmp_path)
    assert ("LDG.E.128" in sass(cubin)) == wide_loads


def test_topk_rounds_reduce_the_warp_with_redux(tmp_path):
    """Each of a token's K rounds takes the warp's maximum and the lowest index holding it
    with one ``redux.sync`` each, and no butterfly shuffles: 2 tokens a warp, 8 rounds each."""
    graph = one_call_graphs(2048, 128, 8, 768)["topk"]
    cubin, _ = build_cubin(build(graph, one_call_dims("topk", 16), strategy="unfused")
                           .cuda_source(), tmp_path)
    code = sass(cubin)
    assert len(re.findall(r"REDUX\.MAX\.S32", code)) == 16
    assert len(re.findall(r"REDUX\.MIN\.S32", code)) == 16
    assert "SHFL.BFLY" not in code


@T.prim_func
def _order_keys(values: T.Buffer((8,), "float32"), keys: T.Buffer((8,), "int32"),
                back: T.Buffer((8,), "float32")):
    for i in range(8):
        keys[i] = moe.order_key(values[i])
        back[i] = moe.order_value(keys[i])


def test_order_key_orders_floats_with_both_zeros_alike():
    """The order key of TopKPicker's rounds, compiled for the CPU: its order is the floats',
    -0 and +0 map to one key, and the key maps back to the value (+0 for -0)."""
    values = np.array([-np.finfo(np.float32).max, -2.5, -1e-30, -0.0, 0.0, 1e-30, 1.0, 3e38],
                      np.float32)
    keys, back = np.zeros(8, np.int32), np.full(8, np.nan, np.float32)
    args = [tvm.runtime.tensor(a) for a in (values, keys, back)]
    tvm.compile(_order_keys, target="llvm")(*args)
    keys, back = args[1].numpy(), args[2].numpy()
    assert list(keys) == sorted(keys) and keys[3] == keys[4] == 0 and len(set(keys)) == 7
    np.testing.assert_array_equal(back, np.where(values == 0, 0, values))
    assert not np.signbit(back[3])


def compile_layer(graph, tokens, tmp_path, strategy="barrier", ctas_per_sm=1) -> set:
    """Compile the layer's megakernel for sm_90a at ``tokens`` tokens, with no wgmma that
    ptxas serialises (it decides for the whole kernel: one tile's loop can stall every
    other's MMAs); its tiles' names."""
    _, report = build_cubin(build(graph, {"T": tokens}, strategy=strategy, num_sms=132,
                                  options=KernelOptions(ctas_per_sm=ctas_per_sm)).cuda_source(),
                            tmp_path, allow_spills=True)
    assert "serializ" not in report, report[-4000:]
    return {c.fn.name for c in TaskGraph.build(graph, {"T": tokens}).calls}


@pytest.mark.parametrize("strategy", ["static", "dynamic", "mixed", "unfused"])
def test_layer_megakernel_compiles_for_sm90a(strategy, tmp_path):
    source = build(make_moe_layer(), {"T": 16}, strategy=strategy, num_sms=132).cuda_source()
    assert "__global__" in source
    build_cubin(source, tmp_path, allow_spills=True)


@pytest.mark.parametrize("tokens", (9, 20))
def test_layer_with_mma_router_matches_float64(tokens, rng):
    """The router on tensor cores: blocks of 16 tokens, rows past T read as zeros."""
    graph = make_moe_layer(H, E, K, F, combine_cols=64, router_engine="mma", block_tokens=16,
                           router_splits=2)
    router = next(c for c in TaskGraph.build(graph, {"T": tokens}).calls
                  if c.fn.name.startswith("router"))
    assert "_mma_" in router.fn.name and router.grid == (-(-tokens // 16), 2, 1)
    inputs = make_inputs(rng, tokens, H, E, F)
    want, bound = moe_layer_reference(*inputs, K)
    assert_within(execute(graph, *inputs, order=RandomOrder(5)), want, bound)


@pytest.mark.parametrize("tokens", (16, 41))
def test_layer_with_router_tasks_of_several_top_k_blocks_matches_float64(tokens, rng):
    """Router tasks of 32 tokens, top-k tasks of 16: a top-k task waits for the router block
    holding its tokens (41: a partial last router block and top-k block)."""
    graph = make_moe_layer(H, E, K, F, combine_cols=64, router_engine="mma", block_tokens=16,
                           router_tokens=32)
    calls = {c.fn.name.split("_")[0]: c for c in TaskGraph.build(graph, {"T": tokens}).calls}
    assert calls["router"].grid == (-(-tokens // 32), 1, 1)
    assert calls["topk"].grid == (-(-tokens // 16),)
    inputs = make_inputs(rng, tokens, H, E, F)
    want, bound = moe_layer_reference(*inputs, K)
    assert_within(execute(graph, *inputs, order=RandomOrder(3)), want, bound)


@pytest.mark.parametrize("tokens, options, want", [
    # one token: a round of gate_up and of down tasks at one CTA an SM (one_round_columns_for)
    (1, {}, (16, "mma", 128, 1, 96)),
    (1, {"ctas_per_sm": 2}, (16, "mma", 128, 2, 64)),
    # from two tokens swapped tiles, of 64 columns below 16 tokens
    (2, {}, (8, "swapped", 128, 4, 64)),
    (15, {}, (8, "swapped", 128, 4, 64)),
    (16, {}, (8, "swapped", 128, 4, 128)),
    (128, {}, (16, "swapped", 128, 4, 128)),
    (256, {}, (24, "swapped", 128, 4, 128)),
    (257, {}, (32, "swapped", 128, 4, 128)),
    (16, {"engine": "mma"}, (16, "mma", 128, 2, 64)),
    (8, {"bn": 128}, (8, "swapped", 128, 4, 128)),
    (512, {}, (48, "swapped", 128, 4, 128)),
    (1024, {}, (80, "swapped", 128, 4, 128)),
    (1200, {}, (96, "swapped", 128, 4, 128)),
    # an expert's pairs past a 96-row swapped tile: two warpgroups, one panel each
    (1300, {}, (104, "swapped", 256, 2, 128)),
    (2048, {}, (152, "swapped", 256, 2, 128)),
    (2600, {}, (192, "swapped", 256, 2, 128)),
    # past 192 rows: 128-row wgmma tiles on two warpgroups
    (2700, {}, (128, "wgmma", 256, 1, 256)),
    (4096, {}, (128, "wgmma", 256, 1, 256)),
    (1024, {"engine": "wgmma"}, (64, "wgmma", 128, 2, 256)),
    (2047, {"engine": "wgmma"}, (64, "wgmma", 128, 2, 256)),
    # two CTAs an SM leave a thread too few registers for 128 x 256 tasks
    (4096, {"ctas_per_sm": 2}, (64, "wgmma", 128, 2, 256)),
    (1024, {"tile_rows": 128, "ctas_per_sm": 2}, (128, "wgmma", 128, 2, 128)),
    (4096, {"engine": "mma"}, (64, "mma", 128, 2, 128)),
    (1024, {"tile_rows": 128}, (128, "wgmma", 256, 1, 256)),
])
def test_layer_options_pick_tiles_threads_and_ctas_by_tokens(tokens, options, want):
    """Swapped tiles of an expert's share of the pairs plus two standard deviations from two
    tokens: of up to 96 rows on one warpgroup at four CTAs an SM, of up to 192 on two at two;
    past that 128-row wgmma grouped GEMM tiles (from an expert's average 128 pairs), on two
    warpgroups at one CTA an SM; at one token 16-row mma tiles, 128 threads at one CTA an SM
    (two where asked for)."""
    got = moe_layer.options_for(tokens, **options)
    keys = ("tile_rows", "engine", "threads", "ctas_per_sm", "bn")
    assert tuple(got[k] for k in keys) == want
    if "tile_rows" not in options:
        engine = options.get("engine") or moe_layer.grouped_engine_for(tokens)
        assert moe_layer.tile_rows_for(tokens, ctas_per_sm=options.get("ctas_per_sm"),
                                       engine=engine) == want[0]


@pytest.mark.parametrize("tokens, options, want", [
    (1, {}, True), (2, {}, False), (16, {}, False), (1024, {}, False),
    (1, {"early_weights": False}, False), (1024, {"early_weights": True}, True),
    (1, {"down_loads": "tma", "engine": "wgmma", "tile_rows": 64}, False),
])
def test_layer_options_load_down_weights_early_at_few_tokens(tokens, options, want):
    assert moe_layer.options_for(tokens, **options)["early_weights"] is want


@pytest.mark.parametrize("tokens, options, want", [
    (1, {}, True), (2, {}, True), (3, {}, False), (1024, {}, False),
    (1, {"routed_gate_up": False}, False), (4, {"routed_gate_up": True}, True),
])
def test_layer_options_route_gate_up_at_few_tokens(tokens, options, want):
    assert moe_layer.options_for(tokens, **options)["routed_gate_up"] is want


def test_router_tokens_must_be_whole_top_k_blocks():
    with pytest.raises(ValueError, match="router_tokens 24 must be a multiple of block_tokens 16"):
        make_moe_layer(H, E, K, F, router_engine="mma", block_tokens=16, router_tokens=24)


def test_layer_options_pick_the_router_engine_by_tokens():
    one, some, many = (moe_layer.options_for(t) for t in (1, 512, 1024))
    key = ("router_engine", "block_tokens", "router_tokens", "experts_per_task", "router_splits")
    assert tuple(one[k] for k in key) == ("fma", 8, 8, 16, 8)
    assert tuple(some[k] for k in key) == ("mma", 16, 16, 32, 2)
    assert tuple(many[k] for k in key) == ("mma", 8, 32, 64, 4)
    assert moe_layer.options_for(1024, router_engine="fma")["block_tokens"] == 8
    # router tasks take whole top-k blocks
    assert moe_layer.options_for(1024, block_tokens=24)["router_tokens"] == 48


@pytest.mark.parametrize("tokens, hidden, ctas_per_sm, cols", [
    (1, 2048, None, 512), (128, 2048, None, 512), (256, 2048, None, 1024),
    (512, 2048, None, 2048), (1024, 2048, None, 2048), (1024, 1536, None, 1536),
    (1024, 4096, None, 4096), (64, 4096, None, 512),
    # at two CTAs an SM half the tasks do
    (64, 2048, 2, 512), (128, 2048, 2, 1024), (200, 2048, 2, 1024), (256, 2048, 2, 2048),
    (64, 4096, 2, 1024)])
def test_combine_tasks_widen_with_the_tokens(tokens, hidden, ctas_per_sm, cols):
    options = moe_layer.options_for(tokens, hidden=hidden, ctas_per_sm=ctas_per_sm)
    assert moe_layer.combine_cols_for(tokens, hidden, options["ctas_per_sm"]) == cols
    assert options["combine_cols"] == cols


@pytest.mark.parametrize("tokens, hidden, block", [(1, 2048, 1), (128, 2048, 1), (256, 2048, 1),
                                                   (512, 2048, 1), (1020, 2048, 1),
                                                   (1024, 2048, 2), (1101, 2048, 2),
                                                   (2048, 2048, 4), (4096, 2048, 4),
                                                   (1024, 4096, 2)])
def test_combine_tasks_sum_more_tokens_while_they_stay_many(tokens, hidden, block):
    """Blocks of 4 or 2 tokens while they make a combine task for about every persistent CTA
    (four CTAs an SM at 512 - 1250 tokens, two at 2048, one at 4096)."""
    options = moe_layer.options_for(tokens, hidden=hidden)
    ctas_per_sm = options["ctas_per_sm"]
    assert moe_layer.combine_tokens_for(tokens, hidden, ctas_per_sm=ctas_per_sm) == block
    assert options["combine_tokens"] == block
    tasks = moe.ceil_div(tokens, block) * (hidden // options["combine_cols"])
    assert tasks >= moe_layer.ROUND_TASKS * ctas_per_sm or block == 1
    assert moe_layer.options_for(tokens, hidden=hidden, combine_tokens=3)["combine_tokens"] == 3


@pytest.mark.parametrize("tokens, engine, splits", [(1, "fma", 8), (16, "fma", 8),
                                                    (16, "mma", 8), (128, "mma", 8),
                                                    (256, "mma", 4),
                                                    (512, "mma", 2), (1024, "mma", 4),
                                                    (4096, "mma", 1), (1024, "fma", 1)])
def test_router_splits_make_a_task_for_about_every_two_ctas(tokens, engine, splits):
    options = moe_layer.options_for(tokens, router_engine=engine)
    assert options["router_splits"] == splits
    blocks = -(-tokens // options["router_tokens"])
    tasks = blocks * (128 // options["experts_per_task"]) * splits
    least = moe_layer.ROUTER_TASKS * options["ctas_per_sm"]
    assert tasks >= least or splits == 8
    assert splits == 1 or tasks // 2 < least


def test_mma_router_layer_compiles_for_sm90a(tmp_path):
    """1024 tokens: 32 blocks x 2 expert groups x 2 splits of router tasks on tensor cores."""
    graph = make_moe_layer(**moe_layer.options_for(1024, engine="wgmma", ctas_per_sm=2))
    names = compile_layer(graph, 1024, tmp_path, ctas_per_sm=2)
    assert "router_2048x128_b32_e64_s2_mma_s4_t128" in names, names


@pytest.mark.parametrize("tokens, splits", [(1, 4), (7, 1), (20, 2)])
def test_route_tile_writes_what_top_k_then_align_write(tokens, splits, rng):
    """One route task over the router's partial logits: top-k of every block of 8 tokens
    (several blocks at 20 tokens), then align of those picks."""
    logits = rng.standard_normal((splits, tokens, E)).astype(np.float32)
    tiles = moe.max_tiles(tokens, E, K, BT)
    picks = [np.full((tokens, K), -7, np.int32), poisoned((tokens, K), "float32")]
    run_tasks(moe.make_topk_tile(E, K, 8, splits=splits), (moe.ceil_div(tokens, 8),), logits,
              *picks)
    out = [np.full((tokens, K), -7, np.int32), poisoned((tokens, K), "float32"),
           *(np.full(s, -7, np.int32) for s in
             ((E,), (E + 1,), (tokens, K), (tokens, K), (tiles * BT,), (tiles,)))]
    run_tasks(moe.make_route_tile(E, K, BT, 8, splits=splits), (1,), logits, *out)
    np.testing.assert_array_equal(out[0], picks[0])
    np.testing.assert_array_equal(out[1], picks[1])
    for got, want in zip(out[2:], aligned(picks[0], tiles)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("route, align_tokens", [("fused", 0), ("split", 0), ("split", 8)])
def test_aligned_needs_no_arming(route, align_tokens):
    """Every task of the call that writes exp_indptr notifies ``aligned`` (the route task, the
    align task, or all of align's place tasks), so its element cannot complete before that
    call has: it starts at its static count, fires at its last notify, and the call's
    completion only marks the gate-up tasks it releases (for a ready ring). ``h_ready``,
    notified by the gate-up tasks, keeps its arming by that completion."""
    graph = TaskGraph.build(make_moe_layer(H, E, K, F, combine_cols=64, router_splits=2,
                                           fused_route=route == "fused",
                                           align_tokens=align_tokens), {"T": 20})
    (writer,) = [c.index for c in graph.calls
                 if any(graph.tensors[t].name == "exp_indptr" for t in c.outputs)]
    assert graph.trigger_marks() == {"aligned": writer}
    assert graph.gates() == {"h_ready": {writer}}
    layout = EventLayout.of(graph)
    chunks = 3 if align_tokens else 1  # place tasks of 8 tokens each
    assert layout.initial[layout.offsets["aligned"]] == chunks
    assert layout.initial[layout.offsets["h_ready"]] == ARM_BIAS + 2 * F // 64
    assert layout.marks == {"aligned": writer} and writer in layout.done


@pytest.mark.parametrize("align_tokens", [0, 8])
def test_one_task_completes_its_call_without_a_round_trip(align_tokens):
    """The call that writes exp_indptr arms ``h_ready`` once complete. One align task
    completes it by counting it down (a notify: thread 0 goes on); of three place tasks each
    asks an atomic whether it was the last."""
    graph = make_moe_layer(H, E, K, F, combine_cols=64, router_splits=2,
                           align_tokens=align_tokens)
    source = build(graph, {"T": 20}, num_sms=132).cuda_source()
    num_tasks, done = completion_counter(graph, {"T": 20})
    assert num_tasks == (3 if align_tokens else 1)
    if align_tokens:
        assert f"etc_complete({done})" in source and f"etc_notify({done})" not in source
    else:
        assert f"etc_notify({done})" in source and "etc_complete((" not in source


def test_the_route_task_publishes_the_gate_up_run_before_its_completion():
    """Dynamic: the route task's notify completes ``aligned`` and fires it, and the CTA
    publishes the gate-up run it releases before it counts its call's completion (one task:
    it completes the call, so it then arms ``h_ready`` and marks the released tasks)."""
    graph = make_moe_layer(H, E, K, F, combine_cols=64, router_splits=2, fused_route=True)
    source = build(graph, {"T": 1}, strategy="dynamic", num_sms=8).cuda_source()
    kernel = source[source.index("moe_layer_dynamic_megakernel_kernel("):]
    route = kernel[kernel.index("etc_notify_last("):]
    order = [route.index(s) for s in ("etc_defer_range(", "etc_claim_runs(",
                                      completion_notify(graph, {"T": 1}),
                                      "etc_unbias(", "etc_mark_range(")]
    assert order == sorted(order) and "etc_complete((" not in kernel


@pytest.mark.parametrize("tokens", (1, 7))
def test_the_ring_releases_down_tasks_once_their_tiles_gate_up_tasks_are_dispatched(tokens):
    """``h_ready``'s trigger is released at dispatch: each tile's element counts its gate_up
    tasks and the arming; the order pushes a tile's down tasks before the tile is complete,
    and they wait for it on a CTA (the layer's result is checked under this order above).
    With fewer CTAs than down tasks, the trigger fires when the tile completes."""
    graph = small_layer()
    task_graph = TaskGraph.build(graph, {"T": tokens})
    gate_up, down = (next(c for c in task_graph.calls if c.fn.name.startswith(p))
                     for p in ("gate", "down"))
    assert not DynamicPlan.of(task_graph, num_ctas=down.num_tasks - 1).releases
    plan = DynamicPlan.of(task_graph, num_ctas=down.num_tasks)
    (release,) = plan.releases.values()
    assert release.etensor == "h_ready" and release.offset == plan.capacity + len(
        plan.late_calls)
    assert release.counts.tolist() == [gate_up.grid[1] + 1] * gate_up.grid[0]
    assert len(plan.initial_pending()) == release.offset + gate_up.grid[0]

    early = []

    class Watched(DynamicQueueOrder):
        def _push(self, task):
            call = self.run.graph.call_of(task)
            if call.fn.name.startswith("down") and task not in self.pushed:
                for name, idx in self.run.triggers_of(call).get(task, []):
                    early.append(self.run.counters[name][idx] != 0)
            super()._push(task)

    execute(graph, *make_inputs(np.random.default_rng(tokens), tokens, H, E, F),
            order=Watched(down.num_tasks))
    assert early and any(early)


def test_dynamic_kernel_down_tasks_wait_on_the_tile_that_releases_them():
    """A gate_up task's dispatch counts its tile's release down (thread 32), the tile's last
    notify pushes nothing, and a down task waits on its tile after its weights' prelude."""
    graph = make_moe_layer(H, E, K, F, combine_cols=64, router_splits=2, fused_route=True,
                           early_weights=True)
    task_graph = TaskGraph.build(graph, {"T": 1})
    gate_up, down = (next(c for c in task_graph.calls if c.fn.name.startswith(p))
                     for p in ("gate", "down"))
    release = DynamicPlan.of(task_graph, num_ctas=down.num_tasks).releases["h_ready"]
    source = build(graph, {"T": 1}, strategy="dynamic", num_sms=down.num_tasks).cuda_source()
    kernel = source[source.index("moe_layer_dynamic_megakernel_kernel("):]
    loop = kernel[kernel.index("while (1)"):]
    count = re.search(r"if \(\(\(int\)threadIdx.x\) == 32\) \{\s*"
                      rf"if \(\({gate_up.first_task} <= t\) && \(t < {down.first_task}\)\) \{{"
                      r"[^{}]*if \(etc_count_down_release\(\(&\(pending_ptr\[[^]]* \+ "
                      rf"{release.offset}\)\]\)\)\) != 0\) \{{", loop)
    assert count and "etc_push_range(" in loop[count.end():count.end() + 900]
    # the route's notify fires ``aligned`` when it completes; no tile of ``h_ready`` does
    layout = EventLayout.of(task_graph)
    aligned = layout.offsets["aligned"]
    assert loop.count("etc_notify_last(") == loop.count(
        f"etc_notify_last((&(counters_ptr[{aligned}])))") == 1
    body = loop[loop.index(f"if (t < {down.first_task + down.num_tasks})"):]
    tile = re.search(rf"etc_wait\(\(&\(counters_ptr\[\(\(\(t - {down.first_task}\) >> 1\) \+ "
                     rf"{layout.offsets['h_ready']}\)\]\)\)", body)
    assert tile and body.index("cp_async_commit_group") < tile.start() < body.index(
        "int skip = etc_uniform(skip_ptr[0]);")


@pytest.mark.parametrize("tokens", (1, 9))
def test_layer_with_fused_route_matches_float64(tokens, rng):
    """Top-k and align as one task, which waits for every router task on one element."""
    graph = make_moe_layer(H, E, K, F, combine_cols=64, router_splits=2, fused_route=True)
    calls = [c.fn.name for c in TaskGraph.build(graph, {"T": tokens}).calls]
    assert calls[1].startswith("route_16_top4_bt16_b8_s2") and not any(
        n.startswith(("topk", "align")) for n in calls), calls
    inputs = make_inputs(rng, tokens, H, E, F)
    want, bound = moe_layer_reference(*inputs, K)
    assert_within(execute(graph, *inputs, order=RandomOrder(6)), want, bound)
    with pytest.raises(ValueError, match="fused_route aligns in one task: it takes "
                                         "align_tokens 0, got 8"):
        make_moe_layer(H, E, K, F, fused_route=True, align_tokens=8)


@pytest.mark.parametrize("claim", [False, True])
def test_trigger_bounds_are_read_once_a_cta(claim):
    """The grouped GEMMs' triggers read ``exp_indptr[E]`` at every task (its waits, and a
    claimed kernel's peeks): each CTA reads it from global memory once, after it has seen the
    routing complete, and keeps it in shared memory (each acquire the CTA makes empties its
    L1)."""
    graph = make_moe_layer(H, E, K, F, combine_cols=64, router_splits=2)
    source = build(graph, {"T": 40}, strategy="static", num_sms=132,
                   options=KernelOptions(claim=claim)).cuda_source()
    kernel = source[source.index("megakernel_kernel("):]
    lines = [line.strip() for line in kernel.splitlines()]
    reads = [k for k, line in enumerate(lines)  # not align's store of it
             if f"exp_indptr_ptr[{E}]" in line and not line.startswith("exp_indptr_ptr[")]
    assert reads and all(
        lines[k - 1] == "if (remembered_ptr[0] == -2147483647) {"
        and lines[k] == f"remembered_ptr[0] = exp_indptr_ptr[{E}];" for k in reads), \
        [lines[k] for k in reads]
    assert any(re.search(r"< \(?remembered_ptr\[0\]", line) for line in lines)


@pytest.mark.parametrize("strategy", ["barrier", "dynamic", "unfused"])
def test_fused_route_layer_compiles_for_sm90a(strategy, tmp_path):
    """The route task stores its picks, syncs the CTA, then walks them: no wait or notify
    between top-k and align."""
    graph = make_moe_layer(**moe_layer.options_for(1, fused_route=True, ctas_per_sm=2))
    source = build(graph, {"T": 1}, strategy=strategy, num_sms=132,
                   options=KernelOptions(ctas_per_sm=2)).cuda_source()
    route = source[source.index("picker_vals_ptr"):]
    route = route[:route.index("walk_ahead_ptr")]  # the picks, up to the walk's first local
    assert "topk_ptr[" in route and "etc_notify" not in route and "etc_wait" not in route
    assert "tvm_builtin_cuda_cta_sync();" in route[route.rindex("topw_ptr["):], route[-400:]
    build_cubin(source, tmp_path, allow_spills=True)


def test_split_router_layer_compiles_for_sm90a(tmp_path):
    """One token's router over 8 splits of the 2048 hidden rows: 64 tasks of 256 rows."""
    names = compile_layer(make_moe_layer(router_splits=moe_layer.router_splits_for(1)), 1,
                          tmp_path)
    assert {"router_2048x128_b8_e16_s8_u4_t128", "topk_128_top8_b8_s8_t128"} <= names, names


def test_dynamic_layer_pushes_gate_up_right_after_align_completes():
    """Align's completion alone arms ``aligned`` and ``h_ready``, which add no counts: the bias
    lifts (pushing every gate-up task) after the completion's notify and a barrier, with no
    atomic that returns, fence or mark before it; the marks and the skip pass come after."""
    graph = make_moe_layer()
    source = build(graph, {"T": 1}, strategy="dynamic", num_sms=132).cuda_source()
    arming = source[source.index("__global__"):]
    arming = arming[arming.index(completion_notify(graph, {"T": 1})):]
    before = arming[:arming.index("etc_unbias(")]
    assert "etc_complete((" not in source and "tvm_builtin_cuda_cta_sync();" in before
    assert "thread_fence" not in before and "etc_mark_range(" not in before
    assert arming.index("etc_mark_range(") < arming.index("etc_release_word(")


def test_blocked_weight_layer_compiles_for_sm90a(tmp_path):
    names = compile_layer(make_moe_layer(blocked_weights=True), 16, tmp_path, "dynamic")
    assert {"gate_up_2048x768_e128_16x64x64_s8_t128_blocked",
            "down_768x2048_e128_16x64x64_s8_t128_blocked"} <= names, names


@pytest.mark.parametrize("bn, down_bn", [(32, None), (48, 64)])
def test_narrow_task_layer_compiles_for_sm90a(bn, down_bn, tmp_path):
    """Grouped-GEMM tasks of 32 or 48 columns: four warps split each K slice over warp groups
    (``gemm.warp_grid``); 48-column gate_up tasks with 64-column down tasks (2048 hidden
    columns are no multiple of 48)."""
    graph = make_moe_layer(bn=bn, down_bn=down_bn, blocked_weights=True, ctas_per_sm=2)
    compile_layer(graph, 1, tmp_path, ctas_per_sm=2)
    calls = {c.fn.name: c.num_tasks for c in TaskGraph.build(graph, {"T": 1}).calls}
    down_bn = down_bn or bn
    assert calls[f"gate_up_2048x768_e128_16x{bn}x64_s8_t128_blocked"] == 8 * 1536 // bn
    assert calls[f"down_768x2048_e128_16x{down_bn}x64_s8_t128_blocked"] == 8 * 2048 // down_bn


@pytest.mark.parametrize("blocked", [False, True])
def test_layer_with_other_down_task_width_matches_float64(blocked, rng):
    """gate_up tasks of 32 columns, down tasks of 64: each GEMM's weights are laid out, its
    tasks counted and its y blocks gathered by the combine with its own width."""
    inputs = make_inputs(rng, 9, H, E, F)
    graph = make_moe_layer(H, E, K, F, bn=32, down_bn=64, combine_cols=128,
                           blocked_weights=blocked)
    weights = moe_layer.blocked_expert_weights(*inputs[2:], BT, 32, 64) if blocked \
        else inputs[2:]
    want, bound = moe_layer_reference(*inputs, K)
    assert_within(execute(graph, *inputs[:2], *weights), want, bound)


@pytest.mark.parametrize("strategy", ["static", "dynamic"])
def test_wgmma_layer_compiles_for_sm90a(strategy, tmp_path):
    """64-row expert tiles on warpgroup MMA: the gathered rows and the fused SiLU epilogue."""
    graph = make_moe_layer(tile_rows=64, bn=128, engine="wgmma")
    source = build(graph, {"T": 512}, strategy=strategy, num_sms=132).cuda_source()
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16" in source
    names = {c.fn.name for c in TaskGraph.build(graph, {"T": 512}).calls}
    assert {"gate_up_2048x768_e128_64x128x64_s8_t128_wgmma",  # the deepest rings in 200 KB
            "down_768x2048_e128_64x128x64_s8_t128_wgmma"} <= names, names
    build_cubin(source, tmp_path, allow_spills=True)


def test_128_row_wgmma_layer_compiles_for_sm90a(tmp_path):
    """128-row expert tiles (two m64 blocks a warpgroup), two CTAs an SM: 3-stage rings."""
    graph = make_moe_layer(tile_rows=128, engine="wgmma", ctas_per_sm=2, blocked_weights=True)
    names = compile_layer(graph, 1024, tmp_path, ctas_per_sm=2)
    assert {"gate_up_2048x768_e128_128x128x64_s3_t128_wgmma_blocked",
            "down_768x2048_e128_128x128x64_s3_t128_wgmma_blocked"} <= names, names


def test_tma_down_tiles_beside_cp_async_gate_up_keep_their_wgmmas_asynchronous(tmp_path):
    """Down tiles on TMA (``down_loads="tma"``) and gate_up tiles on cp.async in one kernel:
    while ``run_tma``'s loop left a wgmma group pending across its back edge, ptxas serialised
    every wgmma of the kernel, gate_up's too (C7515); ``compile_layer`` fails on that."""
    graph = make_moe_layer(**moe_layer.options_for(1024, ctas_per_sm=2, blocked_weights=True,
                                                   down_loads="tma"))
    names = compile_layer(graph, 1024, tmp_path, "static", ctas_per_sm=2)
    assert "down_768x2048_e128_64x128x64_s4_t128_wgmma_tma_blocked" in names, names
    with pytest.raises(EtcError, match="loads 'tma' runs on the wgmma engine"):
        moe.make_down_tile(F, H, E, tile_rows=16, stages=3, loads="tma")


def test_combine_loads_every_step_before_it_stores(tmp_path):
    """A whole-row combine task (4 steps of 4 columns a thread, 8 pairs) issues its 32 loads
    of y before its first store of out: in the megakernel nothing says out and y (a view of
    the workspace) do not overlap, and with a store after each step the compiler kept the next
    step's loads behind it, one round trip a step."""
    graph = make_moe_layer(**moe_layer.options_for(512, ctas_per_sm=2, combine_tokens=1,
                                                   y_dtype="bfloat16"))
    cubin, _ = build_cubin(build(graph, {"T": 512}, strategy="barrier", num_sms=132,
                                 options=KernelOptions(ctas_per_sm=2)).cuda_source(),
                           tmp_path, allow_spills=True)
    memory = re.findall(r"\b(LDG\.E\.64|STG\.E\.64)\b", sass(cubin))  # bf16 x 4 of y, out
    runs = "".join("l" if op.startswith("LDG") else "s" for op in memory).split("s")
    assert max(len(r) for r in runs) == 4 * moe_layer.QWEN3_30B_A3B["top_k"], memory


def test_rings_share_the_sm_among_its_ctas():
    """Two CTAs an SM halve the shared memory a ring may take: 4 stages of 64 x 128 where
    one CTA takes 8, and the kernel of two CTAs an SM then fits."""
    graph = make_moe_layer(tile_rows=64, bn=128, engine="wgmma", ctas_per_sm=2)
    names = {c.fn.name for c in TaskGraph.build(graph, {"T": 512}).calls}
    assert {"gate_up_2048x768_e128_64x128x64_s4_t128_wgmma",
            "down_768x2048_e128_64x128x64_s4_t128_wgmma"} <= names, names
    build(graph, {"T": 512}, strategy="dynamic", num_sms=132,
          options=KernelOptions(ctas_per_sm=2))
    with pytest.raises(EtcError, match="do not fit on one SM"):
        build(make_moe_layer(tile_rows=64, bn=128, engine="wgmma"), {"T": 512},
              strategy="dynamic", num_sms=132, options=KernelOptions(ctas_per_sm=2))


@pytest.mark.parametrize("options, gate_up, down", [
    ({"ctas_per_sm": 2}, "64x256x32_s5", "64x256x32_s5"),
    ({"ctas_per_sm": 1}, "64x256x64_s4", "64x256x64_s4"),
    ({"ctas_per_sm": 3}, "64x256x32_s3", "64x256x32_s3"),  # not even 2 stages of 64
    ({"ctas_per_sm": 2, "down_loads": "tma"}, "64x256x32_s5", "64x128x64_s4"),
    ({"ctas_per_sm": 2, "bn": 128}, "64x128x64_s4", "64x128x64_s4"),
    ({"ctas_per_sm": 2, "engine": "mma"}, "64x128x64_s3", "64x128x64_s3"),
    ({"ctas_per_sm": 2, "intermediate": 704}, "64x128x64_s4", "64x128x64_s4"),
])
def test_default_tasks_of_64_row_tiles(options, gate_up, down):
    """64-row wgmma tiles default to 256-column tasks where both widths take them, in
    32-column slices where fewer than 3 stages of 64 fit a CTA's share of the SM; TMA down
    tiles keep whole 64-column slices, in 128-column tasks; the blocked weights follow."""
    layer = moe_layer.options_for(1024, blocked_weights=True, **{"engine": "wgmma", **options})
    names = [c.fn.name for c in TaskGraph.build(make_moe_layer(**layer), {"T": 1024}).calls]
    assert any(n.startswith("gate_up_") and f"_{gate_up}_" in n for n in names), names
    assert any(n.startswith("down_") and f"_{down}_" in n for n in names), names
    H, F = 2048, layer.get("intermediate", 768)
    w = np.zeros((2, H, 2 * F), ml_dtypes.bfloat16), np.zeros((2, F, H), ml_dtypes.bfloat16)
    blocked = moe_layer.blocked_expert_weights(*w, 64, options.get("bn"), engine=layer["engine"],
                                               down_loads=layer.get("down_loads", "cp.async"))
    widths = [int(name.split("x")[1]) for name in (gate_up, down)]
    assert [b.shape[-1] for b in blocked] == widths


def test_two_warpgroup_tiles_keep_their_wgmmas_asynchronous_in_a_claimed_kernel(tmp_path):
    """128 x 256 tasks on two warpgroups (256 threads, one m64 block each, one CTA an SM; the
    layer's default from about 2700 tokens): each warpgroup issues its block's wgmmas whether
    or not the block holds rows, as one straight run; a branch around them made ptxas
    serialise the claimed kernel's wgmmas."""
    options = moe_layer.options_for(2048, engine="wgmma", blocked_weights=True,
                                    y_dtype="bfloat16")
    graph = make_moe_layer(**options)
    names = {c.fn.name for c in TaskGraph.build(graph, {"T": 2048}).calls}
    assert {"gate_up_2048x768_e128_128x256x64_s4_t256_wgmma_blocked",
            "down_768x2048_e128_128x256x64_s4_t256_wgmma_blocked_ybf16"} <= names, names
    source = build(graph, {"T": 2048}, strategy="static", num_sms=132,
                   options=KernelOptions(ctas_per_sm=options["ctas_per_sm"],
                                         claim=True)).cuda_source()
    assert not re.search(r"if \(1 <= \(live_ptr", source)
    _, report = build_cubin(source, tmp_path, allow_spills=True)
    assert "serializ" not in report, report[-4000:]


def test_shallow_slices_deepen_the_ring_in_the_same_shared_memory(tmp_path):
    """32-column K slices (A in 64-byte swizzled rows) of 64 x 256 tasks: 5 stages of 20 KB
    in a CTA's half of the SM, where 64-column slices leave room for 2 (and a ring needs 3);
    the static kernel of two CTAs an SM compiles with no register spilled and no wgmma
    serialised by ptxas."""
    graph = make_moe_layer(tile_rows=64, bn=256, bk=32, engine="wgmma", ctas_per_sm=2,
                           blocked_weights=True, y_dtype="bfloat16")
    names = {c.fn.name for c in TaskGraph.build(graph, {"T": 1024}).calls}
    assert {"gate_up_2048x768_e128_64x256x32_s5_t128_wgmma_blocked",
            "down_768x2048_e128_64x256x32_s5_t128_wgmma_blocked_ybf16"} <= names, names
    _, report = build_cubin(build(graph, {"T": 1024}, strategy="static", num_sms=132,
                                  options=KernelOptions(ctas_per_sm=2, claim=True)).cuda_source(),
                            tmp_path)
    assert "serializ" not in report, report[-4000:]
    with pytest.raises(EtcError, match="stages must be >= 3"):
        make_moe_layer(tile_rows=64, bn=256, bk=64, engine="wgmma", ctas_per_sm=2)


def test_rings_leave_room_for_what_each_cta_holds_besides_its_arena():
    """Two CTAs of 64 x 64 rings: 6 stages. 7 (115712 bytes) fit half the SM's shared memory
    but not with the 1 KB the hardware keeps per CTA and the scheduler's own words, and the
    cooperative launch refused them."""
    graph = make_moe_layer(tile_rows=64, bn=64, engine="wgmma", ctas_per_sm=2)
    names = {c.fn.name for c in TaskGraph.build(graph, {"T": 1}).calls}
    assert {"gate_up_2048x768_e128_64x64x64_s6_t128_wgmma",
            "down_768x2048_e128_64x64x64_s6_t128_wgmma"} <= names, names
    with pytest.raises(EtcError, match="arenas of at most 113664 bytes"):
        build(make_moe_layer(tile_rows=64, bn=64, engine="wgmma", stages=7), {"T": 1},
              strategy="barrier", num_sms=132, options=KernelOptions(ctas_per_sm=2))


def test_hooks_of_etensors_armed_at_run_time_must_fit_their_share(monkeypatch):
    """The layer arms one ETensor at run time (h_ready; aligned needs no arming): 8 bytes of
    hooks, which a CTA's overhead of shared memory is sized to hold; past that share, the
    build says so."""
    from etc_tvm.tir_sched import persistent

    monkeypatch.setattr(persistent, "GATE_HOOK_BYTES", 4)
    with pytest.raises(EtcError, match=r"ETensors armed at run time: 1 \(h_ready\); their "
                                       "hooks take more than the 4 bytes"):
        build(make_moe_layer(H, E, K, F), {"T": 4}, strategy="static", num_sms=8)


@pytest.mark.parametrize("tokens", (1, 20))
def test_wgmma_layer_matches_float64(tokens, rng):
    graph = make_moe_layer(H, E, K, F, tile_rows=64, combine_cols=128, engine="wgmma")
    inputs = make_inputs(rng, tokens, H, E, F)
    want, bound = moe_layer_reference(*inputs, K)
    assert_within(execute(graph, *inputs, order=RandomOrder(2)), want, bound)


@pytest.mark.parametrize("tokens", (1, 20))
def test_swapped_layer_matches_float64(tokens, rng):
    """Tiles of 24 rows (no multiple of 16 or 64) on swapped wgmma tiles."""
    graph = make_moe_layer(H, E, K, F, tile_rows=24, combine_cols=128, engine="swapped")
    names = {c.fn.name for c in TaskGraph.build(graph, {"T": tokens}).calls}
    assert {"gate_up_128x64_e16_24x128x32_s8_t128_swapped",
            "down_64x128_e16_24x128x32_s8_t128_swapped"} <= names, names
    inputs = make_inputs(rng, tokens, H, E, F)
    want, bound = moe_layer_reference(*inputs, K)
    assert_within(execute(graph, *inputs, order=RandomOrder(2)), want, bound)


@pytest.mark.parametrize("tokens, rows, bn", [(2, 8, 64), (256, 24, 128)])
def test_few_token_swapped_layer_compiles_without_spills(tokens, rows, bn, tmp_path):
    """The layer as bench_moe builds it at few tokens (``options_for``): swapped tiles of
    ``rows`` (m64n<rows>k16) in tasks of ``bn`` columns at four CTAs an SM, the static
    kernel claiming, compile with no register spilled and no wgmma serialised."""
    options = moe_layer.options_for(tokens, blocked_weights=True, y_dtype="bfloat16")
    assert (options["engine"], options["tile_rows"], options["bn"], options["ctas_per_sm"]) \
        == ("swapped", rows, bn, 4)
    source = build(make_moe_layer(**options), {"T": tokens}, strategy="static", num_sms=132,
                   options=KernelOptions(ctas_per_sm=4, claim=True)).cuda_source()
    assert f"wgmma.mma_async.sync.aligned.m64n{rows}k16.f32.bf16.bf16" in source
    _, report = build_cubin(source, tmp_path)
    assert "serializ" not in report, report[-4000:]


@pytest.mark.parametrize("tokens, rows, threads", [(1024, 96, 128), (2048, 152, 256)])
def test_swapped_layer_keeps_its_wgmmas_asynchronous_in_a_claimed_kernel(tokens, rows,
                                                                          threads, tmp_path):
    """Swapped tiles of 96 rows on one warpgroup and 152 on two (m64n<rows>k16: the weights'
    panels on the m64 side, read MN-major), 128 x 32 slices, the static kernel claiming: no
    wgmma serialised, no local memory touched in the K loops; the SiLU epilogue pairs a
    thread's gate and up halves of a panel. (At 96 rows on 128 registers ptxas keeps a few
    words of the task loop in local memory, a store and a load each a task, outside the K
    loops.)"""
    ctas_per_sm = moe_layer.ctas_per_sm_for(threads, "swapped")
    options = moe_layer.options_for(tokens, engine="swapped", tile_rows=rows,
                                    threads=threads, ctas_per_sm=ctas_per_sm,
                                    combine_tokens=4, blocked_weights=True,
                                    y_dtype="bfloat16")
    assert (options["bn"], options["down_bn"], ctas_per_sm) == (128, 128, 512 // threads)
    graph = make_moe_layer(**options)
    names = {c.fn.name for c in TaskGraph.build(graph, {"T": tokens}).calls}
    assert any(n.startswith(f"gate_up_2048x768_e128_{rows}x128x32_") and
               n.endswith(f"_t{threads}_swapped_blocked") for n in names), names
    source = build(graph, {"T": tokens}, strategy="static", num_sms=132,
                   options=KernelOptions(ctas_per_sm=ctas_per_sm, claim=True)).cuda_source()
    assert f"wgmma.mma_async.sync.aligned.m64n{rows}k16.f32.bf16.bf16" in source
    cubin, report = build_cubin(source, tmp_path, allow_spills=True)
    assert "serializ" not in report, report[-4000:]
    code = sass(cubin)
    assert "tnspA" in code
    k_loops = [loop for loop in innermost_loops(code) if any("HGMMA." in op for op in loop)]
    assert len(k_loops) == 2, [len(loop) for loop in k_loops]  # gate_up's and down's
    for loop in k_loops:
        assert not [op for op in loop if re.search(r"\b(STL|LDL)\b", op)], "\n".join(loop)


def test_grouped_gemm_engine_is_checked():
    with pytest.raises(EtcError, match="engine must be one of"):
        moe.make_down_tile(F, H, E, engine="tensor")
    with pytest.raises(EtcError, match="bm must be a multiple of 64"):
        moe.make_down_tile(F, H, E, tile_rows=16, stages=3, engine="wgmma")


def test_ring_pushes_each_released_run_of_tasks_at_once():
    """The ``aligned`` element releases gate-up tasks ``(0 .. exp_indptr[E]) x (0 .. 24)``, an
    ``h_ready`` element the 32 down tasks of its tile: each a run of consecutive task ids whose
    slots one atomic claims. The first, of a length known only at run time, is deferred to
    the CTA's publish after align's notify, which completes ``aligned`` (it needs no
    arming); the second, short, is pushed by the thread that completes the element."""
    source = build(make_moe_layer(), {"T": 16}, strategy="dynamic", num_sms=132).cuda_source()
    kernel = source[source.index("__global__"):]
    kernel = kernel[:kernel.index("\n}\n")]
    deferred = re.findall(r"etc_defer_range\([^;]*\(exp_indptr_ptr\[128\] \* 24\), ", kernel)
    assert len(deferred) == kernel.count("etc_defer_range(") == 1
    assert re.search(r"etc_push_range\([^;]*\* 32\) \+ \d+\), 32, ", kernel)


def test_arming_unbiases_every_etensor_before_marking_any():
    """Align's completion arms h_ready and marks the gate-up tiles aligned released: the
    unbias (which pushes what is complete) comes before the marks and skip passes of down
    and gate-up tiles."""
    graph = make_moe_layer(H, E, K, F, combine_cols=64)
    source = build(graph, {"T": 16}, strategy="dynamic", num_sms=132).cuda_source()
    kernel = source[source.index("_dynamic_megakernel_kernel("):]
    arming = kernel[kernel.index(completion_notify(graph, {"T": 16})):]
    unbias = [m.start() for m in re.finditer(r"etc_unbias\(", arming)]
    marks = [m.start() for m in re.finditer(r"etc_mark_range\(", arming)]
    assert len(unbias) == 1 and len(marks) == 2 and max(unbias) < min(marks)


@pytest.mark.parametrize("strategy", ["static", "unfused"])
def test_layer_with_64_row_tiles_compiles_for_sm90a(strategy, tmp_path):
    """The tiles bench_moe picks from 257 tokens on (``tile_rows_for``)."""
    assert moe_layer.tile_rows_for(256) == 16 and moe_layer.tile_rows_for(257) == 64
    graph = make_moe_layer(tile_rows=64)
    source = build(graph, {"T": 1024}, strategy=strategy, num_sms=132).cuda_source()
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in source
    build_cubin(source, tmp_path, allow_spills=True)


def test_wgmma_tiles_of_two_blocks_issue_the_products_of_blocks_with_rows(tmp_path):
    """A 128-row wgmma tile holds an expert's last rows, so its second m64 block may hold
    none: gate_up and down count the blocks whose first row is a pair (sorted_token of row
    64) and issue the second block's wgmmas only where it holds some, each count a straight
    run of wgmmas (a branch around each one makes ptxas fence the accumulators)."""
    graph = make_moe_layer(**moe_layer.options_for(1024, tile_rows=128, ctas_per_sm=2))
    source = build(graph, {"T": 1024}, strategy="static", num_sms=132,
                   options=KernelOptions(ctas_per_sm=2)).cuda_source()
    # row 64 of the tile: (g * 128) + 64, or as the simplifier folds g's offset into it
    guards = re.findall(r"if \(0 <= sorted_token_ptr\[\(.* \* 128\) ([+-]) (\d+)\)\]\) \{\s*"
                        r"live_ptr\w*\[0\] = 2;", source)
    counts = [g for g in guards if int(g[0] + g[1]) % 128 == 64]
    assert len(counts) == len(guards) == 2, guards  # gate_up's and down's
    wgmma = r"\s*(?:uint64_t \w+ = [^;]*;\s*)*tvm_builtin_ptx_wgmma\w*m64n128k16[^;]*;"
    mine = r"\(live_ptr\w*\[0\] - \(\(warp_id_in_cta >> 2\) \* 2\)\)"
    both = re.findall(rf"if \(2 <= {mine}\) \{{(?:{wgmma}){{8}}\s*\}} else \{{\s*"
                      rf"if \(1 <= {mine}\) \{{(?:{wgmma}){{4}}\s*\}}", source)
    assert len(both) == 2, len(both)  # 4 k16 steps of 2 blocks, else 4 of the first
    report = build_cubin(source, tmp_path, allow_spills=False)[1]
    assert "C7520" not in report  # no serialised wgmma


@pytest.mark.parametrize("tile_rows", (64, 128))
@pytest.mark.parametrize("tokens", (1, 20))
def test_layer_with_large_tiles_matches_float64(tokens, tile_rows, rng):
    graph = make_moe_layer(H, E, K, F, tile_rows=tile_rows, combine_cols=128)
    inputs = make_inputs(rng, tokens, H, E, F)
    want, bound = moe_layer_reference(*inputs, K)
    assert_within(execute(graph, *inputs, order=RandomOrder(1)), want, bound)


def test_unfused_layer_skips_the_grouped_gemm_tiles_past_the_used_ones():
    """Unfused, the layer is five grid launches (and the clear of the stop record align
    checks into); the two grouped GEMMs launch every tile of ``max_tiles`` and run the body
    only for a tile below ``exp_indptr[E]``: gate_up through the one ``aligned`` element's
    range, down through the element of h_ready its tile names (guarded by the same
    bound)."""
    mod = UnfusedTransform({"T": 16})(make_moe_layer().mod)
    tiles = moe.max_tiles(16, 128, 8, BT)
    scripts = {gv.name_hint: mod[gv].script() for gv in mod.get_global_vars()
               if gv.name_hint.endswith("_grid")}
    assert sorted(name for name, script in scripts.items()
                  if "skip: T.int32 = 1" in script) == ["h_grid", "y_grid"]
    for name, blocks in (("h_grid", 2 * 768 // 64), ("y_grid", 2048 // 64)):
        script = scripts[name]
        assert f"bx = T.cta_id([{tiles * blocks}])" in script
        assert script.index("skip: T.int32 = 1") < script.index("exp_indptr[128]") \
            < script.index("skip = 0") < script.index("if skip == 0:") \
            < script.index("T.alloc_shared(")  # the body
