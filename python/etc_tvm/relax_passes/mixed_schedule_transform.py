"""MixedScheduleTransform: static queues and a ready ring in one persistent kernel.

Before: a graph function whose ``call_device`` bindings say ``schedule="static"`` or
``schedule="dynamic"`` (unset: static). After::

    (counters, status, pending, ring, head_tail, marks, C, D) = call_tir(mixed_megakernel,
        (A, B, queue_indptr, queue_tasks, initial_counts, pending0, consumer_indptr,
         consumer_tasks, first_consumer, ring0, head_tail0))
    return (D, status)

The queues and the ring's calls come from ``schedule.mixed_schedule``; the ring follows
``DynamicPlan.of(graph, ring_calls)``. Costs that vary with data
(expert tiles, variable lengths) belong in the ring, predictable ones in the queues.
"""
from __future__ import annotations


import tvm

from ..schedule import DynamicPlan, mixed_schedule
from ..tir_sched.events import EventLayout
from ..tir_sched.mixed_kernel import build_mixed_kernel
from .instantiate import PersistentScheduleTransform, replace_with_persistent_kernel


@tvm.transform.module_pass(opt_level=0, name="etc.MixedScheduleTransform")
class MixedScheduleTransform(PersistentScheduleTransform):
    """Lower every graph function to one kernel of static queues and a ready ring.
    Parameters: see ``PersistentScheduleTransform``."""

    kernel_name = "mixed_megakernel"

    def lower(self, mod, name, graph, kernel_name, variant=None):
        schedule, ring_calls = mixed_schedule(graph, self.num_ctas, scheduler=self.scheduler)
        plan = DynamicPlan.of(graph, ring_calls, num_ctas=self.num_ctas)
        layout = EventLayout.of(graph)
        kernel = build_mixed_kernel(graph, schedule, plan, ring_calls, layout, kernel_name,
                                    self.options, symbolic=variant is not None)
        indptr, tasks = schedule.csr(graph)
        constants = [indptr, tasks, layout.initial,
                     *plan.tables(seeds_at_launch=variant is not None)]
        return replace_with_persistent_kernel(mod, name, graph, kernel, constants, variant)
