"""The CPU reference executor under every order, against plain NumPy."""
import numpy as np
import pytest
from tvm.script import tirx as T

from etc_tvm import (DeadlockError, ETensor, EtcError, ExecutionError, Tensor, call_device,
                     device_func, graph_func)
from etc_tvm.executor import (ClaimedOrder, DynamicQueueOrder, RandomOrder, ReadyQueueOrder,
                              StaticOrder, execute)
from etc_tvm.schedule import list_schedule
from etc_tvm.task_graph import TaskGraph

from graphs import backward_chain, gemm_reduce_scatter, row_sum, row_sum_after_all, two_ops
from tiles import COLS, ROWS, scale_tile


def orders(graph, dims):
    """Every kind of order: ready queue, GPU dynamic schedule (early push or not, 1 and 5 CTAs),
    random interleavings, static queues on 1, 3 and 8 SMs, CTAs claiming in id order (1 and 5,
    in CTA order and at random)."""
    topo = TaskGraph.build(graph, dims).topological_order()
    yield ReadyQueueOrder()
    for ctas in (1, 5):
        yield DynamicQueueOrder(ctas)
        yield DynamicQueueOrder(ctas, early_push=False)
    for seed in range(3):
        yield RandomOrder(seed)
    for sms in (1, 3, 8):
        yield StaticOrder([topo[k::sms] for k in range(sms)])
        yield StaticOrder([topo[k::sms] for k in range(sms)], seed=sms)
    for ctas in (1, 5):
        yield ClaimedOrder(ctas)
        yield ClaimedOrder(ctas, seed=ctas)


