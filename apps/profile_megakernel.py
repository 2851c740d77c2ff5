"""Where the time of a megakernel goes, task by task: the graphs of apps/bench_overhead.py and
the MoE layer of apps/moe_layer.py built to profile (``KernelOptions(profile=True)``) under
several strategies.

For each graph and strategy: the per-call table of ``Timeline.summary`` (median wait and body
per task, busy time), the makespan and the median hand-off between consecutive tasks of an
SM; and a Chrome trace per run in ``--out`` (open in Perfetto or chrome://tracing). The second
of two runs is the one shown (the first loads the kernel).
"""
import argparse
from pathlib import Path

import ml_dtypes
import numpy as np

import moe_layer
from bench_overhead import chain, make_mlp, make_split_k_mlp
from etc_tvm import build
from etc_tvm.tiles import moe
from etc_tvm.tir_sched.persistent import KernelOptions

WIDTH = 128


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--chain", type=int, default=256, help="links of the chain")
    parser.add_argument("--rows", type=int, default=128, help="MLP rows (a multiple of 16)")
    parser.add_argument("--strategies", nargs="+", default=["static", "dynamic", "barrier"])
    parser.add_argument("--graphs", nargs="+", default=["chain", "mlp", "mlp-split-k"],
                        choices=["chain", "mlp", "mlp-split-k", "moe"])
    parser.add_argument("--moe-tokens", type=int, nargs="+", default=[1, 1024],
                        help="token counts of the MoE layer (Qwen3-30B-A3B sizes)")
    parser.add_argument("--moe-engine", choices=moe.ENGINES,
                        help="the MoE layer's grouped-GEMM engine (default: "
                        "moe_layer.grouped_engine_for the tokens)")
    parser.add_argument("--moe-tile-rows", type=int, help="the MoE grouped GEMM tiles' rows "
                        "(default: moe_layer.tile_rows_for the tokens)")
    parser.add_argument("--moe-bn", type=int, help="the MoE grouped GEMM tasks' columns "
                        "(default: make_moe_layer's)")
    parser.add_argument("--moe-down-bn", type=int, help="the MoE down tasks' columns "
                        "(default: --moe-bn)")
    parser.add_argument("--moe-weights", choices=("blocked", "in-place"), default="blocked",
                        help="the MoE expert weights' layout (as apps/bench_moe.py)")
    parser.add_argument("--moe-experts-per-task", type=int, help="experts a MoE router task "
                        "scores (default: moe_layer.ROUTER_BLOCKS of the router's engine)")
    parser.add_argument("--moe-router-engine", choices=moe.ROUTER_ENGINES,
                        help="the MoE router's engine (default: moe_layer.router_engine_for "
                        "the tokens)")
    parser.add_argument("--moe-router-splits", type=int, help="splits of the hidden rows over "
                        "MoE router tasks (default: moe_layer.router_splits_for the tokens)")
    parser.add_argument("--moe-y-dtype", choices=moe.Y_DTYPES, default="bfloat16",
                        help="how the MoE down GEMM's output is stored (as bench_moe's)")
    parser.add_argument("--moe-align-tokens", type=int, help="tokens a MoE align task walks, "
                        "0 for one task (default: moe_layer.align_tokens_for the tokens)")
    parser.add_argument("--moe-early-weights", action=argparse.BooleanOptionalAction,
                        help="MoE down tasks issue their first weight slices before they wait "
                        "for h (as bench_moe's --early-weights; default: "
                        "moe_layer.early_weights_for the tokens)")
    parser.add_argument("--moe-routed-gate-up", action=argparse.BooleanOptionalAction,
                        help="MoE gate_up tasks route themselves from the router's logits "
                        "(as bench_moe's --routed-gate-up)")
    parser.add_argument("--moe-place-offsets", action=argparse.BooleanOptionalAction,
                        help="MoE place tasks sum align's counts themselves (as bench_moe's "
                        "--place-offsets; default: wherever align runs over several CTAs)")
    parser.add_argument("--moe-topk-counts", action=argparse.BooleanOptionalAction,
                        help="MoE top-k tasks count their picks per expert, align in one call "
                        "(as bench_moe's --topk-counts; default: moe_layer.topk_counts_for "
                        "the tokens)")
    parser.add_argument("--ctas-per-sm", type=int,
                        help="persistent CTAs per SM (the MoE layer's rings fit their share; "
                        "default: 1 for the chain and the MLPs, moe_layer.options_for's for "
                        "the MoE layer)")
    parser.add_argument("--claim", action="store_true",
                        help="the static and barrier CTAs claim their tasks at run time "
                        "(KernelOptions.claim)")
    parser.add_argument("--out", default="timelines")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    bf16 = ml_dtypes.bfloat16
    x = rng.standard_normal((args.rows, 2048)).astype(bf16)
    w1, w2 = ((rng.standard_normal((2048, 2048)) / 2048**0.5).astype(bf16) for _ in range(2))
    cases = {}  # name -> (graph, dims, inputs, CTAs an SM)
    ctas_per_sm = args.ctas_per_sm or 1
    if "chain" in args.graphs:
        cases[f"chain{args.chain}"] = (
            chain, {"N": args.chain},
            [rng.standard_normal((args.chain, WIDTH)).astype("float32")], ctas_per_sm)
    if "mlp" in args.graphs:
        cases[f"mlp{args.rows}"] = (make_mlp(16, 2048, 2048), {"M": args.rows}, [x, w1, w2],
                                    ctas_per_sm)
    if "mlp-split-k" in args.graphs:
        cases[f"mlp{args.rows}-split-k"] = (make_split_k_mlp(2048, 2048), {"M": args.rows},
                                            [x, w1, w2], ctas_per_sm)
    if "moe" in args.graphs:
        experts = moe_layer.make_expert_weights(rng, 2048, 128, 768)
        blocked = args.moe_weights == "blocked"
        for tokens in args.moe_tokens:
            options = moe_layer.options_for(
                tokens, tile_rows=args.moe_tile_rows, engine=args.moe_engine,
                router_splits=args.moe_router_splits,
                router_engine=args.moe_router_engine,
                bn=args.moe_bn, down_bn=args.moe_down_bn,
                experts_per_task=args.moe_experts_per_task, ctas_per_sm=args.ctas_per_sm,
                blocked_weights=blocked, y_dtype=args.moe_y_dtype,
                align_tokens=args.moe_align_tokens, early_weights=args.moe_early_weights,
                place_offsets=args.moe_place_offsets, topk_counts=args.moe_topk_counts,
                routed_gate_up=args.moe_routed_gate_up)
            graph = moe_layer.make_moe_layer(**options)
            weights = moe_layer.blocked_expert_weights(
                *experts, options["tile_rows"], options["bn"], options["down_bn"]) \
                if blocked else experts
            cases[f"moe{tokens}"] = (graph, {"T": tokens}, [
                *moe_layer.make_routing_inputs(rng, tokens, 2048, 128), *weights],
                options["ctas_per_sm"])
    for name, (graph, dims, inputs, ctas_per_sm) in cases.items():
        for strategy in args.strategies:
            compiled = build(graph, dims, strategy=strategy,
                             options=KernelOptions(profile=True, ctas_per_sm=ctas_per_sm,
                                                 claim=args.claim))
            compiled.profile(*inputs)
            _, timeline = compiled.profile(*inputs)
            print(f"\n{name}, {strategy}\n{timeline.summary()}")
            timeline.write_chrome_trace(out / f"{name}-{strategy}.json")


if __name__ == "__main__":
    main()
