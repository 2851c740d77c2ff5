"""The MoE graph function under the CPU reference executor: routings, schedules, skipped tiles
and deliberately broken variants."""
import contextlib

import numpy as np
import pytest

from etc_tvm import EtcError, ExecutionError, GraphError
from etc_tvm.executor import (ClaimedOrder, DynamicQueueOrder, MixedOrder, RandomOrder,
                              ReadyQueueOrder, StaticOrder, execute)
from etc_tvm.schedule import mixed_schedule
from etc_tvm.task_graph import TaskGraph

from moe_graph import (BT, COUNT_MODES, HOT, ROUTINGS, TOKENS, E, F, H, make_inputs,
                       make_moe_graph, max_tiles, moe_graph, moe_reference, route)


def deal(order, queues):
    """A static schedule: the task order dealt round-robin onto ``queues`` SMs."""
    return [order[k::queues] for k in range(queues)]


ORDERS = {
    "ready": lambda tg: ReadyQueueOrder(),
    "dynamic3": lambda tg: DynamicQueueOrder(3),
    "dynamic1-late-push": lambda tg: DynamicQueueOrder(1, early_push=False),
    "random0": lambda tg: RandomOrder(0),
    "random1": lambda tg: RandomOrder(1),
    "random2": lambda tg: RandomOrder(2),
    "static4": lambda tg: StaticOrder(deal(tg.topological_order(), 4)),
    "static7": lambda tg: StaticOrder(deal(tg.topological_order(), 7)),
    "static4-seeded": lambda tg: StaticOrder(deal(tg.topological_order(), 4), seed=11),
    "static7-seeded": lambda tg: StaticOrder(deal(tg.topological_order(), 7), seed=12),
    "mixed3": lambda tg: MixedOrder(*_mixed(tg, 3)),
    "mixed1": lambda tg: MixedOrder(*_mixed(tg, 1)),
    "claimed1": lambda tg: ClaimedOrder(1),
    "claimed5-seeded": lambda tg: ClaimedOrder(5, seed=13),
}


def _mixed(task_graph, ctas):
    """Static queues for all but the expert tiles, which go through the ring."""
    schedule, ring_calls = mixed_schedule(task_graph, ctas)
    assert ring_calls == {call_named(task_graph, "expert").index}
    return schedule.queues, ring_calls


def call_named(task_graph, fn_name):
    (call,) = [c for c in task_graph.calls if c.fn.name == fn_name]
    return call


@contextlib.contextmanager
def recorded(fn):
    """Yields a list that gets the arguments of each task of ``fn`` whose body runs."""
    original, calls = fn.reference, []

    def record(*args):
        calls.append(args)
        original(*args)

    fn.set_reference(record)
    try:
        yield calls
    finally:
        fn.set_reference(original)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("routing, top_k", ROUTINGS)