@pytest.mark.parametrize("M,K,N", [(16, 16, 16), (64, 48, 32), (32, 80, 112)])
def test_gemm_reduce_scatter_world_size_1(rng, M, K, N):
    A = rng.standard_normal((M, K)).astype("float32")
    B = rng.standard_normal((K, N)).astype("float32")
    want = A.astype("float64") @ B.astype("float64")
    for order in orders(gemm_reduce_scatter, {"M": M, "K": K, "N": N}):
        np.testing.assert_allclose(execute(gemm_reduce_scatter, A, B, order=order), want,
                                   rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("M,N", [(16, 16), (48, 64), (32, 160)])
def test_fan_in_row_sum(rng, M, N):
    X = rng.standard_normal((M, N)).astype("float32")
    for order in orders(row_sum, {"M": M, "N": N}):
        np.testing.assert_allclose(execute(row_sum, X, order=order),
                                   X.astype("float64").sum(axis=1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("M,N", [(16, 32), (48, 64)])
def test_fan_in_over_whole_calls(rng, M, N):
    """Every row tile waits on all partial sums: the dynamic order pushes the call whole."""
    X = rng.standard_normal((M, N)).astype("float32")
    for order in orders(row_sum_after_all, {"M": M, "N": N}):
        np.testing.assert_allclose(execute(row_sum_after_all, X, order=order),
                                   X.astype("float64").sum(axis=1), rtol=1e-5, atol=1e-5)


def test_two_ops_all_orders_bit_identical(rng):
    X, Y = (rng.standard_normal((40, COLS)).astype("float32") for _ in range(2))
    results = [execute(two_ops, X, Y, order=o) for o in orders(two_ops, {"M": 40})]
    want = (2 * X.astype("float64") + 1) / 2 + np.tanh(Y.astype("float64"))
    np.testing.assert_allclose(results[0], want, rtol=1e-5, atol=1e-6)
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])


def test_trace_respects_edges(rng):
    X, Y = (rng.standard_normal((24, COLS)).astype("float32") for _ in range(2))
    graph = TaskGraph.build(two_ops, {"M": 24})
    for seed in range(5):
        trace = []
        execute(two_ops, X, Y, order=RandomOrder(seed), trace=trace)
        assert sorted(trace) == list(range(graph.num_tasks))
        position = {t: k for k, t in enumerate(trace)}
        for consumer in graph.calls[1].tasks:
            assert position[consumer] > position[consumer - graph.calls[1].first_task]


@graph_func
def chain(X: Tensor(("M", COLS))):
    """A dependent chain inside one call: row tile i waits for tile i-1."""
    M = X.shape[0]
    E = ETensor((M // ROWS,), name="link")
    return call_device(scale_tile, tile_num=(M // ROWS,), args=[X], out=Tensor((M, COLS)),
                       in_edges={E: "i->i-1 if i > 0"}, out_edges={E: "i->i"})


def test_chain_runs_in_chain_order(rng):
    X = rng.standard_normal((20, COLS)).astype("float32")
    trace = []
    np.testing.assert_allclose(execute(chain, X, order=RandomOrder(7), trace=trace), 2 * X + 1)
    assert trace == list(range(5))


def test_deadlock_report_names_task_event_counter_and_sm(rng):
    X = rng.standard_normal((12, COLS)).astype("float32")
    reversed_queue = StaticOrder([[2, 1, 0]])  # tile 2 first: it waits on tile 1 forever
    with pytest.raises(DeadlockError) as err:
        execute(chain, X, order=reversed_queue)
    msg = str(err.value)
    assert "3 tasks left" in msg
    assert "scale_tile0(2) on SM 0 waits on link[1]: counter 1 of wait count 1" in msg


def test_claimed_tasks_run_in_id_order_on_one_cta_and_spread_over_many(rng):
    X = rng.standard_normal((6 * ROWS, COLS)).astype("float32")
    Y = rng.standard_normal((6 * ROWS, COLS)).astype("float32")
    for ctas, seed in ((1, None), (4, None), (4, 3)):
        trace = []
        execute(two_ops, X, Y, order=ClaimedOrder(ctas, seed), trace=trace)
        assert sorted(trace) == list(range(12))
        if ctas == 1:
            assert trace == list(range(12))


def test_claims_deadlock_on_a_wait_for_a_higher_id(rng):
    """Tile i waits on tile i + 1: one CTA holds tile 0 and never claims tile 1. The kernel
    refuses such graphs (``TaskGraph.ids_are_topological``); the model reports the hang."""
    X = rng.standard_normal((4 * ROWS, COLS)).astype("float32")
    with pytest.raises(DeadlockError, match=r"scale_tile0\(0\) claimed by CTA 0 waits on "
                                            r"E\[1\]"):
        execute(backward_chain, X, order=ClaimedOrder(1))
    np.testing.assert_allclose(execute(backward_chain, X, order=ClaimedOrder(4)), 2 * X + 1)


def test_outputs_are_poisoned_before_the_run(rng):
    @graph_func
    def half_written(X: Tensor(("M", COLS))):
        # only the first half of the row tiles run: the rest of the output stays poisoned
        M = X.shape[0]
        return call_device(scale_tile, tile_num=(M // ROWS // 2,), args=[X],
                           out=Tensor((M, COLS)))

    out = execute(half_written, rng.standard_normal((16, COLS)).astype("float32"))
    assert np.isfinite(out[:8]).all() and np.isnan(out[8:]).all()


@pytest.mark.parametrize("inputs,match", [
    (lambda: (np.zeros((8, COLS), "float32"),), "takes 2 inputs, got 1"),
    (lambda: (np.zeros((8, COLS), "float64"), np.zeros((8, COLS), "float32")),
     "input 'X' is float32, got float64"),
    (lambda: (np.zeros((8,), "float32"), np.zeros((8, COLS), "float32")), "has rank 2"),
    (lambda: (np.zeros((8, COLS), "float32"), np.zeros((12, COLS), "float32")),
     r"dim 0 of input 'Y' is 12, expected 8 \(M\)"),
    (lambda: (np.zeros((8, 5), "float32"), np.zeros((8, COLS), "float32")),
     "dim 1 of input 'X' is 5, expected 32"),
    (lambda: ([[0.0] * COLS] * 8, np.zeros((8, COLS), "float32")),
     "input 'X' is a list, not a NumPy array"),
])
def test_bad_inputs(inputs, match):
    with pytest.raises(EtcError, match=match):
        execute(two_ops, *inputs())


def test_an_order_that_is_no_order_is_refused(rng):
    X, Y = (rng.standard_normal((8, COLS)).astype("float32") for _ in range(2))
    with pytest.raises(EtcError, match=r"two_ops: order=\[\[0, 1, 2, 3\]\] is not an executor "
                                       r"Order \(e.g. ReadyQueueOrder\(\), StaticOrder"):
        execute(two_ops, X, Y, order=[[0, 1, 2, 3]])


def test_static_queues_must_cover_every_task_once(rng):
    X, Y = (rng.standard_normal((8, COLS)).astype("float32") for _ in range(2))
    with pytest.raises(EtcError, match=r"missing \[3\], repeated or unknown \[0\]"):
        execute(two_ops, X, Y, order=StaticOrder([[0, 1, 2], [0]]))


def test_missing_reference_is_reported_before_running(rng):
    @device_func
    def bare(i: T.int32, A: T.Buffer((8,), "float32"), B: T.Buffer((8,), "float32")):
        T.device_entry()
        tx = T.thread_id([8])
        B[tx] = A[tx]

    @graph_func
    def g(A: Tensor((8,))):
        return call_device(bare, tile_num=(1,), args=[A], out=Tensor((8,)))

    with pytest.raises(EtcError, match="bare has no NumPy reference"):
        execute(g, np.ones(8, "float32"))


def test_notify_outside_etensor_at_run_time_is_reported(rng):
    @graph_func
    def g(X: Tensor(("M", COLS))):
        M = X.shape[0]
        E = ETensor((M // ROWS,), name="E")
        return call_device(scale_tile, tile_num=(M // ROWS,), args=[X], out=Tensor((M, COLS)),
                           out_edges={E: "i->i+1"})

    with pytest.raises(EtcError, match=r"gives E\[2\], outside E of shape \[2\]"):
        execute(g, np.ones((8, COLS), "float32"))


def test_execution_error_is_an_etc_error():
    assert issubclass(DeadlockError, ExecutionError) and issubclass(ExecutionError, EtcError)


def test_dynamic_queue_pushes_a_chain_one_task_at_a_time(rng):
    """Each link is pushed when the previous one is dispatched: the ring never holds two."""
    X = rng.standard_normal((10 * ROWS, COLS)).astype("float32")
    order, trace = DynamicQueueOrder(4), []
    np.testing.assert_allclose(execute(chain, X, order=order, trace=trace), 2 * X + 1)
    assert trace == list(range(10)) and order.max_queued == 1


def test_dynamic_queue_deadlock_names_what_each_task_waits_on(rng):
    """Counts given at run time (2 per element) that the producers never reach."""
    @graph_func
    def short(X: Tensor((3 * ROWS, COLS)), counts: Tensor((3,), "int32")):
        E = ETensor((3,), wait_count=counts, name="E")
        A = call_device(scale_tile, tile_num=(3,), args=[X], out=Tensor((3 * ROWS, COLS)),
                        out_edges={E: "i->i"})
        return call_device(scale_tile, tile_num=(3,), args=[A], out=Tensor((3 * ROWS, COLS)),
                           in_edges={E: "i->i"})

    counts = np.full(3, 2, np.int32)
    with pytest.raises(DeadlockError, match=r"scale_tile1\(0\) on CTA 0 waits on E\[0\]: "
                                            r"counter 1 of wait count 2"):
        execute(short, np.zeros((3 * ROWS, COLS), "float32"), counts,
                order=DynamicQueueOrder(2))


@pytest.mark.parametrize("graph, make, dims, sample", [
    (two_ops, lambda r, n: [r.standard_normal((n, COLS)).astype("float32") for _ in range(2)],
     [ROWS, 3 * ROWS, 7 * ROWS], {"M": 8 * ROWS}),
    (chain, lambda r, n: [r.standard_normal((n, COLS)).astype("float32")],
     [ROWS, 5 * ROWS], {"M": 8 * ROWS}),
    (row_sum, lambda r, n: [r.standard_normal((n, 48)).astype("float32")],
     [16, 32], {"M": 64}),
], ids=["two_ops", "chain", "row_sum"])
def test_a_schedule_for_a_larger_size_serves_smaller_ones(graph, make, dims, sample, rng):
    """The graph instantiated for the sample size, out-of-range tasks skipped, gives what the
    graph instantiated for the actual size gives, under its sample-size static queues too."""
    name = next(iter(sample))
    big = TaskGraph.build(graph, {**sample, **({"N": 48} if graph is row_sum else {})})
    queues = list_schedule(big, 3).queues
    for n in dims:
        inputs = make(rng, n)
        want = execute(graph, *inputs)
        for order in (ReadyQueueOrder(), RandomOrder(n), StaticOrder(queues),
                      DynamicQueueOrder(2)):
            got = execute(graph, *inputs, order=order, schedule_dims=sample)
            assert got.shape == want.shape
            np.testing.assert_array_equal(got, want)
    with pytest.raises(EtcError, match=rf"schedule_dims {name}={sample[name]} is smaller"):
        execute(graph, *make(rng, sample[name] + 16), schedule_dims=sample)


@pytest.mark.parametrize("order", [ClaimedOrder, DynamicQueueOrder])
@pytest.mark.parametrize("num_ctas", [0, 2.5, True])
def test_an_order_of_ctas_needs_a_positive_integer_of_them(order, num_ctas):
    """2.5 CTAs was a TypeError of ``range`` once the run started."""
    with pytest.raises(EtcError, match=rf"{order.__name__}: num_ctas={num_ctas!r} is not a "
                                       "positive integer"):
        order(num_ctas)
