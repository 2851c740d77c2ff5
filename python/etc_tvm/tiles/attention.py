"""Decode attention with grouped-query heads over a contiguous KV cache (flash-decoding).

One decode step of B sequences, ``Hq`` query heads sharing ``Hk`` KV heads (groups of
``G = Hq / Hk``), head dim D, bf16 (``AttentionHeads``; Qwen3-30B-A3B's 32, 4 and 128 by
default). A split or merge task takes a block of ``Gb`` query heads of one KV head: the whole
group up to 8 heads, else the largest divisor of it up to 8 (``AttentionHeads.block``). Three
tiles, chained by tile-level edges (``tests/python/attention_graph.py``), with ``h`` a block of
query heads ``h*Gb .. h*Gb+Gb-1`` (KV head ``h*Gb // G``)::

    append, task b:       K_cache[b, :, seq_lens[b]] = k_new[b]; likewise V; pos[b] = seq_lens[b]
    split,  task (b,h,s): the Gb query heads of block h over tokens [s*chunk, (s+1)*chunk)
                          of 0 .. pos[b]: O_part[b,h,s] (normalised, fp32) and lse[b,h,s]
    merge,  task (b,h):   out[b, h*Gb : h*Gb+Gb] = the lse-weighted mean of O_part[b,h,:] (bf16);
                          in P parts a block, task (b, h*P + p) the part p of those heads

Layouts. ``K_cache, V_cache: [B, Hk, max_len, D]`` (kv-head major, "HND"): a split task's
chunk is one contiguous run of ``chunk * 2D`` bytes, read as whole DRAM pages (and a later TMA
tile can load it as one box); with ``[B, max_len, Hk, D]`` the same rows would be 2D-byte
pieces ``2 Hk D`` bytes apart. The append writes one row per head in either layout.
``O_part: [B, Hq/Gb, S, Gb, D]`` fp32 and ``lse: [B, Hq/Gb, S, Gb]`` fp32, ``S = ceil(max_len
/ chunk)``; lse is in base 2 (scores are pre-scaled by log2(e), so every exponential is one
``ex2``): ``lse = log2(sum_t exp2(x_t))`` over the chunk. B and max_len are symbolic; the
lengths are run-time data.

Paged caches (``page`` tokens a page, the tiles' ``_p<page>``): ``K_pages, V_pages: [P, Hk,
page, D]`` (a pool of pages, each kv-head major as above) and ``block_table: [B, NP]``, whose
entry i is the page that holds sequence b's tokens ``i*page .. i*page + page - 1``; the cache
holds ``NP * page`` tokens a sequence. The append writes slot ``len % page`` of entry
``len // page``; a split task (its chunk whole pages) reads its chunk's entries once into
shared memory, only those that hold tokens of the sequence (the others may hold anything),
and a page id outside ``0 .. P-1`` stops the kernel with ``PAGE_CHECK`` naming the task and
the id (``checked_pages`` on the reference executor). The merge is the same.

Why blocks of at most 8 heads: a thread keeps ``Gb`` heads' q and accumulators in fp32
registers (``17 Gb`` of them); past 8 heads they spill. A group of 16 (Qwen3-235B-A22B's 64 on
4) is two blocks, whose tasks read the same K and V rows, so that cache is read twice.

The cache is state: the append writes into ``K_cache`` and ``V_cache`` in place (they are
inputs that the tile ``updates``, see ``DeviceFunc``), and a split task reads the row it wrote,
so it waits for the append of its sequence (``"bhs->b"``); its ``pos`` output orders the calls
when they run as separate launches. Bounds: a length outside ``[0, max_len)`` (no room for this
step's token) writes nothing, sets ``pos[b] = -1``, and the merge writes NaN for all of that
sequence's output, so a full cache is loud, never a wild write nor a silently shorter context.
The tensor-core split can append the rows itself (``make_decode_split_mma_tile(append=True)``:
split -> merge, no append task and no hand-off before the splits): the task whose chunk holds
the new row writes it, and every task of that chunk copies the row from ``k_new`` and
``v_new`` rather than from the cache, so none waits for the write.

Inside a split task (128 threads; ``lanes = D / 8`` threads own a row, 16 for D = 128: a
group of lanes ``rg = tx // lanes`` owns rows ``rg, rg + 128/lanes, ...`` of the chunk, lane
``c = tx % lanes`` owns dims ``8c .. 8c+7`` of every row)::

    q[Gb heads, 8 dims] -> fp32 registers, pre-scaled by log2(e) / sqrt(D)
    K rows: one 16-byte load per thread and row (``lanes`` threads read one row), UNROLL
            rows a step, in two register buffers: step i + 1's rows load while step i's
            are used; Gb partial dots per row (the GQA sharing: each loaded K element
            serves the Gb heads), summed over the lanes by a reduce-scatter (each xor shuffle
            halves the dots a lane holds: 8 shuffles a row at 8 heads on 16 lanes, where a
            sum of each head takes 32) -> scores[Gb, chunk] in shared memory
    per head (a warp's): m = max, p = exp2(score - m), l = sum p   (exact over the chunk)
    V rows: the same loads, the first step's issued before the softmax;
            acc[Gb heads, 8 dims] += p * v in fp32 registers
    row groups of a warp, then warps, summed through shared memory; O_part = acc / l,
    lse = m + log2(l)

fp32 FMA on CUDA cores: decode attention moves 2 x 2D bytes per token for ``2 Gb D`` FMAs
(QK and PV), 4 a byte at 8 heads, with a shuffle sum a row on top, where the H200's CUDA cores
issue 6 - 9 FMAs for each byte HBM delivers (31 TFMA/s against 3.4 - 4.8 TB/s): these tasks
are near their issue bound as well as their memory bound. ``make_decode_split_mma_tile`` does
the same split on tensor cores (the K and V rows through shared memory in slices of the chunk,
the heads the m16 rows of the MMAs; either cache), at the price of P in bf16. Its best chunk
depends on the batch and the context (more tasks to fill the GPU, fewer partials to merge):
``choose_split`` picks it, and the merge's parts, from ``SplitCostModel``.

Empty splits: a task whose chunk starts at or beyond the sequence's ``pos[b] + 1`` tokens (every
task of a sequence with ``pos[b] = -1``) writes ``O_part = 0`` and ``lse = -inf``: its merge
weight ``exp2(-inf - M)`` is exactly 0. Split 0 of a valid sequence always holds a token, so
the merge's maximum ``M`` is finite. (A merge task's group of threads whose splits are all empty
weighs 0 against the others, ``MergeThreads``.)

Numeric contract (bf16 inputs, fp32 math with TVM's fast math: ``ex2.approx``, ``lg2.approx``,
approximate division), against float64 attention of the same bf16 values (``error_bound``).
With ``x_t`` the exact base-2 score of token t and ``A = sum_t p_t |v_t| / sum_t p_t``:

* a score: q scaled by an fp32 constant, D exact-input products rounded and summed in fp32:
  ``|dx_t| <= (D + 3) 2**-24 log2(e)/sqrt(D) sum_i |q_i k_ti|``;
* a weight ``exp2(x - m)``: relative ``ln2 (|dx_t| + 2**-23 (|x_t| + max|x|)) + 2**-21``
  (the subtraction, ex2.approx); a split's lse adds ``ln2 (2**-22 + 2**-23 |lse|)`` (lg2.approx,
  the addition) and ``chunk 2**-24`` (the sum l); the merge weight another ex2, ``2**-21``;
* a ratio of weighted sums whose weights are off by a relative rho moves by at most
  ``2 rho A / (1 - rho)``; fp32 sums of at most chunk (then S) terms add ``(chunk + S) 2**-24 A``;
  two approximate divisions ``2**-22 A``;
* the bf16 output rounds: ``2**-8 |o|``.

On tensor cores (``engine="mma"``) the fp32 sums may truncate: a score's error is ``(D 2**-22 +
2**-23) log2(e)/sqrt(D) sum_i |q_i k_ti|``, the P @ V sums add ``4 chunk 2**-24 A``, and P's
bf16 rounding moves each weight by ``2**-8`` relative (l sums the rounded weights, so the
output is an exact mean under them). Slices of a chunk rescale O and l by one ex2 each, the
same factor for both: up to ``chunk / 64`` of them move the split's lse by ``2**-21`` each.

Each term is rounded up; ``error_bound`` sums them per output element.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import ml_dtypes
import numpy as np
from tvm import tirx
from tvm.script import tirx as T

from ..device_func import DeviceFunc, device_func, input_check
from ..errors import EtcError, ExecutionError
from ..ops import is_op
from .gemm import PAD, copy_a_chunk

THREADS = 128
WARPS = THREADS // 32
VEC = 8  # bf16 per 16-byte load
MAX_BLOCK = 8  # query heads a split task takes at most: their fp32 registers
HEAD_DIMS = (16, 32, 64, 128, 256)
NEG_INF = float("-inf")
BF16 = ml_dtypes.bfloat16


@dataclasses.dataclass(frozen=True)
class AttentionHeads:
    """The heads of one attention layer: ``q_heads`` query heads on ``kv_heads`` KV heads of
    ``head_dim`` each, and the block of query heads that a split or merge task takes."""

    q_heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    max_block: int = MAX_BLOCK  # up to 16 for the tensor-core split (its m16 rows)

    def __post_init__(self):
        if min(self.q_heads, self.kv_heads, self.head_dim) < 1 or self.q_heads % self.kv_heads:
            raise EtcError(f"attention heads {self}: the query heads must be a positive "
                           f"multiple of the KV heads")
        if not 1 <= self.max_block <= 16:
            raise EtcError(f"attention heads {self}: max_block must be 1 to 16 (the m16 rows "
                           f"of the tensor-core split tile)")
        if self.head_dim not in HEAD_DIMS:
            raise EtcError(f"attention heads {self}: head_dim must be one of {HEAD_DIMS} "
                           f"({VEC} dims a lane, a row's lanes within one warp, at least two)")

    @property
    def group(self) -> int:
        """Query heads that share one KV head."""
        return self.q_heads // self.kv_heads

    @property
    def lanes(self) -> int:
        """Threads that hold one row of K or V, one 16-byte vector each."""
        return self.head_dim // VEC

    @property
    def row_groups(self) -> int:
        """Rows a CTA loads at once."""
        return THREADS // self.lanes

    @property
    def block(self) -> int:
        """Query heads a task takes: the largest divisor of the group up to ``max_block`` (on
        CUDA cores the registers hold 8) that the lanes of a row can each store one score of."""
        most = min(self.max_block, self.lanes)
        return max(d for d in range(1, most + 1) if self.group % d == 0)

    @property
    def blocks(self) -> int:
        """Blocks of query heads: the second grid dimension of the split and merge tiles."""
        return self.q_heads // self.block

    @property
    def scale_log2(self) -> float:
        """The score scale in base 2 (every exponential one ex2)."""
        return math.log2(math.e) / math.sqrt(self.head_dim)

    @property
    def suffix(self) -> str:
        """What the tiles' names carry of the heads: ``<Hq>q<Hk>k_d<D>``, and ``_b<block>``
        where ``max_block`` is not the default."""
        return f"{self.q_heads}q{self.kv_heads}k_d{self.head_dim}" + (
            "" if self.max_block == MAX_BLOCK else f"_b{self.block}")

    def kv_head(self, block):
        """The KV head that query-head block ``block`` (an int or a TIR expression) reads."""
        per_kv = self.group // self.block
        return block if per_kv == 1 else block // per_kv


QWEN3_30B_A3B = AttentionHeads()


def num_splits(max_len, chunk: int):
    """Split tasks per (sequence, head block): enough chunks to cover the cache."""
    return (max_len + chunk - 1) // chunk


@dataclasses.dataclass(frozen=True)
class SplitCostModel:
    """What the tensor-core split and its merge take, to choose the chunk and the merge's
    parts together (``choose_split``). A time is relative: the launch and the append cost
    every choice alike, so only differences between choices mean anything.

    Split tasks run in waves of the CTA slots. In a wave, the tasks on an SM share what it
    keeps in flight, ``sm_bytes_per_us``, each at most ``task_bytes_per_us`` (a task alone on
    its SM), and all of them share the DRAM, ``dram_bytes_per_us``: a wave takes
    ``task_start_us`` and its busiest SM's share of the chunk's K and V rows, or its bytes at
    the DRAM's rate, whichever is longer. So a chunk short enough to put two tasks on every
    SM streams each at half the SM's rate, a last wave of a few tasks costs a whole task, and
    a long chunk leaves CTA slots idle. A merge task reads its part of the block's ``S``
    partials (fp32) after ``merge_start_us``, at ``merge_bytes_per_us``; the merge tasks run
    in waves of the slots too. Many splits make many partials, which parts spread over more
    SMs (``make_decode_merge_tile(heads, parts)``).

    The defaults were fitted on an H200 and an H100 together (132 SMs, two split CTAs an SM,
    64-token slices, two in flight), the DRAM's rate apart (``H100_SPLIT_COST``), to 1 - 64
    sequences of 2048 - 16384 tokens, one merge task a block and 1 - 8 parts
    (docs/performance.md, "Decode attention on the H200; a chunk for every batch" and "The
    chunk and the merge's parts chosen together"); the fit puts a split task's start at zero,
    as one wave's start costs every choice alike. The tile has changed since (its warps
    stream their own quarters of a slice, "The split's warps stream their own quarters"): a
    task alone streams about twice as fast, and on its H200 rows the pair this model picks is
    within 4% of the fastest measured. ``max_chunk``: the longest chunk the fit measured;
    past it the model would extrapolate."""

    num_sms: int = 132
    ctas_per_sm: int = 2
    dram_bytes_per_us: float = 3.6e6
    task_start_us: float = 0.0
    task_bytes_per_us: float = 2.8e4
    sm_bytes_per_us: float = 3.75e4
    merge_start_us: float = 0.9
    merge_bytes_per_us: float = 5e4
    max_chunk: int = 2048

    def time_us(self, batch: int, capacity: int, heads: AttentionHeads, chunk: int,
                merge_parts: int = 1) -> float:
        """The predicted time of the split and merge tasks over a cache of ``capacity`` tokens
        a sequence (every split task streams its whole chunk), a block's merge in
        ``merge_parts`` tasks."""
        splits = num_splits(capacity, chunk)
        blocks = batch * heads.blocks
        split_bytes = chunk * 4 * heads.head_dim  # the chunk's K and V rows, bf16
        part_bytes = splits * heads.block // merge_parts * heads.head_dim * 4

        def split_wave(tasks: int) -> float:
            rate = min(self.task_bytes_per_us,
                       self.sm_bytes_per_us / math.ceil(tasks / self.num_sms))
            return max(self.task_start_us + split_bytes / rate,
                       tasks * split_bytes / self.dram_bytes_per_us)

        def merge_wave(tasks: int) -> float:
            return max(self.merge_start_us + part_bytes / self.merge_bytes_per_us,
                       tasks * part_bytes / self.dram_bytes_per_us)

        return (self._waves(blocks * splits, split_wave)
                + self._waves(blocks * merge_parts, merge_wave))

    def _waves(self, tasks: int, wave_us) -> float:
        slots = self.num_sms * self.ctas_per_sm
        full, last = divmod(tasks, slots)
        return full * wave_us(slots) + (wave_us(last) if last else 0.0)


# The fitted defaults: an H200 SXM.
H200_SPLIT_COST = SplitCostModel()
# An H100 SXM: the same tasks, fitted with the H200's but for the DRAM's rate.
H100_SPLIT_COST = SplitCostModel(dram_bytes_per_us=2.45e6)


def split_cost_model(device_name: str) -> SplitCostModel:
    """The fitted model of the GPU named ``device_name`` (as ``nvidia-smi`` or
    ``torch.cuda.get_device_name()`` print it): an H100's, else the H200's."""
    return H100_SPLIT_COST if "H100" in device_name else H200_SPLIT_COST


class SplitChoice(NamedTuple):
    """The split tile's chunk and the tasks of a block's merge (``choose_split``)."""

    chunk: int
    merge_parts: int


def choose_split(batch: int, capacity: int, heads: AttentionHeads = QWEN3_30B_A3B,
                 sub: int = 64, page: int | None = None,
                 model: SplitCostModel = H200_SPLIT_COST) -> SplitChoice:
    """The chunk of ``make_decode_split_mma_tile(chunk, heads, sub, page=page)`` and the parts
    of ``make_decode_merge_tile(heads, parts)`` for ``batch`` sequences over ``capacity``
    cached tokens each: the pair ``model`` predicts fastest. The chunk is one of ``sub``,
    ``2 sub``, ``4 sub``, ... up to the first that covers the cache or ``model.max_chunk``, a
    multiple of ``page``; the parts a divisor of the block; on a tie the larger chunk and the
    fewer parts. The chunk grows with the batch (more tasks to fill the GPU with) and shrinks
    for a single long sequence (whose few, long tasks would leave most CTA slots idle), whose
    many splits then take a merge in parts."""
    if batch < 1 or capacity < 1 or sub < 1:
        raise EtcError(f"split chunk: batch ({batch}), capacity ({capacity}) and sub ({sub}) "
                       f"must be positive")
    chunks, chunk = [], sub
    while True:
        if page is None or chunk % page == 0:
            chunks.append(chunk)
        if chunk >= min(capacity, model.max_chunk):
            break
        chunk *= 2
    if not chunks:
        raise EtcError(f"split chunk: no chunk of {sub} x 2**k tokens up to {chunk} (the "
                       f"cache's {capacity} or the model's max_chunk {model.max_chunk}) is a "
                       f"multiple of the page ({page} tokens)")
    parts = [p for p in range(1, heads.block + 1) if heads.block % p == 0]
    return min((SplitChoice(c, p) for c in reversed(chunks) for p in parts),
               key=lambda choice: model.time_us(batch, capacity, heads, *choice))


def check_page(page, chunk: int | None = None) -> None:
    """Raise unless ``page`` (tokens a page; None for a contiguous cache) is positive and
    divides ``chunk``, so that a split task takes whole pages."""
    if page is not None and (page < 1 or chunk is not None and chunk % page):
        raise EtcError(f"paged KV cache: a page must be a positive number of tokens that "
                       f"divides the split tasks' chunk, got page={page}, chunk={chunk}")


PAGE_CHECK = "block_table holds the page id {value}, outside the pages of the cache"


def checked_pages(block_table, b: int, tokens, page: int, num_pages: int, tile: str):
    """The page id of each of sequence b's ``tokens`` (a slice); an id outside the cache's
    ``num_pages`` pages is an error that names it and where (``PAGE_CHECK`` on the device)."""
    slots = np.arange(tokens.start, tokens.stop) // page
    ids = block_table[b, slots]
    bad = np.nonzero((ids < 0) | (ids >= num_pages))[0]
    if bad.size:
        raise ExecutionError(f"{tile}: block_table[{b}, {int(slots[bad[0]])}] = "
                             f"{int(ids[bad[0]])} is no page of 0..{num_pages - 1}")
    return ids


@T.inline
def write_kv_rows(k_new, v_new, b, K, V, major, row, first: int, count: int, tx):
    # this step's rows of KV heads first .. first + count - 1 (first may be a run-time value,
    # count is not): K[major, h, row] = k_new[b, h], likewise V; one 16-byte vector a thread
    # and round, the K vectors first
    lanes = T.meta_var(k_new.shape[2] // VEC)
    half = T.meta_var(count * lanes)  # vectors a cache
    for r in T.unroll((2 * half + THREADS - 1) // THREADS):
        v = T.meta_var(r * THREADS + tx)
        h = T.meta_var(first + v % half // lanes)
        col = T.meta_var(v % lanes * VEC)
        if v < half:
            for e in T.vectorized(VEC):
                K[major, h, row, col + e] = k_new[b, h, col + e]
        elif 2 * half % THREADS == 0 or v < 2 * half:
            for e in T.vectorized(VEC):
                V[major, h, row, col + e] = v_new[b, h, col + e]


@functools.cache
def make_kv_append_tile(heads: AttentionHeads = QWEN3_30B_A3B,
                        page: int | None = None) -> DeviceFunc:
    """The tile ``kv_append_<heads>``: task b writes this step's K and V rows of sequence b,
    all KV heads, at ``seq_lens[b]``; one 16-byte vector per thread and step (the K vectors
    first, then the V vectors). ``page``: into a paged cache (``_p<page>``), at slot
    ``seq_lens[b] % page`` of page ``block_table[b, seq_lens[b] // page]``."""
    check_page(page)
    Hk, D = heads.kv_heads, heads.head_dim
    B, L = tirx.Var("B", "int32"), tirx.Var("L", "int32")

    if page is None:
        @T.prim_func
        def kv_append(b: T.int32, k_new: T.Buffer((B, Hk, D), "bfloat16"),
                      v_new: T.Buffer((B, Hk, D), "bfloat16"),
                      seq_lens: T.Buffer((B,), "int32"),
                      K_cache: T.Buffer((B, Hk, L, D), "bfloat16"),
                      V_cache: T.Buffer((B, Hk, L, D), "bfloat16"),
                      pos: T.Buffer((B,), "int32")):
            T.device_entry()
            tx = T.thread_id([THREADS])
            at = T.local_scalar("int32")
            at = seq_lens[b]
            if at >= 0 and at < L:
                write_kv_rows(k_new, v_new, b, K_cache, V_cache, b, at, 0, Hk, tx)
            if tx == 0:
                pos[b] = T.if_then_else(at >= 0 and at < L, at, -1)

        tile = device_func(kv_append.with_attr("global_symbol", f"kv_append_{heads.suffix}"),
                           updates=("K_cache", "V_cache"))

        @tile.set_reference
        def _(b, k_new, v_new, seq_lens, K_cache, V_cache, pos):
            at = int(seq_lens[b])
            if 0 <= at < K_cache.shape[2]:
                K_cache[b, :, at] = k_new[b]
                V_cache[b, :, at] = v_new[b]
                pos[b] = at
            else:
                pos[b] = -1

        return tile

    NP, P = tirx.Var("NP", "int32"), tirx.Var("P", "int32")

    @T.prim_func
    def kv_append_paged(b: T.int32, k_new: T.Buffer((B, Hk, D), "bfloat16"),
                        v_new: T.Buffer((B, Hk, D), "bfloat16"),
                        seq_lens: T.Buffer((B,), "int32"),
                        block_table: T.Buffer((B, NP), "int32"),
                        K_pages: T.Buffer((P, Hk, page, D), "bfloat16"),
                        V_pages: T.Buffer((P, Hk, page, D), "bfloat16"),
                        pos: T.Buffer((B,), "int32")):
        T.device_entry()
        tx = T.thread_id([THREADS])
        at = T.local_scalar("int32")
        pid = T.local_scalar("int32")
        at = seq_lens[b]
        pid = -1  # no room: a length past the table's pages, or a bad page id (reported)
        if at >= 0 and at < NP * page:
            pid = block_table[b, at // page]
            if input_check(pid, P) == 0:
                pid = -1
        if pid >= 0:
            write_kv_rows(k_new, v_new, b, K_pages, V_pages, pid, at % page, 0, Hk, tx)
        if tx == 0:
            pos[b] = T.if_then_else(pid >= 0, at, -1)

    name = f"kv_append_{heads.suffix}_p{page}"
    tile = device_func(kv_append_paged.with_attr("global_symbol", name),
                       updates=("K_pages", "V_pages"), checks=(PAGE_CHECK,))

    @tile.set_reference
    def _(b, k_new, v_new, seq_lens, block_table, K_pages, V_pages, pos):
        at = int(seq_lens[b])
        if 0 <= at < block_table.shape[1] * page:
            pid = int(checked_pages(block_table, b, slice(at, at + 1), page, len(K_pages),
                                    name)[0])
            K_pages[pid, :, at % page] = k_new[b]
            V_pages[pid, :, at % page] = v_new[b]
            pos[b] = at
        else:
            pos[b] = -1

    return tile


@T.inline
def copy_element(dst, element, valid, row):
    # copy_a_chunk of ``element``: a buffer's element, or an if_then_else of two (this step's
    # row or the cache's), copied from the one it picks
    if is_op(element, "prim.if_then_else"):
        if element.args[0]:
            copy_a_chunk(dst, T.address_of(element.args[1]), valid, row)
        else:
            copy_a_chunk(dst, T.address_of(element.args[2]), valid, row)
    else:
        copy_a_chunk(dst, T.address_of(element), valid, row)


@T.inline
def load_pages(pages, block_table, b, s, tokens, num_pages, page: int, tx):
    # pages[i] = the id of the chunk's i-th page, checked; a page past the sequence's tokens
    # (at most the table's) is not read (its entry may hold anything) and stays 0, as does a
    # bad id
    per_chunk = T.meta_var(pages.shape[0])
    for i in T.serial((per_chunk + THREADS - 1) // THREADS):
        if i * THREADS + tx < per_chunk:
            slot = T.meta_var(s * per_chunk + i * THREADS + tx)
            pages[i * THREADS + tx] = 0
            if slot * page < tokens:
                if input_check(block_table[b, slot], num_pages) == 1:
                    pages[i * THREADS + tx] = block_table[b, slot]
    T.cuda.cta_sync()


@T.meta_class
class HeadOutputs:
    """The ``Gb x lanes`` 16-byte output vectors of a head block over the CTA's threads: in
    round r thread tx takes vector ``r*128 + tx``, head ``// lanes``, dims ``8 (% lanes) ..``;
    one round at Qwen3's 8 heads of 128 dims."""

    def __init__(self, heads: AttentionHeads, tx, task_heads: int | None = None):
        self.lanes = heads.lanes
        self.count = (heads.block if task_heads is None else task_heads) * heads.lanes
        self.rounds = (self.count + THREADS - 1) // THREADS
        self.tx = tx

    def vector(self, r):
        return r * THREADS + self.tx

    def head(self, r):
        return self.vector(r) // self.lanes

    def col(self, r):
        return self.vector(r) % self.lanes * VEC

    def first_lane(self, r):
        """Whether round r's vector is the first of its head."""
        return self.vector(r) % self.lanes == 0

    def inside(self, r):
        """Whether round r of this thread has a vector (Python True where every one does)."""
        return self.count % THREADS == 0 or self.vector(r) < self.count


@T.meta_class
class MergeThreads(HeadOutputs):
    """A merge task's threads over its ``task_heads x lanes`` output vectors: in rounds of
    128 vectors where they fill the CTA (``HeadOutputs``), else one vector a thread in
    ``groups`` groups, group k taking splits k, k + groups, ..., so that a task of few heads
    still keeps every thread's loads in flight (the groups' sums meet in shared memory)."""

    def __init__(self, heads: AttentionHeads, task_heads: int, tx):
        super().__init__(heads, tx, task_heads)
        self.groups = max(1, THREADS // self.count)

    def vector(self, r):
        return super().vector(r) if self.groups == 1 else self.tx % self.count

    def group(self):
        return self.tx // self.count

    def inside(self, r):
        if self.groups == 1:
            return super().inside(r)
        return self.count * self.groups == THREADS or self.tx < self.count * self.groups

    def splits(self, S):
        """How many of the S splits this thread's group takes."""
        return S if self.groups == 1 else (S - self.group() + self.groups - 1) // self.groups

    def split(self, i):
        """The group's i-th split."""
        return i if self.groups == 1 else self.group() + i * self.groups


@T.inline
def write_empty_split(O_part, lse, b, h, s, outs, tx):
    # a chunk with no token: O_part = 0 and lse = -inf, a merge weight of exactly 0
    for r in T.unroll(outs.rounds):
        if outs.inside(r):
            for half in T.unroll(2):
                for e in T.vectorized(VEC // 2):
                    O_part[b, h, s, outs.head(r), outs.col(r) + half * (VEC // 2) + e] = \
                        T.float32(0)
    if tx < lse.shape[3]:
        lse[b, h, s, tx] = T.float32(NEG_INF)


@T.inline
def chunk_max(red, scores, g, count, lane):
    # red[0] = the largest of head g's first count scores, in every lane of the warp
    red[0] = T.float32(NEG_INF)
    for j in T.serial(scores.shape[1] // 32):
        if j * 32 + lane < count:
            red[0] = T.max(red[0], scores[g, j * 32 + lane])
    red[0] = T.cuda.warp_max(red[0])


def split_reference(b, h, s, q, kv_rows, length: int, O_part, lse, chunk: int,
                    heads: AttentionHeads, engine: str = "fma", sub: int | None = None):
    """A split task in NumPy over the first ``length`` tokens of sequence b: ``kv_rows(rows)``
    gives the K and V rows of the task's KV head; "fma" scales q before its dots and runs one
    softmax over slices of ``sub`` tokens; "mma" scales the dots, gives each of the 4 warps
    its quarter of every slice, rounds P to bf16 against the warp's running maximum and
    merges the warps' parts, as the tiles do."""
    rows = slice(s * chunk, min((s + 1) * chunk, length))
    if rows.start >= length:
        O_part[b, h, s] = 0
        lse[b, h, s] = NEG_INF
        return
    K, V = (r.astype(np.float32) for r in kv_rows(rows))
    qs = q[b, h * heads.block:(h + 1) * heads.block].astype(np.float32)
    scale = np.float32(heads.scale_log2)
    x = (qs @ K.T) * scale if engine == "mma" else (qs * scale) @ K.T  # (Gb, tokens)
    sub = chunk if sub is None else sub
    n = x.shape[1]
    # the token spans each softmax takes, slice by slice: one over whole slices ("fma"), or
    # one a warp over its quarters ("mma"); one part's merge is exact (weight exp2(0) = 1)
    span, spans = (sub // WARPS, WARPS) if engine == "mma" else (sub, 1)
    parts = [online_softmax(x, V, [slice(t + w * span, min(t + (w + 1) * span, n))
                                   for t in range(0, n, sub)], round_p=engine == "mma")
             for w in range(spans)]
    top = np.max([m for m, _, _ in parts], axis=0)
    weights = [np.exp2(m - top) for m, _, _ in parts]
    total = sum(w * t for w, (_, t, _) in zip(weights, parts))
    acc = sum(w[:, None] * a for w, (_, _, a) in zip(weights, parts))
    O_part[b, h, s] = acc / total[:, None]
    lse[b, h, s] = top + np.log2(total)


def online_softmax(x, V, slices, round_p: bool):
    """(running max, sum, unnormalised O) of scores ``x`` (heads x tokens) over the token
    ``slices`` in turn, P rounded to bf16 with ``round_p``; a head with no token yet keeps
    max -inf and weighs nothing."""
    m = np.full(len(x), NEG_INF, np.float32)
    total = np.zeros(len(x), np.float32)
    acc = np.zeros((len(x), V.shape[1]), np.float32)
    for t in slices:
        if t.stop <= t.start:
            continue
        m_new = np.maximum(m, x[:, t].max(axis=1))
        rescale = np.exp2(m - m_new)
        p = np.exp2(x[:, t] - m_new[:, None])
        if round_p:
            p = p.astype(BF16).astype(np.float32)
        total = total * rescale + p.sum(axis=1, dtype=np.float32)
        acc = acc * rescale[:, None] + p @ V[t]
        m = m_new
    return m, total, acc


def tokens_of(pos, b: int, capacity: int) -> int:
    """Sequence b's tokens after this step: ``pos[b] + 1`` (0 where it had no room), at most
    ``capacity``."""
    return min(max(int(pos[b]) + 1, 0), capacity)


def split_reference_for(tile: str, chunk: int, heads: AttentionHeads, page: int | None,
                        engine: str = "fma", sub: int | None = None, append: bool = False):
    """The NumPy reference of the split tile ``tile`` (``split_reference``) over its cache:
    contiguous, or paged with its page ids checked (``checked_pages``); with ``append``, this
    step's rows appended as the tile does (``split_device_func``)."""
    per_kv_head = heads.blocks // heads.kv_heads

    def run(b, h, s, q, kv_rows, tokens, O_part, lse):
        split_reference(b, h, s, q, kv_rows, tokens, O_part, lse, chunk, heads, engine, sub)

    def appending(b, h, s, q, k_new, v_new, kv_rows, write_row, at, O_part, lse, pos):
        # at: the row this step appends, -1 for none; the task reads it from k_new and v_new,
        # as the device's does, whichever task of its KV head writes it to the cache
        kvh = heads.kv_head(h)
        if at >= 0 and at // chunk == s and h % per_kv_head == 0:
            write_row(kvh, at)
        if s == 0:
            pos[b] = at

        def with_step(rows):
            K, V = kv_rows(rows)
            if rows.start <= at < rows.stop:  # copies, not the cache's views, take the row
                K, V = K.copy(), V.copy()
                K[at - rows.start], V[at - rows.start] = k_new[b, kvh], v_new[b, kvh]
            return K, V

        run(b, h, s, q, with_step, at + 1, O_part, lse)

    if page is None:
        def contiguous_rows(K_cache, V_cache, b, h):
            kvh = heads.kv_head(h)
            return lambda rows: (K_cache[b, kvh, rows], V_cache[b, kvh, rows])

        if not append:
            def contiguous(b, h, s, q, K_cache, V_cache, pos, O_part, lse):
                run(b, h, s, q, contiguous_rows(K_cache, V_cache, b, h),
                    tokens_of(pos, b, K_cache.shape[2]), O_part, lse)
            return contiguous

        def contiguous_append(b, h, s, q, k_new, v_new, K_cache, V_cache, seq_lens, O_part,
                              lse, pos):
            at = int(seq_lens[b])
            at = at if 0 <= at < K_cache.shape[2] else -1

            def write_row(kvh, at):
                K_cache[b, kvh, at], V_cache[b, kvh, at] = k_new[b, kvh], v_new[b, kvh]

            appending(b, h, s, q, k_new, v_new, contiguous_rows(K_cache, V_cache, b, h),
                      write_row, at, O_part, lse, pos)
        return contiguous_append

    def paged_rows(K_pages, V_pages, block_table, b, h):
        kvh = heads.kv_head(h)

        def kv_rows(rows):
            ids = checked_pages(block_table, b, rows, page, len(K_pages), tile)
            slots = np.arange(rows.start, rows.stop) % page
            return K_pages[ids, kvh, slots], V_pages[ids, kvh, slots]
        return kv_rows

    if not append:
        def paged(b, h, s, q, K_pages, V_pages, block_table, pos, O_part, lse):
            run(b, h, s, q, paged_rows(K_pages, V_pages, block_table, b, h),
                tokens_of(pos, b, block_table.shape[1] * page), O_part, lse)
        return paged

    def paged_append(b, h, s, q, k_new, v_new, K_pages, V_pages, block_table, seq_lens,
                     O_part, lse, pos):
        at, pid = int(seq_lens[b]), -1
        if 0 <= at < block_table.shape[1] * page:
            pid = int(checked_pages(block_table, b, slice(at, at + 1), page, len(K_pages),
                                    tile)[0])
        else:
            at = -1

        def write_row(kvh, at):
            K_pages[pid, kvh, at % page], V_pages[pid, kvh, at % page] = \
                k_new[b, kvh], v_new[b, kvh]

        appending(b, h, s, q, k_new, v_new, paged_rows(K_pages, V_pages, block_table, b, h),
                  write_row, at, O_part, lse, pos)
    return paged_append


def split_device_func(name: str, heads: AttentionHeads, chunk: int, page: int | None,
                      split_task, row_of, engine: str = "fma", sub: int | None = None,
                      append: bool = False) -> DeviceFunc:
    """The split tile ``name`` around its task's body ``split_task(b, h, s, q, K_at, V_at,
    tokens, O_part, lse, tx, warp, lane)``, whose ``K_at(t, k)`` is element k of the chunk's
    token t and ``tokens`` the sequence's: the prim_func's parameters and thread scopes over a
    contiguous cache (token t at row ``row_of(s * chunk + t, L)``) or a paged one (the chunk's
    page ids read once into shared memory, ``load_pages``), the requirement that S chunks
    cover the cache, and the NumPy reference (``split_reference_for``).

    With ``append`` the tile appends this step's rows itself, in place of the append tile
    before it: it takes ``(q, k_new, v_new, <cache>, seq_lens)`` and writes ``pos`` besides
    O_part and lse (every task of split 0: the merge task of each block waits for one). The
    row ``seq_lens[b]`` is written by the task whose chunk holds it, the first block of each
    KV head, and every task of its chunk reads that row from ``k_new`` and ``v_new``
    (``K_at`` an ``if_then_else`` of the two), so no task waits for another's write.
    """
    G, D, Hk = heads.block, heads.head_dim, heads.kv_heads
    per_kv_head = heads.blocks // Hk
    B, L, S = (tirx.Var(d, "int32") for d in "BLS")
    NP, P = tirx.Var("NP", "int32"), tirx.Var("P", "int32")
    # the buffers' shapes in the signatures below
    q_shape, new_shape = (B, heads.q_heads, D), (B, Hk, D)
    cache_shape, pages_shape = (B, Hk, L, D), (P, Hk, page, D)
    part_shape, lse_shape = (B, heads.blocks, S, G, D), (B, heads.blocks, S, G)

    @T.inline
    def append_step(k_new, v_new, b, h, s, K, V, major, row, at, pos, tx):
        # this step's row into the cache by its chunk's task of the KV head's first block;
        # pos[b] = at (-1: no room) by every task of split 0
        if at >= 0 and at // chunk == s and h % per_kv_head == 0:
            write_kv_rows(k_new, v_new, b, K, V, major, row, heads.kv_head(h), 1, tx)
        if s == 0 and tx == 0:
            pos[b] = at

    def with_step(new, b, h, s, at, element):
        # element k of the chunk's token t, which is this step's row (from ``new``) at ``at``
        return lambda t, k: T.if_then_else(s * chunk + t == at, new[b, heads.kv_head(h), k],
                                           element(t, k))

    if page is None:
        def cache_rows(cache, b, h, s, L):
            return lambda t, k: cache[b, heads.kv_head(h), row_of(s * chunk + t, L), k]

        if not append:
            @T.prim_func
            def decode_split(b: T.int32, h: T.int32, s: T.int32,
                             q: T.Buffer(q_shape, "bfloat16"),
                             K_cache: T.Buffer(cache_shape, "bfloat16"),
                             V_cache: T.Buffer(cache_shape, "bfloat16"),
                             pos: T.Buffer((B,), "int32"),
                             O_part: T.Buffer(part_shape, "float32"),
                             lse: T.Buffer(lse_shape, "float32")):
                T.device_entry()
                tx = T.thread_id([THREADS])
                warp = T.warp_id([WARPS])
                lane = T.lane_id([32])
                split_task(b, h, s, q, cache_rows(K_cache, b, h, s, L),
                           cache_rows(V_cache, b, h, s, L), T.min(T.max(pos[b] + 1, 0), L),
                           O_part, lse, tx, warp, lane)
        else:
            @T.prim_func
            def decode_split(b: T.int32, h: T.int32, s: T.int32,
                             q: T.Buffer(q_shape, "bfloat16"),
                             k_new: T.Buffer(new_shape, "bfloat16"),
                             v_new: T.Buffer(new_shape, "bfloat16"),
                             K_cache: T.Buffer(cache_shape, "bfloat16"),
                             V_cache: T.Buffer(cache_shape, "bfloat16"),
                             seq_lens: T.Buffer((B,), "int32"),
                             O_part: T.Buffer(part_shape, "float32"),
                             lse: T.Buffer(lse_shape, "float32"),
                             pos: T.Buffer((B,), "int32")):
                T.device_entry()
                tx = T.thread_id([THREADS])
                warp = T.warp_id([WARPS])
                lane = T.lane_id([32])
                at = T.local_scalar("int32")
                at = seq_lens[b]
                if at < 0 or at >= L:  # no room for this step's row
                    at = -1
                append_step(k_new, v_new, b, h, s, K_cache, V_cache, b, at, at, pos, tx)
                split_task(b, h, s, q,
                           with_step(k_new, b, h, s, at, cache_rows(K_cache, b, h, s, L)),
                           with_step(v_new, b, h, s, at, cache_rows(V_cache, b, h, s, L)),
                           at + 1, O_part, lse, tx, warp, lane)

        capacity, checks, held = L, (), "L"
    else:
        def page_rows(pages_of, cache, h):
            return lambda t, k: cache[pages_of[t // page], heads.kv_head(h), t % page, k]

        if not append:
            @T.prim_func
            def decode_split(b: T.int32, h: T.int32, s: T.int32,
                             q: T.Buffer(q_shape, "bfloat16"),
                             K_pages: T.Buffer(pages_shape, "bfloat16"),
                             V_pages: T.Buffer(pages_shape, "bfloat16"),
                             block_table: T.Buffer((B, NP), "int32"),
                             pos: T.Buffer((B,), "int32"),
                             O_part: T.Buffer(part_shape, "float32"),
                             lse: T.Buffer(lse_shape, "float32")):
                T.device_entry()
                tx = T.thread_id([THREADS])
                warp = T.warp_id([WARPS])
                lane = T.lane_id([32])
                tokens = T.local_scalar("int32")
                tokens = T.min(T.max(pos[b] + 1, 0), NP * page)
                pages = T.alloc_shared((chunk // page,), "int32")
                load_pages(pages, block_table, b, s, tokens, P, page, tx)
                split_task(b, h, s, q, page_rows(pages, K_pages, h),
                           page_rows(pages, V_pages, h), tokens, O_part, lse, tx, warp, lane)
        else:
            @T.prim_func
            def decode_split(b: T.int32, h: T.int32, s: T.int32,
                             q: T.Buffer(q_shape, "bfloat16"),
                             k_new: T.Buffer(new_shape, "bfloat16"),
                             v_new: T.Buffer(new_shape, "bfloat16"),
                             K_pages: T.Buffer(pages_shape, "bfloat16"),
                             V_pages: T.Buffer(pages_shape, "bfloat16"),
                             block_table: T.Buffer((B, NP), "int32"),
                             seq_lens: T.Buffer((B,), "int32"),
                             O_part: T.Buffer(part_shape, "float32"),
                             lse: T.Buffer(lse_shape, "float32"),
                             pos: T.Buffer((B,), "int32")):
                T.device_entry()
                tx = T.thread_id([THREADS])
                warp = T.warp_id([WARPS])
                lane = T.lane_id([32])
                at = T.local_scalar("int32")
                pid = T.local_scalar("int32")
                at = seq_lens[b]
                pid = -1  # no room: a length past the table's pages, or a bad id (reported)
                if at >= 0 and at < NP * page:
                    pid = block_table[b, at // page]
                    if input_check(pid, P) == 0:
                        pid = -1
                if pid < 0:
                    at = -1
                pages = T.alloc_shared((chunk // page,), "int32")
                load_pages(pages, block_table, b, s, at + 1, P, page, tx)
                append_step(k_new, v_new, b, h, s, K_pages, V_pages, pid, at % page, at, pos, tx)
                split_task(b, h, s, q,
                           with_step(k_new, b, h, s, at, page_rows(pages, K_pages, h)),
                           with_step(v_new, b, h, s, at, page_rows(pages, V_pages, h)),
                           at + 1, O_part, lse, tx, warp, lane)

        capacity, checks, held = NP * page, (PAGE_CHECK,), f"NP x {page}"

    caches = ("K_cache", "V_cache") if page is None else ("K_pages", "V_pages")
    tile = device_func(decode_split.with_attr("global_symbol", name),
                       cost=chunk * D / (64 * 128), checks=checks,
                       updates=caches if append else (),
                       requires=[(capacity <= S * chunk, f"{held} at most S x {chunk}")])
    tile.set_reference(split_reference_for(name, chunk, heads, page, engine, sub, append))
    return tile


@functools.cache
def make_decode_split_tile(chunk: int = 256, unroll: int = 4,
                           heads: AttentionHeads = QWEN3_30B_A3B,
                           page: int | None = None) -> DeviceFunc:
    """The tile ``decode_split_<heads>_c<chunk>``: task (b, h, s), the partial attention of
    query-head block h over the s-th chunk of sequence b's ``pos[b] + 1`` tokens.

    ``unroll``: rows a thread loads a step; the next step's are in flight while they are used.
    ``page``: the cache is paged (``_p<page>``; see "Paged caches" in the module docstring),
    ``chunk`` a multiple of it.
    """
    G, D, lanes, row_groups = heads.block, heads.head_dim, heads.lanes, heads.row_groups
    if G > MAX_BLOCK:
        raise EtcError(f"decode split tile: blocks of {G} query heads ({heads}); on CUDA cores "
                       f"a task keeps at most {MAX_BLOCK} heads in registers: "
                       f"make_decode_split_mma_tile takes up to 16")
    if chunk < 1 or chunk % (row_groups * unroll) or chunk % 32:
        raise EtcError(f"decode split tile: chunk must be a multiple of {row_groups} x unroll "
                       f"(the rows {THREADS} threads load at once at head_dim {D}) and of 32, "
                       f"got chunk={chunk}, unroll={unroll}")
    check_page(page, chunk)
    steps = chunk // row_groups // unroll
    padded = 1 << (G - 1).bit_length()  # dots a lane reduces, zeros past the block's heads
    share = lanes // padded  # lanes that end with the same head's score
    heads_per_warp = (G + WARPS - 1) // WARPS
    every_warp_full = G % WARPS == 0
    shuffles = int(math.log2(32 // lanes))  # row groups of a warp, summed by xor shuffles
    scale = heads.scale_log2

    @T.inline
    def load_rows(kv, buf, rows, it, rg, col, count):
        # step it's ``unroll`` rows of this row group into buffer buf, one 16-byte load each;
        # rows past count stay unread
        for u in T.unroll(unroll):
            if (it * unroll + u) * row_groups + rg < count:
                for e in T.vectorized(VEC):
                    kv[buf, u, e] = rows((it * unroll + u) * row_groups + rg, col + e)

    @T.inline
    def stream_rows(kv, rows, rg, col, count, use_rows):
        # the steps' rows through two buffers: step it + 1's loads are in flight while step
        # it's rows are used; step 0's are loaded by the caller, ahead
        for it2 in T.serial((steps + 1) // 2):
            if 2 * it2 + 1 < steps:
                load_rows(kv, 1, rows, 2 * it2 + 1, rg, col, count)
            use_rows(0, 2 * it2)
            if 2 * it2 + 2 < steps:
                load_rows(kv, 0, rows, 2 * it2 + 2, rg, col, count)
            if 2 * it2 + 1 < steps:
                use_rows(1, 2 * it2 + 1)

    @T.inline
    def scatter_sum(dot, c):
        # halve the dots a lane holds at each xor step, keeping the half its lane bit names
        # and adding the partner's: log2(padded) steps leave lane c the row's head c // share
        # summed over padded of the row's lanes, log2(share) more sum the rest (one shuffle a
        # value and step, padded - 1 + log2(share) in all, where a sum of each head over all
        # lanes takes G log2(lanes))
        for k in T.unroll(padded.bit_length() - 1):
            for i in T.unroll(padded // 2):
                if i < (padded // 2 >> k):
                    upper = T.meta_var(T.bitwise_and(c, lanes // 2 >> k) != 0)
                    dot[i] = T.if_then_else(upper, dot[i + (padded // 2 >> k)], dot[i]) \
                        + T.tvm_warp_shuffle_xor(
                            T.uint32(0xFFFFFFFF),
                            T.if_then_else(upper, dot[i], dot[i + (padded // 2 >> k)]),
                            lanes // 2 >> k, 32, 32)
        for k in T.unroll(share.bit_length() - 1):
            dot[0] = dot[0] + T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), dot[0],
                                                     share // 2 >> k, 32, 32)

    @T.inline
    def split_task(b, h, s, q, K_rows, V_rows, tokens, O_part, lse, tx, warp, lane):
        # K_rows(t, c), V_rows: element c of the chunk's token t; tokens: the sequence's
        scores = T.alloc_shared((G, chunk), "float32")
        partial = T.alloc_shared((WARPS, G, D), "float32")
        stats = T.alloc_shared((2, G), "float32")  # per head: max, sum
        qr = T.alloc_local((G, VEC), "float32")
        qv = T.alloc_local((VEC,), "bfloat16")
        kv = T.alloc_local((2, unroll, VEC), "bfloat16")
        dot = T.alloc_local((padded,), "float32")
        acc = T.alloc_local((G, VEC), "float32")
        red = T.alloc_local((2,), "float32")
        count = T.local_scalar("int32")
        outs = HeadOutputs(heads, tx)
        rg = T.meta_var(tx // lanes)
        c = T.meta_var(tx % lanes)
        col = T.meta_var(tx % lanes * VEC)
        start = T.meta_var(s * chunk)
        count = T.min(tokens - start, chunk)  # tokens of this chunk
        if count <= 0:
            write_empty_split(O_part, lse, b, h, s, outs, tx)
        else:
            for g in T.unroll(G):
                for e in T.vectorized(VEC):
                    qv[e] = q[b, h * G + g, col + e]
                for e in T.unroll(VEC):
                    qr[g, e] = T.Cast("float32", qv[e]) * T.float32(scale)
            # scores = q . k for the block's heads; each K element loaded once serves them all
            @T.inline
            def score_rows(buf, it):
                for u in T.unroll(unroll):
                    for g in T.unroll(padded):
                        dot[g] = T.float32(0)
                        if g < G:
                            for e in T.unroll(VEC):
                                dot[g] = dot[g] + qr[g, e] * T.Cast("float32", kv[buf, u, e])
                    scatter_sum(dot, c)
                    if (it * unroll + u) * row_groups + rg < count and c % share == 0 \
                            and c // share < G:
                        scores[c // share, (it * unroll + u) * row_groups + rg] = dot[0]

            load_rows(kv, 0, K_rows, 0, rg, col, count)
            stream_rows(kv, K_rows, rg, col, count, score_rows)
            load_rows(kv, 0, V_rows, 0, rg, col, count)  # in flight over the softmax
            T.cuda.cta_sync()
            # softmax statistics of the chunk, a warp's heads_per_warp heads
            for k in T.unroll(heads_per_warp):
                g = T.meta_var(warp * heads_per_warp + k)
                if every_warp_full or g < G:
                    chunk_max(red, scores, g, count, lane)
                    red[1] = T.float32(0)
                    for j in T.serial(chunk // 32):
                        if j * 32 + lane < count:
                            scores[g, j * 32 + lane] = T.exp2(scores[g, j * 32 + lane] - red[0])
                            red[1] = red[1] + scores[g, j * 32 + lane]
                    red[1] = T.cuda.warp_sum(red[1])
                    if lane == 0:
                        stats[0, g] = red[0]
                        stats[1, g] = red[1]
            T.cuda.cta_sync()
            # acc = p @ v over this thread's rows and dims
            for g in T.unroll(G):
                for e in T.unroll(VEC):
                    acc[g, e] = T.float32(0)
            @T.inline
            def accumulate_rows(buf, it):
                for u in T.unroll(unroll):
                    if (it * unroll + u) * row_groups + rg < count:
                        for g in T.unroll(G):
                            for e in T.unroll(VEC):
                                acc[g, e] = acc[g, e] + scores[
                                    g, (it * unroll + u) * row_groups + rg] * T.Cast(
                                    "float32", kv[buf, u, e])

            stream_rows(kv, V_rows, rg, col, count, accumulate_rows)
            # the row groups of a warp, then the warps through shared memory
            for j in T.unroll(shuffles):
                for g in T.unroll(G):
                    for e in T.unroll(VEC):
                        acc[g, e] = acc[g, e] + T.tvm_warp_shuffle_xor(
                            T.uint32(0xFFFFFFFF), acc[g, e], lanes << j, 32, 32)
            if lane < lanes:
                for g in T.unroll(G):
                    for half in T.unroll(2):
                        for e in T.vectorized(VEC // 2):
                            partial[warp, g, col + half * (VEC // 2) + e] = \
                                acc[g, half * (VEC // 2) + e]
            T.cuda.cta_sync()
            for r in T.unroll(outs.rounds):
                if outs.inside(r):
                    for e in T.unroll(VEC):
                        acc[0, e] = partial[0, outs.head(r), outs.col(r) + e]
                        for w in T.unroll(WARPS - 1):
                            acc[0, e] = acc[0, e] + partial[w + 1, outs.head(r), outs.col(r) + e]
                    for half in T.unroll(2):
                        for e in T.vectorized(VEC // 2):
                            O_part[b, h, s, outs.head(r), outs.col(r) + half * (VEC // 2) + e] \
                                = acc[0, half * (VEC // 2) + e] / stats[1, outs.head(r)]
                    if outs.first_lane(r):
                        lse[b, h, s, outs.head(r)] = stats[0, outs.head(r)] + T.log2(
                            stats[1, outs.head(r)])

    name = f"decode_split_{heads.suffix}_c{chunk}" + ("" if page is None else f"_p{page}")
    return split_device_func(name, heads, chunk, page, split_task, lambda row, L: row)


@functools.cache
def make_decode_split_mma_tile(chunk: int = 128, heads: AttentionHeads = QWEN3_30B_A3B,
                               sub: int | None = None, stages: int = 2,
                               page: int | None = None, append: bool = False) -> DeviceFunc:
    """The tile ``decode_split_mma_<heads>_c<chunk>[_s<sub>x<stages>][_p<page>][_append]``:
    the split tile's task (b, h, s) on tensor cores (``mma.sync.m16n8k16``; the same inputs
    and outputs as ``make_decode_split_tile``, over a contiguous or, with ``page``, a paged
    cache). With ``append`` it appends this step's K and V rows itself, so that no append
    tile runs before it: ``(q, k_new, v_new, <cache>, seq_lens) -> (O_part, lse, pos)``, the
    cache updated as the append tile does (``split_device_func``).

    The chunk streams through shared memory in slices of ``sub`` tokens (the whole chunk
    where ``sub`` is None), ``stages`` slices in flight by cp.async (rows past the tokens land
    as zeros). Each of the 4 warps takes its own quarter of every slice, copies it, and keeps
    its own running max, sum and O, flash-decoding inside the task: a slice waits on the
    warp's own copies and needs no barrier of the CTA, so a warp that is done with a stage
    refills it at once. The block's heads, padded to 16 with zeros, are the m16 rows, so a
    task may take up to 16 (``AttentionHeads(max_block=16)``). A warp's slice::

        S (16 x sub/4) = q @ K rows^T        scaled by log2(e) / sqrt(D)
        per head m' = max(m, the slice's max), a = exp2(m - m')
        P = bf16(exp2(S - m')), l = a l + the fp32 sum of P's bf16 values
        O (16 x D) = a O + P @ V rows

    and at the task's end the warps' (m, l, O) meet in shared memory: M = max m, O = sum
    exp2(m - M) O / sum exp2(m - M) l. P is rounded to bf16 for the MMA, and l sums the
    rounded values, so the output is an exact mean of V under weights off by at most 2**-8
    (``error_bound(engine="mma")``); O and l are rescaled by the same factors, so their ex2
    errors move the lse only.
    """
    G, D = heads.block, heads.head_dim
    sub = chunk if sub is None else sub
    if chunk < 1 or sub < 1 or sub % (16 * WARPS) or chunk % sub or stages < 1:
        raise EtcError(f"decode split tile on tensor cores: slices of sub ({sub}) tokens must "
                       f"divide the chunk ({chunk}) and be a multiple of {16 * WARPS} (k16 "
                       f"blocks of tokens for each of the {WARPS} warps); stages ({stages}) at "
                       f"least 1")
    check_page(page, chunk)
    stages = min(stages, chunk // sub)
    row_chunks = D // VEC  # 16-byte copies a K or V row
    rows = sub // WARPS  # tokens a warp takes of each slice
    token_blocks = rows // 16  # k16 blocks of a warp's tokens, each two n8 blocks of S
    col_blocks = D // 8  # n8 blocks of O's columns
    streams = chunk > stages * sub  # slices loaded inside the loop, not all up front
    scale = heads.scale_log2

    @T.inline
    def load_rows(rows_smem, row, count, j, warp, lane):
        # the warp's rows of slice j into stage j % stages, 16 bytes a copy (row(t, k):
        # element k of the chunk's token t); a row past count reads nothing and lands as
        # zeros; always one commit group, empty past the last slice
        if j * sub < count:
            for i in T.unroll(rows * row_chunks // 32):
                r = T.meta_var(warp * rows + (i * 32 + lane) // row_chunks)
                k = T.meta_var((i * 32 + lane) % row_chunks * VEC)
                copy_element(rows_smem.ptr_to([j % stages, r, k]), row(j * sub + r, k),
                             lambda t: j * sub + t < count, r)
        T.ptx.cp.async_.commit_group()

    @T.inline
    def split_task(b, h, s, q, K_row, V_row, tokens, O_part, lse, tx, warp, lane):
        # K_row(t, k), V_row: element k of the chunk's token t; tokens: the sequence's
        Ks = T.alloc_shared((stages, sub, D + PAD), "bfloat16")
        Vs = T.alloc_shared((stages, sub, D + PAD), "bfloat16")
        Qs = T.alloc_shared((16, D + PAD), "bfloat16")  # q, heads past the block zero
        Ps = T.alloc_shared((WARPS, 16, rows + PAD), "bfloat16")  # each warp's P of a slice
        Os = T.alloc_shared((WARPS, G, D + 4), "float32")  # each warp's O at the end
        stats = T.alloc_shared((2, WARPS, 16), "float32")  # each warp's max and sum a head
        q_frag = T.alloc_local((D // 16, 4), "uint32")
        a_frag = T.alloc_local((4,), "uint32")
        b_frag = T.alloc_local((4,), "uint32")
        st = T.alloc_local((2 * token_blocks, 4), "float32")
        acc = T.alloc_local((col_blocks, 4), "float32")
        m = T.alloc_local((2,), "float32")  # running max of heads lane // 4 and + 8
        total = T.alloc_local((2,), "float32")  # this lane's part of their sums
        red = T.alloc_local((4,), "float32")  # the slice's max, then its base; the rescale
        part = T.alloc_local((WARPS,), "float32")  # at the end: each warp's weight
        o4 = T.alloc_local((VEC // 2,), "float32")
        pb = T.local_scalar("bfloat16")
        count = T.local_scalar("int32")
        outs = HeadOutputs(heads, tx)
        count = T.min(tokens - s * chunk, chunk)  # tokens of this chunk
        if count <= 0:
            write_empty_split(O_part, lse, b, h, s, outs, tx)
        else:
            for j in T.unroll(stages):  # K then V of each slice: S waits for K alone
                load_rows(Ks, K_row, count, j, warp, lane)
                load_rows(Vs, V_row, count, j, warp, lane)
            for i in T.serial((16 * D + THREADS - 1) // THREADS):
                if i * THREADS + tx < 16 * D:
                    g = T.meta_var((i * THREADS + tx) // D)
                    d = T.meta_var((i * THREADS + tx) % D)
                    Qs[g, d] = T.if_then_else(g < G, q[b, h * G + T.min(g, G - 1), d],
                                              T.bfloat16(0))
            for e in T.unroll(2):
                m[e] = T.float32(NEG_INF)
                total[e] = T.float32(0)
            for n in T.unroll(col_blocks):
                for e in T.unroll(4):
                    acc[n, e] = T.float32(0)
            T.cuda.cta_sync()
            # q as the A operand of every k16 step
            for kk in T.unroll(D // 16):
                T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                    q_frag[kk, 0], q_frag[kk, 1], q_frag[kk, 2], q_frag[kk, 3],
                    Qs.ptr_to([lane % 16, kk * 16 + lane // 16 * 8]))
            for j in T.serial((count + sub - 1) // sub):
                T.ptx.cp.async_.wait_group(2 * stages - 1)  # slice j's K
                T.cuda.warp_sync()
                # S = q @ K rows^T; lane holds heads lane // 4 (registers 0, 1) and + 8
                # (2, 3), tokens 2 (lane % 4) and + 1 of each n8 block of the warp's rows
                for n in T.unroll(2 * token_blocks):
                    for e in T.unroll(4):
                        st[n, e] = T.float32(0)
                for kk in T.unroll(D // 16):
                    for tb in T.unroll(token_blocks):
                        T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                            b_frag[0], b_frag[1], b_frag[2], b_frag[3],
                            Ks.ptr_to([j % stages, warp * rows + tb * 16 + lane // 16 * 8
                                       + lane % 8, kk * 16 + lane // 8 % 2 * 8]))
                        for n in T.unroll(2):
                            T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                                st[2 * tb + n, 0], st[2 * tb + n, 1], st[2 * tb + n, 2],
                                st[2 * tb + n, 3], q_frag[kk, 0], q_frag[kk, 1],
                                q_frag[kk, 2], q_frag[kk, 3], b_frag[2 * n],
                                b_frag[2 * n + 1], st[2 * tb + n, 0], st[2 * tb + n, 1],
                                st[2 * tb + n, 2], st[2 * tb + n, 3])
                # scores, tokens past count at -inf; each head's max over the warp's slice
                for e in T.unroll(2):
                    red[e] = T.float32(NEG_INF)
                for n in T.unroll(2 * token_blocks):
                    for e in T.unroll(4):
                        st[n, e] = T.if_then_else(
                            j * sub + warp * rows + n * 8 + lane % 4 * 2 + e % 2 < count,
                            st[n, e] * T.float32(scale), T.float32(NEG_INF))
                        red[e // 2] = T.max(red[e // 2], st[n, e])
                for e in T.unroll(2):
                    red[e] = T.max(m[e], T.cuda.warp_max(red[e], 4))
                    # a head the warp has seen no token of yet: P and the rescale are 0
                    red[2 + e] = T.exp2(m[e] - T.if_then_else(red[e] == T.float32(NEG_INF),
                                                              T.float32(0), red[e]))
                    m[e] = red[e]
                    red[e] = T.if_then_else(red[e] == T.float32(NEG_INF), T.float32(0),
                                            red[e])
                    total[e] = total[e] * red[2 + e]
                for n in T.unroll(2 * token_blocks):
                    for e in T.unroll(4):
                        pb = T.Cast("bfloat16", T.exp2(st[n, e] - red[e // 2]))
                        Ps[warp, e // 2 * 8 + lane // 4, n * 8 + lane % 4 * 2 + e % 2] = pb
                        total[e // 2] = total[e // 2] + T.Cast("float32", pb)
                for n in T.unroll(col_blocks):
                    for e in T.unroll(4):
                        acc[n, e] = acc[n, e] * red[2 + e // 2]
                T.ptx.cp.async_.wait_group(2 * stages - 2)  # slice j's V
                T.cuda.warp_sync()
                # O += P @ V rows; lane holds heads lane // 4 and + 8, columns 2 (lane % 4)
                # and + 1 of each n8 block
                for tb in T.unroll(token_blocks):
                    T.ptx.ldmatrix.sync.aligned.m8n8.x4.shared.b16(
                        a_frag[0], a_frag[1], a_frag[2], a_frag[3],
                        Ps.ptr_to([warp, lane % 16, tb * 16 + lane // 16 * 8]))
                    for n2 in T.unroll(col_blocks // 2):
                        T.ptx.ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16(
                            b_frag[0], b_frag[1], b_frag[2], b_frag[3],
                            Vs.ptr_to([j % stages, warp * rows + tb * 16 + lane % 16,
                                       n2 * 16 + lane // 16 * 8]))
                        for n in T.unroll(2):
                            T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(
                                acc[2 * n2 + n, 0], acc[2 * n2 + n, 1], acc[2 * n2 + n, 2],
                                acc[2 * n2 + n, 3], a_frag[0], a_frag[1], a_frag[2],
                                a_frag[3], b_frag[2 * n], b_frag[2 * n + 1],
                                acc[2 * n2 + n, 0], acc[2 * n2 + n, 1], acc[2 * n2 + n, 2],
                                acc[2 * n2 + n, 3])
                T.cuda.warp_sync()  # the warp is done with the stage and with P
                if streams:  # slice j + stages into the stage slice j leaves
                    load_rows(Ks, K_row, count, j + stages, warp, lane)
                    load_rows(Vs, V_row, count, j + stages, warp, lane)
                elif stages > 1:  # two empty groups, so that the waits above count slice
                    T.ptx.cp.async_.commit_group()  # j + 1's copies among the last four
                    T.ptx.cp.async_.commit_group()
            # the warps' parts meet: each warp's max and sum a head, and its O
            for e in T.unroll(2):
                total[e] = T.cuda.warp_sum(total[e], 4)
                if lane % 4 == 0:
                    stats[0, warp, e * 8 + lane // 4] = m[e]
                    stats[1, warp, e * 8 + lane // 4] = total[e]
                if e * 8 + lane // 4 < G:
                    for n in T.unroll(col_blocks):
                        for v in T.vectorized(2):
                            Os[warp, e * 8 + lane // 4, n * 8 + lane % 4 * 2 + v] = \
                                acc[n, 2 * e + v]
            T.cuda.cta_sync()
            for r in T.unroll(outs.rounds):
                if outs.inside(r):
                    g = T.meta_var(outs.head(r))
                    red[0] = stats[0, 0, g]
                    for w in T.unroll(1, WARPS):
                        red[0] = T.max(red[0], stats[0, w, g])
                    red[1] = T.float32(0)
                    for w in T.unroll(WARPS):  # a warp without a token weighs exp2(-inf) = 0
                        part[w] = T.exp2(stats[0, w, g] - red[0])
                        red[1] = red[1] + stats[1, w, g] * part[w]
                    for half in T.unroll(2):
                        for e in T.unroll(VEC // 2):
                            o4[e] = T.float32(0)
                        for w in T.unroll(WARPS):
                            for e in T.unroll(VEC // 2):
                                o4[e] = o4[e] + Os[w, g, outs.col(r) + half * (VEC // 2) + e] \
                                    * part[w]
                        for e in T.vectorized(VEC // 2):
                            O_part[b, h, s, g, outs.col(r) + half * (VEC // 2) + e] = \
                                o4[e] / red[1]
                    if outs.first_lane(r):
                        lse[b, h, s, g] = red[0] + T.log2(red[1])

    name = f"decode_split_mma_{heads.suffix}_c{chunk}" \
        + ("" if sub == chunk else f"_s{sub}x{stages}") + ("" if page is None else f"_p{page}") \
        + ("_append" if append else "")
    # a row past the cache is copied from nowhere, but its address must be one
    return split_device_func(name, heads, chunk, page, split_task,
                             lambda row, L: T.min(row, L - 1), engine="mma", sub=sub,
                             append=append)


@T.inline
def store_mean(out, b, head, col, acc, total, pos, res):
    # out[b, head, col .. col + 7] = acc / total as bf16; NaN for a sequence without room
    for e in T.unroll(VEC):
        res[e] = T.Cast("bfloat16", T.if_then_else(pos[b] >= 0, acc[e] / total,
                                                  T.float32(float("nan"))))
    for e in T.vectorized(VEC):
        out[b, head, col + e] = res[e]


@functools.cache
def make_decode_merge_tile(heads: AttentionHeads = QWEN3_30B_A3B, parts: int = 1) -> DeviceFunc:
    """The tile ``decode_merge_<heads>`` (``_m<parts>`` where ``parts`` > 1): task (b, t)
    rescales the splits of query-head block ``t // parts`` by ``exp2(lse_s - max lse)`` and
    writes their normalised sum as bf16, for the ``Gb / parts`` heads of part ``t % parts``.
    Parts spread a block's partials over more CTAs, which a few long sequences need: one
    task reading a block's S splits alone runs at its SM's pace (5.8 us for 64 splits of 8
    heads on an H100). A thread owns one head's 8 dims (``MergeThreads``: two 16-byte fp32
    loads per split, one bf16 store); the threads that a part's heads leave over take
    shares of the splits."""
    G, D = heads.block, heads.head_dim
    if parts < 1 or G % parts:
        raise EtcError(f"decode merge: parts ({parts}) must divide the {G} query heads of a "
                       f"block ({heads})")
    Gp = G // parts
    B, S = tirx.Var("B", "int32"), tirx.Var("S", "int32")

    @T.prim_func
    def decode_merge(b: T.int32, t: T.int32,
                     O_part: T.Buffer((B, heads.blocks, S, G, D), "float32"),
                     lse: T.Buffer((B, heads.blocks, S, G), "float32"),
                     pos: T.Buffer((B,), "int32"),
                     out: T.Buffer((B, heads.q_heads, D), "bfloat16")):
        T.device_entry()
        tx = T.thread_id([THREADS])
        acc = T.alloc_local((VEC,), "float32")
        part = T.alloc_local((VEC,), "float32")
        res = T.alloc_local((VEC,), "bfloat16")
        top = T.local_scalar("float32")
        weight = T.local_scalar("float32")
        total = T.local_scalar("float32")
        h = T.meta_var(t if parts == 1 else t // parts)
        first = T.meta_var(0 if parts == 1 else t % parts * Gp)
        threads = MergeThreads(heads, Gp, tx)
        if threads.groups > 1:
            sums = T.alloc_shared((threads.groups, threads.count, VEC + 2), "float32")
        for r in T.unroll(threads.rounds):
            if threads.inside(r):
                g = T.meta_var(first + threads.head(r))
                col = T.meta_var(threads.col(r))
                top = T.float32(NEG_INF)
                for i in T.serial(threads.splits(S)):
                    top = T.max(top, lse[b, h, threads.split(i), g])
                total = T.float32(0)
                for e in T.unroll(VEC):
                    acc[e] = T.float32(0)
                for i in T.serial(threads.splits(S)):
                    s = T.meta_var(threads.split(i))
                    weight = T.exp2(lse[b, h, s, g] - top)  # 0 for an empty split (lse = -inf)
                    total = total + weight
                    for e in T.vectorized(VEC // 2):
                        part[e] = O_part[b, h, s, g, col + e]
                    for e in T.vectorized(VEC // 2):
                        part[VEC // 2 + e] = O_part[b, h, s, g, col + VEC // 2 + e]
                    for e in T.unroll(VEC):
                        acc[e] = acc[e] + weight * part[e]
                if threads.groups == 1:
                    store_mean(out, b, h * G + g, col, acc, total, pos, res)
                else:
                    # a group whose splits are all empty (or none) has top = -inf: weight 0
                    v = T.meta_var(threads.vector(r))
                    k = T.meta_var(threads.group())
                    sums[k, v, 0] = top
                    sums[k, v, 1] = T.if_then_else(top > T.float32(NEG_INF), total,
                                                   T.float32(0))
                    for e in T.unroll(VEC):
                        sums[k, v, 2 + e] = T.if_then_else(top > T.float32(NEG_INF), acc[e],
                                                           T.float32(0))
        if threads.groups > 1:
            T.cuda.cta_sync()
            if tx < threads.count:
                top = sums[0, tx, 0]
                for k in T.unroll(1, threads.groups):
                    top = T.max(top, sums[k, tx, 0])
                total = T.float32(0)
                for e in T.unroll(VEC):
                    acc[e] = T.float32(0)
                for k in T.unroll(threads.groups):
                    weight = T.if_then_else(sums[k, tx, 0] > T.float32(NEG_INF),
                                            T.exp2(sums[k, tx, 0] - top), T.float32(0))
                    total = total + weight * sums[k, tx, 1]
                    for e in T.unroll(VEC):
                        acc[e] = acc[e] + weight * sums[k, tx, 2 + e]
                store_mean(out, b, h * G + first + threads.head(0), threads.col(0), acc, total,
                           pos, res)

    name = f"decode_merge_{heads.suffix}" + ("" if parts == 1 else f"_m{parts}")
    tile = device_func(decode_merge.with_attr("global_symbol", name))

    @tile.set_reference
    def _(b, t, O_part, lse, pos, out):
        h, p = divmod(t, parts)
        in_block = slice(p * Gp, (p + 1) * Gp)
        heads_out = slice(h * G + p * Gp, h * G + (p + 1) * Gp)
        if pos[b] < 0:
            out[b, heads_out] = np.nan
            return
        weight = np.exp2(lse[b, h, :, in_block] - lse[b, h, :, in_block].max(axis=0))  # (S, Gp)
        total = weight.sum(axis=0, dtype=np.float32)
        value = np.einsum("sg,sgd->gd", weight, O_part[b, h, :, in_block]) / total[:, None]
        out[b, heads_out] = value.astype(out.dtype)

    return tile


def cache_with_step(k_new, v_new, K_cache, V_cache, seq_lens):
    """The caches after this step's append (copies; an out-of-range length changes nothing)."""
    K, V = K_cache.copy(), V_cache.copy()
    for b, at in enumerate(seq_lens):
        if 0 <= at < K.shape[2]:
            K[b, :, at], V[b, :, at] = k_new[b], v_new[b]
    return K, V


def attention_float64(q, k_new, v_new, K_cache, V_cache, seq_lens):
    """Decode attention in float64 with this step's token appended: ``(out, A, x)`` with
    ``out`` (B, Hq, D), the weighted mean ``A`` of |v| (B, Hq, D) and, per head, the
    base-2 scores' bounds ``(max |x|, max scale sum_i |q_i k_i|)`` (B, Hq, 2). NaN rows for
    sequences
    whose length leaves no room. The heads are the arrays' own."""
    K, V = cache_with_step(k_new, v_new, K_cache, V_cache, seq_lens)
    B, Hq, D = q.shape
    group = Hq // K.shape[1]
    scale = math.log2(math.e) / math.sqrt(D)
    out = np.full((B, Hq, D), np.nan)
    mean_abs = np.full((B, Hq, D), np.nan)
    scores = np.full((B, Hq, 2), np.nan)
    qd = q.astype(np.float64)
    for b in range(B):
        if not 0 <= seq_lens[b] < K.shape[2]:
            continue
        n = int(seq_lens[b]) + 1
        for g in range(Hq):
            k = K[b, g // group, :n].astype(np.float64)
            v = V[b, g // group, :n].astype(np.float64)
            x = (k @ qd[b, g]) * scale
            p = np.exp2(x - x.max())
            out[b, g] = p @ v / p.sum()
            mean_abs[b, g] = p @ np.abs(v) / p.sum()
            scores[b, g] = np.abs(x).max(), (scale * (np.abs(k) @ np.abs(qd[b, g]))).max()
    return out, mean_abs, scores


def error_bound(q, k_new, v_new, K_cache, V_cache, seq_lens, chunk: int = 256,
                engine: str = "fma"):
    """``(want, bound)``: float64 attention and the elementwise bound on the tiles' bf16 output
    against it (see the module docstring; ``engine`` "mma" for ``make_decode_split_mma_tile``,
    whose tensor cores may truncate their fp32 sums and whose P is bf16); NaN where a sequence
    has no room (the tiles write NaN there too)."""
    want, mean_abs, scores = attention_float64(q, k_new, v_new, K_cache, V_cache, seq_lens)
    D, splits = q.shape[2], num_splits(K_cache.shape[2], chunk)
    x_max, magnitude = scores[..., 0], scores[..., 1]
    mma = engine == "mma"
    dx = ((D * 2.0 ** -22 + 2.0 ** -23) if mma else (D + 3) * 2.0 ** -24) * magnitude
    ln2 = math.log(2)
    lse_max = x_max + math.log2(chunk)
    rho = (ln2 * (dx + 2.0 ** -22 * x_max) + 2.0 ** -21  # a token's weight within its split
           + mma * 2.0 ** -8  # that weight rounded to bf16 for the MMA
           + ln2 * (2.0 ** -22 + 2.0 ** -23 * lse_max) + chunk * 2.0 ** -24  # the split's lse
           + mma * chunk / 64 * 2.0 ** -21  # its slices' rescales (one ex2 each)
           + 2.0 ** -21)  # the merge weight
    rate = 2 * rho / (1 - rho) + ((4 if mma else 1) * chunk + splits) * 2.0 ** -24 + 2.0 ** -22
    return want, 2.0 ** -8 * np.abs(want) + rate[..., None] * mean_abs


kv_append_tile = make_kv_append_tile()
decode_split_tile = make_decode_split_tile()
decode_merge_tile = make_decode_merge_tile()
