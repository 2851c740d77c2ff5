"""The GPU tests' graphs on the CPU reference executor, against their float64 references."""
import numpy as np
import pytest

from etc_tvm.executor import RandomOrder, execute

from megakernel_cases import ATOL, CASES, RTOL


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_executor_matches_float64(case, rng):
    graph, dims, make, reference = CASES[case]
    inputs = make(rng)
    np.testing.assert_allclose(execute(graph, *inputs, order=RandomOrder(1)),
                               reference(*inputs), rtol=RTOL, atol=ATOL)
