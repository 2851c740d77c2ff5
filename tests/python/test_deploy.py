"""Build here, run there: an exported library carries sm_90a machine code, and a TVM runtime
without the compiler library loads and runs it."""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import etc_tvm
from etc_tvm import EtcError, build_env, load
from etc_tvm.build import build, has_gpu
from etc_tvm.executor import execute
from etc_tvm.runtime import GraphMeta, SampledMeta
from etc_tvm.tir_sched.persistent import KernelOptions

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


def gpu(sms: int = 132, compute: str = "9.0", name: str = "NVIDIA H100 80GB HBM3"):
    """What ``GraphMeta.check_device`` reads of a ``tvm.runtime.Device``."""
    return SimpleNamespace(device_name=name, index=0, compute_version=compute,
                           multi_processor_count=sms)


def exported_meta(tmp_path: Path, **kwargs) -> dict:
    path = tmp_path / "two_ops.so"
    build(graphs.two_ops, DIMS, **kwargs).export(path)
    return json.loads(Path(f"{path}.json").read_text())


@pytest.mark.skipif(has_gpu(), reason="where there is no GPU")
def test_a_build_without_a_gpu_says_to_export_it():
    compiled = build(graphs.two_ops, DIMS)
    x = np.zeros((DIMS["M"], COLS), "float32")
    for run in (compiled, compiled.run, compiled.profile):
        with pytest.raises(EtcError, match=r"two_ops: no GPU here: export\(\) the library and "
                                           r"load\(\) it where one is"):
            run(x, x)


def test_export_records_the_grid_and_arch_the_loader_checks(tmp_path):
    fields = exported_meta(tmp_path, num_sms=66, options=KernelOptions(ctas_per_sm=2))
    assert (fields["ctas"], fields["ctas_per_sm"], fields["arch"]) == (132, 2, "sm_90a")
    meta = GraphMeta(**fields)
    meta.check_device(gpu(sms=66))
    meta.check_device(gpu(sms=132))  # runs, on half the SMs
    with pytest.raises(EtcError, match=r"two_ops: its persistent kernel was built for 66 SMs "
                                       r"\(132 CTAs, 2 an SM, all resident at once\); NVIDIA "
                                       r"H20 \(GPU 0\) has 60: build it on this GPU "
                                       r"\(num_sms=None\) or with num_sms=60"):
        meta.check_device(gpu(sms=60, name="NVIDIA H20"))
    for compute, name in (("10.0", "NVIDIA B200"), ("8.9", "NVIDIA L40S")):
        with pytest.raises(EtcError, match=r"two_ops was compiled for sm_90a, whose machine code "
                                           rf"runs on sm_90 only; {name} \(GPU 0\) is "
                                           f"sm_{compute.replace('.', '')}: build it for this "
                                           "GPU's arch"):
            meta.check_device(gpu(compute=compute, name=name))


def test_unfused_launches_need_no_sm_count(tmp_path):
    meta = GraphMeta(**exported_meta(tmp_path, strategy="unfused"))
    assert meta.ctas == 0
    meta.check_device(gpu(sms=1))
    with pytest.raises(EtcError, match="compiled for sm_90a"):
        meta.check_device(gpu(compute="8.0"))


def test_every_sample_is_checked():
    metas = [GraphMeta("g", [], [], 4.0, ctas=ctas, arch="sm_90a") for ctas in (114, 132)]
    sampled = SampledMeta("g", {"B": [0, 0]}, [[{"B": 8}, "g__sample0", metas[0]],
                                               [{"B": 64}, "g__sample1", metas[1]]])
    sampled.check_device(gpu(sms=132))
    with pytest.raises(EtcError, match="built for 132 SMs"):
        sampled.check_device(gpu(sms=114))


def test_metadata_without_the_grid_is_not_checked():
    """Metadata written before the grid and arch were recorded loads, unchecked."""
    meta = GraphMeta(**{"name": "g", "task_names": [], "etensors": [], "timeout_s": 4.0})
    meta.check_device(gpu(sms=1, compute="7.0"))


@pytest.mark.gpu
def test_a_gpu_with_fewer_sms_than_the_build_is_refused_before_a_launch():
    import tvm

    sms = tvm.cuda(0).multi_processor_count
    with pytest.raises(EtcError, match=f"built for {sms + 1} SMs .* has {sms}: build it on "
                                       f"this GPU \\(num_sms=None\\) or with num_sms={sms}"):
        build(graphs.two_ops, DIMS, num_sms=sms + 1)


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
