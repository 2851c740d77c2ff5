"""Compile-only checks of the kernels of several ranks (no GPU): each rank's static kernel
notifies the owner of a sharded element through NVSHMEM and waits on its own shard; TVM builds
it the NVSHMEM way (relocatable code linked with libnvshmem_device.a) for sm_90a. Kernels of
one rank carry no NVSHMEM."""

import re

import pytest

from etc_tvm import distributed
from etc_tvm.build import build
from etc_tvm.errors import EtcError
from etc_tvm.schedule import list_schedule
from etc_tvm.task_graph import TaskGraph
from etc_tvm.tir_sched.events import EventLayout
from etc_tvm.tir_sched.persistent import KernelOptions
from etc_tvm.tir_sched.static_kernel import build_static_kernel

from tp_graphs import all_gather_gemm, gemm_reduce_scatter

DIMS = {"M": 16, "K": 8, "N": 8}


def rank_kernels(world_size: int):
    graph = TaskGraph.build(gemm_reduce_scatter(world_size), DIMS)
    graph.validate()
    schedule, layout = list_schedule(graph, 4), EventLayout.of(graph)
    return graph, [build_static_kernel(graph, schedule.for_rank(graph, r), layout,
                                       f"gemm_rs_rank{r}", rank=r) for r in range(world_size)]


@pytest.mark.parametrize("rank", [0, 1])
def test_rank_kernel_compiles_and_links_against_nvshmem(rank, nvshmem_home):
    """GEMM tile (i, j) stores its partial into the owner's copy of ``partials`` (a peer
    address), then notifies the owner; the reduce tiles wait on their own shard."""
    program = distributed.build_rank(gemm_reduce_scatter(2), DIMS, rank, num_sms=4)
    assert (program.meta.ctas, program.meta.arch) == (4, "sm_90a")  # what a launch checks
    source = program.executable.mod.imports[0].inspect_source("cuda")
    assert source.index("#include <nvshmem.h>") < source.index("#define uint")
    kernel = source[source.index(f"gemm_rs_rank{rank}_kernel("):]
    order = [kernel.index(s) for s in ("tvm_builtin_nvshmem_barrier_all()",
                                       "etc_peer(partials_ptr", "partials_peer[",
                                       "etc_notify_remote(", "etc_wait_sys(", "D_ptr[")]
    assert order == sorted(order)
    assert "etc_rank" not in kernel and "etc_world_size" not in kernel


