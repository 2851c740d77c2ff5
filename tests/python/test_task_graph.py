"""The task graph: instantiation, wait-count inference, checks and reports."""
import re

import numpy as np
import pytest

import tvm

from etc_tvm import ETensor, EtcError, GraphError, Tensor, call_device, device_func, graph_func
from etc_tvm.task_graph import TaskGraph

from graphs import backward_chain, gemm_reduce_scatter, row_sum, two_ops
from tiles import COLS, ROWS, TILE, K, matmul_tile, mix_tile, partial_rowsum_tile, scale_tile


def test_instantiates_tasks_in_program_order():
    graph = TaskGraph.build(gemm_reduce_scatter, {"M": 32, "K": 16, "N": 48})
    assert [c.grid for c in graph.calls] == [(2, 3), (2, 3)]
    assert graph.num_tasks == 12
    assert graph.task_name(0) == "C(0,0)" and graph.task_name(11) == "D(1,2)"
    assert graph.notifies[4] == [("E", (1, 1))] and graph.waits[10] == [("E", (1, 1))]
    assert graph.waits[4] == [] and graph.notifies[10] == []


def test_a_tile_requirement_is_checked_where_the_dims_are_known():
    """A tile's ``requires`` (here K in whole 16-row steps) refuses a call whose concrete dims
    break it, naming the graph, the call and the tile."""
    stepped = device_func(matmul_tile.prim_func, requires=[(K % 16 == 0, "K a multiple of 16")])

    def product(k):
        @graph_func
        def g(A: Tensor((16, k)), B: Tensor((k, 16))):
            return call_device(stepped, tile_num=(1, 1), args=[A, B], out=Tensor((16, 16)))
        return g

    assert TaskGraph.build(product(32), {}).num_tasks == 1
    with pytest.raises(GraphError, match=r"g: call matmul_tile0: matmul_tile takes K a multiple "
                                         r"of 16, got A \(16, 40\), B \(40, 16\), C \(16, 16\)"):
        TaskGraph.build(product(40), {})


@pytest.mark.parametrize("requires, match", [
    ([K % 16 == 0], r"\(condition, what\) pairs"),
    ([(K + 16, "K")], r"\(condition, what\) pairs"),
    ([(tvm.tirx.Var("Q", "int32") > 0, "Q")], r"uses \[Q\], which are not dims"),
])
def test_a_tile_requirement_is_a_condition_on_its_dims(requires, match):
    with pytest.raises(EtcError, match=match):
        device_func(matmul_tile.prim_func, requires=requires)


def test_symbolic_dim_must_be_given():
    with pytest.raises(GraphError, match=r"no value given for the symbolic dim 'N'"):
        TaskGraph.build(gemm_reduce_scatter, {"M": 32, "K": 16})


@pytest.mark.parametrize("n", [9.5, 16.0, "16", None])
def test_a_symbolic_dim_must_be_an_integer(n):
    # it was truncated: N = 9.5 built the graph of N = 9
    with pytest.raises(GraphError, match=rf"the symbolic dim N = {re.escape(repr(n))} is not "
                                         "an integer"):
        TaskGraph.build(gemm_reduce_scatter, {"M": 32, "K": 16, "N": n})


def test_a_symbolic_dim_may_be_a_numpy_integer():
    assert TaskGraph.build(gemm_reduce_scatter, {"M": 32, "K": 16, "N": np.int64(16)}) \
        .dims["N"] == 16


