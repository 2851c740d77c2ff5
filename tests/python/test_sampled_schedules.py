"""Static schedules for sampled sizes: one compilation serves every size up to the largest
sample, each call running on the smallest sample that holds its sizes."""
import json
import shutil
import subprocess

import numpy as np
import pytest
import tvm
from tvm import relax

from etc_tvm import EtcError, ExecutionError
from etc_tvm.build import build, power_of_two_samples
from etc_tvm.executor import DynamicQueueOrder, MixedOrder, StaticOrder, execute
from etc_tvm.relax_passes import StaticScheduleTransform
from etc_tvm.runtime import SampledMeta
from etc_tvm.schedule import list_schedule, mixed_schedule
from etc_tvm.task_graph import TaskGraph

import graphs
from decode_graphs import tensor_core_gemm
from moe_graph import make_inputs, moe_graph, moe_reference


def test_power_of_two_samples_end_at_the_maximum():
    assert [s["B"] for s in power_of_two_samples({"B": 4096})] == [1 << k for k in range(13)]
    assert [s["B"] for s in power_of_two_samples({"B": 100})] == [1, 2, 4, 8, 16, 32, 64, 100]
    with pytest.raises(EtcError, match="one symbolic dim"):
        power_of_two_samples({"B": 8, "C": 8})
    with pytest.raises(EtcError, match="must be positive"):
        power_of_two_samples({"B": 0})
    with pytest.raises(EtcError, match=r"B=64.0: the maximum must be positive \(an integer\)"):
        power_of_two_samples({"B": 64.0})


@pytest.mark.parametrize("sizes, message", [
    ({"dims": {"M": 64, "N": 64, "Q": 3}},
     r"row_sum: dims \{'M': 64, 'N': 64, 'Q': 3\}: \['Q'\] are not among its symbolic dims "
     r"\['M', 'N'\]"),
    ({"dims": {"M": 64.0, "N": 64}}, r"row_sum: dims .*: M = 64.0 is not a size"),
    ({"dims": {"M": -1, "N": 64}}, r"row_sum: dims .*: M = -1 is not a size"),
    ({"samples": [{"M": 8, "N": 8}, {"M": 16, "n": 8}]},
     r"row_sum: a sample \{'M': 16, 'n': 8\}: \['n'\] are not among its symbolic dims"),
])
def test_build_refuses_sizes_of_dims_the_graph_does_not_have(sizes, message):
    with pytest.raises(EtcError, match=message):
        build(graphs.row_sum, **sizes)


@pytest.mark.parametrize("sizes, given", [
    ({"dims": {"M": 64, "N": 64}, "max_dims": {"M": 64}}, "dims and max_dims"),
    ({"dims": {"M": 64}, "samples": [{"M": 8}]}, "dims and samples"),
    ({"samples": [{"M": 8}], "max_dims": {"M": 64}}, "samples and max_dims"),
    ({"dims": {"M": 64, "N": 64}, "samples": []}, "dims and samples"),
])
def test_build_takes_one_kind_of_sizes(sizes, given):
    # before, samples silently replaced dims, and max_dims samples
    with pytest.raises(EtcError, match=f"row_sum: {given}: give one"):
        build(graphs.row_sum, **sizes)


def test_build_refuses_an_empty_list_of_samples():
    # before, with dims beside it, it built a library of no samples that no call could use
    with pytest.raises(EtcError, match="row_sum: samples: none given"):
        build(graphs.row_sum, samples=[])


def test_a_pass_given_dims_and_samples_refuses_them():
    with pytest.raises(EtcError, match=r"StaticScheduleTransform: dims \{'M': 16\} and "
                                       "samples: give dims for one size, or samples"):
        StaticScheduleTransform({"M": 16}, samples=[{"M": 16}, {"M": 64}])


def test_each_sample_is_a_function_with_the_graph_functions_symbolic_parameters():
    mod = StaticScheduleTransform(samples=[{"M": 16}, {"M": 64}], num_sms=8)(graphs.two_ops.mod)
    relax.analysis.well_formed(mod)
    names = sorted(gv.name_hint for gv in mod.get_global_vars())
    assert names == ["two_ops__sample0", "two_ops__sample1", "two_ops_megakernel_0",
                     "two_ops_megakernel_1"]
    for k in range(2):
        (x, y) = mod[f"two_ops__sample{k}"].params
        assert isinstance(x.ty.shape.values[0], tvm.tirx.Var)  # any M
        kernel = mod[f"two_ops_megakernel_{k}"]
        x_buffer = next(b for b in kernel.params if b.name == "X")
        assert isinstance(x_buffer.shape[0], tvm.tirx.Var)


def test_one_compilation_serves_every_size(monkeypatch):
    compiles = []
    real = tvm.compile
    monkeypatch.setattr(tvm, "compile", lambda *a, **k: compiles.append(1) or real(*a, **k))
    compiled = build(graphs.two_ops, max_dims={"M": 256}, num_sms=132)
    assert len(compiles) == 1
    meta = compiled.meta
    pick = {m: meta.select([np.zeros((m, 32)), np.zeros((m, 32))])[0] for m in (1, 3, 64, 65,
                                                                               256)}
    assert pick == {1: "two_ops__sample0", 3: "two_ops__sample2", 64: "two_ops__sample6",
                    65: "two_ops__sample7", 256: "two_ops__sample8"}
    with pytest.raises(ExecutionError, match=r"sizes \{'M': 257\} exceed the largest sample "
                                             r"the graph was compiled for, \{'M': 256\}"):
        meta.select([np.zeros((257, 32)), np.zeros((257, 32))])


