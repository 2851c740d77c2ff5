"""An MoE layer as one graph function, and its NumPy reference.

Shapes: T tokens (the symbolic dim "T"), hidden H, E experts, top-k K, expert output F, and
expert tiles of BT rows. The graph is

    router (T tasks)    logits = x[t] @ w_router + bias; top-K experts and their softmax weights
    grouping (1 task)   tokens per expert, the CSR of expert tiles, each pair's row and tile
    scatter (T tasks)   x[t] copied to its K rows of the expert-sorted buffer xs
    expert (max_tiles)  ys = relu(xs @ w_expert[e]) on the tiles of expert e; unused tiles skip
    combine (T tasks)   out[t] = sum_k topw[t, k] * ys[row of (t, k)]

A pair (t, k) lives in row ``pair_slot[t, k]`` of xs and ys: expert e owns the tiles
``exp_indptr[e]`` to ``exp_indptr[e+1] - 1`` and its rows start at ``exp_indptr[e] * BT``, in
(t, k) row-major order. ``max_tiles = (T*K + BT - 1) // BT + E`` bounds the tiles used.
"""
import functools
import itertools
import zlib

import numpy as np
from etc_tvm import ETensor, Tensor, call_device, device_func, graph_func
from tvm.script import tirx as T

THREADS = 128
COUNT_MODES = ("tensor", "inferred")


def ceil_div(a, b):
    return (a + b - 1) // b


def max_tiles(tokens, experts: int, top_k: int, tile_rows: int):
    """Tiles of the expert call: enough for every expert's partial last tile."""
    return ceil_div(tokens * top_k, tile_rows) + experts


