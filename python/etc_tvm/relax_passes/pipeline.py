"""The etc_tvm compilation pipeline: the etc passes, then TVM's standard Relax CUDA stages.

    tvm.compile(mod, target, relax_pipeline=etc_tvm.relax_passes.pipeline(target, dims=...),
                tir_pipeline="etc_tvm")

``strategy`` picks how the graph functions run:

- "static": one persistent kernel, per-SM queues, tile-level events;
- "dynamic": one persistent kernel whose CTAs pop ready tasks from a ring (early push);
- "mixed": one persistent kernel, static queues for the calls marked ``schedule="static"``
  (or unmarked), a ready ring for those marked ``schedule="dynamic"``;
- "barrier": the same kernel with one global barrier between operators instead of the edges;
- "unfused": each call_device its own grid launch, in stream order (the baseline).

The TIR pipeline "etc_tvm" lowers the TIRx kernels and any legalized s_tir functions together.
"""
from __future__ import annotations

from typing import Mapping

import tvm
from tvm.relax.backend.cuda import pipeline as cuda_pipeline
from tvm.tirx import compilation_pipeline as tir_pipelines

from ..errors import EtcError
from ..schedule import list_schedule
from ..tir_sched.persistent import DEFAULT_OPTIONS, KernelOptions
from .barrier_edges_transform import BarrierEdgesTransform
from .dynamic_schedule_transform import DynamicScheduleTransform
from .mixed_schedule_transform import MixedScheduleTransform
from .static_schedule_transform import StaticScheduleTransform
from .unfused_transform import UnfusedTransform

STRATEGIES = ("static", "dynamic", "mixed", "barrier", "unfused")


def etc_passes(strategy: str = "static", dims: Mapping[str, int] | None = None,
               num_sms: int = 132, options: KernelOptions = DEFAULT_OPTIONS,
               scheduler=list_schedule, samples=None) -> list:
    """The etc passes of one execution strategy, to run before the standard Relax lowering.

    ``samples`` (the persistent strategies): sizes to precompute schedules for instead of
    ``dims``; see ``StaticScheduleTransform``."""
    if strategy not in STRATEGIES:
        raise EtcError(f"unknown strategy {strategy!r}; one of {', '.join(STRATEGIES)}")
    if samples is not None and strategy == "unfused":
        raise EtcError("sampled schedules are for the persistent kernels, not the unfused "
                       "launches")
    if strategy == "unfused":
        return [UnfusedTransform(dims)]
    if strategy == "dynamic":
        return [DynamicScheduleTransform(dims, num_sms, options, samples)]
    if strategy == "mixed":
        return [MixedScheduleTransform(dims, num_sms, options, scheduler, samples)]
    lowering = [StaticScheduleTransform(dims, num_sms, options, scheduler, samples)]
    return [BarrierEdgesTransform()] + lowering if strategy == "barrier" else lowering


def cuda_target(target) -> tvm.target.Target:
    """``target`` as ``tvm.compile`` takes one (a Target, a JSON dict, a kind's name), checked
    to be CUDA: the megakernels are CUDA kernels, and another kind failed deep in the lowering
    (an LLVM target: "Cannot resolve ScopeIdDef")."""
    if not isinstance(target, tvm.target.Target):
        try:
            target = tvm.target.Target(target)
        except (ValueError, TypeError) as err:
            raise EtcError(f"target {target!r}: {str(err).splitlines()[0]}") from None
    if target.kind.name != "cuda":
        raise EtcError(f"target {target.kind.name}: the megakernels are CUDA kernels; give a "
                       "CUDA target, e.g. {'kind': 'cuda', 'arch': 'sm_90a'}")
    return target


def pipeline(target, strategy: str = "static",
             dims: Mapping[str, int] | None = None, num_sms: int = 132,
             options: KernelOptions = DEFAULT_OPTIONS,
             scheduler=list_schedule, samples=None) -> tvm.transform.Pass:
    """The whole Relax pipeline for ``tvm.compile(..., relax_pipeline=...)`` on a CUDA
    ``target`` (``cuda_target``)."""
    target = cuda_target(target)
    passes = etc_passes(strategy, dims, num_sms, options, scheduler, samples)

    @tvm.transform.module_pass(opt_level=0, name="etc.Pipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            return tvm.transform.Sequential(
                passes
                + cuda_pipeline.library_dispatch_passes(target)
                + cuda_pipeline.legalize_passes(target)
                + cuda_pipeline.dataflow_lower_passes(target)
                + cuda_pipeline.finalize_passes(target))(mod)

    return _pipeline


def _is_s_tir(func) -> bool:
    return isinstance(func, tvm.tirx.PrimFunc) and func.attrs is not None \
        and bool(func.attrs.get("s_tir", False))


def _tir_pipeline():
    """TIRx kernels through the "tirx" pipeline, legalized Relax ops through "s_tir"."""
    s_tir, finalize_host, finalize_device = tir_pipelines.get_tir_pipeline("s_tir")
    tirx_pipe = tir_pipelines.get_tir_pipeline("tirx")[0]

    @tvm.transform.module_pass(opt_level=0, name="etc.TIRPipeline")
    def _lower(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        parts = {True: {}, False: {}}
        for gv, f in mod.functions_items():
            parts[_is_s_tir(f)][gv] = f
        out = {}
        for is_s_tir, funcs in parts.items():
            if funcs:
                lowered = (s_tir if is_s_tir else tirx_pipe)(tvm.IRModule(funcs, attrs=mod.attrs))
                out.update(dict(lowered.functions_items()))
        return tvm.IRModule(out, attrs=mod.attrs)

    return _lower, finalize_host, finalize_device


tir_pipelines.register_tir_pipeline("etc_tvm", _tir_pipeline)
