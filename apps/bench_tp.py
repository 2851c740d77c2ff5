"""Tensor-parallel MLP halves on several GPUs (one process each) against cuBLAS + NCCL.

    torchrun --nproc-per-node W apps/bench_tp.py [--tokens 8192] [--shapes 4096x14336 ...]
        [--tile 128x256x64 --threads 256 --loads tma] [--stores staged] [--graphs]
        [--profile DIR]

For each MLP shape (hidden x intermediate) and the world size W of the launch:

- up     All-Gather + GEMM (``tp_layers.ag_gemm_layer``): tokens/W rows a rank, gathered,
         times its 2*intermediate/W gate-up columns; baseline ``all_gather_into_tensor`` then
         ``matmul``.
- down   GEMM + Reduce-Scatter (``tp_layers.gemm_rs_layer``): all tokens times its
         intermediate/W rows of the down weights, summed over ranks, tokens/W rows kept;
         baseline ``matmul`` then ``reduce_scatter_tensor``.

Each rank checks its result against float64 within the tiles' bounds (for a sample of rows)
and reports its relative error to NCCL's; then both variants are timed by CUDA-event medians,
taking turns, and rank 0 prints the slowest rank's median of each and the ratio. With
``--graphs`` both are replayed from CUDA graphs, so that neither side's host launch path
(ours: TVM's call, the tensor maps' encoding, the cooperative launch) counts. With
``--profile DIR`` our kernels are built to profile: rank 0 also prints each rank's task
timeline of its last timed launch, and every rank writes it to DIR as a Chrome trace. bf16
everywhere, fp32 accumulation. NVLink multicast stays off (NVSHMEM_DISABLE_NVLS,
NCCL_NVLS_ENABLE).
"""
import argparse
import json
import os

os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import tp_layers  # noqa: E402
from etc_tvm.distributed import Nvshmem, build_rank  # noqa: E402
from etc_tvm.runtime import cuda_graph  # noqa: E402
from etc_tvm.tiles.wgmma_gemm import STORES  # noqa: E402
from etc_tvm.tir_sched.persistent import KernelOptions  # noqa: E402
from timing import time_interleaved  # noqa: E402
from tp_patterns import join  # noqa: E402

SAMPLE_ROWS = 256  # rows checked against float64 (the full product is ~1 TFLOP in float64)


def draw(shape, scale, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(shape, device="cuda", generator=g) * scale).to(torch.bfloat16)


def as_tvm(t: torch.Tensor):
    import tvm

    return tvm.runtime.from_dlpack(t)


def as_torch(t) -> torch.Tensor:
    return torch.from_dlpack(t)


def within(got: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor) -> float:
    """max |got - exact| / bound (<= 1 is within the contract)."""
    return float(((got.double() - exact).abs() / bound).max())


def gemm_bound(a64, b64, k: int):
    """``gemm.error_bound`` for bf16 output, on the GPU."""
    return k * 2.0 ** -22 * (a64.abs() @ b64.abs()) + 2.0 ** -8 * (a64 @ b64).abs() + 2.0 ** -126


def against(baseline, program, world: Nvshmem, args, got: torch.Tensor, reps: int,
            trace: str | None, graphs: bool) -> dict:
    """Our result's relative error to the baseline's, and the medians of both, taking turns
    (``graphs``: each replayed from a CUDA graph); the watchdog is read once, after the timed
    launches. A profiled program's last launch goes to ``trace`` (a Chrome trace) and,
    summed up, into the result."""
    want = baseline().float()
    nccl = float((got.float() - want).norm() / want.norm())
    runs = {"ours": lambda: program.launch(world, *args), "cuBLAS+NCCL": baseline}
    if graphs:  # every rank captures the same launches and collectives, in the same order
        runs = {label: cuda_graph(run)[0] for label, run in runs.items()}
    us = time_interleaved(runs, reps=reps)
    program.check()
    if not program.meta.profiled:
        return {"vs NCCL": nccl, "us": us}
    timeline = program.timeline()
    timeline.write_chrome_trace(trace)
    return {"vs NCCL": nccl, "us": us, "timeline": timeline.summary()}


