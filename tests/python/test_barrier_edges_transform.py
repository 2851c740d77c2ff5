"""BarrierEdgesTransform: tile-level edges become one barrier between consecutive calls."""
import numpy as np
import tvm
from tvm import relax

from etc_tvm import ETensor, Tensor, call_device, graph_func
from etc_tvm.executor import RandomOrder, execute
from etc_tvm.graph_func import GraphFunc
from etc_tvm.relax_passes import BarrierEdgesTransform
from etc_tvm.schedule import list_schedule
from etc_tvm.task_graph import TaskGraph

from tiles import COLS, ROWS, mix_tile, scale_tile


@graph_func
def before(X: Tensor(("M", COLS))):
    M = X.shape[0]
    E = ETensor((M // ROWS,), name="E")
    A = call_device(scale_tile, tile_num=(M // ROWS,), args=[X], out=Tensor((M, COLS), name="A"),
                    out_edges={E: "i->i"})
    return call_device(mix_tile, tile_num=(M // ROWS,), args=[A, X],
                       out=Tensor((M, COLS), name="B"), in_edges={E: "i->i"})


@graph_func
def expected(X: Tensor(("M", COLS))):
    M = X.shape[0]
    a_done = ETensor((1,), name="A_done")
    A = call_device(scale_tile, tile_num=(M // ROWS,), args=[X], out=Tensor((M, COLS), name="A"),
                    out_edges={a_done: "i->0"})
    return call_device(mix_tile, tile_num=(M // ROWS,), args=[A, X],
                       out=Tensor((M, COLS), name="B"), in_edges={a_done: "i->0"})


def test_before_and_after():
    after = BarrierEdgesTransform()(before.mod)
    relax.analysis.well_formed(after)
    tvm.ir.assert_structural_equal(after["before"].body, expected.mod["expected"].body,
                                   map_free_vars=True)


def test_every_task_waits_for_the_whole_previous_call(rng):
    after = GraphFunc.from_module(BarrierEdgesTransform()(before.mod), "before")
    after.device_funcs = before.device_funcs
    graph = TaskGraph.build(after, {"M": 6 * ROWS})
    graph.validate()
    assert graph.static_counts()["A_done"].tolist() == [6]
    assert all(graph.waits[t] == [("A_done", (0,))] for t in graph.calls[1].tasks)
    x = rng.standard_normal((6 * ROWS, COLS)).astype("float32")
    np.testing.assert_array_equal(execute(after, x, order=RandomOrder(3)), execute(before, x))


def test_tile_edges_gain_only_where_a_wave_is_partial():
    """On 4 SMs, 8 tiles a call are two whole waves: the list schedule takes as long with
    tile-level edges as with the barrier. With 5 tiles the first call's second wave leaves 3
    SMs idle, and tile-level edges fill them with the second call's first tiles (3 against 4
    task times)."""
    barrier = GraphFunc(before.name, BarrierEdgesTransform()(before.mod), before.device_funcs)

    def makespans(tiles):
        return [list_schedule(TaskGraph.build(g, {"M": tiles * ROWS}), 4,
                              task_overhead=0).makespan for g in (before, barrier)]

    assert makespans(8) == [4, 4]
    assert makespans(5) == [3, 4]


@graph_func
def chain_then_scale(X: Tensor(("M", COLS))):
    """A chain inside one call (an internal ETensor), then a second call."""
    M = X.shape[0]
    link = ETensor((M // ROWS,), name="link")
    ready = ETensor((M // ROWS,), name="ready")
    A = call_device(scale_tile, tile_num=(M // ROWS,), args=[X], out=Tensor((M, COLS), name="A"),
                    in_edges={link: "i->i-1 if i > 0"}, out_edges={link: "i->i", ready: "i->i"})
    return call_device(scale_tile, tile_num=(M // ROWS,), args=[A],
                       out=Tensor((M, COLS), name="B"), in_edges={ready: "i->i"})


def test_edges_internal_to_one_call_stay():
    after = GraphFunc.from_module(BarrierEdgesTransform()(chain_then_scale.mod),
                                  "chain_then_scale")
    graph = TaskGraph.build(after, {"M": 3 * ROWS})
    assert sorted(graph.etensors) == ["A_done", "link"]
    assert graph.waits[1] == [("link", (0,))]
    assert graph.notifies[1] == [("A_done", (0,)), ("link", (1,))]
    assert graph.waits[4] == [("A_done", (0,))]


def test_data_dependent_edges_become_barriers_too():
    """The MoE graph behind barriers: no trigger skips the unused expert tiles, which find no
    rows of their own and write nothing; the result is unchanged."""
    from moe_graph import make_inputs, moe_graph, moe_reference

    graph = moe_graph(2, "tensor")
    barriers = GraphFunc(graph.name, BarrierEdgesTransform()(graph.mod), graph.device_funcs)
    task_graph = TaskGraph.build(barriers, {"T": 12})
    assert all(not (e.map.is_data_dependent or e.map.is_trigger)
               for c in task_graph.calls for e in c.in_edges + c.out_edges)
    inputs = make_inputs("idle_experts", 12, 2)
    np.testing.assert_allclose(execute(barriers, *inputs, order=RandomOrder(4)),
                               moe_reference(*inputs, 2), rtol=1e-5, atol=1e-5)
