"""What every persistent kernel of a task graph has, whatever hands out its tasks.

``PersistentKernel`` holds the kernel's buffers (the graph's tensors, the flat event counters,
the watchdog ``status`` record), its thread scopes and shared-memory arena, and builds

* ``initialise(ctas)``: the prologue: counters from their read-only initial values, status
  cleared, then a grid-wide barrier (the kernel is launched cooperatively);
* ``dispatch(task, skip_waits)``: the if/elif over calls that runs global task ``task``:
  coordinates decoded, waits (thread 0, bounded, then a barrier; the loop is left if the grid
  is stopping), the inlined body, then a barrier and thread 0's notifies.

The static and dynamic kernels differ only in where ``task`` comes from.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tvm import tirx
from tvm.script.ir_builder import tirx as Tb

from ..errors import EtcError, GraphError
from ..task_graph import TaskGraph
from .events import EventLayout, lower_edge
from .grid_kernel import unravel
from .inline import ThreadScopes, i32, inline_task, shared_bytes

STATUS_WORDS = 8
SM_SHARED_BYTES = 227 * 1024  # shared memory one SM gives its CTAs (Hopper)
SM_THREADS = 2048
RUNTIME_SOURCE = Path(__file__).resolve().parents[3] / "src" / "etc_runtime.cuh"


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


def check_compile_time_edges(graph: TaskGraph, kernel: str) -> None:
    """Refuse, by name, the edges and counts only run-time data can instantiate."""
    runtime = sorted(graph.arm_inputs())
    dynamic = [f"{c.name}: {e.etensor} '{e.map}'" for c in graph.calls
               for e in c.in_edges + c.out_edges if e.map.is_data_dependent or e.map.is_trigger]
    if runtime or dynamic:
        raise GraphError(
            f"{graph.name}: the {kernel} kernel needs every edge and wait count at compile time; "
            + (f"data-dependent edges {dynamic}" if dynamic else "")
            + (" and " if runtime and dynamic else "")
            + (f"wait counts known only at run time {runtime}" if runtime else "")
            + " are not supported by it yet")


class PersistentKernel:
    """The buffers, scopes and statement builders shared by the persistent kernels."""

    def __init__(self, graph: TaskGraph, layout: EventLayout, options: KernelOptions):
        threads = {c.fn.num_threads for c in graph.calls}
        if len(threads) != 1:
            raise ValueError(f"the device functions of {graph.name} run different thread "
                             f"counts {sorted(threads)}; one kernel runs one")
        self.graph, self.layout, self.options = graph, layout, options
        self.scopes = ThreadScopes(threads.pop())
        self.tx = self.scopes.tx
        self.source = runtime_source()
        self.buffers = [tirx.decl_buffer(t.shape, t.dtype, t.name) for t in graph.tensors]
        self.inputs = [self.buffers[t.index] for t in graph.tensors if t.param is not None]
        self.outputs = [self.buffers[t.index] for t in graph.tensors if t.producer is not None]
        self.initial = tirx.decl_buffer((layout.size,), "int32", "initial")
        self.counters = tirx.decl_buffer((layout.size,), "int32", "counters")
        self.status = tirx.decl_buffer((STATUS_WORDS,), "int32", "status")
        arena_bytes = max(shared_bytes(c.fn) for c in graph.calls)
        per_sm, threads = options.ctas_per_sm, self.scopes.num_threads
        if per_sm * arena_bytes > SM_SHARED_BYTES or per_sm * threads > SM_THREADS:
            raise EtcError(f"{graph.name}: {per_sm} persistent CTAs per SM of {threads} threads "
                           f"and {arena_bytes} bytes of shared memory each do not fit on one SM "
                           f"({SM_THREADS} threads, {SM_SHARED_BYTES} bytes): lower ctas_per_sm")
        self.arena = tirx.decl_buffer((arena_bytes,), "uint8", "smem", scope="shared.dyn") \
            if arena_bytes else None
        self.stop = tirx.decl_buffer((1,), "int32", "stop", scope="shared")
        self.limit = tirx.IntImm("int64", int(options.timeout_s * 1e9))

    def runtime_call(self, name: str, *args, return_type: str = "void"):
        """A call of a function of the device runtime (src/etc_runtime.cuh)."""
        return Tb.cuda.func_call(name, *args, source_code=self.source, return_type=return_type)

    def declare(self) -> None:
        """Inside the kernel's device entry: scope ids, the stop flag and the arena."""
        for d in self.scopes.defs:
            Tb.add_to_parent(tirx.ScopeIdDefStmt(d))
        Tb.add_to_parent(tirx.AllocBuffer(self.stop))
        if self.arena is not None:
            Tb.add_to_parent(tirx.AllocBuffer(self.arena))

    def initialise(self, bx, num_ctas: int, extra=()) -> None:
        """Counters from their initial values (and each (dst, src, n) of ``extra``), status
        cleared, then a grid-wide barrier: every launch starts from fresh state."""
        stride = num_ctas * self.scopes.num_threads
        for dst, src, n in [(self.counters, self.initial, self.layout.size), *extra]:
            for k in range(-(-n // stride)):
                idx = i32(k * stride) + bx * i32(self.scopes.num_threads) + self.tx
                with Tb.If(idx < i32(n)):
                    with Tb.Then():
                        Tb.buffer_store(dst, src[idx], [idx])
        with Tb.If(tirx.And(bx == 0, self.tx < STATUS_WORDS)):
            with Tb.Then():
                Tb.buffer_store(self.status, i32(0), [self.tx])
        Tb.evaluate(Tb.cuda.grid_sync())

    def dispatch(self, task: tirx.Var, skip_waits: tirx.Expr | None = None) -> tirx.Stmt:
        """Run global task ``task``; ``skip_waits`` (when nonzero) elides its waits."""
        out = None
        for call in reversed(self.graph.calls):
            cond = task < i32(call.first_task + call.num_tasks)
            out = tirx.IfThenElse(cond, self._branch(call, task, skip_waits), out)
        return out

    def _branch(self, call, task, skip_waits) -> tirx.Stmt:
        tx, stop, layout = self.tx, self.stop, self.layout
        coord_vars = [tirx.Var(c, "int32") for c in call.fn.coord_params]
        values = unravel(task - i32(call.first_task), call.grid)
        stmts = [tirx.Bind(v, e) for v, e in zip(coord_vars, values)]
        env = dict(zip(call.fn.coord_params, coord_vars))
        if call.in_edges:
            waits = [tirx.BufferStore(stop, i32(0), [i32(0)])]
            for e in call.in_edges:
                lowered = lower_edge(e.map, env)
                guard, idx = lowered.guard, layout.flat_index(e.etensor, lowered.index)
                wait = self.runtime_call("etc_wait", self.counters.ptr_to([idx]),
                                         self.status.ptr_to([0]), task, idx, self.limit,
                                         return_type="int32")
                step = tirx.IfThenElse(stop[0] == 0, tirx.BufferStore(stop, wait, [i32(0)]),
                                       None)
                waits.append(step if guard is None else tirx.IfThenElse(guard, step, None))
            block = tirx.stmt_seq(tirx.IfThenElse(tx == 0, tirx.stmt_seq(*waits), None),
                                  tirx.Evaluate(Tb.cuda.cta_sync()),
                                  tirx.IfThenElse(stop[0] != 0, tirx.Break(), None))
            stmts.append(block if skip_waits is None
                         else tirx.IfThenElse(skip_waits == 0, block, None))
        args = [self.buffers[t] for t in call.tensor_args()]
        stmts += tirx.stmt_list(inline_task(call.fn, coord_vars, args, self.scopes, self.arena))
        if call.out_edges:
            notifies = []
            for e in call.out_edges:
                lowered = lower_edge(e.map, env)
                guard = lowered.guard
                step = tirx.Evaluate(self.runtime_call("etc_notify", self.counters.ptr_to(
                    [layout.flat_index(e.etensor, lowered.index)])))
                notifies.append(step if guard is None else tirx.IfThenElse(guard, step, None))
            cond = tx == 0
            if self.options.drop_notify is not None:
                cond = tirx.And(cond, task != i32(self.options.drop_notify))
            stmts += [tirx.Evaluate(Tb.cuda.cta_sync()),
                      tirx.IfThenElse(cond, tirx.stmt_seq(*notifies), None)]
        else:  # the next task may reuse the shared memory this one reads
            stmts.append(tirx.Evaluate(Tb.cuda.cta_sync()))
        return tirx.stmt_seq(*stmts)
