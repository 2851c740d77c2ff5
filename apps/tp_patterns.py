"""The seed's two tensor-parallel patterns on several GPUs, one process per GPU.

    torchrun --nproc-per-node 2 apps/tp_patterns.py [--pattern gemm_rs gemm_rs_dynamic ag_gemm]

Each rank builds its kernel of GEMM + Reduce-Scatter (static and dynamic schedules) and of
All-Gather + GEMM (static, ring order) (tests/python/tp_graphs.py: small fp32 tiles), runs it
on fresh random inputs, and checks its
result against the same computation through torch.distributed (NCCL: matmul then
reduce_scatter; all_gather then matmul) and against float64. Then ``--launches`` repeated
launches must give the same bits. With ``--profile`` the kernels are built to profile and the
last launch's timeline must hold every task of the rank, each run once. Rank 0 prints one
line per pattern. NVLink multicast stays off (NVSHMEM_DISABLE_NVLS, NCCL_NVLS_ENABLE).
"""
import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from etc_tvm.distributed import Nvshmem, build_rank  # noqa: E402
from etc_tvm.tir_sched.persistent import KernelOptions  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))
from tp_graphs import all_gather_gemm, gemm_reduce_scatter  # noqa: E402


def join() -> tuple[Nvshmem, int, int]:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    uid = [Nvshmem.unique_id() if rank == 0 else None]
    dist.broadcast_object_list(uid, src=0)
    return Nvshmem.init(rank, world, uid[0]), rank, world


def gemm_rs(world: Nvshmem, M: int, K: int, N: int, rng, launches: int,
            options: KernelOptions, strategy: str = "static") -> float:
    """A[:, K_r] @ B[K_r, :] summed over ranks, row block r kept: against NCCL and float64."""
    W, r = world.world_size, world.rank
    A = rng.standard_normal((M, K * W)).astype(np.float32)  # the same on every rank (seeded)
    B = rng.standard_normal((K * W, N)).astype(np.float32)
    A_r, B_r = A[:, r * K:(r + 1) * K], B[r * K:(r + 1) * K]
    program = build_rank(gemm_reduce_scatter(W), {"M": M, "K": K, "N": N}, r,
                         strategy=strategy, options=options)
    D = program(world, A_r, B_r)
    partial = torch.from_numpy(A_r).cuda() @ torch.from_numpy(B_r).cuda()
    nccl = torch.empty((M // W, N), device="cuda")
    dist.reduce_scatter_tensor(nccl, partial)
    want = (A.astype(np.float64) @ B)[r * M // W:(r + 1) * M // W]
    return check(f"GEMM + Reduce-Scatter ({strategy})", program, world, (A_r, B_r), D, nccl,
                 want, launches)


def ag_gemm(world: Nvshmem, M: int, K: int, N: int, rng, launches: int,
            options: KernelOptions) -> float:
    """All rows of A gathered, times this rank's columns of B: against NCCL and float64."""
    W, r = world.world_size, world.rank
    A = rng.standard_normal((M * W, K)).astype(np.float32)
    B = rng.standard_normal((K, N * W)).astype(np.float32)
    A_r, B_r = A[r * M:(r + 1) * M], np.ascontiguousarray(B[:, r * N:(r + 1) * N])
    program = build_rank(all_gather_gemm(W), {"M": M, "K": K, "N": N}, r, options=options)
    C = program(world, A_r, B_r)
    gathered = torch.empty((M * W, K), device="cuda")
    dist.all_gather_into_tensor(gathered, torch.from_numpy(A_r).cuda())
    nccl = gathered @ torch.from_numpy(B_r).cuda()
    want = A.astype(np.float64) @ B[:, r * N:(r + 1) * N]
    return check("All-Gather + GEMM", program, world, (A_r, B_r), C, nccl, want, launches)


def check(name, program, world, inputs, got, nccl, want, launches) -> float:
    nccl = nccl.cpu().numpy().astype(np.float64)
    error = np.linalg.norm(got - want) / np.linalg.norm(want)
    nccl_error = np.linalg.norm(got - nccl) / np.linalg.norm(nccl)
    assert error < 1e-5 and nccl_error < 1e-5, \
        f"rank {world.rank} {name}: error {error:.1e} (float64), {nccl_error:.1e} (NCCL)"
    for _ in range(launches):
        again = program(world, *inputs)
        assert np.array_equal(again.view(np.uint32), got.view(np.uint32)), \
            f"rank {world.rank} {name}: a repeated launch gave other bits"
    if program.meta.profiled:
        spans = program.timeline().spans
        own = sorted(t for c in program.graph.calls if c.rank == world.rank for t in c.tasks)
        assert sorted(s.task for s in spans) == own, \
            f"rank {world.rank} {name}: the timeline holds {len(spans)} tasks, not its {len(own)}"
        assert all(0 <= s.start_us <= s.end_us for s in spans), f"rank {world.rank} {name}"
    return max(error, nccl_error)


PATTERNS = {"gemm_rs": ("GEMM + Reduce-Scatter, static", gemm_rs),
            "gemm_rs_dynamic": ("GEMM + Reduce-Scatter, dynamic",
                                lambda *args: gemm_rs(*args, strategy="dynamic")),
            "ag_gemm": ("All-Gather + GEMM", ag_gemm)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--M", type=int, default=64)
    parser.add_argument("--K", type=int, default=32)
    parser.add_argument("--N", type=int, default=64)
    parser.add_argument("--launches", type=int, default=20)
    parser.add_argument("--pattern", choices=sorted(PATTERNS), nargs="+", default=sorted(PATTERNS))
    parser.add_argument("--profile", action="store_true",
                        help="build the kernels to profile and check their timelines")
    args = parser.parse_args()
    world, rank, size = join()
    rng = np.random.default_rng(2026)
    for name, run in (PATTERNS[p] for p in args.pattern):
        error = run(world, args.M, args.K, args.N, rng, args.launches,
                    KernelOptions(profile=args.profile))
        errors = [None] * size
        dist.all_gather_object(errors, error)
        if rank == 0:
            print(f"{name}: world size {size}, M={args.M} K={args.K} N={args.N}: every rank "
                  f"within {max(errors):.1e} of float64 and of NCCL, {args.launches} repeated "
                  "launches identical" + (", every task in its rank's timeline" if args.profile
                                          else ""), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
