"""The seed's two tensor-parallel patterns on several GPUs of this machine: apps/tp_patterns.py
under torchrun, one process per GPU. Each rank's result is checked there against NCCL and
float64, and repeated launches must give the same bits; here, that every rank finished."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


def gpu_count() -> int:
    torch = pytest.importorskip("torch")
    return torch.cuda.device_count()


def run_patterns(world_size: int, *flags: str) -> str:
    """apps/tp_patterns.py on ``world_size`` GPUs; its output, after every rank finished."""
    if gpu_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs")
    env = {**os.environ, "NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "python"),
                                          os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run",
                           f"--nproc-per-node={world_size}", str(ROOT / "apps" / "tp_patterns.py"),
                           *flags], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    for name in ("GEMM + Reduce-Scatter, static", "GEMM + Reduce-Scatter, dynamic",
                 "All-Gather + GEMM"):
        assert f"{name}: world size {world_size}" in done.stdout
    return done.stdout


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_patterns_against_nccl(world_size):
    """Both patterns in one process each rank: two NVSHMEM modules, each still loaded when
    the other initialises."""
    run_patterns(world_size)


def test_profiled_patterns_time_every_task_of_their_rank():
    """Rank kernels built to profile: still right, and each rank's timeline holds its own
    tasks, each once."""
    out = run_patterns(2, "--profile", "--launches", "3")
    assert out.count("every task in its rank's timeline") == 3, out
