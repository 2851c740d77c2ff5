"""The front end: tracing into Relax, the etc ops through standard passes, and its errors."""
import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import tirx as T

from etc_tvm import (ETensor, EdgeMapError, EtcError, GraphFunc, Tensor, await_inputs,
                     call_device, device_func, graph_func, input_check, ops)
from etc_tvm.executor import RandomOrder, execute
from etc_tvm.task_graph import TaskGraph

from graphs import gemm_reduce_scatter, row_sum, weighted_rows
from tiles import COLS, mix_tile, scale_tile, weight_row_tile


def etc_calls(func):
    return [b.value for block in func.body.blocks for b in block.bindings
            if isinstance(b.value, tvm.ir.Call) and isinstance(b.value.op, tvm.ir.Op)
            and b.value.op.name.startswith("etc.")]


def test_module_holds_the_graph_and_its_device_functions():
    mod = gemm_reduce_scatter.mod
    names = sorted(gv.name_hint for gv in mod.get_global_vars())
    assert names == ["gemm_reduce_scatter", "matmul_tile", "reduce_scatter_tile"]
    assert isinstance(mod["matmul_tile"], tvm.tirx.PrimFunc)
    assert mod["matmul_tile"].attrs["etc.device_func"] == "matmul_tile"
    relax.analysis.well_formed(mod)
    func = mod["gemm_reduce_scatter"]
    M, K = func.params[0].ty.shape.values
    assert (M.name, K.name) == ("M", "K")
    assert [c.op.name for c in etc_calls(func)] == [
        ops.EVENT_TENSOR, ops.CALL_DEVICE, ops.LOCAL_VIEW, ops.CALL_DEVICE]


