"""The tile library: device functions for real operators, each with its NumPy reference.

One module per family; every tile is a factory result cached per configuration, so two graphs
that ask for the same configuration share one device function:

- ``gemm``: ``make_gemm_tile(bm, bn, bk, threads, out_dtype, stages)``: bf16 x bf16 -> fp32 or
  bf16 on tensor cores (``mma.sync.m16n8k16``), ``C[tile (i, j)] = A[rows i] @ B[:, cols j]``.
- ``elementwise``: ``make_activation_tile(activation, out_dtype, rows, cols, threads)``:
  ReLU / GELU / SiLU over a ``rows x cols`` tile, fp32 in, fp32 or bf16 out.
- ``reduction``: ``make_row_sum_tile(rows, threads)`` and
  ``make_partial_row_sum_tile(rows, cols, threads)``: fp32 row sums, whole or per column block.
- ``moe``: the MoE layer's router (top-K, renormalised weights), align (the padded CSR of
  expert tiles), grouped gate-up (SiLU-mul fused) and down GEMMs on ``gemm.MmaTile``, and the
  weighted combine; ``apps/moe_layer.py`` wires them into one graph.
- ``rope``: ``make_qk_norm_rope_tile``: Qwen3's per-head q/k RMSNorm and neox rotary.

A megakernel runs every task with one thread count, so tiles used together must agree on it:
every family defaults to 128 threads (4 warps), and the default tile shapes line up (64-row
blocks, 64 x 64 GEMM and activation tiles), so ``"ij->ij"`` and ``"ij->i"`` edges connect them.
Each module states its numeric contract and gives an ``error_bound`` to check it against.
"""
from .elementwise import make_activation_tile, relu_bf16_tile, relu_tile
from .gemm import gemm_bf16_tile, gemm_tile, make_gemm_tile
from .reduction import (
    make_partial_row_sum_tile,
    make_row_sum_tile,
    partial_row_sum_tile,
    row_sum_tile,
)

__all__ = [
    "gemm_bf16_tile", "gemm_tile", "make_activation_tile", "make_gemm_tile",
    "make_partial_row_sum_tile", "make_row_sum_tile", "partial_row_sum_tile", "relu_bf16_tile",
    "relu_tile", "row_sum_tile",
]
