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

Kernel parameters, in order (the DPS order of ``R.call_tir``): the graph's input tensors,
``indptr`` int32[num_ctas + 1], ``tasks`` int32[num_tasks] and ``initial`` int32[n] (the
counts every launch starts from, never written), then the outputs ``counters`` int32[n] and
``status`` int32[STATUS_WORDS] (fresh every launch, initialised by the kernel itself before a
grid-wide barrier: no separate launch) and every call's output tensors. ``status`` is the
watchdog record of ``src/etc_runtime.cuh``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as Tb

from ..errors import EtcError, GraphError
from ..schedule import LOCAL_WAITS, StaticSchedule
from ..task_graph import TaskGraph
from .events import EventLayout, lower_edge
from .grid_kernel import unravel
from .inline import ThreadScopes, i32, inline_task, shared_bytes

STATUS_WORDS = 8
SM_SHARED_BYTES = 227 * 1024  # shared memory one SM gives its CTAs (Hopper)
SM_THREADS = 2048
RUNTIME_SOURCE = Path(__file__).resolve().parents[3] / "src" / "etc_runtime.cuh"


def _check_static(graph: TaskGraph) -> None:
    """This kernel knows every edge and count at compile time; refuse the rest by name."""
    runtime = sorted(graph.arm_inputs())
    dynamic = [f"{c.name}: {e.etensor} '{e.map}'" for c in graph.calls
               for e in c.in_edges + c.out_edges if e.map.is_data_dependent or e.map.is_trigger]
    if runtime or dynamic:
        raise GraphError(
            f"{graph.name}: the static kernel needs every edge and wait count at compile time; "
            + (f"data-dependent edges {dynamic}" if dynamic else "")
            + (" and " if runtime and dynamic else "")
            + (f"wait counts known only at run time {runtime}" if runtime else "")
            + " are not supported by it yet")


def runtime_source() -> str:
    if not RUNTIME_SOURCE.exists():
        raise FileNotFoundError(f"the etc_tvm device runtime {RUNTIME_SOURCE} is missing: "
                                "install etc_tvm from its source tree (pip install -e .)")
    return RUNTIME_SOURCE.read_text()


@dataclass(frozen=True)
class KernelOptions:
    """timeout_s: how long a wait may spin before the grid stops with an error.
    ctas_per_sm: persistent CTAs per SM; more hide the latency of one task with another's (the
      kernel's registers and shared memory must let them be co-resident, or the cooperative
      launch fails).
    drop_notify: a task id whose notifies are left out (a test hook for the watchdog)."""

    timeout_s: float = 4.0
    ctas_per_sm: int = 1
    drop_notify: int | None = None


DEFAULT_OPTIONS = KernelOptions()


