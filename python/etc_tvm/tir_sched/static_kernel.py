"""The persistent kernel of a static schedule.

    grid = one CTA per queue, ctas_per_sm per SM (cooperative launch: all co-resident, or the
           launch fails)
    CTA b:  counters[its slice] = initial[its slice]; status = 0 (CTA 0); grid-wide barrier
            for pos in indptr[b] .. indptr[b+1]-1:
                t = tasks[pos] & ~LOCAL_WAITS        # a global task id, read by every thread
                if t < first[1]:   call 0, coords = unravel(t - first[0], grid[0])
                elif t < first[2]: call 1, ...
                    wait:   thread 0 waits on each element of the in_edges (etc_wait, bounded);
                            barrier; all threads leave the loop if the grid is stopping
                            (skipped when tasks[pos] has LOCAL_WAITS: this CTA ran them)
                    body:   the device function, inlined
                    notify: barrier; thread 0 decrements each element of the out_edges

With ``KernelOptions.claim`` the loop takes no queues: thread 0 claims the next task id from a
counter (``build_claiming_kernel``).

Kernel parameters, in order (the DPS order of ``R.call_tir``): the graph's input tensors,
``indptr`` int32[num_ctas + 1], ``tasks`` int32[num_tasks] and ``initial`` int32[n] (the
counts every launch starts from, never written), then the outputs ``counters`` int32[n] and
``status`` int32[STATUS_WORDS] (fresh every launch, initialised by the kernel itself before a
grid-wide barrier: no separate launch) and every call's output tensors. ``status`` is the
watchdog record of ``src/etc_runtime.cuh``.

A graph of several ranks gets one kernel per rank, with the same parameters (that rank's
tensors). ``counters`` must then be a symmetric allocation (``nvshmem_malloc``) holding every
rank's layout, and after its own grid-wide barrier each rank waits for the others to
initialise theirs (``nvshmem_barrier_all``) before any notify may cross.
"""
from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as Tb

from ..errors import EtcError
from ..schedule import LOCAL_WAITS, StaticSchedule
from ..task_graph import TaskGraph
from .events import EventLayout
from .inline import i32
from .persistent import DEFAULT_OPTIONS, KernelOptions, PersistentKernel


def build_static_kernel(graph: TaskGraph, schedule: StaticSchedule, layout: EventLayout,
                        name: str, options: KernelOptions = DEFAULT_OPTIONS,
                        symbolic: bool = False, rank: int | None = None) -> tirx.PrimFunc:
    """The persistent kernel that runs ``schedule`` (per-CTA queues) of ``graph``; with
    ``symbolic``, on tensors of any sizes up to ``graph``'s (``PersistentKernel``). For a
    graph of several ranks, rank ``rank``'s kernel: ``schedule`` holds that rank's tasks
    (``StaticSchedule.for_rank``)."""
    if options.claim:
        raise NotImplementedError(f"{graph.name}: KernelOptions.claim needs no queues "
                                  "(build_claiming_kernel, one rank)")
    kernel = PersistentKernel(graph, layout, options, schedule.num_ctas, symbolic, rank)
    indptr = tirx.decl_buffer((schedule.num_ctas + 1,), "int32", "indptr")
    tasks = tirx.decl_buffer((max(1, graph.num_tasks),), "int32", "tasks")
    task = tirx.Var("t", "int32")
    local = tirx.Var("local_waits", "int32")
    dispatch = kernel.dispatch(task, skip_waits=local)

    with IRBuilder() as ib:
        with Tb.prim_func():
            bx = kernel.begin(name, [*kernel.inputs, indptr, tasks, kernel.initial,
                                     *kernel.returned()])
            pos = IRBuilder.name("pos", Tb.alloc_local((1,), "int32"))
            Tb.buffer_store(pos, indptr[bx], [0])
            with Tb.While(pos[0] < indptr[bx + 1]):
                Tb.add_to_parent(tirx.Bind(task, tasks[pos[0]] & i32(LOCAL_WAITS - 1)))
                Tb.add_to_parent(tirx.Bind(local, tasks[pos[0]] >> i32(30)))
                Tb.add_to_parent(dispatch)
                Tb.buffer_store(pos, pos[0] + 1, [0])
            kernel.end(bx)
    return ib.get()