def make_moe_graph(hidden: int, experts: int, top_k: int, out_features: int, tile_rows: int,
                   count_mode: str, *, combine_waits: bool = True,
                   expert_ready_size: int | None = None):
    """The MoE graph function ``moe(x, w_router, bias, w_expert) -> out``; under the "mixed"
    strategy the expert tiles (data-dependent count, released by a trigger) go through the
    ready ring and the other calls through static queues.

    count_mode: the wait counts of ``expert_ready``, "tensor" (the ``counts`` grouping writes)
      or "inferred" (from scatter's data-dependent notifies, at run time).
    combine_waits, expert_ready_size: deliberately broken variants for the tests (a combine
      that waits on nothing; an ``expert_ready`` of another size than ``experts``).
    """
    if count_mode not in COUNT_MODES:
        raise ValueError(f"count_mode must be one of {COUNT_MODES}, got {count_mode!r}")
    H, E, K, F, BT = hidden, experts, top_k, out_features, tile_rows
    ntok, rows = T.int32(), T.int32()  # tokens, and rows of xs / ys

    @device_func
    def router(t: T.int32, x: T.Buffer((ntok, H), "float32"),
               w_router: T.Buffer((H, E), "float32"), bias: T.Buffer((E,), "float32"),
               topk: T.Buffer((ntok, K), "int32"), topw: T.Buffer((ntok, K), "float32")):
        """One logit per thread, then thread 0 picks the top K and their softmax weights."""
        T.device_entry()
        tx = T.thread_id([THREADS])
        logits = T.alloc_shared((E,), "float32")
        for r in T.serial(ceil_div(E, THREADS)):
            e = r * THREADS + tx
            if e < E:
                logits[e] = bias[e]
                for h in T.serial(H):
                    logits[e] = logits[e] + x[t, h] * w_router[h, e]
        T.cuda.cta_sync()
        if tx == 0:
            chosen = T.alloc_local((E,), "int32")
            best = T.local_scalar("float32")
            arg = T.local_scalar("int32")
            total = T.local_scalar("float32")
            for e in T.serial(E):
                chosen[e] = 0
            for k in T.serial(K):
                best = logits[0]
                arg = -1
                for e in T.serial(E):  # strict '>': ties go to the lower expert id
                    if chosen[e] == 0 and (arg < 0 or logits[e] > best):
                        best = logits[e]
                        arg = e
                chosen[arg] = 1
                topk[t, k] = arg
                topw[t, k] = best
            total = T.float32(0)
            for k in T.serial(K):
                topw[t, k] = T.exp(topw[t, k] - logits[topk[t, 0]])
                total = total + topw[t, k]
            for k in T.serial(K):
                topw[t, k] = topw[t, k] / total

    @router.set_reference
    def _(t, x, w_router, bias, topk, topw):
        logits = x[t] @ w_router + bias
        topk[t] = np.argsort(-logits, kind="stable")[:K]
        weights = np.exp(logits[topk[t]] - logits[topk[t, 0]])
        topw[t] = weights / weights.sum()

    @device_func
    def grouping(i: T.int32, topk: T.Buffer((ntok, K), "int32"), counts: T.Buffer((E,), "int32"),
                 exp_indptr: T.Buffer((E + 1,), "int32"), pair_slot: T.Buffer((ntok, K), "int32"),
                 pair_tile: T.Buffer((ntok, K), "int32")):
        """Thread 0: count, prefix-sum the tiles, then hand out rows, reusing counts as cursors."""
        T.device_entry()
        tx = T.thread_id([THREADS])
        if tx == 0:
            for e in T.serial(E):
                counts[e] = 0
            for t in T.serial(ntok):
                for k in T.serial(K):
                    counts[topk[t, k]] = counts[topk[t, k]] + 1
            exp_indptr[0] = 0
            for e in T.serial(E):
                exp_indptr[e + 1] = exp_indptr[e] + (counts[e] + BT - 1) // BT
                counts[e] = 0
            for t in T.serial(ntok):
                for k in T.serial(K):
                    pair_slot[t, k] = exp_indptr[topk[t, k]] * BT + counts[topk[t, k]]
                    pair_tile[t, k] = pair_slot[t, k] // BT
                    counts[topk[t, k]] = counts[topk[t, k]] + 1

    @grouping.set_reference
    def _(i, topk, counts, exp_indptr, pair_slot, pair_tile):
        counts[:], exp_indptr[:], pair_slot[:] = group(topk, E, BT)
        pair_tile[:] = pair_slot // BT

    @device_func
    def scatter(t: T.int32, x: T.Buffer((ntok, H), "float32"), topk: T.Buffer((ntok, K), "int32"),
                pair_slot: T.Buffer((ntok, K), "int32"), xs: T.Buffer((rows, H), "float32")):
        """Copies x[t] to its K rows of xs; ``topk`` is read by the out-edge map only."""
        T.device_entry()
        tx = T.thread_id([THREADS])
        for r in T.serial(ceil_div(K * H, THREADS)):
            q = r * THREADS + tx
            if q < K * H:
                xs[pair_slot[t, q // H], q % H] = x[t, q % H]

    @scatter.set_reference
    def _(t, x, topk, pair_slot, xs):
        xs[pair_slot[t]] = x[t]

    @device_func
    def expert(g: T.int32, xs: T.Buffer((rows, H), "float32"),
               w_expert: T.Buffer((E, H, F), "float32"), exp_indptr: T.Buffer((E + 1,), "int32"),
               counts: T.Buffer((E,), "int32"), ys: T.Buffer((rows, F), "float32")):
        """Tile g of its expert e: relu(xs @ w_expert[e]) on the tile's real rows only."""
        T.device_entry()
        tx = T.thread_id([THREADS])
        e = T.local_scalar("int32")
        e = 0
        for c in T.serial(E):  # the last expert whose tiles start at or before g
            if exp_indptr[c] <= g:
                e = c
        for r in T.serial(ceil_div(BT * F, THREADS)):
            q = r * THREADS + tx
            if q < BT * F and (g - exp_indptr[e]) * BT + q // F < counts[e]:
                ys[g * BT + q // F, q % F] = T.float32(0)
                for h in T.serial(H):
                    ys[g * BT + q // F, q % F] = (ys[g * BT + q // F, q % F]
                                                  + xs[g * BT + q // F, h] * w_expert[e, h, q % F])
                ys[g * BT + q // F, q % F] = T.max(ys[g * BT + q // F, q % F], T.float32(0))

    @expert.set_reference
    def _(g, xs, w_expert, exp_indptr, counts, ys):
        e = int(np.searchsorted(exp_indptr, g, side="right")) - 1
        if e == E:  # a tile past every expert's (run when no trigger skips it): no rows
            return
        real = min(BT, int(counts[e]) - (g - int(exp_indptr[e])) * BT)
        tile = slice(g * BT, g * BT + real)
        ys[tile] = np.maximum(xs[tile] @ w_expert[e], 0)

    @device_func
    def combine(t: T.int32, topw: T.Buffer((ntok, K), "float32"),
                pair_slot: T.Buffer((ntok, K), "int32"), pair_tile: T.Buffer((ntok, K), "int32"),
                ys: T.Buffer((rows, F), "float32"), out: T.Buffer((ntok, F), "float32")):
        """out[t] = the topw-weighted sum of its K expert rows; ``pair_tile`` feeds the in-edge."""
        T.device_entry()
        tx = T.thread_id([THREADS])
        for r in T.serial(ceil_div(F, THREADS)):
            f = r * THREADS + tx
            if f < F:
                out[t, f] = T.float32(0)
                for k in T.serial(K):
                    out[t, f] = out[t, f] + topw[t, k] * ys[pair_slot[t, k], f]

    @combine.set_reference
    def _(t, topw, pair_slot, pair_tile, ys, out):
        out[t] = topw[t] @ ys[pair_slot[t]]

    # A call with one output is named after it, so those stay unnamed: the calls are then
    # router0, grouping0, scatter0, expert0 and combine0 in task names and diagnostics.
    @graph_func
    def moe(x: Tensor(("T", H)), w_router: Tensor((H, E)), bias: Tensor((E,)),
            w_expert: Tensor((E, H, F))):
        tokens = x.shape[0]
        tiles = max_tiles(tokens, E, K, BT)
        routed = ETensor((1,), name="routed")
        topk, topw = call_device(router, tile_num=(tokens,), args=[x, w_router, bias],
                                 out=[Tensor((tokens, K), "int32", name="topk"),
                                      Tensor((tokens, K), name="topw")],
                                 out_edges={routed: "t->0"})
        grouped = ETensor((1,), name="grouped")
        counts, exp_indptr, pair_slot, pair_tile = call_device(
            grouping, tile_num=(1,), args=[topk],
            out=[Tensor((E,), "int32", name="counts"),
                 Tensor((E + 1,), "int32", name="exp_indptr"),
                 Tensor((tokens, K), "int32", name="pair_slot"),
                 Tensor((tokens, K), "int32", name="pair_tile")],
            in_edges={routed: "i->0"}, out_edges={grouped: "i->0"})
        expert_ready = ETensor((expert_ready_size or E,), name="expert_ready",
                               wait_count=counts if count_mode == "tensor" else None)
        xs = call_device(scatter, tile_num=(tokens,), args=[x, topk, pair_slot],
                         out=Tensor((tiles * BT, H)),
                         in_edges={grouped: "t->0"}, out_edges={expert_ready: "t->topk[t,:]"})
        tile_done = ETensor((tiles,), name="tile_done")
        ys = call_device(expert, tile_num=(tiles,), args=[xs, w_expert, exp_indptr, counts],
                         out=Tensor((tiles * BT, F)),
                         in_edges={expert_ready: "e=>exp_indptr[e]:exp_indptr[e+1]"},
                         out_edges={tile_done: "g->g"}, schedule="dynamic")
        return call_device(combine, tile_num=(tokens,), args=[topw, pair_slot, pair_tile, ys],
                           out=Tensor((tokens, F)),
                           in_edges={tile_done: "t->pair_tile[t,:]"} if combine_waits else None)

    return moe


def route(x, w_router, bias, top_k: int):
    """Top-K experts per token (descending logits, ties by lower id) and their softmax weights,
    in float64."""
    logits = x.astype(np.float64) @ w_router.astype(np.float64) + bias.astype(np.float64)
    topk = np.argsort(-logits, axis=1, kind="stable")[:, :top_k]
    chosen = np.take_along_axis(logits, topk, axis=1)
    weights = np.exp(chosen - chosen[:, :1])
    return topk.astype(np.int32), weights / weights.sum(axis=1, keepdims=True)


def group(topk, experts: int, tile_rows: int):
    """``(counts, exp_indptr, pair_slot)`` of a routing, as the grouping task computes them."""
    counts = np.bincount(topk.ravel(), minlength=experts).astype(np.int32)
    exp_indptr = np.zeros(experts + 1, np.int32)
    exp_indptr[1:] = np.cumsum(ceil_div(counts, tile_rows))
    pair_slot = np.empty(topk.shape, np.int32)
    cursor = exp_indptr[:-1] * tile_rows
    for pair, e in enumerate(topk.ravel()):  # row-major (t, k) order within each expert
        pair_slot.flat[pair] = cursor[e]
        cursor[e] += 1
    return counts, exp_indptr, pair_slot


def moe_reference(x, w_router, bias, w_expert, top_k: int):
    """The whole layer in float64, no tiles: sum_k topw[t, k] * relu(x[t] @ w_expert[e_k])."""
    topk, topw = route(x, w_router, bias, top_k)
    hidden = np.maximum(np.einsum("th,tkhf->tkf", x.astype(np.float64),
                                  w_expert.astype(np.float64)[topk]), 0)
    return np.einsum("tk,tkf->tf", topw, hidden)


# ---------------------------------------------------------------- the configuration the tests use
H, E, F, BT = 32, 8, 16, 4
HOT = 3  # every token's first choice in the "one_expert" routing
TOKENS = (1, 7, 12)  # 7: not a multiple of BT
ROUTINGS = [("random", 1), ("random", 2), ("one_expert", 1), ("one_expert", 2),
            ("idle_experts", 2)]


@functools.lru_cache(maxsize=None)
def moe_graph(top_k, count_mode):
    return make_moe_graph(H, E, top_k, F, BT, count_mode)


def routing_margin(x, w_router, bias, top_k):
    """The smallest gap between a token's K-th and (K+1)-th logit (float64)."""
    logits = np.sort(x.astype(np.float64) @ w_router + bias, axis=1)[:, ::-1]
    return float((logits[:, top_k - 1] - logits[:, top_k]).min())


def make_inputs(routing, tokens, top_k, seed=0):
    """``(x, w_router, bias, w_expert)``, float32, seeded by the arguments; redrawn while two
    experts nearly tie for a token's last place (float32 tiles and the float64 reference must
    pick the same experts)."""
    for attempt in itertools.count():
        key = f"{routing}/{tokens}/{top_k}" + (f"/{seed}" if seed else "") \
            + (f"#{attempt}" if attempt else "")
        rng = np.random.default_rng(zlib.crc32(key.encode()))
        x = rng.standard_normal((tokens, H))
        w_router = rng.standard_normal((H, E)) / np.sqrt(H)
        w_expert = rng.standard_normal((E, H, F)) / np.sqrt(H)
        bias = rng.standard_normal(E) * 0.1
        if routing == "random":
            bias[:] = 0
        elif routing == "one_expert":  # x @ w_router is ~0.3 wide: HOT leads by about 5
            w_router *= 0.05
            bias[HOT] = 5
        elif routing == "idle_experts":
            bias[::2] = -100
        inputs = tuple(a.astype(np.float32) for a in (x, w_router, bias, w_expert))
        if routing_margin(*inputs[:3], top_k) > 1e-4:
            return inputs
