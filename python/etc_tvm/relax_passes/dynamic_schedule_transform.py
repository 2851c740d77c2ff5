"""DynamicScheduleTransform: a graph function becomes one persistent kernel fed by a ready ring.

Before: a graph function of ``etc.event_tensor`` and ``etc.call_device`` bindings (see
``StaticScheduleTransform``). After::

    (counters, status, pending, ring, head_tail, marks, C, D) = call_tir(dynamic_megakernel,
        (A, B, initial_counts, pending0, consumer_indptr, consumer_tasks, first_consumer,
         ring0, head_tail0))
    return (D, status)

Instead of per-CTA queues fixed at compile time, idle CTAs pop the oldest ready task, so
unbalanced task costs balance themselves; tasks released by data (trigger maps) enter the ring
only when their element completes, and the tasks no element releases never take a CTA. The
task graph is instantiated for concrete sizes and its ``DynamicPlan`` (pending producer counts,
consumer lists, seeds, late calls) stored as constants; the kernel's state is fresh every
launch. Run it before the standard Relax lowering.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import tvm

from ..schedule import DynamicPlan
from ..tir_sched.dynamic_kernel import build_dynamic_kernel
from ..tir_sched.events import EventLayout
from ..tir_sched.persistent import DEFAULT_OPTIONS, KernelOptions
from .instantiate import PersistentScheduleTransform, replace_with_persistent_kernel


@tvm.transform.module_pass(opt_level=0, name="etc.DynamicScheduleTransform")
class DynamicScheduleTransform(PersistentScheduleTransform):
    """Lower every graph function of the module to one launch of a ready-ring kernel.

    Parameters: see ``PersistentScheduleTransform`` (a ring needs no scheduler).
    """

    kernel_name = "dynamic_megakernel"

    def __init__(self, dims: Mapping[str, int] | None = None, num_sms: int = 132,
                 options: KernelOptions = DEFAULT_OPTIONS,
                 samples: Sequence[Mapping[str, int]] | None = None):
        super().__init__(dims, num_sms, options, samples=samples)

    def lower(self, mod, name, graph, kernel_name, variant=None):
        plan = DynamicPlan.of(graph, num_ctas=self.num_ctas)
        layout = EventLayout.of(graph)
        kernel = build_dynamic_kernel(graph, plan, layout, kernel_name, self.num_ctas,
                                      self.options,
                                      symbolic=variant is not None)
        constants = [layout.initial, *plan.tables(seeds_at_launch=variant is not None)]
        return replace_with_persistent_kernel(mod, name, graph, kernel, constants, variant)
