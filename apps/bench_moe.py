"""The Qwen3-30B-A3B MoE layer as one graph function, against PyTorch and Hugging Face.

The layer of apps/moe_layer.py (hidden 2048, 128 experts, top-8 with renormalised weights,
expert intermediate 768, bf16 weights drawn at random; ``--model`` for another model's
shapes, ``moe_layer.MODELS``) at several token counts, under every execution strategy of
the same tiles, against:

- "torch loop": PyTorch eager as a layer is usually written (router, softmax, top-k, one
  pair of matmuls per expert that has tokens, ``index_add_``);
- "HF": transformers' ``Qwen3MoeSparseMoeBlock`` with ``_experts_implementation =
  "grouped_mm"``, eager and replayed from a CUDA graph ("HF+graph").

Each variant's output is checked against a float64 PyTorch layer that picks the experts
the device picks (the activations and router weights lie on a grid where fp32 logits are
exact; ``moe_layer.make_routing_inputs``). Our variants must be within ``RTOL``; the HF block
rounds its router logits to bf16, so near ties may pick other experts: its error is printed,
not asserted. Times are medians of CUDA events around one call, the variants taking turns
(``timing.time_interleaved``); "+graph" variants replay a CUDA graph of one call, the others
include the host's call path. ``--configs`` puts several layer configurations (task widths,
router splits, CTAs an SM, ...) in the same timing loop, so that they compare on one machine
at one moment. Prints one table (us: a line per configuration and token count, whose last
columns are the ratios of HF+graph and of our barrier megakernel over our dynamic one, then
the baselines) and writes JSON (``--json``).
"""
import argparse
import json
import shlex

import ml_dtypes
import numpy as np
import torch

import moe_layer
from etc_tvm import build
from etc_tvm.errors import EtcError
from etc_tvm.tir_sched.persistent import KernelOptions
from etc_tvm.runtime import cuda_graph
from etc_tvm.tiles import moe
from timing import checked_run, kernel_times, time_interleaved

RTOL = 2e-2  # bf16 h and out, fp32 accumulation: measured errors are near 3e-3
OURS = ["static", "dynamic", "mixed", "barrier", "unfused", "unfused+graph", "static+graph",
        "dynamic+graph", "barrier+graph"]
THEIRS = ["torch loop", "HF", "HF+graph"]


def on_gpu(a: np.ndarray) -> torch.Tensor:
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16)).cuda().view(torch.bfloat16)
    return torch.from_numpy(a).cuda()


def torch_loop_layer(x, w_router, w_gate, w_up, w_down, top_k):
    """PyTorch eager, bf16 matmuls: one gate/up/down triple per expert with tokens."""
    logits = (x @ w_router).float()
    topw, topk = torch.topk(torch.softmax(logits, dim=1), top_k, dim=1)
    topw = topw / topw.sum(dim=1, keepdim=True)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in topk.unique().tolist():
        token, slot = (topk == e).nonzero(as_tuple=True)
        rows = x[token]
        h = torch.nn.functional.silu(rows @ w_gate[e]) * (rows @ w_up[e])
        out.index_add_(0, token, topw[token, slot, None] * (h @ w_down[e]).float())
    return out.to(torch.bfloat16)


