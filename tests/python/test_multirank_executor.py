"""The CPU reference executor running a graph function of world size W as W ranks at once."""
import numpy as np
import pytest

from etc_tvm import (DeadlockError, ETensor, EtcError, ExecutionError, GraphError, Tensor,
                     call_device, graph_func)
from etc_tvm.executor import (DynamicQueueOrder, MixedOrder, RandomOrder, ReadyQueueOrder,
                              StaticOrder, execute, execute_ranks)
from etc_tvm.task_graph import TaskGraph

import graphs
from tiles import COLS, ROWS, scale_tile
from tp_graphs import TP, all_gather_gemm, gemm_reduce_scatter

WORLD_SIZES = [1, 2, 4, 8]


def rank_queues(graph, dims, sms):
    """Per rank, the rank's tasks in a topological order of the whole graph, dealt to
    ``sms`` queues in the rank-local ids."""
    tg = TaskGraph.build(graph, dims)
    out = [[] for _ in range(tg.world_size)]
    for t in tg.topological_order():
        out[tg.rank_of(t)].append(t % tg.tasks_per_rank)
    return [[topo[k::sms] for k in range(sms)] for topo in out]


def orders(graph, dims):
    yield ReadyQueueOrder()
    for seed in range(2):
        yield RandomOrder(seed)
    for sms in (1, 3):
        yield StaticOrder.per_rank(rank_queues(graph, dims, sms))
    yield StaticOrder.per_rank(rank_queues(graph, dims, 2), seed=5)
    for ctas in (1, 3):
        yield DynamicQueueOrder(ctas)
        yield DynamicQueueOrder(ctas, rank_local=True)  # one CTA a rank: a wait across ranks
    yield DynamicQueueOrder(2, early_push=False)       # that blocks it would deadlock


def rs_inputs(rng, W, M=None, K=None, N=8):
    M, K = M or 2 * TP * W, K or 3 * W
    A = rng.standard_normal((M, K)).astype("float32")
    B = rng.standard_normal((K, N)).astype("float32")
    k = K // W
    return A, B, [[A[:, r * k:(r + 1) * k], B[r * k:(r + 1) * k]] for r in range(W)]


def ag_inputs(rng, W, M=None, K=5, N=None):
    M, N = M or 2 * TP * W, N or TP * W
    A = rng.standard_normal((M, K)).astype("float32")
    B = rng.standard_normal((K, N)).astype("float32")
    m, n = M // W, N // W
    return A, B, [[A[r * m:(r + 1) * m], B[:, r * n:(r + 1) * n]] for r in range(W)]


