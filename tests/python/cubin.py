"""Generated CUDA built into sm_90a machine code by the CPU tests, and its SASS read back."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from etc_tvm.tir_sched.persistent import CTA_RESERVED_BYTES, CTA_SHARED_OVERHEAD

NVCC = shutil.which("nvcc")


def build_cubin(source: str, tmp_path, allow_spills: bool = False) -> tuple[Path, str]:
    """(the sm_90a cubin of ``source``, ptxas's report); nvcc must accept it, each persistent
    kernel's static shared memory fit what ``arena_limit`` leaves it, and, unless
    ``allow_spills``, ptxas spill no register."""
    if NVCC is None:
        pytest.skip("nvcc is not on PATH: the CUDA source was generated but not compiled")
    path, cubin = tmp_path / "kernel.cu", tmp_path / "kernel.cubin"
    path.write_text(source)
    done = subprocess.run([NVCC, "-gencode=arch=compute_90a,code=sm_90a", "-cubin",
                           "-Xptxas=-v", str(path), "-o", str(cubin)], capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    for name, used in persistent_static_shared(done.stderr).items():
        assert used <= CTA_SHARED_OVERHEAD - CTA_RESERVED_BYTES, (
            f"{name}: {used} bytes of static shared memory, more than the "
            f"{CTA_SHARED_OVERHEAD - CTA_RESERVED_BYTES} that CTA_SHARED_OVERHEAD keeps: the "
            "cooperative launch would not fit ctas_per_sm CTAs of the largest arena")
    if not allow_spills:
        spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", done.stderr)]
        assert spills and not any(spills), done.stderr[-4000:]
    return cubin, done.stderr


def persistent_static_shared(report: str) -> dict[str, int]:
    """Each persistent kernel's static shared memory in bytes, from ptxas's report."""
    out, name = {}, None
    for line in report.splitlines():
        entry = re.search(r"Compiling entry function '(\w+)'", line)
        if entry:
            name = entry.group(1)
        used = re.search(r"(\d+) bytes smem", line)
        if used and name and re.search(r"megakernel|_rank\d+_kernel", name):
            out[name] = int(used.group(1))
    return out


def cuobjdump() -> str | None:
    """cuobjdump (nvdisasm beside it): on PATH, or from the nvidia-cuda-cuobjdump wheel."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    wheel = Path(sys.prefix).glob("lib/python3*/site-packages/nvidia/cu*/bin/cuobjdump")
    return next((str(p) for p in wheel), None)


def sass(cubin: Path) -> str:
    """The SASS of ``cubin`` (skips where no cuobjdump is installed)."""
    tool = cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")
    env = {**os.environ, "PATH": os.path.dirname(tool) + os.pathsep + os.environ["PATH"]}
    dump = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True,
                          check=False, env=env)
    assert dump.returncode == 0, dump.stderr[-4000:]
    return dump.stdout


def count(code: str, opcode: str) -> int:
    """How many times the instruction ``opcode`` occurs in SASS ``code``."""
    return len(re.findall(rf"\b{re.escape(opcode)}\b", code))
