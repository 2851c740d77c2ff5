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

With ``KernelOptions(claim=True)`` the kernel takes no queues: its CTAs claim the tasks in id
order at run time, each the next when it frees up (``tir_sched.static_kernel``).
"""
from __future__ import annotations

import tvm

from ..tir_sched.events import EventLayout
from ..tir_sched.static_kernel import build_claiming_kernel, build_static_kernel
from .instantiate import PersistentScheduleTransform, replace_with_persistent_kernel


@tvm.transform.module_pass(opt_level=0, name="etc.StaticScheduleTransform")
class StaticScheduleTransform(PersistentScheduleTransform):
    """Lower every graph function of the module to one launch of a persistent kernel, its
    queues list-scheduled (or by ``scheduler``) for concrete sizes. Parameters: see
    ``PersistentScheduleTransform``."""

    def lower(self, mod, name, graph, kernel_name, variant=None):
        num_ctas, layout = self.num_ctas, EventLayout.of(graph)
        symbolic = variant is not None
        if self.options.claim:  # no queues: the CTAs claim the tasks at run time
            kernel = build_claiming_kernel(graph, num_ctas, layout, kernel_name, self.options,
                                           symbolic)
            tables = []
        else:
            schedule = self.scheduler(graph, num_ctas)
            kernel = build_static_kernel(graph, schedule, layout, kernel_name, self.options,
                                         symbolic)
            tables = list(schedule.csr(graph))
        return replace_with_persistent_kernel(mod, name, graph, kernel,
                                              [*tables, layout.initial], variant)