def test_the_sample_table_survives_export(tmp_path):
    compiled = build(graphs.two_ops, samples=[{"M": 8}, {"M": 32}], num_sms=132)
    compiled.export(tmp_path / "two_ops.so")
    meta = SampledMeta(**json.loads((tmp_path / "two_ops.so.json").read_text()))
    assert meta == compiled.meta
    assert meta.select([np.zeros((20, 32))] * 2)[1].task_names[-1] == "B(7)"  # M = 32: 8 tiles


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("strategy", ["static", "dynamic", "mixed"])
@pytest.mark.parametrize("graph, samples", [
    (graphs.two_ops, [{"M": 8}, {"M": 64}]),
    (moe_graph(2, "inferred"), [{"T": 8}, {"T": 16}]),
], ids=["two_ops", "moe"])
def test_sampled_kernels_compile_for_sm90a(graph, samples, strategy, tmp_path):
    source = build(graph, samples=samples, strategy=strategy, num_sms=132).cuda_source()
    path = tmp_path / "kernel.cu"
    path.write_text(source)
    proc = subprocess.run(["nvcc", "-arch=sm_90a", "-c", str(path), "-o", str(tmp_path / "k.o")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_ring_kernel_on_symbolic_shapes_pushes_its_seeds_at_launch():
    """The ring starts empty; at launch a task inside the grids that waits for nothing is
    pushed, and one outside is dispatched as skipped, its pending count out of reach."""
    source = build(graphs.two_ops, samples=[{"M": 64}], strategy="dynamic",
                   num_sms=132).cuda_source()
    kernel = source[source.index("two_ops_dynamic_megakernel_0_kernel("):]
    kernel = kernel[kernel.index("{"):]
    assert "1073741824" in kernel[:kernel.index("tvm_builtin_cuda_grid_sync")]
    launch = kernel[kernel.index("tvm_builtin_cuda_grid_sync"):kernel.index("while (1)")]
    assert "etc_push(" in launch and ")), -1);" in launch  # the expected count, one less


@pytest.mark.parametrize("engine, asserted", [("mma", "MNK"), ("swapped", "NK")])
def test_a_kernel_on_symbolic_sizes_asserts_its_tiles_requirements_at_launch(engine, asserted):
    """Sizes between samples are only known at launch: the host asserts each tile's
    ``requires`` that they decide (the swapped tile takes any M), with the tile's message."""
    graph = tensor_core_gemm(engine, 1)
    mod = StaticScheduleTransform(samples=[{"M": 64, "K": 2048, "N": 2048}], num_sms=132)(
        graph.mod)
    kernel = mod["gemm_only_megakernel_0"].script()
    tile = next(iter(graph.device_funcs))
    step = {"mma": {"M": 16, "N": 64, "K": 64}, "swapped": {"N": 128, "K": 32}}[engine]
    what = {"M": "M a multiple of 16", "N": f"N a multiple of {step['N']}",
            "K": f"K a multiple of {step['K']}"}
    assert [line.strip() for line in kernel.splitlines() if "assert" in line] == [
        f'assert T.Cast("int32", {d}) % {step[d]} == 0, ("ValueError", ["gemm_only: call {tile}0: '
        f'{tile} takes {what[d]}, which the sizes of A (M, K), B (K, N), C (M, N) break"])'
        for d in asserted]
    fixed = StaticScheduleTransform({"M": 64, "K": 2048, "N": 2048}, num_sms=132)(graph.mod)
    assert "assert" not in fixed["gemm_only_megakernel"].script()


def test_sampled_schedules_are_for_persistent_kernels():
    with pytest.raises(EtcError, match="sampled schedules are for the persistent kernels"):
        build(graphs.two_ops, samples=[{"M": 8}], strategy="unfused", num_sms=132)


@pytest.mark.parametrize("tokens", [1, 2, 3, 7, 64, 100, 300, 1024])
def test_every_token_count_runs_on_its_samples_schedules(tokens):
    """What the GPU runs for ``tokens`` under one ``max_dims={"T": 4096}`` compilation, on the
    CPU: the smallest power-of-two sample holding it, its static queues, its ring and its mixed
    queues, with the tasks beyond the tokens skipped."""
    graph = moe_graph(2, "tensor")
    sample = next(s for s in power_of_two_samples({"T": 4096}) if s["T"] >= tokens)
    big = TaskGraph.build(graph, sample)
    inputs = make_inputs("random", tokens, 2)
    want = moe_reference(*inputs, 2)
    mixed, ring_calls = mixed_schedule(big, 132)
    for order in (StaticOrder(list_schedule(big, 132).queues), DynamicQueueOrder(132),
                  MixedOrder(mixed.queues, ring_calls)):
        got = execute(graph, *inputs, order=order, schedule_dims=sample)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

