"""What a dependency costs: the same tiles under every execution strategy, on the GPU.

(a) a dependent chain of N small tasks (N = 16 .. 1024), one call with an internal chain;
(b) a two-layer MLP, GEMM -> ReLU -> GEMM (bf16 tensor-core tiles), pipelined tile by tile: a
    row block of the second GEMM starts when its row of activations is done (M = 80: 160 tiles
    a GEMM, so the first GEMM's second wave leaves 104 SMs that the second GEMM's finished
    rows can take; the list schedule's model predicts 1.36x over the barrier there, none at
    M = 1, 16 or 128, where each GEMM fills whole waves or one row block holds every tile);
(c) the same MLP with split-K GEMMs: partial products per 256-wide K slice, summed by the
    activation (and a final sum); a K slice of the second GEMM waits for 4 activation tiles.

Strategies (the same device functions in every one):
    static              one persistent kernel, list-scheduled per-SM queues
    static-2, static-4  the same with 2 or 4 persistent CTAs per SM
    static-rr           the same kernel, topological order dealt round-robin onto the SMs (a
                        chain then crosses SMs at every hop: the hand-off cost)
    claimed, claimed+graph
                        the same kernel whose CTAs claim the tasks in id order at run time
                        (KernelOptions.claim): each CTA takes the next task when it frees up
    barrier-claimed+graph
                        the barrier kernel, likewise, replayed from a CUDA graph
    dynamic             one persistent kernel whose CTAs pop ready tasks from a ring
    barrier, barrier-2, barrier-4
                        the persistent kernel with one barrier between operators (2 or 4
                        CTAs/SM: against static-2 and static-4 at the same occupancy)
    unfused             each call (each task of a chain) its own kernel launch
    unfused+graph       those launches replayed from a CUDA graph
    static+graph        the persistent kernel's launch replayed from a CUDA graph (no host
                        work: the GPU-side cost alone)
    barrier+graph       the barrier kernel's, likewise: tile-level edges against barriers
                        with the host's part of a call out of both

Times are medians of CUDA-event timings of one call, the variants taking turns call by call.
Per-hop cost is the slope over N. Prints one table per part and writes every number to JSON
(``--json``).
"""
import argparse
import json

import ml_dtypes
import numpy as np
import tvm
import tvm_ffi
from tvm.script import tirx as T

from etc_tvm import ETensor, Tensor, build, call_device, device_func, graph_func
from etc_tvm.executor import execute
from etc_tvm.graph_func import GraphFunc
from etc_tvm.relax_passes import BarrierEdgesTransform
from etc_tvm.schedule import list_schedule, round_robin_schedule
from etc_tvm.task_graph import TaskGraph
from etc_tvm.tiles import make_activation_tile, make_gemm_tile
from etc_tvm.tir_sched.persistent import KernelOptions
from timing import checked_run, time_interleaved

WIDTH, THREADS = 128, 128
N_ROWS = T.int32()

VARIANTS = {  # label: (strategy, scheduler, CTAs per SM, replay from a CUDA graph, claimed)
    "static": ("static", list_schedule, 1, False, False),
    "claimed": ("static", list_schedule, 1, False, True),
    "claimed+graph": ("static", list_schedule, 1, True, True),
    "barrier-claimed+graph": ("barrier", list_schedule, 1, True, True),
    "static-2": ("static", list_schedule, 2, False, False),
    "static-4": ("static", list_schedule, 4, False, False),
    "static-rr": ("static", round_robin_schedule, 1, False, False),
    "dynamic": ("dynamic", list_schedule, 1, False, False),
    "barrier": ("barrier", list_schedule, 1, False, False),
    "barrier-2": ("barrier", list_schedule, 2, False, False),
    "barrier-4": ("barrier", list_schedule, 4, False, False),
    "unfused": ("unfused", list_schedule, 1, False, False),
    "unfused+graph": ("unfused", list_schedule, 1, True, False),
    "static+graph": ("static", list_schedule, 1, True, False),
    "barrier+graph": ("barrier", list_schedule, 1, True, False),
}


@device_func
def hop_tile(i: T.int32, X: T.Buffer((N_ROWS, WIDTH), "float32"),
             Y: T.Buffer((N_ROWS, WIDTH), "float32")):
    """Y[i] = X[i] + Y[i-1][0]: one row per task, reading what the previous task wrote."""
    T.device_entry()
    tx = T.thread_id([THREADS])
    if i > 0:
        Y[i, tx] = X[i, tx] + Y[i - 1, 0]
    else:
        Y[i, tx] = X[i, tx]


@hop_tile.set_reference
def _(i, X, Y):
    Y[i] = X[i] + (Y[i - 1, 0] if i > 0 else 0)


