"""Mixture-of-experts tiles (Qwen3-MoE shaped): router, align, grouped GEMMs, combine.

The layer, for T tokens (symbolic), hidden H, E experts, top-K, expert intermediate F, and
expert tiles of BT rows::

    router   task (b, s, j)      logits[s, TB tokens, EB experts] = x[:, split s] @
                                 w_router[split s] (fp32 partial logits over S splits of H)
    topk     task b (TB tokens)  top-K experts per token of the summed logits, their softmax
                                 weights renormalised to sum to 1
    align    task 0 (one CTA)    per-expert counts, the CSR of expert tiles exp_indptr [E+1],
                                 each (t, k) pair's row (pair_row) and tile, each row's token
                                 (or over several CTAs: align_count, align_offsets,
                                 align_place; align_count, align_rows; or top-k counting,
                                 align_rows)
    gate_up  task (g, n)         h[rows of g, cols n] = silu(x[tok] @ Wg[e]) * (x[tok] @ Wu[e])
    down     task (g, n)         y[rows of g, cols n] = h[rows of g] @ Wd[e]       (fp32)
    combine  task (t, c)         out[t, cols c] = sum_k w[t, k] * y[pair_row[t, k]]  (bf16)

Expert e owns tiles ``exp_indptr[e] .. exp_indptr[e+1] - 1`` and rows from
``exp_indptr[e] * BT`` on, its pairs in (t, k) row-major order; the last tile of an expert is
padded (``sorted_token`` -1). ``max_tiles = n + (T*K - n) // BT`` with ``n = min(E, T*K)``
bounds the tiles used; a grouped GEMM task of a tile past ``exp_indptr[E]``
(``tile_expert[g] == E``) does nothing, and in a megakernel no trigger releases it, so it is
skipped.

Choices, and why:

- Router tasks take TB tokens: a token does only 2 FLOP per router weight, so the 512 KB
  ``w_router`` read dominates; a block of tokens reads it once, staged in shared memory. The
  experts are split over tasks (EB = 16: 8 tasks, 64 KB each), so that one token's routing
  is not one SM's 512 KB read and 2 M FMAs (38 us on the H200); top-K is a task of its own.
  Thread (group of 8 experts, contiguous slice of H) issues 16-byte loads of ``unroll``
  weight rows before it uses them; the slices are summed in shared memory. At few tokens
  the hidden rows are split too (S splits: 8 x S tasks of 64/S KB), since one token's
  logits are a 512 KB read on 8 SMs while the rest wait; each split writes its partial
  logits and top-K sums the S of them.
  Top-K runs one warp per token: K rounds of warp max, then warp min of the lanes' indices that
  reach it, so ties go to the lower expert index, as ``np.argsort(kind="stable")`` does.
  The softmax over all E cancels under renormalisation: ``w_k = exp(l_k - l_1) / sum_j
  exp(l_j - l_1)`` over the K chosen, which is what Qwen3's ``norm_topk_prob`` computes.
- Align is one CTA and deterministic: warp w walks its contiguous range of the T*K pairs 32
  at a time, each lane loading one pair (coalesced, 16 steps' loads in flight together),
  and counts them into its row of a (warps x E) count in shared memory (shared atomics:
  counts need no order). A column scan over the warps turns the rows into per-warp offsets
  within each expert, a block-wide (Hillis-Steele) scan of tiles per expert gives
  exp_indptr, and a second walk over the same ranges hands out rows in (t, k) order: the
  warp's offset, its running count, and the lanes below with the same expert
  (``__match_any_sync``, whose lowest lane then adds the step's pairs to the running count).
  2 KB of counts for 128 experts on 4 warps.
  At 1024 tokens on the H200: 20 us (threads with contiguous chunks of their own, the first
  design, loaded and stored one line per lane per pair and scanned 128 rows of counts: 37).
  Over several CTAs (``make_align_count_tile``, ``make_align_offsets_tile``,
  ``make_align_place_tile``) the same walk runs a chunk of tokens a task, twice: count
  tasks give each chunk's pairs of each expert, one offsets task scans them over the chunks
  and the experts, and place tasks walk their chunks again from those offsets; the outputs
  are the one task's, bit for bit. At 1024 tokens: 10.4 - 29.6 us for all three phases
  (the single task: 19.7 - 39.5), as the walks are 8 steps a warp instead of 64 (chunks of
  128 tokens); chunks of 64 tokens end the place call 4.6 us sooner again. Place tasks that
  sum the chunks' counts themselves (``make_align_rows_tile``) drop the offsets task and its
  hop: the routing then ends 5.4 us sooner at 1024 tokens. Top-k tasks that count their
  picks (``make_topk_tile(counts=True)``) drop the count call and its hop too: the place
  tasks sum the top-k tasks' rows of counts (1.2 - 8.1 us faster at 512 and 1024 tokens).
- Grouped GEMMs gather A rows straight from x by ``sorted_token`` (cp.async from the token's
  row): no scattered copy of x, one task and one hop fewer, and the gather costs nothing extra
  since each row is loaded once per tile either way. BT = 16 is one m16 row block: at decode
  most experts get 1-8 pairs, and padding stays below one m16 block per expert.
- Expert weights are read in place, (E, K, N), or blocked by task columns (``block_columns``:
  (E, N/bn, K, bn)), so that a task's K x bn slab is one contiguous run and each ring stage
  reads whole DRAM pages; at 1024 tokens on the H200 the layer's barrier megakernel went from
  683 to 646 us with it and the dynamic one from 757 to 721, and one token took the same
  time either way.
- SiLU-and-multiply is fused in gate_up's epilogue: the gate and up weights are interleaved in
  blocks of 8 columns (``interleave_gate_up``), so accumulator blocks 2q and 2q+1 of a thread
  hold gate and up of the same h column (on the "swapped" engine, whose accumulators hold
  the tile transposed, a thread's halves g and g + 8 of a 16-column group); h is written
  once, in bf16, with no fp32 (rows, 2F) round trip and no extra dependency hop.
- y stays fp32 by default and the combine sums in fp32 in k order (deterministic, no
  atomics), rounding once to bf16. Stored in bf16 instead (``Y_DTYPES``, as vLLM keeps it),
  y costs half the bytes down writes and the combine reads back, for one more rounding.

Numeric contracts (against float64 of the same bf16 inputs) are in each ``*_bound`` function.
TVM compiles with ``--use_fast_math``: ``expf`` is ``ex2.approx`` and division approximate.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import tirx
from tvm.script import tirx as T

from ..device_func import DeviceFunc, await_inputs, device_func, input_check
from ..errors import EtcError, ExecutionError
from . import gemm, wgmma_gemm

WARP = 32
VEC = 8  # bf16 per 16-byte load
FLT_LOWEST = -3.4028234663852886e38  # a chosen expert's logit in the top-K rounds
INTERLEAVE = 8  # gate and up columns alternate in blocks of one n8 mma block


def ceil_div(a, b):
    return (a + b - 1) // b


def largest_divisor(n: int, most: int) -> int:
    """The largest divisor of ``n`` that is at most ``most``."""
    return next(d for d in range(min(n, most), 0, -1) if n % d == 0)


def max_tiles(tokens, experts: int, top_k: int, tile_rows: int):
    """Tiles of the grouped GEMMs, for any routing: at most ``n = min(E, T*K)`` experts have
    pairs, one pair each fills one tile, and the other ``T*K - n`` pairs add a tile per BT,
    so ``n + (T*K - n) // BT`` (8 tiles, not 129, for one token of Qwen3-30B-A3B). ``tokens``
    may be symbolic."""
    pairs = tokens * top_k
    busy = min(experts, pairs) if isinstance(pairs, int) else tirx.min(pairs, experts)
    return busy + (pairs - busy) // tile_rows


# ----------------------------------------------------------------------------------- router
ROUTER_ENGINES = ("fma", "mma")
# What a router task's experts must be on each engine: on CUDA cores a thread reads 16 bytes
# of a weight row (VEC experts) and groups of VEC share out the threads; on tensor cores the
# warps share the task in whole m16 x n16 blocks.
ROUTER_FIT = {"fma": f"a multiple of {VEC} that divides the experts, its groups of {VEC} the "
                     "threads",
              "mma": "a multiple of 16 that divides the experts, the threads' warps sharing "
                     "16 tokens of them in m16 x n16 blocks"}
# What a split's hidden rows must be a multiple of: a thread's 16-byte load of x on CUDA
# cores, the K slice on tensor cores.
ROUTER_SPLIT_ROWS = {"fma": VEC, "mma": 64}


def router_experts_fit(experts: int, experts_per_task: int, engine: str,
                       threads: int = 128) -> bool:
    """Whether router tasks of ``experts_per_task`` experts on ``engine`` cover ``experts``
    (``ROUTER_FIT``)."""
    EB = experts_per_task
    if EB < 1 or experts % EB:
        return False
    if engine == "mma":  # a block of 16 tokens, the fewest a tensor-core task takes
        try:
            gemm.warp_grid(16, EB, threads // WARP, ROUTER_SPLIT_ROWS["mma"])
        except EtcError:
            return False
        return True
    return EB % VEC == 0 and threads % (EB // VEC) == 0


def router_splits_fit(hidden: int, splits: int, engine: str) -> bool:
    """Whether ``splits`` router tasks on ``engine`` can share the ``hidden`` rows
    (``ROUTER_SPLIT_ROWS``)."""
    return splits >= 1 and hidden % splits == 0 \
        and hidden // splits % ROUTER_SPLIT_ROWS[engine] == 0


def router_experts_for(experts: int, engine: str, most: int, threads: int = 128) -> int | None:
    """The most experts, up to ``most``, that one router task on ``engine`` can take of
    ``experts`` (``router_experts_fit``); None where no block fits (Mixtral's 8 experts on
    tensor cores, or a count that is not a multiple of ``VEC``)."""
    return next((eb for eb in range(min(most, experts), 0, -1)
                 if router_experts_fit(experts, eb, engine, threads)), None)


@functools.cache
def make_router_tile(hidden: int, experts: int, block_tokens: int = 8,
                     experts_per_task: int = 16, threads: int = 128,
                     unroll: int = 16, splits: int = 1, engine: str = "fma") -> DeviceFunc:
    """The tile ``router_<H>x<E>_b<TB>_e<EB>_s<S>``: task (b, s, j) writes the fp32 partial
    logits of tokens b*TB .. b*TB + TB - 1 (those below T) for experts j*EB .. j*EB + EB - 1
    over hidden rows s*H/S .. (s+1)*H/S - 1 into logits[s] of (S, T, E); the top-k tile sums
    the S partials. ``engine``: "fma" (CUDA cores; a thread keeps ``unroll`` 16-byte weight
    loads in flight; any block of tokens, for a few) or "mma" (tensor cores, ``gemm.MmaTile``;
    blocks of 16-token multiples: at 1024 tokens the router is a 1024 x 2048 x 128 GEMM, which
    took 34 us on the H200 on CUDA cores). bf16 products are exact in fp32, so both meet
    ``logit_bound`` whatever order they add in."""
    if engine not in ROUTER_ENGINES:
        raise EtcError(f"router tile: engine must be one of {ROUTER_ENGINES}, got {engine!r}")
    if threads % WARP or not router_experts_fit(experts, experts_per_task, engine, threads):
        raise EtcError(f"router tile: {experts_per_task} experts a task on {engine!r} do not "
                       f"fit the {experts} experts and {threads} threads ({ROUTER_FIT[engine]})")
    if not router_splits_fit(hidden, splits, engine):
        raise EtcError(f"router tile: {splits} splits on {engine!r} must divide hidden "
                       f"{hidden} into multiples of {ROUTER_SPLIT_ROWS[engine]} rows")
    if engine == "mma":
        return _router_mma_tile(hidden, experts, block_tokens, experts_per_task, threads,
                                splits)
    H, E, TB, EB, S = hidden, experts, block_tokens, experts_per_task, splits
    groups = EB // VEC
    HS = H // S  # hidden rows of a task
    # the split's rows in equal slices, a thread's rows in equal steps
    slices = largest_divisor(HS, threads // groups)
    all_busy = slices * groups == threads  # else the threads past them idle in the sums
    span = HS // slices
    U = largest_divisor(span, unroll)  # weight rows a thread loads before it uses them
    xvec = math.gcd(U, VEC)
    ntok = tirx.Var("T", "int32")

    @T.prim_func
    def router(b: T.int32, s0: T.int32, j0: T.int32, x: T.Buffer((ntok, H), "bfloat16"),
               w_router: T.Buffer((H, E), "bfloat16"),
               logits: T.Buffer((S, ntok, E), "float32")):
        T.device_entry()
        tx = T.thread_id([threads])
        xs = T.alloc_shared((TB, HS), "bfloat16")
        part = T.alloc_shared((slices, TB, EB), "float32")
        acc = T.alloc_local((TB, VEC), "float32")
        wv = T.alloc_local((U, VEC), "bfloat16")
        xv = T.alloc_local((U,), "bfloat16")
        eg = T.meta_var(tx % groups)
        hs = T.meta_var(tx // groups)  # thread rows hs*span .. (hs+1)*span - 1 of the split
        for q in T.serial(ceil_div(TB * HS // VEC, threads)):
            v = T.meta_var(q * threads + tx)
            if v < TB * HS // VEC:
                # rows past T copy the last token; their logits are never stored
                for j in T.vectorized(VEC):
                    xs[v // (HS // VEC), v % (HS // VEC) * VEC + j] = x[
                        T.min(b * TB + v // (HS // VEC), ntok - 1),
                        s0 * HS + v % (HS // VEC) * VEC + j]
        for t in T.unroll(TB):
            for j in T.unroll(VEC):
                acc[t, j] = T.float32(0)
        T.cuda.cta_sync()
        if all_busy or hs < slices:
            for ho in T.serial(span // U):
                k0 = T.meta_var(hs * span + ho * U)
                for u in T.unroll(U):
                    for j in T.vectorized(VEC):
                        wv[u, j] = w_router[s0 * HS + k0 + u, j0 * EB + eg * VEC + j]
                for t in T.unroll(TB):
                    for uo in T.unroll(U // xvec):
                        for j in T.vectorized(xvec):
                            xv[uo * xvec + j] = xs[t, k0 + uo * xvec + j]
                    for u in T.unroll(U):
                        for j in T.unroll(VEC):
                            acc[t, j] = acc[t, j] + T.Cast("float32", xv[u]) * T.Cast(
                                "float32", wv[u, j])
            for t in T.unroll(TB):
                for j in T.unroll(VEC):
                    part[hs, t, eg * VEC + j] = acc[t, j]
        T.cuda.cta_sync()
        for q in T.serial(ceil_div(TB * EB, threads)):
            v = T.meta_var(q * threads + tx)
            if v < TB * EB and b * TB + v // EB < ntok:
                total = T.local_scalar("float32")
                total = T.float32(0)
                for sl in T.serial(slices):
                    total = total + part[sl, v // EB, v % EB]
                logits[s0, b * TB + v // EB, j0 * EB + v % EB] = total

    name = f"router_{H}x{E}_b{TB}_e{EB}_s{S}_u{U}_t{threads}"
    return _with_router_reference(device_func(router.with_attr("global_symbol", name),
                                              cost=span // 64 + 1), TB, EB, HS)


def _router_mma_tile(H: int, E: int, TB: int, EB: int, threads: int, S: int,
                     stages: int = 4) -> DeviceFunc:
    """``make_router_tile(engine="mma")``: a TB x EB ``gemm.MmaTile`` over the split's hidden
    rows; rows past T are read as zeros and not stored."""
    bk = ROUTER_SPLIT_ROWS["mma"]
    gemm.check_geometry(TB, EB, bk, threads, stages)
    HS = H // S
    ntok = tirx.Var("T", "int32")

    @T.prim_func
    def router(b: T.int32, s0: T.int32, j0: T.int32, x: T.Buffer((ntok, H), "bfloat16"),
               w_router: T.Buffer((H, E), "bfloat16"),
               logits: T.Buffer((S, ntok, E), "float32")):
        T.device_entry()
        tx = T.thread_id([threads])
        warp = T.warp_id([threads // WARP])
        lane = T.lane_id([WARP])
        mma = gemm.MmaTile(TB, EB, bk, threads, stages, tx, warp, lane)
        mma.run(lambda r, k: x.ptr_to([T.min(b * TB + r, ntok - 1), s0 * HS + k]),
                lambda k, c: w_router.ptr_to([s0 * HS + k, j0 * EB + c]), HS // bk,
                lambda r: b * TB + r < ntok)
        for m in T.unroll(mma.mi):
            for n in T.unroll(mma.ni):
                for hh in T.unroll(2):
                    for v in T.unroll(2):
                        if b * TB + mma.row(m, hh) < ntok:
                            logits[s0, b * TB + mma.row(m, hh), j0 * EB + mma.col(n, v)] = \
                                mma.frag(m, n, 2 * hh + v)

    name = f"router_{H}x{E}_b{TB}_e{EB}_s{S}_mma_s{stages}_t{threads}"
    return _with_router_reference(device_func(router.with_attr("global_symbol", name),
                                              cost=HS // bk), TB, EB, HS)


def _with_router_reference(tile: DeviceFunc, TB: int, EB: int, HS: int) -> DeviceFunc:
    @tile.set_reference
    def _(b, s0, j0, x, w_router, logits):
        rows, cols = slice(b * TB, min((b + 1) * TB, x.shape[0])), slice(j0 * EB, (j0 + 1) * EB)
        ks = slice(s0 * HS, (s0 + 1) * HS)
        logits[s0, rows, cols] = x[rows, ks].astype(np.float32) @ w_router[ks, cols].astype(
            np.float32)

    return tile


FULL_MASK = 0xFFFFFFFF


def order_key(value):
    """The int32 whose order is ``value``'s (a float32, not NaN), -0 and +0 alike: a warp's
    maximum is then one ``redux.sync``, where a float's takes five dependent shuffles."""
    bits = T.reinterpret("int32", value)
    return T.if_then_else(bits < 0, T.int32(0) - (bits & T.int32(0x7FFFFFFF)), bits)


