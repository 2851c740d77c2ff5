"""The MoE layer's two grouped GEMMs alone (``moe_layer.make_expert_gemms``): the same tiles as
megakernels and as their own grids, with no routing before them and no combine after them.

What the persistent runtime costs the tiles themselves, apart from the layer around them:
at 4096 tokens on the H200 the static megakernel of the whole layer took 11% longer than its
unfused launches, and these GEMMs alone 3% (docs/performance.md). For each token count, the
routing of ``moe_layer.make_routing_inputs`` is aligned on the host (``moe.align_reference``)
and the tiles take the layer's options at that count (``moe_layer.options_for``, with
bench_moe's defaults: two CTAs an SM, blocked weights, y in bf16; ``--configs`` measures
several side by side, with bench_moe's layer options). Each variant's y rows of
every (token, k) pair are checked against float64 before and after its timing; the
variants then take turns, replayed from CUDA graphs (``timing.time_interleaved``, queued).
Prints us per call and each megakernel over the unfused launches; with ``--kernels``, each
unfused grid's device time and the rate at which it reads its expert weights.
``--intermediate`` changes the experts' intermediate size F (down's K, gate_up's columns
over two), so that tasks of more or fewer K steps stream the same bytes a step; ``--model``
takes another model's shapes (``moe_layer.MODELS``).
"""
import argparse

import numpy as np
import torch
import tvm

import moe_layer
from bench_moe import RTOL, layer_options, layer_parser, on_gpu, parse_configs, relative_error
from etc_tvm import build
from etc_tvm.tiles import moe
from etc_tvm.tir_sched.persistent import KernelOptions
from timing import kernel_times, time_interleaved

VARIANTS = ("static", "barrier", "unfused")


def float64_pairs(x, topk, w_gate_up, w_down) -> np.ndarray:
    """y of every (token, k) pair, (T, K, H), in float64 from the same bf16 inputs."""
    w_gate, w_up = (on_gpu(np.ascontiguousarray(w)) for w in moe.split_gate_up(w_gate_up))
    xt, wd = on_gpu(x).double(), on_gpu(w_down)
    ys = torch.empty((*topk.shape, w_down.shape[2]), dtype=torch.float64, device="cuda")
    for e in np.unique(topk):
        token, k = (torch.from_numpy(i).cuda() for i in np.nonzero(topk == e))
        rows = xt[token]
        h = torch.nn.functional.silu(rows @ w_gate[e].double()) * (rows @ w_up[e].double())
        ys[token, k] = h @ wd[e].double()
    return ys.cpu().numpy()


def checked_replay(label: str, compiled, inputs, pair_row, want):
    """A CUDA-graph replay of ``compiled`` on ``inputs`` whose ``check()`` holds the y rows of
    the pairs to ``want``: once here, and again after the timing."""
    run, _ = compiled.capture(*inputs)

    def check():
        run()
        torch.cuda.synchronize()
        error = relative_error(np.asarray(run.checked(), np.float32)[pair_row], want)
        assert error < RTOL, f"{label}: relative error {error:.2e}"

    check()
    run.check = check
    return run


def measure(tokens: int, top_k: int, weights, rng, reps: int, configs: dict,
            kernels: bool = False) -> dict:
    """us per call of each of ``VARIANTS`` under each of ``configs`` (name -> bench_moe
    ``layer_parser`` options) at ``tokens``, ``top_k`` experts a token, all from one timing
    loop; each configuration's tiles in use and allotted; with ``kernels``, its unfused
    grids' device times."""
    (E, H, _), F = weights[0].shape, weights[1].shape[1]
    x, w_router = moe_layer.make_routing_inputs(rng, tokens, H, E)
    topk, _ = moe.route(x, w_router, top_k)
    want = float64_pairs(x, topk, *weights)
    runs, tiles, blocked = {}, {}, {}
    for name, options in configs.items():
        layer = layer_options(tokens, options, intermediate=F)
        rows = layer["tile_rows"]
        dims = moe_layer.expert_gemm_dims(tokens, E, top_k, rows)
        _, indptr, pair_row, sorted_token, tile_expert = moe.align_reference(topk, E, rows,
                                                                             dims["tiles"])
        expert_weights = weights
        if layer["blocked_weights"]:  # laid out once for each task width the rows take
            key = (rows, layer["bn"], layer["down_bn"])
            if key not in blocked:
                blocked[key] = moe_layer.blocked_expert_weights(*weights, *key)
            expert_weights = blocked[key]
        inputs = [tvm.runtime.tensor(a, tvm.cuda(0))
                  for a in (x, *expert_weights, sorted_token, tile_expert, indptr)]
        graph = moe_layer.make_expert_gemms(**layer)
        for variant in VARIANTS:
            compiled = build(graph, dims, strategy=variant, options=KernelOptions(
                ctas_per_sm=layer["ctas_per_sm"], claim=options.claim and variant != "unfused"))
            runs[name, variant] = checked_replay(f"{name or 'default'}: {variant}", compiled,
                                                 inputs, pair_row, want)
        tiles[name] = (int(indptr[E]), dims["tiles"])
    row = {"tokens": tokens, "tiles": tiles,
           "us": time_interleaved(runs, reps=reps, queued=True)}
    if kernels:
        row["kernels"] = {name: kernel_times(runs[name, "unfused"]) for name in configs}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     parents=[layer_parser()])
    parser.set_defaults(claim=True)  # the megakernels' CTAs claim their tasks
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--configs", nargs="+", metavar="NAME=FLAGS",
                        help="tile configurations measured side by side, each NAME=FLAGS with "
                        "bench_moe's layer options over the command line's")
    parser.add_argument("--intermediate", type=int,
                        help="the experts' intermediate size (default: --model's)")
    parser.add_argument("--kernels", action="store_true",
                        help="also each unfused grid's device time and weight read rate")
    args = parser.parse_args()
    configs = parse_configs(args.configs, args)
    rng = np.random.default_rng(0)
    model = moe_layer.MODELS[args.model]
    weights = moe_layer.make_expert_weights(rng, model["hidden"], model["experts"],
                                            args.intermediate or model["intermediate"])
    weight_bytes = {"h": weights[0].nbytes, "y": weights[1].nbytes}  # grids named by output
    print(f"{'tokens':>6} {'config':>10} {'tiles':>9} "
          + " ".join(f"{v + '+graph':>14}" for v in VARIANTS)
          + f" {'static/unfused':>15} {'barrier/unfused':>16}", flush=True)
    for tokens in args.tokens:
        row = measure(tokens, model["top_k"], weights, rng, args.reps, configs, args.kernels)
        for name in configs:
            us = {v: row["us"][name, v] for v in VARIANTS}
            used, allotted = row["tiles"][name]
            print(f"{tokens:>6} {name or 'default':>10} {used:>4}/{allotted:<4} "
                  + " ".join(f"{us[v]:14.1f}" for v in VARIANTS)
                  + f" {us['static'] / us['unfused']:15.3f}"
                  f" {us['barrier'] / us['unfused']:16.3f}", flush=True)
            for kernel, kernel_us in row.get("kernels", {}).get(name, ()):
                rate = weight_bytes.get(kernel.split("_")[0], 0) / kernel_us / 1e6
                print(f"{'':>17} {kernel[:24]} {kernel_us:.1f} us"
                      + (f", weights at {rate:.2f} TB/s" if rate else ""), flush=True)


if __name__ == "__main__":
    main()
