"""Tiles against PyTorch: achieved bandwidth at decode shapes, FLOP rate at prefill shapes.

Each tile runs as a one-call graph ("unfused": one grid launch; decode attention is its three
tiles, append -> split -> merge, and the MoE router its logits and top-K tiles), PyTorch runs
the same operation (``torch.matmul`` for the GEMV and the GEMM, ``rms_norm``, ``silu * up``
and ``+``, ``scaled_dot_product_attention`` after the cache append, per-head ``rms_norm`` and
the neox rotation, fp32 logits and ``topk``, a stable sort for the MoE alignment, one matmul
per routed expert for the grouped GEMMs, a weighted sum for the combine), both on the same
inputs in the same run. Each side is replayed from a CUDA graph of one call per input copy,
so the times are the kernels' own (no host call path, no launch gaps), medians of CUDA events
with the two sides taking turns. Inputs rotate through enough copies to exceed the 60 MiB L2
twice, so no call finds its operands in L2 from the previous one (but the alignment's routing,
which a layer finds in L2).

Bandwidth is the bytes the operation must move (weights, activations in, results out) over
the time; the GEMM's rate is 2MNK over the time. The GEMV picks the smallest split-K that gives
every SM two tasks; at M = 16 the "mma16" rows run the same product on tensor cores (the gemm
tile with 16-row blocks, split-K, the same sum tile), and at M up to 64 the "swapped" rows
on warpgroup MMA with the weights on its m64 side, all M rows one tile of a multiple of 8
(``decode_graphs.tensor_core_gemm``). The GEMM is the wgmma tile (128 x 256 x 64, four
stages, bf16 out).
A row whose output misses PyTorch's is reported and not timed, the rest run, and the script
exits non-zero at the end.
``--strategy static`` runs our side as a one-call megakernel instead (persistent CTAs taking
the tasks from static queues): the tile as it runs inside a graph.
Prints one table and writes JSON (``--json``).
"""
import argparse
import json
import re
import sys
from pathlib import Path
from typing import Callable, NamedTuple

import ml_dtypes
import numpy as np
import torch
import tvm

from etc_tvm import Tensor, build, call_device, graph_func
from etc_tvm.runtime import cuda_graph
from etc_tvm.tiles import attention, gemm, gemv, moe, wgmma_gemm
from moe_layer import QWEN3_30B_A3B
from timing import time_interleaved

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))
from attention_graph import deal_pages, decode_attention_graph  # noqa: E402
from decode_graphs import (BN, EPS, gemv_graph, residual_add_only,  # noqa: E402
                           rmsnorm_only, silu_mul_only, split_gemv_graph, tensor_core_gemm)
from moe_tile_graphs import BT, one_call_dims, one_call_graphs  # noqa: E402

BF16 = ml_dtypes.bfloat16
L2_BYTES = 60 << 20
SMS = 132
MMA_BN = 64
SWAPPED_ROWS = 64  # the "swapped" rows: one tile of all M rows (padded to 8), M up to this
GEMM_TILE = {"bm": 128, "bn": 256, "bk": 64, "threads": 256, "out_dtype": "bfloat16"}


class Case(NamedTuple):
    """One row: ``graph`` at ``dims`` on ``inputs(rng)`` against ``torch_op``; ``amount`` bytes
    (or FLOPs) over the time gives the rate in ``unit``; ``pick``, where an output holds rows
    that only one side writes (a grouped GEMM's padding and unused tiles), selects the rows
    both compare; ``copies``, where the inputs are a few bytes, how many input copies the
    calls rotate through (else enough to exceed the L2 twice); ``torch_inputs``, where
    PyTorch takes the operation's operands in another form, them from ours (on the host,
    outside the timing: a paged cache as the contiguous one it holds)."""
    tile: str
    label: str
    graph: object
    dims: dict
    inputs: Callable
    torch_op: Callable
    amount: float
    unit: str
    pick: Callable | None = None
    copies: int | None = None
    torch_inputs: Callable | None = None


