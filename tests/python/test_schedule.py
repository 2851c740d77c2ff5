"""Static schedules: list scheduling, and the executor running the very same queues."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from etc_tvm import ETensor, EtcError, Tensor, call_device, device_func, graph_func
from etc_tvm.executor import StaticOrder, execute
from etc_tvm.schedule import (LOCAL_WAITS, ONLY_PRODUCER, DynamicPlan, LateCall, list_schedule,
                              round_robin_schedule)
from etc_tvm.task_graph import TaskGraph

import graphs
import tiles
from test_executor import chain
from test_random_dags import build as build_dag
from test_random_dags import dags, numpy_dag
from tiles import COLS, ROWS, TILE, scale_tile


def param_shape(param, dims):
    return [int(d.value) if hasattr(d, "value") else dims[d.name] for d in param.ty.shape.values]


def check_schedule(graph, schedule):
    listed = sorted(t for q in schedule.queues for t in q)
    assert listed == list(range(graph.num_tasks))
    position = {t: k for k, t in enumerate(graph.topological_order())}
    placed = {}
    for sm, queue in enumerate(schedule.queues):
        for k, task in enumerate(queue):
            placed[task] = (sm, k)
    for task in range(graph.num_tasks):  # a task's waits are notified by tasks placed earlier
        for elem in graph.waits[task]:
            for producer in range(graph.num_tasks):
                if elem in graph.notifies[producer] and placed[producer][0] == placed[task][0]:
                    assert placed[producer][1] < placed[task][1]
    assert position  # the graph is acyclic


@pytest.mark.parametrize("graph,dims", [
    (graphs.two_ops, {"M": 37 * ROWS}),
    (graphs.row_sum, {"M": 5 * TILE, "N": 7 * TILE}),
    (graphs.gemm_reduce_scatter, {"M": 4 * TILE, "K": 32, "N": 6 * TILE}),
    (chain, {"M": 40 * ROWS}),
], ids=["two_ops", "row_sum", "gemm_reduce_scatter", "chain"])
@pytest.mark.parametrize("num_sms", [1, 3, 132])
def test_queues_are_valid_and_the_executor_runs_them(graph, dims, num_sms, rng):
    task_graph = TaskGraph.build(graph, dims)
    schedule = list_schedule(task_graph, num_sms)
    check_schedule(task_graph, schedule)
    inputs = [rng.standard_normal(param_shape(p, dims)).astype("float32")
              for p in graph.func.params]
    want = execute(graph, *inputs)
    for seed in (None, 0, 1):
        np.testing.assert_array_equal(
            execute(graph, *inputs, order=StaticOrder(schedule.queues, seed=seed)), want)


def test_csr_layout():
    task_graph = TaskGraph.build(graphs.two_ops, {"M": 5 * ROWS})
    schedule = list_schedule(task_graph, 3)
    indptr, tasks = schedule.csr()
    assert indptr.dtype == np.int32 and tasks.dtype == np.int32
    assert indptr.tolist() == [0, *np.cumsum([len(q) for q in schedule.queues]).tolist()]
    assert tasks.tolist() == [t for q in schedule.queues for t in q]


slow_scale_tile = device_func(scale_tile.prim_func, cost=4.0)


@graph_func
def chain_beside_wide(X: Tensor((64, COLS))):
    """16 independent cheap tasks, then (in program order) a chain of 4 tasks of cost 4."""
    link = ETensor((5,), name="link")
    wide = call_device(scale_tile, tile_num=(16,), args=[X], out=Tensor((64, COLS)))
    long = call_device(slow_scale_tile, tile_num=(4,), args=[X], out=Tensor((64, COLS)),
                       in_edges={link: "i->i-1 if i > 0"}, out_edges={link: "i->i"})
    return wide, long


def test_critical_path_goes_first():
    """On 2 SMs the chain (length 16) starts at once on one SM while the other runs the 16
    cheap tasks: makespan 16, where taking tasks in program order would give 24."""
    task_graph = TaskGraph.build(chain_beside_wide, {})
    schedule = list_schedule(task_graph, 2, task_overhead=0)
    chain_tasks = list(task_graph.calls[1].tasks)
    assert schedule.makespan == 16
    assert chain_tasks in [list(q) for q in schedule.queues]


@given(dag=dags(), sms=st.integers(1, 6))
@settings(max_examples=40, deadline=None)
def test_random_dags_under_list_schedules(dag, sms):
    calls, tiles = dag
    graph = build_dag(calls)
    task_graph = TaskGraph.build(graph, {"M": tiles * ROWS})
    schedule = list_schedule(task_graph, sms)
    check_schedule(task_graph, schedule)
    x = np.random.default_rng(tiles).standard_normal((tiles * ROWS, COLS)).astype("float32")
    for got, want in zip(execute(graph, x, order=StaticOrder(schedule.queues)),
                         numpy_dag(calls, x)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_chain_stays_on_one_sm_and_its_waits_are_local():
    task_graph = TaskGraph.build(chain, {"M": 12 * ROWS})
    schedule = list_schedule(task_graph, 4)
    assert [list(q) for q in schedule.queues if q] == [list(range(12))]
    assert schedule.local_waits(task_graph) == set(range(1, 12))
    indptr, tasks = schedule.csr(task_graph)
    assert (tasks[1:] & LOCAL_WAITS).all() and not tasks[0] & LOCAL_WAITS
    assert ((tasks & (LOCAL_WAITS - 1)) == np.arange(12)).all()


def test_round_robin_spreads_a_chain_and_nothing_is_local():
    task_graph = TaskGraph.build(chain, {"M": 12 * ROWS})
    schedule = round_robin_schedule(task_graph, 4)
    assert schedule.queues[1] == (1, 5, 9)
    assert schedule.local_waits(task_graph) == set()


def test_dynamic_plan_of_a_fan_in():
    """Row tile i of rowsum waits for the 3 partial sums of its row: pending 3, and each
    partial sum counts down exactly that one consumer."""
    task_graph = TaskGraph.build(graphs.row_sum, {"M": 2 * TILE, "N": 3 * TILE})
    plan = DynamicPlan.of(task_graph)
    assert plan.pending.tolist() == [0] * 6 + [3, 3]
    assert plan.seeds == tuple(range(6)) and plan.late == frozenset()
    assert [plan.consumers(t).tolist() for t in range(8)] == [[6]] * 3 + [[7]] * 3 + [[], []]
    assert plan.first_consumers().tolist() == [6] * 3 + [7] * 3 + [-1, -1]  # not the only one
    assert plan.capacity == 8


def test_dynamic_plan_pushes_a_fan_in_over_whole_calls_whole():
    """Each of the 2 row tiles of the result waits on all 6 partial sums: one count-down of
    the call a partial sum, not one of each row tile; the call is pushed whole."""
    task_graph = TaskGraph.build(graphs.row_sum_after_all, {"M": 2 * TILE, "N": 3 * TILE})
    plan = DynamicPlan.of(task_graph)
    assert plan.late_calls == (LateCall(call=1, deps=(0,), pending=6),)
    assert plan.late == {6, 7} and plan.seeds == tuple(range(6))
    assert plan.consumer_tasks.size == 0 and plan.pending.tolist() == [0] * 8
    assert plan.late_dependents(0) == [0]


def test_dynamic_plan_keeps_a_single_consumer_of_a_fan_in_task_by_task():
    """One row tile waiting on 3 partial sums: the partial that makes it ready holds it."""
    task_graph = TaskGraph.build(graphs.row_sum_after_all, {"M": TILE, "N": 3 * TILE})
    plan = DynamicPlan.of(task_graph)
    assert plan.late_calls == () and plan.pending.tolist() == [0, 0, 0, 3]
    assert [plan.consumers(t).tolist() for t in range(3)] == [[3]] * 3


def test_dynamic_plan_marks_a_chain_link_as_its_consumers_only_producer():
    task_graph = TaskGraph.build(chain, {"M": 4 * ROWS})
    plan = DynamicPlan.of(task_graph)
    assert plan.pending.tolist() == [0, 1, 1, 1]
    assert plan.first_consumers().tolist() == [1 | ONLY_PRODUCER, 2 | ONLY_PRODUCER,
                                               3 | ONLY_PRODUCER, -1]


def test_dynamic_plan_pushes_data_dependent_waiters_late():
    from moe_graph import make_moe_graph

    moe = make_moe_graph(32, 8, 2, 16, 4, "inferred")
    task_graph = TaskGraph.build(moe, {"T": 5})
    plan = DynamicPlan.of(task_graph)
    expert, combine = task_graph.calls[3], task_graph.calls[4]
    assert set(expert.tasks) | set(combine.tasks) == plan.late
    assert not plan.late & set(plan.seeds)
    assert plan.triggered == {expert.index}
    (late,) = plan.late_calls  # combine: pushed once grouping and every expert tile are done
    assert (late.call, late.deps) == (combine.index, (1, expert.index))
    assert late.pending == 1 + expert.num_tasks and plan.late_dependents(1) == [0]


costly_matmul = device_func(tiles.matmul_tile.prim_func, cost=tiles.K // 16)


@graph_func
def two_products(A: Tensor((32, 96)), B: Tensor((96, 16)), C: Tensor((32, 32)),
                 D: Tensor((32, 16))):
    return (call_device(costly_matmul, tile_num=(2, 1), args=[A, B], out=Tensor((32, 16))),
            call_device(costly_matmul, tile_num=(2, 1), args=[C, D], out=Tensor((32, 16))))


def test_cost_hints_are_evaluated_for_each_call():
    task_graph = TaskGraph.build(two_products, {})
    assert [c.cost for c in task_graph.calls] == [6.0, 2.0]
    assert list_schedule(task_graph, 1, task_overhead=0).makespan == 2 * 6 + 2 * 2
    assert list_schedule(task_graph, 1, task_overhead=1.5).makespan == 2 * 6 + 2 * 2 + 4 * 1.5
    with pytest.raises(ValueError, match="task_overhead"):
        list_schedule(task_graph, 1, task_overhead=-1)


def test_cost_hints_must_be_positive_expressions_of_tensor_dims():
    with pytest.raises(EtcError, match="cost must be positive"):
        device_func(tiles.matmul_tile.prim_func, cost=0)
    stray = __import__("tvm").tirx.Var("Q", "int32")
    with pytest.raises(EtcError, match=r"uses \[Q\], which are not dims of its tensor"):
        device_func(tiles.matmul_tile.prim_func, cost=stray)
    negative = device_func(tiles.matmul_tile.prim_func, cost=tiles.K - 1000)

    @graph_func
    def g(A: Tensor((16, 32)), B: Tensor((32, 16))):
        return call_device(negative, tile_num=(1, 1), args=[A, B], out=Tensor((16, 16)))

    with pytest.raises(EtcError, match=r"its cost v - 1000 is .*-968.* it must be a positive"):
        TaskGraph.build(g, {})
