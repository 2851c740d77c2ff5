import etc_tvm  # noqa: F401  (first: prepares CUDA builds before anything imports tvm)

import zlib

import numpy as np
import pytest


@pytest.fixture
def rng(request):
    """A NumPy generator seeded per test, so that failures reproduce."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def _has_gpu() -> bool:
    try:
        import tvm

        return bool(tvm.cuda(0).exist)
    except Exception:  # noqa: BLE001 (no CUDA runtime at all)
        return False


HAS_GPU = _has_gpu()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip)