@pytest.mark.parametrize("out_map,shape,want", [
    ("ij->i", lambda m, n: (m,), lambda m, n: np.full((m,), n)),
    ("ij->0", lambda m, n: (1,), lambda m, n: np.array([m * n])),
    ("ij->i//2", lambda m, n: ((m + 1) // 2,),
     lambda m, n: np.array([n * min(2, m - 2 * e) for e in range((m + 1) // 2)])),
    ("ij->ji", lambda m, n: (n, m), lambda m, n: np.ones((n, m))),
    ("ij->i*2+j if j < 2", lambda m, n: (2 * m + n,),
     lambda m, n: np.bincount([2 * i + j for i in range(m) for j in range(min(n, 2))],
                              minlength=2 * m + n)),
])
@pytest.mark.parametrize("m,n", [(1, 1), (3, 2), (5, 4)])
def test_wait_count_inference(out_map, shape, want, m, n):
    @graph_func
    def g(X: Tensor(("M", "N"))):
        M, N = X.shape
        E = ETensor(shape(M // TILE, N // TILE), name="E")
        return call_device(partial_rowsum_tile, tile_num=(M // TILE, N // TILE), args=[X],
                           out=Tensor((M, N // TILE)), out_edges={E: out_map})

    counts = TaskGraph.build(g, {"M": m * TILE, "N": n * TILE}).static_counts()["E"]
    np.testing.assert_array_equal(counts, want(m, n))


def producer_consumer(wait_count, notify="i->i", wait="i->i", size=lambda m: m):
    @graph_func
    def g(X: Tensor(("M", COLS))):
        M = X.shape[0]
        E = ETensor((size(M // ROWS),), wait_count=wait_count, name="E")
        A = call_device(scale_tile, tile_num=(M // ROWS,), args=[X], out=Tensor((M, COLS)),
                        out_edges={E: notify})
        return call_device(mix_tile, tile_num=(M // ROWS,), args=[A, X],
                           out=Tensor((M, COLS)), in_edges={E: wait})
    return TaskGraph.build(g, {"M": 4 * ROWS})


def test_given_wait_count_that_matches_is_accepted():
    producer_consumer(1).validate()
    producer_consumer(4, notify="i->0", wait="i->0", size=lambda m: 1).validate()


@pytest.mark.parametrize("args,match", [
    ((1, "i->0", "i->0", lambda m: 1),
     r"E\[0\] has wait_count 1 but is notified 4 times \(by scale_tile0\(0\), scale_tile0\(1\)"),
    ((2,), r"E\[0\] is waited on by mix_tile0\(0\) but is notified 1 times, fewer than its "
           r"wait_count 2"),
    ((None, "i->i//2", "i->i"),
     r"E\[2\] is waited on by mix_tile0\(2\) but no task notifies it"),
])
def test_wrong_wait_counts_are_reported_by_name(args, match):
    with pytest.raises(GraphError, match=match):
        producer_consumer(*args).validate()


def test_wait_count_zero_makes_an_unnotified_wait_legal():
    @graph_func
    def g(X: Tensor(("M", COLS))):
        M = X.shape[0]
        ready, open_gate = ETensor((M // ROWS,)), ETensor((1,), wait_count=0)
        A = call_device(scale_tile, tile_num=(M // ROWS,), args=[X], out=Tensor((M, COLS)),
                        out_edges={ready: "i->i"})
        return call_device(mix_tile, tile_num=(M // ROWS,), args=[A, X], out=Tensor((M, COLS)),
                           in_edges={ready: "i->i", open_gate: "i->0"})

    graph = TaskGraph.build(g, {"M": 4 * ROWS})
    graph.validate()
    assert graph.static_counts()["E1"].tolist() == [0]


def test_cycle_is_reported_with_its_path():
    @graph_func
    def g(X: Tensor(("M", COLS))):
        M = X.shape[0]
        E = ETensor((M // ROWS,), name="E")
        return call_device(scale_tile, tile_num=(M // ROWS,), args=[X], out=Tensor((M, COLS)),
                           in_edges={E: "i->(i+1)%3"}, out_edges={E: "i->i"})

    with pytest.raises(GraphError, match=r"cycle: scale_tile0\(0\) -> E\[0\] -> "
                                         r"scale_tile0\(2\) -> E\[2\] -> scale_tile0\(1\) -> "
                                         r"E\[1\] -> scale_tile0\(0\)"):
        TaskGraph.build(g, {"M": 3 * ROWS}).validate()


def test_a_graph_of_2_to_the_30_tasks_is_refused_by_name():
    """Task ids share the kernels' int32 words with flags at bit 30: a graph that many tasks
    would reach is refused before any task is instantiated."""
    with pytest.raises(GraphError, match=r"two_ops: 1073741824 tasks \(A 536870912, B "
                                         r"536870912\); a graph holds fewer than 1073741824 "
                                         r"\(2\^30\) tasks"):
        TaskGraph.build(two_ops, {"M": 2**29 * ROWS})
    assert TaskGraph.build(two_ops, {"M": 4 * ROWS}).num_tasks == 8


def test_ids_are_topological_when_every_wait_points_to_a_lower_id():
    assert TaskGraph.build(gemm_reduce_scatter, {"M": 32, "K": 16, "N": 48}).ids_are_topological()
    assert TaskGraph.build(two_ops, {"M": 4 * ROWS}).ids_are_topological()
    graph = TaskGraph.build(backward_chain, {"M": 4 * ROWS})
    graph.validate()
    assert not graph.ids_are_topological()


def test_read_without_event_is_a_race():
    @graph_func
    def g(X: Tensor(("M", COLS))):
        M = X.shape[0]
        A = call_device(scale_tile, tile_num=(M // ROWS,), args=[X], out=Tensor((M, COLS)))
        return call_device(mix_tile, tile_num=(M // ROWS,), args=[A, X], out=Tensor((M, COLS)))

    with pytest.raises(GraphError, match="mix_tile0 reads 'scale_tile0', written by scale_tile0,"
                                         " but waits on no event that scale_tile0 notifies"):
        TaskGraph.build(g, {"M": 8}).validate()


def test_static_index_outside_the_etensor():
    with pytest.raises(GraphError, match=r"edge map 'i->i\+1' of task scale_tile0\(3,\) gives "
                                         r"E\[4\], outside E of shape \[4\]"):
        producer_consumer(None, notify="i->i+1")


def test_summary_and_dot():
    graph = TaskGraph.build(row_sum, {"M": 2 * TILE, "N": 3 * TILE})
    summary = graph.summary()
    assert "8 tasks in 2 calls, 1 event tensors" in summary
    assert "S: partial_rowsum_tile x 6 [2, 3]  notifies partials_done:'ij->i'" in summary
    assert "partials_done[2]: wait counts inferred, 3..3" in summary
    dot = graph.to_dot()
    assert dot.startswith('digraph "row_sum"') and dot.rstrip().endswith("}")
    assert 't4 -> "partials_done[1]";' in dot and '"partials_done[1]" -> t7;' in dot
    assert 'label="partials_done[0] / 3"' in dot
    assert dot.count("[shape=box") == 8


def test_topological_order_respects_static_edges():
    graph = TaskGraph.build(two_ops, {"M": 6 * ROWS})
    order = graph.topological_order()
    assert sorted(order) == list(range(graph.num_tasks))
    pos = {t: k for k, t in enumerate(order)}
    for task in range(graph.num_tasks):
        for elem in graph.waits[task]:
            producers = [p for p in range(graph.num_tasks) if elem in graph.notifies[p]]
            assert all(pos[p] < pos[task] for p in producers)
