"""The MoE graph as one persistent kernel on the GPU: data-dependent notifies, wait counts
armed at run time, expert tiles released through a CSR trigger, skipped tiles; against float64
and the CPU reference executor replaying the same routing. Unfused, as one grid launch per call,
the expert tiles evaluate the same trigger and skip alike."""
import functools

import numpy as np
import pytest

from etc_tvm import ExecutionError
from etc_tvm.build import build
from etc_tvm.executor import execute

from moe_graph import (BT, COUNT_MODES, E, F, H, ROUTINGS, TOKENS, make_inputs, make_moe_graph,
                       moe_graph, moe_reference)

pytestmark = pytest.mark.gpu

STRATEGIES = ["static", "dynamic", "mixed", "barrier", "unfused"]  # mixed: experts in the ring
RTOL, ATOL = 1e-4, 1e-5  # float32 dot products of length H


@functools.lru_cache(maxsize=None)
def compiled(top_k, count_mode, tokens, strategy):
    return build(moe_graph(top_k, count_mode), {"T": tokens}, strategy=strategy)


@pytest.mark.parametrize("tokens", TOKENS + (64,))
@pytest.mark.parametrize("routing, top_k", ROUTINGS)
@pytest.mark.parametrize("count_mode", COUNT_MODES)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_matches_float64_and_the_reference_executor(strategy, count_mode, routing, top_k,
                                                    tokens):
    inputs = make_inputs(routing, tokens, top_k)
    got = compiled(top_k, count_mode, tokens, strategy)(*inputs)
    np.testing.assert_allclose(got, moe_reference(*inputs, top_k), rtol=RTOL, atol=ATOL)
    replayed = execute(moe_graph(top_k, count_mode), *inputs)
    np.testing.assert_allclose(got, replayed, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("count_mode", COUNT_MODES)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_100_launches_with_fresh_routings(strategy, count_mode):
    """One compiled kernel, a new routing every launch (random, one hot expert, idle experts
    in turn): the counts, the CSR and the skipped tiles change from launch to launch."""
    tokens, top_k = 12, 2
    run = compiled(top_k, count_mode, tokens, strategy)
    kinds = [r for r, k in ROUTINGS if k == top_k]
    for launch in range(100):
        inputs = make_inputs(kinds[launch % len(kinds)], tokens, top_k, seed=launch + 1)
        np.testing.assert_allclose(run(*inputs), moe_reference(*inputs, top_k), rtol=RTOL,
                                   atol=ATOL, err_msg=f"launch {launch}")


@pytest.mark.parametrize("strategy", ["static", "dynamic", "mixed"])  # barrier: no such edge
def test_an_expert_outside_expert_ready_stops_the_kernel(strategy):
    """expert_ready one element short and tokens routed to expert E-1: the arming (which
    evaluates scatter's notify map) reports the index instead of counting a wild element."""
    graph = make_moe_graph(H, E, 2, F, BT, "inferred", expert_ready_size=E - 1)
    x, w_router, bias, w_expert = make_inputs("random", 7, 2)
    bias[E - 1] = 100
    with pytest.raises(ExecutionError, match=r"the edge map scatter0: expert_ready "
                                             r"'t->topk\[t,:\]' gave the index 7, outside"):
        build(graph, {"T": 7}, strategy=strategy)(x, w_router, bias, w_expert)