@graph_func
def chain(x: Tensor(("N", WIDTH))):
    n = x.shape[0]
    link = ETensor((n,), name="link")
    return call_device(hop_tile, tile_num=(n,), args=[x], out=Tensor((n, WIDTH), name="y"),
                       in_edges={link: "i->i-1 if i > 0"}, out_edges={link: "i->i"})


def make_mlp(block_rows: int, hidden: int, inter: int):
    """GEMM (hidden -> inter) -> ReLU (bf16) -> GEMM (inter -> hidden), 64-column tiles."""
    bk = 64 if block_rows < 64 else 32  # whole 16-byte copies for every thread
    up = make_gemm_tile(bm=block_rows, bn=64, bk=bk)
    relu = make_activation_tile("relu", "bfloat16", rows=block_rows, cols=64)
    down = make_gemm_tile(bm=block_rows, bn=64, bk=bk)

    @graph_func
    def mlp(x: Tensor(("M", hidden), "bfloat16"), w1: Tensor((hidden, inter), "bfloat16"),
            w2: Tensor((inter, hidden), "bfloat16")):
        m = x.shape[0]
        h_ready = ETensor((m // block_rows, inter // 64), name="h_ready")
        row_ready = ETensor((m // block_rows,), name="row_ready")
        h = call_device(up, tile_num=(m // block_rows, inter // 64), args=[x, w1],
                        out=Tensor((m, inter), name="h"), out_edges={h_ready: "ij->ij"})
        a = call_device(relu, tile_num=(m // block_rows, inter // 64), args=[h],
                        out=Tensor((m, inter), "bfloat16", name="a"),
                        in_edges={h_ready: "ij->ij"}, out_edges={row_ready: "ij->i"})
        return call_device(down, tile_num=(m // block_rows, hidden // 64), args=[a, w2],
                           out=Tensor((m, hidden), name="y"), in_edges={row_ready: "ij->i"})

    return mlp


def make_split_k_mlp(hidden: int, inter: int, slice_k: int = 256, block_rows: int = 16):
    """The same MLP with both GEMMs split along K into ``slice_k`` slices: 8x more tasks at
    small M, and a slice of the second GEMM starts once its 4 activation tiles are done."""
    up = make_gemm_tile(bm=block_rows, bn=64, bk=64, split_k=hidden // slice_k)
    relu = make_activation_tile("relu", "bfloat16", rows=block_rows, cols=64,
                                split_k=hidden // slice_k)
    down = make_gemm_tile(bm=block_rows, bn=64, bk=64, split_k=inter // slice_k)
    total = make_activation_tile("identity", "float32", rows=block_rows, cols=64,
                                 split_k=inter // slice_k)
    per_slice = slice_k // 64  # activation tiles per K slice of the second GEMM

    @graph_func
    def mlp_split_k(x: Tensor(("M", hidden), "bfloat16"),
                    w1: Tensor((hidden, inter), "bfloat16"),
                    w2: Tensor((inter, hidden), "bfloat16")):
        m = x.shape[0]
        rows, s1, s2 = m // block_rows, hidden // slice_k, inter // slice_k
        up_done = ETensor((rows, inter // 64), name="up_done")
        slice_ready = ETensor((rows, s2), name="slice_ready")
        down_done = ETensor((rows, hidden // 64), name="down_done")
        p1 = call_device(up, tile_num=(rows, inter // 64, s1), args=[x, w1],
                         out=Tensor((s1, m, inter), name="p1"), out_edges={up_done: "ijs->ij"})
        a = call_device(relu, tile_num=(rows, inter // 64), args=[p1],
                        out=Tensor((m, inter), "bfloat16", name="a"),
                        in_edges={up_done: "ij->ij"},
                        out_edges={slice_ready: f"ij->i, j//{per_slice}"})
        p2 = call_device(down, tile_num=(rows, hidden // 64, s2), args=[a, w2],
                         out=Tensor((s2, m, hidden), name="p2"),
                         in_edges={slice_ready: "ijs->is"}, out_edges={down_done: "ijs->ij"})
        return call_device(total, tile_num=(rows, hidden // 64), args=[p2],
                           out=Tensor((m, hidden), name="y"), in_edges={down_done: "ij->ij"})

    return mlp_split_k


def measure(graph, dims, inputs, want, rtol, labels) -> dict:
    """Each variant in ``labels``: build, check against ``want`` (relative L2 error); then time
    them all, and print the row at once so that a long run that is stopped keeps its rows."""
    dev = tvm.cuda(0)
    on_device = [tvm.runtime.tensor(x, dev) for x in inputs]
    runs = {}
    for label in labels:
        strategy, scheduler, ctas, replay, claim = VARIANTS[label]
        compiled = build(graph, dims, strategy=strategy, scheduler=scheduler,
                         options=KernelOptions(ctas_per_sm=ctas, claim=claim))
        runs[label] = checked_run(label, compiled, on_device, want, rtol, replay)
    medians = time_interleaved(runs)
    print(f"{graph.name} {dims}: "
          + ", ".join(f"{label} {us:.1f}" for label, us in medians.items()), flush=True)
    return medians


# (a, b) printed as a/b, how many times faster b ran: each launch mode against its own kind
# (a VM call against a VM call, a CUDA-graph replay against a replay), and unfused + graph
# against the static VM call as well
RATIOS = (("unfused", "static"), ("unfused+graph", "static+graph"), ("unfused+graph", "static"),
          ("barrier", "static"), ("barrier+graph", "static+graph"),
          ("barrier+graph", "claimed+graph"), ("barrier-claimed+graph", "claimed+graph"))


def predicted_barrier_gain(graph, dims, num_sms: int) -> float:
    """The list schedule's estimate of how much faster static is than barrier (the ratio of
    their makespans in cost units): what tile-level edges can gain on ``num_sms`` SMs."""
    barrier = GraphFunc(graph.name, BarrierEdgesTransform()(graph.mod), graph.device_funcs)
    return (list_schedule(TaskGraph.build(barrier, dims), num_sms).makespan
            / list_schedule(TaskGraph.build(graph, dims), num_sms).makespan)


def print_predictions(title, rows) -> None:
    print(f"{title}, barrier/static predicted by the list schedule: " + ", ".join(
        f"M={r['M']} {r['predicted barrier/static']:.2f}x" for r in rows))


def table(title, key, rows, labels) -> None:
    ratios = [(a, b) for a, b in RATIOS if a in labels and b in labels]
    print(f"\n{title}")
    print(f"{key:>8} " + " ".join(f"{label:>13}" for label in labels)
          + "".join(f" {a + '/' + b:>27}" for a, b in ratios))
    for r in rows:
        print(f"{r[key]:>8} " + " ".join(f"{r[label]:>10.1f} us" for label in labels)
              + "".join(f" {r[a] / r[b]:>26.2f}x" for a, b in ratios))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 16, 80, 128],
                        help="MLP rows (none: the chain alone)")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=2048)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                        help="the strategies to build and time (default: all)")
    parser.add_argument("--json", default="bench_overhead.json")
    args = parser.parse_args()
    labels = args.variants
    rng = np.random.default_rng(0)
    sms = tvm.cuda(0).multi_processor_count
    chains, mlps, split_mlps = [], [], []
    with tvm_ffi.use_torch_stream():
        for n in args.lengths:
            x = rng.standard_normal((n, WIDTH)).astype("float32")
            chains.append({"N": n, **measure(chain, {"N": n}, [x], execute(chain, x), 1e-6,
                                             labels)})
        for m in args.rows:
            block = 16  # row blocks of 16: M=128 gives 8 blocks to pipeline
            padded = -(-m // block) * block  # tiles are whole blocks of rows
            bf16 = ml_dtypes.bfloat16
            x = rng.standard_normal((padded, args.hidden)).astype(bf16)
            w1 = (rng.standard_normal((args.hidden, args.inter)) / args.hidden**0.5).astype(bf16)
            w2 = (rng.standard_normal((args.inter, args.hidden)) / args.inter**0.5).astype(bf16)
            h = np.maximum(x.astype(np.float64) @ w1.astype(np.float64), 0)
            want = h.astype(bf16).astype(np.float64) @ w2.astype(np.float64)
            mlp = make_mlp(block, args.hidden, args.inter)
            split = make_split_k_mlp(args.hidden, args.inter)
            for graph, rows in ((mlp, mlps), (split, split_mlps)):
                dims = {"M": padded}
                rows.append({"M": m, "rows computed": padded,
                             "predicted barrier/static": predicted_barrier_gain(graph, dims, sms),
                             **measure(graph, dims, [x, w1, w2], want, 2e-2, labels)})
    table("(a) dependent chain of N tasks", "N", chains, labels)
    ns = [r["N"] for r in chains]
    if len(ns) > 1:
        print("per hop (slope over N): " + ", ".join(
            f"{label} {np.polyfit(ns, [r[label] for r in chains], 1)[0]:.3f} us"
            for label in labels))
    if args.rows:
        table(f"(b) MLP {args.hidden} -> {args.inter} -> {args.hidden}, bf16 "
              "(16-row blocks; M=1 computed as one block)", "M", mlps, labels)
        table("(c) the same MLP, split-K (256-wide K slices)", "M", split_mlps, labels)
        print_predictions("(b)", mlps)
        print_predictions("(c)", split_mlps)
    with open(args.json, "w") as f:
        json.dump({"chain": chains, "mlp": mlps, "mlp_split_k": split_mlps}, f, indent=1)


if __name__ == "__main__":
    main()
