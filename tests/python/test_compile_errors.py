"""The CUDA compiler's refusals as CompileError: the kernels, the arch, the errors without the
source dump and the warnings, the files that keep the rest."""
import re
from pathlib import Path

import pytest

import etc_tvm
from etc_tvm import CompileError, build, build_env
from etc_tvm.compile_errors import ReportedCompile

from test_wgmma_gemm import config, gemm_graph

KEPT = re.compile(r"The source is kept in (\S+), the compiler's whole output in (\S+)\.$")
CODE = 'extern "C" __global__ void __launch_bounds__(128) tile_kernel(float* x) {\n  foo();\n}\n'


def refused(code: str, message: str) -> str:
    """The CompileError's message where the compile callback failed with ``message``."""
    def compile(_code):
        raise RuntimeError(message)

    with pytest.raises(CompileError) as err:
        ReportedCompile(compile)(code)
    return str(err.value)


@pytest.mark.skipif(etc_tvm.BUILD_ENV == build_env.NO_COMPILER, reason="needs nvcc")
def test_a_wgmma_tile_built_for_sm_80_is_told_the_arch_to_build_for():
    cfg = config("128x256x64_f32")
    with pytest.raises(CompileError) as err:
        build(gemm_graph(cfg), {"M": 256, "K": 256, "N": 512}, strategy="unfused",
              target={"kind": "cuda", "arch": "sm_80"})
    message = str(err.value)
    kernel = re.match(r"the CUDA compiler refused the generated kernels "
                      r"\((wgmma_gemm_128x256x64_f32\w*_grid_kernel)\) for sm_80:\n", message)
    assert kernel is not None, message
    assert "Instruction 'wgmma.fence' not supported on .target 'sm_80' (and " in message
    assert ("need a newer arch than sm_80 (wgmma, TMA and bulk copies need sm_90a): build for "
            "one, e.g. target={'kind': 'cuda', 'arch': 'sm_90a'}") in message
    assert "__global__" not in message and "warning" not in message
    assert len(message.splitlines()) <= 16
    source, log = (Path(p) for p in KEPT.search(message).groups())
    assert f"{kernel[1]}(" in source.read_text()
    assert "ptxas fatal" in log.read_text()


def test_nvcc_front_end_errors_point_into_the_kept_source():
    message = refused(CODE, CODE + "\nCompilation error:\n"
                      '/tmp/tmpab12/tvm_kernels.cu(2): error: identifier "foo" is undefined\n'
                      "    foo();\n    ^\n\n"
                      '/tmp/tmpab12/tvm_kernels.cu(9): warning #177-D: variable "v" was '
                      "declared but never referenced\n"
                      '/tmp/tmpab12/tvm_kernels.cu(5): error: identifier "foo" is undefined\n'
                      "2 errors detected in the compilation of \"tvm_kernels.cu\".\n")
    source, log = KEPT.search(message).groups()
    assert message.splitlines()[:2] == [
        "the CUDA compiler refused the generated kernels (tile_kernel) for the default arch:",
        f'  {source}(2): error: identifier "foo" is undefined (and 1 more places)']
    assert "newer arch" not in message and "warning" not in message
    assert Path(source).read_text() == CODE and "#177-D" in Path(log).read_text()


def test_nvrtc_log_is_read_as_nvcc_output():
    message = refused(CODE, "NVRTC compilation failed:\n"
                            'tvm_kernels.cu(2): error: identifier "foo" is undefined\n')
    source = KEPT.search(message).group(1)
    assert f'  {source}(2): error: identifier "foo" is undefined' in message.splitlines()


def test_other_failures_of_the_callback_pass_through():
    def compile(_code):
        raise RuntimeError("cannot find nvcc")

    with pytest.raises(RuntimeError, match="^cannot find nvcc$"):
        ReportedCompile(compile)(CODE)
