"""``etc_tvm.build``: a graph function to a runnable megakernel, in one call."""
from __future__ import annotations

import os
import warnings
from typing import Mapping, Sequence

import tvm

from . import build_env
from .graph_func import GraphFunc
from .relax_passes import cuda_target, pipeline
from .errors import EtcError
from .relax_passes.instantiate import sample_function
from .runtime import CompiledGraph, GraphMeta, SampledMeta
from .schedule import list_schedule
from .task_graph import TaskGraph
from .tir_sched.events import EventLayout, edge_sites
from .tir_sched.inline import input_check_sites
from .tir_sched.persistent import DEFAULT_OPTIONS, KernelOptions, is_integer, kernel_options

SM90A = {"kind": "cuda", "arch": "sm_90a"}


def default_target() -> tvm.target.Target:
    return tvm.target.Target(SM90A, host="llvm")


def build(graph: GraphFunc, dims: Mapping[str, int] | None = None, *, strategy: str = "static",
          target=None, num_sms: int | None = None,
          options: KernelOptions = DEFAULT_OPTIONS, scheduler=list_schedule,
          samples: Sequence[Mapping[str, int]] | None = None,
          max_dims: Mapping[str, int] | None = None, device=None) -> CompiledGraph:
    """Compile ``graph`` for ``dims`` with ``strategy`` (see ``relax_passes.pipeline``).

    target: a CUDA target as ``tvm.compile`` takes one (``relax_passes.cuda_target``); by
      default sm_90a with an LLVM host.
    num_sms: SMs for the persistent CTAs; by default those of ``device`` (or of the GPU
      here), else 132 (an H200's).
    scheduler: how static queues are computed (``etc_tvm.schedule``).
    samples, max_dims: instead of ``dims`` (one of the three), compile once for every size up
      to the largest sample (the persistent strategies): a kernel per sample, on symbolic
      shapes, each run served by the smallest sample that holds its sizes, the tasks beyond
      its grids skipped. ``max_dims`` (one symbolic dim) samples the powers of two up to its
      value, and the value itself.
    device: the GPU to run it on (by default the first); where there is none, the result can
      be exported (``CompiledGraph.export``), not run.
    """
    if not isinstance(graph, GraphFunc):
        raise EtcError(f"build: graph={graph!r} is not a @graph_func")
    if dims is not None and not isinstance(dims, Mapping):
        raise EtcError(f"{graph.name}: dims={dims!r} is not a dict of sizes of its symbolic "
                       "dims (e.g. {'B': 64})")
    given = [name for name, value in (("dims", dims or None), ("samples", samples),
                                      ("max_dims", max_dims)) if value is not None]
    if len(given) > 1:
        raise EtcError(f"{graph.name}: {' and '.join(given)}: give one (dims for one size, "
                       "samples or max_dims for every size up to theirs)")
    target = default_target() if target is None else cuda_target(target)
    kernel_options(options, graph.name)
    dims = dict(dims or {})
    check_dims(graph, dims, "dims")
    if num_sms is None:
        num_sms = default_num_sms(device if device is not None
                                  else tvm.cuda(0) if has_gpu() else None)
    if max_dims is not None:
        samples = power_of_two_samples(max_dims)
    if samples is not None:
        if not samples:
            raise EtcError(f"{graph.name}: samples: none given (each a dict of sizes of its "
                           "symbolic dims)")
        samples = sorted((dict(s) for s in samples), key=lambda s: sorted(s.items()))
        for sample in samples:
            check_dims(graph, sample, "a sample")
    with target:
        executable = tvm.compile(graph.mod, target=target, tir_pipeline="etc_tvm",
                                 relax_pipeline=pipeline(target, strategy, dims, num_sms, options,
                                                         scheduler, samples))
    # unfused launches return a stop record only for their tiles' input checks
    has_status = strategy != "unfused" or any(f.checks for f in graph.device_funcs.values())
    launch = {"ctas": 0 if strategy == "unfused" else num_sms * options.ctas_per_sm,
              "arch": str(target.attrs.get("arch", ""))}
    if samples is None:
        meta = graph_meta(graph, dims, options, has_status, **launch)
    else:
        meta = SampledMeta(graph.name, dim_sources(graph), [
            [s, sample_function(graph.name, k), graph_meta(graph, s, options, has_status,
                                                           **launch)]
            for k, s in enumerate(samples)])
    return CompiledGraph(executable, meta, device) if device is not None or has_gpu() \
        else _Unloaded(executable, meta)


