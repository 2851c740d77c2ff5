"""Build here, run there: an exported library carries sm_90a machine code, and a TVM runtime
without the compiler library loads and runs it."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import etc_tvm
from etc_tvm import EtcError, build_env, load
from etc_tvm.build import build
from etc_tvm.executor import execute

import graphs
from tiles import COLS, ROWS

DIMS = {"M": 40 * ROWS}
LOADER = """
import sys
import numpy as np
from etc_tvm import load
graph = load(sys.argv[1])
x, y = np.load(sys.argv[2]), np.load(sys.argv[3])
np.save(sys.argv[4], graph(x, y))
assert "tvm.relax" not in sys.modules  # the compiler's Python side never loaded
"""
TVM_FIRST = """
import sys
import tvm  # before etc_tvm: on a machine without a driver it loads no CUDA runtime
import etc_tvm
sys.path.insert(0, sys.argv[3])
import graphs
etc_tvm.build(graphs.two_ops, {"M": int(sys.argv[2])}).export(sys.argv[1])
print(etc_tvm.BUILD_ENV)
"""


def export(tmp_path: Path) -> Path:
    path = tmp_path / "two_ops.so"
    build(graphs.two_ops, DIMS).export(path)
    return path


def assert_machine_code(library: Path) -> None:
    data = library.read_bytes()
    assert b"__global__" not in data  # no CUDA source to compile at load time
    assert data.count(b"\x7fELF") >= 2  # the host library and the embedded GPU image
    assert b"sm_90a" in data
    assert library.with_name(library.name + ".json").exists()


def test_load_names_a_missing_library_or_metadata(tmp_path):
    library = tmp_path / "g.so"
    with pytest.raises(EtcError, match=f"load: no library at {library}"):
        load(library)
    library.write_bytes(b"")
    with pytest.raises(EtcError, match=f"load: {library}.json is missing: the metadata that "
                                       "CompiledGraph.export writes beside the library"):
        load(library)


needs_nvcc = pytest.mark.skipif(etc_tvm.BUILD_ENV == build_env.NO_COMPILER, reason="needs nvcc")


@needs_nvcc
def test_export_holds_machine_code_not_source(tmp_path):
    assert_machine_code(export(tmp_path))


def export_after_import_tvm(library: Path, path: str) -> subprocess.CompletedProcess:
    """``TVM_FIRST`` in a fresh process whose PATH is ``path``; its stdout is BUILD_ENV."""
    env = {k: v for k, v in os.environ.items() if k != "TVM_CUDA_COMPILE_MODE"}
    proc = subprocess.run([sys.executable, "-W", "always", "-c", TVM_FIRST, str(library),
                           str(DIMS["M"]), str(Path(__file__).parent)],
                          env={**env, "PATH": path}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@needs_nvcc
def test_export_holds_machine_code_when_tvm_was_imported_first(tmp_path):
    library = tmp_path / "two_ops.so"
    proc = export_after_import_tvm(library, os.environ.get("PATH", ""))
    assert proc.stdout.strip() in (build_env.DRIVER, build_env.STUB_DRIVER), proc.stdout
    assert_machine_code(library)


def test_export_without_nvcc_warns_that_it_holds_source(tmp_path):
    """With neither a driver nor nvcc (taken off the PATH) the library carries CUDA source,
    and export says so."""
    if etc_tvm.BUILD_ENV == build_env.DRIVER:
        pytest.skip("a driver compiles through NVRTC, nvcc or not")
    library = tmp_path / "two_ops.so"
    path = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if not (Path(d) / "nvcc").exists())
    proc = export_after_import_tvm(library, path)
    assert proc.stdout.strip() == build_env.NO_COMPILER, proc.stdout
    assert "the kernels are CUDA source, not sm_90a machine code" in proc.stderr
    assert b"__global__" in library.read_bytes()


@pytest.mark.gpu
def test_runtime_without_compiler_library_runs_it(tmp_path, rng):
    """Loads ``$ETC_TVM_PREBUILT/two_ops.so`` when given (exported on another machine), else
    one exported here, in a fresh process with ``TVM_USE_RUNTIME_LIB=1``."""
    prebuilt = os.environ.get("ETC_TVM_PREBUILT")
    library = Path(prebuilt) / "two_ops.so" if prebuilt else export(tmp_path)
    x, y = (rng.standard_normal((DIMS["M"], COLS)).astype("float32") for _ in range(2))
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    env = {**os.environ, "TVM_USE_RUNTIME_LIB": "1"}
    proc = subprocess.run([sys.executable, "-c", LOADER, str(library), str(tmp_path / "x.npy"),
                           str(tmp_path / "y.npy"), str(tmp_path / "out.npy")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), execute(graphs.two_ops, x, y),
                               rtol=1e-5, atol=1e-5)
