"""One compilation of the MoE graph for every token count up to 4096, on the GPU: each count
runs on the smallest sampled schedule that holds it, tasks beyond its grids skipped."""
import functools
from unittest import mock

import numpy as np
import pytest
import tvm

from etc_tvm import ExecutionError
from etc_tvm.build import build
from etc_tvm.executor import execute

from moe_graph import make_inputs, moe_graph, moe_reference

pytestmark = pytest.mark.gpu

TOKENS = (1, 2, 3, 7, 64, 100, 300, 1024)
RTOL, ATOL = 1e-4, 1e-5


@functools.lru_cache(maxsize=None)
def compiled_once(strategy):
    """The library and how many times ``tvm.compile`` ran to make it."""
    with mock.patch.object(tvm, "compile", wraps=tvm.compile) as counted:
        library = build(moe_graph(2, "tensor"), max_dims={"T": 4096}, strategy=strategy)
    return library, counted.call_count


def compiled(strategy):
    library, compilations = compiled_once(strategy)
    assert compilations == 1
    return library


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("strategy", ["static", "dynamic", "mixed", "barrier"])
def test_every_token_count_from_one_library(strategy, tokens):
    inputs = make_inputs("random", tokens, 2)
    got = compiled(strategy)(*inputs)
    np.testing.assert_allclose(got, moe_reference(*inputs, 2), rtol=RTOL, atol=ATOL)
    if tokens <= 100:  # the CPU executor running the sample's task graph with the same skips
        sample = next(s for s, _, _ in compiled(strategy).meta.samples if s["T"] >= tokens)
        replayed = execute(moe_graph(2, "tensor"), *inputs, schedule_dims=sample)
        np.testing.assert_allclose(got, replayed, rtol=RTOL, atol=ATOL)


def test_above_the_largest_sample_is_a_clear_error():
    with pytest.raises(ExecutionError, match=r"\{'T': 4097\} exceed the largest sample"):
        compiled("static")(*make_inputs("random", 4097, 2))
