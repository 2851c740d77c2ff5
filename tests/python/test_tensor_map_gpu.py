"""The TMA tile on the H200: rows loaded through a host-encoded tensor map equal the input,
under a persistent kernel and as a grid launch, over repeated launches."""
import numpy as np
import pytest

from etc_tvm.build import build

from tma_tiles import random_rows, tma_copy

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("strategy", ["static", "dynamic", "unfused"])
def test_tma_rows_arrive_whole(strategy, rng):
    compiled = build(tma_copy, {"R": 1024}, strategy=strategy)
    for _ in range(10):
        A = random_rows(rng, 1024)
        np.testing.assert_array_equal(compiled(A).view(np.uint16), A.view(np.uint16))