def build_static_kernel(graph: TaskGraph, schedule: StaticSchedule, layout: EventLayout,
                        name: str, options: KernelOptions = DEFAULT_OPTIONS) -> tirx.PrimFunc:
    """The persistent kernel that runs ``schedule`` (per-SM queues) of ``graph``."""
    _check_static(graph)
    threads = {c.fn.num_threads for c in graph.calls}
    if len(threads) != 1:
        raise ValueError(f"the device functions of {graph.name} run different thread counts "
                         f"{sorted(threads)}; one kernel runs one")
    scopes = ThreadScopes(threads.pop())
    tx = scopes.tx
    source = runtime_source()

    buffers = [tirx.decl_buffer(t.shape, t.dtype, t.name) for t in graph.tensors]
    inputs = [buffers[t.index] for t in graph.tensors if t.param is not None]
    outputs = [buffers[t.index] for t in graph.tensors if t.producer is not None]
    indptr = tirx.decl_buffer((schedule.num_ctas + 1,), "int32", "indptr")
    tasks = tirx.decl_buffer((max(1, graph.num_tasks),), "int32", "tasks")
    initial = tirx.decl_buffer((layout.size,), "int32", "initial")
    counters = tirx.decl_buffer((layout.size,), "int32", "counters")
    status = tirx.decl_buffer((STATUS_WORDS,), "int32", "status")
    arena_bytes = max(shared_bytes(c.fn) for c in graph.calls)
    per_sm = options.ctas_per_sm
    if per_sm * arena_bytes > SM_SHARED_BYTES or per_sm * scopes.num_threads > SM_THREADS:
        raise EtcError(f"{graph.name}: {per_sm} persistent CTAs per SM of {scopes.num_threads} "
                       f"threads and {arena_bytes} bytes of shared memory each do not fit on one "
                       f"SM ({SM_THREADS} threads, {SM_SHARED_BYTES} bytes): lower ctas_per_sm")
    arena = tirx.decl_buffer((arena_bytes,), "uint8", "smem", scope="shared.dyn") \
        if arena_bytes else None
    stop = tirx.decl_buffer((1,), "int32", "stop", scope="shared")
    task = tirx.Var("t", "int32")
    local = tirx.Var("local_waits", "int32")
    limit = tirx.IntImm("int64", int(options.timeout_s * 1e9))

    def wait(idx):
        return Tb.cuda.func_call("etc_wait", counters.ptr_to([idx]), status.ptr_to([0]), task,
                                 idx, limit, source_code=source, return_type="int32")

    def notify(idx):
        return tirx.Evaluate(Tb.cuda.func_call("etc_notify", counters.ptr_to([idx]),
                                               source_code=source))

    def branch(call):
        coord_vars = [tirx.Var(c, "int32") for c in call.fn.coord_params]
        values = unravel(task - i32(call.first_task), call.grid)
        stmts = [tirx.Bind(v, e) for v, e in zip(coord_vars, values)]
        env = dict(zip(call.fn.coord_params, coord_vars))
        if call.in_edges:
            waits = [tirx.BufferStore(stop, i32(0), [i32(0)])]
            for e in call.in_edges:
                index, guard = lower_edge(e.map, env)
                idx = layout.flat_index(e.etensor, index)
                step = tirx.IfThenElse(stop[0] == 0,
                                       tirx.BufferStore(stop, wait(idx), [i32(0)]), None)
                waits.append(step if guard is None else tirx.IfThenElse(guard, step, None))
            stmts.append(tirx.IfThenElse(local == 0, tirx.stmt_seq(
                tirx.IfThenElse(tx == 0, tirx.stmt_seq(*waits), None),
                tirx.Evaluate(Tb.cuda.cta_sync()),
                tirx.IfThenElse(stop[0] != 0, tirx.Break(), None)), None))
        args = [buffers[t] for t in call.tensor_args()]
        stmts += tirx.stmt_list(inline_task(call.fn, coord_vars, args, scopes, arena))
        if call.out_edges:
            notifies = []
            for e in call.out_edges:
                index, guard = lower_edge(e.map, env)
                step = notify(layout.flat_index(e.etensor, index))
                notifies.append(step if guard is None else tirx.IfThenElse(guard, step, None))
            cond = tx == 0
            if options.drop_notify is not None:
                cond = tirx.And(cond, task != i32(options.drop_notify))
            stmts += [tirx.Evaluate(Tb.cuda.cta_sync()),
                      tirx.IfThenElse(cond, tirx.stmt_seq(*notifies), None)]
        else:  # the next task may reuse the shared memory this one reads
            stmts.append(tirx.Evaluate(Tb.cuda.cta_sync()))
        return tirx.stmt_seq(*stmts)

    dispatch = None
    for call in reversed(graph.calls):
        cond = task < i32(call.first_task + call.num_tasks)
        dispatch = tirx.IfThenElse(cond, branch(call), dispatch)

    with IRBuilder() as ib:
        with Tb.prim_func():
            Tb.func_name(name)
            Tb.func_attr({"global_symbol": name, "tirx.is_scheduled": True,
                          "tirx.kernel_launch_params": ["tirx.use_cooperative_launch"]})
            for b in [*inputs, indptr, tasks, initial, counters, status, *outputs]:
                Tb.arg(b.name, b)
            Tb.device_entry()
            bx = IRBuilder.name("bx", Tb.cta_id([schedule.num_ctas]))
            for d in scopes.defs:
                Tb.add_to_parent(tirx.ScopeIdDefStmt(d))
            Tb.add_to_parent(tirx.AllocBuffer(stop))
            if arena is not None:
                Tb.add_to_parent(tirx.AllocBuffer(arena))
            stride = schedule.num_ctas * scopes.num_threads
            for k in range(-(-layout.size // stride)):
                idx = i32(k * stride) + bx * i32(scopes.num_threads) + tx
                with Tb.If(idx < i32(layout.size)):
                    with Tb.Then():
                        Tb.buffer_store(counters, initial[idx], [idx])
            with Tb.If(tirx.And(bx == 0, tx < STATUS_WORDS)):
                with Tb.Then():
                    Tb.buffer_store(status, i32(0), [tx])
            Tb.evaluate(Tb.cuda.grid_sync())
            pos = IRBuilder.name("pos", Tb.alloc_local((1,), "int32"))
            Tb.buffer_store(pos, indptr[bx], [0])
            with Tb.While(pos[0] < indptr[bx + 1]):
                Tb.add_to_parent(tirx.Bind(task, tasks[pos[0]] & i32(LOCAL_WAITS - 1)))
                Tb.add_to_parent(tirx.Bind(local, tasks[pos[0]] >> i32(30)))
                Tb.add_to_parent(dispatch)
                Tb.buffer_store(pos, pos[0] + 1, [0])
    return ib.get()