def mma_split_for(K: int, N: int) -> int:
    """The smallest split-K giving every SM two tasks (or 8), with whole 64-row K steps."""
    fits = [s for s in (1, 2, 4, 8) if K % (s * 64) == 0]
    return next((s for s in fits if N // MMA_BN * s >= 2 * SMS), fits[-1])


def swapped_tiling_for(M: int, K: int, N: int) -> tuple[int, int]:
    """(columns a task, split-K) of the "swapped" rows: at least 256 tasks (two an SM), with
    128-column tasks where the split allows, else 64, whole 32-row K steps, and fp32 partials
    (S x M x N) of at most an eighth of the weights' bytes, which the sum reads back."""
    most = max(1, K // (16 * M))
    fits = [s for s in (1, 2, 4, 8, 16) if K % (s * 32) == 0 and s <= most]
    for bn in (128, 64):
        s = next((s for s in fits if N // bn * s >= 256), None)
        if s is not None:
            return bn, s
    return 64, fits[-1]


def split_for(K: int, N: int) -> int:
    """The smallest split-K giving every SM two tasks (or 8); the GEMV deals its double
    batches out unevenly where the split does not divide them."""
    fits = [s for s in (1, 2, 4, 8) if s <= K // gemv.k_step(BN)]
    return next((s for s in fits if N // BN * s >= 2 * SMS), fits[-1])


def gaussian(*shapes):
    """Inputs of ``shapes``: bf16, standard normal over the square root of the first dim."""
    return lambda rng: [(rng.standard_normal(s, dtype=np.float32)
                         / np.float32(np.sqrt(s[0] if len(s) == 2 else 1))).astype(BF16)
                        for s in shapes]


def cases(rows, hidden_sizes, vocab):
    """(tile, label, graph, dims, inputs(rng), torch op, bytes moved, "TB/s")."""
    for M in rows:
        for H in hidden_sizes:
            F = {2048: 5632, 4096: 11008}.get(H, 4 * H)
            for K, N in [(H, H), (H, 2 * F), (F, H), (H, vocab)]:
                s = split_for(K, N)
                graph = gemv_graph() if s == 1 else split_gemv_graph(s)
                yield Case("gemv", f"M={M} {K}x{N} k{s}", graph, {"M": M, "K": K, "N": N},
                           gaussian((M, K), (K, N)), torch.matmul, 2 * (K * N + M * K + M * N),
                           "TB/s")
                if M == 16:
                    s = mma_split_for(K, N)
                    yield Case("mma16", f"M={M} {K}x{N} k{s}", tensor_core_gemm("mma", s),
                               {"M": M, "K": K, "N": N}, gaussian((M, K), (K, N)), torch.matmul,
                               2 * (K * N + M * K + M * N), "TB/s")
                if M <= SWAPPED_ROWS:
                    rows = -(-M // 8) * 8
                    bn, s = swapped_tiling_for(rows, K, N)
                    yield Case("swapped", f"M={M} {K}x{N} n{bn} k{s}",
                               tensor_core_gemm("swapped", s, rows, bn),
                               {"M": M, "K": K, "N": N}, gaussian((M, K), (K, N)), torch.matmul,
                               2 * (K * N + M * K + M * N), "TB/s")
            yield Case("rmsnorm", f"M={M} H={H}", rmsnorm_only, {"M": M, "H": H},
                       gaussian((M, H), (H,)),
                       lambda x, w: torch.nn.functional.rms_norm(x, (x.shape[1],), w, EPS),
                       2 * (2 * M * H + H), "TB/s")
            yield Case("silu_mul", f"M={M} F={F}", silu_mul_only, {"M": M, "F2": 2 * F},
                       gaussian((M, 2 * F)),
                       lambda h: torch.nn.functional.silu(h[:, :h.shape[1] // 2])
                       * h[:, h.shape[1] // 2:], 2 * 3 * M * F, "TB/s")
            yield Case("residual_add", f"M={M} N={H}", residual_add_only, {"M": M, "N": H},
                       gaussian((M, H), (M, H)), torch.add, 2 * 3 * M * H, "TB/s")


def torch_decode_attention(q, k_new, v_new, K_cache, V_cache, seq_lens):
    """The append, then attention over the whole cache: every sequence has the cache's
    length, its last row the new token."""
    n = K_cache.shape[2] - 1
    K_cache[:, :, n], V_cache[:, :, n] = k_new, v_new
    return torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None], K_cache, V_cache, enable_gqa=True)[:, :, 0]


def torch_qk_norm_rope(q, k, q_weight, k_weight, positions, eps=1e-6, theta=1e6):
    """Per-head RMSNorm, then the neox rotation, angles in float64 as the tile's."""
    D = q_weight.shape[0]
    inv_freq = theta ** (-torch.arange(0, D, 2, dtype=torch.float64, device=q.device) / D)
    angle = positions.double()[:, None, None] * inv_freq
    cos, sin = angle.cos().float(), angle.sin().float()

    def one(x, w):
        xn = torch.nn.functional.rms_norm(x.view(x.shape[0], -1, D).float(), (D,), w.float(),
                                          eps)
        x1, x2 = xn[..., :D // 2], xn[..., D // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1) \
            .to(torch.bfloat16).view(x.shape)

    return one(q, q_weight), one(k, k_weight)


def torch_route(x, w_router, top_k=8):
    """fp32 logits, the top K, their softmax (renormalised over the K)."""
    values, ids = torch.topk(x.float() @ w_router.float(), top_k, dim=1)
    return ids.int(), torch.softmax(values, dim=1)


def decode_inputs(rng, B: int, L: int, heads: attention.AttentionHeads) -> list:
    """Decode attention's inputs ``(q, k_new, v_new, K_cache, V_cache, seq_lens)`` over a
    contiguous cache of L tokens, every one of the B sequences full but for this step's."""
    Hq, Hk, D = heads.q_heads, heads.kv_heads, heads.head_dim

    def normal(*shape):
        return rng.standard_normal(shape, dtype=np.float32).astype(BF16)

    return [normal(B, Hq, D), normal(B, Hk, D), normal(B, Hk, D), normal(B, Hk, L, D),
            normal(B, Hk, L, D), np.full(B, L - 1, np.int32)]


def paged(arrays, page: int, rng):
    """Decode attention's inputs over a contiguous cache as ``(q, k_new, v_new, K_pages,
    V_pages, block_table, seq_lens)``: each sequence's rows in pages dealt at random."""
    q, k_new, v_new, K_cache, V_cache, seq_lens = arrays
    return [q, k_new, v_new, *deal_pages(K_cache, V_cache, page, rng), seq_lens]


def contiguous(arrays):
    """``paged``'s arrays back as the contiguous cache they hold (PyTorch's operands)."""
    q, k_new, v_new, K_pages, V_pages, block_table, seq_lens = arrays
    B, NP = block_table.shape
    _, Hk, page, D = K_pages.shape
    caches = [pool[block_table.ravel()].reshape(B, NP, Hk, page, D).transpose(0, 2, 1, 3, 4)
              .reshape(B, Hk, NP * page, D) for pool in (K_pages, V_pages)]
    return [q, k_new, v_new, *caches, seq_lens]


def split_options(spec: str, batch: int, capacity: int, heads: attention.AttentionHeads,
                  page: int | None = None,
                  model: attention.SplitCostModel = attention.H200_SPLIT_COST) -> dict:
    """``decode_attention_graph``'s split options from ``CHUNKxUNROLL`` (the CUDA-core tile),
    ``CHUNKxmma`` (the tensor-core tile, the chunk at once), ``CHUNKxmmaSUBxSTAGES`` (the
    tensor-core tile streaming slices of SUB tokens, STAGES in flight) or ``auto`` (slices of
    64 tokens, two in flight, the chunk and merge parts ``attention.choose_split`` picks with
    ``model`` for ``batch`` sequences of ``capacity`` tokens); any of them ``xmPARTS`` for a
    block's merge in PARTS tasks, and a tensor-core one ``xa`` for a split that appends this
    step's rows itself (no append tile before it)."""
    split = spec.split("x")
    parts = {}
    if split[-1] == "a":
        split.pop()
        parts["append_in_split"] = True
    if re.fullmatch(r"m\d+", split[-1]):
        parts["merge_parts"] = int(split.pop()[1:])
    if split == ["auto"]:
        sub = 64
        chunk, merge_parts = attention.choose_split(batch, capacity, heads, sub, page, model)
        return {"chunk": chunk, "engine": "mma", "sub": sub, "stages": 2,
                "merge_parts": merge_parts, **parts}
    chunk, engine, *slices = split
    if engine.startswith("mma"):
        sub = int(engine[3:]) if engine[3:] else None
        return {"chunk": int(chunk), "engine": "mma", "sub": sub,
                "stages": int(slices[0]) if slices else 2, **parts}
    return {"chunk": int(chunk), "unroll": int(engine), **parts}


def decode_cases(rows, batches, contexts, heads=attention.QWEN3_30B_A3B, splits=("256x4",),
                 page=None, split_model=attention.H200_SPLIT_COST):
    """(tile, label, graph, dims, inputs(rng), torch op, bytes moved, "TB/s") of decode
    attention (batches x contexts: the K and V rows it reads; ``heads``; split tasks of each
    spec of ``splits`` (``split_options``, ``auto`` with ``split_model``); with ``page``,
    our side over a paged cache, PyTorch's over the contiguous cache that holds the same
    rows), the q/k RMSNorm + RoPE and the MoE router (``rows`` tokens) at Qwen3-30B-A3B
    sizes."""
    Hq, Hk, D = heads.q_heads, heads.kv_heads, heads.head_dim
    for B in batches:
        for L in contexts:
            def inputs(rng, B=B, L=L):
                arrays = decode_inputs(rng, B, L, heads)
                return arrays if page is None else paged(arrays, page, rng)
            dims = {"B": B, "L": L} if page is None else {"B": B, "NP": L // page,
                                                          "P": B * L // page}
            for spec in splits:
                options = split_options(spec, B, L, heads, page, split_model)
                label = f"B={B} L={L}" + ("" if heads == attention.QWEN3_30B_A3B
                                          else f" {heads.suffix}") \
                    + ("" if page is None else f" p{page}") \
                    + ("" if len(splits) == 1 else f" {spec}") \
                    + (f" (c{options['chunk']} m{options['merge_parts']})"
                       if spec.startswith("auto") else "")
                graph = decode_attention_graph(heads=heads, page=page, **options)
                yield Case("attention", label, graph, dims, inputs, torch_decode_attention,
                           2 * (2 * B * Hk * L * D + 2 * B * Hq * D), "TB/s",
                           torch_inputs=None if page is None else contiguous)
    qwen3 = attention.QWEN3_30B_A3B
    Hq, Hk, D = qwen3.q_heads, qwen3.kv_heads, qwen3.head_dim
    moe_graphs = one_call_graphs(2048, 128, 8, 768, (Hq, Hk))
    for M in rows:
        def rope_inputs(rng, M=M):
            q, k, qw, kw = gaussian((M, Hq * D), (M, Hk * D), (D,), (D,))(rng)
            return [q, k, qw, kw, rng.integers(0, 100_000, M, dtype=np.int32)]
        yield Case("qk_norm_rope", f"M={M}", moe_graphs["qk_norm_rope"], {"T": M}, rope_inputs,
                   torch_qk_norm_rope, 2 * (2 * M * (Hq + Hk) * D + 2 * D), "TB/s")
        yield Case("router", f"M={M} 2048x128 top8", moe_graphs["router"], {"T": M},
                   gaussian((M, 2048), (2048, 128)), torch_route,
                   2 * (2048 * 128 + M * 2048) + 8 * M * 8, "TB/s")


def routed_cases(rows):
    """The MoE tiles after the router at Qwen3-30B-A3B sizes (align, the grouped GEMMs on the
    layer's decode tiles: 16 rows, 64 columns, the deepest default ring
    (``gemm.deepest_stages``), and combine), for one random routing of each count of tokens
    in ``rows``."""
    H, E, K, F = (QWEN3_30B_A3B[k] for k in ("hidden", "experts", "top_k", "intermediate"))
    graphs = one_call_graphs(H, E, K, F, grouped_stages=gemm.deepest_stages(BT, MMA_BN, 64),
                             chunk_tokens=moe.ALIGN_CHUNK_TOKENS)
    for tokens in rows:
        yield from routing_cases(tokens, graphs)


def torch_align(topk, experts, tile_rows, tiles):
    """The align tile's outputs in PyTorch (no host sync, so that a CUDA graph captures it):
    counts, exp_indptr, pair_row, pair_tile, sorted_token, tile_expert."""
    dev, pairs = topk.device, topk.numel()
    flat = topk.reshape(-1).long()
    counts = torch.zeros(experts, dtype=torch.long, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat))
    indptr = torch.zeros(experts + 1, dtype=torch.long, device=dev)
    indptr[1:] = torch.cumsum((counts + tile_rows - 1) // tile_rows, 0)
    order = torch.argsort(flat, stable=True)  # pairs of an expert in (t, k) order
    rank = torch.empty_like(flat)
    rank[order] = torch.arange(pairs, device=dev) - (torch.cumsum(counts, 0) - counts)[flat[order]]
    row = indptr[flat] * tile_rows + rank
    sorted_token = torch.full((tiles * tile_rows,), -1, dtype=torch.int32, device=dev)
    sorted_token[row] = (torch.arange(pairs, device=dev) // topk.shape[1]).int()
    tile_expert = torch.searchsorted(indptr[1:], torch.arange(tiles, device=dev), right=True)
    return (counts.int(), indptr.int(), row.view(topk.shape).int(),
            (row // tile_rows).view(topk.shape).int(), sorted_token, tile_expert.int())


def routing_cases(tokens, graphs):
    """align, gate_up, down and combine over one random routing of ``tokens`` tokens (align
    on fresh routings of that size); PyTorch runs one matmul per routed expert. Bytes: the
    routed experts' weights and the rows in and out. Of the grouped GEMMs only the pairs'
    rows are compared: padding rows and unused tiles are ours alone."""
    H, E, K, F = (QWEN3_30B_A3B[k] for k in ("hidden", "experts", "top_k", "intermediate"))

    def random_topk(rng):  # each token's K distinct experts
        return np.stack([rng.choice(E, K, replace=False) for _ in range(tokens)])

    topk = random_topk(np.random.default_rng(tokens))
    tiles = moe.max_tiles(tokens, E, K, BT)
    _, indptr, pair_row, sorted_token, tile_expert = moe.align_reference(topk, E, BT, tiles)
    routed = np.unique(topk)
    plan = []  # (expert, its tokens, their pair rows)
    for e in routed:
        token, k = np.nonzero(topk == e)
        plan.append((int(e), token.tolist(), pair_row[token, k].tolist()))
    pairs = sorted(pair_row.ravel().tolist())
    on_device = {}  # device -> the plan with its rows as index tensors, made before a capture

    def plan_on(device):
        if device not in on_device:
            on_device[device] = [(e, *(torch.tensor(r, device=device) for r in rows))
                                 for e, *rows in plan]
        return on_device[device]

    def weights(rng, shape):
        w = np.zeros((E, *shape), BF16)
        w[routed] = (rng.standard_normal((len(routed), *shape), dtype=np.float32)
                     / np.float32(np.sqrt(shape[0]))).astype(BF16)
        return w

    def gate_up_inputs(rng):
        x = rng.standard_normal((tokens, H), dtype=np.float32).astype(BF16)
        return [x, weights(rng, (H, 2 * F)), sorted_token, tile_expert, indptr]

    def torch_gate_up(x, w, *_):
        h = torch.zeros((tiles * BT, F), dtype=torch.bfloat16, device=x.device)
        for e, rows_in, rows_out in plan_on(x.device):
            n = rows_in.shape[0]
            both = (x[rows_in] @ w[e]).float().view(n, -1, 2, moe.INTERLEAVE)
            h[rows_out] = (torch.nn.functional.silu(both[:, :, 0]) * both[:, :, 1]) \
                .reshape(n, F).to(torch.bfloat16)
        return h

    def down_inputs(rng):
        h = np.zeros((tiles * BT, F), BF16)
        h[pairs] = rng.standard_normal((len(pairs), F), dtype=np.float32).astype(BF16)
        return [h, weights(rng, (F, H)), sorted_token, tile_expert, indptr]

    def torch_down(h, w, *_):
        y = torch.zeros((tiles * BT, H), dtype=torch.float32, device=h.device)
        for e, _rows_in, rows_out in plan_on(h.device):
            y[rows_out] = (h[rows_out] @ w[e]).float()
        return y

    def align_inputs(rng):
        return [random_topk(rng).astype(np.int32)]

    def combine_inputs(rng):
        topw = rng.dirichlet(np.ones(K), tokens).astype(np.float32)
        y = rng.standard_normal((tiles * BT, H), dtype=np.float32)
        return [topw, pair_row, pair_row // BT, y]

    def torch_combine(topw, rows, _tiles, y):
        return (y[rows.long()] * topw[..., None]).sum(1).to(torch.bfloat16)

    label, expert_bytes = f"T={tokens} {len(routed)} experts", len(routed) * H * F * 2
    yield Case("align", f"T={tokens}", graphs["align"], one_call_dims("align", tokens),
               align_inputs, lambda t: torch_align(t, E, BT, tiles),
               4 * (tokens * K * 3 + 2 * E + 1 + tiles * (BT + 1)), "TB/s",
               copies=64)  # the routing of a layer's call is in L2: top-k just wrote it
    if tokens >= moe.ALIGN_CHUNK_TOKENS:  # the same over several CTAs: count, offsets, place
        yield Case("align_chunks", f"T={tokens}", graphs["align_chunked"],
                   one_call_dims("align_chunked", tokens), align_inputs,
                   lambda t: torch_align(t, E, BT, tiles),
                   4 * (tokens * K * 3 + 2 * E + 1 + tiles * (BT + 1)), "TB/s", copies=64)
    yield Case("gate_up", label, graphs["gate_up"], one_call_dims("gate_up", tokens),
               gate_up_inputs, torch_gate_up,
               2 * expert_bytes + 2 * (tokens * H + len(pairs) * F), "TB/s",
               lambda out: out[pairs])
    yield Case("down", label, graphs["down"], one_call_dims("down", tokens), down_inputs,
               torch_down, expert_bytes + len(pairs) * (2 * F + 4 * H), "TB/s",
               lambda out: out[pairs])
    yield Case("combine", f"T={tokens}", graphs["combine"], one_call_dims("combine", tokens),
               combine_inputs, torch_combine, tokens * (K * (4 * H + 12) + 2 * H), "TB/s")


def gemm_graph(tile):
    """One call of a GEMM tile over the whole product."""
    @graph_func
    def gemm_only(A: Tensor(("M", "K"), "bfloat16"), B: Tensor(("K", "N"), "bfloat16")):
        M, N = A.shape[0], B.shape[1]
        return call_device(tile, tile_num=(M // GEMM_TILE["bm"], N // GEMM_TILE["bn"]),
                           args=[A, B], out=Tensor((M, N), "bfloat16"))

    return gemm_only


def gemm_cases(shapes, stages):
    """(tile, label, graph, dims, input shapes, torch op, FLOPs, "TFLOP/s") of the wgmma GEMM,
    its stages loaded by cp.async ("gemm") and by TMA ("gemm_tma", and "gemm_tma_staged" with
    the tile staged through shared memory on its way out), for each ring depth."""
    for depth in stages:
        for name, loads, stores in (("gemm", "cp.async", "fragments"),
                                    ("gemm_tma", "tma", "fragments"),
                                    ("gemm_tma_staged", "tma", "staged")):
            graph = gemm_graph(wgmma_gemm.make_wgmma_gemm_tile(**GEMM_TILE, stages=depth,
                                                               loads=loads, stores=stores))
            for M, K, N in shapes:
                yield Case(name, f"{M}x{K}x{N} s{depth}", graph, {"M": M, "K": K, "N": N},
                           gaussian((M, K), (K, N)), torch.matmul, 2 * M * K * N, "TFLOP/s")


def to_torch(x: np.ndarray):
    if x.dtype == BF16:
        return torch.from_numpy(x.view(np.int16)).cuda().view(torch.bfloat16)
    return torch.from_numpy(x).cuda()


def flat(out) -> np.ndarray:
    """One float64 vector of an output or a tuple of outputs (NumPy or PyTorch)."""
    parts = out if isinstance(out, tuple) else (out,)
    return np.concatenate([(p.float().cpu().numpy() if isinstance(p, torch.Tensor) else p)
                           .astype(np.float64).ravel() for p in parts])


class Mismatch(Exception):
    """A tile's output missed PyTorch's: its row is not timed."""


def measure(case: Case, rng, reps, strategy: str = "unfused"):
    """Median us of one call of the tile (its graph built with ``strategy``) and of PyTorch,
    after a check of the tile against PyTorch (``Mismatch`` where the norm of the difference
    is 2% of PyTorch's or more).

    Each side is captured into a CUDA graph of one call per input copy, so that neither the
    host's call path nor the launch gaps count: the numbers are the kernels' own."""
    dev = tvm.cuda(0)
    host = [case.inputs(rng)]
    copies = case.copies or max(1, -(-2 * L2_BYTES // sum(x.nbytes for x in host[0])))
    host += [case.inputs(rng) for _ in range(copies - 1)]
    on_tvm = [[tvm.runtime.tensor(x, dev) for x in arrays] for arrays in host]
    on_torch = [[to_torch(x) for x in (case.torch_inputs or list)(arrays)] for arrays in host]
    compiled = build(case.graph, case.dims, strategy=strategy)
    pick = case.pick or (lambda out: out)
    got = flat(pick(compiled(*host[0])))
    want = flat(pick(case.torch_op(*on_torch[0])))
    error = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    if not error < 2e-2:
        raise Mismatch(f"relative error {error:.2e} against PyTorch")
    etc, _ = cuda_graph(lambda: [compiled.run(*inputs) for inputs in on_tvm])
    reference, _ = cuda_graph(lambda: [case.torch_op(*inputs) for inputs in on_torch])
    times = time_interleaved({"etc": etc, "torch": reference}, reps=reps)
    return {k: t / copies for k, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 3, 16])
    parser.add_argument("--hidden", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32],
                        help="sequences of the decode attention rows")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096],
                        help="cached tokens a sequence of the decode attention rows")
    parser.add_argument("--attention-heads", type=int, nargs=3, default=[32, 4, 128],
                        metavar=("HQ", "HK", "D"),
                        help="query heads, KV heads and head dim of the decode attention rows")
    parser.add_argument("--attention-splits", nargs="+",
                        default=["256x4", "auto", "autoxa"],
                        metavar="SPLIT",
                        help="the split tasks' tokens and rows loaded ahead a thread "
                        "(CHUNKxUNROLL), or the tensor-core split tile's tokens (CHUNKxmma) "
                        "and its slices and stages (CHUNKxmmaSUBxSTAGES), or that tile with "
                        "the chunk and merge parts the GPU's cost model picks for each batch "
                        "and context (auto, attention.split_cost_model), each with xmPARTS for "
                        "a block's merge in PARTS tasks, and the tensor-core ones with xa for a "
                        "split that appends this step's rows itself; one attention row each")
    parser.add_argument("--attention-page", type=int,
                        help="tokens a page: the decode attention rows over a paged cache "
                        "(pages dealt at random; PyTorch over the contiguous cache)")
    parser.add_argument("--gemm", nargs="*", default=["4096x4096x4096", "8192x8192x8192"],
                        help="M x K x N of the compute-bound GEMM rows")
    parser.add_argument("--gemm-stages", type=int, nargs="+", default=[4],
                        help="ring depths of the GEMM rows (s<depth> in the shape column)")
    parser.add_argument("--tiles", nargs="+", metavar="TILE",
                        help="only the rows of these tiles (gemv, mma16, swapped, rmsnorm, "
                        "silu_mul, residual_add, attention, qk_norm_rope, router, align, "
                        "align_chunks, gate_up, down, combine, gemm, gemm_tma, "
                        "gemm_tma_staged)")
    parser.add_argument("--strategy", choices=("unfused", "static"), default="unfused",
                        help="how our side runs: a grid launch a call, or a one-call "
                        "megakernel")
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--json", default="bench_tiles.json")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    gemms = [tuple(int(v) for v in g.split("x")) for g in args.gemm]
    results, mismatches = [], []
    print(f"{'tile':>12} {'shape':>24} {'etc us':>9} {'torch us':>9} {'etc rate':>9} "
          f"{'torch rate':>10} {'unit':>7} {'torch/etc':>9}", flush=True)
    for case in (*cases(args.rows, args.hidden, args.vocab),
                 *decode_cases(args.rows, args.batches, args.contexts,
                               attention.AttentionHeads(*args.attention_heads),
                               args.attention_splits, args.attention_page,
                               attention.split_cost_model(torch.cuda.get_device_name())),
                 *routed_cases(args.rows),
                 *gemm_cases(gemms, args.gemm_stages)):
        if args.tiles and case.tile not in args.tiles:
            continue
        tile, label, amount, unit = case.tile, case.label, case.amount, case.unit
        try:
            t = measure(case, rng, args.reps, args.strategy)
        except Mismatch as error:
            mismatches.append({"tile": tile, "shape": label, "error": str(error)})
            print(f"{tile:>12} {label:>24} not timed: {error}", flush=True)
            continue
        row = {"tile": tile, "shape": label, "unit": unit, "strategy": args.strategy,
               "etc_us": t["etc"],
               "torch_us": t["torch"], "etc_rate": amount / t["etc"] / 1e6,
               "torch_rate": amount / t["torch"] / 1e6}
        results.append(row)
        print(f"{tile:>12} {label:>24} {row['etc_us']:>9.2f} {row['torch_us']:>9.2f} "
              f"{row['etc_rate']:>9.3f} {row['torch_rate']:>10.3f} {unit:>7} "
              f"{row['torch_us'] / row['etc_us']:>8.2f}x", flush=True)
    with open(args.json, "w") as f:
        json.dump(results + mismatches, f, indent=1)
    if mismatches:
        sys.exit(f"{len(mismatches)} rows missed PyTorch (not timed): "
                 + ", ".join(f"{m['tile']} {m['shape']}" for m in mismatches))


if __name__ == "__main__":
    main()