def hf_block(w_gate, w_up, w_down, top_k):
    """transformers' Qwen3MoeSparseMoeBlock (grouped_mm experts) holding these expert weights
    (w_gate, w_up (E, H, F)) and routing to ``top_k``: ``(run(x), its router weight (E,
    H))``."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    E, H, F = w_gate.shape
    config = Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=top_k,
                            moe_intermediate_size=F, norm_topk_prob=True)
    config._experts_implementation = "grouped_mm"
    block = Qwen3MoeSparseMoeBlock(config).to(device="cuda", dtype=torch.bfloat16).eval()
    want = {"gate.weight": torch.zeros(E, H),  # HF weights are (out, in)
            "experts.gate_up_proj": torch.cat([w_gate, w_up], dim=2).transpose(1, 2),
            "experts.down_proj": w_down.transpose(1, 2)}
    for e in range(E):  # transformers before grouped experts: one MLP module per expert
        want |= {f"experts.{e}.gate_proj.weight": w_gate[e].t(),
                 f"experts.{e}.up_proj.weight": w_up[e].t(),
                 f"experts.{e}.down_proj.weight": w_down[e].t()}
    params = dict(block.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            if name not in want or want[name].shape != p.shape:
                raise RuntimeError(f"Qwen3MoeSparseMoeBlock parameter {name} {tuple(p.shape)}: "
                                   "layout not known to this benchmark")
            p.copy_(want[name])

    def run(x):
        with torch.no_grad():
            out = block(x.view(1, *x.shape))
        return (out[0] if isinstance(out, tuple) else out).view(x.shape)

    return run, params["gate.weight"]


def relative_error(got, want) -> float:
    got = got.float().cpu().numpy() if isinstance(got, torch.Tensor) else got
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want))


def layer_parser() -> argparse.ArgumentParser:
    """The options that shape our layer: the command line's, and each of ``--configs``'
    over them."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--model", choices=moe_layer.MODELS, default="qwen3-30b-a3b",
                        help="whose MoE layer shapes (hidden, experts, top-k, intermediate: "
                        "moe_layer.MODELS); one for all --configs, which share its weights")
    parser.add_argument("--ctas-per-sm", type=int,
                        help="persistent CTAs per SM of the megakernels (default: "
                        "moe_layer.ctas_per_sm_for the tiles' threads and engine: 2 of 128 "
                        "threads, whose hand-offs and memory latency overlap the other CTA's "
                        "task, 1 of 256; on swapped tiles 4 of 128 threads, 2 of 256; 1 "
                        "where moe_layer.one_round_columns_for cuts a round of tasks)")
    parser.add_argument("--tile-rows", type=int, help="grouped GEMM tile rows (default: "
                        "moe_layer.tile_rows_for the tokens)")
    parser.add_argument("--bn", type=int, help="grouped GEMM task columns (default: the "
                        "layer's choice for the tile rows and tokens)")
    parser.add_argument("--down-bn", type=int, help="the down tasks' columns (default: --bn)")
    parser.add_argument("--engine", choices=moe.ENGINES,
                        help="the grouped GEMMs' MMA (default: moe_layer.grouped_engine_for "
                        "the tokens: swapped wgmma tiles from 2 tokens while an expert's "
                        "pairs fit 192 rows (two warpgroups past 96), else wgmma; mma for "
                        "the 16-row tiles of one token)")
    parser.add_argument("--bk", type=int,
                        help="the grouped GEMMs' K slice (default: moe_layer.expert_tiles' "
                        "choice; 32 on wgmma tiles keeps A in 64-byte swizzled rows, more "
                        "stages in the same shared memory)")
    parser.add_argument("--down-bk", type=int, help="the down tiles' K slice (default: --bk "
                        "where given; TMA down tiles need a multiple of 64)")
    parser.add_argument("--stages", type=int, help="the grouped GEMMs' ring depth (default: "
                        "the deepest that fits a CTA's share of the SM)")
    parser.add_argument("--down-stages", type=int, help="the down tiles' ring depth (default: "
                        "--stages where given)")
    parser.add_argument("--experts-per-task", type=int, help="experts a router task scores "
                        "(default: moe_layer.ROUTER_BLOCKS of the router's engine)")
    parser.add_argument("--threads", type=int,
                        help="threads of every tile (and of the megakernels' CTAs; default: "
                        "moe_layer.layer_threads_for the tile rows)")
    parser.add_argument("--router-splits", type=int, help="splits of the hidden rows over "
                        "router tasks (default: moe_layer.router_splits_for the tokens)")
    parser.add_argument("--block-tokens", type=int, help="tokens a top-k task takes (default: "
                        "moe_layer.ROUTER_BLOCKS of the router's engine)")
    parser.add_argument("--router-tokens", type=int, help="tokens a router task scores, a "
                        "multiple of --block-tokens (default: moe_layer.router_block_for the "
                        "tokens)")
    parser.add_argument("--router-engine", choices=moe.ROUTER_ENGINES,
                        help="the router's engine (default: moe_layer.router_engine_for the "
                        "tokens)")
    parser.add_argument("--combine-cols", type=int, help="output columns a combine task "
                        "writes (default: moe_layer.combine_cols_for the tokens)")
    parser.add_argument("--combine-tokens", type=int, help="tokens a combine task sums "
                        "(default: moe_layer.combine_tokens_for the tokens)")
    parser.add_argument("--combine-prefetch", action="store_true",
                        help="combine tasks first ask for their rows of y in L2")
    parser.add_argument("--y-dtype", choices=moe.Y_DTYPES, default="bfloat16",
                        help="how the down GEMM's output, which the combine reads back, is "
                        "stored (bf16, as the HF block's experts return theirs: at T=1024 on "
                        "the H200, 1-2%% faster than fp32)")
    parser.add_argument("--align-tokens", type=int, help="tokens an align task walks, 0 for "
                        "one align task (default: moe_layer.align_tokens_for the tokens)")
    parser.add_argument("--fused-route", action=argparse.BooleanOptionalAction,
                        help="top-k and the one align task as one task (moe.make_route_tile; "
                        "default: wherever align is one task, moe_layer.options_for)")
    parser.add_argument("--weights", choices=("blocked", "in-place"), default="blocked",
                        help="our expert weights' layout: moe.block_columns (each task's slab "
                        "contiguous; at T=1024 on the H200, 3-5%% faster) or (E, K, N)")
    parser.add_argument("--claim", action=argparse.BooleanOptionalAction, default=False,
                        help="the static and barrier megakernels' CTAs claim the tasks in "
                        "id order at run time (KernelOptions.claim)")
    parser.add_argument("--down-loads", choices=("cp.async", "tma"), default="cp.async",
                        help="how the down tiles fill their rings (wgmma tiles: TMA loads of "
                        "h's rows and the weight slab; default cp.async)")
    parser.add_argument("--early-weights", action=argparse.BooleanOptionalAction,
                        help="down tasks issue their first weight slices before they wait "
                        "for their rows of h, a task prelude (default: below "
                        f"{moe_layer.EARLY_WEIGHTS_BELOW} tokens)")
    parser.add_argument("--routed-gate-up", action=argparse.BooleanOptionalAction,
                        help="gate_up tasks route themselves from the router's logits and "
                        "wait for the router only (moe.LogitRouting; default: below "
                        f"{moe_layer.ROUTED_GATE_UP_BELOW} tokens)")
    parser.add_argument("--place-offsets", action=argparse.BooleanOptionalAction,
                        help="align's place tasks sum the chunks' counts themselves, with no "
                        "offsets task (moe.make_align_rows_tile; default: wherever align runs "
                        "over several CTAs)")
    parser.add_argument("--topk-counts", action=argparse.BooleanOptionalAction,
                        help="the top-k tasks count their picks per expert, so that align is "
                        "one call (moe.make_topk_tile(counts=True); where --place-offsets "
                        "is on; default: moe_layer.topk_counts_for the tokens)")
    return parser


