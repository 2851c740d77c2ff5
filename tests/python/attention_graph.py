"""Decode attention as one graph function (append -> split -> merge), and its test inputs.

Edges: split task (b, h, s) waits for the append of sequence b (it reads the cache row that the
append wrote); merge task (b, h) waits for the S split tasks of its (b, h): ``split_done`` is
counted per (b, kv head) with a wait count inferred from the ``"bhs->bh"`` notifies, S.
"""
import functools
import zlib

import numpy as np

from etc_tvm import ETensor, Tensor, call_device, graph_func
from etc_tvm.tiles import attention
from etc_tvm.tiles.attention import BF16, GROUP, HEAD_DIM, KV_HEADS, Q_HEADS

# name -> (max_len, lengths before this step's append); attention covers length + 1 tokens
MIXES = {
    "one_token": (64, [0]),
    "ragged": (700, [0, 299, 255, 699]),  # 1 token, not a chunk multiple, 256 tokens, full
    "one_long": (1100, [1099, 3, 17, 40, 0, 9]),
    "boundaries": (520, [254, 255, 256, 511]),  # 255, 256, 257 and 512 tokens
}


@functools.cache
def decode_attention_graph(chunk: int = 256):
    """``decode_attention(q, k_new, v_new, K_cache, V_cache, seq_lens) -> out`` (bf16)."""
    append = attention.make_kv_append_tile()
    split = attention.make_decode_split_tile(chunk)
    merge = attention.make_decode_merge_tile()

    @graph_func
    def decode_attention(q: Tensor(("B", Q_HEADS, HEAD_DIM), "bfloat16"),
                         k_new: Tensor(("B", KV_HEADS, HEAD_DIM), "bfloat16"),
                         v_new: Tensor(("B", KV_HEADS, HEAD_DIM), "bfloat16"),
                         K_cache: Tensor(("B", KV_HEADS, "L", HEAD_DIM), "bfloat16"),
                         V_cache: Tensor(("B", KV_HEADS, "L", HEAD_DIM), "bfloat16"),
                         seq_lens: Tensor(("B",), "int32")):
        B, L = q.shape[0], K_cache.shape[2]
        S = attention.num_splits(L, chunk)
        appended = ETensor((B,), name="appended")
        split_done = ETensor((B, KV_HEADS), name="split_done")
        pos = call_device(append, tile_num=(B,), args=[k_new, v_new, seq_lens, K_cache, V_cache],
                          out=Tensor((B,), "int32", name="pos"), out_edges={appended: "b->b"})
        O_part, lse = call_device(
            split, tile_num=(B, KV_HEADS, S), args=[q, K_cache, V_cache, pos],
            out=[Tensor((B, KV_HEADS, S, GROUP, HEAD_DIM), name="O_part"),
                 Tensor((B, KV_HEADS, S, GROUP), name="lse")],
            in_edges={appended: "bhs->b"}, out_edges={split_done: "bhs->bh"})
        return call_device(merge, tile_num=(B, KV_HEADS), args=[O_part, lse, pos],
                           out=Tensor((B, Q_HEADS, HEAD_DIM), "bfloat16", name="out"),
                           in_edges={split_done: "bh->bh"})

    return decode_attention


def make_inputs(max_len: int, lengths, seed: str = ""):
    """``(q, k_new, v_new, K_cache, V_cache, seq_lens)``: standard normal bf16, the cache rows
    at and past each length NaN (so a missed append or a read past the length shows)."""
    rng = np.random.default_rng(zlib.crc32(f"{max_len}/{list(lengths)}/{seed}".encode()))
    B = len(lengths)

    def randn(*shape):
        return rng.standard_normal(shape).astype(BF16)

    q, k_new, v_new = randn(B, Q_HEADS, HEAD_DIM), randn(B, KV_HEADS, HEAD_DIM), \
        randn(B, KV_HEADS, HEAD_DIM)
    K_cache, V_cache = randn(B, KV_HEADS, max_len, HEAD_DIM), randn(B, KV_HEADS, max_len,
                                                                   HEAD_DIM)
    for b, n in enumerate(lengths):
        K_cache[b, :, max(n, 0):] = np.nan
        V_cache[b, :, max(n, 0):] = np.nan
    return q, k_new, v_new, K_cache, V_cache, np.asarray(lengths, np.int32)