@pytest.mark.parametrize("W", WORLD_SIZES)
def test_gemm_reduce_scatter_equals_numpy(rng, W):
    graph = gemm_reduce_scatter(W)
    A, B, inputs = rs_inputs(rng, W)
    full, rows = A.astype("float64") @ B.astype("float64"), A.shape[0] // W
    dims = {"M": A.shape[0], "K": A.shape[1] // W, "N": B.shape[1]}
    for order in orders(graph, dims):
        outs = execute_ranks(graph, inputs, order=order)
        assert len(outs) == W
        for r, out in enumerate(outs):
            np.testing.assert_allclose(out, full[r * rows:(r + 1) * rows], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("W", WORLD_SIZES)
def test_all_gather_gemm_equals_numpy(rng, W):
    graph = all_gather_gemm(W)
    A, B, inputs = ag_inputs(rng, W)
    full, cols = A.astype("float64") @ B.astype("float64"), B.shape[1] // W
    dims = {"M": A.shape[0] // W, "K": A.shape[1], "N": cols}
    for order in orders(graph, dims):
        for r, out in enumerate(execute_ranks(graph, inputs, order=order)):
            np.testing.assert_allclose(out, full[:, r * cols:(r + 1) * cols], rtol=1e-5,
                                       atol=1e-5)


def test_reduce_tiles_start_before_every_gemm_tile_finished(rng):
    """Tile-level overlap across ranks: with GEMM tiles on SM 0 and reduce tiles on SM 1 of
    every rank, a reduce tile runs once its row's partials are in, while GEMM tiles of later
    rows still wait to run."""
    W = 4
    graph = gemm_reduce_scatter(W)
    _, _, inputs = rs_inputs(rng, W, M=4 * TP * W)
    tg = TaskGraph.build(graph, {"M": 4 * TP * W, "K": 3, "N": 8})
    gemm = list(tg.calls[0].tasks)
    queues = [[gemm, list(tg.calls[1].tasks)]] * W
    trace = []
    execute_ranks(graph, inputs, trace=trace, order=StaticOrder.per_rank(queues))
    names = [tg.call_of(t).fn.name for t in trace]
    assert names.index("reduce_tile") < len(names) - 1 - names[::-1].index("gemm_put_tile")


def test_ring_order_walks_own_rows_first(rng):
    """Each rank's GEMM tiles list the sources rank, rank + 1, ...: with the gathers of
    other ranks not yet run, a rank's first GEMM tiles (its own rows) can start."""
    W = 4
    graph = all_gather_gemm(W)
    dims = {"M": 2 * TP, "K": 5, "N": TP}
    tg = TaskGraph.build(graph, dims)
    for r in range(W):
        gemm = tg.calls[2 * r + 1]
        first = [e for e in tg.waits[gemm.first_task]]
        assert first == [("E", (r, r))]
        last = tg.waits[gemm.tasks[-1]]
        assert last == [("E", (r, (r + W - 1) % W))]


@pytest.mark.parametrize("make, inputs", [
    (lambda: graphs.gemm_reduce_scatter, lambda rng: rs_inputs(rng, 1, M=32, K=48, N=16)[2][0]),
    (lambda: gemm_reduce_scatter(1), lambda rng: rs_inputs(rng, 1)[2][0]),
    (lambda: all_gather_gemm(1), lambda rng: ag_inputs(rng, 1)[2][0]),
], ids=["graphs.gemm_reduce_scatter", "tp_gemm_reduce_scatter", "tp_all_gather_gemm"])
def test_world_size_1_equals_the_single_rank_path(rng, make, inputs):
    graph, args = make(), inputs(rng)
    for seed in range(3):
        trace1, trace2 = [], []
        one = execute(graph, *args, order=RandomOrder(seed), trace=trace1)
        (ranks,) = execute_ranks(graph, [args], order=RandomOrder(seed), trace=trace2)
        np.testing.assert_array_equal(one, ranks)
        assert trace1 == trace2
    tg = TaskGraph.build(graph, {k: v for k, v in zip("MKN", (args[0].shape + args[1].shape[1:]))})
    assert tg.world_size == 1 and " on rank" not in tg.task_name(0)
    assert all("@" not in name for name in tg.etensors)


# ------------------------------------------------------------------ broken variants
@pytest.mark.parametrize("W", [2, 4, 8])
def test_run_time_count_one_too_high_deadlocks_naming_rank_task_and_element(rng, W):
    graph = gemm_reduce_scatter(W, counts=True)
    A, B, inputs = rs_inputs(rng, W)
    counts = np.full((A.shape[0] // TP, B.shape[1] // TP), W, np.int32)
    counts[-1, 0] = W + 1  # owned by the last rank
    for order in (ReadyQueueOrder(), RandomOrder(3), DynamicQueueOrder(2)):
        with pytest.raises(DeadlockError) as err:
            execute_ranks(graph, [[*x, counts] for x in inputs], order=order)
        msg = str(err.value)
        assert "1 tasks left" in msg
        assert (f"D(1,0) on rank {W - 1}" in msg and f"waits on E[{2 * W - 1},0] "
                f"(on rank {W - 1}): counter 1 of wait count {W + 1}" in msg), msg


@pytest.mark.parametrize("W", [2, 4])
def test_run_time_count_one_too_low_is_an_over_notify(rng, W):
    graph = gemm_reduce_scatter(W, counts=True)
    A, B, inputs = rs_inputs(rng, W)
    counts = np.full((A.shape[0] // TP, B.shape[1] // TP), W, np.int32)
    counts[0, 1] = W - 1
    with pytest.raises(ExecutionError, match=r"E\[0,1\] \(on rank 0\) is notified more times "
                                             r"than its wait count \(by partials\(0,1\) "
                                             r"on rank \d\)"):
        execute_ranks(graph, [[*x, counts] for x in inputs])


@pytest.mark.parametrize("W", [2, 4, 8])
@pytest.mark.parametrize("variant, match", [
    (dict(wait_count="W+1"), r"E\[0,0\] \(on rank 0\) is waited on by D\(0,0\) on "
                             r"rank 0 but is notified {W} times, fewer than its wait_count {W1}"),
    (dict(wait_count="W-1"), r"E\[0,0\] \(on rank 0\) has wait_count {Wm} but is notified {W} "
                             r"times \(by partials\(0,0\) on rank 0, partials\(0,0\) "
                             r"on rank 1"),
    (dict(notify="ij->ij if rank != 1"), r"E\[0,0\] \(on rank 0\) is waited on by "
     r"D\(0,0\) on rank 0 but is notified {Wm} times, fewer than its wait_count {W}"),
], ids=["count+1", "count-1", "missing-notify"])
def test_static_broken_variants_are_graph_errors_naming_rank_task_element(rng, W, variant,
                                                                          match):
    if "wait_count" in variant:
        variant = {"wait_count": W + 1 if variant["wait_count"] == "W+1" else W - 1}
    graph = gemm_reduce_scatter(W, **variant)
    _, _, inputs = rs_inputs(rng, W)
    with pytest.raises(GraphError, match=match.format(W=W, W1=W + 1, Wm=W - 1)):
        execute_ranks(graph, inputs)


@pytest.mark.parametrize("W", [2, 4])
def test_static_order_that_blocks_a_rank_deadlocks_naming_rank_and_sm(rng, W):
    """Rank 1 queues its reduce tiles before its GEMM tiles on one SM: its first reduce
    tile waits on an element its own later GEMM tile notifies."""
    graph = gemm_reduce_scatter(W)
    A, B, inputs = rs_inputs(rng, W)
    dims = {"M": A.shape[0], "K": A.shape[1] // W, "N": B.shape[1]}
    queues = rank_queues(graph, dims, 1)
    tg = TaskGraph.build(graph, dims)
    gemm = tg.calls[0].num_tasks
    queues[1] = [queues[1][0][gemm:] + queues[1][0][:gemm]]
    with pytest.raises(DeadlockError) as err:
        execute_ranks(graph, inputs, order=StaticOrder.per_rank(queues))
    assert ("D(0,0) on rank 1 on SM 0 of rank 1 waits on E[2,0] (on rank 1): "
            f"counter 1 of wait count {W}") in str(err.value)


def test_ag_gemm_missing_gather_notify_is_reported(rng):
    graph = all_gather_gemm(4, gather="pi->p, rank if rank != 2 or p != 0")
    _, _, inputs = ag_inputs(rng, 4)
    with pytest.raises(GraphError, match=r"E\[0,2\] \(on rank 0\) is waited on by "
                                         r"C\(2,0,0\) on rank 0 but no task "
                                         r"notifies it"):
        execute_ranks(graph, inputs)


# ------------------------------------------------------------------ bad input
def test_inputs_for_the_wrong_number_of_ranks(rng):
    graph = gemm_reduce_scatter(4)
    _, _, inputs = rs_inputs(rng, 4)
    with pytest.raises(EtcError, match="runs on 4 ranks: execute_ranks needs one list of "
                                       "inputs per rank, got 3 entries"):
        execute_ranks(graph, inputs[:3])
    with pytest.raises(EtcError, match=r"has world size 4: run it with execute_ranks"):
        execute(graph, *inputs[0])
    with pytest.raises(EtcError, match="needs one list of inputs per rank, got not a list"):
        execute_ranks(graph, inputs[0] + inputs[1])


def test_ranks_with_different_shapes_or_bad_inputs_are_named(rng):
    graph = gemm_reduce_scatter(2)
    _, _, inputs = rs_inputs(rng, 2)
    bigger = [inputs[0], [np.concatenate([x, x]) if k == 0 else x
                          for k, x in enumerate(inputs[1])]]
    with pytest.raises(EtcError, match=r"rank 1's inputs give dims .*'M': 32.*, rank 0's "
                                       r".*'M': 16"):
        execute_ranks(graph, bigger)
    wrong = [inputs[0], [inputs[1][0].astype("float64"), inputs[1][1]]]
    with pytest.raises(EtcError, match="rank 1: gemm_rs: input 'A' is float32, got float64"):
        execute_ranks(graph, wrong)


def test_shard_that_does_not_divide_by_the_world_size(rng):
    graph = gemm_reduce_scatter(4)
    A = rng.standard_normal((6 * TP, 4)).astype("float32")  # 6 row tiles over 4 ranks
    B = rng.standard_normal((4, 8)).astype("float32")
    with pytest.raises(GraphError, match=r"ETensor E is sharded on dim 0 \(S\[0\]\) of size "
                                         r"6, which does not divide over world size 4"):
        execute_ranks(graph, [[A, B]] * 4)


def test_local_view_of_an_unsharded_etensor_is_refused():
    with pytest.raises(EtcError, match="ETensor E is not sharded: local_view needs"):
        @graph_func(world_size=2)
        def g(X: Tensor((8, COLS))):
            E = ETensor((2,), name="E")
            return call_device(scale_tile, tile_num=(2,), args=[X], out=Tensor((8, COLS)),
                               in_edges={E.local_view(): "i->i"})


def test_local_edge_outside_the_shard_names_the_rank(rng):
    @graph_func(world_size=2)
    def g(X: Tensor((4 * ROWS, COLS))):
        E = ETensor((4,), shard="S[0]", wait_count=0, name="E")
        return call_device(scale_tile, tile_num=(4,), args=[X], out=Tensor((4 * ROWS, COLS)),
                           in_edges={E.local_view(): "i->i"})

    with pytest.raises(GraphError, match=r"edge map 'i->i' of task scale_tile0\(2,\) on rank 0 "
                                         r"gives E.local_view\(\)\[2\] of rank 0, outside E of "
                                         r"shape \[2\]"):
        TaskGraph.build(g, {})


def test_unsharded_etensors_have_one_counter_array_per_rank(rng):
    @graph_func(world_size=3)
    def chain(X: Tensor(("M", COLS))):
        E = ETensor((X.shape[0] // ROWS,), name="link")
        return call_device(scale_tile, tile_num=(X.shape[0] // ROWS,), args=[X],
                           out=Tensor((X.shape[0], COLS)), in_edges={E: "i->i-1 if i > 0"},
                           out_edges={E: "i->i"})

    tg = TaskGraph.build(chain, {"M": 3 * ROWS})
    assert sorted(tg.etensors) == ["link@0", "link@1", "link@2"]
    assert tg.waits[tg.rank_task(2, 1)] == [("link@2", (0,))]
    xs = [rng.standard_normal((3 * ROWS, COLS)).astype("float32") for _ in range(3)]
    for order in (RandomOrder(1), StaticOrder.per_rank([[[0, 1, 2]]] * 3)):
        for x, out in zip(xs, execute_ranks(chain, [[x] for x in xs], order=order)):
            np.testing.assert_allclose(out, 2 * x + 1)
    with pytest.raises(DeadlockError, match=r"scale_tile0\(2\) on rank 1 on SM 0 of rank 1 "
                                            r"waits on link\[1\] of rank 1: counter 1"):
        execute_ranks(chain, [[x] for x in xs],
                      order=StaticOrder.per_rank([[[0, 1, 2]], [[2, 1, 0]], [[0, 1, 2]]]))


def test_peers_reach_only_symmetric_tensors(rng):
    from tp_graphs import gemm_put_tile

    saved = gemm_put_tile.reference
    try:
        @gemm_put_tile.set_reference
        def _(i, j, A, B, P, *, peers):
            peers[1].A[0, 0] = 1.0

        _, _, inputs = rs_inputs(rng, 2)
        with pytest.raises(ExecutionError, match=r"gemm_put_tile: peers\[1\].A: 'A' is not "
                                                 r"symmetric"):
            execute_ranks(gemm_reduce_scatter(2), inputs)
    finally:
        gemm_put_tile.set_reference(saved)


def test_mixed_order_is_one_rank_only(rng):
    graph = gemm_reduce_scatter(2)
    _, _, inputs = rs_inputs(rng, 2)
    with pytest.raises(EtcError, match="mixed schedule is modelled for one rank"):
        execute_ranks(graph, inputs, order=MixedOrder([[]], ring_calls={0, 1, 2, 3}))


def test_edge_map_constants_bind_per_rank():
    from etc_tvm import edge_map

    m = edge_map.parse("sij->0, (rank + s) % world_size", kind="in", task_rank=3, event_rank=2)
    assert m.constants == {"rank", "world_size"}
    assert m.bind(rank=3, world_size=4).evaluate((2, 0, 0)) == [(0, 1)]
    with pytest.raises(EtcError, match="'rank' has no value here: bind it for a rank"):
        m.evaluate((0, 0, 0))


def test_one_gpu_lowering_points_several_ranks_to_build_rank():
    from etc_tvm.relax_passes.instantiate import instantiate

    graph = gemm_reduce_scatter(2)
    with pytest.raises(GraphError, match="world size 2 runs one kernel per rank, each in its "
                                         "GPU's process: build it with "
                                         "etc_tvm.distributed.build_rank"):
        instantiate(graph.mod, graph.name, {"M": 16, "K": 3, "N": 8})