def parse_configs(specs, base: argparse.Namespace) -> dict[str, argparse.Namespace]:
    """``NAME=FLAGS`` specs -> name -> layer options: ``base`` with FLAGS (``layer_parser``'s
    options, as on a command line) over it; no specs: ``{"": base}``."""
    configs = {}
    for spec in specs or ():
        name, sep, flags = spec.partition("=")
        if not sep or not name or name in configs:
            raise SystemExit(f"--configs: {spec!r} is not a new NAME=FLAGS")
        configs[name] = layer_parser().parse_args(shlex.split(flags),
                                                  argparse.Namespace(**vars(base)))
        if configs[name].model != base.model:
            raise SystemExit(f"--configs: {name}: the configurations share the weights of "
                             "one --model; give it outside --configs")
    return configs or {"": base}


def layer_options(tokens: int, options: argparse.Namespace, **shape) -> dict:
    """``moe_layer.make_moe_layer``'s options at ``tokens`` for ``layer_parser``'s
    ``options`` (``moe_layer.options_for`` filling in what they leave open), the layer of
    ``options.model``'s shapes with ``shape``'s over them (``intermediate=...``)."""
    return moe_layer.options_for(
        tokens, **{**moe_layer.MODELS[options.model], **shape}, tile_rows=options.tile_rows,
        engine=options.engine,
        router_splits=options.router_splits, router_engine=options.router_engine,
        block_tokens=options.block_tokens, router_tokens=options.router_tokens, bn=options.bn,
        down_bn=options.down_bn, bk=options.bk, down_bk=options.down_bk, stages=options.stages,
        down_stages=options.down_stages,
        threads=options.threads, experts_per_task=options.experts_per_task,
        ctas_per_sm=options.ctas_per_sm,
        combine_cols=options.combine_cols, combine_tokens=options.combine_tokens,
        combine_prefetch=options.combine_prefetch,
        blocked_weights=options.weights == "blocked",
        y_dtype=options.y_dtype, align_tokens=options.align_tokens,
        fused_route=options.fused_route, down_loads=options.down_loads,
        early_weights=options.early_weights, place_offsets=options.place_offsets,
        topk_counts=options.topk_counts, routed_gate_up=options.routed_gate_up)


