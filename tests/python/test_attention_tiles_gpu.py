"""Decode attention tiles on the GPU, against float64 attention within ``attention.error_bound``.

Each tile runs alone as a one-call graph (strategy "unfused": one grid launch) and the three
chained as one static persistent megakernel, on fresh random inputs (cache rows at and past
each length NaN), B in {1, 4, 32}, lengths up to 4096 mixed with the edge cases (1 token, a
chunk boundary, a full cache). Where PyTorch is installed, the NumPy float64 reference is
itself checked against PyTorch's float64 softmax attention.
"""
import zlib

import numpy as np
import pytest

from etc_tvm import ExecutionError

from etc_tvm.build import build
from etc_tvm.tiles import attention
from etc_tvm.tiles.attention import QWEN3_30B_A3B, AttentionHeads

from attention_graph import OTHER_HEADS, decode_attention_graph, make_inputs, make_paged_inputs
from test_attention_tiles import MERGE_PARTS, merge_id, one_call_graphs
from test_tiles import assert_within

pytestmark = pytest.mark.gpu

CHUNK = 256
CASES = [(1, 4096), (4, 4096), (4, 1000), (32, 4096)]  # (B, max_len)


def lengths(B: int, max_len: int) -> list:
    """Random lengths before the append, with 1 token, a chunk boundary, and a full cache."""
    rng = np.random.default_rng(zlib.crc32(f"{B}/{max_len}".encode()))
    special = [max_len - 1, 0, CHUNK - 1, CHUNK, max_len // 3]
    drawn = rng.integers(0, max_len, B).tolist()
    return (special + drawn)[:B] if B > 1 else [max_len - 1]


def float64_reference(inputs, chunk=CHUNK, engine="fma"):
    want, bound = attention.error_bound(*inputs, chunk=chunk, engine=engine)
    try:
        import torch
    except ImportError:
        return want, bound
    q, k_new, v_new, K_cache, V_cache, seq_lens = inputs
    K, V = attention.cache_with_step(k_new, v_new, K_cache, V_cache, seq_lens)
    _, Hq, D = q.shape
    Hk = K.shape[1]
    for b, n in enumerate(seq_lens + 1):
        qt = torch.from_numpy(q[b].astype(np.float64)).view(Hk, Hq // Hk, D)
        kt = torch.from_numpy(K[b, :, :n].astype(np.float64))
        vt = torch.from_numpy(V[b, :, :n].astype(np.float64))
        p = torch.softmax(qt @ kt.transpose(1, 2) / D ** 0.5, dim=-1)
        np.testing.assert_allclose(want[b], (p @ vt).reshape(Hq, D).numpy(), rtol=1e-10,
                                   atol=1e-12)
    return want, bound


def assert_attention(out, want, bound):
    """Within the float64 bound element by element, and as a whole within 1% (the norm of
    the difference against float64's): the element bound allows a weight 2**-8 off (P in
    bf16), which left a tile whose second slice read rows still landing at 2e-2 inside it;
    a correct tile is at 2e-3, the bf16 rounding of its output."""
    assert_within(out, want, bound)
    got = np.asarray(out, np.float64)
    assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want)


def one_launch_each(B, max_len, heads=QWEN3_30B_A3B):
    """append, then split, then merge as three launches: the cache is updated in place on the
    device, the partials of empty chunks are neutral, and the output is within the bound."""
    import tvm

    dev = tvm.cuda(0)
    inputs = make_inputs(max_len, lengths(B, max_len), heads=heads)
    q, k_new, v_new, K_cache, V_cache, seq_lens = inputs
    S = attention.num_splits(max_len, CHUNK)
    graphs = one_call_graphs(CHUNK, heads)
    dims = {"B": B, "L": max_len}
    K_dev, V_dev = tvm.runtime.tensor(K_cache, dev), tvm.runtime.tensor(V_cache, dev)
    pos = build(graphs["append"], dims, strategy="unfused")(k_new, v_new, seq_lens, K_dev, V_dev)
    want_k, want_v = attention.cache_with_step(k_new, v_new, K_cache, V_cache, seq_lens)
    np.testing.assert_array_equal(pos, seq_lens)
    np.testing.assert_array_equal(K_dev.numpy().view(np.uint16), want_k.view(np.uint16))
    np.testing.assert_array_equal(V_dev.numpy().view(np.uint16), want_v.view(np.uint16))

    O_part, lse = build(graphs["split"], dims, strategy="unfused")(q, want_k, want_v, pos)
    blocks, Gb = heads.blocks, heads.block
    assert O_part.shape == (B, blocks, S, Gb, heads.head_dim)
    assert lse.shape == (B, blocks, S, Gb)
    empty = np.arange(S)[None, :] * CHUNK >= (seq_lens + 1)[:, None]  # (B, S)
    assert (lse.transpose(0, 2, 1, 3)[empty] == -np.inf).all()
    assert (O_part.transpose(0, 2, 1, 3, 4)[empty] == 0).all()
    assert np.isfinite(lse.transpose(0, 2, 1, 3)[~empty]).all()

    out = build(graphs["merge"], {"B": B, "S": S}, strategy="unfused")(O_part, lse, pos)
    want, bound = float64_reference(inputs)
    assert_attention(out, want, bound)


@pytest.mark.parametrize("B, max_len", CASES)
def test_tiles_one_launch_each(B, max_len):
    one_launch_each(B, max_len)


@pytest.mark.parametrize("B, max_len", CASES)
def test_decode_attention_megakernel(B, max_len):
    compiled = build(decode_attention_graph(CHUNK), {"B": B, "L": max_len}, strategy="static")
    inputs = make_inputs(max_len, lengths(B, max_len))
    out = compiled(*inputs)
    want, bound = float64_reference(inputs)
    assert_attention(out, want, bound)


@pytest.mark.parametrize("model", sorted(OTHER_HEADS))
def test_other_heads(model):
    """Other models' heads (groups of 4, 7 and 16, head dims 64 and 256): the three tiles as
    launches, and the static megakernel, 100 launches of it identical."""
    heads = OTHER_HEADS[model]
    B, max_len = 8, 1000
    one_launch_each(B, max_len, heads)
    compiled = build(decode_attention_graph(CHUNK, heads), {"B": B, "L": max_len},
                     strategy="static")
    inputs = make_inputs(max_len, lengths(B, max_len), heads=heads)
    first = compiled(*inputs)
    want, bound = float64_reference(inputs)
    assert_attention(first, want, bound)
    for _ in range(99):
        np.testing.assert_array_equal(compiled(*inputs).view(np.uint16), first.view(np.uint16))


@pytest.mark.parametrize("engine", ["fma", "mma"])
@pytest.mark.parametrize("strategy", ["static", "dynamic", "unfused"])
@pytest.mark.parametrize("B, max_len, page", [(4, 4096, 16), (32, 4096, 16), (4, 1000, 8)])
def test_paged_cache(B, max_len, page, strategy, engine):
    """A paged cache (pages dealt at random, table entries past the tokens -1): within the
    contiguous cache's bound, the new rows in their pages on the device; then a page id
    outside the pool stops the kernel with an error that names it. On tensor cores in
    64-token slices."""
    import tvm

    paged, contiguous = make_paged_inputs(max_len, lengths(B, max_len), page, seed="paged")
    q, k_new, v_new, K_pages, V_pages, block_table, seq_lens = paged
    split = {"engine": "mma", "sub": 64} if engine == "mma" else {}
    run = build(decode_attention_graph(CHUNK, page=page, **split),
                {"B": B, "NP": max_len // page, "P": len(K_pages)}, strategy=strategy)
    K_dev, V_dev = (tvm.runtime.tensor(x, tvm.cuda(0)) for x in (K_pages, V_pages))
    out = run(q, k_new, v_new, K_dev, V_dev, block_table, seq_lens)
    want, bound = float64_reference(contiguous, CHUNK, engine)
    assert_attention(out, want, bound)
    for b, at in enumerate(seq_lens):
        if 0 <= at < max_len:
            np.testing.assert_array_equal(
                K_dev.numpy()[block_table[b, at // page], :, at % page].view(np.uint16),
                k_new[b].view(np.uint16))
    bad = block_table.copy()
    bad[B - 1, 0] = len(K_pages) + 5
    with pytest.raises(ExecutionError, match=r"block_table holds the page id "
                       rf"{len(K_pages) + 5}, outside the pages of the cache"):
        run(q, k_new, v_new, K_pages, V_pages, bad, seq_lens)
    assert_attention(run(*paged), want, bound)
MMA_SPLITS = [(128, None, 1), (128, 64, 2), (512, 64, 2)]  # (chunk, sub, stages)


@pytest.mark.parametrize("chunk, sub, stages", MMA_SPLITS,
                         ids=lambda v: "-" if v is None else str(v))
@pytest.mark.parametrize("B, max_len", CASES)
def test_mma_split_megakernel(B, max_len, chunk, sub, stages):
    """The split on tensor cores in the static megakernel (the chunk at once, or streamed in
    slices of 64 tokens), within its bound (P in bf16), and 100 launches identical."""
    compiled = build(decode_attention_graph(chunk, engine="mma", sub=sub, stages=stages),
                     {"B": B, "L": max_len}, strategy="static")
    inputs = make_inputs(max_len, lengths(B, max_len), seed="mma")
    first = compiled(*inputs)
    want, bound = float64_reference(inputs, chunk, "mma")
    assert_attention(first, want, bound)
    for _ in range(99 if B == 32 else 4):
        np.testing.assert_array_equal(compiled(*inputs).view(np.uint16), first.view(np.uint16))


@pytest.mark.parametrize("chunk, sub", [(64, None), (256, 64)])
@pytest.mark.parametrize("model", ["gpt-oss-120b", "gemma2-9b", "qwen3-235b-a22b",
                                   "qwen3-235b-a22b, 16 heads a task", "head dim 32"])
def test_mma_split_other_heads(model, chunk, sub):
    heads = {**OTHER_HEADS, "head dim 32": AttentionHeads(32, 8, 32),
             "qwen3-235b-a22b, 16 heads a task": AttentionHeads(64, 4, 128, max_block=16)}[model]
    B, max_len = 8, 1000
    compiled = build(decode_attention_graph(chunk, heads, engine="mma", sub=sub),
                     {"B": B, "L": max_len}, strategy="unfused")
    inputs = make_inputs(max_len, lengths(B, max_len), heads=heads)
    want, bound = float64_reference(inputs, chunk, "mma")
    assert_attention(compiled(*inputs), want, bound)


@pytest.mark.parametrize("strategy", ["static", "unfused"])
@pytest.mark.parametrize("heads, parts", MERGE_PARTS, ids=merge_id)
def test_merge_in_parts(heads, parts, strategy):
    """A block's merge in parts after 64-token splits on tensor cores: 64 splits a block,
    most of them empty for the short sequences, and 5, fewer than a task's groups of
    threads; within the bound, and 20 launches identical."""
    for max_len in (4096, 300):
        compiled = build(decode_attention_graph(64, heads, engine="mma", merge_parts=parts),
                         {"B": 4, "L": max_len}, strategy=strategy)
        inputs = make_inputs(max_len, lengths(4, max_len), seed="parts", heads=heads)
        first = compiled(*inputs)
        want, bound = float64_reference(inputs, 64, "mma")
        assert_attention(first, want, bound)
        for _ in range(20):
            np.testing.assert_array_equal(compiled(*inputs).view(np.uint16),
                                          first.view(np.uint16))


@pytest.mark.parametrize("strategy", ["static", "dynamic", "unfused"])
@pytest.mark.parametrize("B, max_len, page", [(4, 1000, None), (32, 4096, None), (4, 4096, 16)])
def test_split_that_appends(B, max_len, page, strategy):
    """split -> merge, the split appending this step's rows (512-token chunks in 64-token
    slices): the bits of append -> split -> merge, the new rows in the device's cache, a
    sequence without room NaN; 20 launches identical."""
    import tvm

    lens = [*lengths(B, max_len)[:-1], max_len]  # the last sequence has no room
    if page is None:
        inputs = contiguous = make_inputs(max_len, lens, seed="appends")
        dims = {"B": B, "L": max_len}
    else:
        inputs, contiguous = make_paged_inputs(max_len, lens, page, seed="appends")
        dims = {"B": B, "NP": max_len // page, "P": len(inputs[3])}
    split = {"chunk": 512, "engine": "mma", "sub": 64, "page": page}
    run = build(decode_attention_graph(**split, append_in_split=True), dims, strategy=strategy)
    want = build(decode_attention_graph(**split), dims, strategy=strategy)(*inputs)
    K_dev, V_dev = (tvm.runtime.tensor(x, tvm.cuda(0)) for x in inputs[3:5])
    args = [*inputs[:3], K_dev, V_dev, *inputs[5:]]
    first = run(*args)
    np.testing.assert_array_equal(first.view(np.uint16), want.view(np.uint16))
    assert np.isnan(first[-1].astype(np.float32)).all()
    good = slice(0, B - 1)
    reference, bound = float64_reference(tuple(x[good] for x in contiguous), 512, "mma")
    assert_attention(first[good], reference, bound)
    q, k_new, v_new, *_, seq_lens = inputs
    for b, at in enumerate(seq_lens[good]):
        major, row = (b, at) if page is None else (inputs[5][b, at // page], at % page)
        for cache, new in ((K_dev, k_new), (V_dev, v_new)):
            np.testing.assert_array_equal(cache.numpy()[major, :, row].view(np.uint16),
                                          new[b].view(np.uint16))
    for _ in range(20):
        np.testing.assert_array_equal(run(*args).view(np.uint16), first.view(np.uint16))


def test_megakernel_updates_the_device_cache_in_place():
    import tvm

    B, max_len = 4, 1000
    compiled = build(decode_attention_graph(CHUNK), {"B": B, "L": max_len}, strategy="static")
    inputs = make_inputs(max_len, lengths(B, max_len))
    q, k_new, v_new, K_cache, V_cache, seq_lens = inputs
    K_dev, V_dev = (tvm.runtime.tensor(x, tvm.cuda(0)) for x in (K_cache, V_cache))
    compiled(q, k_new, v_new, K_dev, V_dev, seq_lens)
    want_k, want_v = attention.cache_with_step(k_new, v_new, K_cache, V_cache, seq_lens)
    np.testing.assert_array_equal(K_dev.numpy().view(np.uint16), want_k.view(np.uint16))
    np.testing.assert_array_equal(V_dev.numpy().view(np.uint16), want_v.view(np.uint16))


def test_a_full_cache_gives_nan_for_that_sequence_only():
    B, max_len = 4, 1000
    compiled = build(decode_attention_graph(CHUNK), {"B": B, "L": max_len}, strategy="static")
    inputs = make_inputs(max_len, [5, max_len, 300, -1])
    out = compiled(*inputs).astype(np.float32)
    assert np.isnan(out[[1, 3]]).all()
    want, bound = attention.error_bound(*inputs, chunk=CHUNK)
    assert_attention(out[[0, 2]], want[[0, 2]], bound[[0, 2]])


@pytest.mark.parametrize("strategy", ["unfused_tiles", "static"])
def test_100_launches_are_identical(strategy):
    B, max_len = 32, 4096
    inputs = make_inputs(max_len, lengths(B, max_len), seed="repeat")
    q, k_new, v_new, K_cache, V_cache, seq_lens = inputs
    if strategy == "static":
        compiled = build(decode_attention_graph(CHUNK), {"B": B, "L": max_len},
                         strategy="static")

        def run():
            return compiled(*inputs)
    else:
        graphs, S = one_call_graphs(CHUNK), attention.num_splits(max_len, CHUNK)
        dims = {"B": B, "L": max_len}
        K, V = attention.cache_with_step(k_new, v_new, K_cache, V_cache, seq_lens)
        split = build(graphs["split"], dims, strategy="unfused")
        merge = build(graphs["merge"], {"B": B, "S": S}, strategy="unfused")

        def run():
            return merge(*split(q, K, V, seq_lens), seq_lens)
    first = run()
    want, bound = float64_reference(inputs)
    assert_attention(first, want, bound)
    for _ in range(99):
        np.testing.assert_array_equal(run().view(np.uint16), first.view(np.uint16))
