"""The persistent kernel of a mixed schedule: static queues and a ready ring in one kernel.

Calls marked ``schedule="dynamic"`` go through the ready ring of ``dynamic_kernel``; the others
are list-scheduled into per-CTA queues as in ``static_kernel``. A CTA never blocks on one side
while the other has work for it:

    CTA:  loop:
              thread 0: take the ring task the last round held, if any; else
              warp 0:   poll the head of its queue (its waits, not awaited), the elements
                        of a map shared out over the lanes
              thread 0: if the head of its queue is ready (as polled): take it
                        else: take a task from the ring if one is there now (never waits for
                              a push); -1 once the ring is exhausted and the queue empty;
                        nothing taken for longer than the limit stops the grid with an error
                        naming the CTA's next queued task
              barrier; broadcast; leave the loop on -1 (done) or -2 (stopping)
              all threads: count down the consumers of the task taken (static or not: both
                        release ring tasks), holding the first one made ready
              run the task; a queued task's waits were polled already, and a ring task held
                        from its only producer has none to run: this CTA did all it waits on

Progress: a ring task is pushed only once the tasks it waits on have been taken, and a taken
task runs to its end; the queues follow a topological order. The earliest unfinished task is
therefore either at the head of its queue with its waits satisfied, or in the ring, and a CTA
that polls it finds it.

Kernel parameters, in order: the graph's inputs; ``indptr``, ``tasks`` (the static queues, as
in ``static_kernel``), ``initial`` and the ring's read-only tables (as in ``dynamic_kernel``);
then ``counters``, ``status``, the ring's working state and every call's output tensors.
"""
from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as Tb

from ..schedule import LOCAL_WAITS, DynamicPlan, StaticSchedule
from ..task_graph import TaskGraph
from .dynamic_kernel import ReadyRing, pointer
from .events import EventLayout
from .inline import i32
from .persistent import DEFAULT_OPTIONS, WARP, KernelOptions, PersistentKernel

NONE_NOW = -3  # etc_try_pop: no task in the ring at the moment


