"""StaticScheduleTransform, DynamicScheduleTransform and UnfusedTransform: what a graph function
becomes."""
import numpy as np
import pytest
import tvm
from tvm import relax

from etc_tvm import ETensor, EtcError, GraphError, Tensor, call_device, graph_func
from etc_tvm.build import build
from etc_tvm.relax_passes import (DynamicScheduleTransform, MixedScheduleTransform,
                                  StaticScheduleTransform, UnfusedTransform, cuda_target,
                                  pipeline)
from etc_tvm.schedule import LOCAL_WAITS, ONLY_PRODUCER, DynamicPlan, list_schedule
from etc_tvm.task_graph import TaskGraph
from etc_tvm.tir_sched.device_runtime import STATUS_WORDS
from etc_tvm.tir_sched.events import ARM_BIAS, EventLayout
from etc_tvm.tir_sched.persistent import KernelOptions

import graphs
from moe_graph import make_moe_graph
from tiles import COLS, ROWS, scale_tile

DIMS = {"M": 64, "K": 32, "N": 48}


def calls_of(func):
    return [b.value for block in func.body.blocks for b in block.bindings
            if isinstance(b.value, tvm.ir.Call)]


def kernel_call(func):
    """The one ``call_tir`` of the persistent kernel that ``func`` was lowered to."""
    (kernel,) = [c for c in calls_of(func) if c.op.name.startswith("relax.call_tir")]
    return kernel


def test_static_becomes_one_persistent_kernel_launch():
    mod = StaticScheduleTransform(DIMS, num_sms=8)(graphs.gemm_reduce_scatter.mod)
    relax.analysis.well_formed(mod)
    assert sorted(gv.name_hint for gv in mod.get_global_vars()) == [
        "gemm_reduce_scatter", "gemm_reduce_scatter_megakernel"]
    kernel = kernel_call(mod["gemm_reduce_scatter"])
    assert kernel.op.name == "relax.call_tir"
    assert kernel.args[0].name_hint == "gemm_reduce_scatter_megakernel"
    A, B, indptr, tasks, initial = kernel.args[1].fields
    graph = TaskGraph.build(graphs.gemm_reduce_scatter, DIMS)
    want_indptr, want_tasks = list_schedule(graph, 8).csr(graph)
    np.testing.assert_array_equal(indptr.value.numpy(), want_indptr)
    np.testing.assert_array_equal(tasks.value.numpy(), want_tasks)
    np.testing.assert_array_equal(initial.value.numpy(), EventLayout.of(graph).initial)
    # the watchdog record, the workspace (C, the function's internal tensor, then the 12
    # counters from the next 256-byte boundary), the returned D
    status, workspace, D = kernel.ty_args[0].fields
    assert [list(map(int, t.shape.values)) for t in (status, workspace, D)] == [
        [8], [64 * 48 * 4 + 256], [64, 48]]
    params = mod["gemm_reduce_scatter"].params
    assert [list(map(int, p.ty.shape.values)) for p in params] == [[64, 32], [32, 48]]
    ret = mod["gemm_reduce_scatter"].ret_ty
    assert [list(map(int, f.shape.values)) for f in ret.fields] == [[64, 48], [8]]


