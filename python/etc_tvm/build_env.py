"""Building CUDA code on a machine without a GPU driver.

TVM's CUDA runtime library links against the driver (``libcuda.so.1``). Where no driver is
installed it cannot load, and ``tvm.compile`` then silently keeps CUDA *source* in the module,
so an exported library would compile at load time. To export real sm_90a machine code from
such a machine, a stub ``libcuda.so.1`` (every entry point answers "no device") is built with
the C compiler and loaded before TVM, and TVM compiles through ``nvcc`` (NVRTC needs the
``cuda-bindings`` package, which driverless machines lack). ``etc_tvm`` does it on import;
where ``tvm`` was imported first, its CUDA runtime library (skipped then, for want of a
driver) is loaded once the stub is. Where a driver exists nothing changes.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

_STUB = r"""
typedef int CUresult;
#define NO_DEVICE 100
CUresult cuInit(unsigned f) { return NO_DEVICE; }
CUresult cuDriverGetVersion(int* v) { if (v) *v = 0; return NO_DEVICE; }
CUresult cuDeviceGetName(char* n, int l, int d) { return NO_DEVICE; }
CUresult cuFuncSetAttribute(void* f, int a, int v) { return NO_DEVICE; }
CUresult cuGetErrorName(CUresult e, const char** s) { if (s) *s = "NO_DEVICE"; return 0; }
CUresult cuGetErrorString(CUresult e, const char** s) { if (s) *s = "no CUDA driver"; return 0; }
CUresult cuLaunchKernelEx(const void* c, void* f, void** a, void** e) { return NO_DEVICE; }
CUresult cuModuleGetFunction(void** f, void* m, const char* n) { return NO_DEVICE; }
CUresult cuModuleLoadData(void** m, const void* image) { return NO_DEVICE; }
CUresult cuModuleUnload(void* m) { return NO_DEVICE; }
CUresult cuTensorMapEncodeTiled(void* t, int d, unsigned r, void* g, const void* gd,
                                const void* gs, const void* bd, const void* es, int i, int s,
                                int l2, int o) { return NO_DEVICE; }
"""


# what ``prepare`` did, which ``etc_tvm.BUILD_ENV`` holds
DRIVER = "driver present"
STUB_DRIVER = "stub driver, nvcc"
NO_COMPILER = "no nvcc or C compiler: CUDA modules keep their source"


def has_driver() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def prepare() -> str:
    """Make TVM able to emit machine code here; returns what was done (for diagnostics)."""
    if has_driver():
        return DRIVER
    if shutil.which("nvcc") is None or shutil.which("cc") is None:
        return NO_COMPILER
    stub_dir = Path(tempfile.gettempdir()) / f"etc_tvm_cuda_stub_{os.getuid()}"
    stub = stub_dir / "libcuda.so.1"
    if not stub.exists():
        stub_dir.mkdir(parents=True, exist_ok=True)
        source = stub_dir / "libcuda_stub.c"
        source.write_text(_STUB)
        partial = stub_dir / f"libcuda.so.1.{os.getpid()}"
        subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-Wl,-soname,libcuda.so.1",
                        "-o", str(partial), str(source)], check=True)
        partial.replace(stub)
    ctypes.CDLL(str(stub), mode=ctypes.RTLD_GLOBAL)
    os.environ.setdefault("TVM_CUDA_COMPILE_MODE", "nvcc")
    if "tvm" in sys.modules:
        _load_tvm_cuda_runtime()
    return STUB_DRIVER


def _load_tvm_cuda_runtime() -> None:
    """Load TVM's CUDA runtime library as ``import tvm`` does (``tvm.backend.cuda``), for an
    ``import tvm`` that ran before the stub and could not load it."""
    from tvm.base import _LOADED_LIBS
    from tvm_ffi.libinfo import load_lib_ctypes

    if "tvm_runtime_cuda" not in _LOADED_LIBS:
        runtime_dir = Path(_LOADED_LIBS["tvm_runtime"]._name).resolve().parent
        _LOADED_LIBS["tvm_runtime_cuda"] = load_lib_ctypes(
            package="tvm", target_name="tvm_runtime_cuda", extra_lib_paths=[runtime_dir],
            mode="RTLD_LOCAL")