def our_runs(tokens: int, options: argparse.Namespace, weights, inputs, want, ours,
             prefix: str = "") -> tuple[dict, dict]:
    """(runs, description) of one layer configuration at ``tokens``: ``prefix`` + label ->
    a checked run of each of ``ours`` (the grouped GEMMs on ``options.engine`` where their
    tiles have 64 rows), and what the configuration resolved to, with the variants not run
    and why."""
    import tvm

    layer = layer_options(tokens, options)
    about = {**layer, "skipped": {}}
    expert_weights = weights["ours"]
    if layer["blocked_weights"]:  # laid out once for each task width the rows take
        key = ("blocked", layer["tile_rows"], layer["bn"], layer["down_bn"])
        if key not in weights:
            weights[key] = moe_layer.blocked_expert_weights(*expert_weights, *key[1:])
        expert_weights = weights[key]
    inputs = (*inputs, *expert_weights)
    on_device = [tvm.runtime.tensor(a, tvm.cuda(0)) for a in inputs]
    kernel_options = KernelOptions(ctas_per_sm=layer["ctas_per_sm"], claim=options.claim)
    runs, libraries = {}, {}
    for label in ours:
        strategy, replay = label.split("+")[0], label.endswith("+graph")
        try:
            if strategy not in libraries:
                graph = moe_layer.make_moe_layer(**layer)
                libraries[strategy] = build(graph, {"T": tokens}, strategy=strategy,
                                             options=kernel_options)
        except EtcError as err:  # a strategy that cannot run this graph says why
            about["skipped"][label] = str(err).splitlines()[0]
            continue
        try:
            runs[prefix + label] = checked_run(label, libraries[strategy], on_device, want,
                                               RTOL, replay)
        except (AssertionError, EtcError) as err:  # wrong results are reported, not timed
            about["skipped"][label] = f"FAILED: {err}"
        except tvm.error.InternalError as err:  # so is a launch the device refuses
            about["skipped"][label] = f"FAILED: {str(err).splitlines()[0]}"
    return runs, about


def measure(tokens: int, model: dict, weights, hf, rng, reps: int, configs: dict,
            ours=tuple(OURS), kernels: bool = False, queued: bool = False,
            routing: str = "random") -> dict:
    """One row: us per call of each of ``ours`` under each of ``configs`` (name -> layer
    options; a named one's labels are ``name:label``) and of the baselines at ``tokens``, all
    taking turns in one timing loop, and the errors; with ``kernels``, the GPU kernels each of
    ours launches and their times. ``model``: the layer's shapes (``moe_layer.MODELS``),
    ``routing``: ``moe_layer.ROUTINGS``."""
    x, w_router = moe_layer.make_routing_inputs(rng, tokens, model["hidden"], model["experts"],
                                                routing)
    xt, wrt = on_gpu(x), on_gpu(w_router)
    want = moe_layer.layer_float64_torch(xt, wrt, *weights["torch"], model["top_k"])
    row = {"tokens": tokens, **model, "queued": queued, "routing": routing, "configs": {},
           "error": {}}
    runs = {}
    for name, options in configs.items():
        mine, row["configs"][name] = our_runs(tokens, options, weights, (x, w_router), want,
                                              ours, f"{name}:" if name else "")
        runs |= mine
    hf_run, hf_router = hf
    with torch.no_grad():
        hf_router.copy_(wrt.t())
    runs["torch loop"] = lambda: torch_loop_layer(xt, wrt, *weights["torch"], model["top_k"])
    row["error"]["torch loop"] = relative_error(runs["torch loop"](), want)
    runs["HF"] = lambda: hf_run(xt)
    row["error"]["HF"] = relative_error(hf_run(xt), want)
    runs["HF+graph"], out = cuda_graph(lambda: hf_run(xt))
    runs["HF+graph"]()
    row["error"]["HF+graph"] = relative_error(out, want)
    row["us"] = time_interleaved(runs, reps=reps, queued=queued)
    if kernels:
        row["kernels"] = {label: kernel_times(runs[label]) for label in runs
                          if label.split(":")[-1] in ours}
    return row


