"""Compiled CUDA binaries, cached on disk by what they were compiled from.

A megakernel's build spends most of its time in ``nvcc`` (or NVRTC), and a process that builds
the same graph for the same sizes again (a test suite, a benchmark after its tests, a server
started twice) compiles byte for byte the same source. ``install`` wraps TVM's
``tvm_callback_cuda_compile`` so that a binary is looked up by the SHA-256 of everything that
decides it: the source, the target (its ``arch``), the compiler and its version, TVM's
version and the compile options TVM reads from the environment. A hit returns the stored bytes;
a miss compiles and stores them (written aside, then renamed: concurrent builds, as pytest's
workers run them, never read half a file).

``ETC_TVM_CACHE_DIR`` names the directory (default ``$XDG_CACHE_HOME/etc_tvm/cuda``, else
``~/.cache/etc_tvm/cuda``); an empty value turns the cache off. With ``TVM_KERNEL_DUMP`` set,
every build compiles (the dump is what it is for), as does code linked against NVSHMEM's
device library, whose version the key does not hold. A directory that cannot be written only
costs the cache, never the build.
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import tvm
import tvm_ffi

from .compile_errors import ReportedCompile

CALLBACK = "tvm_callback_cuda_compile"
# the environment variables that change what TVM's compile callback builds (tvm/support/nvcc.py)
COMPILE_ENV = ("TVM_CUDA_COMPILE_MODE", "TVM_CUDA_PTXAS_REG_LEVEL", "TVM_CUDA_PTXAS_EXTRA_OPTS",
               "TVM_CUDA_NVCC_NO_FAST_MATH", "TVM_CUDA_NVRTC_EXTRA_OPTS", "TVM_KERNEL_DEBUG",
               "CUDA_PATH")


def cache_dir() -> Path | None:
    """Where binaries are kept, or None with the cache off."""
    configured = os.environ.get("ETC_TVM_CACHE_DIR")
    if configured is not None:
        return Path(configured).expanduser() if configured else None
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "etc_tvm" / "cuda"


@functools.cache
def compiler_version(mode: str) -> str | None:
    """What identifies the compiler of ``mode`` ("nvcc" or "nvrtc"), its version text, or None
    where it cannot be told (nothing is cached then)."""
    try:
        if mode == "nvcc":
            nvcc = shutil.which("nvcc")
            run = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True)
            return f"{nvcc}\n{run.stdout}"
        from cuda.bindings import nvrtc  # noqa: PLC0415 (present only with cuda-bindings)

        result, major, minor = nvrtc.nvrtcVersion()
        return f"nvrtc {major}.{minor}" if result == nvrtc.nvrtcResult.NVRTC_SUCCESS else None
    except Exception:  # noqa: BLE001 (no nvcc, no cuda-bindings, no libnvrtc: unknown)
        return None


def binary_key(code: str, target: tvm.target.Target) -> str | None:
    """The SHA-256 (hex) of everything that decides the binary compiled from ``code``, or None
    where the compiler cannot be told."""
    compiler = compiler_version(os.environ.get("TVM_CUDA_COMPILE_MODE", "nvrtc").lower())
    if compiler is None:
        return None
    parts = [code, str(target), tvm.__version__, compiler,
             *(f"{name}={os.environ.get(name, '')}" for name in COMPILE_ENV)]
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


class CachedCompile:
    """TVM's CUDA compile callback ``compile`` behind the disk cache (see the module)."""

    def __init__(self, compile):
        self.compile = compile

    def __call__(self, code: str):
        directory = cache_dir()
        target = tvm.target.Target.current(allow_none=True)
        if (directory is None or target is None or os.environ.get("TVM_KERNEL_DUMP")
                or "#include <nvshmem" in code):  # linked against a library not in the key
            return self.compile(code)
        key = binary_key(code, target)
        if key is None:
            return self.compile(code)
        path = directory / f"{key}.bin"
        try:
            return bytearray(path.read_bytes())
        except OSError:
            pass
        binary = self.compile(code)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            handle, aside = tempfile.mkstemp(dir=directory, prefix=f"{path.name}.")
            with os.fdopen(handle, "wb") as file:
                file.write(bytes(binary))
            os.replace(aside, path)
        except OSError:
            pass
        return binary


def install() -> None:
    """Put the cache in front of the registered compile callback, its errors reported
    (``compile_errors``), once a process."""
    global _INSTALLED
    compile = tvm_ffi.get_global_func(CALLBACK, allow_missing=True)
    if compile is None or _INSTALLED is not None:
        return
    _INSTALLED = CachedCompile(ReportedCompile(compile))
    tvm_ffi.register_global_func(CALLBACK, _INSTALLED, override=True)


_INSTALLED: CachedCompile | None = None
