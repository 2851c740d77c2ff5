"""Qwen3-30B-A3B's MoE layer as one graph function, and its float64 reference; other models'
layers by their shapes (``MODELS``; ``options_for`` fits the tiles to them).

    router (ceil(T/RT) x S x E/EB)  --logits_ready "bsj->b"-->  topk (ceil(T/TB))
        --routed "b->0"-->  align (1)
        --aligned, trigger "a=>0:exp_indptr[E], 0:NB1"-->  gate_up (tiles x NB1)
        --h_ready "gn->g", trigger "g=>g:g+1, 0:NB2 if g < exp_indptr[E]"-->  down (tiles x NB2)
        --y_ready "gn->g, n//R", data-dependent "tc->pair_tile[t,:], c"-->  combine (T x NC)

(top-k's in-edge is "b->b//(RT/TB)" where a router task scores several top-k blocks.)
Tiles past ``exp_indptr[E]`` are never released by a trigger, so both grouped GEMMs skip
them (their static ``h_ready``/``y_ready`` notifies still run, so the fan-ins complete; the
guard keeps the completed ``h_ready`` of a skipped tile from releasing its down tiles). The
dynamic kernel takes a single trigger as a triggered call's only in-edge, hence down's
per-tile trigger on ``h_ready`` rather than a trigger plus a wait. Align is
one task, so every expert becomes ready at once: one trigger element over all used tiles is
the per-expert trigger ``e=>exp_indptr[e]:exp_indptr[e+1]`` of ``moe_graph`` with its E
elements fired together. A combine task (t, c) waits for exactly the K down tiles holding
token t's rows, column block c. Under "mixed" the two grouped GEMMs (a data-dependent number
of tasks) go through the ready ring, the rest through static queues.

With ``align_tokens`` (CT), align runs over several CTAs instead, in three calls::

    topk --routed "b->b//(CT/TB)"-->  align_count (ceil(T/CT))  --counted "c->0"-->
        align_offsets (1)  --offset "i->0"-->  align_place (ceil(T/CT))  --aligned "c->0"-->

with the same outputs: at 1024 tokens one align task walks 8192 pairs on one SM (20 us on
the H200), where each of 8 count and 8 place tasks walks 1024. With ``place_offsets``
(``options_for``'s default) the place tasks sum the counts themselves, in two calls::

    align_count (ceil(T/CT))  --counted "c->0"-->  align_rows (ceil(T/CT))  --aligned "c->0"-->

and with ``topk_counts`` in one: the top-k tasks count their picks per expert themselves::

    topk (ceil(T/TB))  --counted "b->0"-->  align_rows (ceil(T/CT))  --aligned "c->0"-->

With ``routed_gate_up`` (a few tokens) gate_up routes itself from the logits, beside the
routing calls rather than after them, and ``aligned`` goes (down's trigger reads the
routing's exp_indptr, so its tasks still wait for the routing)::

    router  --logits_ready-->  gate_up (tiles x NB1), in-edge "gn->0" (the first block)

Run ``python apps/moe_layer.py`` to check a small configuration on the CPU reference executor.
"""
import functools
import math

import numpy as np

from etc_tvm import ETensor, Tensor, call_device, graph_func
from etc_tvm.tiles import gemm, moe, wgmma_gemm
from etc_tvm.tiles.moe import ceil_div, max_tiles
from etc_tvm.tir_sched.persistent import arena_limit, is_integer

QWEN3_30B_A3B = {"hidden": 2048, "experts": 128, "top_k": 8, "intermediate": 768}
# The MoE layers of released models by the shapes of their routed experts. The layer routes
# as Qwen3's does (softmax, top-k, the k weights renormalised; Mixtral's and gpt-oss's softmax
# over the top-k logits is the same) and activates with SiLU-and-multiply; OLMoE does not
# renormalise and gpt-oss clamps its activation, so theirs are the shapes alone.
MODELS = {"qwen3-30b-a3b": QWEN3_30B_A3B,
          "qwen3-235b-a22b": {"hidden": 4096, "experts": 128, "top_k": 8, "intermediate": 1536},
          "qwen3-next-80b-a3b": {"hidden": 2048, "experts": 512, "top_k": 10,
                                 "intermediate": 512},
          "mixtral-8x7b": {"hidden": 4096, "experts": 8, "top_k": 2, "intermediate": 14336},
          "gpt-oss-120b": {"hidden": 2880, "experts": 128, "top_k": 4, "intermediate": 2880},
          "olmoe-1b-7b": {"hidden": 2048, "experts": 64, "top_k": 8, "intermediate": 1024}}