def build_mixed_kernel(graph: TaskGraph, schedule: StaticSchedule, plan: DynamicPlan,
                       ring_calls: set[int], layout: EventLayout, name: str,
                       options: KernelOptions = DEFAULT_OPTIONS,
                       symbolic: bool = False) -> tirx.PrimFunc:
    """The kernel running the tasks of ``ring_calls`` from a ready ring (``plan``) and the
    others from ``schedule``'s queues (which hold none of the ring's tasks); ``symbolic``: on
    tensors of any sizes up to ``graph``'s."""
    kernel = PersistentKernel(graph, layout, options, schedule.num_ctas, symbolic)
    ring = ReadyRing(kernel, plan, ring_calls)
    static_calls = {c.index for c in graph.calls} - set(ring_calls)
    num_queued = sum(len(q) for q in schedule.queues)
    indptr = tirx.decl_buffer((schedule.num_ctas + 1,), "int32", "indptr")
    tasks = tirx.decl_buffer((max(1, num_queued),), "int32", "tasks")
    taken = tirx.decl_buffer((2,), "int32", "taken", scope="shared")  # task, from the queue
    # 1: the task taken is a ring task held from its only producer, run here last round
    done_here = tirx.decl_buffer((1,), "int32", "done_here", scope="shared")
    # the queue's head that warp 0 polls this round, -1 for none
    polled = tirx.decl_buffer((1,), "int32", "polled", scope="shared")
    warp = kernel.warp_waits
    task, queued = tirx.Var("t", "int32"), tirx.Var("queued", "int32")
    here = tirx.Var("here", "int32")
    head, polled_task = tirx.Var("head", "int32"), tirx.Var("polled_task", "int32")
    # a queued task's waits were polled; a held one's were done by this CTA
    dispatch = kernel.dispatch(task, skip_waits=tirx.bitwise_or(queued, here))
    tx, status = kernel.tx, kernel.status

    with IRBuilder() as ib:
        with Tb.prim_func():
            bx = kernel.begin(name, [*kernel.inputs, indptr, tasks, kernel.initial,
                                     *ring.inputs, *kernel.returned(ring.outputs)],
                              shared=(taken, done_here, *([polled] if warp else []),
                                      *ring.shared),
                              state=ring.initialisation())
            launch = ring.launch(bx)
            if launch is not None:
                Tb.add_to_parent(launch)
            pos = IRBuilder.name("pos", Tb.alloc_local((1,), "int32"))
            since = IRBuilder.name("idle_since", Tb.alloc_local((1,), "uint64"))
            claimed = IRBuilder.name("claimed", Tb.alloc_local((1,), "int32"))
            Tb.buffer_store(pos, indptr[bx], [0])
            Tb.buffer_store(since, tirx.IntImm("uint64", 0), [0])
            Tb.buffer_store(claimed, i32(-1), [0])
            with Tb.If(tx == 0):
                with Tb.Then():
                    Tb.buffer_store(ring.held, i32(-1), [0])
            end = indptr[bx + 1]
            at = tasks[tirx.min(pos[0], i32(max(0, num_queued - 1)))]
            with Tb.While(tirx.IntImm("bool", 1)):
                if warp:  # the head's polls shared out over warp 0, unless a task is held
                    with Tb.If(tx < i32(WARP)):
                        with Tb.Then():
                            with Tb.If(tx == 0):
                                with Tb.Then():
                                    Tb.add_to_parent(ring.take_held(taken, done_here=done_here))
                                    Tb.buffer_store(polled, tirx.Select(tirx.And(
                                        taken[0] < 0, tirx.And(pos[0] < end,
                                                               at >> i32(30) == 0)),
                                        at & i32(LOCAL_WAITS - 1), i32(-1)), [0])
                            Tb.evaluate(Tb.cuda.warp_sync())
                            Tb.add_to_parent(tirx.Bind(polled_task, polled[0]))
                            with Tb.If(polled_task >= 0):
                                with Tb.Then():
                                    Tb.add_to_parent(kernel.poll(polled_task, static_calls,
                                                                 warp=True))
                with Tb.If(tx == 0):
                    with Tb.Then():
                        if not warp:
                            Tb.add_to_parent(ring.take_held(taken, done_here=done_here))
                        Tb.buffer_store(taken, i32(0), [1])
                        with Tb.If(taken[0] < 0):
                            with Tb.Then():
                                Tb.buffer_store(taken, i32(NONE_NOW), [0])
                        Tb.add_to_parent(tirx.Bind(head, tirx.Select(
                            pos[0] < end, at & i32(LOCAL_WAITS - 1), i32(-1))))
                        with Tb.If(tirx.And(head >= 0, taken[0] == i32(NONE_NOW))):
                            with Tb.Then():
                                with Tb.If(tasks[pos[0]] >> i32(30) != 0):
                                    with Tb.Then():
                                        Tb.buffer_store(kernel.stop, i32(0), [0])
                                    with Tb.Else():
                                        if not warp:
                                            Tb.add_to_parent(kernel.poll(head, static_calls))
                                        Tb.buffer_store(kernel.stop, kernel.halt[0], [0])
                                with Tb.If(kernel.stop[0] == 0):
                                    with Tb.Then():
                                        Tb.buffer_store(taken, head, [0])
                                        Tb.buffer_store(taken, i32(1), [1])
                        with Tb.If(taken[0] == i32(NONE_NOW)):
                            with Tb.Then():
                                popped = kernel.runtime_call(
                                    "etc_try_pop", pointer(ring.head_tail), pointer(ring.ring),
                                    claimed.ptr_to([0]), return_type="int32")
                                Tb.buffer_store(taken, popped, [0])
                                with Tb.If(tirx.And(taken[0] == -1, head >= 0)):
                                    with Tb.Then():  # the ring is done, the queue is not
                                        Tb.buffer_store(taken, i32(NONE_NOW), [0])
                        with Tb.If(taken[0] >= 0):
                            with Tb.Then():
                                Tb.buffer_store(since, tirx.IntImm("uint64", 0), [0])
                                Tb.buffer_store(kernel.stop, i32(0), [0])
                        with Tb.If(taken[0] == i32(NONE_NOW)):
                            with Tb.Then():
                                with Tb.If(kernel.runtime_call(
                                        "etc_idle", since.ptr_to([0]), pointer(status), head,
                                        kernel.limit, return_type="int32") != 0):
                                    with Tb.Then():
                                        Tb.buffer_store(taken, i32(-2), [0])
                Tb.evaluate(Tb.cuda.cta_sync())
                Tb.add_to_parent(tirx.Bind(task, taken[0]))
                Tb.add_to_parent(tirx.Bind(queued, taken[1]))
                Tb.add_to_parent(tirx.Bind(here, done_here[0]))
                Tb.evaluate(Tb.cuda.cta_sync())  # ``taken`` is rewritten next round
                with Tb.If(tirx.And(task < 0, task != i32(NONE_NOW))):
                    with Tb.Then():
                        Tb.Break()
                with Tb.If(task >= 0):
                    with Tb.Then():
                        Tb.buffer_store(pos, pos[0] + queued, [0])
                        Tb.add_to_parent(ring.count_down_consumers(task, dispatch=True))
                        Tb.evaluate(Tb.cuda.cta_sync())  # ``held`` is read at the next round
                        Tb.add_to_parent(dispatch)
            kernel.end(bx)
    return ib.get()
