"""The MoE and RoPE tiles each alone as a graph function (strategy "unfused": one grid launch),
as the GPU tests and ``apps/bench_tiles.py`` run them, and the sizes each takes."""
from tvm import tirx
from tvm.script import tirx as T

from etc_tvm import ETensor, Tensor, call_device, device_func, graph_func
from etc_tvm.tiles import moe, rope

BT = 16  # the grouped GEMMs' tile rows
CHUNK_TOKENS = 32  # tokens an align_count / align_place task walks (several chunks at 100)


def one_call_graphs(hidden, experts, top_k, intermediate, qwen_heads=(32, 4),
                    grouped_stages=2, chunk_tokens=CHUNK_TOKENS):
    """name -> the tile alone as a graph function, at these layer sizes (the grouped GEMMs
    with a ring of ``grouped_stages``; align over several CTAs in chunks of
    ``chunk_tokens``)."""
    Hd, Ex, Kk, Fi = hidden, experts, top_k, intermediate
    align = moe.make_align_tile(Ex, Kk, BT)
    count = moe.make_align_count_tile(Ex, Kk, chunk_tokens)
    offsets = moe.make_align_offsets_tile(Ex, BT)
    place = moe.make_align_place_tile(Ex, Kk, BT, chunk_tokens)
    rows = moe.make_align_rows_tile(Ex, Kk, BT, chunk_tokens)
    gate_up = moe.make_gate_up_tile(Hd, Fi, Ex, stages=grouped_stages)
    down = moe.make_down_tile(Fi, Hd, Ex, stages=grouped_stages)
    combine = moe.make_combine_tile(Hd, Kk, min(512, Hd))
    qk = rope.make_qk_norm_rope_tile(*qwen_heads)
    Hq, Hk = qwen_heads

    def routing_only(engine, block_tokens, experts_per_task):
        router = moe.make_router_tile(Hd, Ex, block_tokens, experts_per_task, engine=engine)
        topk_tile = moe.make_topk_tile(Ex, Kk, block_tokens)

        @graph_func
        def router_only(x: Tensor(("T", Hd), "bfloat16"), w: Tensor((Hd, Ex), "bfloat16")):
            n = x.shape[0]
            blocks = moe.ceil_div(n, block_tokens)
            ready = ETensor((blocks,), name="logits_ready")
            logits = call_device(router, tile_num=(blocks, 1, Ex // experts_per_task),
                                 args=[x, w], out=Tensor((1, n, Ex), "float32"),
                                 out_edges={ready: "bsj->b"})
            return call_device(topk_tile, tile_num=(blocks,), args=[logits],
                               out=[Tensor((n, Kk), "int32"), Tensor((n, Kk), "float32")],
                               in_edges={ready: "b->b"})

        return router_only

    topk_splits, topk_block = 2, 8
    topk_tile = moe.make_topk_tile(Ex, Kk, topk_block, splits=topk_splits)

    @graph_func
    def topk_only(logits: Tensor((topk_splits, "T", Ex), "float32")):
        """The top-K of the sums of 2 partial logits, tokens 8 a task."""
        n = logits.shape[1]
        return call_device(topk_tile, tile_num=(moe.ceil_div(n, topk_block),), args=[logits],
                           out=[Tensor((n, Kk), "int32"), Tensor((n, Kk), "float32")])

    @graph_func
    def align_only(topk: Tensor(("T", Kk), "int32")):
        n = topk.shape[0]
        tiles = moe.max_tiles(n, Ex, Kk, BT)
        return call_device(align, tile_num=(1,), args=[topk],
                           out=[Tensor((Ex,), "int32"), Tensor((Ex + 1,), "int32"),
                                Tensor((n, Kk), "int32"), Tensor((n, Kk), "int32"),
                                Tensor((tiles * BT,), "int32"), Tensor((tiles,), "int32")])

    @graph_func
    def align_chunked(topk: Tensor(("T", Kk), "int32")):
        """Align over several CTAs: count, offsets, place; the same outputs as align_only."""
        n = topk.shape[0]
        tiles, chunks = moe.max_tiles(n, Ex, Kk, BT), moe.ceil_div(n, chunk_tokens)
        counted, offset = ETensor((1,), name="counted"), ETensor((1,), name="offset")
        chunk_counts = call_device(count, tile_num=(chunks,), args=[topk],
                                   out=Tensor((chunks, Ex), "int32"),
                                   out_edges={counted: "c->0"})
        counts, indptr, chunk_row, tile_expert = call_device(
            offsets, tile_num=(1,), args=[chunk_counts],
            out=[Tensor((Ex,), "int32"), Tensor((Ex + 1,), "int32"),
                 Tensor((chunks, Ex), "int32"), Tensor((tiles,), "int32")],
            in_edges={counted: "i->0"}, out_edges={offset: "i->0"})
        pair_row, pair_tile, sorted_token, exp_indptr = call_device(
            place, tile_num=(chunks,), args=[topk, counts, indptr, chunk_row],
            out=[Tensor((n, Kk), "int32"), Tensor((n, Kk), "int32"),
                 Tensor((tiles * BT,), "int32"), Tensor((Ex + 1,), "int32")],
            in_edges={offset: "c->0"})
        return counts, exp_indptr, pair_row, pair_tile, sorted_token, tile_expert

    @graph_func
    def align_rows(topk: Tensor(("T", Kk), "int32")):
        """Align over several CTAs in two calls: count, then place tasks that sum the counts
        themselves; align_only's outputs but the counts."""
        n = topk.shape[0]
        tiles, chunks = moe.max_tiles(n, Ex, Kk, BT), moe.ceil_div(n, chunk_tokens)
        counted = ETensor((1,), name="counted")
        chunk_counts = call_device(count, tile_num=(chunks,), args=[topk],
                                   out=Tensor((chunks, Ex), "int32"),
                                   out_edges={counted: "c->0"})
        return call_device(rows, tile_num=(chunks,), args=[topk, chunk_counts],
                           out=[Tensor((n, Kk), "int32"), Tensor((n, Kk), "int32"),
                                Tensor((tiles * BT,), "int32"), Tensor((Ex + 1,), "int32"),
                                Tensor((tiles,), "int32")],
                           in_edges={counted: "c->0"})

    @graph_func
    def gate_up_only(x: Tensor(("T", Hd), "bfloat16"), w: Tensor((Ex, Hd, 2 * Fi), "bfloat16"),
                     sorted_token: Tensor(("R",), "int32"), tile_expert: Tensor(("G",), "int32"),
                     exp_indptr: Tensor((Ex + 1,), "int32")):
        g = tile_expert.shape[0]
        return call_device(gate_up, tile_num=(g, 2 * Fi // 64),
                           args=[x, w, sorted_token, tile_expert, exp_indptr],
                           out=Tensor((sorted_token.shape[0], Fi), "bfloat16"))

    @graph_func
    def down_only(h: Tensor(("R", Fi), "bfloat16"), w: Tensor((Ex, Fi, Hd), "bfloat16"),
                  sorted_token: Tensor(("R",), "int32"), tile_expert: Tensor(("G",), "int32"),
                  exp_indptr: Tensor((Ex + 1,), "int32")):
        g = tile_expert.shape[0]
        return call_device(down, tile_num=(g, Hd // 64),
                           args=[h, w, sorted_token, tile_expert, exp_indptr],
                           out=Tensor((h.shape[0], Hd), "float32"))

    @graph_func
    def combine_only(topw: Tensor(("T", Kk), "float32"), pair_row: Tensor(("T", Kk), "int32"),
                     pair_tile: Tensor(("T", Kk), "int32"), y: Tensor(("R", Hd), "float32")):
        n = topw.shape[0]
        return call_device(combine, tile_num=(n, Hd // min(512, Hd)),
                           args=[topw, pair_row, pair_tile, y],
                           out=Tensor((n, Hd), "bfloat16"))

    @graph_func
    def qk_norm_rope_only(q: Tensor(("T", Hq * 128), "bfloat16"),
                          k: Tensor(("T", Hk * 128), "bfloat16"),
                          qw: Tensor((128,), "bfloat16"), kw: Tensor((128,), "bfloat16"),
                          positions: Tensor(("T",), "int32")):
        n = q.shape[0]
        return call_device(qk, tile_num=(n,), args=[q, k, qw, kw, positions],
                           out=[Tensor((n, Hq * 128), "bfloat16"),
                                Tensor((n, Hk * 128), "bfloat16")])

    return {"router": routing_only("fma", 8, 16), "router_mma": routing_only("mma", 16, 32),
            "topk": topk_only, "align": align_only, "align_chunked": align_chunked,
            "align_rows": align_rows,
            "topk_align": counted_align_graph(Ex, Kk, chunk_tokens, topk_block),
            "gate_up": gate_up_only,
            "down": down_only, "combine": combine_only, "qk_norm_rope": qk_norm_rope_only}


def counted_align_graph(experts, top_k, chunk_tokens=CHUNK_TOKENS, block_tokens=8):
    """Align in one call: top-k tasks of ``block_tokens`` that count their picks per expert,
    then place tasks of ``chunk_tokens`` that sum those rows; returns topk, the counts, and
    align_rows' outputs."""
    counted_topk = moe.make_topk_tile(experts, top_k, block_tokens, counts=True)
    rows = moe.make_align_rows_tile(experts, top_k, BT, chunk_tokens, count_tokens=block_tokens)

    @graph_func
    def topk_align(logits: Tensor((1, "T", experts), "float32")):
        n = logits.shape[1]
        tiles, chunks = moe.max_tiles(n, experts, top_k, BT), moe.ceil_div(n, chunk_tokens)
        blocks = moe.ceil_div(n, block_tokens)
        counted = ETensor((1,), name="counted")
        topk, _, block_counts = call_device(
            counted_topk, tile_num=(blocks,), args=[logits],
            out=[Tensor((n, top_k), "int32"), Tensor((n, top_k), "float32"),
                 Tensor((blocks, experts), "int32")], out_edges={counted: "b->0"})
        return (topk, block_counts, *call_device(
            rows, tile_num=(chunks,), args=[topk, block_counts],
            out=[Tensor((n, top_k), "int32"), Tensor((n, top_k), "int32"),
                 Tensor((tiles * BT,), "int32"), Tensor((experts + 1,), "int32"),
                 Tensor((tiles,), "int32")],
            in_edges={counted: "c->0"}))

    return topk_align


def routed_tiles_graph(experts, top_k, tile_rows=BT, splits=2, threads=128):
    """``moe.tile_from_logits`` alone: task g writes tile g's expert and the tokens of its rows, as
    a routed gate_up task finds them from the router's ``splits`` partial logits, into
    tile_expert (tiles,) and sorted_token (tiles * tile_rows,); the reference is align's."""
    E, S, BT_ = experts, splits, tile_rows
    ntok, tiles, rows = (tirx.Var(n, "int32") for n in ("T", "tiles", "rows"))

    @T.prim_func
    def routed_tile(g: T.int32, logits: T.Buffer((S, ntok, E), "float32"),
                    tile_expert: T.Buffer((tiles,), "int32"),
                    sorted_token: T.Buffer((rows,), "int32")):
        T.device_entry()
        tx = T.thread_id([threads])
        warp = T.warp_id([threads // moe.WARP])
        lane = T.lane_id([moe.WARP])
        expert = T.alloc_shared((1,), "int32")
        tokens = T.alloc_shared((BT_,), "int32")
        moe.tile_from_logits(g, logits, top_k, BT_, threads, tx, warp, lane, expert, tokens)
        if tx == 0:
            tile_expert[g] = expert[0]
        if tx < BT_:
            sorted_token[g * BT_ + tx] = tokens[tx]

    tile = device_func(routed_tile.with_attr("global_symbol", "routed_tile"))

    @tile.set_reference
    def _(g, logits, tile_expert, sorted_token):
        picks, _ = moe.top_k_of(moe.summed_logits(logits), top_k)
        _, _, _, tokens, experts = moe.align_reference(picks, E, BT_, len(tile_expert))
        tile_expert[g] = experts[g]
        sorted_token[g * BT_:(g + 1) * BT_] = tokens[g * BT_:(g + 1) * BT_]

    @graph_func
    def routed_tiles(logits: Tensor((S, "T", E), "float32")):
        tiles_ = moe.max_tiles(logits.shape[1], E, top_k, BT_)
        return call_device(tile, tile_num=(tiles_,), args=[logits],
                           out=[Tensor((tiles_,), "int32"), Tensor((tiles_ * BT_,), "int32")])

    return routed_tiles


def one_call_dims(name, tokens, experts=128, top_k=8):
    """The sizes the graph ``name`` of ``one_call_graphs`` takes for ``tokens`` tokens."""
    tiles = moe.max_tiles(tokens, experts, top_k, BT)
    return {"router": {"T": tokens}, "router_mma": {"T": tokens}, "topk": {"T": tokens},
            "align": {"T": tokens}, "align_chunked": {"T": tokens},
            "align_rows": {"T": tokens}, "topk_align": {"T": tokens},
            "qk_norm_rope": {"T": tokens},
            "gate_up": {"T": tokens, "R": tiles * BT, "G": tiles},
            "down": {"R": tiles * BT, "G": tiles},
            "combine": {"T": tokens, "R": tiles * BT}}[name]
