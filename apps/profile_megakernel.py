"""Where the time of a megakernel goes, task by task: the graphs of apps/bench_overhead.py,
the MoE layer of apps/moe_layer.py and decode attention (append, split, merge; the split
tasks as bench_tiles.py's ``--attention-splits`` builds them) built to profile
(``KernelOptions(profile=True)``) under several strategies. The MoE layer takes
apps/bench_moe.py's layer options (``--model``, ``--bn``, ``--routed-gate-up``, ...;
``bench_moe.layer_parser``), so that a configuration it times is profiled with the same
flags; ``--ctas-per-sm`` is 1 for the chain and the MLPs unless given, 2 for attention.

For each graph and strategy: the per-call table of ``Timeline.summary`` (median wait and body
per task, busy time), the makespan and the median hand-off between consecutive tasks of an
SM; and a Chrome trace per run in ``--out`` (open in Perfetto or chrome://tracing). The second
of two runs is the one shown (the first loads the kernel).
"""
import argparse
from pathlib import Path

import ml_dtypes
import numpy as np

import bench_moe
import moe_layer
from bench_overhead import chain, make_mlp, make_split_k_mlp
from bench_tiles import decode_attention_graph, decode_inputs, split_options
from etc_tvm import build
from etc_tvm.tiles.attention import QWEN3_30B_A3B
from etc_tvm.tir_sched.persistent import KernelOptions

WIDTH = 128


def main() -> None:
    parser = argparse.ArgumentParser(parents=[bench_moe.layer_parser()])
    parser.add_argument("--chain", type=int, default=256, help="links of the chain")
    parser.add_argument("--rows", type=int, default=128, help="MLP rows (a multiple of 16)")
    parser.add_argument("--strategies", nargs="+", default=["static", "dynamic", "barrier"])
    parser.add_argument("--graphs", nargs="+", default=["chain", "mlp", "mlp-split-k"],
                        choices=["chain", "mlp", "mlp-split-k", "moe", "attention"])
    parser.add_argument("--moe-tokens", type=int, nargs="+", default=[1, 1024],
                        help="token counts of the MoE layer (Qwen3-30B-A3B sizes)")
    parser.add_argument("--attention", nargs="+", metavar="BxLxSPLIT",
                        default=["1x16384x256xmma64x2", "1x16384x512xmma64x2"],
                        help="decode attention cases: B sequences of L cached tokens, split "
                             "tasks of bench_tiles' --attention-splits spec SPLIT")
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
        model = moe_layer.MODELS[args.model]
        experts = moe_layer.make_expert_weights(rng, model["hidden"], model["experts"],
                                                model["intermediate"])
        for tokens in args.moe_tokens:
            options = bench_moe.layer_options(tokens, args)
            graph = moe_layer.make_moe_layer(**options)
            weights = moe_layer.blocked_expert_weights(
                *experts, options["tile_rows"], options["bn"], options["down_bn"]) \
                if options["blocked_weights"] else experts
            cases[f"moe{tokens}"] = (graph, {"T": tokens}, [
                *moe_layer.make_routing_inputs(rng, tokens, model["hidden"], model["experts"]),
                *weights],
                options["ctas_per_sm"])
    if "attention" in args.graphs:
        heads = QWEN3_30B_A3B
        for case in args.attention:
            B, L, spec = case.split("x", 2)
            B, L = int(B), int(L)
            graph = decode_attention_graph(heads=heads,
                                           **split_options(spec, B, L, heads))
            cases[f"attention{case}"] = (graph, {"B": B, "L": L},
                                         decode_inputs(rng, B, L, heads), args.ctas_per_sm or 2)
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