def default_num_sms(device=None) -> int:
    """The SMs persistent CTAs are placed on by default: ``device``'s, where there is none
    132 (an H200's; a library exported from a machine without a GPU)."""
    return 132 if device is None else device.multi_processor_count


def graph_meta(graph: GraphFunc, dims, options: KernelOptions, has_status: bool, *,
               ctas: int = 0, arch: str = "") -> GraphMeta:
    """What the host reports a stopped kernel of ``graph`` for ``dims`` with, and checks the
    GPU against: ``ctas`` persistent CTAs (0: grid launches only), compiled for ``arch``."""
    task_graph = TaskGraph.build(graph, dims)
    return task_graph_meta(task_graph, EventLayout.of(task_graph), options, has_status,
                           ctas=ctas, arch=arch)


def task_graph_meta(task_graph: TaskGraph, layout: EventLayout, options: KernelOptions,
                    has_status: bool, *, ctas: int = 0, arch: str = "") -> GraphMeta:
    """``graph_meta`` of a task graph already built, with its event layout."""
    names = [task_graph.task_name(t) for t in range(task_graph.num_tasks)]
    return GraphMeta(task_graph.name, names, layout.names(task_graph), options.timeout_s,
                     has_status=has_status,
                     edges=[f"{c.name}: {e.etensor} '{e.map}'" for c, e in edge_sites(task_graph)],
                     checks=[c.fn.checks[k] for c, k in input_check_sites(task_graph)],
                     profiled=has_status and options.profile,
                     ctas=ctas, ctas_per_sm=options.ctas_per_sm, arch=arch)


def power_of_two_samples(max_dims: Mapping[str, int]) -> list[dict[str, int]]:
    """1, 2, 4, ... up to the one dim's maximum, and the maximum itself."""
    if len(max_dims) != 1:
        raise EtcError(f"max_dims samples one symbolic dim, got {dict(max_dims)}: give samples")
    (name, top), = max_dims.items()
    if not is_integer(top, least=1):
        raise EtcError(f"max_dims {name}={top!r}: the maximum must be positive (an integer)")
    values = sorted({1 << k for k in range(top.bit_length()) if 1 << k <= top} | {top})
    return [{name: v} for v in values]


def check_dims(graph: GraphFunc, sizes: Mapping[str, int], what: str) -> None:
    """Refuse sizes of dims that ``graph`` does not have, or that are no integers."""
    known = sorted(v.name for v in tvm.relax.analysis.defined_symbolic_vars(graph.func))
    unknown = sorted(set(sizes) - set(known))
    if unknown:
        raise EtcError(f"{graph.name}: {what} {dict(sizes)}: {unknown} are not among its "
                       f"symbolic dims {known}")
    for name, value in sizes.items():
        if not is_integer(value, least=0):
            raise EtcError(f"{graph.name}: {what} {dict(sizes)}: {name} = {value!r} is not a "
                           "size (an integer of at least 0)")


def dim_sources(graph: GraphFunc) -> dict[str, list[int]]:
    """Each symbolic dim of ``graph``: the first (input, axis) whose size it is."""
    sources = {}
    for k, p in enumerate(graph.func.params):
        for axis, d in enumerate(p.ty.shape.values):
            if isinstance(d, tvm.tirx.Var) and d.name not in sources:
                sources[d.name] = [k, axis]
    return sources


def has_gpu() -> bool:
    """Whether a CUDA GPU is usable here."""
    try:
        return tvm.cuda(0).exist
    except Exception:  # noqa: BLE001 (no CUDA runtime at all)
        return False


class _Unloaded(CompiledGraph):
    """A compiled graph on a machine without a GPU: it can be exported, not run."""

    def __init__(self, executable, meta):
        self.executable, self.meta = executable, meta

    def _run(self, inputs):  # under run, __call__, profile and capture
        raise EtcError(f"{self.meta.name}: no GPU here: export() the library and load() it "
                       "where one is")

    def export(self, path: str | os.PathLike) -> None:
        """Write the library, with a warning where its kernels stay CUDA source (then a
        machine that loads it has to compile them)."""
        from . import BUILD_ENV

        if BUILD_ENV == build_env.NO_COMPILER:
            warnings.warn(f"{path}: the kernels are CUDA source, not sm_90a machine code "
                          f"({BUILD_ENV}); with nvcc on the PATH, a build exports machine "
                          "code", stacklevel=2)
        super().export(path)
