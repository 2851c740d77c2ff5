"""The tile library: device functions for real operators, each with its NumPy reference.

One module per family; every tile is a factory result cached per configuration, so two graphs
that ask for the same configuration share one device function:

- ``gemm``: ``make_gemm_tile(bm, bn, bk, threads, out_dtype, stages)``: bf16 x bf16 -> fp32 or
  bf16 on tensor cores (``mma.sync.m16n8k16``), ``C[tile (i, j)] = A[rows i] @ B[:, cols j]``.
- ``wgmma_gemm``: ``make_wgmma_gemm_tile(bm, bn, bk, stages, threads, out_dtype)``: the same
  product for large, compute-bound shapes on sm_90a warpgroup MMA (``wgmma``), operands in a
  128-byte-swizzled shared ring; 256 threads by default (128 for tiles up to 128 x 128).
  ``swapped=True`` puts the weights on the instruction's m64 side, for row blocks of any
  multiple of 8, and ``split_k`` splits K as ``gemm``'s does: the bandwidth-bound GEMMs of a
  few rows.
- ``elementwise``: ``make_activation_tile(activation, out_dtype, rows, cols, threads)``:
  ReLU / GELU / SiLU over a ``rows x cols`` tile, fp32 in, fp32 or bf16 out.
- ``gemv``: ``make_gemv_tile(bn, split_k, threads)``: decode GEMV, 1..16 bf16 rows (M symbolic)
  against bf16 weights, bandwidth bound; ``make_gemv_sum_tile`` adds its split-K partials.
- ``norm``: ``make_rmsnorm_tile(eps, threads)``: RMSNorm of one bf16 row per task.
- ``elementwise`` also holds the decode epilogues over a column block of all rows:
  ``make_silu_mul_tile`` ([gate | up] -> silu(gate) * up) and ``make_residual_add_tile``.
- ``reduction``: ``make_row_sum_tile(rows, threads)`` and
  ``make_partial_row_sum_tile(rows, cols, threads)``: fp32 row sums, whole or per column block.
- ``attention``: decode attention with grouped-query heads (``AttentionHeads``: query heads,
  KV heads, head dim; Qwen3's 32, 4 and 128 by default; bf16) over a contiguous KV cache:
  ``make_kv_append_tile(heads)``, ``make_decode_split_tile(chunk, heads=heads)`` (one chunk of
  one sequence and block of up to 8 query heads of a KV head, flash-decoding partials) and
  ``make_decode_merge_tile(heads, parts)`` (a block's splits, in ``parts`` tasks); with
  ``page=`` the append and the split take a paged cache (a pool of pages and a block table);
  ``choose_split`` picks the tensor-core split's chunk and the merge's parts together, from a
  GPU's fitted ``SplitCostModel`` (``split_cost_model``).
- ``moe``: the MoE layer's router logits and top-K (renormalised weights), align (the padded CSR of
  expert tiles), grouped gate-up (SiLU-mul fused) and down GEMMs on ``gemm.MmaTile``, and the
  weighted combine; ``apps/moe_layer.py`` wires them into one graph.
- ``rope``: ``make_qk_norm_rope_tile``: Qwen3's per-head q/k RMSNorm and neox rotary.
- ``tp``: tensor-parallel tiles for graphs of several ranks, on ``wgmma_gemm.WgmmaTile``:
  ``make_gemm_scatter_tile`` and ``make_partial_sum_tile`` (GEMM + Reduce-Scatter),
  ``make_gather_rows_tile`` and ``make_ring_gemm_tile`` (All-Gather + GEMM);
  ``apps/tp_layers.py`` wires them into the two halves of a tensor-parallel MLP.

A megakernel runs every task with one thread count, so tiles used together must agree on it:
every family defaults to 128 threads (4 warps), and the default tile shapes line up (64-row
blocks, 64 x 64 GEMM and activation tiles), so ``"ij->ij"`` and ``"ij->i"`` edges connect them.
Each module states its numeric contract and gives an ``error_bound`` to check it against.
"""
from .attention import (
    AttentionHeads,
    decode_merge_tile,
    decode_split_tile,
    kv_append_tile,
    make_decode_merge_tile,
    make_decode_split_tile,
    make_kv_append_tile,
)
from .elementwise import (
    make_activation_tile,
    make_residual_add_tile,
    make_silu_mul_tile,
    relu_bf16_tile,
    relu_tile,
)
from .gemm import gemm_bf16_tile, gemm_tile, make_gemm_tile
from .gemv import gemv_tile, make_gemv_sum_tile, make_gemv_tile
from .norm import make_rmsnorm_tile, rmsnorm_tile
from .reduction import (
    make_partial_row_sum_tile,
    make_row_sum_tile,
    partial_row_sum_tile,
    row_sum_tile,
)
from .wgmma_gemm import make_wgmma_gemm_tile

__all__ = [
    "AttentionHeads",
    "decode_merge_tile", "decode_split_tile", "gemm_bf16_tile", "gemm_tile", "gemv_tile",
    "kv_append_tile", "make_activation_tile", "make_decode_merge_tile", "make_decode_split_tile",
    "make_gemm_tile", "make_gemv_sum_tile", "make_gemv_tile", "make_kv_append_tile",
    "make_partial_row_sum_tile", "make_residual_add_tile", "make_rmsnorm_tile",
    "make_row_sum_tile", "make_silu_mul_tile", "make_wgmma_gemm_tile", "partial_row_sum_tile",
    "relu_bf16_tile", "relu_tile", "rmsnorm_tile", "row_sum_tile",
]
