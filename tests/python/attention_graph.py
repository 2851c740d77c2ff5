"""Decode attention as one graph function (append -> split -> merge, or split -> merge with a
split that appends), and its test inputs.

Edges: split task (b, h, s) waits for the append of sequence b (it reads the cache row that the
append wrote); merge task (b, h) waits for the S split tasks of its (b, h): ``split_done`` is
counted per (b, query-head block) with a wait count inferred from the ``"bhs->bh"`` notifies,
S.
"""
import functools
import zlib

import numpy as np

from etc_tvm import EtcError, ETensor, Tensor, call_device, graph_func
from etc_tvm.tiles import attention
from etc_tvm.tiles.attention import BF16, QWEN3_30B_A3B, AttentionHeads

# name -> (max_len, lengths before this step's append); attention covers length + 1 tokens
MIXES = {
    "one_token": (64, [0]),
    "ragged": (700, [0, 299, 255, 699]),  # 1 token, not a chunk multiple, 256 tokens, full
    "one_long": (1100, [1099, 3, 17, 40, 0, 9]),
    "boundaries": (520, [254, 255, 256, 511]),  # 255, 256, 257 and 512 tokens
}


# other models' heads (query, KV, dim): groups of 4, 7 (not a power of two), 16 (two blocks of
# 8 a KV head), 2 with 8 blocks, and head dims 64 and 256
OTHER_HEADS = {
    "llama3-8b": AttentionHeads(32, 8, 128),
    "qwen2.5-7b": AttentionHeads(28, 4, 128),
    "qwen3-235b-a22b": AttentionHeads(64, 4, 128),
    "gpt-oss-120b": AttentionHeads(64, 8, 64),
    "gemma2-9b": AttentionHeads(16, 8, 256),
}


@functools.cache
def decode_attention_graph(chunk: int = 256, heads: AttentionHeads = QWEN3_30B_A3B,
                           unroll: int = 4, page: int | None = None, engine: str = "fma",
                           sub: int | None = None, stages: int = 2, merge_parts: int = 1,
                           append_in_split: bool = False):
    """``decode_attention(q, k_new, v_new, K_cache, V_cache, seq_lens) -> out`` (bf16); with
    ``page``, ``decode_attention(q, k_new, v_new, K_pages, V_pages, block_table, seq_lens)``
    over a paged cache. The split tasks run on CUDA cores (``engine`` "fma") or on tensor
    cores ("mma", in slices of ``sub`` tokens, ``stages`` in flight); a block's merge is
    ``merge_parts`` tasks. With ``append_in_split`` (tensor cores) the split tasks append
    this step's rows themselves: split -> merge, no append call."""
    if append_in_split and engine != "mma":
        raise EtcError(f"decode attention: the split appends this step's rows on tensor cores "
                       f"only (engine 'mma'), got engine {engine!r}")
    split = attention.make_decode_split_mma_tile(chunk, heads, sub, stages, page,
                                                 append_in_split) if engine == "mma" \
        else attention.make_decode_split_tile(chunk, unroll, heads=heads, page=page)
    merge = attention.make_decode_merge_tile(heads, merge_parts)
    Hq, Hk, D, Gb = heads.q_heads, heads.kv_heads, heads.head_dim, heads.block

    def attend(q, k_new, v_new, caches, seq_lens, capacity):
        # [append ->] split -> merge; caches: the cache's tensors as the split takes them
        B = q.shape[0]
        S = attention.num_splits(capacity, chunk)
        split_done = ETensor((B, heads.blocks), name="split_done")
        parts = [Tensor((B, heads.blocks, S, Gb, D), name="O_part"),
                 Tensor((B, heads.blocks, S, Gb), name="lse")]
        pos = Tensor((B,), "int32", name="pos")
        if append_in_split:
            O_part, lse, pos = call_device(split, tile_num=(B, heads.blocks, S),
                                           args=[q, k_new, v_new, *caches, seq_lens],
                                           out=[*parts, pos], out_edges={split_done: "bhs->bh"})
        else:
            appended = ETensor((B,), name="appended")
            # the append takes the cache as (K, V) or (block_table, K_pages, V_pages)
            pos = call_device(attention.make_kv_append_tile(heads, page), tile_num=(B,),
                              args=[k_new, v_new, seq_lens, *caches[2:], *caches[:2]],
                              out=pos, out_edges={appended: "b->b"})
            O_part, lse = call_device(split, tile_num=(B, heads.blocks, S),
                                      args=[q, *caches, pos], out=parts,
                                      in_edges={appended: "bhs->b"},
                                      out_edges={split_done: "bhs->bh"})
        return call_device(merge, tile_num=(B, heads.blocks * merge_parts),
                           args=[O_part, lse, pos],
                           out=Tensor((B, Hq, D), "bfloat16", name="out"),
                           in_edges={split_done: "bh->bh" if merge_parts == 1
                                     else f"bt->b, t // {merge_parts}"})

    if page is None:
        @graph_func
        def decode_attention(q: Tensor(("B", Hq, D), "bfloat16"),
                             k_new: Tensor(("B", Hk, D), "bfloat16"),
                             v_new: Tensor(("B", Hk, D), "bfloat16"),
                             K_cache: Tensor(("B", Hk, "L", D), "bfloat16"),
                             V_cache: Tensor(("B", Hk, "L", D), "bfloat16"),
                             seq_lens: Tensor(("B",), "int32")):
            return attend(q, k_new, v_new, [K_cache, V_cache], seq_lens, K_cache.shape[2])
    else:
        @graph_func
        def decode_attention(q: Tensor(("B", Hq, D), "bfloat16"),
                             k_new: Tensor(("B", Hk, D), "bfloat16"),
                             v_new: Tensor(("B", Hk, D), "bfloat16"),
                             K_pages: Tensor(("P", Hk, page, D), "bfloat16"),
                             V_pages: Tensor(("P", Hk, page, D), "bfloat16"),
                             block_table: Tensor(("B", "NP"), "int32"),
                             seq_lens: Tensor(("B",), "int32")):
            return attend(q, k_new, v_new, [K_pages, V_pages, block_table], seq_lens,
                          block_table.shape[1] * page)

    return decode_attention


