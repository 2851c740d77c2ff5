"""Property: on a random DAG of call_devices, every valid order gives the same result."""
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from etc_tvm import ETensor, Tensor, call_device, graph_func
from etc_tvm.executor import (ClaimedOrder, DynamicQueueOrder, MixedOrder, RandomOrder,
                              ReadyQueueOrder, StaticOrder, execute)
from etc_tvm.schedule import mixed_schedule
from etc_tvm.task_graph import TaskGraph

from tiles import COLS, ROWS, mix_tile, scale_tile

# How row tile i of a consumer waits for row tile i of its producer: one ETensor per edge,
# with the producer's and the consumer's maps.
EDGES = {
    "identity": (lambda n: (n,), "i->i", "i->i"),
    "barrier": (lambda n: (1,), "i->0", "i->0"),
    "pairs": (lambda n: ((n + 1) // 2,), "i->i//2", "i->i//2"),
    "transposed": (lambda n: (1, n), "i->0, i", "i->0, i"),
}


@st.composite
def dags(draw):
    """A list of calls: (tile, [(input value, edge kind)]); value 0 is the graph input."""
    calls = []
    for k in range(draw(st.integers(1, 6))):
        n_inputs = draw(st.sampled_from([1, 2]))
        inputs = [(draw(st.integers(0, k)), draw(st.sampled_from(sorted(EDGES))))
                  for _ in range(n_inputs)]
        calls.append(inputs)
    return calls, draw(st.integers(1, 5))


def build(calls):
    @graph_func
    def dag(X: Tensor(("M", COLS))):
        M = X.shape[0]
        out_edges = [{} for _ in calls]
        in_edges = [{} for _ in calls]
        for k, inputs in enumerate(calls):
            for source, kind in inputs:
                if source > 0:
                    shape, notify, wait = EDGES[kind]
                    event = ETensor(shape(M // ROWS))
                    out_edges[source - 1][event] = notify
                    in_edges[k][event] = wait
        values = [X]
        for k, inputs in enumerate(calls):
            tile = scale_tile if len(inputs) == 1 else mix_tile
            values.append(call_device(tile, tile_num=(M // ROWS,),
                                      args=[values[source] for source, _ in inputs],
                                      out=Tensor((M, COLS)), in_edges=in_edges[k],
                                      out_edges=out_edges[k]))
        return tuple(values[1:])

    return dag


def numpy_dag(calls, x):
    values = [x.astype("float64")]
    for inputs in calls:
        a = values[inputs[0][0]]
        values.append(2 * a + 1 if len(inputs) == 1 else a / 2 + np.tanh(values[inputs[1][0]]))
    return values[1:]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dag=dags(), seed=st.integers(0, 2**16), ring=st.sets(st.integers(0, 5)),
       ctas=st.integers(1, 4))
def test_every_valid_order_gives_the_same_result(dag, seed, ring, ctas):
    """...including mixed schedules with any subset of the calls in the ring (1 CTA: every
    hand-over between queue and ring happens on the one CTA)."""
    calls, tiles = dag
    graph = build(calls)
    x = np.random.default_rng(seed).standard_normal((tiles * ROWS, COLS)).astype("float32")
    task_graph = TaskGraph.build(graph, {"M": tiles * ROWS})
    topo = task_graph.topological_order()
    assert task_graph.ids_are_topological()  # edges between calls point to later calls
    queues, ring_calls = mixed_schedule(task_graph, ctas, ring & set(range(len(calls))))
    orders = [ReadyQueueOrder(), DynamicQueueOrder(1), DynamicQueueOrder(3),
              DynamicQueueOrder(2, early_push=False), RandomOrder(seed), RandomOrder(seed + 1),
              StaticOrder([topo]), StaticOrder([topo[k::3] for k in range(3)], seed=seed),
              MixedOrder(queues.queues, ring_calls), ClaimedOrder(1), ClaimedOrder(ctas, seed)]
    results = [execute(graph, x, order=o) for o in orders]
    for got, want in zip(results[0], numpy_dag(calls, x)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for other in results[1:]:
        for a, b in zip(other, results[0]):
            np.testing.assert_array_equal(a, b)