def order_value(key):
    """The float32 of ``order_key`` ``key`` (+0 for either zero)."""
    return T.if_then_else(key < 0, T.float32(0) - T.reinterpret("float32", T.int32(0) - key),
                          T.reinterpret("float32", key))


@T.meta_class
class TopKPicker:
    """The top-K experts of a block of TB tokens from the router's S partial logits (S, T, E),
    summed in s order, each token's picks by one warp (``rounds`` tokens a warp, one after
    another): the ids in topk (T, K) and their renormalised softmax weights in topw (T, K).
    A round's maximum and the lowest index holding it are two ``redux.sync`` of the warp
    (``order_key``)."""

    def __init__(self, experts, top_k, block_tokens, splits, threads, warp, lane):
        self.E, self.K, self.TB, self.S = experts, top_k, block_tokens, splits
        self.warp, self.lane = warp, lane
        self.warps, self.per_lane = threads // WARP, ceil_div(experts, WARP)
        self.rounds = ceil_div(block_tokens, self.warps)
        self.vals = T.alloc_local((self.rounds, self.per_lane), "float32")
        self.weight = T.alloc_local((top_k,), "float32")

    @T.inline
    def pick(self, b, logits, topk, topw, hist=None, token_bits=False):
        # hist, if given: a shared (E,) count that each pick adds one to (an unpickable
        # token's id E is not counted), or with token_bits 1 << t for block token t (a set
        # of the block's tokens: a token picks an expert once); topk and topw may be None
        E, K, TB, S = T.meta_var((self.E, self.K, self.TB, self.S))
        warps, per_lane, lane, vals = T.meta_var((self.warps, self.per_lane, self.lane,
                                                  self.vals))
        ntok = T.meta_var(logits.shape[1])
        # every token's logits before any pick: in the megakernel nothing tells the compiler
        # that topk and topw do not overlap the logits, so a token's stores held the next
        # token's loads back, one round trip a token
        for tt in T.unroll(self.rounds):
            t = T.meta_var(tt * warps + self.warp)
            for v in T.unroll(per_lane):
                vals[tt, v] = T.float32(FLT_LOWEST)
                if t < TB and b * TB + t < ntok and lane + v * WARP < E:
                    vals[tt, v] = logits[0, b * TB + t, lane + v * WARP]
                    for s in T.unroll(1, S):
                        vals[tt, v] = vals[tt, v] + logits[s, b * TB + t, lane + v * WARP]
        for tt in T.unroll(self.rounds):
            t = T.meta_var(tt * warps + self.warp)
            if t < TB and b * TB + t < ntok:  # warp-uniform: the shuffles see every lane
                best = T.local_scalar("float32")
                mine = T.local_scalar("float32")
                arg = T.local_scalar("int32")
                top = T.local_scalar("float32")
                chosen = T.local_scalar("int32")
                best_key = T.local_scalar("int32")
                lsum = T.local_scalar("float32")
                lsum = T.float32(0)
                top = T.float32(0)
                for k in T.unroll(K):
                    mine = T.float32(FLT_LOWEST)
                    arg = E
                    for v in T.unroll(per_lane):  # a lane's indices rise with v: strict '>'
                        if lane + v * WARP < E and vals[tt, v] > mine:
                            mine = vals[tt, v]
                            arg = lane + v * WARP
                    key = T.meta_var(order_key(mine))
                    T.ptx.redux_sync.max.s32(best_key, key, T.uint32(FULL_MASK))
                    best = order_value(best_key)
                    if key != best_key:
                        arg = E
                    # the lowest index holding the maximum
                    T.ptx.redux_sync.min.s32(chosen, arg, T.uint32(FULL_MASK))
                    for v in T.unroll(per_lane):
                        if lane + v * WARP == chosen:
                            vals[tt, v] = T.float32(FLT_LOWEST)
                    if topw is not None:
                        if k == 0:
                            top = best
                        self.weight[k] = T.exp(best - top)
                        lsum = lsum + self.weight[k]
                    if lane == 0:
                        if topk is not None:
                            topk[b * TB + t, k] = chosen
                        if hist is not None and chosen < E:
                            T.evaluate(T.cuda.atomic_add(hist.ptr_to([chosen]),
                                                         (1 << t) if token_bits else 1))
                if topw is not None:
                    if lane == 0:
                        for k in T.unroll(K):
                            topw[b * TB + t, k] = self.weight[k] / lsum


def _check_topk(E: int, K: int, threads: int, tile: str) -> None:
    if threads % WARP or not 1 <= K <= E:
        raise EtcError(f"{tile} tile: threads must be whole warps and 1 <= top_k {K} <= {E}")


def summed_logits(logits, rows: slice = slice(None)) -> np.ndarray:
    """Tokens ``rows``' logits from the router's S partial logits (S, T, E), summed in s
    order as the device sums them (fp32 sums do not reassociate)."""
    total = logits[0, rows]
    for s in range(1, logits.shape[0]):
        total = total + logits[s, rows]
    return total


def _topk_reference(logits, rows: slice, K: int, topk, topw) -> None:
    """topk and topw of tokens ``rows`` from the S partial logits (``summed_logits``)."""
    ids, weights = top_k_of(summed_logits(logits, rows), K)
    topk[rows], topw[rows] = ids, weights.astype(np.float32)