def make_inputs(max_len: int, lengths, seed: str = "", heads: AttentionHeads = QWEN3_30B_A3B):
    """``(q, k_new, v_new, K_cache, V_cache, seq_lens)``: standard normal bf16, the cache rows
    at and past each length NaN (so a missed append or a read past the length shows)."""
    rng = np.random.default_rng(zlib.crc32(f"{max_len}/{list(lengths)}/{seed}/{heads}".encode()))
    B = len(lengths)
    Hq, Hk, D = heads.q_heads, heads.kv_heads, heads.head_dim

    def randn(*shape):
        return rng.standard_normal(shape).astype(BF16)

    q, k_new, v_new = randn(B, Hq, D), randn(B, Hk, D), randn(B, Hk, D)
    K_cache, V_cache = randn(B, Hk, max_len, D), randn(B, Hk, max_len, D)
    for b, n in enumerate(lengths):
        K_cache[b, :, max(n, 0):] = np.nan
        V_cache[b, :, max(n, 0):] = np.nan
    return q, k_new, v_new, K_cache, V_cache, np.asarray(lengths, np.int32)


def make_paged_inputs(max_len: int, lengths, page: int, seed: str = "",
                      heads: AttentionHeads = QWEN3_30B_A3B):
    """``(paged, contiguous)``: ``make_inputs``' draw as ``(q, k_new, v_new, K_pages, V_pages,
    block_table, seq_lens)`` and as the contiguous inputs that hold the same rows (the float64
    reference's). Each sequence has ``max_len / page`` table entries over pages dealt at
    random from the pool (two spare); an entry past the tokens that the step covers is -1,
    so a read of it shows, and so do the NaN rows of every page slot that holds no token."""
    if max_len % page:
        raise ValueError(f"max_len {max_len} must be whole pages of {page}")
    contiguous = make_inputs(max_len, lengths, seed, heads)
    q, k_new, v_new, K_cache, V_cache, seq_lens = contiguous
    NP = max_len // page
    rng = np.random.default_rng(zlib.crc32(f"pages/{max_len}/{page}/{seed}".encode()))
    K_pages, V_pages, block_table = deal_pages(K_cache, V_cache, page, rng, spare=2)
    for b, n in enumerate(lengths):
        block_table[b, np.arange(NP) * page > min(n, max_len - 1)] = -1
    return (q, k_new, v_new, K_pages, V_pages, block_table, seq_lens), contiguous


def deal_pages(K_cache, V_cache, page: int, rng, spare: int = 0):
    """``(K_pages, V_pages, block_table)``: the contiguous caches' rows in pages dealt at
    random from a pool of ``spare`` more pages than they fill (those NaN)."""
    B, Hk, L, D = K_cache.shape
    NP = L // page
    ids = rng.permutation(B * NP + spare)[:B * NP].astype(np.int32).reshape(B, NP)
    pools = []
    for cache in (K_cache, V_cache):
        pool = np.full((B * NP + spare, Hk, page, D), np.nan, BF16)
        pool[ids.ravel()] = cache.reshape(B, Hk, NP, page, D).transpose(0, 2, 1, 3, 4) \
            .reshape(-1, Hk, page, D)
        pools.append(pool)
    return (*pools, ids)
