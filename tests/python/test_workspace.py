"""One workspace per persistent-kernel call: the internal tensors and the per-launch state are
views of one buffer, so the call allocates the watchdog record, the workspace and what the
graph function returns, where it allocated every tensor and state buffer."""
import pytest
import tvm
from tvm import relax

from etc_tvm import ETensor, Tensor, call_device, graph_func
from etc_tvm.build import build
from etc_tvm.relax_passes import DynamicScheduleTransform, StaticScheduleTransform
from etc_tvm.task_graph import TaskGraph
from etc_tvm.tir_sched.inline import substitute
from etc_tvm.tir_sched.persistent import Workspace, returned_tensors

import graphs
import tp_graphs
from cubin import build_cubin
from tma_tiles import COLS, ROWS, tma_rows


def test_views_start_on_256_byte_boundaries():
    ws = Workspace()
    a = ws.carve("a", (3, 5), "bfloat16")  # 30 bytes
    b = ws.carve("b", (7,), "int32")
    c = ws.carve("c", (64,), "float32")  # 256 bytes exactly
    assert [v.name for v in (a, b, c)] == ["a_ptr", "b_ptr", "c_ptr"]
    assert [int(offset) for _, offset in ws.views] == [0, 256, 512]
    assert int(ws.size) == 768


def call_outputs(transform, graph, dims):
    func = transform(dims, num_sms=8)(graph.mod)[graph.name]
    (call,) = [b.value for blk in func.body.blocks for b in blk.bindings
               if isinstance(b.value, relax.Call) and b.value.op.name == "relax.call_tir"]
    return [(f.dtype, [int(d) for d in f.shape.values]) for f in call.ty_args[0].fields]


@pytest.mark.parametrize("transform, state", [
    (StaticScheduleTransform, 1),  # the 12 counters
    (DynamicScheduleTransform, 5)])  # and the ring's pending, ring, head_tail and marks
def test_a_call_returns_the_record_one_workspace_and_its_outputs(transform, state):
    """gemm_reduce_scatter returns D; C (64 x 48 fp32) is internal. Each state buffer is
    under 256 bytes and starts on a 256-byte boundary."""
    outs = call_outputs(transform, graphs.gemm_reduce_scatter, {"M": 64, "K": 32, "N": 48})
    assert outs == [("int32", [8]), ("uint8", [64 * 48 * 4 + state * 256]),
                    ("float32", [64, 48])]


def test_a_sampled_kernel_sizes_its_workspace_from_the_call_shapes():
    """A kernel for every size up to a sample: its call allocates a workspace sized by the
    function's own symbolic dims (C is M x N fp32, then the counters), not the sample's."""
    mod = StaticScheduleTransform(num_sms=8, samples=[{"M": 64, "K": 32, "N": 48}])(
        graphs.gemm_reduce_scatter.mod)
    func = mod["gemm_reduce_scatter__sample0"]
    (call,) = [b.value for blk in func.body.blocks for b in blk.bindings
               if isinstance(b.value, relax.Call) and b.value.op.name == "relax.call_tir"]
    (size,) = call.ty_args[0].fields[1].shape.values
    dims = {v.name: v for v in relax.analysis.defined_symbolic_vars(func)}
    analyzer = tvm.sym.Analyzer()
    for m, n in ((16, 48), (64, 40)):
        value = analyzer.simplify(substitute(size, {
            dims["M"]: tvm.tirx.IntImm("int64", m), dims["N"]: tvm.tirx.IntImm("int64", n)}))
        assert int(value) == -(-m * n * 4 // 256) * 256 + 256


@graph_func
def two_copies(A: Tensor(("R", COLS), "bfloat16")):
    """B = A, then C = B, both through a TMA load: B is internal but read through a map."""
    copied = ETensor((A.shape[0] // ROWS,), name="copied")
    B = call_device(tma_rows, tile_num=(A.shape[0] // ROWS,), args=[A],
                    out=Tensor((A.shape[0], COLS), "bfloat16", name="B"),
                    out_edges={copied: "i->i"})
    return call_device(tma_rows, tile_num=(A.shape[0] // ROWS,), args=[B],
                       out=Tensor((A.shape[0], COLS), "bfloat16", name="C"),
                       in_edges={copied: "i->i"})


def test_a_tensor_read_through_a_tensor_map_stays_an_argument(tmp_path):
    """The host encodes a map from its tensor's own address, so B is no workspace view."""
    graph = TaskGraph.build(two_copies, {"R": 256})
    assert [t.name for t in returned_tensors(graph)] == ["B", "C"]
    source = build(two_copies, {"R": 256}, strategy="static", num_sms=4).cuda_source()
    signature = source[source.index("two_copies_megakernel_kernel("):]
    assert "nv_bfloat16* __restrict__ B_ptr" in signature[:signature.index(")")]
    build_cubin(source, tmp_path)


def test_internal_tensors_are_views_in_the_generated_kernel(tmp_path):
    source = build(graphs.gemm_reduce_scatter, {"M": 64, "K": 32, "N": 48}, strategy="dynamic",
                   num_sms=8).cuda_source()
    kernel = source[source.index("__global__"):]
    assert "float* C_ptr = ((float*)(&(workspace_ptr[0])));" in kernel
    assert "int* counters_ptr = ((int*)(&(workspace_ptr[12288])));" in kernel
    build_cubin(source, tmp_path)


def test_ranks_keep_a_buffer_per_tensor():
    """A kernel of one rank of several keeps every tensor the rank produces where build_rank
    puts it (the symmetric heap, for the other ranks to reach)."""
    graph = TaskGraph.build(tp_graphs.gemm_reduce_scatter(2), {"M": 16, "K": 8, "N": 8})
    for rank in range(2):
        own = [t.name for t in graph.tensors if t.producer is not None and t.rank == rank]
        assert [t.name for t in returned_tensors(graph, rank)] == own
        assert len(own) > len([t for t in returned_tensors(graph) if t.rank == rank])