def test_call_device_carries_its_edges_grid_and_types():
    event, matmul, view, rs = etc_calls(gemm_reduce_scatter.func)
    decl = ops.EventTensorCall.of(event)
    assert (decl.name, decl.wait_count, decl.shard) == ("E", 1, "S[0]")
    call = ops.CallDeviceCall.of(matmul)
    assert call.fn.name_hint == "matmul_tile"
    assert (call.in_edges, call.out_edges) == ((), ("ij->ij",))
    M, N = gemm_reduce_scatter.func.params[0].ty.shape.values[0], \
        gemm_reduce_scatter.func.params[1].ty.shape.values[1]
    tvm.ir.assert_structural_equal(list(call.tile_num), [M // 16, N // 16])
    assert str(call.out_ty.dtype) == "float32" and len(call.out_ty.shape.values) == 2
    assert view.attrs["world_size"] == 1
    assert ops.CallDeviceCall.of(rs).in_edges == ("ij->ij",)


def test_script_prints_readable_ir():
    text = gemm_reduce_scatter.script()
    for needle in ('def gemm_reduce_scatter(A: R.Tensor((M, K), dtype="float32")',
                   'E: R.Tensor((M // 16, N // 16), dtype="int32") = T.Call("etc.event_tensor"',
                   '"out_edges": ["ij->ij"]', "def matmul_tile(i: T.int32, j: T.int32"):
        assert needle in text


STANDARD_PASSES = [
    relax.transform.Normalize(), relax.transform.CanonicalizeBindings(),
    relax.transform.EliminateCommonSubexpr(), relax.transform.FoldConstant(),
    relax.transform.DeadCodeElimination(), relax.transform.LegalizeOps(),
    relax.transform.ToNonDataflow(),
]


@pytest.mark.parametrize("graph", [gemm_reduce_scatter, row_sum], ids=lambda g: g.name)
def test_etc_ops_survive_standard_relax_passes(graph, rng):
    mod = tvm.transform.Sequential(STANDARD_PASSES)(graph.mod)
    relax.analysis.well_formed(mod)
    before, after = etc_calls(graph.func), etc_calls(mod[graph.name])
    assert len(after) == len(before)
    for b, a in zip(before, after):
        assert b.op.same_as(a.op)
        tvm.ir.assert_structural_equal(b.attrs, a.attrs)
    passed = GraphFunc(graph.name, mod, graph.device_funcs)
    dims = {"M": 32, "N": 48, "K": 16} if graph is gemm_reduce_scatter else {"M": 32, "N": 48}
    assert TaskGraph.build(passed, dims).summary() == TaskGraph.build(graph, dims).summary()
    inputs = [rng.standard_normal((dims[a], dims[b])).astype("float32")
              for a, b in (("M", "K"), ("K", "N"))[:len(graph.func.params)]] \
        if graph is gemm_reduce_scatter else [rng.standard_normal((32, 48)).astype("float32")]
    np.testing.assert_array_equal(execute(passed, *inputs, order=RandomOrder(1)),
                                  execute(graph, *inputs, order=RandomOrder(2)))


def test_unlowered_etc_ops_do_not_compile_silently():
    with pytest.raises(tvm.error.InternalError, match="etc.event_tensor"):
        tvm.compile(row_sum.mod, target=tvm.target.Target("llvm"))


def test_multiple_outputs_and_tuple_results(rng):
    @device_func
    def split_tile(i: T.int32, X: T.Buffer((8, COLS), "float32"), A: T.Buffer((8, COLS), "float32"),
                   B: T.Buffer((8, COLS), "float32")):
        T.device_entry()
        tx = T.thread_id([COLS])
        for r in T.serial(8):
            A[r, tx] = X[r, tx]
            B[r, tx] = X[r, tx] * T.float32(-1)

    @split_tile.set_reference
    def _(i, X, A, B):
        A[:] = X
        B[:] = -X

    @graph_func
    def g(X: Tensor((8, COLS))):
        a, b = call_device(split_tile, tile_num=1, args=[X],
                           out=[Tensor((8, COLS), name="pos"), Tensor((8, COLS), name="neg")])
        return a, b

    x = rng.standard_normal((8, COLS)).astype("float32")
    a, b = execute(g, x)
    np.testing.assert_array_equal(a, x)
    np.testing.assert_array_equal(b, -x)


def _graph_with(body):
    @graph_func
    def g(X: Tensor(("M", COLS)), idx: Tensor(("M",), "int32")):
        return body(X, idx)
    return g


@pytest.mark.parametrize("body,error,match", [
    (lambda X, idx: call_device(scale_tile, tile_num=(1, 2), args=[X], out=Tensor((8, COLS))),
     EtcError, r"tile_num has 2 dims but scale_tile takes 1 task coordinates \('i',\)"),
    (lambda X, idx: call_device(scale_tile, tile_num=1, args=[X, X], out=Tensor((8, COLS))),
     EtcError, r"2 args and 1 outputs for 2 tensor parameters \['A', 'B'\]"),
    (lambda X, idx: call_device(scale_tile, tile_num=1, args=[X], out=Tensor((8, COLS), "int32")),
     EtcError, "tensor parameter 'B' is float32, got int32"),
    (lambda X, idx: call_device(scale_tile, tile_num=1, args=[X], out=Tensor(("M", 16))),
     EtcError, "tensor parameter 'B': dim 1 is 16, expected 32"),
    (lambda X, idx: call_device(scale_tile, tile_num=1, args=[X], out=Tensor((7, COLS))),
     EtcError, "tensor parameter 'B': dim 0 is 7, expected M"),
    (lambda X, idx: call_device(scale_tile, tile_num=1, args=[np.ones(3)], out=Tensor((8, COLS))),
     EtcError, "argument 'A' must be a tensor of the graph function"),
    (lambda X, idx: call_device(lambda: 0, tile_num=1, args=[X], out=Tensor((8, COLS))),
     EtcError, "call_device needs a @device_func"),
    (lambda X, idx: call_device(scale_tile, tile_num=1, args=[X], out=Tensor(("M", COLS)),
                              out_edges={"E": "i->i"}),
     EtcError, "out_edges keys must be ETensors"),
    (lambda X, idx: call_device(scale_tile, tile_num=1, args=[X], out=Tensor(("M", COLS)),
                              out_edges={ETensor((4,)): "i->idx[i]"}),
     EdgeMapError, "idx"),
    (lambda X, idx: call_device(scale_tile, tile_num=1, args=[X], out=Tensor(("M", COLS)),
                              in_edges={ETensor((4, 4)): "i->i"}),
     EdgeMapError, "for E0"),
    (lambda X, idx: ETensor((4,), wait_count=X), EtcError, "wait_count tensor must be int32"),
    (lambda X, idx: ETensor((5,), wait_count=idx), EtcError,
     r"tensor idx has shape \[M\], the ETensor \[5\]"),
    (lambda X, idx: ETensor((4,), wait_count=-1), EtcError, "must not be negative"),
    (lambda X, idx: ETensor((4,), shard="S[1]"), EtcError, "names dim 1 of a 1-d ETensor"),
    (lambda X, idx: ETensor((4,), shard="rows"), EtcError, "shard must look like 'S\\[0\\]'"),
    (lambda X, idx: ETensor((4,)).local_view(), EtcError, "is not sharded"),
    (lambda X, idx: (ETensor((4,), name="E"), ETensor((4,), name="E")), EtcError,
     "two values of the graph function are named 'E'"),
    (lambda X, idx: ETensor(()), EtcError, "at least one dimension"),
    (lambda X, idx: 3, EtcError, "must return tensors"),
])
def test_front_end_errors(body, error, match):
    with pytest.raises(error, match=match):
        _graph_with(body)


def test_outside_a_graph_function():
    with pytest.raises(EtcError, match=r"ETensor can only be used inside a @graph_func"):
        ETensor((4,))
    with pytest.raises(EtcError, match="call_device can only be used inside a @graph_func"):
        call_device(scale_tile, tile_num=1, args=[], out=[])


def test_parameters_need_tensor_annotations():
    with pytest.raises(EtcError, match="parameter 'x' needs a Tensor"):
        @graph_func
        def g(x):
            return x


def test_edge_maps_may_only_read_int32_inputs():
    @device_func
    def gather_tile(i: T.int32, X: T.Buffer((8, COLS), "float32"), idx: T.Buffer((8,), "int32"),
                    Y: T.Buffer((8, COLS), "float32")):
        T.device_entry()
        tx = T.thread_id([COLS])
        Y[i, tx] = X[idx[i], tx]

    def build(edges):
        @graph_func
        def g(X: Tensor((8, COLS)), idx: Tensor((8,), "int32")):
            E = ETensor((8,), name="E")
            return call_device(gather_tile, tile_num=8, args=[X, idx], out=Tensor((8, COLS)),
                               **edges(E))
        return g

    build(lambda E: {"out_edges": {E: "i->idx[i]"}})
    with pytest.raises(EdgeMapError, match="X"):
        build(lambda E: {"out_edges": {E: "i->X[i, 0]"}})


@T.prim_func(check_well_formed=False)
def no_coordinates(A: T.Buffer((4,), "float32")):
    T.device_entry()
    tx = T.thread_id([4])
    A[tx] = T.float32(0)


@T.prim_func(check_well_formed=False)
def scalar_after_tensor(i: T.int32, A: T.Buffer((4,), "float32"), j: T.int32):
    T.device_entry()
    tx = T.thread_id([4])
    A[tx] = T.float32(0)


@T.prim_func(check_well_formed=False)
def cta_id(i: T.int32, A: T.Buffer((4,), "float32")):
    T.device_entry()
    b = T.cta_id([4])
    tx = T.thread_id([4])
    A[tx] = T.float32(b)


@T.prim_func(check_well_formed=False)
def no_threads(i: T.int32, A: T.Buffer((4,), "float32")):
    T.device_entry()
    A[0] = T.float32(0)


@T.prim_func(check_well_formed=False)
def float_coordinate(i: T.float32, A: T.Buffer((4,), "float32")):
    T.device_entry()
    tx = T.thread_id([4])
    A[tx] = T.float32(0)


@T.prim_func(check_well_formed=False)
def mark_in_branch(i: T.int32, A: T.Buffer((4,), "float32")):
    T.device_entry()
    tx = T.thread_id([4])
    if i > 0:
        T.evaluate(await_inputs())
    A[tx] = T.float32(0)


@T.prim_func(check_well_formed=False)
def prelude_writes(i: T.int32, W: T.Buffer((4,), "float32"), A: T.Buffer((4,), "float32")):
    T.device_entry()
    tx = T.thread_id([4])
    A[tx] = W[tx]
    T.evaluate(await_inputs())


@T.prim_func(check_well_formed=False)
def prelude_binds_a_read(i: T.int32, row: T.Buffer((4,), "int32"),
                         A: T.Buffer((4,), "float32")):
    T.device_entry()
    tx = T.thread_id([4])
    r = T.bind(row[i])
    T.evaluate(await_inputs())
    A[tx] = T.Cast("float32", r)


@pytest.mark.parametrize("fn,match", [
    (no_coordinates, "has no task coordinates"),
    (scalar_after_tensor, "scalar parameter 'j' after a tensor parameter"),
    (cta_id, "declares a cluster or CTA id"),
    (no_threads, "declares no T.thread_id: pass num_threads"),
    (float_coordinate, "task coordinate 'i' must be T.int32"),
    (mark_in_branch, "await_inputs\\(\\) must be one statement of the body's top level"),
    (prelude_writes, "its prelude \\(before await_inputs\\(\\)\\) writes \\['A'\\]"),
    (prelude_binds_a_read, "its prelude binds a value read from \\['row'\\] at its top level"),
])
def test_device_func_contract(fn, match):
    with pytest.raises(EtcError, match=match):
        device_func(fn)


@T.prim_func(check_well_formed=False)
def slot_check(i: T.int32, slot: T.Buffer((4,), "int32"), A: T.Buffer((8,), "float32")):
    T.device_entry()
    tx = T.thread_id([4])
    if input_check(slot[tx], 8, 1) != 0:
        A[slot[tx]] = T.float32(1)


def test_device_func_input_checks_have_messages():
    """``input_check(value, size, n)`` reports ``checks[n]``: each number a check uses needs
    its message when the function is declared, and the module keeps them."""
    with pytest.raises(EtcError, match=r"slot_check: input_check number 1 has no message "
                                       r"among its 1 checks"):
        device_func(slot_check, checks=("slot {value} outside 0..7",))
    tile = device_func(slot_check, checks=("unused", "slot {value} outside 0..7"))

    @graph_func
    def one(slot: Tensor((4,), "int32")):
        return call_device(tile, tile_num=(1,), args=[slot],
                           out=Tensor((8,), "float32", name="A"))

    rebuilt = GraphFunc.from_module(one.mod, "one").device_funcs["slot_check"]
    assert rebuilt.checks == tile.checks == ("unused", "slot {value} outside 0..7")


def test_device_func_thread_count():
    assert scale_tile.num_threads == 128 and mix_tile.num_coords == 1
    with pytest.raises(EtcError, match=r"runs 128 threads \(T.thread_id\) but num_threads=64"):
        device_func(scale_tile.prim_func, num_threads=64)


def test_prelude_reads():
    """What a prelude reads decides what the kernel waits for before it runs."""
    assert weight_row_tile.prelude_reads == ("row", "W")
    assert scale_tile.prelude_reads == ()
    graph = TaskGraph.build(weighted_rows, {"M": 40, "N": 7, "P": 10})
    pick, _, weight = graph.calls
    assert graph.prelude_waits(weight) == graph.completion_waits(weight) == {pick.index}
    assert graph.completion_waits(pick) == set()
