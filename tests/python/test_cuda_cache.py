"""The disk cache of compiled CUDA binaries: a binary is reused only for the same source,
target, compiler and options, and a build that hits it compiles nothing."""
import shutil

import pytest
import tvm

from etc_tvm import cuda_cache
from etc_tvm.build import SM90A, build

import graphs

SM80 = {"kind": "cuda", "arch": "sm_80"}


class CountingCompile:
    """A stand-in compiler: a distinct binary for each call, and the number of calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, code):
        self.calls += 1
        return bytearray(f"{self.calls}:{code}".encode())


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache directory; the compiler's version told without running it."""
    monkeypatch.setenv("ETC_TVM_CACHE_DIR", str(tmp_path / "cuda"))
    monkeypatch.delenv("TVM_KERNEL_DUMP", raising=False)
    monkeypatch.setattr(cuda_cache, "compiler_version", lambda mode: f"a compiler, {mode}")
    return tmp_path / "cuda"


def compile_in(target, compile, code):
    with tvm.target.Target(target):
        return compile(code)


def test_the_second_compile_of_a_source_reads_the_first_binary(cache):
    counting = CountingCompile()
    compile = cuda_cache.CachedCompile(counting)
    first = compile_in(SM90A, compile, "__global__ void k() {}")
    again = compile_in(SM90A, compile, "__global__ void k() {}")
    assert counting.calls == 1 and again == first and isinstance(again, bytearray)
    assert len(list(cache.glob("*.bin"))) == 1 and not list(cache.glob("*.bin.*"))


def test_another_source_or_target_compiles_again(cache):
    counting = CountingCompile()
    compile = cuda_cache.CachedCompile(counting)
    binaries = {bytes(compile_in(SM90A, compile, "__global__ void k() {}")),
                bytes(compile_in(SM90A, compile, "__global__ void k() { }")),
                bytes(compile_in(SM80, compile, "__global__ void k() {}"))}
    assert counting.calls == 3 and len(binaries) == 3


@pytest.mark.parametrize("name, value", [("TVM_CUDA_PTXAS_REG_LEVEL", "5"),
                                         ("TVM_CUDA_PTXAS_EXTRA_OPTS", "-O1"),
                                         ("TVM_CUDA_COMPILE_MODE", "nvrtc")])
def test_the_compilers_options_are_in_the_key(name, value, cache, monkeypatch):
    monkeypatch.setenv("TVM_CUDA_COMPILE_MODE", "nvcc")
    code = "__global__ void k() {}"
    with tvm.target.Target(SM90A) as target:
        before = cuda_cache.binary_key(code, target)
        monkeypatch.setenv(name, value)
        assert cuda_cache.binary_key(code, target) != before


@pytest.mark.parametrize("env", [{"ETC_TVM_CACHE_DIR": ""}, {"TVM_KERNEL_DUMP": "/tmp/dump"}])
def test_an_empty_cache_dir_or_a_kernel_dump_compiles_every_time(env, cache, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    counting = CountingCompile()
    compile = cuda_cache.CachedCompile(counting)
    for _ in range(2):
        compile_in(SM90A, compile, "__global__ void k() {}")
    assert counting.calls == 2 and not cache.exists()


def test_without_a_current_target_or_with_nvshmem_nothing_is_cached(cache):
    counting = CountingCompile()
    compile = cuda_cache.CachedCompile(counting)
    compile("__global__ void k() {}")
    compile("__global__ void k() {}")
    for _ in range(2):
        compile_in(SM90A, compile, "#include <nvshmem.h>\n__global__ void k() {}")
    assert counting.calls == 4 and not cache.exists()


def test_a_compiler_that_cannot_be_told_caches_nothing(cache, monkeypatch):
    monkeypatch.setattr(cuda_cache, "compiler_version", lambda mode: None)
    counting = CountingCompile()
    compile = cuda_cache.CachedCompile(counting)
    for _ in range(2):
        compile_in(SM90A, compile, "__global__ void k() {}")
    assert counting.calls == 2 and not cache.exists()


def test_a_directory_that_cannot_be_written_costs_only_the_cache(cache, tmp_path,
                                                                 monkeypatch):
    blocked = tmp_path / "a file"
    blocked.write_text("")
    monkeypatch.setenv("ETC_TVM_CACHE_DIR", str(blocked / "cuda"))
    counting = CountingCompile()
    compile = cuda_cache.CachedCompile(counting)
    assert compile_in(SM90A, compile, "__global__ void k() {}") == bytearray(
        b"1:__global__ void k() {}")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_a_build_repeated_compiles_nothing(cache, monkeypatch):
    installed = cuda_cache._INSTALLED
    if installed is None:
        pytest.skip("TVM registered no CUDA compile callback")
    compiles = []
    compile = installed.compile
    monkeypatch.setattr(installed, "compile", lambda code: compiles.append(1) or compile(code))
    dims = {"M": 64, "N": 64}
    build(graphs.row_sum, dims, strategy="static")
    built = len(compiles)
    build(graphs.row_sum, dims, strategy="static")
    assert built >= 1 and len(compiles) == built
    assert len(list(cache.glob("*.bin"))) == built