def up(world: Nvshmem, tokens: int, hidden: int, inter: int, reps: int, tile: dict,
       trace: str | None, graphs: bool) -> dict:
    W, r = world.world_size, world.rank
    M, K, N = tokens // W, hidden, 2 * inter // W
    A = draw((tokens, K), 1.0, 1)  # every rank draws the whole, keeps its part
    B = draw((K, N * W), K ** -0.5, 2)[:, r * N:(r + 1) * N].contiguous()
    A_r = A[r * M:(r + 1) * M].contiguous()
    program = build_rank(tp_layers.ag_gemm_layer(W, **tile), {"M": M, "K": K, "N": N}, r,
                         options=KernelOptions(profile=trace is not None))
    args = [as_tvm(A_r), as_tvm(B)]
    (C,) = program.launch(world, *args)
    program.check()
    got = as_torch(C)
    rows = torch.arange(0, tokens, max(1, tokens // SAMPLE_ROWS), device="cuda")
    a64, b64 = A[rows].double(), B.double()
    error = within(got[rows], a64 @ b64, gemm_bound(a64, b64, K))
    gathered = torch.empty((tokens, K), device="cuda", dtype=torch.bfloat16)

    def baseline():
        dist.all_gather_into_tensor(gathered, A_r)
        return gathered @ B

    return {"M": tokens, "K": K, "N": N, "error/bound": error, "flop": 2.0 * tokens * K * N,
            **against(baseline, program, world, args, got, reps, trace, graphs)}


def down(world: Nvshmem, tokens: int, hidden: int, inter: int, reps: int, tile: dict,
         trace: str | None, graphs: bool, strategy: str = "static") -> dict:
    W, r = world.world_size, world.rank
    M, K, N = tokens, inter // W, hidden
    A = draw((M, K * W), 1.0, 3)
    B = draw((K * W, N), (K * W) ** -0.5, 4)
    A_r, B_r = A[:, r * K:(r + 1) * K].contiguous(), B[r * K:(r + 1) * K].contiguous()
    program = build_rank(tp_layers.gemm_rs_layer(W, **tile), {"M": M, "K": K, "N": N}, r,
                         strategy=strategy, options=KernelOptions(profile=trace is not None))
    args = [as_tvm(A_r), as_tvm(B_r)]
    (D,) = program.launch(world, *args)
    program.check()
    got = as_torch(D)
    rows = torch.arange(0, M // W, max(1, M // W // SAMPLE_ROWS), device="cuda")
    own = r * (M // W) + rows
    parts = [(A[own, s * K:(s + 1) * K].double(), B[s * K:(s + 1) * K].double())
             for s in range(W)]
    exact = sum(a @ b for a, b in parts)
    bound = sum(gemm_bound(a, b, K) for a, b in parts) * (1 + W * 2.0 ** -23) \
        + 2.0 ** -8 * exact.abs() + 2.0 ** -126
    error = within(got[rows], exact, bound)
    scattered = torch.empty((M // W, N), device="cuda", dtype=torch.bfloat16)

    def baseline():
        dist.reduce_scatter_tensor(scattered, A_r @ B_r)
        return scattered

    return {"M": M, "K": K, "N": N, "error/bound": error, "flop": 2.0 * M * K * N,
            **against(baseline, program, world, args, got, reps, trace, graphs)}


HALVES = {"up": ("All-Gather + GEMM", up), "down": ("GEMM + Reduce-Scatter", down),
          "down-dynamic": ("GEMM + RS, dynamic",
                           lambda *args: down(*args, strategy="dynamic"))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--shapes", nargs="+", default=["4096x14336", "8192x28672"],
                        help="hidden x intermediate (Llama-3 8B and 70B)")
    parser.add_argument("--halves", nargs="+", choices=sorted(HALVES),
                        default=["up", "down", "down-dynamic"])
    parser.add_argument("--tile", default="128x128x64", help="bm x bn x bk of the GEMM tiles")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--threads", type=int, default=128, choices=[128, 256])
    parser.add_argument("--loads", default="cp.async", choices=["cp.async", "tma"])
    parser.add_argument("--stores", default="fragments", choices=list(STORES),
                        help="GEMM tiles' output: straight from the fragments, or staged "
                        "through shared memory into row-contiguous 16-byte stores")
    parser.add_argument("--graphs", action="store_true",
                        help="time both variants replayed from CUDA graphs")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--json", default="bench_tp.json")
    parser.add_argument("--profile", metavar="DIR",
                        help="build our kernels to profile; timelines to DIR (Chrome traces)")
    args = parser.parse_args()
    bm, bn, bk = (int(v) for v in args.tile.split("x"))
    tile = {"bm": bm, "bn": bn, "bk": bk, "stages": args.stages, "threads": args.threads,
            "loads": args.loads, "stores": args.stores}
    world, rank, size = join()
    rows = []
    if rank == 0:
        print(f"GEMM tiles {args.tile}, {args.stages} stages, {args.threads} threads, "
              f"{args.loads} loads, {args.stores} stores"
              + (", both sides from CUDA graphs" if args.graphs else ""), flush=True)
        print(f"{'half':<22} {'W':>2} {'M x K x N':>20} {'ours us':>9} {'base us':>9} "
              f"{'ratio':>6} {'TFLOP/s':>8} {'err/bound':>9} {'vs NCCL':>8}", flush=True)
    for shape in args.shapes:
        hidden, inter = (int(v) for v in shape.split("x"))
        for half in args.halves:
            name, run = HALVES[half]
            trace = None
            if args.profile:
                os.makedirs(args.profile, exist_ok=True)
                trace = os.path.join(args.profile, f"{half}-{shape}-w{size}-rank{rank}.json")
            row = run(world, args.tokens, hidden, inter, args.reps, tile, trace, args.graphs)
            every = [None] * size
            dist.all_gather_object(every, row)
            if rank == 0:
                ours = max(r["us"]["ours"] for r in every)
                base = max(r["us"]["cuBLAS+NCCL"] for r in every)
                worst = max(r["error/bound"] for r in every)
                nccl = max(r["vs NCCL"] for r in every)
                dims = f"{row['M']}x{row['K']}x{row['N']}"
                print(f"{name:<22} {size:>2} {dims:>20} {ours:9.1f} {base:9.1f} "
                      f"{base / ours:5.2f}x {row['flop'] / ours / 1e6:8.1f} {worst:9.3f} "
                      f"{nccl:8.1e}", flush=True)
                for r, summary in enumerate(e.get("timeline") for e in every):
                    if summary:
                        print(f"rank {r}:\n{summary}", flush=True)
                rows.append({"half": half, "world_size": size, "hidden": hidden,
                             "intermediate": inter, "ours_us": ours, "baseline_us": base,
                             "error_over_bound": worst, "relative_to_nccl": nccl,
                             "graphs": args.graphs, **tile,
                             **{k: row[k] for k in ("M", "K", "N")}})
    if rank == 0:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
