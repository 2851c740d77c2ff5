"""The persistent kernel of a dynamic schedule: CTAs pop tasks from a ready ring in memory.

    grid = ctas CTAs (cooperative launch)
    prologue: counters, pending counts, ring (seeds then -1) and head/tail from their initial
              values; status cleared; grid-wide barrier
    CTA:  loop:
              thread 0: t = etc_pop(ring)                 # -1: every task taken, -2: stopping
                        if t >= 0: for each consumer c of t: etc_count_down(pending[c])
                                   (early push: c enters the ring once its last producer is
                                   dispatched; it still waits on its events before its body)
              barrier; t broadcast through shared memory; leave the loop if t < 0
              run task t as the static kernel does: waits, inlined body, notifies

The plan (pending counts, consumer lists, seeds) is ``schedule.DynamicPlan``; the CPU executor's
``DynamicQueueOrder`` follows the same plan and protocol. Kernel parameters, in order: the
graph's inputs; the read-only initial state ``initial`` (counts), ``pending0``, ``consumer_indptr``,
``consumer_tasks``, ``ring0`` (seeds padded with -1), ``head_tail0``; then the outputs
``counters``, ``status``, ``pending``, ``ring``, ``head_tail`` and every call's output tensors.
"""
from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as Tb

from ..schedule import DynamicPlan
from ..task_graph import TaskGraph
from .events import EventLayout
from .inline import i32
from .persistent import DEFAULT_OPTIONS, KernelOptions, PersistentKernel, check_compile_time_edges


def build_dynamic_kernel(graph: TaskGraph, plan: DynamicPlan, layout: EventLayout, name: str,
                         num_ctas: int, options: KernelOptions = DEFAULT_OPTIONS) -> tirx.PrimFunc:
    """The persistent kernel that runs ``graph`` from a ready ring, following ``plan``."""
    check_compile_time_edges(graph, "dynamic")
    kernel = PersistentKernel(graph, layout, options)
    n = max(1, graph.num_tasks)
    state = {  # name: (read-only initial value, working copy)
        "pending": (n,), "ring": (n,), "head_tail": (2,)}
    initial = {k: tirx.decl_buffer(shape, "int32", f"{k}0") for k, shape in state.items()}
    work = {k: tirx.decl_buffer(shape, "int32", k) for k, shape in state.items()}
    consumer_indptr = tirx.decl_buffer((n + 1,), "int32", "consumer_indptr")
    consumer_tasks = tirx.decl_buffer((max(1, len(plan.consumer_tasks)),), "int32",
                                      "consumer_tasks")
    slot = tirx.decl_buffer((1,), "int32", "popped", scope="shared")
    task = tirx.Var("t", "int32")
    dispatch = kernel.dispatch(task)
    tx, status = kernel.tx, kernel.status

    def pointer(buf):
        return buf.ptr_to([0])

    with IRBuilder() as ib:
        with Tb.prim_func():
            Tb.func_name(name)
            Tb.func_attr({"global_symbol": name, "tirx.is_scheduled": True,
                          "tirx.kernel_launch_params": ["tirx.use_cooperative_launch"]})
            for b in [*kernel.inputs, kernel.initial, initial["pending"], consumer_indptr,
                      consumer_tasks, initial["ring"], initial["head_tail"], kernel.counters,
                      status, work["pending"], work["ring"], work["head_tail"], *kernel.outputs]:
                Tb.arg(b.name, b)
            Tb.device_entry()
            bx = IRBuilder.name("bx", Tb.cta_id([num_ctas]))
            kernel.declare()
            Tb.add_to_parent(tirx.AllocBuffer(slot))
            kernel.initialise(bx, num_ctas, [(work[k], initial[k], shape[0])
                                             for k, shape in state.items()])
            with Tb.While(tirx.IntImm("bool", 1)):
                with Tb.If(tx == 0):
                    with Tb.Then():
                        Tb.buffer_store(slot, kernel.runtime_call(
                            "etc_pop", pointer(work["head_tail"]), pointer(work["ring"]),
                            i32(graph.num_tasks), pointer(status), kernel.limit,
                            return_type="int32"), [0])
                        with Tb.If(slot[0] >= 0):
                            with Tb.Then():
                                with Tb.serial(consumer_indptr[slot[0]],
                                               consumer_indptr[slot[0] + 1]) as k:
                                    Tb.evaluate(kernel.runtime_call(
                                        "etc_count_down", pointer(work["pending"]),
                                        consumer_tasks[k], pointer(work["head_tail"]),
                                        pointer(work["ring"]), i32(n), pointer(status)))
                Tb.evaluate(Tb.cuda.cta_sync())
                Tb.add_to_parent(tirx.Bind(task, slot[0]))
                Tb.evaluate(Tb.cuda.cta_sync())  # the slot is rewritten by the next pop
                with Tb.If(task < 0):
                    with Tb.Then():
                        Tb.Break()
                Tb.add_to_parent(dispatch)
    return ib.get()