def print_row(row: dict, ours) -> None:
    """A line per configuration (its variants, and the ratios of HF+graph and of our barrier
    megakernel over our dynamic one), then the baselines and what each configuration was."""
    us = row["us"]
    for name in row["configs"]:
        mine = {v: us.get(f"{name}:{v}" if name else v) for v in ours}
        cells = " ".join(f"{mine[v]:13.1f}" if mine[v] else f"{'n/a':>13}" for v in ours)
        ratios = [f"{a / b:12.2f}x" if a and b else f"{'n/a':>13}"
                  for a, b in ((us["HF+graph"], mine.get("dynamic")),
                               (mine.get("barrier"), mine.get("dynamic")))]
        print(f"{row['tokens']:>6} {name or '-':>10} {cells} {' '.join(ratios)}", flush=True)
    print(f"{'':>17} " + ", ".join(f"{v} {us[v]:.1f}" for v in THEIRS) + "; errors: "
          + ", ".join(f"{k} {v:.1e}" for k, v in row["error"].items()), flush=True)
    for name, about in row["configs"].items():
        print(f"{'':>17} {name or '-'}: {about['tile_rows']}-row expert tiles on "
              f"{about['engine']}, {about['threads']} threads, {about['ctas_per_sm']} CTAs "
              f"an SM, router tasks of "
              f"{about['router_tokens']} tokens x {about['experts_per_task']} experts over "
              f"{about['router_splits']} splits on {about['router_engine']}"
              + f", tasks of {about['bn']} (gate_up) and {about['down_bn']} (down) columns"
              + (f" on rings of {about['stages']} stages" if about["stages"]
                 else " on the deepest rings that fit")
              + (f" ({about['down_stages']} for down)" if about.get("down_stages") else "")
              + f", combine tasks of {about['combine_tokens']} tokens x {about['combine_cols']}"
              + " columns" + (" (rows prefetched into L2)" if about.get("combine_prefetch")
                              else "")
              + (", down weights before the wait" if about.get("early_weights") else "")
              + (", gate_up routed from the logits" if about.get("routed_gate_up") else "")
              + (f", align over tasks of {about['align_tokens']} tokens"
                 if about["align_tokens"] else ", top-k and align in one task"
                 if about.get("fused_route") else ", one align task")
              + f", y in {about['y_dtype']}"
              + f"{', blocked weights' if about['blocked_weights'] else ''}"
              + "".join(f"; {k} not run: {why}" for k, why in about["skipped"].items()),
              flush=True)
    for label, kernels in row.get("kernels", {}).items():
        print(f"{'':>17} {label} ({row['us'][label]:.1f} us a call) launches "
              + ", ".join(f"{name[:40]} {us:.1f} us" for name, us in kernels), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(parents=[layer_parser()])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 1024, 4096])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--json", default="bench_moe.json")
    parser.add_argument("--ours", nargs="+", default=OURS, choices=OURS,
                        help="our variants to run (the baselines always run)")
    parser.add_argument("--configs", nargs="+", metavar="NAME=FLAGS",
                        help="layer configurations that take turns in one timing loop, each "
                        "the layer options above over the command line's, e.g. "
                        "base= narrow='--bn 32'")
    parser.add_argument("--kernels", action="store_true",
                        help="also list the GPU kernels each of our variants launches, with "
                        "their device times")
    parser.add_argument("--queued", action="store_true",
                        help="time each call queued behind a sleep kernel: the device's time "
                        "alone, without the host's launch latency (timing.time_interleaved)")
    parser.add_argument("--routing", choices=moe_layer.ROUTINGS, default="random",
                        help="the tokens' routing: random, every token's first choice one "
                        "expert (one_expert: its tiles many, the others' few), or the odd "
                        "experts idle (moe_layer.make_routing_inputs)")
    args = parser.parse_args()
    configs = parse_configs(args.configs, args)
    model = moe_layer.MODELS[args.model]
    rng = np.random.default_rng(0)
    w_gate_up, w_down = moe_layer.make_expert_weights(rng, model["hidden"], model["experts"],
                                                      model["intermediate"])
    w_gate, w_up = (on_gpu(np.ascontiguousarray(w)) for w in moe.split_gate_up(w_gate_up))
    weights = {"ours": (w_gate_up, w_down), "torch": (w_gate, w_up, on_gpu(w_down))}
    hf = hf_block(*weights["torch"], model["top_k"])
    print(f"{args.model}: hidden {model['hidden']}, {model['experts']} experts, top-"
          f"{model['top_k']}, expert intermediate {model['intermediate']}", flush=True)
    print(f"{'tokens':>6} {'config':>10} " + " ".join(f"{v:>13}" for v in args.ours)
          + f" {'HF+graph/dyn':>13} {'barrier/dyn':>12}", flush=True)
    rows = []
    for tokens in args.tokens:
        rows.append(measure(tokens, model, weights, hf, rng, args.reps, configs, args.ours,
                            args.kernels, args.queued, args.routing))
        print_row(rows[-1], args.ours)
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