@functools.cache
def make_topk_tile(experts: int, top_k: int, block_tokens: int = 8,
                   threads: int = 128, splits: int = 1, counts: bool = False) -> DeviceFunc:
    """The tile ``topk_<E>_top<K>_b<TB>_s<S>``: task b picks the top-K experts of tokens
    b*TB .. b*TB + TB - 1 (those below T) from the router's S partial logits (S, T, E), summed
    in s order, writing topk (T, K) int32 and their renormalised softmax weights topw (T, K)
    fp32 (``TopKPicker``). ``counts``: the task also writes how many of its picks went to
    each expert into block_counts[b, :] (blocks x E int32), the rows that
    ``make_align_rows_tile(count_tokens=TB)`` sums, so that align needs no count call."""
    E, K, TB, S = experts, top_k, block_tokens, splits
    _check_topk(E, K, threads, "top-k")
    if counts:
        return _counted_topk_tile(E, K, TB, threads, S)
    ntok = tirx.Var("T", "int32")

    @T.prim_func
    def topk_of(b: T.int32, logits: T.Buffer((S, ntok, E), "float32"),
                topk: T.Buffer((ntok, K), "int32"), topw: T.Buffer((ntok, K), "float32")):
        T.device_entry()
        T.thread_id([threads])
        warp = T.warp_id([threads // WARP])
        lane = T.lane_id([WARP])
        picker = TopKPicker(E, K, TB, S, threads, warp, lane)
        picker.pick(b, logits, topk, topw)

    name = f"topk_{E}_top{K}_b{TB}_s{S}_t{threads}"
    tile = device_func(topk_of.with_attr("global_symbol", name), cost=1)

    @tile.set_reference
    def _(b, logits, topk, topw):
        _topk_reference(logits, slice(b * TB, min((b + 1) * TB, logits.shape[1])), K, topk,
                        topw)

    return tile


def _counted_topk_tile(E: int, K: int, TB: int, threads: int, S: int) -> DeviceFunc:
    """``make_topk_tile(counts=True)``: the picks also counted per expert, in a shared count
    of the task's (one shared atomic a pick), then stored as the task's row of block_counts."""
    ntok, blocks = tirx.Var("T", "int32"), tirx.Var("blocks", "int32")

    @T.prim_func
    def topk_counted(b: T.int32, logits: T.Buffer((S, ntok, E), "float32"),
                     topk: T.Buffer((ntok, K), "int32"), topw: T.Buffer((ntok, K), "float32"),
                     block_counts: T.Buffer((blocks, E), "int32")):
        T.device_entry()
        tx = T.thread_id([threads])
        warp = T.warp_id([threads // WARP])
        lane = T.lane_id([WARP])
        hist = T.alloc_shared((E,), "int32")
        for q in T.serial(ceil_div(E, threads)):
            if q * threads + tx < E:
                hist[q * threads + tx] = 0
        T.cuda.cta_sync()
        picker = TopKPicker(E, K, TB, S, threads, warp, lane)
        picker.pick(b, logits, topk, topw, hist)
        T.cuda.cta_sync()
        for q in T.serial(ceil_div(E, threads)):
            if q * threads + tx < E:
                block_counts[b, q * threads + tx] = hist[q * threads + tx]

    name = f"topk_{E}_top{K}_b{TB}_s{S}_t{threads}_counts"
    tile = device_func(topk_counted.with_attr("global_symbol", name), cost=1)

    @tile.set_reference
    def _(b, logits, topk, topw, block_counts):
        rows = slice(b * TB, min((b + 1) * TB, logits.shape[1]))
        _topk_reference(logits, rows, K, topk, topw)
        picks = topk[rows]
        block_counts[b] = np.bincount(picks[picks < E], minlength=E)

    return tile


def top_k_of(logits: np.ndarray, top_k: int):
    """(ids, weights): the top-K per row, descending, ties to the lower index, and the softmax
    weights renormalised over the K chosen, in the logits' precision."""
    ids = np.argsort(-logits, axis=1, kind="stable")[:, :top_k]
    chosen = np.take_along_axis(logits, ids, axis=1)
    weights = np.exp(chosen - chosen[:, :1])
    return ids.astype(np.int32), weights / weights.sum(axis=1, keepdims=True)


def route(x, w_router, top_k: int):
    """Float64 routing of bf16 inputs: (topk, topw)."""
    return top_k_of(x.astype(np.float64) @ w_router.astype(np.float64), top_k)


def logit_bound(x, w_router) -> np.ndarray:
    """(T, E): fp32 sums of exact bf16 products, in any order."""
    return x.shape[1] * 2.0 ** -24 * (np.abs(x.astype(np.float64))
                                      @ np.abs(w_router.astype(np.float64)))


def routing_margins(x, w_router, top_k: int) -> np.ndarray:
    """Each token's float64 gap between its K-th and (K+1)-th logit, less its fp32 logit
    bound twice: positive means the device must pick that token's float64 experts."""
    logits = x.astype(np.float64) @ w_router.astype(np.float64)
    if top_k == logits.shape[1]:
        return np.full(logits.shape[0], np.inf)
    ordered = np.sort(logits, axis=1)[:, ::-1]
    return ordered[:, top_k - 1] - ordered[:, top_k] - 2 * logit_bound(x, w_router).max(axis=1)


def router_weight_bound(x, w_router, topw64) -> np.ndarray:
    """(T, K) bound on ``|topw - topw64|`` when the experts agree: d log w_k = dl_k -
    sum_j w_j dl_j moves by at most 2 * max dl, plus ex2.approx and the division
    (2**-20 relative together), plus the fp32 roundings of the sum."""
    delta = logit_bound(x, w_router).max(axis=1, keepdims=True)
    return topw64 * (2.2 * delta + 2.0 ** -19) + 2.0 ** -126


# ------------------------------------------------------------------------------------ align
# A warp's 32 pairs of one step: the lanes holding the same expert, and the count below a lane.
MATCH_ANY = """
__device__ __forceinline__ unsigned etc_match_any(int v) {
  return __match_any_sync(0xffffffffu, v);
}
"""
POPC = """
__device__ __forceinline__ int etc_popc(unsigned m) { return __popc(m); }
"""
STEPS_AHEAD = 16  # steps of a warp's walk whose experts align loads together


@T.meta_class
class PairWalk:
    """The warps' walk over ``total`` (t, k) pairs of ``topk`` from flat pair ``first`` on:
    warp w takes a contiguous share, 32 pairs (one a lane) a step, in order. Each expert id
    goes through ``input_check`` number 0: a tile that walks declares ``expert_id_checks``.

    ``count`` adds each warp's pairs of expert e into ``seen[w, e]`` (shared); after
    ``scan_warps`` turns those into offsets, ``place`` walks again and hands each pair its
    rank among the pairs of its expert, in (t, k) order: the warp's offset, the warp's
    running count, and the lanes below with the same expert (``__match_any_sync``, whose
    lowest lane then adds the step's pairs to the running count). The experts of
    ``STEPS_AHEAD`` steps load together, and the next batch's while this one is worked
    through: the match of each step is opaque to the compiler, and it cannot move a load
    across stores that may alias ``topk`` for all it knows, so one load a step, or a batch
    loaded after the previous batch's stores, would wait an L2 round trip each (55 us at
    1024 tokens on the H200, before). For the same reason ``count`` keeps the first batch
    for ``place``, and a tile may issue that batch (``load(0)``) on entry, under its other
    loads, and tell ``count`` so (``loaded``); the ids are checked as a batch is handed out
    (``next_batch``), so that nothing waits for a load where it is issued."""

    def __init__(self, topk, first, total, experts, warps, warp, lane):
        self.topk, self.first, self.total, self.K = topk, first, total, topk.shape[1]
        self.warps, self.warp, self.lane = warps, warp, lane
        self.span = (total + warps - 1) // warps  # pairs of a warp's share
        self.batches = ceil_div((self.span + WARP - 1) // WARP, STEPS_AHEAD)
        # seen[w, e] (+1: rows in other banks)
        self.seen = T.alloc_shared((warps, experts + 1), "int32")
        self.experts = experts
        self.ahead = T.alloc_local((STEPS_AHEAD,), "int32")  # this batch's experts
        self.coming = T.alloc_local((STEPS_AHEAD,), "int32")  # the next batch's, loading
        self.kept = T.alloc_local((STEPS_AHEAD,), "int32")  # the first batch's, for place
        self.expert = T.alloc_local((1,), "int32")
        self.same = T.alloc_local((1,), "uint32")
        self.below = (T.uint32(1) << T.Cast("uint32", lane)) - T.uint32(1)  # lane mask

    def pair(self, batch, j):
        """The pair of this lane at step j of ``batch``, within the warp's share."""
        return (batch * STEPS_AHEAD + j) * WARP + self.lane

    def inside(self, batch, j):
        """Whether this lane has a pair at step j of ``batch``: within the warp's share and
        the walk."""
        return tirx.And(self.pair(batch, j) < self.span,
                        self.warp * self.span + self.pair(batch, j) < self.total)

    @T.inline
    def load(self, batch):
        # the experts of batch's steps into coming (-1 past the share), loads only: nothing
        # waits for them before next_batch
        for j in T.unroll(STEPS_AHEAD):
            p = T.meta_var(self.first + self.warp * self.span + self.pair(batch, j))
            self.coming[j] = -1
            if self.inside(batch, j):
                self.coming[j] = self.topk[p // self.K, p % self.K]

    @T.inline
    def next_batch(self, batch):
        for j in T.unroll(STEPS_AHEAD):
            self.ahead[j] = self.coming[j]
            # the walking tile's check 0 (expert_id_checks): a bad id is left out
            if self.inside(batch, j):
                if input_check(self.ahead[j], self.experts) == 0:
                    self.ahead[j] = -1
        self.load(batch + 1)

    @T.inline
    def count(self, loaded=False):
        # seen[warp, e] = the warp's pairs of e; the caller syncs the CTA before reading
        for q in T.serial(ceil_div(self.experts, WARP)):
            if q * WARP + self.lane < self.experts:
                self.seen[self.warp, q * WARP + self.lane] = 0
        T.cuda.warp_sync()
        if not loaded:
            self.load(0)
        for j in T.unroll(STEPS_AHEAD):
            self.kept[j] = self.coming[j]
        for batch in T.serial(self.batches):
            self.next_batch(batch)
            for j in T.unroll(STEPS_AHEAD):
                if self.ahead[j] >= 0:  # counts need no order: no match, no sync between steps
                    T.evaluate(T.cuda.atomic_add(self.seen.ptr_to([self.warp, self.ahead[j]]),
                                                 T.int32(1)))

    @T.inline
    def scan_warps(self, tx, threads, total=None):
        # seen[w, e] becomes the pairs of e in the shares of the warps before w;
        # total(e, n), if given: what to do with n, expert e's pairs of the whole walk
        for q in T.serial(ceil_div(self.experts, threads)):
            e = T.meta_var(q * threads + tx)
            if e < self.experts:
                run = T.local_scalar("int32")
                c = T.local_scalar("int32")
                run = 0
                for w in T.unroll(self.warps):
                    c = self.seen[w, e]
                    self.seen[w, e] = run
                    run = run + c
                if total is not None:
                    total(e, run)

    @T.inline
    def place(self, first_row, tile_rows, pair_row, pair_tile, sorted_token):
        # each pair's row: first_row(e) + its rank among the walk's pairs of its expert e,
        # into pair_row and pair_tile at the pair, and its token into sorted_token at the row;
        # after count, whose first batch it walks again without loading it
        for j in T.unroll(STEPS_AHEAD):
            self.coming[j] = self.kept[j]
        for batch in T.serial(self.batches):
            self.next_batch(batch)
            for j in T.unroll(STEPS_AHEAD):
                # every lane takes part in the match, with or without a pair
                self.expert[0] = self.ahead[j]
                self.same[0] = T.cuda.func_call("etc_match_any", self.expert[0],
                                                source_code=MATCH_ANY, return_type="uint32")
                if self.expert[0] >= 0:
                    row = T.local_scalar("int32")
                    row = first_row(self.expert[0]) + self.seen[self.warp, self.expert[0]] \
                        + T.cuda.func_call("etc_popc", self.same[0] & self.below,
                                           source_code=POPC, return_type="int32")
                    p = T.meta_var(self.first + self.warp * self.span + self.pair(batch, j))
                    pair_row[p // self.K, p % self.K] = row
                    pair_tile[p // self.K, p % self.K] = row // tile_rows
                    sorted_token[row] = p // self.K
                T.cuda.warp_sync()  # every lane has read seen before the step's counts go in
                # the lowest lane of each expert adds the step's pairs of it
                if self.expert[0] >= 0 and (self.same[0] & self.below) == T.uint32(0):
                    self.seen[self.warp, self.expert[0]] = \
                        self.seen[self.warp, self.expert[0]] + T.cuda.func_call(
                            "etc_popc", self.same[0], source_code=POPC, return_type="int32")
                T.cuda.warp_sync()  # the next step's lowest lane may be another


@T.meta_class
class ExpertTiles:
    """The CSR of expert tiles from per-expert pair counts, in one CTA: ``tiles`` scans
    ``count`` (shared, filled by the caller) into ``indptr`` (a Hillis-Steele scan of each
    thread's experts' tiles), ``tile_experts`` gives each tile, or each of a share of them,
    its expert."""

    def __init__(self, experts, tile_rows, threads, tx):
        self.E, self.BT, self.threads, self.tx = experts, tile_rows, threads, tx
        self.seg = ceil_div(experts, threads)  # experts per thread in the tile scan
        self.steps = max(1, math.ceil(math.log2(threads)))
        self.search = max(1, math.ceil(math.log2(experts + 1)))
        self.count = T.alloc_shared((experts,), "int32")
        self.indptr = T.alloc_shared((experts + 1,), "int32")
        self.scan = T.alloc_shared((2, threads), "int32")

    @T.inline
    def tiles(self, exp_indptr=None):
        # indptr (shared) and exp_indptr (global, if given) from count; the caller synced
        # count
        E, BT, seg, tx = T.meta_var((self.E, self.BT, self.seg, self.tx))
        mysum = T.local_scalar("int32")
        mysum = 0
        for s in T.unroll(seg):
            if tx * seg + s < E:
                mysum = mysum + (self.count[tx * seg + s] + BT - 1) // BT
        self.scan[0, tx] = mysum
        T.cuda.cta_sync()
        for d in T.unroll(self.steps):
            if tx >= (1 << d):
                self.scan[(d + 1) % 2, tx] = self.scan[d % 2, tx] + self.scan[d % 2, tx - (1 << d)]
            else:
                self.scan[(d + 1) % 2, tx] = self.scan[d % 2, tx]
            T.cuda.cta_sync()
        start = T.local_scalar("int32")
        start = self.scan[self.steps % 2, tx] - mysum
        for s in T.unroll(seg):
            if tx * seg + s < E:
                self.indptr[tx * seg + s] = start
                if exp_indptr is not None:
                    exp_indptr[tx * seg + s] = start
                start = start + (self.count[tx * seg + s] + BT - 1) // BT
        if tx == self.threads - 1:
            self.indptr[E] = self.scan[self.steps % 2, tx]
            if exp_indptr is not None:
                exp_indptr[E] = self.scan[self.steps % 2, tx]
        T.cuda.cta_sync()

    @T.inline
    def tile_experts(self, tile_expert, part=0, parts=1):
        # each tile's expert: the last e with indptr[e] <= g (binary search), E past the end;
        # of the tiles, the part-th of parts contiguous shares
        E, tx, threads = T.meta_var((self.E, self.tx, self.threads))
        tiles = T.meta_var(tile_expert.shape[0])
        whole = T.meta_var(isinstance(parts, int) and parts == 1)  # parts: Python or TIR int
        share = T.meta_var(tiles if whole else (tiles + parts - 1) // parts)
        for q in T.serial((share + threads - 1) // threads):
            g = T.meta_var(q * threads + tx if whole else part * share + q * threads + tx)
            inside = T.meta_var(g < tiles if whole
                                else tirx.And(q * threads + tx < share, g < tiles))
            if inside:
                lo_e = T.local_scalar("int32")
                hi_e = T.local_scalar("int32")
                lo_e = 0
                hi_e = E
                if g >= self.indptr[E]:
                    lo_e = E
                else:
                    for _it in T.unroll(self.search):  # indptr[lo_e] <= g < indptr[hi_e]
                        if hi_e - lo_e > 1:
                            if self.indptr[(lo_e + hi_e) // 2] <= g:
                                lo_e = (lo_e + hi_e) // 2
                            else:
                                hi_e = (lo_e + hi_e) // 2
                tile_expert[g] = lo_e


def chunk_walk(topk, c, chunk_tokens: int, experts: int, warps: int, warp, lane) -> PairWalk:
    """The ``PairWalk`` over the pairs of tokens c*CT .. c*CT + CT - 1 (those below T)."""
    ntok, K = topk.shape
    first = c * chunk_tokens
    return PairWalk(topk, first * K, (T.min(ntok, first + chunk_tokens) - first) * K, experts,
                    warps, warp, lane)


def expert_id_checks(experts: int) -> tuple[str]:
    """The input check of the tiles that walk topk (``PairWalk``): an expert id outside
    0..E-1 is this error, and the pair is left out."""
    return (f"topk holds the expert id {{value}}, outside 0..{experts - 1}",)


def _check_align(E: int, BT: int, threads: int, tile: str) -> None:
    if threads % WARP or E < 1 or BT < 1:
        raise EtcError(f"{tile} tile: bad configuration E={E}, BT={BT}, threads={threads}")


@T.inline
def _align_pairs(topk, E, BT, threads, tx, warp, lane, counts, exp_indptr, pair_row, pair_tile,
                 sorted_token, tile_expert):
    # the whole of align in one CTA: count the pairs of each expert, the CSR of tiles, then
    # each pair's row (``make_align_tile``)
    ntok, K = T.meta_var(topk.shape)
    rows = T.meta_var(sorted_token.shape[0])
    walk = PairWalk(topk, 0, ntok * K, E, threads // WARP, warp, lane)
    csr = ExpertTiles(E, BT, threads, tx)

    @T.inline
    def total(e, n):
        csr.count[e] = n
        counts[e] = n

    walk.count()
    T.cuda.cta_sync()
    walk.scan_warps(tx, threads, total)
    T.cuda.cta_sync()
    csr.tiles(exp_indptr)
    csr.tile_experts(tile_expert)
    for q in T.serial((rows + threads - 1) // threads):
        if q * threads + tx < rows:
            sorted_token[q * threads + tx] = -1
    T.cuda.cta_sync()  # the padding marks land before the real rows overwrite them
    walk.place(lambda e: csr.indptr[e] * BT, BT, pair_row, pair_tile, sorted_token)


@functools.cache
def make_align_tile(experts: int, top_k: int, tile_rows: int, threads: int = 128) -> DeviceFunc:
    """The tile ``align_<E>_top<K>_bt<BT>``: one task (run it on a grid of 1) that turns
    topk (T, K) into counts (E,), exp_indptr (E+1,) in tiles, pair_row and pair_tile (T, K),
    sorted_token (rows,) (-1 on padding) and tile_expert (tiles,) (E past the used tiles).
    Expert ids must lie in 0..E-1, as the top-k tile makes them: for others the reference
    and the kernels raise (``checked_expert_ids``, ``expert_id_checks``)."""
    E, K, BT = experts, top_k, tile_rows
    _check_align(E, BT, threads, "align")
    warps = threads // WARP
    ntok, rows, tiles = (tirx.Var(n, "int32") for n in ("T", "rows", "tiles"))

    @T.prim_func
    def align(i: T.int32, topk: T.Buffer((ntok, K), "int32"), counts: T.Buffer((E,), "int32"),
              exp_indptr: T.Buffer((E + 1,), "int32"), pair_row: T.Buffer((ntok, K), "int32"),
              pair_tile: T.Buffer((ntok, K), "int32"), sorted_token: T.Buffer((rows,), "int32"),
              tile_expert: T.Buffer((tiles,), "int32")):
        T.device_entry()
        tx = T.thread_id([threads])
        warp = T.warp_id([warps])
        lane = T.lane_id([WARP])
        _align_pairs(topk, E, BT, threads, tx, warp, lane, counts, exp_indptr, pair_row,
                     pair_tile, sorted_token, tile_expert)

    name = f"align_{E}_top{K}_bt{BT}_t{threads}"
    tile = device_func(align.with_attr("global_symbol", name), cost=ntok * K // threads + 4,
                       checks=expert_id_checks(E))

    @tile.set_reference
    def _(i, topk, *outputs):
        _align_into(topk, E, BT, *outputs)

    return tile


@functools.cache
def make_route_tile(experts: int, top_k: int, tile_rows: int, block_tokens: int = 8,
                    threads: int = 128, splits: int = 1) -> DeviceFunc:
    """The tile ``route_<E>_top<K>_bt<BT>_b<TB>_s<S>``: top-k and align in one task (run it
    on a grid of 1). It picks the top-K experts of every token from the router's S partial
    logits, TB tokens a round (``TopKPicker``, writing topk and topw as the top-k tile
    does), then aligns those picks in the same CTA (``make_align_tile``'s outputs after
    topk and topw). For few tokens: the align task's wait for the top-k task's notify and its
    loads of what that task stored are then a barrier and loads of the CTA's own stores."""
    E, K, BT, TB, S = experts, top_k, tile_rows, block_tokens, splits
    _check_topk(E, K, threads, "route")
    _check_align(E, BT, threads, "route")
    ntok, rows, tiles = (tirx.Var(n, "int32") for n in ("T", "rows", "tiles"))

    @T.prim_func
    def route(i: T.int32, logits: T.Buffer((S, ntok, E), "float32"),
              topk: T.Buffer((ntok, K), "int32"), topw: T.Buffer((ntok, K), "float32"),
              counts: T.Buffer((E,), "int32"), exp_indptr: T.Buffer((E + 1,), "int32"),
              pair_row: T.Buffer((ntok, K), "int32"), pair_tile: T.Buffer((ntok, K), "int32"),
              sorted_token: T.Buffer((rows,), "int32"), tile_expert: T.Buffer((tiles,), "int32")):
        T.device_entry()
        tx = T.thread_id([threads])
        warp = T.warp_id([threads // WARP])
        lane = T.lane_id([WARP])
        picker = TopKPicker(E, K, TB, S, threads, warp, lane)
        for b in T.serial((ntok + TB - 1) // TB):
            picker.pick(b, logits, topk, topw)
        T.cuda.cta_sync()  # every pick stored before the walk loads them
        _align_pairs(topk, E, BT, threads, tx, warp, lane, counts, exp_indptr, pair_row,
                     pair_tile, sorted_token, tile_expert)

    name = f"route_{E}_top{K}_bt{BT}_b{TB}_s{S}_t{threads}"
    tile = device_func(route.with_attr("global_symbol", name),
                       cost=ntok // TB + ntok * K // threads + 5, checks=expert_id_checks(E))

    @tile.set_reference
    def _(i, logits, topk, topw, counts, exp_indptr, pair_row, pair_tile, sorted_token,
          tile_expert):
        _topk_reference(logits, slice(0, logits.shape[1]), K, topk, topw)
        _align_into(topk, E, BT, counts, exp_indptr, pair_row, pair_tile, sorted_token,
                    tile_expert)

    return tile


ALIGN_CHUNK_TOKENS = 64  # tokens a chunked-align task walks (512 pairs at top-8)


def _check_chunk(chunk_tokens: int, tile: str) -> None:
    if chunk_tokens < 1:
        raise EtcError(f"{tile} tile: chunk_tokens must be positive, got {chunk_tokens}")


@functools.cache
def make_align_count_tile(experts: int, top_k: int, chunk_tokens: int = ALIGN_CHUNK_TOKENS,
                          threads: int = 128) -> DeviceFunc:
    """The tile ``align_count_<E>_top<K>_c<CT>``, the first phase of align over several CTAs:
    task c counts the pairs of each expert among tokens c*CT .. c*CT + CT - 1 (those below T)
    into chunk_counts[c, :] (chunks x E). Expert ids as ``make_align_tile`` takes them."""
    E, K, CT = experts, top_k, chunk_tokens
    _check_align(E, 1, threads, "align_count")
    _check_chunk(CT, "align_count")
    warps = threads // WARP
    ntok, chunks = tirx.Var("T", "int32"), tirx.Var("chunks", "int32")

    @T.prim_func
    def align_count(c: T.int32, topk: T.Buffer((ntok, K), "int32"),
                    chunk_counts: T.Buffer((chunks, E), "int32")):
        T.device_entry()
        tx = T.thread_id([threads])
        warp = T.warp_id([warps])
        lane = T.lane_id([WARP])
        walk = chunk_walk(topk, c, CT, E, warps, warp, lane)

        @T.inline
        def total(e, n):
            chunk_counts[c, e] = n

        walk.count()
        T.cuda.cta_sync()
        walk.scan_warps(tx, threads, total)

    name = f"align_count_{E}_top{K}_c{CT}_t{threads}"
    tile = device_func(align_count.with_attr("global_symbol", name), cost=CT * K // threads + 2,
                       checks=expert_id_checks(E))

    @tile.set_reference
    def _(c, topk, chunk_counts):
        chunk = checked_expert_ids(topk[c * CT:(c + 1) * CT], E, "align_count", c * CT)
        chunk_counts[c] = np.bincount(chunk.ravel(), minlength=E)

    return tile


@T.inline
def _load_chunk_counts(part, chunk_counts, e, batch):
    # part[u] = chunk_counts[batch * ahead + u, e] (0 past the chunks), ahead = len(part):
    # one thread's loads of a batch issued together
    ahead, chunks = T.meta_var((part.shape[0], chunk_counts.shape[0]))
    for u in T.unroll(ahead):
        part[u] = 0
        if batch * ahead + u < chunks:
            part[u] = chunk_counts[batch * ahead + u, e]


def _chunk_offsets(chunk_counts, tile_rows: int):
    """Reference: (counts, exp_indptr, chunk_row) of ``align_offsets`` from chunk counts."""
    counts = chunk_counts.sum(axis=0)
    indptr = np.zeros(len(counts) + 1, np.int32)
    indptr[1:] = np.cumsum(ceil_div(counts, tile_rows))
    chunk_row = indptr[:-1] * tile_rows + np.cumsum(chunk_counts, axis=0) - chunk_counts
    return counts, indptr, chunk_row


@functools.cache
def make_align_offsets_tile(experts: int, tile_rows: int, threads: int = 128) -> DeviceFunc:
    """The tile ``align_offsets_<E>_bt<BT>``, the middle phase of align over several CTAs: one
    task (a grid of 1) turns chunk_counts (chunks x E) into counts (E,), exp_indptr (E+1,),
    tile_expert (tiles,) as ``make_align_tile`` gives them, and chunk_row (chunks x E): the
    first row of chunk c's pairs of expert e."""
    E, BT = experts, tile_rows
    _check_align(E, BT, threads, "align_offsets")
    chunks, tiles = tirx.Var("chunks", "int32"), tirx.Var("tiles", "int32")
    ahead = STEPS_AHEAD  # chunks whose counts a thread loads together

    @T.prim_func
    def align_offsets(i: T.int32, chunk_counts: T.Buffer((chunks, E), "int32"),
                      counts: T.Buffer((E,), "int32"), exp_indptr: T.Buffer((E + 1,), "int32"),
                      chunk_row: T.Buffer((chunks, E), "int32"),
                      tile_expert: T.Buffer((tiles,), "int32")):
        T.device_entry()
        tx = T.thread_id([threads])
        csr = ExpertTiles(E, BT, threads, tx)
        part = T.alloc_local((ahead,), "int32")
        run = T.local_scalar("int32")

        for q in T.serial(ceil_div(E, threads)):
            e = T.meta_var(q * threads + tx)
            if e < E:
                run = 0
                for batch in T.serial((chunks + ahead - 1) // ahead):
                    _load_chunk_counts(part, chunk_counts, e, batch)
                    for u in T.unroll(ahead):
                        run = run + part[u]
                csr.count[e] = run
                counts[e] = run
        T.cuda.cta_sync()
        csr.tiles(exp_indptr)
        csr.tile_experts(tile_expert)
        for q in T.serial(ceil_div(E, threads)):
            e = T.meta_var(q * threads + tx)
            if e < E:
                run = csr.indptr[e] * BT
                for batch in T.serial((chunks + ahead - 1) // ahead):
                    _load_chunk_counts(part, chunk_counts, e, batch)
                    for u in T.unroll(ahead):
                        if batch * ahead + u < chunks:
                            chunk_row[batch * ahead + u, e] = run
                        run = run + part[u]

    name = f"align_offsets_{E}_bt{BT}_t{threads}"
    tile = device_func(align_offsets.with_attr("global_symbol", name), cost=4)

    @tile.set_reference
    def _(i, chunk_counts, counts, exp_indptr, chunk_row, tile_expert):
        counts[:], exp_indptr[:], chunk_row[:] = _chunk_offsets(chunk_counts, BT)
        _fill_tile_experts(exp_indptr, tile_expert)

    return tile


@T.inline
def _place_chunk(walk, c, chunks, tx, threads, first_row, indptr, counts, tile_rows, pair_row,
                 pair_tile, sorted_token):
    # chunk c's pairs their rows from first_row(e) on (PairWalk.place), and -1 on the chunk's
    # share of the padding rows of the CSR indptr of pair counts (E+1 and E int32, global or
    # shared): no real row is among these, so no order against the other tasks' rows. The
    # caller issued the walk's first loads (walk.load(0)) on entry, under its other loads.
    E, BT = T.meta_var((counts.shape[0], tile_rows))
    rows = T.meta_var(sorted_token.shape[0])
    walk.count(loaded=True)
    T.cuda.cta_sync()
    walk.scan_warps(tx, threads)
    T.cuda.cta_sync()
    walk.place(first_row, BT, pair_row, pair_tile, sorted_token)
    for q in T.serial(ceil_div(E, threads)):
        e = T.meta_var(q * threads + tx)
        if e < E and e % chunks == c:
            for r in T.serial(indptr[e] * BT + counts[e], indptr[e + 1] * BT):
                sorted_token[r] = -1
    used = T.local_scalar("int32")
    used = indptr[E] * BT
    share = T.meta_var((rows - used + chunks - 1) // chunks)
    for q in T.serial((share + threads - 1) // threads):
        r = T.meta_var(used + c * share + q * threads + tx)
        if q * threads + tx < share and r < rows:
            sorted_token[r] = -1


@functools.cache
def make_align_place_tile(experts: int, top_k: int, tile_rows: int,
                          chunk_tokens: int = ALIGN_CHUNK_TOKENS,
                          threads: int = 128) -> DeviceFunc:
    """The tile ``align_place_<E>_top<K>_bt<BT>_c<CT>``, the last phase of align over several
    CTAs: task c hands the pairs of chunk c their rows, from chunk_row (``align_offsets``) on
    in (t, k) order, writing pair_row and pair_tile (T, K) and sorted_token at those rows; and
    writes -1 on its share of the padding rows (the tail of the last tile of the experts e
    with e % chunks == c, and its slice of the rows past the used tiles). Together the tasks
    write what ``make_align_tile`` writes. Task 0 also copies offsets' ``indptr`` to
    ``exp_indptr``: maps that read the CSR read this call's copy, so that in a dynamic
    megakernel their arming goes with this call's completion (the routing's last), not with
    the offsets task's, whose CTA would hold a place task it claimed ahead meanwhile."""
    E, K, BT, CT = experts, top_k, tile_rows, chunk_tokens
    _check_align(E, BT, threads, "align_place")
    _check_chunk(CT, "align_place")
    warps = threads // WARP
    ntok, rows, chunks = (tirx.Var(n, "int32") for n in ("T", "rows", "chunks"))

    @T.prim_func
    def align_place(c: T.int32, topk: T.Buffer((ntok, K), "int32"),
                    counts: T.Buffer((E,), "int32"), indptr: T.Buffer((E + 1,), "int32"),
                    chunk_row: T.Buffer((chunks, E), "int32"),
                    pair_row: T.Buffer((ntok, K), "int32"),
                    pair_tile: T.Buffer((ntok, K), "int32"),
                    sorted_token: T.Buffer((rows,), "int32"),
                    exp_indptr: T.Buffer((E + 1,), "int32")):
        T.device_entry()
        tx = T.thread_id([threads])
        warp = T.warp_id([warps])
        lane = T.lane_id([WARP])
        walk = chunk_walk(topk, c, CT, E, warps, warp, lane)
        walk.load(0)
        first = T.alloc_shared((E,), "int32")  # chunk_row[c, :]

        for q in T.serial(ceil_div(E, threads)):
            if q * threads + tx < E:
                first[q * threads + tx] = chunk_row[c, q * threads + tx]
        if c == 0:
            for q in T.serial(ceil_div(E + 1, threads)):
                if q * threads + tx <= E:
                    exp_indptr[q * threads + tx] = indptr[q * threads + tx]
        _place_chunk(walk, c, chunks, tx, threads, lambda e: first[e], indptr, counts, BT,
                     pair_row, pair_tile, sorted_token)

    name = f"align_place_{E}_top{K}_bt{BT}_c{CT}_t{threads}"
    tile = device_func(align_place.with_attr("global_symbol", name), cost=CT * K // threads + 4,
                       checks=expert_id_checks(E))

    @tile.set_reference
    def _(c, topk, counts, indptr, chunk_row, pair_row, pair_tile, sorted_token, exp_indptr):
        if c == 0:
            exp_indptr[:] = indptr
        _place_chunk_reference(topk, c, CT, BT, chunk_row[c], indptr, counts, pair_row,
                               pair_tile, sorted_token, len(chunk_row))

    return tile


def _place_chunk_reference(topk, c: int, chunk_tokens: int, tile_rows: int, first_row, indptr,
                           counts, pair_row, pair_tile, sorted_token, chunks: int) -> None:
    """Reference of ``_place_chunk``: chunk c's pairs from ``first_row`` on, and its share of
    the padding rows."""
    BT = tile_rows
    tokens = range(c * chunk_tokens, min((c + 1) * chunk_tokens, len(topk)))
    _place_pairs(topk, tokens, first_row, pair_row, sorted_token)
    pair_tile[tokens.start:tokens.stop] = pair_row[tokens.start:tokens.stop] // BT
    for e in range(c, len(counts), chunks):
        sorted_token[indptr[e] * BT + counts[e]:indptr[e + 1] * BT] = -1
    used = indptr[-1] * BT
    share = -(-(len(sorted_token) - used) // chunks)
    sorted_token[used + c * share:used + (c + 1) * share] = -1


COUNT_ROWS_AHEAD = 16  # rows of counts a thread loads together


@T.meta_class
class CountRowSums:
    """Each expert's sum over the rows of a (rows x E) int32 count, and over the rows before
    a bound, into shared arrays. Thread (group g, column c) loads experts 4c .. 4c + 3 (E a
    multiple of 4; else one expert a column) in 16-byte loads from rows g, g + G, g + 2G ...
    (G = threads / columns groups of rows), ``COUNT_ROWS_AHEAD`` rows together, and the
    groups' sums meet in shared memory. 128 rows of 128 experts on 128 threads take two
    batches of loads a thread, where a thread an expert would take eight, one after another."""

    def __init__(self, experts, threads, tx):
        self.E, self.threads, self.tx = experts, threads, tx
        self.width = 4 if experts % 4 == 0 else 1  # int32 a load
        self.columns = experts // self.width
        self.groups = max(1, threads // self.columns)
        self.part = T.alloc_local((COUNT_ROWS_AHEAD, self.width), "int32")
        self.run = T.alloc_local((2, self.width), "int32")  # all rows, rows before the bound
        self.sums = T.alloc_shared((self.groups, 2, experts), "int32")

    @T.inline
    def sum(self, counts, bound, total, before):
        # total[e] = the sum of counts[:, e], before[e] = of counts[:bound, e] (shared, (E,));
        # the caller syncs the CTA before reading them
        E, W, cols, G = T.meta_var((self.E, self.width, self.columns, self.groups))
        tx, threads, part, run = T.meta_var((self.tx, self.threads, self.part, self.run))
        ahead, rows = T.meta_var((COUNT_ROWS_AHEAD, counts.shape[0]))
        group = T.meta_var(tx // cols)
        for q in T.serial(ceil_div(cols, threads)):
            col = T.meta_var(q * threads + tx % cols)
            if group < G and col < cols:
                for j in T.unroll(W):
                    run[0, j] = 0
                    run[1, j] = 0
                for batch in T.serial((rows + G * ahead - 1) // (G * ahead)):
                    for u in T.unroll(ahead):
                        for j in T.vectorized(W):
                            part[u, j] = 0
                        if (batch * ahead + u) * G + group < rows:
                            for j in T.vectorized(W):
                                part[u, j] = counts[(batch * ahead + u) * G + group, col * W + j]
                    for u in T.unroll(ahead):
                        for j in T.unroll(W):
                            run[0, j] = run[0, j] + part[u, j]
                            if (batch * ahead + u) * G + group < bound:
                                run[1, j] = run[1, j] + part[u, j]
                for j in T.unroll(W):
                    self.sums[group, 0, col * W + j] = run[0, j]
                    self.sums[group, 1, col * W + j] = run[1, j]
        T.cuda.cta_sync()
        for q in T.serial(ceil_div(E, threads)):
            e = T.meta_var(q * threads + tx)
            if e < E:
                whole = T.local_scalar("int32")
                earlier = T.local_scalar("int32")
                whole = 0
                earlier = 0
                for g in T.unroll(G):
                    whole = whole + self.sums[g, 0, e]
                    earlier = earlier + self.sums[g, 1, e]
                total[e] = whole
                before[e] = earlier


@functools.cache
def make_align_rows_tile(experts: int, top_k: int, tile_rows: int,
                         chunk_tokens: int = ALIGN_CHUNK_TOKENS,
                         threads: int = 128, count_tokens: int | None = None) -> DeviceFunc:
    """The tile ``align_rows_<E>_top<K>_bt<BT>_c<CT>``: align's offsets and place phases in
    each task, so that one hop of the routing chain and its one-CTA task go. Task c sums the
    counts (rows x E: each row the pairs of each expert among ``count_tokens`` tokens, by
    default CT, as ``align_count`` gives them; or TB, as a counting top-k task gives them,
    ``make_topk_tile(counts=True)``) over all rows and over those before chunk c
    (``CountRowSums``), scans the experts' tiles into the CSR in shared memory, then places
    chunk c's pairs as ``make_align_place_tile``'s task c does. Each task also writes its
    contiguous share of tile_expert, and task 0 exp_indptr: together the tasks write what
    ``make_align_tile`` writes but its counts. The sums cost each task one read of the counts
    (8 KB at 1024 tokens in chunks of 64; 64 KB in rows of 8 tokens), where the offsets task
    cost a task and a hop."""
    E, K, BT, CT = experts, top_k, tile_rows, chunk_tokens
    CN = count_tokens or CT
    _check_align(E, BT, threads, "align_rows")
    _check_chunk(CT, "align_rows")
    if CN < 1 or CT % CN:
        raise EtcError(f"align_rows tile: count_tokens {CN} must divide chunk_tokens {CT}")
    per = CT // CN  # rows of counts a chunk
    warps = threads // WARP
    ntok, rows, count_rows, tiles = (tirx.Var(n, "int32")
                                     for n in ("T", "rows", "count_rows", "tiles"))

    @T.prim_func
    def align_rows(c: T.int32, topk: T.Buffer((ntok, K), "int32"),
                   counts: T.Buffer((count_rows, E), "int32"),
                   pair_row: T.Buffer((ntok, K), "int32"),
                   pair_tile: T.Buffer((ntok, K), "int32"),
                   sorted_token: T.Buffer((rows,), "int32"),
                   exp_indptr: T.Buffer((E + 1,), "int32"),
                   tile_expert: T.Buffer((tiles,), "int32")):
        T.device_entry()
        tx = T.thread_id([threads])
        warp = T.warp_id([warps])
        lane = T.lane_id([WARP])
        chunks = T.meta_var((count_rows + per - 1) // per)
        walk = chunk_walk(topk, c, CT, E, warps, warp, lane)
        walk.load(0)
        csr = ExpertTiles(E, BT, threads, tx)
        first = T.alloc_shared((E,), "int32")  # the first row of chunk c's pairs of e
        sums = CountRowSums(E, threads, tx)
        sums.sum(counts, c * per, csr.count, first)
        T.cuda.cta_sync()
        csr.tiles()
        for q in T.serial(ceil_div(E, threads)):
            if q * threads + tx < E:
                first[q * threads + tx] = first[q * threads + tx] \
                    + csr.indptr[q * threads + tx] * BT
        if c == 0:
            for q in T.serial(ceil_div(E + 1, threads)):
                if q * threads + tx <= E:
                    exp_indptr[q * threads + tx] = csr.indptr[q * threads + tx]
        csr.tile_experts(tile_expert, c, chunks)
        _place_chunk(walk, c, chunks, tx, threads, lambda e: first[e], csr.indptr, csr.count,
                     BT, pair_row, pair_tile, sorted_token)

    name = f"align_rows_{E}_top{K}_bt{BT}_c{CT}" + (f"_n{CN}" if CN != CT else "") \
        + f"_t{threads}"
    tile = device_func(align_rows.with_attr("global_symbol", name),
                       cost=CT * K // threads + 6, checks=expert_id_checks(E))

    @tile.set_reference
    def _(c, topk, counts, pair_row, pair_tile, sorted_token, exp_indptr, tile_expert):
        chunk_counts = np.add.reduceat(counts, np.arange(0, len(counts), per), axis=0)
        totals, indptr, chunk_row = _chunk_offsets(chunk_counts, BT)
        if c == 0:
            exp_indptr[:] = indptr
        share = ceil_div(len(tile_expert), len(chunk_counts))
        every = np.empty_like(tile_expert)
        _fill_tile_experts(indptr, every)
        tile_expert[c * share:(c + 1) * share] = every[c * share:(c + 1) * share]
        _place_chunk_reference(topk, c, CT, BT, chunk_row[c], indptr, totals, pair_row,
                               pair_tile, sorted_token, len(chunk_counts))

    return tile


def checked_expert_ids(topk, experts: int, tile: str, first_token: int = 0):
    """``topk`` (rows of tokens from ``first_token`` on), whose expert ids align counts and
    places pairs by: an id outside 0..experts-1 is an error that names it and where."""
    bad = np.argwhere((topk < 0) | (topk >= experts))
    if bad.size:
        t, k = (int(i) for i in bad[0])
        raise ExecutionError(f"{tile}: topk[{first_token + t}, {k}] = {int(topk[t, k])} is no "
                             f"expert id of 0..{experts - 1}")
    return topk


def align_reference(topk, experts: int, tile_rows: int, tiles: int):
    """(counts, exp_indptr, pair_row, sorted_token, tile_expert) of a routing."""
    counts = np.bincount(checked_expert_ids(topk, experts, "align").ravel(),
                         minlength=experts).astype(np.int32)
    indptr = np.zeros(experts + 1, np.int32)
    indptr[1:] = np.cumsum(ceil_div(counts, tile_rows))
    pair_row = np.empty(topk.shape, np.int32)
    sorted_token = np.full(tiles * tile_rows, -1, np.int32)
    _place_pairs(topk, range(len(topk)), indptr[:-1] * tile_rows, pair_row, sorted_token)
    tile_expert = np.empty(tiles, np.int32)
    _fill_tile_experts(indptr, tile_expert)
    return counts, indptr, pair_row, sorted_token, tile_expert


def _align_into(topk, experts: int, tile_rows: int, counts, exp_indptr, pair_row, pair_tile,
                sorted_token, tile_expert) -> None:
    """``align_reference`` written into the one-task align's outputs."""
    c, indptr, rows, tokens, tile_experts = align_reference(topk, experts, tile_rows,
                                                            len(tile_expert))
    counts[:], exp_indptr[:], pair_row[:], pair_tile[:] = c, indptr, rows, rows // tile_rows
    sorted_token[:], tile_expert[:] = tokens, tile_experts


def _place_pairs(topk, tokens: range, first_row, pair_row, sorted_token) -> None:
    """Reference: the rows of the pairs of ``tokens``, from ``first_row[e]`` on in (t, k)
    order within each expert e, into ``pair_row``; their tokens into ``sorted_token``."""
    cursor = np.array(first_row)
    for t in tokens:
        for k, e in enumerate(topk[t]):
            pair_row[t, k], sorted_token[cursor[e]] = cursor[e], t
            cursor[e] += 1


def _fill_tile_experts(indptr, tile_expert) -> None:
    """Reference: each tile's expert from the CSR ``indptr``, E past the used tiles."""
    experts = len(indptr) - 1
    tile_expert[:] = experts
    for e in range(experts):
        tile_expert[indptr[e]:indptr[e + 1]] = e


# ----------------------------------------------------------------------------- grouped GEMMs
def interleave_gate_up(w_gate: np.ndarray, w_up: np.ndarray) -> np.ndarray:
    """(E, H, F) gate and up weights -> (E, H, 2F) with columns ``[g0..g7, u0..u7, g8..]``: the
    layout gate_up's fused epilogue reads (done once, when the weights are loaded)."""
    E, H, F = w_gate.shape
    blocks = (E, H, F // INTERLEAVE, INTERLEAVE)
    return np.concatenate([w_gate.reshape(blocks), w_up.reshape(blocks)],
                          axis=3).reshape(E, H, 2 * F)


def block_columns(w: np.ndarray, bn: int) -> np.ndarray:
    """(E, K, N) expert weights -> (E, N/bn, K, bn): the K x bn slab that a grouped-GEMM task
    of ``bn`` columns streams lies contiguous (``blocked`` tiles), so each ring stage reads
    whole DRAM pages instead of one ``2 * bn``-byte run per weight row."""
    E, K, N = w.shape
    if N % bn:
        raise EtcError(f"block_columns: {N} columns are no multiple of bn={bn}")
    return np.ascontiguousarray(w.reshape(E, K, N // bn, bn).transpose(0, 2, 1, 3))


def unblock_columns(w: np.ndarray) -> np.ndarray:
    """The inverse of ``block_columns``."""
    E, NB, K, bn = w.shape
    return np.ascontiguousarray(w.transpose(0, 2, 1, 3).reshape(E, K, NB * bn))


def grouped_weight_shape(experts: int, k: int, n: int, bn: int, blocked: bool) -> tuple:
    """A grouped GEMM's (experts, K, N) weights as the tile reads them: in place, or as
    ``block_columns`` lays them out."""
    return (experts, n // bn, k, bn) if blocked else (experts, k, n)


def _reference_slab(w: np.ndarray, e: int, n: int, bn: int, blocked: bool) -> np.ndarray:
    """Expert ``e``'s (K, bn) column block ``n`` of weights of ``grouped_weight_shape``: the
    references' ``_weight_src``."""
    return w[e, n] if blocked else w[e][:, n * bn:(n + 1) * bn]


def _weight_src(w, e, n, bn: int, blocked: bool):
    """``b_src(k, c)`` of expert ``e``'s column block ``n`` in weights of
    ``grouped_weight_shape``."""
    if blocked:
        return lambda k, c: w.ptr_to([e, n, k, c])
    return lambda k, c: w.ptr_to([e, k, n * bn + c])


def split_gate_up(w_gate_up: np.ndarray):
    """The inverse of ``interleave_gate_up``: (w_gate, w_up)."""
    E, H, F2 = w_gate_up.shape
    blocks = w_gate_up.reshape(E, H, F2 // (2 * INTERLEAVE), 2, INTERLEAVE)
    return blocks[:, :, :, 0].reshape(E, H, F2 // 2), blocks[:, :, :, 1].reshape(E, H, F2 // 2)


def _silu(v):
    return v / (T.float32(1) + T.exp(-v))


def _np_silu(v):
    with np.errstate(over="ignore"):
        return v / (1 + np.exp(-v))


ENGINES = ("mma", "wgmma", "swapped")
# down's output y, which the combine reads back: fp32, or bf16 (half the bytes, as vLLM keeps
# it; one more rounding, ``y_rounding_bound``)
Y_DTYPES = ("float32", "bfloat16")
_Y_SUFFIX = {"float32": "", "bfloat16": "_ybf16"}


def _check_y_dtype(y_dtype: str, tile: str) -> None:
    if y_dtype not in Y_DTYPES:
        raise EtcError(f"{tile} tile: y_dtype must be one of {Y_DTYPES}, got {y_dtype!r}")


def y_rounding_bound(y: np.ndarray, y_dtype: str) -> np.ndarray:
    """Bound on what storing ``y`` (its magnitudes) as ``y_dtype`` adds: nothing for fp32,
    one bf16 rounding (half an ulp, ``2**-8`` relative, plus the smallest subnormal)."""
    if y_dtype == "float32":
        return np.zeros_like(y, dtype=np.float64)
    return 2.0 ** -8 * np.abs(y) + 2.0 ** -133


def _engine(engine: str, bm: int, bn: int, bk: int, threads: int, stages: int):
    """The grouped GEMMs' accumulator tile: a constructor ``(tx, warp, lane) -> tile`` of
    ``gemm.MmaTile`` ("mma": mma.sync, any 16-row multiple) or ``wgmma_gemm.WgmmaTile``
    ("wgmma": 64-row multiples per warpgroup; "swapped": the weights on the m64 side, any
    8-row multiple up to 256, so that a tile pads an expert's rows to 8, not 64), after
    checking the geometry; and a name suffix."""
    if engine == "mma":
        gemm.check_geometry(bm, bn, bk, threads, stages)
        return lambda tx, warp, lane: gemm.MmaTile(bm, bn, bk, threads, stages, tx, warp,
                                                   lane), ""
    if engine in ("wgmma", "swapped"):
        swapped = engine == "swapped"
        wgmma_gemm.check_geometry(bm, bn, bk, stages, threads, swapped=swapped)
        return lambda tx, warp, lane: wgmma_gemm.WgmmaTile(bm, bn, bk, stages, threads, tx,
                                                           warp, lane, swapped), f"_{engine}"
    raise EtcError(f"grouped GEMM: engine must be one of {ENGINES}, got {engine!r}")


def _live_blocks(engine: str, tile_rows: int) -> int:
    """The m64 blocks of a grouped tile whose rows ``_run_rows`` counts: a wgmma tile's (an
    expert's rows fill its tiles from the first, so only its last tile has blocks without
    rows); 1, nothing to count, for 64-row tiles and the mma engine's."""
    return tile_rows // 64 if engine == "wgmma" and tile_rows > 64 else 1


@T.inline
def _run_rows(mma, a, a_rows, b_src, num_k, sorted_token, row0, blocks, tma=None,
              b_preloaded=False):
    # the tile's GEMM over its rows row0.. of A rows a_rows(r) of ``a`` (negative: padding,
    # sorted_token -1, reads nothing), and where a warpgroup holds several m64 blocks those
    # without rows (a block's first row is padding) issue no products. tma: (maps, b_row,
    # b_col) of WgmmaTile.run_tma, in place of a_rows and b_src: the A rows row0.. load as
    # whole boxes (padding rows read too); b_preloaded: the tile's run's
    a_src = T.meta_var(lambda i, k: a.ptr_to([i, k]))
    if blocks > 1:
        live = T.local_scalar("int32")
        live = 1
        for b in T.unroll(1, blocks):
            if sorted_token[row0 + b * 64] >= 0:
                live = b + 1
        if tma is None:
            mma.run(a_src, b_src, num_k, live_blocks=live, a_rows=a_rows,
                    b_preloaded=b_preloaded)
        else:
            mma.run_tma(tma[0][0].var, row0, tma[0][1].var, tma[2], num_k, tma[1], live)
    elif tma is None:
        mma.run(a_src, b_src, num_k, a_rows=a_rows, b_preloaded=b_preloaded)
    else:
        mma.run_tma(tma[0][0].var, row0, tma[0][1].var, tma[2], num_k, tma[1])


# The CTA's count of threads whose p is set, read back through a warp reduction so that
# ptxas keeps it in a uniform register (a vector one, live across a task's K loop, cost
# 128-register tiles spills)
CTA_COUNT = """
__device__ __forceinline__ int etc_cta_count(int p) {
  return __reduce_max_sync(0xffffffffu, __syncthreads_count(p));
}
"""


def pair_row_checks(gathers: bool) -> tuple[str, ...]:
    """The input checks of a grouped GEMM tile (``count_pair_rows``): a pair after a padding
    row of its tile, which the tile would leave unstored, and where it ``gathers`` x's rows
    by token, a token past them."""
    return (("sorted_token[{value}] holds a pair after a padding row (-1) of its tile: "
             "a tile's pairs come first"),) + (
        ("sorted_token holds the token {value}, past x's rows",) if gathers else ())


def _grouped_requires(rows, tiles, tile_rows: int) -> list:
    """The ``requires`` of a grouped GEMM tile: task g reads and writes rows g*BT .. g*BT +
    BT - 1 of sorted_token and of its output unguarded, so the rows are the tiles' BT each."""
    return [(rows == tiles * tile_rows, f"rows = {tile_rows} x tiles")]


@T.inline
def count_pair_rows(held, sorted_token, row0, tile_rows, threads, tx, tokens=None):
    # held = the rows of the tile from sorted_token row ``row0`` that hold pairs, counted
    # over the CTA (a barrier each ``threads`` rows): align fills a tile's first rows, the
    # padding (-1) follows them, so the grouped GEMMs store rows below it only. Each thread
    # then checks its rows (pair_row_checks): a pair at or past the count follows padding,
    # and with ``tokens`` a token must be one of them. The checks load the rows again (an L1
    # hit): held in registers across the count's barrier, the 1024-token layer spills 8 bytes
    held = 0
    for s in T.unroll(ceil_div(tile_rows, threads)):
        row = T.meta_var(T.min(s * threads + tx, tile_rows - 1))
        held = held + T.cuda.func_call(
            "etc_cta_count", T.Cast("int32", T.And(s * threads + tx < tile_rows,
                                                   sorted_token[row0 + row] >= 0)),
            source_code=CTA_COUNT, return_type="int32")
    for s in T.unroll(ceil_div(tile_rows, threads)):
        row = T.meta_var(T.min(s * threads + tx, tile_rows - 1))
        token = T.meta_var(sorted_token[row0 + row])
        T.evaluate(input_check(T.Select(token >= 0, row0 + row, row0),
                               row0 + T.max(held, 1), 0))
        if tokens is not None:
            T.evaluate(input_check(T.max(token, 0), tokens, 1))


def checked_pair_rows(sorted_token, g: int, tile_rows: int, tile: str,
                      tokens: int | None = None) -> np.ndarray:
    """The rows of tile ``g`` that hold pairs, as ``count_pair_rows`` checks them: a pair
    after a padding row, or a token past ``tokens``, is an error that names the tile's
    task and the row."""
    mine = sorted_token[g * tile_rows:(g + 1) * tile_rows]
    pairs = np.flatnonzero(mine >= 0)
    if pairs.size and pairs[-1] >= pairs.size:
        first = g * tile_rows + int(np.flatnonzero(mine < 0)[0])
        raise ExecutionError(f"{tile}: sorted_token[{g * tile_rows + int(pairs[-1])}] holds a "
                             f"pair after the padding row {first} (-1) of tile {g}: a tile's "
                             "pairs come first")
    if tokens is not None and pairs.size and mine[pairs].max() >= tokens:
        row = g * tile_rows + int(pairs[np.argmax(mine[pairs] >= tokens)])
        raise ExecutionError(f"{tile}: sorted_token[{row}] holds the token "
                             f"{int(sorted_token[row])}, past x's {tokens} rows")
    return g * tile_rows + pairs


@dataclass(frozen=True)
class LogitRouting:
    """What a grouped GEMM tile needs to route its own task from the router's partial
    logits (``tile_from_logits``): the ``top_k`` and the router's ``splits``."""

    top_k: int
    splits: int


def routed_tokens(threads: int, tile_rows: int) -> int:
    """The most tokens a tile of ``threads`` routes itself for (``tile_from_logits``): one
    round of picks, a warp a token, and every expert's pairs in one tile."""
    return min(threads // WARP, tile_rows)


@T.inline
def tile_from_logits(g, logits, top_k, tile_rows, threads, tx, warp, lane, expert, tokens):
    # tile g as align lays it out, from the router's S partial logits (S, T, E), for T <=
    # routed_tokens: expert[0] its expert (E past the used tiles), tokens[r] the token of its
    # row r (-1 past its pairs; shared). Warp t picks token t's top-K (``TopKPicker``) into
    # a shared set of tokens an expert; each thread's contiguous experts' tiles (one where
    # some token picked it) take their offsets from a warp scan of shuffles and the warps'
    # totals, and the thread holding tile g writes it. Shared and local memory only
    S, ntok, E = T.meta_var((int(logits.shape[0]), logits.shape[1], int(logits.shape[2])))
    warps, seg = T.meta_var((threads // WARP, ceil_div(int(logits.shape[2]), threads)))
    picker = TopKPicker(E, top_k, warps, S, threads, warp, lane)
    picked = T.alloc_shared((E,), "int32")  # bit t: token t picked the expert
    totals = T.alloc_shared((warps,), "int32")
    for q in T.serial(ceil_div(E, threads)):
        if q * threads + tx < E:
            picked[q * threads + tx] = 0
    if tx == 0:
        expert[0] = E
    T.cuda.cta_sync()
    picker.pick(0, logits, None, None, picked, token_bits=True)
    T.cuda.cta_sync()
    mine = T.local_scalar("int32")
    run = T.local_scalar("int32")
    up = T.local_scalar("int32")
    mine = 0
    for s in T.unroll(seg):
        if tx * seg + s < E:
            mine = mine + T.Cast("int32", picked[tx * seg + s] != 0)
    run = mine
    for d in T.unroll(5):  # the warp's inclusive scan; every lane shuffles
        up = T.tvm_warp_shuffle_up(T.uint32(FULL_MASK), run, 1 << d, WARP, WARP)
        if lane >= (1 << d):
            run = run + up
    if lane == WARP - 1:
        totals[warp] = run
    T.cuda.cta_sync()
    run = run - mine  # the first tile of the thread's experts
    for w in T.unroll(warps - 1):
        if w < warp:
            run = run + totals[w]
    for s in T.unroll(seg):
        if tx * seg + s < E:
            if picked[tx * seg + s] != 0:
                if run == g:
                    expert[0] = tx * seg + s
                run = run + 1
    T.cuda.cta_sync()
    bits = T.local_scalar("int32")
    rank = T.local_scalar("int32")
    bits = 0
    if expert[0] < E:
        bits = picked[expert[0]]
    for q in T.serial(ceil_div(tile_rows, threads)):
        r = T.meta_var(q * threads + tx)
        if r < tile_rows:
            rank = 0
            tokens[r] = -1
            for t in T.unroll(warps):  # row r: the r-th token that picked the expert
                if (bits >> t) & 1 == 1:
                    if rank == r:
                        tokens[r] = t
                    rank = rank + 1
    T.cuda.cta_sync()


def _tile_from_logits_reference(logits, g: int, top_k: int, tile_rows: int):
    """(expert, tokens of its rows) of tile g, as ``tile_from_logits`` finds them."""
    picks, _ = top_k_of(summed_logits(logits), top_k)
    experts = np.unique(picks)
    if g >= len(experts):
        return logits.shape[2], np.full(tile_rows, -1, np.int32)
    tokens = np.flatnonzero((picks == experts[g]).any(axis=1)).astype(np.int32)
    return int(experts[g]), np.pad(tokens, (0, tile_rows - len(tokens)), constant_values=-1)


@functools.cache
def make_gate_up_tile(hidden: int, intermediate: int, experts: int, tile_rows: int = 16,
                      bn: int = 64, bk: int = 64, threads: int = 128,
                      stages: int = 2, engine: str = "mma", blocked: bool = False,
                      routing: LogitRouting | None = None) -> DeviceFunc:
    """The tile ``gate_up_<H>x<F>_e<E>_<BT>x<bn>x<bk>``: task (g, n) computes h columns
    n*bn/2 .. (n+1)*bn/2 of tile g's rows from x rows gathered by sorted_token and the
    interleaved (E, H, 2F) weights (``blocked``: as ``block_columns`` lays them out);
    ``exp_indptr`` is read by the in-edge's trigger only. ``engine``: "mma" or "wgmma"
    (``_engine``; on "wgmma" a tile of several m64 blocks issues the products of those that
    hold rows only, ``_run_rows``). Padding rows (sorted_token -1), which follow a tile's
    pairs as align lays them out, read nothing and are not stored: no task reads them. A pair
    after a padding row, or a token past x's rows, is an input error (``pair_row_checks``).
    ``routing``: the tile routes its own task instead: it takes the router's S partial logits
    (S, T, E) in place of sorted_token, tile_expert and exp_indptr, and finds tile g's
    expert and rows as align lays them out (``tile_from_logits``), for at most ``routed_tokens``
    tokens; so that a megakernel's gate_up tasks wait for the router only, not for top-k
    and align after it. A task of a tile past the used ones does nothing."""
    H, F, E, BT = hidden, intermediate, experts, tile_rows
    new_tile, suffix = _engine(engine, BT, bn, bk, threads, stages)
    live_blocks = _live_blocks(engine, BT)
    swapped = engine == "swapped"
    if H % bk or (2 * F) % bn or bn % (2 * INTERLEAVE):
        raise EtcError(f"gate_up tile: H={H} must be a multiple of bk={bk}, 2F={2 * F} of "
                       f"bn={bn}, and bn of {2 * INTERLEAVE}")
    if routing is not None:
        _check_topk(E, routing.top_k, threads, "gate_up")
    ntok, rows, tiles = (tirx.Var(n, "int32") for n in ("T", "rows", "tiles"))
    w_shape = grouped_weight_shape(E, H, 2 * F, bn, blocked)

    @T.inline
    def product(g, n, e, x, w_gate_up, h, a_rows, held, mma, sorted_token):
        # h of tile g's rows below ``held`` from the x rows a_rows(r) and expert e's weights
        _run_rows(mma, x, a_rows, _weight_src(w_gate_up, e, n, bn, blocked), H // bk,
                  sorted_token, g * BT, live_blocks)
        if swapped:  # a thread's columns c and c + 8 of a panel: gate and up
            for m in T.unroll(mma.mi):
                for q in T.unroll(mma.ni):
                    for v in T.unroll(2):
                        col = T.meta_var(mma.col(m, 0))  # a gate column of the tile
                        if mma.row(q, v) < held:
                            h[g * BT + mma.row(q, v),
                              n * (bn // 2) + col // (2 * INTERLEAVE) * INTERLEAVE
                              + col % INTERLEAVE] = T.Cast(
                                  "bfloat16", _silu(mma.frag(m, q, v)) * mma.frag(m, q, 2 + v))
        else:
            for m in T.unroll(mma.mi):
                for q in T.unroll(mma.ni // 2):  # blocks 2q (gate) and 2q+1 (up)
                    for hh in T.unroll(2):
                        if mma.row(m, hh) < held:
                            for v in T.unroll(2):
                                col = T.meta_var(mma.col(2 * q, v))  # a gate column
                                h[g * BT + mma.row(m, hh),
                                  n * (bn // 2) + col // (2 * INTERLEAVE) * INTERLEAVE
                                  + col % INTERLEAVE] = T.Cast(
                                      "bfloat16", _silu(mma.frag(m, 2 * q, 2 * hh + v))
                                      * mma.frag(m, 2 * q + 1, 2 * hh + v))

    if routing is None:
        @T.prim_func
        def gate_up(g: T.int32, n: T.int32, x: T.Buffer((ntok, H), "bfloat16"),
                    w_gate_up: T.Buffer(w_shape, "bfloat16"),
                    sorted_token: T.Buffer((rows,), "int32"),
                    tile_expert: T.Buffer((tiles,), "int32"),
                    exp_indptr: T.Buffer((E + 1,), "int32"), h: T.Buffer((rows, F), "bfloat16")):
            T.device_entry()
            tx = T.thread_id([threads])
            warp = T.warp_id([threads // WARP])
            lane = T.lane_id([WARP])
            e = T.local_scalar("int32")
            e = tile_expert[g]
            if e < E:  # CTA-uniform
                mma = new_tile(tx, warp, lane)
                # padding rows (token -1) read nothing and store nothing: at few tokens they
                # are most rows of a tile, and from 1024 tokens on a fifth of its bytes of h
                held = T.local_scalar("int32")
                count_pair_rows(held, sorted_token, g * BT, BT, threads, tx, ntok)
                # a token past x's rows (an input error) reads nothing
                product(g, n, e, x, w_gate_up, h,
                        lambda r: T.Select(sorted_token[g * BT + r] < ntok,
                                           sorted_token[g * BT + r], -1), held, mma, sorted_token)

        requires = _grouped_requires(rows, tiles, BT)
    else:
        S, K, most = routing.splits, routing.top_k, routed_tokens(threads, BT)

        @T.prim_func
        def gate_up(g: T.int32, n: T.int32, x: T.Buffer((ntok, H), "bfloat16"),
                    w_gate_up: T.Buffer(w_shape, "bfloat16"),
                    logits: T.Buffer((S, ntok, E), "float32"),
                    h: T.Buffer((rows, F), "bfloat16")):
            T.device_entry()
            tx = T.thread_id([threads])
            warp = T.warp_id([threads // WARP])
            lane = T.lane_id([WARP])
            expert = T.alloc_shared((1,), "int32")
            tokens = T.alloc_shared((BT,), "int32")
            tile_from_logits(g, logits, K, BT, threads, tx, warp, lane, expert, tokens)
            e = T.local_scalar("int32")
            e = expert[0]
            if e < E:  # CTA-uniform
                mma = new_tile(tx, warp, lane)
                held = T.local_scalar("int32")
                held = 0
                for r in T.unroll(BT):
                    held = held + T.Cast("int32", tokens[r] >= 0)
                product(g, n, e, x, w_gate_up, h, lambda r: tokens[r], held, mma, None)

        # task g writes rows of tile g only where g is a used tile, below max_tiles
        requires = [(ntok <= most, f"T <= {most}: the tile routes itself for one round of "
                     "picks, every expert's pairs in one tile"),
                    (rows >= max_tiles(ntok, E, K, BT) * BT,
                     f"rows >= {BT} x max_tiles(T): h holds every tile a routing can use")]

    name = f"gate_up_{H}x{F}_e{E}_{BT}x{bn}x{bk}_s{stages}_t{threads}{suffix}" + (
        "_blocked" if blocked else "") + (
        f"_routed_top{routing.top_k}_s{routing.splits}" if routing is not None else "")
    tile = device_func(gate_up.with_attr("global_symbol", name), cost=H // bk,
                       checks=() if routing is not None else pair_row_checks(gathers=True),
                       requires=requires)

    def reference(g, n, x, w_gate_up, e, tokens, h):
        both = x[tokens].astype(np.float32) @ _reference_slab(w_gate_up, e, n, bn,
                                                              blocked).astype(np.float32)
        pairs = both.reshape(len(tokens), bn // (2 * INTERLEAVE), 2, INTERLEAVE)
        value = _np_silu(pairs[:, :, 0]) * pairs[:, :, 1]
        h[g * BT:g * BT + len(tokens), n * bn // 2:(n + 1) * bn // 2] = value.reshape(
            len(tokens), bn // 2).astype(h.dtype)

    if routing is None:
        @tile.set_reference
        def _(g, n, x, w_gate_up, sorted_token, tile_expert, exp_indptr, h):
            e = int(tile_expert[g])
            if e < E:
                rows_ = checked_pair_rows(sorted_token, g, BT, f"gate_up({g}, {n})", len(x))
                reference(g, n, x, w_gate_up, e, sorted_token[rows_], h)
    else:
        @tile.set_reference
        def _(g, n, x, w_gate_up, logits, h):
            e, tokens = _tile_from_logits_reference(logits, g, routing.top_k, BT)
            if e < E:
                reference(g, n, x, w_gate_up, e, tokens[tokens >= 0], h)

    return tile


@functools.cache
def make_down_tile(intermediate: int, hidden: int, experts: int, tile_rows: int = 16,
                   bn: int = 64, bk: int = 64, threads: int = 128, stages: int = 2,
                   engine: str = "mma", blocked: bool = False,
                   y_dtype: str = "float32", loads: str = "cp.async",
                   early_weights: bool = False) -> DeviceFunc:
    """The tile ``down_<F>x<H>_e<E>_<BT>x<bn>x<bk>``: task (g, n) computes
    y[rows of g, n*bn:(n+1)*bn] = h[rows of g] @ w_down[e], summed in fp32 and stored as
    ``y_dtype`` (``Y_DTYPES``; ``engine`` and ``blocked`` as gate_up's). Like gate_up's, its
    padding rows (sorted_token -1) read nothing and are not stored (a pair after one is an
    input error), and its m64 blocks without rows issue no products. ``loads``:
    "cp.async", or "tma" on the wgmma engine (``WgmmaTile.run_tma``: h's rows are the tile's
    own, not gathered, so whole boxes of them and of the weight slab load by TMA, and every
    slot of the ring but the one read is in flight; padding rows are then read, whatever they
    hold, into rows of y not stored).
    ``early_weights`` (cp.async loads): the task's prelude (``await_inputs``) reads its
    expert and issues the weight slices of its ring's prologue (``preload_b``), so that in a
    persistent kernel they stream while the task waits for its rows of h."""
    F, H, E, BT = intermediate, hidden, experts, tile_rows
    _check_y_dtype(y_dtype, "down")
    new_tile, suffix = _engine(engine, BT, bn, bk, threads, stages)
    live_blocks = _live_blocks(engine, BT)
    if F % bk or H % bn:
        raise EtcError(f"down tile: F={F} must be a multiple of bk={bk} and H={H} of bn={bn}")
    maps = wgmma_gemm.operand_maps(loads, "h", BT, bk, "down tile", b="w_down")
    tma = loads == "tma"
    if tma and engine != "wgmma":  # (a swapped tile's rows are no TMA box of A)
        raise EtcError(f"down tile: loads 'tma' runs on the wgmma engine, not {engine!r}")
    if tma and early_weights:
        raise EtcError("down tile: early_weights issues cp.async copies; TMA loads fill the "
                       "ring from its barriers within the task")
    rows, tiles = tirx.Var("rows", "int32"), tirx.Var("tiles", "int32")

    @T.inline
    def product(mma, g, n, e, h, w_down, sorted_token, y, tma_loads):
        held = T.local_scalar("int32")  # padding rows are not stored
        count_pair_rows(held, sorted_token, g * BT, BT, threads, mma.tx)
        _run_rows(mma, h, lambda r: T.Select(sorted_token[g * BT + r] >= 0, g * BT + r, -1),
                  _weight_src(w_down, e, n, bn, blocked), F // bk, sorted_token, g * BT,
                  live_blocks, tma_loads, b_preloaded=early_weights)
        mma.store(y, g * BT, n * bn, held)

    # with TMA the maps' variables are free: each kernel binds them
    @T.prim_func(check_well_formed=not tma)
    def down(g: T.int32, n: T.int32, h: T.Buffer((rows, F), "bfloat16"),
             w_down: T.Buffer(grouped_weight_shape(E, F, H, bn, blocked), "bfloat16"),
             sorted_token: T.Buffer((rows,), "int32"), tile_expert: T.Buffer((tiles,), "int32"),
             exp_indptr: T.Buffer((E + 1,), "int32"), y: T.Buffer((rows, H), y_dtype)):
        T.device_entry()
        tx = T.thread_id([threads])
        warp = T.warp_id([threads // WARP])
        lane = T.lane_id([WARP])
        e = T.local_scalar("int32")
        e = tile_expert[g]
        # with TMA, the slab's rows and columns in the map's 2-D view of w_down:
        # (E * H/bn * F, bn) blocked, (E * F, H) in place
        tma_loads = T.meta_var((maps, (e * (H // bn) + n) * F if blocked else e * F,
                                0 if blocked else n * bn) if tma else None)
        if early_weights:
            early = new_tile(tx, warp, lane)
            if e < E:
                early.preload_b(_weight_src(w_down, e, n, bn, blocked), F // bk)
            T.evaluate(await_inputs())
            if e < E:
                product(early, g, n, e, h, w_down, sorted_token, y, tma_loads)
        elif e < E:
            mma = new_tile(tx, warp, lane)
            product(mma, g, n, e, h, w_down, sorted_token, y, tma_loads)

    name = f"down_{F}x{H}_e{E}_{BT}x{bn}x{bk}_s{stages}_t{threads}{suffix}" + (
        "_tma" if tma else "") + ("_blocked" if blocked else "") + _Y_SUFFIX[y_dtype] + (
        "_early" if early_weights else "")
    tile = device_func(down.with_attr("global_symbol", name), cost=F // bk, tensor_maps=maps,
                       checks=pair_row_checks(gathers=False),
                       requires=_grouped_requires(rows, tiles, BT))

    @tile.set_reference
    def _(g, n, h, w_down, sorted_token, tile_expert, exp_indptr, y):
        e = int(tile_expert[g])
        if e >= E:
            return
        rows_ = checked_pair_rows(sorted_token, g, BT, f"down({g}, {n})")
        y[rows_, n * bn:(n + 1) * bn] = (h[rows_].astype(np.float32) @ _reference_slab(
            w_down, e, n, bn, blocked).astype(np.float32)).astype(y.dtype)

    return tile


def gate_up_exact(xrows, w_gate, w_up):
    """float64 (h, gate, up) of rows of x under one expert's weights."""
    a = xrows.astype(np.float64)
    gate = a @ w_gate.astype(np.float64, copy=False)
    up = a @ w_up.astype(np.float64, copy=False)
    return _np_silu(gate) * up, gate, up


def gate_up_bound(xrows, w_gate, w_up) -> np.ndarray:
    """Bound on ``|h - h64|``: each GEMM within ``H * 2**-22 * |x| @ |W|`` (gemm.py), carried
    through silu(g) * u (|silu'| <= 1.1), the fast-math SiLU (``2**-20 * (1 + |g|)``), the
    product's fp32 rounding and the bf16 rounding of h."""
    return gate_up_reference(xrows, w_gate, w_up)[1]


def gate_up_reference(xrows, w_gate, w_up) -> tuple[np.ndarray, np.ndarray]:
    """(``gate_up_exact``'s h, ``gate_up_bound``) from one conversion of the weights and one
    product each (the layer's reference runs it for every expert)."""
    w_gate, w_up = w_gate.astype(np.float64), w_up.astype(np.float64)
    h64, gate, up = gate_up_exact(xrows, w_gate, w_up)
    a = np.abs(xrows.astype(np.float64))
    dg = xrows.shape[-1] * 2.0 ** -22 * (a @ np.abs(w_gate))
    du = xrows.shape[-1] * 2.0 ** -22 * (a @ np.abs(w_up))
    silu = np.abs(_np_silu(gate))
    err = 1.1 * dg * (np.abs(up) + du) + (silu + 1.1 * dg) * du \
        + 2.0 ** -20 * (1 + np.abs(gate)) * (np.abs(up) + du)
    return h64, err * (1 + 2.0 ** -8) + 2.0 ** -8 * np.abs(h64) + 2.0 ** -126


# ---------------------------------------------------------------------------------- combine
def combine_cols_fit(hidden: int, cols: int, threads: int = 128) -> bool:
    """Whether combine tasks of ``cols`` columns on ``threads`` cover ``hidden``: blocks
    that divide it, of 4-vectors, at most one a thread or whole rounds of the threads."""
    vecs = cols // 4
    return cols > 0 and hidden % cols == 0 and cols % 4 == 0 \
        and (vecs <= threads or vecs % threads == 0)


@functools.cache
def make_combine_tile(hidden: int, top_k: int, cols: int = 512,
                      threads: int = 128, y_dtype: str = "float32",
                      tokens: int = 1, prefetch: bool = False) -> DeviceFunc:
    """The tile ``combine_<H>_top<K>_c<cols>``: task (b, c) writes, for each token t of
    b*tokens .. b*tokens + tokens - 1 below T,
    out[t, c*cols:(c+1)*cols] = sum_k topw[t, k] * y[pair_row[t, k], same] in fp32, in k
    order, rounded once to bf16; y is down's (``Y_DTYPES``); ``pair_tile`` is read by the
    in-edge only (``pair_tile[tokens*b:tokens*b+tokens, :]``). Several ``tokens`` a task keep
    as many times the bytes of y in flight: where one CTA an SM runs the tasks, a token's
    32 KB gather (H = 2048, K = 8, bf16 y) waits a memory round trip or two. ``prefetch``:
    the task first asks for each of its rows of y in L2 (one bulk prefetch a row, from as
    many threads), as ptxas lets a thread's loads out only a few dozen at a time, each batch
    then waiting on L2 rather than on DRAM."""
    H, K, TB = hidden, top_k, tokens
    _check_y_dtype(y_dtype, "combine")
    vecs = cols // 4
    if not combine_cols_fit(H, cols, threads):
        raise EtcError(f"combine tile: cols={cols} must divide H={H} into 4-vectors that "
                       f"spread over {threads} threads")
    if TB < 1:
        raise EtcError(f"combine tile: tokens must be positive, got {TB}")
    row_bytes = cols * tvm.DataType(y_dtype).bits // 8
    if prefetch and row_bytes % 16:
        raise EtcError(f"combine tile: a prefetched row of y is a multiple of 16 bytes; "
                       f"cols={cols} of {y_dtype} make {row_bytes}")
    ntok, rows = tirx.Var("T", "int32"), tirx.Var("rows", "int32")
    steps = ceil_div(vecs, threads)

    @T.prim_func
    def combine(b: T.int32, c: T.int32, topw: T.Buffer((ntok, K), "float32"),
                pair_row: T.Buffer((ntok, K), "int32"), pair_tile: T.Buffer((ntok, K), "int32"),
                y: T.Buffer((rows, H), y_dtype), out: T.Buffer((ntok, H), "bfloat16")):
        T.device_entry()
        tx = T.thread_id([threads])
        acc = T.alloc_local((TB, steps, 4), "float32")
        if prefetch:
            for r in T.unroll(ceil_div(TB * K, threads)):
                row = T.meta_var(r * threads + tx)
                if row < TB * K and b * TB + row // K < ntok:
                    T.ptx.cp.async_.bulk.prefetch.L2.global_(
                        y.ptr_to([pair_row[b * TB + row // K, row % K], c * cols]),
                        T.uint32(row_bytes))
        # every token's and step's sums before any store: nothing tells the compiler that out
        # and y do not overlap, so a store between two steps kept the next step's loads from
        # leaving early, one round trip a step
        for u in T.unroll(TB):
            if b * TB + u < ntok:
                for s in T.unroll(steps):
                    if s * threads + tx < vecs:
                        col = T.meta_var(c * cols + (s * threads + tx) * 4)
                        for j in T.vectorized(4):
                            acc[u, s, j] = T.float32(0)
                        for k in T.unroll(K):
                            for j in T.vectorized(4):
                                acc[u, s, j] = acc[u, s, j] + topw[b * TB + u, k] * T.Cast(
                                    "float32", y[pair_row[b * TB + u, k], col + j])
        for u in T.unroll(TB):
            if b * TB + u < ntok:
                for s in T.unroll(steps):
                    if s * threads + tx < vecs:
                        for j in T.vectorized(4):
                            out[b * TB + u, c * cols + (s * threads + tx) * 4 + j] = T.Cast(
                                "bfloat16", acc[u, s, j])

    name = f"combine_{H}_top{K}_c{cols}_t{threads}" + (f"_b{TB}" if TB > 1 else "") \
        + ("_l2" if prefetch else "") + _Y_SUFFIX[y_dtype]
    tile = device_func(combine.with_attr("global_symbol", name))

    @tile.set_reference
    def _(b, c, topw, pair_row, pair_tile, y, out):
        span = slice(c * cols, (c + 1) * cols)
        for t in range(b * TB, min((b + 1) * TB, topw.shape[0])):
            acc = np.zeros(cols, np.float32)
            for k in range(K):
                acc = acc + topw[t, k] * y[pair_row[t, k], span].astype(np.float32)
            out[t, span] = acc.astype(out.dtype)

    return tile


def combine_bound(topw, ys) -> np.ndarray:
    """Bound on ``|out - sum_k w_k y_k|`` for exact fp32 inputs ``topw`` (T, K) and gathered
    ``ys`` (T, K, H): K fp32 multiply-adds and the bf16 rounding."""
    terms = np.abs(topw.astype(np.float64))[:, :, None] * np.abs(ys.astype(np.float64))
    exact = np.einsum("tk,tkh->th", topw.astype(np.float64), ys.astype(np.float64))
    return 2 * topw.shape[1] * 2.0 ** -24 * terms.sum(axis=1) + 2.0 ** -8 * np.abs(exact) \
        + 2.0 ** -126