@pytest.mark.parametrize("rank", [0, 1])
def test_dynamic_rank_kernel_pops_its_own_ring(rank, nvshmem_home):
    """Under the dynamic schedule a rank pops its own tasks; the reduce tiles wait on the
    other rank's GEMM tiles, so they enter the ring as a late call, after the rank's GEMM
    tiles are dispatched. No task runs without its waits."""
    program = distributed.build_rank(gemm_reduce_scatter(2), DIMS, rank, strategy="dynamic",
                                     num_sms=4)
    source = program.executable.mod.imports[0].inspect_source("cuda")
    kernel = source[source.index(f"gemm_rs_dynamic_rank{rank}_kernel("):]
    order = [kernel.index(s) for s in ("tvm_builtin_nvshmem_barrier_all()", "etc_take(",
                                       "etc_count_down_call_warp(", "etc_notify_remote(",
                                       "etc_wait_sys(")]
    assert order == sorted(order)
    # an element a task notifies may live on another rank: a held task still waits
    assert "chained_ptr" not in kernel and "done_here_ptr[0] = 0;" in kernel
    graph = program.graph
    own = [c for c in graph.calls if c.rank == rank]
    initial, pending, *_, head_tail = program.arrays
    late = len(pending) - graph.num_tasks  # pending counts: tasks, then late calls
    assert late == 1 and pending[-1] == own[0].num_tasks  # reduce waits for every GEMM tile
    assert head_tail.tolist() == [0, own[0].num_tasks, own[0].num_tasks + own[1].num_tasks]
    assert program.work == (len(pending), graph.num_tasks, 3, -(-graph.num_tasks // 32))
    assert all(a.size for a in program.arrays)  # the runtime refuses an empty argument


def test_build_rank_refuses_a_strategy_without_a_rank_kernel():
    with pytest.raises(EtcError, match="static or the dynamic schedule, not 'mixed'"):
        distributed.build_rank(gemm_reduce_scatter(2), DIMS, 0, strategy="mixed", num_sms=4)


@pytest.mark.parametrize("rank", [0, 1])
def test_all_gather_gemm_rank_kernel_compiles(rank, nvshmem_home):
    """Gather task (p, i) stores into rank p's ``gathered``; the ring GEMM reads its own."""
    program = distributed.build_rank(all_gather_gemm(2), {"M": 8, "K": 8, "N": 8}, rank,
                                     num_sms=4)
    kernel = program.executable.mod.imports[0].inspect_source("cuda")
    assert "etc_peer(gathered_ptr" in kernel and "gathered_ptr[" in kernel
    indptr, tasks, initial = program.arrays
    assert len(indptr) == 5 and len(tasks) == program.graph.num_tasks
    assert len(initial) == EventLayout.of(program.graph).size


@pytest.mark.parametrize("strategy", ["static", "dynamic"])
def test_a_rank_kernel_takes_ctas_per_sm_cta_an_sm(strategy, nvshmem_home):
    """As ``etc_tvm.build``: num_sms x ctas_per_sm persistent CTAs, and the launch checks the
    SMs they need."""
    program = distributed.build_rank(all_gather_gemm(2), {"M": 8, "K": 8, "N": 8}, 0,
                                     strategy=strategy, num_sms=2,
                                     options=KernelOptions(ctas_per_sm=2))
    assert program.num_ctas == 4
    assert (program.meta.ctas, program.meta.ctas_per_sm) == (4, 2)
    if strategy == "static":
        assert len(program.arrays[0]) == 5  # a queue a CTA


@pytest.mark.parametrize("strategy", ["static", "dynamic"])
def test_profiled_rank_kernel_takes_a_timeline_of_every_rank_s_tasks(strategy, nvshmem_home):
    """A rank kernel built to profile stamps rows by task id over all ranks (rank-major): its
    timeline has a row for every rank's task, and rows of other ranks' tasks stay zero."""
    program = distributed.build_rank(gemm_reduce_scatter(2), DIMS, 1, strategy=strategy,
                                     num_sms=4, options=KernelOptions(profile=True))
    source = program.executable.mod.imports[0].inspect_source("cuda")
    signature = re.search(r"__global__ void[^;{]*\{", source).group(0)
    assert "timeline_ptr" in signature
    assert program.meta.profiled and len(program.meta.task_names) == program.graph.num_tasks
    with pytest.raises(EtcError, match="has not been launched"):
        program.timeline()
    plain = distributed.build_rank(gemm_reduce_scatter(2), DIMS, 1, num_sms=4)
    with pytest.raises(EtcError, match="was not built to profile"):
        plain.timeline()


def test_build_rank_refuses_a_graph_of_one_rank():
    with pytest.raises(EtcError, match="one rank: build it with etc_tvm.build"):
        distributed.build_rank(gemm_reduce_scatter(1), DIMS, 0, num_sms=4)


def test_joining_checks_the_rank_before_touching_nvshmem():
    with pytest.raises(EtcError, match="rank 2 is outside a world of 2"):
        distributed.Nvshmem.init(2, 2, b"")


def test_host_library_builds_and_exports_its_calls(nvshmem_home):
    lib = distributed.Nvshmem.library()
    assert lib.etc_nvshmem_unique_id_size() > 0
    for name in ("etc_nvshmem_init", "etc_nvshmem_malloc", "etc_nvshmem_module_init",
                 "etc_nvshmem_barrier_all", "etc_nvshmem_finalize"):
        assert hasattr(lib, name)


def test_rank_kernel_takes_its_own_tensors_and_notifies_the_owner():
    graph, kernels = rank_kernels(2)
    names = [[p.name for p in k.params] for k in kernels]
    assert names[0] == names[1] == ["A", "B", "indptr", "tasks", "initial", "counters",
                                    "status", "partials", "D"]
    script = kernels[1].script()
    assert "etc_notify_remote" in script and "etc_notify\"" not in script
    assert "etc_wait_sys" in script


def test_rank_is_required_for_several_ranks_and_run_time_counts_are_refused():
    graph = TaskGraph.build(gemm_reduce_scatter(2), DIMS)
    schedule, layout = list_schedule(graph, 4), EventLayout.of(graph)
    with pytest.raises(Exception, match="one kernel per rank"):
        build_static_kernel(graph, schedule, layout, "k")
    counted = TaskGraph.build(gemm_reduce_scatter(2, counts=True), {**DIMS, "Mt": 4, "Nt": 2})
    with pytest.raises(NotImplementedError, match="run-time counts"):
        build_static_kernel(counted, list_schedule(counted, 4).for_rank(counted, 0),
                            EventLayout.of(counted), "k", rank=0)


def test_world_size_1_kernel_carries_no_nvshmem():
    """RANK is 0 and WORLD_SIZE 1 there, and the symmetric tensor is the kernel's own."""
    source = build(gemm_reduce_scatter(1), DIMS, num_sms=8).cuda_source()
    assert "nvshmem" not in source and "etc_notify(" in source
    assert "etc_rank" not in source and "etc_peer" not in source