@pytest.mark.parametrize("count_mode", COUNT_MODES)
def test_matches_reference(count_mode, routing, top_k, tokens, order):
    graph = moe_graph(top_k, count_mode)
    inputs = make_inputs(routing, tokens, top_k)
    schedule = ORDERS[order](TaskGraph.build(graph, {"T": tokens}))
    out = execute(graph, *inputs, order=schedule)
    np.testing.assert_allclose(out, moe_reference(*inputs, top_k), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("routing, top_k", ROUTINGS)
def test_routings_are_what_they_say(routing, top_k, tokens):
    topk, topw = route(*make_inputs(routing, tokens, top_k)[:3], top_k)
    assert all(len(set(row)) == top_k for row in topk)
    np.testing.assert_allclose(topw.sum(axis=1), 1)
    counts = np.bincount(topk.ravel(), minlength=E)
    if routing == "one_expert":
        assert (topk[:, 0] == HOT).all()
    if routing == "idle_experts":
        assert (counts[::2] == 0).all()


@pytest.mark.parametrize("order", ["random0", "static7-seeded"])
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("routing, top_k", ROUTINGS)
@pytest.mark.parametrize("count_mode", COUNT_MODES)
def test_structure(count_mode, routing, top_k, tokens, order):
    """Every task runs once, grouping's CSR is right, exactly the tiles past exp_indptr[E] are
    skipped, and each pair goes through scatter, its expert tile and combine in that order."""
    graph = moe_graph(top_k, count_mode)
    inputs = make_inputs(routing, tokens, top_k)
    task_graph = TaskGraph.build(graph, {"T": tokens})
    trace = []
    with recorded(graph.device_funcs["grouping"]) as grouping_runs, \
            recorded(graph.device_funcs["expert"]) as expert_runs:
        execute(graph, *inputs, order=ORDERS[order](task_graph), trace=trace)

    assert sorted(trace) == list(range(task_graph.num_tasks))
    [(_, topk, counts, exp_indptr, pair_slot, pair_tile)] = grouping_runs
    np.testing.assert_array_equal(topk, route(*inputs[:3], top_k)[0])
    np.testing.assert_array_equal(counts, np.bincount(topk.ravel(), minlength=E))
    assert exp_indptr[0] == 0
    np.testing.assert_array_equal(np.diff(exp_indptr), -(-counts // BT))
    for e in range(E):  # expert e's pairs, row-major, fill its rows from exp_indptr[e] * BT on
        np.testing.assert_array_equal(pair_slot[topk == e],
                                      exp_indptr[e] * BT + np.arange(counts[e]))
    np.testing.assert_array_equal(pair_tile, pair_slot // BT)

    tiles = max_tiles(tokens, E, top_k, BT)
    experts = call_named(task_graph, "expert")
    assert experts.grid == (tiles,)
    assert sorted(args[0] for args in expert_runs) == list(range(exp_indptr[E]))
    expert_tasks = [task for task in trace if task in experts.tasks]
    assert len(expert_tasks) - len(expert_runs) == tiles - exp_indptr[E]  # the skipped ones

    position = {task: k for k, task in enumerate(trace)}
    scatter, combine = call_named(task_graph, "scatter"), call_named(task_graph, "combine")
    for t in range(tokens):
        for k in range(top_k):
            tile = experts.first_task + pair_tile[t, k]
            assert position[scatter.first_task + t] < position[tile]
            assert position[tile] < position[combine.first_task + t]


@pytest.mark.parametrize("top_k", [1, 2])
def test_router_breaks_ties_by_lower_id(top_k):
    """Experts 2 and 5 tie at the top for every token: identical logits, computed exactly."""
    rng = np.random.default_rng(5)
    x = rng.integers(1, 4, (6, H)) * rng.choice([-1, 1], (6, H))
    w_router = rng.integers(-2, 3, (H, E))
    w_router[:, 5] = w_router[:, 2]
    bias = np.zeros(E)
    bias[[2, 5]] = 1000
    w_expert = rng.standard_normal((E, H, F)) / np.sqrt(H)
    inputs = tuple(a.astype(np.float32) for a in (x, w_router, bias, w_expert))
    np.testing.assert_array_equal(route(*inputs[:3], top_k)[0], [[2, 5][:top_k]] * 6)
    out = execute(moe_graph(top_k, "inferred"), *inputs, order=RandomOrder(3))
    np.testing.assert_allclose(out, moe_reference(*inputs, top_k), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("count_mode", COUNT_MODES)
def test_combine_that_waits_on_nothing_is_rejected(count_mode):
    graph = make_moe_graph(H, E, 2, F, BT, count_mode, combine_waits=False)
    message = r"combine0 reads 'topw', written by router0, but waits on no event"
    with pytest.raises(GraphError, match=message):
        TaskGraph.build(graph, {"T": 7}).validate()
    with pytest.raises(GraphError, match=message):
        execute(graph, *make_inputs("random", 7, 2))


def test_expert_index_outside_expert_ready_fails_at_run_time():
    """expert_ready one element short: routing a token to expert E-1 names scatter's map."""
    graph = make_moe_graph(H, E, 2, F, BT, "inferred", expert_ready_size=E - 1)
    x, w_router, bias, w_expert = make_inputs("random", 7, 2)
    bias[E - 1] = 100
    message = (r"edge map 't->topk\[t,:\]' of task scatter0\(0\) gives expert_ready\[7\], "
               r"outside expert_ready of shape \[7\]")
    with pytest.raises(ExecutionError, match=message):
        execute(graph, x, w_router, bias, w_expert)


def test_expert_ready_of_another_size_than_its_counts_is_rejected():
    with pytest.raises(EtcError, match=r"its wait_count tensor counts has shape \[8\]"):
        make_moe_graph(H, E, 2, F, BT, "tensor", expert_ready_size=E - 1)


@pytest.mark.parametrize("count_mode", COUNT_MODES)
@pytest.mark.parametrize("routing", ["random", "idle_experts"])
@pytest.mark.parametrize("tokens", [1, 5, 9])
def test_a_schedule_for_more_tokens_serves_fewer(tokens, routing, count_mode):
    """The MoE graph instantiated for 12 tokens runs 1, 5 and 9: out-of-range routers,
    scatters, expert tiles and combines are skipped, data-dependent edges still resolve."""
    graph = moe_graph(2, count_mode)
    inputs = make_inputs(routing, tokens, 2)
    want = moe_reference(*inputs, 2)
    for order in (ReadyQueueOrder(), DynamicQueueOrder(3), RandomOrder(tokens)):
        got = execute(graph, *inputs, order=order, schedule_dims={"T": 12})
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