def test_dynamic_becomes_one_ready_ring_kernel_launch():
    mod = DynamicScheduleTransform(DIMS, num_sms=8)(graphs.gemm_reduce_scatter.mod)
    relax.analysis.well_formed(mod)
    assert sorted(gv.name_hint for gv in mod.get_global_vars()) == [
        "gemm_reduce_scatter", "gemm_reduce_scatter_dynamic_megakernel"]
    kernel = kernel_call(mod["gemm_reduce_scatter"])
    A, B, initial, pending, indptr, consumers, first, ring, head_tail = kernel.args[1].fields
    graph = TaskGraph.build(graphs.gemm_reduce_scatter, DIMS)
    plan = DynamicPlan.of(graph)
    np.testing.assert_array_equal(initial.value.numpy(), EventLayout.of(graph).initial)
    np.testing.assert_array_equal(pending.value.numpy(), [0] * 12 + [1] * 12)
    np.testing.assert_array_equal(indptr.value.numpy(), plan.consumer_indptr)
    np.testing.assert_array_equal(consumers.value.numpy(), list(range(12, 24)))
    # each GEMM tile is the only producer of its reduce-scatter tile
    np.testing.assert_array_equal(first.value.numpy(),
                                  [t | ONLY_PRODUCER for t in range(12, 24)] + [-1] * 12)
    np.testing.assert_array_equal(ring.value.numpy(), list(range(12)) + [-1] * 12)
    np.testing.assert_array_equal(head_tail.value.numpy(), [0, 12, 24])  # pops, pushes, tasks
    # the watchdog record, the workspace (C, then the counters and the ring's pending, ring,
    # head_tail and marks, each from a 256-byte boundary), the returned D
    state = kernel.ty_args[0].fields
    assert [list(map(int, t.shape.values)) for t in state] == [
        [8], [64 * 48 * 4 + 5 * 256], [64, 48]]
    kernel_func = mod["gemm_reduce_scatter_dynamic_megakernel"]
    assert "tirx.use_cooperative_launch" in list(kernel_func.attrs["tirx.kernel_launch_params"])


def test_static_needs_sizes():
    with pytest.raises(GraphError, match=r"give dims for \['N'\]"):
        StaticScheduleTransform({"M": 64, "K": 32})(graphs.gemm_reduce_scatter.mod)


@pytest.mark.parametrize("transform", [StaticScheduleTransform, DynamicScheduleTransform,
                                       MixedScheduleTransform])
@pytest.mark.parametrize("num_sms", [0, -3, 2.5, True])
def test_a_persistent_transform_needs_a_positive_number_of_sms(transform, num_sms):
    with pytest.raises(EtcError, match=rf"{transform.__name__}: num_sms={num_sms!r} is not a "
                                       "positive integer"):
        transform(DIMS, num_sms=num_sms)


@pytest.mark.parametrize("options, message", [
    ({"timeout_s": 0}, r"timeout_s=0 is not a positive number of seconds"),
    ({"timeout_s": -1.5}, r"timeout_s=-1.5 is not a positive number of seconds"),
    ({"timeout_s": float("nan")}, r"timeout_s=nan is not a positive number of seconds"),
    ({"timeout_s": 1e10}, r"timeout_s=10000000000.0 is not a positive number of seconds "
                          r"\(below 9.2e9\)"),
    ({"timeout_s": "4"}, r"timeout_s='4' is not a positive number"),
    ({"ctas_per_sm": 0}, r"ctas_per_sm=0 is not a positive integer"),
    ({"ctas_per_sm": 1.5}, r"ctas_per_sm=1.5 is not a positive integer"),
    ({"drop_notify": -1}, r"drop_notify=-1 is not a task id"),
    ({"claim": "yes"}, r"claim='yes' is not True or False"),
    ({"profile": 3}, r"profile=3 is not True or False"),
])
def test_kernel_options_out_of_range_are_refused(options, message):
    with pytest.raises(EtcError, match=rf"KernelOptions: {message}"):
        KernelOptions(**options)


def test_unfused_is_one_grid_launch_per_call():
    mod = UnfusedTransform(DIMS)(graphs.gemm_reduce_scatter.mod)
    relax.analysis.well_formed(mod)
    calls = calls_of(mod["gemm_reduce_scatter"])
    assert [c.op.name for c in calls] == ["relax.call_tir", "relax.call_tir"]
    assert [c.args[0].name_hint for c in calls if c.op.name == "relax.call_tir"] == [
        "C_grid", "D_grid"]
    grid = mod["C_grid"]
    assert "T.cta_id([12])" in grid.script()


