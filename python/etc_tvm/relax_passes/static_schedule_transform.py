"""StaticScheduleTransform: a graph function of etc ops becomes one persistent kernel launch.

Before::

    E = etc.event_tensor(...)
    C = etc.call_device(gemm, ..., out_edges=[E: "ij->ij"])
    D = etc.call_device(reduce_scatter, ..., in_edges=[E: "ij->ij"])
    return D

After::

    (counters, status, C, D) = call_tir(megakernel,
        (A, B, queue_indptr, queue_tasks, initial_counts), out_ty=[...])
    return (D, status)

The counters and the watchdog record are fresh outputs of every launch, which the kernel
initialises from the constant ``initial_counts`` (never written) before a grid-wide barrier.

The task graph is instantiated for concrete sizes (the function's own, or ``dims``), list
scheduled onto one queue per persistent CTA (stored as constants the kernel reads) and lowered by
``tir_sched.static_kernel``. The device functions, now inlined, leave the module. The function
also returns the watchdog ``status`` record, last; ``etc_tvm.runtime`` checks it. Run it before
the standard Relax lowering (``etc_tvm.relax_passes.pipeline``).
"""
from __future__ import annotations

from typing import Mapping

import numpy as np
import tvm
from tvm import relax

from ..schedule import list_schedule
from ..tir_sched.events import EventLayout
from ..tir_sched.persistent import DEFAULT_OPTIONS, STATUS_WORDS, KernelOptions
from ..tir_sched.static_kernel import build_static_kernel
from .instantiate import graph_functions, instantiate, without, without_device_funcs


@tvm.transform.module_pass(opt_level=0, name="etc.StaticScheduleTransform")
class StaticScheduleTransform:
    """Lower every graph function of the module to one launch of a persistent kernel.

    dims: values of the symbolic dims (a static schedule is computed for concrete sizes).
    num_sms: SMs of the target (132 on an H200); ``options.ctas_per_sm`` persistent CTAs each.
    scheduler: (task graph, number of queues) -> StaticSchedule; list scheduling by default.
    """

    def __init__(self, dims: Mapping[str, int] | None = None, num_sms: int = 132,
                 options: KernelOptions = DEFAULT_OPTIONS, scheduler=list_schedule):
        self.dims = dict(dims or {})
        self.num_sms = num_sms
        self.options = options
        self.scheduler = scheduler

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        for name in graph_functions(mod):
            mod, graph = instantiate(mod, name, self.dims)
            schedule = self.scheduler(graph, self.num_sms * self.options.ctas_per_sm)
            layout = EventLayout.of(graph)
            kernel = build_static_kernel(graph, schedule, layout, f"{name}_megakernel",
                                         self.options)
            mod = _rewrite(mod, name, graph, schedule, layout, kernel)
        return without_device_funcs(mod)


def _rewrite(mod, name, graph, schedule, layout, kernel) -> tvm.IRModule:
    func = mod[name]
    bb = relax.BlockBuilder(without(mod, name))
    megakernel = bb.add_func(kernel, kernel.attrs["global_symbol"])
    params = list(func.params)
    produced = [t for t in graph.tensors if t.producer is not None]
    indptr, tasks = schedule.csr(graph)
    # a plain binding block: the s_tir-only dataflow passes (FuseOps, RewriteDataflowReshape)
    # must not look into the TIRx kernels
    with bb.function(name, params, attrs=dict(func.attrs) if func.attrs else None):
        args = [*params, relax.const(indptr), relax.const(_padded(tasks)),
                relax.const(_padded(layout.initial))]
        out_tys = [relax.TensorType([layout.size], "int32"),
                   relax.TensorType([STATUS_WORDS], "int32")]
        out_tys += [relax.TensorType(list(t.shape), t.dtype) for t in produced]
        result = bb.emit(relax.call_tir(megakernel, args, out_tys), "result")
        value = {t.index: params[t.param] for t in graph.tensors if t.param is not None}
        for k, t in enumerate(produced):
            value[t.index] = bb.emit(relax.TupleGetItem(result, 2 + k), t.name)
        status = bb.emit(relax.TupleGetItem(result, 1), "status")
        bb.emit_func_output(relax.Tuple([*(value[t] for t in graph.outputs), status]))
    return bb.finalize()


def _padded(values):
    """A constant of at least one element (a zero-size tensor cannot be a kernel argument)."""
    values = np.asarray(values, np.int32)
    return values if values.size else np.zeros(1, np.int32)