@functools.cache
def make_moe_layer(hidden: int = 2048, experts: int = 128, top_k: int = 8,
                   intermediate: int = 768, *, tile_rows: int = 16, block_tokens: int = 8,
                   router_tokens: int | None = None,
                   experts_per_task: int = 16, router_splits: int = 1,
                   router_engine: str = "fma",
                   bn: int | None = None, down_bn: int | None = None, bk: int | None = None,
                   down_bk: int | None = None, stages: int | None = None,
                   down_stages: int | None = None,
                   engine: str = "mma", combine_cols: int = 512, threads: int = 128,
                   ctas_per_sm: int = 1, blocked_weights: bool = False,
                   y_dtype: str = "float32", align_tokens: int = 0, fused_route: bool = False,
                   down_loads: str = "cp.async", combine_tokens: int = 1,
                   combine_prefetch: bool = False, early_weights: bool = False,
                   place_offsets: bool = False, topk_counts: bool = False,
                   routed_gate_up: bool = False):
    """The graph function ``moe_layer(x, w_router, w_gate_up, w_down) -> out`` (T symbolic):
    x (T, H) bf16, w_router (H, E) bf16, w_gate_up (E, H, 2F) bf16 interleaved
    (``moe.interleave_gate_up``), w_down (E, F, H) bf16; out (T, H) bf16.

    ``block_tokens``: the tokens of a top-k task; ``router_tokens``: of a router task, a
    multiple of them (by default as many; ``router_block_for``). ``experts_per_task``,
    ``router_splits`` and ``router_engine``: a router task's experts, the splits of the hidden
    rows over router tasks and their engine (``moe.make_router_tile``; ``router_splits_for``,
    ``router_engine_for``).
    ``bn``: the grouped GEMM tasks' columns, ``down_bn``: the down tasks' where they differ
    (``task_columns`` for the defaults and why; 48-column gate_up tasks, which do not divide
    the hidden size, with 64-column down tasks: at one token 256 gate_up tasks, one round of
    two CTAs on 132 SMs, against 192 of 64 columns; on the H200 no faster). ``stages``: each
    grouped GEMM's cp.async ring, by default the deepest that fits (``gemm.deepest_stages``)
    the shared memory of one of the ``ctas_per_sm`` persistent CTAs an SM runs
    (``KernelOptions.ctas_per_sm``), within ``gemm.DEFAULT_RING_BYTES`` for "mma" tiles
    and ``gemm.SMEM_LIMIT`` for wgmma ones (a given ``stages`` up to that). For 64 x 128
    wgmma tiles at T=1024 on the H200: 4 stages with one CTA an SM, 889 us (static); 8
    stages (197 KB), 742; 4 stages with two CTAs an SM, 682, as one CTA's ring hand-offs
    overlap the other's task. ``down_stages``: down's ring alone, ``stages`` by default (a
    down task issues its ring's first slices in its prelude with ``early_weights``, so its
    depth is what it streams while it waits for h).
    ``engine``: "mma" (``mma.sync``), "wgmma" (warpgroup MMA, for tiles of 64-row multiples)
    or "swapped" (warpgroup MMA with the weights on its m64 side, for tiles of 8-row
    multiples up to 256; ``moe.ENGINES``). ``bk``: the grouped GEMMs' K slice, ``down_bk``:
    the down tiles' where it differs (by default ``expert_tiles``' choice).
    ``blocked_weights``: the layer takes both expert weights as ``moe.block_columns`` of
    ``bn`` and ``down_bn`` lays them out (``blocked_expert_weights``). ``y_dtype``: how
    down's output, which the combine reads back, is stored (``moe.Y_DTYPES``; bf16 halves
    those bytes, ``moe_layer_reference``'s bound then counting the rounding).
    ``align_tokens``: 0 for one align task, else the tokens each task of align over several
    CTAs walks (a multiple of ``block_tokens``; ``align_tokens_for``). ``fused_route``:
    top-k and the one align task as one task (``moe.make_route_tile``), which waits for
    every router task; for few tokens, where top-k is one task anyway. ``down_loads``: how
    the down tiles fill their rings, "cp.async" or "tma" (wgmma tiles;
    ``moe.make_down_tile``). ``combine_tokens``: the tokens a combine task sums,
    ``combine_prefetch``: whether it first asks for its rows of y in L2
    (``moe.make_combine_tile``'s ``tokens`` and ``prefetch``). ``early_weights``: the down
    tasks issue their first weight slices before they wait for their rows of h
    (``moe.make_down_tile``'s). ``place_offsets`` (with ``align_tokens``): each place task
    sums the chunks' counts itself (``moe.make_align_rows_tile``), so that align is two
    calls, not three: one hop and one one-CTA task fewer before the experts.
    ``topk_counts`` (with ``place_offsets``): the top-k tasks count their picks per expert
    (``moe.make_topk_tile(counts=True)``) and the place tasks sum those rows, so that align
    is one call: the count call and its hop go. ``routed_gate_up``: the gate_up tasks
    route themselves from the router's logits (``moe.LogitRouting``), so that they wait for
    the router only, not for top-k and align after it; for at most ``moe.routed_tokens``
    tokens (a larger T is refused at run time)."""
    H, E, K, F, BT = hidden, experts, top_k, intermediate, tile_rows
    bn, down_bn = task_columns(BT, H, F, engine=engine, bn=bn, down_bn=down_bn,
                               down_loads=down_loads, threads=threads)
    gate_up, down = expert_tiles(H, E, F, tile_rows=BT, bn=bn, down_bn=down_bn, bk=bk,
                                 down_bk=down_bk, stages=stages, down_stages=down_stages,
                                 engine=engine, threads=threads,
                                 ctas_per_sm=ctas_per_sm, blocked_weights=blocked_weights,
                                 y_dtype=y_dtype, down_loads=down_loads,
                                 early_weights=early_weights,
                                 routing=moe.LogitRouting(top_k, router_splits)
                                 if routed_gate_up else None)
    combine_cols = min(combine_cols, H)
    if combine_cols % down_bn:
        raise ValueError(f"combine_cols {combine_cols} must be a multiple of down_bn {down_bn}")
    router_tokens = router_tokens or block_tokens
    if router_tokens % block_tokens:
        raise ValueError(f"router_tokens {router_tokens} must be a multiple of block_tokens "
                         f"{block_tokens}")
    per_router_block = router_tokens // block_tokens  # top-k blocks a router task scores
    router = moe.make_router_tile(H, E, router_tokens, experts_per_task, threads,
                                  splits=router_splits, engine=router_engine)
    if align_tokens < 0 or align_tokens % block_tokens:
        raise ValueError(f"align_tokens {align_tokens} must be 0 (one align task) or a "
                         f"positive multiple of block_tokens {block_tokens}")
    if place_offsets and not align_tokens:
        raise ValueError("place_offsets folds align's offsets into its place tasks: it takes "
                         "align over several CTAs (align_tokens)")
    if topk_counts and not place_offsets:
        raise ValueError("topk_counts hands the top-k tasks' counts to place tasks that sum "
                         "them: it takes place_offsets")
    if routed_gate_up and router_tokens < moe.routed_tokens(threads, BT):
        raise ValueError(f"routed_gate_up waits for the router's first block of tokens: "
                         f"router_tokens {router_tokens} must cover the "
                         f"{moe.routed_tokens(threads, BT)} tokens a gate_up tile routes")
    if fused_route and align_tokens:
        raise ValueError(f"fused_route aligns in one task: it takes align_tokens 0, got "
                         f"{align_tokens}")
    if fused_route:
        route = moe.make_route_tile(E, K, BT, block_tokens, threads, router_splits)
    else:
        topk_tile = moe.make_topk_tile(E, K, block_tokens, threads, router_splits,
                                       counts=topk_counts)
    if align_tokens:
        if not topk_counts:
            align_count = moe.make_align_count_tile(E, K, align_tokens, threads)
        if place_offsets:
            align_rows = moe.make_align_rows_tile(
                E, K, BT, align_tokens, threads,
                count_tokens=block_tokens if topk_counts else None)
        else:
            align_offsets = moe.make_align_offsets_tile(E, BT, threads)
            align_place = moe.make_align_place_tile(E, K, BT, align_tokens, threads)
    elif not fused_route:
        align = moe.make_align_tile(E, K, BT, threads)
    gate_up_shape = moe.grouped_weight_shape(E, H, 2 * F, bn, blocked_weights)
    down_shape = moe.grouped_weight_shape(E, F, H, down_bn, blocked_weights)
    combine = moe.make_combine_tile(H, K, combine_cols, threads, y_dtype, combine_tokens,
                                    combine_prefetch)
    TC = combine_tokens
    nb1, nb2, nc = 2 * F // bn, H // down_bn, H // combine_cols
    per_block = combine_cols // down_bn  # down column blocks per combine column block

    @graph_func
    def moe_layer(x: Tensor(("T", H), "bfloat16"), w_router: Tensor((H, E), "bfloat16"),
                  w_gate_up: Tensor(gate_up_shape, "bfloat16"),
                  w_down: Tensor(down_shape, "bfloat16")):
        tokens = x.shape[0]
        tiles = max_tiles(tokens, E, K, BT)
        blocks, router_blocks = ceil_div(tokens, block_tokens), ceil_div(tokens, router_tokens)
        # the fused route waits for every router task: one element they all notify
        logits_ready = ETensor((1,) if fused_route else (router_blocks,), name="logits_ready")
        logits = call_device(router, tile_num=(router_blocks, router_splits,
                                               E // experts_per_task),
                             args=[x, w_router],
                             out=Tensor((router_splits, tokens, E), "float32", name="logits"),
                             out_edges={logits_ready: "bsj->0" if fused_route else "bsj->b"})
        picks = [Tensor((tokens, K), "int32", name="topk"),
                 Tensor((tokens, K), "float32", name="topw")]
        aligned = None if routed_gate_up else ETensor((1,), name="aligned")

        def aligning(edge_map: str) -> dict:
            # the routing's last call completes gate_up's trigger, unless gate_up routes itself
            return {} if aligned is None else {aligned: edge_map}

        routing = [Tensor((tokens, K), "int32", name="pair_row"),
                   Tensor((tokens, K), "int32", name="pair_tile"),
                   Tensor((tiles * BT,), "int32", name="sorted_token")]
        if fused_route:
            topk, topw, _, exp_indptr, pair_row, pair_tile, sorted_token, tile_expert = \
                call_device(route, tile_num=(1,), args=[logits],
                            out=[*picks, Tensor((E,), "int32", name="counts"),
                                 Tensor((E + 1,), "int32", name="exp_indptr"), *routing,
                                 Tensor((tiles,), "int32", name="tile_expert")],
                            in_edges={logits_ready: "i->0"}, out_edges=aligning("i->0"))
        else:
            chunks = ceil_div(tokens, align_tokens) if align_tokens else 1
            if align_tokens:
                counted = ETensor((1,), name="counted")
            topk_ready = {logits_ready: f"b->b//{per_router_block}" if per_router_block > 1
                          else "b->b"}
            if topk_counts:
                topk, topw, chunk_counts = call_device(
                    topk_tile, tile_num=(blocks,), args=[logits],
                    out=[*picks, Tensor((blocks, E), "int32", name="block_counts")],
                    in_edges=topk_ready, out_edges={counted: "b->0"})
            else:
                routed = ETensor((chunks,), name="routed")
                topk, topw = call_device(
                    topk_tile, tile_num=(blocks,), args=[logits], out=picks,
                    in_edges=topk_ready,
                    out_edges={routed: f"b->b//{align_tokens // block_tokens}" if align_tokens
                               else "b->0"})
            if align_tokens and not topk_counts:
                chunk_counts = call_device(align_count, tile_num=(chunks,), args=[topk],
                                           out=Tensor((chunks, E), "int32", name="chunk_counts"),
                                           in_edges={routed: "c->c"}, out_edges={counted: "c->0"})
            if align_tokens and place_offsets:
                pair_row, pair_tile, sorted_token, exp_indptr, tile_expert = call_device(
                    align_rows, tile_num=(chunks,), args=[topk, chunk_counts],
                    out=[*routing, Tensor((E + 1,), "int32", name="exp_indptr"),
                         Tensor((tiles,), "int32", name="tile_expert")],
                    in_edges={counted: "c->0"}, out_edges=aligning("c->0"))
            elif align_tokens:
                offset = ETensor((1,), name="offset")
                counts, indptr, chunk_row, tile_expert = call_device(
                    align_offsets, tile_num=(1,), args=[chunk_counts],
                    out=[Tensor((E,), "int32", name="counts"),
                         Tensor((E + 1,), "int32", name="offsets_indptr"),
                         Tensor((chunks, E), "int32", name="chunk_row"),
                         Tensor((tiles,), "int32", name="tile_expert")],
                    in_edges={counted: "i->0"}, out_edges={offset: "i->0"})
                # the triggers below read place's copy of the CSR: they arm with its completion
                pair_row, pair_tile, sorted_token, exp_indptr = call_device(
                    align_place, tile_num=(chunks,), args=[topk, counts, indptr, chunk_row],
                    out=[*routing, Tensor((E + 1,), "int32", name="exp_indptr")],
                    in_edges={offset: "c->0"}, out_edges=aligning("c->0"))
            else:
                _, exp_indptr, pair_row, pair_tile, sorted_token, tile_expert = call_device(
                    align, tile_num=(1,), args=[topk],
                    out=[Tensor((E,), "int32", name="counts"),
                         Tensor((E + 1,), "int32", name="exp_indptr"), *routing,
                         Tensor((tiles,), "int32", name="tile_expert")],
                    in_edges={routed: "i->0"}, out_edges=aligning("i->0"))
        h_ready = ETensor((tiles,), name="h_ready")
        h_out = Tensor((tiles * BT, F), "bfloat16", name="h")
        if routed_gate_up:  # the router's first block holds every token (checked above)
            h = call_device(gate_up, tile_num=(tiles, nb1), args=[x, w_gate_up, logits],
                            out=h_out, in_edges={logits_ready: "gn->0"},
                            out_edges={h_ready: "gn->g"}, schedule="dynamic")
        else:
            h = call_device(gate_up, tile_num=(tiles, nb1),
                            args=[x, w_gate_up, sorted_token, tile_expert, exp_indptr],
                            out=h_out, in_edges={aligned: f"a=>0:exp_indptr[{E}], 0:{nb1}"},
                            out_edges={h_ready: "gn->g"}, schedule="dynamic")
        y_ready = ETensor((tiles, nc), name="y_ready")
        y = call_device(down, tile_num=(tiles, nb2), args=[h, w_down, sorted_token, tile_expert,
                                                          exp_indptr],
                        out=Tensor((tiles * BT, H), y_dtype, name="y"),
                        in_edges={h_ready: f"g=>g:g+1, 0:{nb2} if g < exp_indptr[{E}]"},
                        out_edges={y_ready: f"gn->g, n//{per_block}"}, schedule="dynamic")
        return call_device(combine, tile_num=(ceil_div(tokens, TC), nc),
                           args=[topw, pair_row, pair_tile, y],
                           out=Tensor((tokens, H), "bfloat16", name="out"),
                           in_edges={y_ready: f"bc->pair_tile[{TC}*b:{TC}*b+{TC}, :], c"
                                     if TC > 1 else "tc->pair_tile[t,:], c"})

    return moe_layer


def expert_tiles(hidden: int, experts: int, intermediate: int, *, tile_rows: int, bn: int,
                 down_bn: int, bk: int | None = None, down_bk: int | None = None,
                 stages: int | None = None, down_stages: int | None = None,
                 engine: str = "mma", threads: int = 128, ctas_per_sm: int = 1,
                 blocked_weights: bool = False, y_dtype: str = "float32",
                 down_loads: str = "cp.async",
                 early_weights: bool = False, routing: moe.LogitRouting | None = None):
    """The layer's grouped GEMM tiles ``(gate_up, down)`` (``make_moe_layer``'s options;
    ``routing``: gate_up's, ``moe.make_gate_up_tile``), each with ``stages`` (down with
    ``down_stages`` where given) or the deepest ring that fits a CTA's share of the SM.

    K slices (``bk``, ``down_bk`` by default ``bk``): 64 columns, but 32 for swapped tiles
    and for cp.async wgmma tiles where fewer than ``MIN_DEEP_RING`` stages of 64 fit: 64 x
    256 tasks at two CTAs an SM keep 5 stages of 32 (A in 64-byte swizzled rows) where 2 of
    64 fit; swapped 80 x 128 tasks at 1024 tokens ran the grouped GEMMs in 371 us on 32 and
    388 on 64 on the H200. TMA loads take whole 64-column slices."""
    wgmma = engine in ("wgmma", "swapped")
    footprint = wgmma_gemm.shared_bytes if wgmma else functools.partial(gemm.shared_bytes,
                                                                         threads=threads)
    limit = min(gemm.SMEM_LIMIT if wgmma else gemm.DEFAULT_RING_BYTES, arena_limit(ctas_per_sm))

    def deepest(columns: int, bk: int) -> int:
        return gemm.deepest_stages(tile_rows, columns, bk, footprint=footprint, limit=limit)

    def slice_for(columns: int, loads: str = "cp.async") -> int:
        shallow = engine == "swapped" or (
            wgmma and loads == "cp.async"
            and footprint(tile_rows, columns, 64, MIN_DEEP_RING) > limit)
        return 32 if shallow else 64

    H, E, F = hidden, experts, intermediate
    down_bk = down_bk or bk or slice_for(down_bn, down_loads)
    bk = bk or slice_for(bn)
    down_stages = stages if down_stages is None else down_stages
    # a ring of no stages reaches the tile, whose geometry check names it
    return (moe.make_gate_up_tile(H, F, E, tile_rows, bn, bk, threads,
                                  deepest(bn, bk) if stages is None else stages, engine,
                                  blocked_weights, routing),
            moe.make_down_tile(F, H, E, tile_rows, down_bn, down_bk, threads,
                               deepest(down_bn, down_bk) if down_stages is None
                               else down_stages, engine, blocked_weights, y_dtype, down_loads,
                               early_weights))


# The shallowest ring of 64-column K slices expert_tiles keeps by default (a wgmma ring's
# least): with fewer stages of them, 32-column slices (64 x 256 tasks at two CTAs an SM)
MIN_DEEP_RING = 3


# make_moe_layer's options that shape its grouped GEMMs (the rest shape routing and combine)
EXPERT_OPTIONS = ("tile_rows", "bn", "down_bn", "bk", "down_bk", "stages", "down_stages",
                  "engine", "threads", "ctas_per_sm", "blocked_weights", "y_dtype", "down_loads",
                  "early_weights")


@functools.cache
def make_expert_gemms(hidden: int = 2048, experts: int = 128, intermediate: int = 768,
                      **options):
    """The graph function ``expert_gemms(x, w_gate_up, w_down, sorted_token, tile_expert,
    exp_indptr) -> y``: the layer's two grouped GEMMs alone, gate_up -> down on ``h_ready
    "gn->g"``, the routing given as inputs (``moe.align_reference``'s, for
    ``max_tiles(T, ...)`` tiles). ``options``: ``make_moe_layer``'s (those outside
    ``EXPERT_OPTIONS`` are ignored), so that the same tiles run without the routing before
    them and the combine after them: what the megakernel costs the tiles themselves."""
    H, E, F = hidden, experts, intermediate
    tiles_options = {k: options[k] for k in EXPERT_OPTIONS if options.get(k) is not None}
    bn, down_bn = task_columns(
        tiles_options.setdefault("tile_rows", 16), H, F,
        engine=tiles_options.get("engine", "mma"), bn=tiles_options.get("bn"),
        down_bn=tiles_options.get("down_bn"),
        down_loads=tiles_options.get("down_loads", "cp.async"),
        threads=tiles_options.get("threads", 128))
    tiles_options.update(bn=bn, down_bn=down_bn)
    gate_up, down = expert_tiles(H, E, F, **tiles_options)
    blocked = tiles_options.get("blocked_weights", False)
    y_dtype = tiles_options.get("y_dtype", "float32")

    @graph_func
    def expert_gemms(x: Tensor(("T", H), "bfloat16"),
                     w_gate_up: Tensor(moe.grouped_weight_shape(E, H, 2 * F, bn, blocked),
                                       "bfloat16"),
                     w_down: Tensor(moe.grouped_weight_shape(E, F, H, down_bn, blocked),
                                    "bfloat16"),
                     sorted_token: Tensor(("rows",), "int32"),
                     tile_expert: Tensor(("tiles",), "int32"),
                     exp_indptr: Tensor((E + 1,), "int32")):
        tiles, rows = tile_expert.shape[0], sorted_token.shape[0]  # rows: tiles * tile_rows
        h_ready = ETensor((tiles,), name="h_ready")
        h = call_device(gate_up, tile_num=(tiles, 2 * F // bn),
                        args=[x, w_gate_up, sorted_token, tile_expert, exp_indptr],
                        out=Tensor((rows, F), "bfloat16", name="h"),
                        out_edges={h_ready: "gn->g"})
        return call_device(down, tile_num=(tiles, H // down_bn),
                           args=[h, w_down, sorted_token, tile_expert, exp_indptr],
                           out=Tensor((rows, H), y_dtype, name="y"),
                           in_edges={h_ready: "gn->g"})

    return expert_gemms


def expert_gemm_dims(tokens: int, experts: int, top_k: int, tile_rows: int) -> dict:
    """``make_expert_gemms``' dims for ``tokens``: as many tiles as the layer plans for."""
    tiles = max_tiles(tokens, experts, top_k, tile_rows)
    return {"T": tokens, "rows": tiles * tile_rows, "tiles": tiles}


def task_columns(tile_rows: int, hidden: int, intermediate: int, *, engine: str | None = None,
                 bn: int | None = None, down_bn: int | None = None,
                 down_loads: str = "cp.async", threads: int = 128) -> tuple[int, int]:
    """The grouped GEMM tasks' columns ``(bn, down_bn)``, those given kept (``down_bn`` by
    default ``bn``). ``bn``: 64 for 16-row tiles (more tasks for few tokens); 256 for wgmma
    tiles of one m64 block a warpgroup (64 rows on 128 threads, 128 on 256) where both GEMMs'
    widths take it (each A slice read once for 256 weight columns, not twice: at two CTAs an
    SM on the H200 the claimed static layer took 447 -> 425 us at 1024 tokens, 1130 -> 1036
    at 4096); else 128 (a third more FLOPs per loaded byte than 64: at 1024 tokens the static
    layer went from 1504 to 1149 us). With ``bn`` left to it, TMA down tiles take at most 128
    columns: of their 64-column slices, a 64 x 256 ring keeps 2 stages at two CTAs an SM.
    Widths left to it are halved until they divide their GEMM's columns (``2 *
    intermediate``, ``hidden``). ``engine``: the tiles' (``engine_for`` by default);
    ``threads``: the tiles'. Swapped tiles take 128 columns, two m64 panels of weight
    columns on one warpgroup or one each on two (``SWAPPED_ROWS``; 256 columns on two
    warpgroups lost at 1024 tokens on the H200: 415 us for the grouped GEMMs against 372 on
    one)."""
    engine = engine or engine_for(tile_rows, "wgmma")
    if bn is None and engine == "swapped":
        bn = halved_to_divide(128, 2 * intermediate)
    elif bn is None:
        one_block = tile_rows == wgmma_gemm.BLOCK_ROWS * (threads // wgmma_gemm.WARPGROUP)
        wide = engine == "wgmma" and one_block and 2 * intermediate % 256 == 0 \
            and hidden % 256 == 0
        bn = halved_to_divide(64 if tile_rows <= 16 else 256 if wide else 128,
                              2 * intermediate)
        if down_loads == "tma":
            down_bn = down_bn or min(bn, 128)
    return bn, down_bn or halved_to_divide(bn, hidden)


MIN_DOWN_COLUMNS = 32  # the narrowest down tasks down_columns_for makes


def down_columns_for(tokens: int, top_k: int, experts: int, hidden: int, down_bn: int,
                     ctas_per_sm: int = 2) -> int:
    """The down tasks' columns for ``tokens`` where every routed expert is one 16-row tile
    (at most 16 pairs): ``down_bn`` halved, to at least ``MIN_DOWN_COLUMNS``, as long as
    twice the tasks of the experts the pairs can reach still fit one round of the persistent
    CTAs (``ROUND_TASKS`` for each CTA an SM). Few experts of long K make few, long down
    tasks that leave CTA slots without weights to stream: at one token Mixtral 8x7B's 2
    experts made 128 tasks of 1.8 MB for 264 slots (H200, static + graph 219.2 us; 192.2 on
    256 tasks of 32 columns, barrier 218.9 -> 208.9)."""
    pairs = tokens * top_k
    if pairs > 16:
        return down_bn
    tiles = min(pairs, experts)
    while down_bn // 2 >= MIN_DOWN_COLUMNS and down_bn % 2 == 0 \
            and 2 * tiles * (hidden // down_bn) <= ROUND_TASKS * ctas_per_sm:
        down_bn //= 2
    return down_bn


ONE_ROUND_COLUMNS = 128  # the widest tasks one_round_columns_for makes


def one_round_columns_for(tokens: int, top_k: int, experts: int, hidden: int,
                          intermediate: int, engine: str) -> tuple[int, int] | None:
    """Task columns ``(bn, down_bn)`` that cut each grouped GEMM of ``tokens`` into one round
    of ``ROUND_TASKS`` tasks, one gate_up and one down task a persistent CTA at one CTA an
    SM: where every pair is its own expert's 16-row "mma" tile (at most 16 pairs) and both
    widths come out as multiples of 32 columns, up to ``ONE_ROUND_COLUMNS``, that divide
    their GEMM's columns; else None. At two CTAs an SM the one-token layer's 192 gate_up
    tasks of 64 columns leave some SMs streaming two tasks' weights and others one; at
    one token of Qwen3-30B-A3B these make 128 gate_up tasks of 96 columns and 128 down tasks
    of 128, and OLMoE's 128 of 128 columns each. On an H100 (CUDA-graph replays, claimed):
    Qwen3-30B-A3B's static kernel 42.9 -> 41.5, 42.5 -> 41.4, 41.7 -> 40.1 and 41.8 ->
    40.4 / 40.1 us over four runs, OLMoE's 48.9 / 48.4 -> 47.5; the barrier kernel and the
    unfused grids from 0.2 us slower to 1.5 faster, the dynamic kernel 0.6 - 1.6 us slower."""
    pairs = tokens * top_k
    if pairs > 16 or engine != "mma":
        return None
    tiles = min(pairs, experts)
    widths = (2 * intermediate, hidden)
    columns = tuple(tiles * width // ROUND_TASKS for width in widths)
    fits = all(tiles * width % ROUND_TASKS == 0 and cols % 32 == 0
               and cols <= ONE_ROUND_COLUMNS and width % cols == 0
               for width, cols in zip(widths, columns))
    return columns if fits else None


def halved_to_divide(width: int, columns: int) -> int:
    """``width`` halved until it divides ``columns`` (a layer's hidden size of 2880 takes
    down tasks of 64 columns where 2048 takes 128), or until it is odd."""
    while columns % width and width % 2 == 0:
        width //= 2
    return width


def blocked_expert_weights(w_gate_up, w_down, tile_rows: int, bn: int | None = None,
                           down_bn: int | None = None, **options):
    """The layer's expert weights for ``make_moe_layer(blocked_weights=True)`` with tiles of
    ``tile_rows`` and tasks of ``bn`` and ``down_bn`` columns (by default the layer's,
    ``task_columns`` with its ``options``): done once, when the weights are loaded."""
    _, intermediate, hidden = w_down.shape
    bn, down_bn = task_columns(tile_rows, hidden, intermediate, bn=bn, down_bn=down_bn,
                               **options)
    return moe.block_columns(w_gate_up, bn), moe.block_columns(w_down, down_bn)


# the options of ``options_for`` that are counts or sizes
SIZE_OPTIONS = ("tile_rows", "threads", "ctas_per_sm", "block_tokens", "router_tokens",
                "experts_per_task", "bn", "down_bn", "bk", "down_bk", "stages", "down_stages",
                "combine_cols", "combine_tokens", "router_splits")


def options_for(tokens: int, **options) -> dict:
    """``make_moe_layer``'s keyword options for ``tokens`` tokens: ``options``, with the tile
    rows (``tile_rows_for``), the grouped GEMMs' engine (``engine_for``, from
    ``grouped_engine_for`` if neither an engine nor tile rows nor TMA down loads are asked
    for, else from "wgmma"), the tiles' threads (``layer_threads_for``) and the CTAs an SM they are
    built for (``ctas_per_sm_for``; build the kernel with ``KernelOptions(ctas_per_sm=...)``
    of the same), the task columns (``task_columns``; on 16-row tiles the down tasks'
    from ``down_columns_for``; where neither the CTAs an SM nor the columns are asked for,
    one CTA an SM and ``one_round_columns_for``'s columns wherever it gives them), the
    router's engine
    (``router_engine_for``), its blocks of tokens and experts (``router_block_for``; top-k's
    tokens from ``topk_tokens_for``), its splits (``router_splits_for``), the combine's columns
    (``combine_cols_for``) and tokens a task (``combine_tokens_for``), whether the down tasks
    load their first weights in their prelude (``early_weights_for``), whether the gate_up
    tasks route themselves (``routed_gate_up_for``), ``place_offsets``
    wherever align runs over several CTAs unless turned off (at 1024 tokens on the H200 the
    routing ended 5.4 us sooner and the static kernel ran 2 - 10 us faster in three runs),
    ``topk_counts`` where ``place_offsets`` is on, unless turned off, while the place
    tasks sum few rows of counts (``topk_counts_for``),
    align's tokens a task
    (``align_tokens_for``; one align task under ``fused_route``) and ``fused_route``
    (wherever align is one task: on the H200 at 1 and 16 tokens it was as fast under barrier
    and 0.3 - 2 us faster under static, dynamic and unfused) filled in where missing or
    None; a size given must be positive."""
    given = {name: options[name] for name in SIZE_OPTIONS if options.get(name) is not None}
    bad = [f"{name}={value}" for name, value in given.items() if value < 1]
    if bad:
        raise ValueError(f"options_for: {', '.join(bad)}: a size must be positive (or None "
                         "for the layer's choice)")
    shape = {"tokens": tokens, **{name: options[name] for name in QWEN3_30B_A3B
                                  if name in options}}
    bad = [f"{name}={value!r}" for name, value in shape.items() if not is_integer(value, 1)]
    if bad:
        raise ValueError(f"options_for: {', '.join(bad)}: the tokens and the layer's shape "
                         "are positive integers")
    experts = options.get("experts", QWEN3_30B_A3B["experts"])
    ctas_per_sm = options.get("ctas_per_sm")
    top_k = options.get("top_k", QWEN3_30B_A3B["top_k"])
    if top_k > experts:
        raise ValueError(f"options_for: top_k={top_k} picks more experts than the {experts} "
                         "there are")
    # rows asked for without an engine, or TMA down tiles: wgmma tiles
    wgmma_asked = options.get("tile_rows") or options.get("down_loads") == "tma"
    hidden = options.get("hidden", QWEN3_30B_A3B["hidden"])
    intermediate = options.get("intermediate", QWEN3_30B_A3B["intermediate"])
    engine = options.get("engine") or ("wgmma" if wgmma_asked else grouped_engine_for(
        tokens, experts, top_k, hidden, intermediate))
    rows = options.get("tile_rows") or tile_rows_for(tokens, experts, top_k, ctas_per_sm,
                                                     engine)
    engine = engine_for(rows, engine)
    one_round = None
    if ctas_per_sm is None and rows == 16 and options.get("bn") is None \
            and options.get("down_bn") is None:
        one_round = one_round_columns_for(tokens, top_k, experts, hidden, intermediate, engine)
        if one_round:
            ctas_per_sm = 1
    threads = options.get("threads") or layer_threads_for(rows, engine, ctas_per_sm)
    ctas_per_sm = ctas_per_sm or ctas_per_sm_for(threads, engine)
    router_engine = options.get("router_engine") or router_engine_for(tokens, experts, threads)
    block_tokens = options.get("block_tokens") or topk_tokens_for(tokens, router_engine)
    router_tokens, experts_per_task = router_block_for(tokens, router_engine, experts, threads)
    # whole top-k blocks
    router_tokens = options.get("router_tokens") or ceil_div(router_tokens,
                                                             block_tokens) * block_tokens
    experts_per_task = options.get("experts_per_task") or experts_per_task
    if experts_per_task is None:
        raise ValueError(f"options_for: no router task on {router_engine!r} covers {experts} "
                         f"experts: their number must be {moe.ROUTER_FIT[router_engine]}")
    align_tokens = options["align_tokens"] if options.get("align_tokens") is not None \
        else 0 if options.get("fused_route") else align_tokens_for(tokens)
    fused_route = options["fused_route"] if options.get("fused_route") is not None \
        else align_tokens == 0
    bn, down_bn = one_round or task_columns(
        rows, hidden, intermediate, engine=engine,
        bn=options.get("bn") or swapped_columns_for(tokens, engine),
        down_bn=options.get("down_bn"), down_loads=options.get("down_loads") or "cp.async",
        threads=threads)
    if options.get("down_bn") is None and rows == 16 and not one_round:
        down_bn = down_columns_for(tokens, top_k, experts, hidden, down_bn, ctas_per_sm)
    combine_cols = options.get("combine_cols") or combine_cols_for(tokens, hidden, ctas_per_sm,
                                                                   threads, down_bn)
    place_offsets = options.get("place_offsets") is not False and align_tokens > 0
    early_weights = options["early_weights"] if options.get("early_weights") is not None \
        else early_weights_for(tokens) and options.get("down_loads", "cp.async") != "tma"
    routed = options["routed_gate_up"] if options.get("routed_gate_up") is not None \
        else routed_gate_up_for(tokens)
    return {**options, "tile_rows": rows, "engine": engine, "threads": threads,
            "early_weights": early_weights, "routed_gate_up": routed,
            "place_offsets": place_offsets,
            "topk_counts": place_offsets and (
                options["topk_counts"] if options.get("topk_counts") is not None
                else topk_counts_for(tokens, block_tokens)),
            "ctas_per_sm": ctas_per_sm, "bn": bn, "down_bn": down_bn,
            "combine_cols": combine_cols,
            "combine_tokens": options.get("combine_tokens")
            or combine_tokens_for(tokens, hidden, combine_cols, ctas_per_sm),
            "router_engine": router_engine, "block_tokens": block_tokens,
            "router_tokens": router_tokens,
            "align_tokens": align_tokens, "fused_route": fused_route,
            "experts_per_task": experts_per_task,
            "router_splits": options.get("router_splits")
            or router_splits_for(tokens, router_tokens, experts_per_task, experts,
                                 ctas_per_sm, hidden, router_engine)}


# A router task's (tokens, experts) on each engine: 8 x 16 on CUDA cores; on tensor cores one
# m16 block of tokens, and 32 experts, so that 1024 tokens make 256 tasks.
ROUTER_BLOCKS = {"fma": (8, 16), "mma": (16, 32)}
# From this many tokens, tensor-core router tasks of 32 tokens x 64 experts: each reads its x
# rows and router columns for twice the products of a 16 x 32 task (on the H200 the router
# took 13.0 -> 7.5 us at 1024 tokens, 44.2 -> 21.6 at 4096). Top-k tasks then take
# WIDE_TOPK_TOKENS each: a warp picks for two tokens one after another, not four.
WIDE_ROUTER_TOKENS, WIDE_ROUTER_BLOCK, WIDE_TOPK_TOKENS = 1024, (32, 64), 8
# Router tasks for each CTA an SM: about one every two persistent CTAs (128 at two CTAs an SM)
ROUTER_TASKS = 64


def router_engine_for(tokens: int, experts: int = 128, threads: int = 128) -> str:
    """The router's engine for ``tokens``: CUDA cores while one block of 8 tokens holds them
    all (at one token the logits are a GEMV), tensor cores past that, where their tasks of
    ``threads`` fit the experts (``moe.router_experts_fit``: not Mixtral's 8)."""
    if tokens <= ROUTER_BLOCKS["fma"][0] \
            or moe.router_experts_for(experts, "mma", experts, threads) is None:
        return "fma"
    return "mma"


def wide_router(tokens: int, engine: str) -> bool:
    """Whether the router runs in ``WIDE_ROUTER_BLOCK`` tasks: on tensor cores from
    ``WIDE_ROUTER_TOKENS``."""
    return engine == "mma" and tokens >= WIDE_ROUTER_TOKENS


def router_block_for(tokens: int, engine: str, experts: int = 128,
                     threads: int = 128) -> tuple[int, int | None]:
    """(tokens, experts) of a router task on ``engine`` for ``tokens`` tokens:
    ``ROUTER_BLOCKS``, or ``WIDE_ROUTER_BLOCK`` (``wide_router``), with as many of their
    experts as fit ``experts`` (``moe.router_experts_for``; None where none do)."""
    block_tokens, most = WIDE_ROUTER_BLOCK if wide_router(tokens, engine) \
        else ROUTER_BLOCKS[engine]
    return block_tokens, moe.router_experts_for(experts, engine, most, threads)


def topk_tokens_for(tokens: int, engine: str) -> int:
    """Tokens of a top-k task for ``tokens`` (``make_moe_layer``'s ``block_tokens``): a
    router block's on ``engine`` (``ROUTER_BLOCKS``), or ``WIDE_TOPK_TOKENS`` beside the wide
    router tasks (``wide_router``)."""
    return WIDE_TOPK_TOKENS if wide_router(tokens, engine) else ROUTER_BLOCKS[engine][0]


def router_splits_for(tokens: int, router_tokens: int = 8, experts_per_task: int = 16,
                      experts: int = 128, ctas_per_sm: int = 2, hidden: int = 2048,
                      engine: str = "fma") -> int:
    """Splits of the hidden rows over router tasks for ``tokens``: the fewest of 1, 2, 4, 8
    that make ``ROUTER_TASKS`` tasks for each of ``ctas_per_sm`` (of those that fit the
    ``hidden`` rows on ``engine``, ``moe.router_splits_fit``), as blocks of tokens alone
    leave SMs idle (one token on CUDA cores: 8 tasks, so 8 splits, 64 SMs reading the
    router's 512 KB instead of 8; 128 tokens on tensor cores at two CTAs an SM: 32 tasks, so
    4 splits, 400.6 -> 388.5 us on the H200; 1024 tokens at four CTAs an SM: 128 tasks, so 4
    splits, with combine tasks of 2 tokens 394.4 -> 385.5 us static, 411.8 -> 395.9
    dynamic), and more splits than that only add partial logits to write and sum."""
    tasks = ceil_div(tokens, router_tokens) * (experts // experts_per_task)
    splits = 1
    while splits < 8 and tasks * splits < ROUTER_TASKS * ctas_per_sm \
            and moe.router_splits_fit(hidden, 2 * splits, engine):
        splits *= 2
    return splits


# Tasks for each CTA an SM that make about one round of the persistent CTAs (256 at two
# CTAs an SM on 132 SMs)
ROUND_TASKS = 128


def combine_cols_for(tokens: int, hidden: int = 2048, ctas_per_sm: int = 2,
                     threads: int = 128, down_bn: int = 64) -> int:
    """Output columns a combine task writes for ``tokens``: the widest of the whole row and
    1024 that divides ``hidden`` into multiples of 512 and still makes ``ROUND_TASKS``
    tasks for each of ``ctas_per_sm``, else the widest up to 512 (``make_moe_layer``'s
    default); of those the tile takes on ``threads`` (``moe.combine_cols_fit``) in whole
    down tasks of ``down_bn`` columns (512 where none is: a ``down_bn`` that does not divide
    ``hidden``, which the down tile refuses). Combine tasks take 1-2 us, so under the
    dynamic schedule thousands of them queue on one head counter: at 1024 tokens on the
    H200, 4096 tasks of 512 columns took 80 us, 1024 whole rows 36 (dynamic + graph 533.8
    -> 489.8 us, barrier + graph 505.0 -> 493.7)."""
    def fits(cols: int) -> bool:
        return cols % down_bn == 0 and moe.combine_cols_fit(hidden, cols, threads)

    wide = [c for c in (hidden, 1024) if c % 512 == 0 and fits(c)]
    return next((c for c in wide if tokens * (hidden // c) >= ROUND_TASKS * ctas_per_sm),
                None) or next((c for c in range(min(hidden, 512), 0, -1) if fits(c)), 512)


# Tokens a combine task may sum, most first. On the H200 blocks of 8 were as fast as blocks of
# 4 at 2048 and 4096 tokens, and blocks of 2 at 512 tokens no faster than single tokens; at
# 1024 tokens and four CTAs an SM blocks of 2 (512 tasks) against 4: static + graph 394.4 ->
# 387.3 us, dynamic 411.8 -> 400.4.
COMBINE_BLOCKS = (4, 2)


def combine_tokens_for(tokens: int, hidden: int = 2048, cols: int | None = None,
                       ctas_per_sm: int = 2) -> int:
    """Tokens a combine task sums for ``tokens`` (``make_moe_layer``'s ``combine_tokens``):
    the most of ``COMBINE_BLOCKS`` that still make ``ROUND_TASKS`` tasks for each of
    ``ctas_per_sm`` of ``cols`` columns (``combine_cols_for`` by default), else 1. The
    combine runs after the last down tiles, where a task's gather of 8 rows waits a round
    trip or two; blocks of tokens keep more of y in flight a task (on the H200, blocks of 4:
    4096 tokens static + graph 967.2 -> 932.7 us, dynamic 988.5 -> 938.7; 1024 tokens
    dynamic 444.2 -> 428.3, static and barrier within 1 us)."""
    cols = cols or combine_cols_for(tokens, hidden, ctas_per_sm)
    tasks, least = hidden // cols, ROUND_TASKS * ctas_per_sm
    return next((b for b in COMBINE_BLOCKS if ceil_div(tokens, b) * tasks >= least), 1)


ALIGN_FROM_TOKENS = 512  # tokens from which align runs over several CTAs


EARLY_WEIGHTS_BELOW = 2  # tokens below which the down tasks load weights in their prelude


def early_weights_for(tokens: int) -> bool:
    """Whether the down tasks issue their first weight slices before they wait for h
    (``make_moe_layer``'s ``early_weights``): at one token, where the 8 expert tiles' h
    completes at about the same time and the CTAs that claimed down tasks would otherwise
    stream nothing until then. On the H200 (static + graph, claimed; three runs) one token
    40.8 / 40.6 / 40.9 -> 39.5 / 39.5 / 38.3 us; at 4, 8 and 16 tokens the static kernel
    within 1 us, the barrier kernel 0.7 - 2.8 us faster, the dynamic one 0.8 - 4.2 us slower:
    a task the ring hands out is ready, gains nothing from its prelude, and its ring's first
    step then waits for every weight slice the prelude issued (one cp.async group)."""
    return tokens < EARLY_WEIGHTS_BELOW


ROUTED_GATE_UP_BELOW = 3  # tokens below which the gate_up tasks route themselves


def routed_gate_up_for(tokens: int) -> bool:
    """Whether the gate_up tasks route themselves from the router's logits
    (``make_moe_layer``'s ``routed_gate_up``): below ``ROUTED_GATE_UP_BELOW`` tokens, where
    the gate-up weights then stream from the router's end, not the route task's. On the
    H200 (static + graph, claimed) one token 38.7 -> 36.4 us, two 55.3 -> 53.3; at four
    tokens each of the 768 tasks picks for four and the static kernel lost 0.7 us."""
    return tokens < ROUTED_GATE_UP_BELOW


def align_tokens_for(tokens: int) -> int:
    """Tokens an align task walks for ``tokens`` (``make_moe_layer``'s ``align_tokens``):
    ``moe.ALIGN_CHUNK_TOKENS`` from ``ALIGN_FROM_TOKENS`` on, else 0 (one align task: below
    that the two extra hand-offs cost more than the shorter walks save)."""
    return moe.ALIGN_CHUNK_TOKENS if tokens >= ALIGN_FROM_TOKENS else 0


# The most rows of top-k counts a place task sums where the top-k tasks count (``topk_counts``):
# on the H200 align in one call was 1.2 - 8.1 us faster than in two at 512 and 1024 tokens
# (32 and 128 rows, two runs, every schedule) and no faster at 2048 (256 rows, 128 KB a task)
TOPK_COUNT_ROWS = 128


def topk_counts_for(tokens: int, block_tokens: int) -> bool:
    """Whether the top-k tasks of ``block_tokens`` count their picks for ``tokens`` tokens
    (``make_moe_layer``'s ``topk_counts``, where place tasks sum the counts): while their rows
    are at most ``TOPK_COUNT_ROWS``."""
    return ceil_div(tokens, block_tokens) <= TOPK_COUNT_ROWS


# Accumulators a thread of a swapped tile the layer picks: 96 x 128 tasks on one warpgroup
# (both 64-column panels on it) and 192 x 128 on two (one panel each) keep 96 a thread, with
# nothing spilled at the 128 registers four CTAs an SM of 128 threads, or two of 256, leave
SWAPPED_ROWS = 96
SWAPPED_FROM_TOKENS = 2  # tokens from which the grouped GEMMs default to swapped tiles
# Tokens below which swapped tasks take 64 columns (``swapped_columns_for``)
SWAPPED_NARROW_BELOW = 16


def swapped_columns_for(tokens: int, engine: str) -> int | None:
    """A grouped GEMM task's columns for ``tokens`` on ``engine`` where they are not
    ``task_columns``' own: 64 on swapped tiles below ``SWAPPED_NARROW_BELOW`` tokens, where
    the few experts used make too few 128-column tasks to share the CTAs evenly (at 8 tokens
    about 50 experts, 600 gate_up tasks for 528 CTAs). On the H200 (static, claimed,
    CUDA-graph replays) 57.7 -> 55.3 us at 2 tokens, 87.7 -> 85.0 at 4, 135.0 -> 128.1 at 8;
    even at 16 (192.3 against 192.7 on 64 columns)."""
    return 64 if engine == "swapped" and tokens < SWAPPED_NARROW_BELOW else None


def swapped_rows_for(tokens: int, experts: int = 128, top_k: int = 8) -> int:
    """Rows of a swapped grouped-GEMM tile for ``tokens``: an expert's average share s of the
    pairs plus two standard deviations of a random routing's (about ``2 sqrt(s)``), in
    whole n8 blocks, so that most experts' pairs fit one tile (their weights read once) with
    little padding: 48 rows at 512 tokens, 80 at 1024, 152 at 2048."""
    share = tokens * top_k / experts
    return max(8, math.ceil((share + 2 * math.sqrt(share)) / 8) * 8)


def grouped_engine_for(tokens: int, experts: int = 128, top_k: int = 8, hidden: int = 2048,
                       intermediate: int = 768) -> str:
    """The grouped GEMMs' engine for ``tokens`` when none is asked for: "swapped" from
    ``SWAPPED_FROM_TOKENS`` while ``swapped_rows_for`` is at most ``2 * SWAPPED_ROWS`` (two
    warpgroups' worth, where a 64-column panel each divides both GEMMs' columns, ``hidden``
    and ``2 * intermediate``), else "wgmma" (16-row tiles then run on "mma",
    ``engine_for``). On the
    H200 (claimed, CUDA-graph replays, static) against 16-row mma tiles at two CTAs an SM:
    2 tokens 57.2 -> 55.3 us, 8 tokens 140.8 -> 128.1, 16 tokens 218.2 -> 192.3, 128 tokens
    374.7 -> 330.6, 256 tokens 507.7 -> 370.5 (an expert's weights streamed once by the
    wgmma's m64 side at four CTAs an SM); against 64 x 256 wgmma tasks at two CTAs an SM
    418 -> 393 at 1024 tokens (80-row tiles), 354 -> 346 at 512; 565 -> 530 at 2048 tokens
    on 152 x 128 swapped tasks on two warpgroups against 128 x 256 wgmma tasks at one. At
    one token the 16-row mma tiles stay (40.0 against 41.2 us)."""
    rows = swapped_rows_for(tokens, experts, top_k)
    two_panels = 2 * wgmma_gemm.PANEL
    if tokens >= SWAPPED_FROM_TOKENS and (rows <= SWAPPED_ROWS or rows <= 2 * SWAPPED_ROWS and (
            hidden % two_panels == 0 and 2 * intermediate % two_panels == 0)):
        return "swapped"
    return "wgmma"


def tile_rows_for(tokens: int, experts: int = 128, top_k: int = 8,
                  ctas_per_sm: int | None = None, engine: str = "wgmma") -> int:
    """Rows of a grouped-GEMM tile for ``tokens``: on the "swapped" ``engine``,
    ``swapped_rows_for``; else as many as an expert's average share of the pairs fills, of
    16, 64 and 128, so that each busy expert's weights are read about once,
    not once per 16 of its rows (at 1024 tokens: 64 rows an expert, 4 reads at 16). 128-row
    tiles run on two warpgroups at one CTA an SM (``layer_threads_for``): not where
    ``ctas_per_sm`` asks for more, nor on the "mma" ``engine``. On the H200 the claimed
    static layer on 128 x 256 tasks took 607 -> 595 us at 2048 tokens and 1021 -> 964 at
    4096 against 64 x 256 tasks at two CTAs an SM; the grouped GEMMs alone 377 -> 398 at
    1024 tokens (128 tiles of 128 rows against 187 of 64), hence not below an expert's
    128 rows."""
    pairs = tokens * top_k
    if engine == "swapped":
        return swapped_rows_for(tokens, experts, top_k)
    if pairs >= 128 * experts and ctas_per_sm in (None, 1) and engine == "wgmma":
        return 128
    return 16 if pairs <= 16 * experts else 64


def layer_threads_for(tile_rows: int, engine: str, ctas_per_sm: int | None = None) -> int:
    """Threads of the layer's tiles (and of the kernel's CTAs) for grouped-GEMM tiles of
    ``tile_rows``: one warpgroup an m64 block of wgmma tiles up to two (256 threads for 128
    rows, whose 128 x 256 tasks need more registers than two CTAs an SM leave a thread),
    at one CTA an SM; two warpgroups for swapped tiles of more than ``SWAPPED_ROWS`` rows
    (each one 64-column panel); else 128."""
    two = (engine == "wgmma" and tile_rows == 2 * wgmma_gemm.BLOCK_ROWS
           and ctas_per_sm in (None, 1)) or (engine == "swapped" and tile_rows > SWAPPED_ROWS)
    return 2 * wgmma_gemm.WARPGROUP if two else wgmma_gemm.WARPGROUP


def ctas_per_sm_for(threads: int, engine: str = "wgmma") -> int:
    """Persistent CTAs an SM for tiles of ``threads``: two of 128 threads, whose hand-offs
    and memory latency overlap the other CTA's task, one of 256; on the "swapped" ``engine``
    512 threads an SM, four CTAs of 128 or two of 256 (a swapped task's ring of 32-column
    slices fits a quarter of the SM; the grouped GEMMs alone at 1024 tokens on the H200:
    372 us at two CTAs of 128 threads, 353 at three, 341 at four)."""
    if engine == "swapped":
        return 4 * wgmma_gemm.WARPGROUP // threads
    return 1 if threads > wgmma_gemm.WARPGROUP else 2


def engine_for(tile_rows: int, engine: str) -> str:
    """The grouped GEMMs' engine for tiles of ``tile_rows``: ``engine``, but "mma" where the
    tiles are no multiple of 64 rows (a warpgroup MMA is 64 rows; swapped, of 8)."""
    return engine if tile_rows % (8 if engine == "swapped" else 64) == 0 else "mma"


def layer_float64_torch(x, w_router, w_gate, w_up, w_down, top_k: int) -> np.ndarray:
    """The layer in float64 with PyTorch, on the device of its (torch) inputs: ties to the
    lower expert index (a stable sort), one expert's rows at a time. ``w_gate`` and ``w_up``
    (E, H, F) are ``moe.split_gate_up`` of the layer's interleaved weights; the expert weights
    may stay bf16, as each expert's are widened to float64 (exactly) where they are used."""
    import torch

    x, w_router = x.double(), w_router.double()
    logits = x @ w_router
    topk = torch.sort(-logits, dim=1, stable=True).indices[:, :top_k]
    topw = torch.softmax(torch.gather(logits, 1, topk), dim=1)  # renormalised over the K
    out = torch.zeros_like(x)
    for e in topk.unique().tolist():
        token, slot = (topk == e).nonzero(as_tuple=True)
        rows = x[token]
        h = torch.nn.functional.silu(rows @ w_gate[e].double()) * (rows @ w_up[e].double())
        out.index_add_(0, token, topw[token, slot, None] * (h @ w_down[e].double()))
    return out.cpu().numpy()


def moe_layer_reference(x, w_router, w_gate_up, w_down, top_k: int,
                        y_dtype: str = "float32"):
    """(out, bound): the layer in float64 from the same bf16 inputs, and the bound on
    ``|out_device - out|`` the tiles' contracts compose to, given the device picks the same
    experts (``moe.routing_margins`` > 0): h within ``moe.gate_up_bound``, carried through the
    down GEMM (``|dh| @ |Wd|`` plus its own fp32 sums) and y's storage as ``y_dtype``
    (``moe.y_rounding_bound``), the router weights within ``moe.router_weight_bound``, then
    ``moe.combine_bound``."""
    topk, topw = moe.route(x, w_router, top_k)
    F = w_down.shape[1]
    T_, H = x.shape
    ys = np.empty((T_, top_k, H))
    bound_y = np.empty((T_, top_k, H))
    for e in np.unique(topk):
        pairs = np.nonzero(topk == e)
        rows = x[pairs[0]]
        # this expert's gate and up weights alone: splitting all of them took seconds
        w_gate, w_up = (w[0] for w in moe.split_gate_up(w_gate_up[e:e + 1]))
        h64, bound_h = moe.gate_up_reference(rows, w_gate, w_up)
        wd = w_down[e].astype(np.float64)
        ys[pairs] = h64 @ wd
        wd = np.abs(wd)
        bound_y[pairs] = bound_h @ wd + F * 2.0 ** -22 * ((np.abs(h64) + bound_h) @ wd)
        bound_y[pairs] += moe.y_rounding_bound(np.abs(ys[pairs]) + bound_y[pairs], y_dtype)
    out = np.einsum("tk,tkh->th", topw, ys)
    bound_w = moe.router_weight_bound(x, w_router, topw)
    bound = np.einsum("tk,tkh->th", topw + bound_w, bound_y) \
        + np.einsum("tk,tkh->th", bound_w, np.abs(ys)) \
        + moe.combine_bound(topw + bound_w, np.abs(ys) + bound_y)
    return out, bound


ROUTINGS = ("random", "one_expert", "idle_experts")
HOT = 3  # every token's first choice under "one_expert"
ROUTING_X_MEAN_SQUARE = 20 / 3  # E[x^2] of make_routing_inputs' integers in -4..4


def make_inputs(rng, tokens: int, hidden: int, experts: int, intermediate: int,
                routing: str = "random"):
    """bf16 ``(x, w_router, w_gate_up, w_down)``: ``make_routing_inputs`` then
    ``make_expert_weights``."""
    return (*make_routing_inputs(rng, tokens, hidden, experts, routing),
            *make_expert_weights(rng, hidden, experts, intermediate))


def make_routing_inputs(rng, tokens: int, hidden: int, experts: int, routing: str = "random"):
    """bf16 ``(x, w_router)``.

    Both lie on a grid (integers, and multiples of 2**-7) on which every fp32 logit is exact
    in any summation order, so the device picks exactly the float64 experts, ties included
    (to the lower index); the router tile's own tests cover Gaussian inputs. Feature 0 of x
    is 4 for every token, and the router row 0 steers: "one_expert" lifts expert HOT by 16
    (every token's first choice), "idle_experts" drops the odd experts by 16 (no tokens when
    top-K <= E/2).
    """
    import ml_dtypes

    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    bf16 = ml_dtypes.bfloat16
    x = rng.integers(-4, 5, (tokens, hidden)).astype(np.float64)
    x[:, 0] = 4
    w_router = rng.integers(-3, 4, (hidden, experts)) * 2.0 ** -7
    w_router[0] = 0
    if routing == "one_expert":
        w_router[0, HOT % experts] = 4
    elif routing == "idle_experts":
        w_router[0, 1::2] = -4
    return x.astype(bf16), w_router.astype(bf16)


def make_expert_weights(rng, hidden: int, experts: int, intermediate: int):
    """bf16 ``(w_gate_up, w_down)``, Gaussian, scaled so that h and y stay near unit size for
    the inputs of ``make_routing_inputs``. Every element is drawn alike, so gate_up's are
    drawn in place, without ``moe.interleave_gate_up``."""
    gate_up = gaussian_bf16(rng, (experts, hidden, 2 * intermediate),
                            1 / np.sqrt(hidden * ROUTING_X_MEAN_SQUARE))
    return gate_up, gaussian_bf16(rng, (experts, intermediate, hidden),
                                  1 / np.sqrt(intermediate))


def gaussian_bf16(rng, shape, scale: float) -> np.ndarray:
    """bf16 samples of N(0, scale^2) by their 16-bit quantiles: 16 random bits an element
    index a table of the bf16 values of the 65536 midpoint quantiles (tails cut at 4.3
    sigma). The layer's 600 M weights take a few seconds this way, against half a minute
    drawn as float32 normals and rounded."""
    import ml_dtypes
    from statistics import NormalDist

    quantile = NormalDist(0.0, float(scale)).inv_cdf
    table = np.array([quantile((i + 0.5) / 65536) for i in range(65536)], np.float32)
    bits = np.frombuffer(rng.bytes(2 * int(np.prod(shape))), np.uint16)
    return table.astype(ml_dtypes.bfloat16).view(np.uint16)[bits].view(
        ml_dtypes.bfloat16).reshape(shape)


def main():  # pragma: no cover (a demonstration)
    from etc_tvm.executor import execute

    rng = np.random.default_rng(0)
    H, E, K, F = 128, 16, 4, 64
    x, w_router, w_gate_up, w_down = make_inputs(rng, 9, H, E, F)
    graph = make_moe_layer(H, E, K, F)
    out = execute(graph, x, w_router, w_gate_up, w_down)
    want, bound = moe_layer_reference(x, w_router, w_gate_up, w_down, K)
    err = np.abs(out.astype(np.float64) - want)
    print(f"max error {err.max():.3g}, max error / bound {(err / bound).max():.3g}")


if __name__ == "__main__":
    main()
