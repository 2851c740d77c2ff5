"""Compile-only checks of the kernels of several ranks (no GPU): each rank's static kernel
notifies the owner of a sharded element through NVSHMEM and waits on its own shard; TVM builds
it the NVSHMEM way (relocatable code linked with libnvshmem_device.a) for sm_90a. Kernels of
one rank carry no NVSHMEM."""
import importlib.util
import os
import shutil
from pathlib import Path

import pytest
import tvm

from etc_tvm.build import build, default_target
from etc_tvm.schedule import list_schedule
from etc_tvm.task_graph import TaskGraph
from etc_tvm.tir_sched.events import EventLayout
from etc_tvm.tir_sched.static_kernel import build_static_kernel

from tp_graphs import gemm_reduce_scatter

DIMS = {"M": 16, "K": 8, "N": 8}


def nvshmem_root() -> Path | None:
    """The NVSHMEM installation: ``NVSHMEM_HOME``, or the nvidia-nvshmem wheel."""
    if "NVSHMEM_HOME" in os.environ:
        return Path(os.environ["NVSHMEM_HOME"])
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations if spec else []):
        if (Path(base) / "nvshmem" / "include" / "nvshmem.h").exists():
            return Path(base) / "nvshmem"
    return None


@pytest.fixture(scope="module")
def nvshmem_home(tmp_path_factory):
    """A directory TVM's ``find_nvshmem_paths`` accepts: it looks for ``libnvshmem.a`` or
    ``libnvshmem.so``, which the wheel names ``libnvshmem_host.so.3``."""
    root = nvshmem_root()
    if root is None or not (root / "include" / "nvshmem.h").exists() \
            or shutil.which("nvcc") is None:
        pytest.skip("needs nvcc and the NVSHMEM headers (pip install nvidia-nvshmem-cu13)")
    lib = root / "lib"
    if (lib / "libnvshmem.a").exists() or (lib / "libnvshmem.so").exists():
        return root
    home = tmp_path_factory.mktemp("nvshmem_home")
    (home / "lib").mkdir()
    (home / "include").symlink_to(root / "include")
    (home / "lib" / "libnvshmem_device.a").symlink_to(lib / "libnvshmem_device.a")
    (home / "lib" / "libnvshmem.so").symlink_to(lib / "libnvshmem_host.so.3")
    return home


def rank_kernels(world_size: int):
    graph = TaskGraph.build(gemm_reduce_scatter(world_size), DIMS)
    graph.validate()
    schedule, layout = list_schedule(graph, 4), EventLayout.of(graph)
    return graph, [build_static_kernel(graph, schedule.for_rank(graph, r), layout,
                                       f"gemm_rs_rank{r}", rank=r) for r in range(world_size)]


@pytest.mark.parametrize("rank", [0, 1])
def test_rank_kernel_compiles_and_links_against_nvshmem(rank, nvshmem_home, monkeypatch):
    monkeypatch.setenv("NVSHMEM_HOME", str(nvshmem_home))
    _, kernels = rank_kernels(2)
    target = default_target()
    with target:
        ex = tvm.compile(tvm.IRModule({"k": kernels[rank]}), target=target, tir_pipeline="tirx")
    source = ex.mod.imports[0].inspect_source("cuda")
    assert source.index("#include <nvshmem.h>") < source.index("#define uint")
    kernel = source[source.index(f"gemm_rs_rank{rank}_kernel("):]
    order = [kernel.index(s) for s in ("tvm_builtin_nvshmem_barrier_all()", "partials_ptr[",
                                       "etc_notify_remote(", "etc_wait_sys(", "D_ptr[")]
    assert order == sorted(order)


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
    source = build(gemm_reduce_scatter(1), DIMS, num_sms=8).cuda_source()
    assert "nvshmem" not in source and "etc_notify(" in source