def test_unfused_threads_a_fresh_stop_record_through_the_launches_that_check():
    """Before: two calls of a tile that checks the slots it gathers by, one of a tile that
    does not. After: a stop record allocated and cleared by its own launch on every call
    (a constant of zeros would be folded into the module and then written), written in place
    by each checking launch after its inputs, and returned last."""
    mod = UnfusedTransform()(graphs.gathers.mod)
    relax.analysis.well_formed(mod)
    launches = [(c.op.name, c.args[0].name_hint if isinstance(c.args[0], tvm.ir.GlobalVar)
                 else None, [int(i) for i in c.attrs.inplace_indices]
                 if c.op.name == "relax.call_tir_inplace" else None)
                for c in calls_of(mod["gathers"])]
    assert launches == [
        ("relax.builtin.alloc_tensor", None, None),
        ("relax.call_tir_inplace", "gathers_clear_stop_record", [0]),
        ("relax.call_tir_inplace", "B_grid", [-1, 2]),
        ("relax.call_tir", "C_grid", None),
        ("relax.call_tir_inplace", "D_grid", [-1, 2]),
    ], launches
    assert [p.name for p in mod["D_grid"].params] == ["slot", "C", "status", "D"]
    assert len(mod["gathers"].ret_ty.fields) == 3  # D, B and the stop record


def test_unfused_first_launch_clears_the_stop_record_where_it_does_not_check():
    """Before: a tile that does not check, then one that does. After: no launch of its own
    for the stop record; the first launch takes it in place and its first thread zeroes it
    before its task, which stream order completes before the checking launch."""
    mod = UnfusedTransform()(graphs.doubled_gather.mod)
    relax.analysis.well_formed(mod)
    launches = [(c.op.name, [int(i) for i in c.attrs.inplace_indices]
                 if c.op.name == "relax.call_tir_inplace" else None)
                for c in calls_of(mod["doubled_gather"])]
    assert launches == [("relax.builtin.alloc_tensor", None),
                        ("relax.call_tir_inplace", [-1, 1]),
                        ("relax.call_tir_inplace", [-1, 2])], launches
    assert "doubled_gather_clear_stop_record" not in [g.name_hint for g in mod.get_global_vars()]
    clearing = mod["C_grid"]
    assert [p.name for p in clearing.params] == ["A", "status", "C"]
    script = clearing.script()
    assert all(f"status[{w}] = 0" in script for w in range(STATUS_WORDS)), script
    assert "if bx == 0 and tx == 0:" in script, script


def test_event_layout_offsets_and_initial_counts():
    graph = TaskGraph.build(graphs.row_sum, {"M": 32, "N": 48})
    layout = EventLayout.of(graph)
    assert layout.offsets == {"partials_done": 0}
    assert layout.initial.tolist() == [3, 3]
    assert str(tvm.sym.Analyzer().simplify(layout.flat_index("partials_done", [1]))) == "1"


def test_persistent_ctas_that_cannot_share_an_sm_are_refused():
    with pytest.raises(EtcError, match=r"32 persistent CTAs per SM of 128 threads .* do not fit "
                                       r"on one SM \(2048 threads"):
        StaticScheduleTransform(DIMS, num_sms=8, options=KernelOptions(ctas_per_sm=32))(
            graphs.gemm_reduce_scatter.mod)


def test_unfused_skips_the_tasks_no_trigger_releases():
    """The expert call launches its whole grid; each CTA scans expert_ready for an element
    whose exp_indptr range holds its tile and runs the body only if it finds one. The other
    calls, released by no trigger, run every task."""
    mod = UnfusedTransform({"T": 7})(make_moe_graph(32, 8, 2, 16, 4, "tensor").mod)
    relax.analysis.well_formed(mod)
    calls = calls_of(mod["moe"])
    assert [c.args[0].name_hint for c in calls] == [
        "router0_grid", "grouping0_grid", "scatter0_grid", "expert0_grid", "combine0_grid"]
    script = mod["expert0_grid"].script()
    assert 'exp_indptr: T.Buffer((9,), "int32")' in script  # the call's argument the map reads
    assert "bx = T.cta_id([12])" in script  # max_tiles(7, 8, 2, 4) CTAs, whether used or not
    scan = script[script.index("skip: T.int32 = 1"):script.index("g: T.let[T.int32]")]
    assert [line.strip() for line in scan.splitlines()] == [
        "skip: T.int32 = 1",
        "for e0 in range(8):",
        "if exp_indptr[e0] <= bx % 12 and bx % 12 < exp_indptr[e0 + 1]:",
        "skip = 0",
        "if skip == 0:",
        ""]
    for name in ("router0_grid", "grouping0_grid", "scatter0_grid", "combine0_grid"):
        assert "skip" not in mod[name].script()


