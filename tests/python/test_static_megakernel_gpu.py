"""The persistent megakernels on the GPU, against float64 NumPy and the CPU reference executor."""
import re
import time

import numpy as np
import pytest

from etc_tvm import ExecutionError
from etc_tvm.build import build
from etc_tvm.executor import execute
from etc_tvm.schedule import round_robin_schedule
from etc_tvm.tir_sched.persistent import KernelOptions

import graphs
from megakernel_cases import ATOL, CASES, MEGAKERNELS, RTOL

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("strategy", [*MEGAKERNELS, "unfused"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_float64_and_the_reference_executor(case, strategy, rng):
    graph, dims, make, reference = CASES[case]
    compiled = build(graph, dims, **MEGAKERNELS.get(strategy, {"strategy": strategy}))
    inputs = make(rng)
    got = compiled(*inputs)
    np.testing.assert_allclose(got, reference(*inputs), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got, execute(graph, *inputs), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("case", sorted(CASES))
def test_unfused_replayed_from_a_cuda_graph(case, rng):
    import tvm

    graph, dims, make, reference = CASES[case]
    compiled = build(graph, dims, strategy="unfused")
    inputs = [tvm.runtime.tensor(x, tvm.cuda(0)) for x in make(rng)]
    replay, outputs = compiled.capture(*inputs)
    for _ in range(3):
        replay()
    import torch

    torch.cuda.synchronize()
    np.testing.assert_allclose(outputs[0].numpy(), reference(*(x.numpy() for x in inputs)),
                               rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("claim", [False, True])
@pytest.mark.parametrize("case", ["two_ops", "gemm_reduce_scatter", "prelude_weighted_rows"])
def test_100_launches_are_identical(case, claim, rng):
    graph, dims, make, _ = CASES[case]
    compiled = build(graph, dims, options=KernelOptions(claim=claim))
    inputs = make(rng)
    first = compiled(*inputs)
    for _ in range(99):
        np.testing.assert_array_equal(compiled(*inputs), first)


@pytest.mark.parametrize("claim", [False, True])
def test_a_missing_notify_stops_the_kernel_with_a_named_error(claim, rng):
    """Every task after the one whose notify is dropped waits on its predecessor's link; the
    first to time out names itself, the link it waited on and the SM, well within the limit.
    Round-robin queues put each hop on another SM (a same-SM producer's wait is elided); so
    do claims, which never elide a wait."""
    graph, dims, make, _ = CASES["dependent_chain"]
    dropped = 10
    compiled = build(graph, dims, options=KernelOptions(timeout_s=0.5, drop_notify=dropped,
                                                        claim=claim),
                     scheduler=round_robin_schedule)
    start = time.perf_counter()
    with pytest.raises(ExecutionError) as err:
        compiled(*make(rng))
    assert time.perf_counter() - start < 3
    match = re.search(r"task scale_tile0\((\d+)\) on SM (\d+) waited on link\[(\d+)\] "
                      r"\(counter 1\) for more than 0.5 s", str(err.value))
    assert match, str(err.value)
    task, sm, link = (int(g) for g in match.groups())
    assert task > dropped and link == task - 1 and 0 <= sm < 132


@pytest.mark.parametrize("strategy", ["static", "mixed", "unfused"])
@pytest.mark.parametrize("graph", ["gathers", "doubled_gather"])
def test_a_failed_input_check_stops_the_call_and_the_next_call_runs(graph, strategy, rng):
    """A slot outside A's rows is an error naming the task and the value; the next call with
    good slots returns the right rows, so the stop record was cleared for it (unfused: by a
    launch of its own where the first call checks, else by the first launch). Mixed: CTAs of
    4 threads, which poll their queue's head on thread 0."""
    run = build(getattr(graphs, graph), strategy=strategy)
    a = rng.standard_normal(8).astype(np.float32)
    with pytest.raises(ExecutionError, match=r"task [BD]\w*\(0\) on SM \d+: slot 9 outside 0\.\.7"):
        run(np.array([1, 9, 2, 3], np.int32), a)
    slot = np.array([7, 0, 5, 5], np.int32)
    got = run(slot, a)
    np.testing.assert_array_equal(got[0] if graph == "gathers" else got, 2 * a[slot])