def build_claiming_kernel(graph: TaskGraph, num_ctas: int, layout: EventLayout, name: str,
                          options: KernelOptions = DEFAULT_OPTIONS,
                          symbolic: bool = False) -> tirx.PrimFunc:
    """The persistent kernel of ``num_ctas`` CTAs that claim the tasks of ``graph`` (one
    rank) in id order (``KernelOptions.claim``); ``symbolic`` as ``build_static_kernel``.

    CTA b runs task b first, with no claim, as the dynamic kernel's CTAs hold their first
    ring slots: the first tasks start without an atomic round trip, and without every CTA's
    atomic queued on one word. Thread 0 claims its CTA's next task, from id ``num_ctas`` on,
    once the current task's waits are done, so that the claim's round trip overlaps the
    body; before the notifies it peeks at what that next task waits on
    (``PersistentKernel.peek``, through its trigger maps too), and the fence that makes the
    notifies releases makes the peek an acquire: a next task whose producers are done starts
    without a wait, or is skipped at once where its trigger releases nothing. A CTA holds a
    claimed task only while it runs one whose waits are done, and every task waits only on
    tasks of lower ids, so the lowest unfinished task is always running or about to:
    claiming cannot deadlock.

    Parameters: the graph's inputs, ``initial``, then what the call returns (the claim
    counter, from ``num_ctas`` at each launch, is state of the workspace)."""
    if not graph.ids_are_topological():
        raise EtcError(f"{graph.name}: a task waits on a task of a higher id (an edge within a "
                       "call that points forward in its grid): its CTAs cannot claim the "
                       "tasks in id order; build it without KernelOptions.claim")
    kernel = PersistentKernel(graph, layout, options, num_ctas, symbolic)
    kernel.fenced_notifies = True
    counter = kernel.state_buffer("claim", 1)
    head = tirx.decl_buffer((2,), "int32", "head", scope="shared")  # next task, its peek
    claimed = tirx.decl_buffer((1,), "int32", "claimed", scope="local")
    looked = tirx.decl_buffer((2,), "int32", "looked", scope="local")  # the next task's peek
    task, ready = tirx.Var("t", "int32"), tirx.Var("ready", "int32")
    first = kernel.tx == 0

    def thread0(*stmts):
        return tirx.IfThenElse(first, tirx.stmt_seq(*stmts), None)

    claim = tirx.BufferStore(claimed, kernel.runtime_call(
        "etc_claim", counter.ptr_to([0]), return_type="int32"), [i32(0)])
    upcoming = tirx.if_then_else(claimed[0] < i32(graph.num_tasks), claimed[0], i32(-1))
    following = tirx.decl_buffer((1,), "int32", "following", scope="local")  # upcoming's value
    dispatch = kernel.dispatch(
        task, static_done=ready, after_waits=thread0(claim),
        before_notifies=lambda: thread0(tirx.BufferStore(following, upcoming, [i32(0)]),
                                        kernel.peek(following[0], looked),
                                        tirx.Evaluate(kernel.runtime_call("etc_fence"))))

    with IRBuilder() as ib:
        with Tb.prim_func():
            bx = kernel.begin(name, [*kernel.inputs, kernel.initial, *kernel.returned()],
                              shared=(head, claimed, following, looked),
                              state=[(counter, lambda _: i32(num_ctas), 1)])
            Tb.add_to_parent(thread0(tirx.BufferStore(claimed, bx, [i32(0)]),
                                     tirx.BufferStore(head, upcoming, [i32(0)]),
                                     tirx.BufferStore(head, i32(0), [i32(1)])))
            Tb.evaluate(Tb.cuda.cta_sync())
            with Tb.While(head[0] >= i32(0)):
                Tb.add_to_parent(tirx.Bind(task, head[0]))
                Tb.add_to_parent(tirx.Bind(ready, head[1]))
                Tb.add_to_parent(dispatch)
                Tb.add_to_parent(thread0(tirx.BufferStore(head, following[0], [i32(0)]),
                                         tirx.BufferStore(head, looked[0], [i32(1)])))
                Tb.evaluate(Tb.cuda.cta_sync())
            kernel.end(bx)
    return ib.get()