@graph_func
def released_chain(x: Tensor(("M", COLS))):
    """A chain (task i waits for task i-1) of which the trigger releases the first two tasks;
    the others are skipped."""
    m = x.shape[0]
    ready, link = ETensor((1,), name="ready"), ETensor((m // ROWS,), name="link")
    a = call_device(scale_tile, tile_num=(m // ROWS,), args=[x], out=Tensor((m, COLS), name="a"),
                    out_edges={ready: "i->0"})
    return call_device(scale_tile, tile_num=(m // ROWS,), args=[a],
                       out=Tensor((m, COLS), name="b"),
                       in_edges={ready: "r=>0:2", link: "i->i-1 if i > 0"},
                       out_edges={link: "i->i"})


@graph_func
def self_released(x: Tensor(("M", COLS))):
    """Task i released by link[i+1], which task i+1 notifies: a chain run backwards."""
    m = x.shape[0]
    link = ETensor((m // ROWS,), name="link")
    return call_device(scale_tile, tile_num=(m // ROWS,), args=[x],
                       out=Tensor((m, COLS), name="b"),
                       in_edges={link: "e=>e-1:e if e > 0"}, out_edges={link: "i->i"})


def test_unfused_chain_tasks_released_by_a_trigger_launch_one_at_a_time_and_may_skip():
    mod = UnfusedTransform({"M": 16})(released_chain.mod)
    calls = calls_of(mod["released_chain"])
    assert [c.args[0].name_hint for c in calls] == ["a_grid"] + ["b_task"] * 4
    script = mod["b_task"].script()
    assert script.index("skip: T.int32 = 1") < script.index("skip = 0") \
        < script.index("if skip == 0:")


def test_unfused_refuses_a_trigger_among_one_calls_tasks():
    with pytest.raises(GraphError, match=r"self_released: b waits on its own tasks through "
                                         r"'e=>e-1:e if e > 0' on link, an order that run-time "
                                         r"data decides"):
        UnfusedTransform({"M": 16})(self_released.mod)


@pytest.mark.parametrize("count_mode", ["tensor", "inferred"])
def test_run_time_events_of_the_moe_graph(count_mode):
    """Combine and the expert tiles wait for grouping's completion (they read its CSR and
    pair tiles); expert_ready is armed once its counts can be read: when grouping completes
    (its counts tensor, and exp_indptr for the trigger), and router too when the counts are
    inferred from scatter's notifies through topk. Its counters start ARM_BIAS high."""
    graph = TaskGraph.build(make_moe_graph(32, 8, 2, 16, 4, count_mode), {"T": 7})
    router, grouping = (c.index for c in graph.calls[:2])
    layout = EventLayout.of(graph)
    tracked = [grouping] if count_mode == "tensor" else [router, grouping]
    assert list(layout.done) == tracked
    (gate, calls), = layout.gates.values()
    assert list(layout.gates) == ["expert_ready"] and calls == tuple(tracked)
    expert_ready = layout.offsets["expert_ready"]
    np.testing.assert_array_equal(layout.initial[expert_ready:expert_ready + 8], ARM_BIAS)
    assert [layout.initial[at] for at in layout.done.values()] == \
        [graph.calls[c].num_tasks for c in tracked]
    assert layout.initial[gate] == len(tracked)


def test_mixed_keeps_the_expert_tiles_out_of_the_queues():
    """Under "mixed" the expert tiles (schedule="dynamic") go through the ring and every other
    task through the queues; the ring will hold exactly the expert tiles, pushed by their
    trigger (no seeds)."""
    moe = make_moe_graph(32, 8, 2, 16, 4, "tensor")
    mod = MixedScheduleTransform({"T": 7}, num_sms=4)(moe.mod)
    kernel = kernel_call(mod["moe"])
    args = kernel.args[1].fields
    indptr, tasks, ring0, head_tail0 = (args[k].value.numpy() for k in (4, 5, 11, 12))
    graph = TaskGraph.build(moe, {"T": 7})
    expert = graph.calls[3]
    assert len(indptr) == 5 and indptr[-1] == graph.num_tasks - expert.num_tasks
    queued = set((tasks & (LOCAL_WAITS - 1)).tolist())
    assert queued == set(range(graph.num_tasks)) - set(expert.tasks)
    assert (ring0 == -1).all()
    assert head_tail0.tolist() == [0, 0, expert.num_tasks]


@pytest.mark.parametrize("target, message", [
    ("llvm", r"target llvm: the megakernels are CUDA kernels; give a CUDA target"),
    (tvm.target.Target("llvm"), r"target llvm: the megakernels are CUDA kernels"),
    ("nosuch", r"target 'nosuch': Target kind \"nosuch\" is not defined"),
    ({"kind": "cuda", "arch": 90}, r"target \{'kind': 'cuda', 'arch': 90\}: "),
])
def test_a_target_that_is_not_cuda_is_refused_before_the_lowering(target, message):
    """An LLVM target failed deep in the lowering ("Cannot resolve ScopeIdDef"), a kind's
    name as ``tvm.compile`` takes it with a TypeError of the ``with`` statement."""
    with pytest.raises(EtcError, match=message):
        build(graphs.gemm_reduce_scatter, DIMS, target=target)
    with pytest.raises(EtcError, match=message):
        pipeline(target, dims=DIMS)


def test_a_target_is_taken_as_tvm_compile_takes_it():
    """A JSON dict or a kind's name, as well as a Target."""
    source = build(graphs.gemm_reduce_scatter, DIMS, num_sms=132,
                   target={"kind": "cuda", "arch": "sm_90a"}).cuda_source()
    assert "gemm_reduce_scatter_megakernel_kernel(" in source
    assert cuda_target("cuda").kind.name == "cuda"


@pytest.mark.parametrize("transform", [StaticScheduleTransform, DynamicScheduleTransform,
                                       MixedScheduleTransform])
def test_a_persistent_transform_needs_kernel_options(transform):
    """A dict of options failed on its first attribute read ("'dict' object has no attribute
    'ctas_per_sm'")."""
    with pytest.raises(EtcError, match=rf"{transform.__name__}: options=\{{'claim': True\}} "
                                       r"is not a KernelOptions \(e.g. KernelOptions"):
        transform(DIMS, options={"claim": True})


@pytest.mark.parametrize("strategy", ["static", "unfused"])
def test_build_needs_kernel_options(strategy):
    with pytest.raises(EtcError, match=r"gemm_reduce_scatter: options=\{'claim': True\} is "
                                       "not a KernelOptions"):
        build(graphs.gemm_reduce_scatter, DIMS, strategy=strategy, options={"claim": True})


def test_build_names_the_strategies():
    with pytest.raises(EtcError, match="unknown strategy 'fast'; one of static, dynamic, mixed, "
                                       "barrier, unfused"):
        build(graphs.gemm_reduce_scatter, DIMS, strategy="fast")


def test_build_needs_a_graph_function_and_a_dict_of_dims():
    # a list of sizes was a TypeError of dict(), a plain function an AttributeError of .name
    with pytest.raises(EtcError, match=r"gemm_reduce_scatter: dims=\[32, 16, 16\] is not a "
                                       r"dict of sizes of its symbolic dims"):
        build(graphs.gemm_reduce_scatter, [32, 16, 16])
    with pytest.raises(EtcError, match=r"build: graph=<function .*> is not a @graph_func"):
        build(lambda x: x, DIMS)


@pytest.mark.parametrize("transform", [StaticScheduleTransform, MixedScheduleTransform])
def test_a_scheduler_is_callable(transform):
    """It was "'int' object is not callable" once the pass ran."""
    with pytest.raises(EtcError, match=rf"{transform.__name__}: scheduler=5 is not callable "
                                       r"\(a function of the task graph"):
        transform(DIMS, scheduler=5)
