import etc_tvm  # noqa: F401  (first: prepares CUDA builds before anything imports tvm)

import os
import shutil
import zlib

import numpy as np
import pytest

from etc_tvm import distributed
from etc_tvm.errors import EtcError


@pytest.fixture
def rng(request):
    """A NumPy generator seeded per test, so that failures reproduce."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(scope="session")
def nvshmem_home():
    """NVSHMEM's install, for the tests that build kernels of several ranks (nvcc too)."""
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    try:
        return distributed.nvshmem_home()
    except EtcError as err:
        pytest.skip(str(err))


def _has_gpu() -> bool:
    try:
        import tvm

        return bool(tvm.cuda(0).exist)
    except Exception:  # noqa: BLE001 (no CUDA runtime at all)
        return False


HAS_GPU = _has_gpu()


BLAS_THREADS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def pytest_configure(config):
    """One BLAS thread a pytest-xdist worker (where the environment names none): ``-n auto``
    already runs a worker a core, and a BLAS pool of a thread a core in every worker would
    run the float64 references' matrix products on many times more threads than cores.
    Workers start after this hook and inherit the environment."""
    if config.getoption("numprocesses", None):
        for name in BLAS_THREADS:
            os.environ.setdefault(name, "1")


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip)
