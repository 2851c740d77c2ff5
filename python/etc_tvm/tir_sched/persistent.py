"""What every persistent kernel of a task graph has, whatever hands out its tasks.

``PersistentKernel`` holds the kernel's buffers (the graph's tensors, the flat event counters,
the watchdog ``status`` record), its thread scopes and shared-memory arena, and builds

* ``begin``/``initialise``: the kernel's signature and prologue: counters from their read-only
  initial values, status cleared, a grid-wide barrier (the kernel is launched cooperatively),
  then the arming of the ETensors whose run-time counts read only the graph's inputs;
* ``dispatch(task, skip_waits, before_notifies)``: the if/elif over calls that runs global
  task ``task``: coordinates decoded, waits (warp 0, bounded, then a barrier; the loop is
  left if the grid is stopping; a counter of fixed index the CTA saw complete is not polled
  again), the inlined body, then a barrier and thread 0's notifies
  (after ``before_notifies``, whose loads then overlap the notifies' release); a task of a call
  whose completion others wait for counts it down, and the one completing it arms the
  ETensors that completion gates (``events.EventLayout``);
* ``poll(task, calls)``: the same waits, without blocking (the mixed kernel's queue head).

The static, dynamic and mixed kernels differ in where ``task`` comes from; a ready ring
(``dynamic_kernel.ReadyRing``, set as ``ring``) also changes what completing a trigger's
element and arming do: they push the tasks the trigger releases.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import tirx
from tvm.tirx import buffer_data
from tvm.backend.cuda import op as cuda_op
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as Tb

from ..errors import EtcError, GraphError
from ..task_graph import TaskGraph
from .events import EventLayout, LoweredEdge, edge_sites, lower_edge, trigger_scan
from .device_runtime import STATUS_WORDS, runtime_source
from .grid_kernel import in_call, unravel
from .inline import (DECLARATIONS, ThreadScopes, encode_tensor_maps, i32, inline_task,
                     input_check_sites, shared_bytes)

TIMELINE_WORDS = 7  # per task; ETC_TIMELINE_WORDS in src/etc_runtime.cuh
WARP = 32
SM_SHARED_BYTES = 228 * 1024  # shared memory of one SM (Hopper)
CTA_SHARED_BYTES = 227 * 1024  # the most of it one CTA may hold
# What a resident CTA takes of its SM's shared memory besides its arena: 1 KB the hardware
# keeps for each CTA, and the kernel's static shared memory (the scheduler's flags, hooks and
# release marks, the tiles' own words), which must fit the rest
CTA_RESERVED_BYTES = 1024
CTA_SHARED_OVERHEAD = 3 * 1024
GATE_HOOK_BYTES = 512  # of the overhead, what the hooks of ETensors armed at run time may take
SEEN_SLOTS = 32  # counters of fixed index a CTA remembers complete (``PersistentKernel._wait``)
REMEMBERED_SLOTS = 8  # elements a CTA keeps of the tensors trigger maps read (``_scan``)
# A remembered slot not read yet (an element of this value is read each time). Not -2**31:
# TVM 0.27's simplifier folds ``x == -2147483648`` on int32 to False.
UNREAD = -(2**31 - 1)
SM_THREADS = 2048
# A CTA may hold more shared memory than this only where its kernel opts in; TVM's runtime
# opts in only for an arena larger than it, so an arena just below it, with the scheduler's
# static words on top, would leave the kernel no CTA an SM (a cooperative launch "too large")
OPT_IN_SHARED_BYTES = 48 * 1024
READY, SKIPPED = 1, 2  # what ``PersistentKernel.peek`` saw of a task's waits (0: unknown)


def arena_limit(ctas_per_sm: int) -> int:
    """The largest arena (the tasks' dynamic shared memory) with which ``ctas_per_sm``
    persistent CTAs fit on one SM together, as the cooperative launch requires."""
    return min(CTA_SHARED_BYTES, SM_SHARED_BYTES // ctas_per_sm) - CTA_SHARED_OVERHEAD


def kernel_table(values) -> np.ndarray:
    """``values`` as a read-only int32 table argument of a persistent kernel: at least one
    element, for a kernel argument cannot be empty (the kernel declares ``max(1, n)``)."""
    values = np.asarray(values, np.int32)
    return values if values.size else np.zeros(1, np.int32)


WORKSPACE = "workspace"  # the kernel parameter's name
WORKSPACE_ATTR = "etc.workspace_bytes"  # the kernel attribute of its size


class Workspace:
    """One global buffer of a kernel's working tensors: its internal tensors (what a call
    writes and later calls read, the graph function not returning it) and its per-launch
    state, each a view at an aligned offset. The call then allocates one buffer where it
    allocated one per tensor, and each Relax VM allocation costs the host time (about 0.6 us,
    timed on the CPU).

    The parameter's length is a variable the launch binds; ``size`` (an expression of the
    graph's symbolic dims where it has them) is what the call allocates, recorded in the
    kernel's attribute ``WORKSPACE_ATTR``."""

    ALIGN = 256  # bytes: what cudaMalloc promises, so a tile's vector loads stay aligned

    def __init__(self):
        self.param = tirx.decl_buffer((tirx.Var(f"{WORKSPACE}_bytes", "int64"),), "uint8",
                                      WORKSPACE)
        self.size = tirx.IntImm("int64", 0)
        self.views = []

    def carve(self, name: str, shape, dtype: str) -> tirx.Buffer:
        """A fresh ``shape`` x ``dtype`` view of the workspace, after the previous ones."""
        itemsize = tvm.DataType(dtype).bits // 8
        elems = tirx.IntImm("int64", 1)
        for d in shape:
            elems = elems * d
        # named as TVM names a parameter's pointer, so that the CUDA reads alike for both
        view = tirx.decl_buffer(shape, dtype, f"{name}_ptr")
        self.views.append((view, self.size))
        self.size = tirx.floordiv(self.size + elems * itemsize + self.ALIGN - 1,
                                  self.ALIGN) * self.ALIGN
        return view

    def declarations(self) -> list:
        """The views, each bound to its bytes of the parameter (a pointer of its own)."""
        return [tirx.DeclBuffer(v, data=self.param.ptr_to([offset])) for v, offset in self.views]


def returned_tensors(graph: TaskGraph, rank: int | None = None) -> list:
    """The tensors a persistent kernel's call returns, in graph order: those its calls
    produce that the graph function returns, or that a tile loads through a tensor map (the
    host encodes the map from the tensor's own address); for one ``rank`` of several, every
    tensor the rank produces. The others are views of the kernel's ``Workspace``."""
    own = [t for t in graph.tensors if t.producer is not None
           and (rank is None or t.rank == rank)]
    if rank is not None:
        return own
    keep = set(graph.outputs)
    for call in graph.calls:
        by_name = dict(zip((p.name for p in call.fn.buffer_params), call.tensor_args()))
        keep.update(by_name[m.param] for m in call.fn.tensor_maps)
    return [t for t in own if t.index in keep]


def timeline_size(graph: TaskGraph, num_ctas: int) -> int:
    """int64 words of the timeline of ``graph`` run by ``num_ctas`` persistent CTAs
    (KernelOptions.profile): a row per task, then a row per CTA."""
    return (max(1, graph.num_tasks) + num_ctas) * TIMELINE_WORDS


def is_integer(value, least: int) -> bool:
    """Whether ``value`` is an integer (not a bool) of at least ``least``."""
    return not isinstance(value, bool) and isinstance(value, (int, np.integer)) and value >= least


def is_number(value) -> bool:
    """Whether ``value`` is a real number (not a bool)."""
    return not isinstance(value, bool) and isinstance(value, (int, float, np.integer,
                                                              np.floating))


def positive_count(what: str, value) -> int:
    """``value`` (a count of SMs, CTAs, ...) as an int, or an error naming ``what`` where it
    is not a positive integer."""
    if not is_integer(value, least=1):
        raise EtcError(f"{what}={value!r} is not a positive integer")
    return int(value)


@dataclass(frozen=True)
class KernelOptions:
    """timeout_s: how long a wait may spin before the grid stops with an error.
    ctas_per_sm: persistent CTAs per SM; more hide the latency of one task with another's. The
      cooperative launch needs them co-resident: the kernel bounds its registers for them
      (``__launch_bounds__``), and the build refuses shared memory or threads that do not fit.
    drop_notify: a task id whose notifies are left out (a test hook for the watchdog).
    profile: record each task's timeline (start, waits done, end, SM) in an extra output
      (``etc_tvm.profile``); a few stores per task.
    claim: (the static and barrier kernels) no queues fixed at compile time (no scheduler
      runs): a CTA that frees up claims the next task id from one counter, so that tasks
      spread by their real times (the list schedule's rule, without its cost model). Every
      wait is kept; the graph's tasks must wait only on lower ids
      (``TaskGraph.ids_are_topological``)."""

    timeout_s: float = 4.0
    ctas_per_sm: int = 1
    drop_notify: int | None = None
    profile: bool = False
    claim: bool = False

    def __post_init__(self):
        # the kernel counts the limit in int64 nanoseconds
        if not (is_number(self.timeout_s) and 0 < self.timeout_s < 2**63 / 1e9):
            raise EtcError(f"KernelOptions: timeout_s={self.timeout_s!r} is not a positive "
                           "number of seconds (below 9.2e9)")
        positive_count("KernelOptions: ctas_per_sm", self.ctas_per_sm)
        if self.drop_notify is not None and not is_integer(self.drop_notify, least=0):
            raise EtcError(f"KernelOptions: drop_notify={self.drop_notify!r} is not a task id")
        for name in ("profile", "claim"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise EtcError(f"KernelOptions: {name}={getattr(self, name)!r} is not True or "
                               "False")


DEFAULT_OPTIONS = KernelOptions()


def kernel_options(value, where: str) -> KernelOptions:
    """``value``, or an error naming ``where`` if it is not a ``KernelOptions`` (a dict of
    them failed on its first attribute read, far from the call that gave it)."""
    if not isinstance(value, KernelOptions):
        raise EtcError(f"{where}: options={value!r} is not a KernelOptions (e.g. "
                       "KernelOptions(claim=True))")
    return value


def _slot(slots: dict, key, limit: int) -> tirx.IntImm | None:
    """The shared word ``key`` is given in a table of ``limit`` words (``slots``: key ->
    word, in first-asked order), or None once every word is taken."""
    slot = slots.setdefault(key, len(slots))
    return i32(slot) if slot < limit else None


class PersistentKernel:
    """The buffers, scopes and statement builders shared by the persistent kernels."""

    def __init__(self, graph: TaskGraph, layout: EventLayout, options: KernelOptions,
                 num_ctas: int, symbolic: bool = False, rank: int | None = None):
        """``num_ctas``: the persistent CTAs of a launch.

        ``symbolic``: the tensors keep the graph function's symbolic shapes, bound from the
        arguments at each launch; ``graph`` (instantiated for the largest sizes the kernel
        serves) then fixes the tasks, and those outside the arguments' grids are skipped.

        ``rank``: for a graph of world size above 1, the rank whose tasks this kernel runs
        (one kernel per rank). Every rank keeps the whole ``layout`` in its counter array, a
        symmetric allocation: a rank uses its own copies and the shards it owns, and a notify
        of an element another rank owns decrements that rank's copy (``etc_notify_remote``).
        """
        self.rank = _rank(graph, rank)
        self.calls = [c for c in graph.calls if self.rank is None or c.rank == self.rank]
        threads = {c.fn.num_threads for c in self.calls}
        if len(threads) != 1:
            raise ValueError(f"the device functions of {graph.name} run different thread "
                             f"counts {sorted(threads)}; one kernel runs one")
        self.graph, self.layout, self.options = graph, layout, options
        self.num_ctas = num_ctas
        self.scopes = ThreadScopes(threads.pop())
        self.tx = self.scopes.tx
        # whether warp 0 shares a task's waits and polls (else thread 0 takes every element)
        self.warp_waits = self.scopes.num_threads >= WARP
        self.source = runtime_source(ranks=self.rank is not None)
        self.symbolic = symbolic
        # one kernel of several ranks keeps every buffer where build_rank puts it
        self.workspace = Workspace() if self.rank is None else None
        returned = {t.index for t in returned_tensors(graph, self.rank)}

        def buffer(t):
            shape = t.sym_shape if symbolic else t.shape
            if self.workspace is None or t.producer is None or t.index in returned:
                return tirx.decl_buffer(shape, t.dtype, t.name)
            return self.workspace.carve(t.name, shape, t.dtype)

        self.buffers = [buffer(t) for t in graph.tensors]
        map_vars, self.map_encodes = encode_tensor_maps(
            [(c.fn, [self.buffers[t] for t in c.tensor_args()], c.name) for c in self.calls])
        self.map_vars = dict(zip((c.index for c in self.calls), map_vars))
        own = [t for t in graph.tensors if self.rank is None or t.rank == self.rank]
        self.inputs = [self.buffers[t.index] for t in own if t.param is not None]
        self.outputs = [self.buffers[t.index] for t in returned_tensors(graph, self.rank)]
        self.initial = tirx.decl_buffer((layout.size,), "int32", "initial")
        self.counters = self.state_buffer("counters", layout.size)
        self.status = tirx.decl_buffer((STATUS_WORDS,), "int32", "status")
        self.timeline = tirx.decl_buffer((timeline_size(graph, num_ctas),), "int64",
                                         "timeline") if options.profile else None
        # thread 0's entry time, kept until the prologue has cleared the timeline
        self.entered = tirx.decl_buffer((1,), "int64", "entered", scope="local")
        largest = max(self.calls, key=lambda c: shared_bytes(c.fn))
        arena_bytes = shared_bytes(largest.fn)
        if OPT_IN_SHARED_BYTES - CTA_SHARED_OVERHEAD < arena_bytes <= OPT_IN_SHARED_BYTES:
            arena_bytes = OPT_IN_SHARED_BYTES + 16  # so that the runtime opts in
        per_sm, threads = options.ctas_per_sm, self.scopes.num_threads
        if arena_bytes > arena_limit(per_sm) or per_sm * threads > SM_THREADS:
            remedy = "lower ctas_per_sm" if arena_bytes <= arena_limit(1) else (
                f"no CTA holds a task of {largest.fn.name}, the largest: give that tile less "
                f"shared memory")
            raise EtcError(f"{graph.name}: {per_sm} persistent CTAs per SM of {threads} threads "
                           f"and {arena_bytes} bytes of shared memory each do not fit on one SM "
                           f"({SM_THREADS} threads, {SM_SHARED_BYTES} bytes, arenas of at most "
                           f"{arena_limit(per_sm)} bytes): {remedy}")
        self.arena = tirx.decl_buffer((arena_bytes,), "uint8", "smem", scope="shared.dyn") \
            if arena_bytes else None
        self.stop = tirx.decl_buffer((1,), "int32", "stop", scope="shared")
        # the prelude waits' own flag: a task's waits publish in ``stop`` right after them,
        # with no barrier between, while slow threads may still read the prelude's result
        self.prelude_stop = tirx.decl_buffer((1,), "int32", "prelude_stop", scope="shared") \
            if any(graph.prelude_waits(c) for c in self.calls) else None
        # a waiting thread's own stop flag, published to ``stop`` once its waits are done
        self.halt = tirx.decl_buffer((1,), "int32", "halt", scope="local")
        self.skip = tirx.decl_buffer((1,), "int32", "skip", scope="shared")
        # seen[seen_slots[c]] = 1 once this CTA saw counter c complete
        self.seen = tirx.decl_buffer((SEEN_SLOTS,), "int32", "seen", scope="shared")
        self.seen_slots: dict[int, int] = {}
        # remembered[remembered_slots[(tensor, index)]]: an element a trigger map reads
        self.remembered = tirx.decl_buffer((REMEMBERED_SLOTS,), "int32", "remembered",
                                           scope="shared")
        self.remembered_slots: dict[tuple, int] = {}
        self.analyzer = tvm.sym.Analyzer()
        if 4 * (1 + len(layout.gates)) > GATE_HOOK_BYTES:
            raise EtcError(f"{graph.name}: ETensors armed at run time: {len(layout.gates)} "
                           f"({', '.join(layout.gates)}); their hooks take more than the "
                           f"{GATE_HOOK_BYTES} bytes of shared memory CTA_SHARED_OVERHEAD "
                           "keeps for them")
        self.hooks = tirx.decl_buffer((1 + len(layout.gates),), "int32", "hooks", scope="shared")
        self.sites = {(c.index, e): k for k, (c, e) in enumerate(edge_sites(graph))}
        self.checks = {(c.index, n): k for k, (c, n) in enumerate(input_check_sites(graph))}
        self.ring = None  # the ready ring's operations, set by the dynamic kernel
        # whether thread 0 runs an ``etc_fence`` before every task's notifies, which are then
        # relaxed (set by a kernel that places the fence)
        self.fenced_notifies = False
        self.limit = tirx.IntImm("int64", int(options.timeout_s * 1e9))

    def state_buffer(self, name: str, size: int) -> tirx.Buffer:
        """An int32 buffer of per-launch state (the kernel sets it before any task runs): a
        view of the workspace, or with ranks a parameter of its own."""
        if self.workspace is None:
            return tirx.decl_buffer((size,), "int32", name)
        return self.workspace.carve(name, (size,), "int32")

    def returned(self, state=()) -> list:
        """The kernel's parameters after its read-only tables, which its call returns: the
        watchdog record, the timeline when profiling, the workspace, then the calls' returned
        outputs. With ranks: the counters, the watchdog record, ``state`` (buffers of
        ``state_buffer``), the timeline, the outputs."""
        timeline = [] if self.timeline is None else [self.timeline]
        if self.workspace is None:
            return [self.counters, self.status, *state, *timeline, *self.outputs]
        return [self.status, *timeline, self.workspace.param, *self.outputs]

    def runtime_call(self, name: str, *args, return_type="void"):
        """A call of a function of the device runtime (src/etc_runtime.cuh)."""
        return Tb.cuda.func_call(name, *args, source_code=self.source, return_type=return_type)

    def begin(self, name: str, params, shared=(), state=()) -> tirx.Var:
        """Inside ``Tb.prim_func()``: the kernel's name and attributes (a cooperative launch),
        ``params`` in order, its device entry for ``num_ctas`` CTAs, its scopes and the
        ``shared`` buffers, then the prologue (``initialise`` with ``state``); returns ``bx``.
        The kernel's loop over tasks follows, then ``end``."""
        Tb.func_name(name)
        attrs = {"global_symbol": name, "tirx.is_scheduled": True,
                 "tirx.kernel_launch_params": ["tirx.use_cooperative_launch"]}
        if self.workspace is not None:
            attrs[WORKSPACE_ATTR] = tirx.max(self.workspace.size, 1)  # never an empty argument
        Tb.func_attr(attrs)
        for b in params:
            Tb.arg(b.name, b)
        for cond, message in self.launch_requirements():  # host: before the sizes are used
            with Tb.Assert(cond, message, "ValueError"):
                pass
        for stmt in self.map_encodes:  # host: the tensor maps of the tiles' TMA loads
            Tb.add_to_parent(stmt)
        Tb.device_entry()
        bx = IRBuilder.name("bx", Tb.cta_id([self.num_ctas]))
        self.declare()
        for buf in shared:
            Tb.add_to_parent(tirx.AllocBuffer(buf))
        if self.timeline is not None:
            Tb.add_to_parent(tirx.AllocBuffer(self.entered))
            with Tb.If(self.tx == 0):
                with Tb.Then():
                    Tb.buffer_store(self.entered, self.runtime_call(
                        "etc_trace_now", return_type="int64"), [0])
        self.initialise(bx, state)
        if self.timeline is not None:
            with Tb.If(self.tx == 0):
                with Tb.Then():
                    Tb.evaluate(self.runtime_call("etc_trace_cta_ready", self._cta_row(bx),
                                                  self.entered[0]))
        return bx

    def launch_requirements(self) -> list:
        """On symbolic shapes: (condition, message) of each tile requirement (``device_func``'s
        ``requires``) that only the launch's sizes decide, which the host asserts, so that a
        size the graph was not instantiated for stops the call with the tile's message rather
        than running a grid that misses rows. Fixed sizes were checked at instantiation."""
        if not self.symbolic:
            return []
        return [check for call in self.calls for check in call.fn.check_requires(
            [self.buffers[t].shape for t in call.tensor_args()],
            f"{self.graph.name}: call {call.name}")]

    def end(self, bx) -> None:
        """After the kernel's loop over tasks: thread 0 stamps the CTA's leaving (profiling
        only)."""
        if self.timeline is not None:
            with Tb.If(self.tx == 0):
                with Tb.Then():
                    Tb.evaluate(self.runtime_call("etc_trace_cta_left", self._cta_row(bx)))

    def _cta_row(self, bx) -> tirx.Expr:
        """The timeline row of CTA ``bx``, after the task rows."""
        first = max(1, self.graph.num_tasks)
        return self.timeline.ptr_to([(i32(first) + bx) * i32(TIMELINE_WORDS)])

    def declare(self) -> None:
        """Inside the kernel's device entry: scope ids, the shared flags (stop, skip, hooks)
        and the arena."""
        for d in self.scopes.defs:
            Tb.add_to_parent(tirx.ScopeIdDefStmt(d))
        # __launch_bounds__(threads, ctas_per_sm): ptxas keeps the registers within what
        # ctas_per_sm CTAs may share, where left alone it may take more than the cooperative
        # launch can then place
        Tb.add_to_parent(tirx.AttrStmt(0, "tirx.launch_bounds_min_blocks_per_sm",
                                       i32(self.options.ctas_per_sm), tirx.Evaluate(0)))
        if self.workspace is not None:
            for stmt in self.workspace.declarations():
                Tb.add_to_parent(stmt)
        for buf in (self.stop, self.prelude_stop, self.skip, self.hooks, self.seen,
                    self.remembered, self.halt):
            if buf is not None:
                Tb.add_to_parent(tirx.AllocBuffer(buf))
        if self.arena is not None:
            Tb.add_to_parent(tirx.AllocBuffer(self.arena))

    def initialise(self, bx, extra=()) -> None:
        """Counters from their initial values (and each (dst, src, n) of ``extra``: src a
        buffer, a function of the index, or None for zeros), status cleared, then a grid-wide
        barrier: every launch starts from fresh state."""
        stride = self.num_ctas * self.scopes.num_threads
        fills = [(self.counters, self.initial, self.layout.size), *extra]
        if self.timeline is not None:
            fills.append((self.timeline, None, int(self.timeline.shape[0])))
        for dst, src, n in fills:
            for k in range(-(-n // stride)):
                idx = i32(k * stride) + bx * i32(self.scopes.num_threads) + self.tx
                with Tb.If(idx < i32(n)):
                    with Tb.Then():
                        value = tirx.IntImm(dst.dtype, 0) if src is None else src[idx] \
                            if isinstance(src, tirx.Var) else src(idx)
                        Tb.buffer_store(dst, value, [idx])
        with Tb.If(tirx.And(bx == 0, self.tx < STATUS_WORDS)):
            with Tb.Then():
                Tb.buffer_store(self.status, i32(0), [self.tx])
        Tb.add_to_parent(self.strided(SEEN_SLOTS, lambda i: tirx.BufferStore(
            self.seen, i32(0), [i])))
        Tb.add_to_parent(self.strided(REMEMBERED_SLOTS, lambda i: tirx.BufferStore(
            self.remembered, i32(UNREAD), [i])))
        if self.ring is not None:
            Tb.add_to_parent(self.ring.clear_runs())
        Tb.evaluate(Tb.cuda.grid_sync())
        if self.rank is not None:
            with Tb.If(tirx.And(bx == 0, self.tx == 0)):
                with Tb.Then():
                    Tb.evaluate(cuda_op.nvshmem_barrier_all())
            Tb.evaluate(Tb.cuda.grid_sync())
        arm = self.arm_at_launch(bx)
        if arm is not None:
            Tb.add_to_parent(arm)

    def dispatch(self, task: tirx.Var, skip_waits: tirx.Expr | None = None,
                 before_notifies: tirx.Stmt | None = None,
                 after_waits: tirx.Stmt | None = None,
                 static_done: tirx.Expr | None = None) -> tirx.Stmt:
        """Run global task ``task``; ``skip_waits`` (when nonzero) elides its waits;
        ``static_done`` (when nonzero: ``peek``'s ``READY`` or ``SKIPPED``) elides its waits,
        and for ``SKIPPED`` its body, as a trigger that releases nothing would;
        ``after_waits`` runs once they are done (or skipped), before the body (a statement,
        or a function of whether the waits' closing barrier ran, a boolean expression);
        ``before_notifies`` (a statement, or a function that makes a fresh one for each
        call's branch) runs after the body's closing barrier, before the notifies."""
        out = None
        for call in reversed([c for c in self.calls if c.num_tasks]):
            cond = task < i32(call.first_task + call.num_tasks)
            out = tirx.IfThenElse(cond, self._branch(call, task, skip_waits, before_notifies,
                                                     after_waits, static_done), out)
        return out

    # ------------------------------------------------------------------ one task
    def _branch(self, call, task, skip_waits, before_notifies=None, after_waits=None,
                static_done=None) -> tirx.Stmt:
        coord_vars = [tirx.Var(c, "int32") for c in call.fn.coord_params]
        values = unravel(task - i32(call.first_task), call.grid)
        stmts = [tirx.Bind(v, e) for v, e in zip(coord_vars, values)]
        inside = self.inside(call, coord_vars)
        stmts.append(self._trace("etc_trace_start", task))
        run_waits = None if skip_waits is None else skip_waits == 0
        if static_done is not None:
            run_waits = _both(run_waits, static_done == 0)
        run_waits = _both(run_waits, inside)
        args, peers = self._task_buffers(call, coord_vars)
        prelude, body = inline_task(
            call.fn, coord_vars, args, self.scopes, self.arena, rank=self.rank or 0,
            world_size=self.graph.world_size, maps=self.map_vars[call.index],
            check=lambda value, size, k: self.runtime_call(
                "etc_input_check", value, size, self.status.ptr_to([0]), task,
                i32(self.checks[(call.index, k)]), return_type="int32"))
        if prelude is None:
            body = tirx.stmt_seq(*peers, *tirx.stmt_list(body))
        else:  # the prelude before the waits, once the tensors it reads are complete
            stmts.append(self._guarded(self._prelude_waits(call, task), run_waits))
            stmts += [s if isinstance(s, DECLARATIONS) else self._guarded(s, inside)
                      for s in [*peers, *prelude]]
        waits = self._waits(call, task, coord_vars)
        stmts.append(self._guarded(waits, run_waits))
        if callable(after_waits):
            synced = tirx.IntImm("bool", waits is not None)
            after_waits = after_waits(synced if waits is None or run_waits is None
                                      else run_waits)
        stmts.append(after_waits)
        stmts.append(self._trace("etc_trace_waited", task))
        released = None
        if self._scans(call):
            skip = tirx.Var("skip", "int32")
            stmts.append(tirx.Bind(skip, self._uniform(self.skip[0])))
            released = skip == 0
            if static_done is not None:  # a peek that saw the trigger decided it
                released = tirx.Select(static_done != 0, static_done == i32(READY), released)
        run_body = _both(released, inside)
        stmts.append(self._guarded(body, run_body))
        if prelude is not None:  # copies the prelude issued for a body that did not run
            stmts.append(tirx.Evaluate(Tb.ptx.cp.async_.wait_all()))
        # the notifies follow every thread's writes; without any, the next task may reuse the
        # shared memory this one reads
        stmts.append(tirx.Evaluate(Tb.cuda.cta_sync()))
        stmts.append(self._trace("etc_trace_body_done", task))
        stmts.append(before_notifies() if callable(before_notifies) else before_notifies)
        notifies = self._notifies(call, task, coord_vars, released)
        if notifies is not None:
            cond = self.tx == 0
            if self.options.drop_notify is not None:
                cond = tirx.And(cond, task != i32(self.options.drop_notify))
            stmts.append(tirx.IfThenElse(cond, notifies, None))
        # the runs the notifies deferred go out before the completion's round trips (an
        # element that needs no arming fires at its last notify), then those the arming
        # deferred
        if self.ring is not None and self.ring.unpublished:
            stmts.append(self.ring.publish())
        if call.index in self.layout.done:
            stmts.append(self._completion(call))
        if self.ring is not None and self.ring.unpublished:
            stmts.append(self.ring.publish())
        stmts.append(self._trace("etc_trace_end", task))
        return tirx.stmt_seq(*[s for s in stmts if s is not None])

    @staticmethod
    def _guarded(stmt: tirx.Stmt | None, cond: tirx.Expr | None) -> tirx.Stmt | None:
        return stmt if stmt is None or cond is None else tirx.IfThenElse(cond, stmt, None)

    def _task_buffers(self, call, coords) -> tuple[list, list]:
        """The tensors a task of ``call`` runs on, and the statements that bind them: on
        several ranks a symmetric output is the copy of the rank the task notifies, reached
        by plain stores over NVLink (``etc_peer``)."""
        args, binds = [], []
        for t in call.tensor_args():
            buf = self.buffers[t]
            if self.rank is not None and t in call.outputs and self.graph.tensors[t].symmetric:
                pointer = buffer_data(buf).ty
                data = tirx.Var(f"{buf.name}_peer", pointer)
                binds.append(tirx.Bind(data, self.runtime_call(
                    "etc_peer", buffer_data(buf), self._data_owner(call, coords),
                    return_type=pointer)))
                buf = tirx.decl_buffer(buf.shape, buf.dtype, f"{buf.name}_peer", data=data)
                binds.append(tirx.DeclBuffer(buf, data=data))
            args.append(buf)
        return args, binds

    def _data_owner(self, call, coords) -> tirx.Expr:
        """The rank a task of ``call`` writes its symmetric outputs on: the owner of the one
        element of a sharded ETensor that the task notifies."""
        sharded = [e for e in call.out_edges
                   if self.graph.etensors[e.etensor].shard_dim is not None]
        lowered = [lower_edge(e.map, dict(zip(e.map.coords, coords))) for e in sharded]
        if len(sharded) != 1 or lowered[0].loops or lowered[0].guard is not None:
            raise EtcError(f"{call.name} writes a symmetric tensor: it must notify exactly one "
                           "element of one sharded ETensor (whose owner receives the data); "
                           f"its out-edges are {[f'{e.etensor}: {e.map}' for e in call.out_edges]}")
        return self.owner(sharded[0], lowered[0].index)

    def _trace(self, name: str, task) -> tirx.Stmt | None:
        """Thread 0 stamps ``task``'s timeline row (profiling only)."""
        if self.timeline is None:
            return None
        row = self.timeline.ptr_to([task * i32(TIMELINE_WORDS)])
        return tirx.IfThenElse(self.tx == 0, tirx.Evaluate(self.runtime_call(name, row)), None)

    def _waits(self, call, task, coords) -> tirx.Stmt | None:
        """Warp 0 waits on: the elements of static in-edges and the completion of the calls
        whose tensors the in-edge maps read; then (after a warp barrier: the maps below read
        those tensors) the elements that release the task through a trigger map (none: the
        task is skipped) and data-dependent elements. The lanes share the points of a map
        (``LoweredEdge.nest_strided``), so that a task waiting on K elements polls them at
        once, not one round trip after another. Then a barrier, and the CTA leaves its loop
        if the grid is stopping."""
        steps = self._wait_steps(call, task, coords, self._wait,
                                 self.tx if self.warp_waits else None)
        return None if steps is None else self._by_warp0(steps)

    def _prelude_waits(self, call, task) -> tirx.Stmt | None:
        """``_waits`` for a prelude: the completions of the calls whose tensors it reads,
        one lane of warp 0 each (the waits after the prelude find them seen)."""
        flats = [i32(self.layout.done[p]) for p in sorted(self.graph.prelude_waits(call))]
        if not flats:
            return None
        return self._by_warp0(tirx.stmt_seq(
            tirx.BufferStore(self.halt, i32(0), [i32(0)]),
            *[tirx.IfThenElse(self.tx == i32(k % WARP), self._wait(flat, task), None)
              if self.warp_waits else self._wait(flat, task) for k, flat in enumerate(flats)]),
            self.prelude_stop)

    def _by_warp0(self, steps: tirx.Stmt, flag: tirx.Buffer | None = None) -> tirx.Stmt:
        """``steps`` (waits that set ``halt``) by warp 0 (thread 0 in a CTA of fewer
        threads), which publishes in ``flag`` (``stop`` unless given) whether one failed;
        then a barrier, and the CTA leaves its loop if the grid is stopping."""
        flag = self.stop if flag is None else flag
        publish = tirx.BufferStore(flag, self.halt[0], [i32(0)])
        if self.warp_waits:
            publish = tirx.stmt_seq(self._halt_any(),
                                    tirx.IfThenElse(self.tx == 0, publish, None))
        return tirx.stmt_seq(tirx.IfThenElse(self.tx < i32(WARP if self.warp_waits else 1),
                                             tirx.stmt_seq(steps, publish), None),
                             tirx.Evaluate(Tb.cuda.cta_sync()),
                             tirx.IfThenElse(flag[0] != 0, tirx.Break(), None))

    def _wait_steps(self, call, task, coords, wait, lane=None) -> tirx.Stmt | None:
        """``halt[0] = 0``, then ``wait(counter index, task)`` on each element: by one
        thread in turn, or, given ``lane`` (the thread's lane in warp 0), shared out over the
        warp's lanes (``spread``). A wait that fails sets the thread's ``halt``."""
        singles = itertools.count()

        def one_lane(stmt):
            """A wait on one element: the next lane in turn takes it."""
            return stmt if lane is None else tirx.IfThenElse(
                lane == i32(next(singles) % WARP), stmt, None)

        def spread(lowered: LoweredEdge, body) -> tirx.Stmt:
            if lane is None or not lowered.loops:
                return one_lane(lowered.nest(body))
            return lowered.nest_strided(body, lane, WARP)

        steps = [one_lane(wait(flat, task)) if lowered is None
                 else spread(lowered, wait(flat, task))
                 for lowered, flat in self._known_waits(call, coords)]
        # the maps below read tensors only once their producers are complete
        reading = []
        if self._scans(call):
            reading.append(one_lane(tirx.stmt_seq(
                tirx.BufferStore(self.skip, i32(1), [i32(0)]),
                *[self._trigger_scan(call, e, task, coords, wait) for e in call.triggers])))
        for e in call.in_edges:
            if e.map.is_data_dependent and not e.map.is_trigger:
                lowered = lower_edge(e.map, dict(zip(e.map.coords, coords)), self.params(call))
                reading.append(spread(lowered, self.checked(
                    call, e, task, lowered.index, lambda flat: wait(flat, task))))
        if not steps and not reading:
            return None
        out = [tirx.BufferStore(self.halt, i32(0), [i32(0)]), *steps]
        if reading:
            if lane is not None:  # what one lane waited for, the others read: a warp barrier
                out += [_warp_sync(), self._halt_any()]
            out.append(tirx.IfThenElse(self.halt[0] == 0, tirx.stmt_seq(*reading), None))
        return tirx.stmt_seq(*out)

    def _uniform(self, value: tirx.PrimExpr) -> tirx.PrimExpr:
        """``value``, an int32 every thread reads alike (a shared word written before a
        barrier), as a warp-uniform value (``etc_uniform``) where the CTA is whole warps. A
        branch on a plain shared read is divergent code to ptxas: the task body it guards lost
        the uniform datapath (the 4096-token layer's down tiles: 176 instructions a K step
        against 132, the wgmma descriptors rebuilt in vector registers)."""
        if self.scopes.num_threads % WARP:
            return value
        return self.runtime_call("etc_uniform", value, return_type="int32")

    def _halt_any(self) -> tirx.Stmt:
        """Every lane of warp 0: ``halt`` = whether any lane's wait failed."""
        return tirx.BufferStore(self.halt, Tb.cuda.any_sync(
            tirx.const(0xFFFFFFFF, "uint32"), self.halt[0]), [i32(0)])

    def _known_waits(self, call, coords) -> list:
        """(the lowered edge, or None for a call's completion; the flat counter index, in the
        edge's loop variables) of each element a task of ``call`` at ``coords`` waits on
        whatever the data: its static in-edges' elements and the completions of the calls
        whose tensors its maps read."""
        out = []
        for e in call.in_edges:
            if not (e.map.is_data_dependent or e.map.is_trigger):
                lowered = lower_edge(e.map, dict(zip(e.map.coords, coords)))
                out.append((lowered, self.layout.flat_index(
                    e.etensor, self.global_index(e, lowered.index))))
        return out + [(None, i32(self.layout.done[p]))
                      for p in sorted(self.graph.completion_waits(call))]

    def peek(self, task: tirx.Expr, looked: tirx.Buffer) -> tirx.Stmt:
        """One thread: ``looked[0]`` = ``READY`` if every wait of ``task`` (any task, or -1 for
        none) looks satisfied now, ``SKIPPED`` if besides its trigger releases nothing, else 0
        (or where a wait cannot be looked at: a data-dependent in-edge, a trigger map whose
        tensors this CTA has not yet seen complete). The counters are read with relaxed loads
        that all leave before any is looked at; an ``etc_fence`` after them makes the look an
        acquire, so that the task may then skip its waits (``dispatch``'s ``static_done``)."""
        out = self._by_call(task, [c for c in self.calls if c.num_tasks], "ahead",
                            lambda call, coords: self._peek_call(call, coords, looked))
        return tirx.stmt_seq(tirx.BufferStore(looked, i32(READY), [i32(1)]),
                             tirx.BufferStore(looked, i32(READY), [i32(0)]),
                             *([] if out is None else [out]),
                             tirx.BufferStore(looked, looked[0] * looked[1], [i32(0)]))

    def _peek_call(self, call, coords, looked) -> tirx.Stmt | None:
        """``peek`` for a task of ``call`` at ``coords``: clears ``looked[0]`` where a wait is
        not done or cannot be looked at; ``looked[1]`` becomes ``SKIPPED`` where a trigger
        releases nothing. None where the task waits for nothing."""
        def look(flat):
            read = self.runtime_call("etc_peek_complete", self.counters.ptr_to([flat]),
                                     return_type="int32")
            return self._unless_seen(flat, tirx.BufferStore(looked, looked[0] & read, [i32(0)]))

        never = tirx.BufferStore(looked, i32(0), [i32(0)])
        if any(e.map.is_data_dependent and not e.map.is_trigger for e in call.in_edges):
            return never
        looks, completions = [], []
        for lowered, flat in self._known_waits(call, coords):
            if lowered is None:
                completions.append(flat)
            else:
                looks.append(lowered.nest(look(flat)))
        if not self._scans(call):  # counters alone: any task's are in range
            looks += [look(flat) for flat in completions]
            return tirx.stmt_seq(*looks) if looks else None
        # the trigger maps read tensors: only once this CTA has acquired their completion
        slots = [self._seen_slot(flat) for flat in completions]
        if any(slot is None for slot in slots):
            return never
        seen = None
        for slot in slots:
            seen = _both(seen, self.seen[slot] != 0)
        scans = [tirx.BufferStore(looked, i32(SKIPPED), [i32(1)])]
        for e in call.triggers:
            scans.append(self._scan(call, e, coords, lambda elem, e=e: tirx.stmt_seq(
                tirx.BufferStore(looked, i32(READY), [i32(1)]),
                look(self.layout.flat_index(e.etensor, elem)))))
        body = tirx.stmt_seq(*looks, *scans)
        body = body if seen is None else tirx.IfThenElse(seen, body, never)
        inside = self.inside(call, coords)  # a task outside the launch's grids reads nothing
        return body if inside is None else tirx.IfThenElse(inside, body, never)

    def poll(self, task: tirx.Var, calls, warp: bool = False) -> tirx.Stmt:
        """Without blocking: ``halt[0]`` = 0 if every wait of ``task`` (a task of one of
        ``calls``) is satisfied now, else nonzero. By thread 0, or with ``warp`` by the lanes
        of warp 0 together (each then holds the answer), the elements of a map dealt out to
        them as ``_waits`` deals them: one round of loads, where one thread's polls of a
        data-dependent map went one after another (a combine task of 2 tokens, 16 pairs)."""
        clear = tirx.BufferStore(self.halt, i32(0), [i32(0)])
        lane = self.tx if warp else None

        def poll_call(call, coords):
            polls = self._wait_steps(call, task, coords, self._poll, lane)
            inside = self.inside(call, coords)
            if polls is None or inside is None:
                return polls
            # a task outside the launch's grids waits for nothing
            return tirx.IfThenElse(inside, polls, clear)

        out = self._by_call(task, [self.graph.calls[c] for c in sorted(calls)], "poll",
                            poll_call, otherwise=clear)
        return out if lane is None else tirx.stmt_seq(out, self._halt_any())

    @staticmethod
    def _by_call(task, calls, suffix: str, branch, otherwise=None) -> tirx.Stmt | None:
        """An if-chain over ``calls`` by the range of ids ``task`` (any task) falls in:
        ``branch(call, coords)``, with the coordinates (``{name}_{suffix}``) bound from
        ``task``, for the calls whose branch is not None; ``otherwise`` for any other."""
        out = otherwise
        for call in reversed(calls):
            coords = [tirx.Var(f"{c}_{suffix}", "int32") for c in call.fn.coord_params]
            body = branch(call, coords)
            if body is None:
                continue
            body = tirx.stmt_seq(*[tirx.Bind(v, x) for v, x in zip(
                coords, unravel(task - i32(call.first_task), call.grid))], body)
            out = tirx.IfThenElse(in_call(call, task), body, out)
        return out

    def _poll(self, flat: tirx.Expr, task) -> tirx.Stmt:
        ready = self.runtime_call("etc_poll", self.counters.ptr_to([flat]), return_type="int32")
        return tirx.IfThenElse(self.halt[0] == 0,
                               tirx.BufferStore(self.halt, i32(1) - ready, [i32(0)]), None)

    def _wait(self, flat: tirx.Expr, task) -> tirx.Stmt:
        """A bounded wait on counter ``flat``. A counter of fixed index (a barrier between
        calls, a call's completion, a one-element ETensor) is polled until this CTA has seen
        it complete, and no more: a complete counter stays complete for the launch, and an
        acquire the CTA already made orders its later tasks too, where each poll of it costs
        a round trip to L2 (0.5 us and more a task, with several such waits)."""
        name = "etc_wait" if self.rank is None else "etc_wait_sys"
        wait = tirx.BufferStore(self.halt, self.runtime_call(
            name, self.counters.ptr_to([flat]), self.status.ptr_to([0]), task, flat, self.limit,
            return_type="int32"), [i32(0)])
        slot = self._seen_slot(flat)
        if slot is None:
            return tirx.IfThenElse(self.halt[0] == 0, wait, None)
        return tirx.IfThenElse(
            tirx.And(self.halt[0] == 0, self.seen[slot] == 0),
            tirx.stmt_seq(wait, tirx.BufferStore(self.seen, i32(1) - self.halt[0], [slot])),
            None)

    def _unless_seen(self, flat: tirx.Expr, read: tirx.Stmt) -> tirx.Stmt:
        """``read`` (a look at counter ``flat``) unless this CTA has seen that counter
        complete (``_wait``): the look would find it complete, a round trip to L2 later."""
        slot = self._seen_slot(flat)
        return read if slot is None else tirx.IfThenElse(self.seen[slot] == 0, read, None)

    def _seen_slot(self, flat: tirx.Expr) -> tirx.IntImm | None:
        """The ``seen`` word of counter ``flat`` if its index is fixed and a word is left."""
        flat = self.analyzer.simplify(flat)
        if not isinstance(flat, tirx.IntImm):
            return None
        return _slot(self.seen_slots, flat.value, SEEN_SLOTS)

    def checked(self, call, edge, task, index, then, shape=None) -> tirx.Stmt:
        """``then(flat counter index)`` if every coordinate of ``index`` lies inside the
        edge's ETensor (or, given ``shape``, ``then(index)`` if inside ``shape``); otherwise
        the stop is recorded (kind 4) and the CTA stops."""
        site = self.sites[(call.index, edge)]
        ok = None
        for i, n in zip(index, shape or self.layout.shapes[edge.etensor]):
            check = self.runtime_call("etc_in_range", i, i32(n), self.status.ptr_to([0]), task,
                                      i32(site), return_type="int32") != 0
            ok = check if ok is None else tirx.And(ok, check)
        body = then(index) if shape else then(self.layout.flat_index(edge.etensor, index))
        return tirx.IfThenElse(ok, body, tirx.BufferStore(self.halt, i32(1), [i32(0)]))

    def _trigger_scan(self, call, edge, task, coords, wait) -> tirx.Stmt:
        """Find the elements whose trigger map releases this task: each clears ``skip`` and
        is waited on."""
        return self._scan(call, edge, coords, lambda elem: tirx.stmt_seq(
            tirx.BufferStore(self.skip, i32(0), [i32(0)]),
            wait(self.layout.flat_index(edge.etensor, elem), task)))

    def _scan(self, call, edge, coords, hit) -> tirx.Stmt:
        """``trigger_scan`` of trigger ``edge`` for the task of ``call`` at ``coords``, which
        runs once the CTA has seen the tensors the map reads complete: the int32 elements it
        reads at a fixed index come from ``remembered``, read from global memory once a CTA,
        not once a task (every acquire the CTA makes empties its L1, so each scan's read,
        such as the MoE triggers' ``exp_indptr[E]``, would be another round trip to L2)."""
        fills = {}

        def read(buf, index):
            slot = self._remembered_slot(buf, index)
            if slot is None:
                return tirx.BufferLoad(buf, index)
            fills[slot.value] = tirx.IfThenElse(
                self.remembered[slot] == i32(UNREAD),
                tirx.BufferStore(self.remembered, tirx.BufferLoad(buf, index), [slot]), None)
            return self.remembered[slot]

        scan = trigger_scan(edge.map, self.layout.shapes[edge.etensor], coords,
                            self.params(call), hit, read)
        return tirx.stmt_seq(*fills.values(), scan)

    def _remembered_slot(self, buf: tirx.Buffer, index) -> tirx.IntImm | None:
        """The ``remembered`` word of element ``index`` of ``buf`` if it is an int32 element
        of fixed index inside the buffer and a word is left."""
        index = [self.analyzer.simplify(i) for i in index]
        if buf.dtype != "int32" or not all(
                isinstance(i, tirx.IntImm) and 0 <= i.value
                and self.analyzer.can_prove(i < tirx.Cast("int32", n))
                for i, n in zip(index, buf.shape)):
            return None
        tensor = next(t for t, b in enumerate(self.buffers) if b.same_as(buf))
        return _slot(self.remembered_slots, (tensor, *(i.value for i in index)),
                     REMEMBERED_SLOTS)

    def _scans(self, call) -> bool:
        """Whether ``call``'s tasks find their releasing elements themselves and wait on them:
        in the static kernel, and in a ring that pushes them once the element's notifiers are
        dispatched (``DispatchRelease``); a ring otherwise pushes them when the element
        completes."""
        return bool(call.triggers) and (
            self.ring is None or call.index not in self.ring.calls
            or all(e.etensor in self.ring.releases for e in call.triggers))

    def _notifies(self, call, task, coords, released=None) -> tirx.Stmt | None:
        """Thread 0's decrements: static out-edges always (a skipped task's too, so that
        fan-ins over whole grids complete), data-dependent ones where ``released`` (the
        trigger's verdict; None: always)."""
        steps = [self.static_notifies(call, coords, defer=True)]
        for e in call.out_edges:
            if e.map.is_data_dependent:
                lowered = lower_edge(e.map, dict(zip(e.map.coords, coords)), self.params(call))
                step = lowered.nest(self.checked(
                    call, e, task, lowered.index,
                    lambda flat, e=e: self._notify(e, flat, defer=True)))
                run = _both(released, self.inside(call, coords))
                steps.append(step if run is None else tirx.IfThenElse(run, step, None))
        steps = [s for s in steps if s is not None]
        return tirx.stmt_seq(*steps) if steps else None

    def static_notifies(self, call, coords, defer: bool = False) -> tirx.Stmt | None:
        """The decrements of ``call``'s static out-edges for the task at ``coords``;
        ``defer``: by the thread 0 of a CTA that then publishes (``ReadyRing.publish``)."""
        steps = []
        for e in call.out_edges:
            if not e.map.is_data_dependent:
                lowered = lower_edge(e.map, dict(zip(e.map.coords, coords)))
                owner = self.owner(e, lowered.index)
                flat = self.layout.flat_index(e.etensor, lowered.index)
                remote = None if owner is None else tirx.Evaluate(self.runtime_call(
                    "etc_notify_remote", self.counters.ptr_to([flat]), owner))
                steps.append(lowered.nest(self._notify(e, flat, defer) if remote is None
                                          else remote))
        return tirx.stmt_seq(*steps) if steps else None

    def _notify(self, edge, flat, defer: bool = False) -> tirx.Stmt:
        """One decrement; on an element whose completion a ready ring acts on, the decrement
        that completes it fires it."""
        counter = self.counters.ptr_to([flat])
        if (self.ring is None or edge.etensor not in self.ring.trigger_sources
                or edge.etensor in self.ring.releases):
            return tirx.Evaluate(self.runtime_call(
                "etc_notify_fenced" if self.fenced_notifies else "etc_notify", counter))
        last = self.runtime_call("etc_notify_last", counter, return_type="int32")
        shape = self.layout.shapes[edge.etensor]
        return tirx.IfThenElse(last != 0, self.ring.fire(
            edge.etensor, unravel(flat - i32(self.layout.offsets[edge.etensor]), shape),
            defer), None)

    # ------------------------------------------------------------------ run-time events
    def _completion(self, call) -> tirx.Stmt:
        """Thread 0 counts the call's completion down; the task that completes it counts down
        the gates the call opens, and the CTA arms each ETensor whose gate it opened: every
        ETensor's counts and unbias (``_arm_counts``: the first pushes) before any ETensor's
        marks (``_arm_marks``), then marks the tasks released by the ETensors this completion
        makes readable without a gate (``EventLayout.marks``). A call of one task completes
        with it: its count-down is a notify, with no round trip to learn what it knows."""
        counter = self.counters.ptr_to([i32(self.layout.done[call.index])])
        opened = [(k, name, at, calls)
                  for k, (name, (at, calls)) in enumerate(self.layout.gates.items())
                  if call.index in calls]
        marks = [m for m in (self._arm_marks(name) for name, producer in self.layout.marks.items()
                             if producer == call.index) if m is not None]
        if call.num_tasks == 1:
            completed = None  # always
            steps = [tirx.Evaluate(self.runtime_call(
                "etc_notify_fenced" if self.fenced_notifies else "etc_notify", counter))]
        else:
            completed = self.hooks[0] != 0
            steps = [tirx.BufferStore(self.hooks, self.runtime_call(
                "etc_complete", counter, return_type="int32"), [i32(0)])]
        opens = {}  # gate k -> whether this task opened it (None: it did)
        for k, _, at, calls in opened:
            if calls == (call.index,):  # this call's completion alone arms it
                opens[k] = completed
                continue
            gate = tirx.BufferStore(self.hooks, self.runtime_call(
                "etc_complete", self.counters.ptr_to([i32(at)]), return_type="int32"),
                [i32(k + 1)])
            steps.append(gate if completed is None else tirx.IfThenElse(
                completed, gate, tirx.BufferStore(self.hooks, i32(0), [i32(k + 1)])))
            opens[k] = self.hooks[k + 1] != 0
        out = [tirx.IfThenElse(self.tx == 0, tirx.stmt_seq(*steps), None)]
        if opened or marks:
            out.append(tirx.Evaluate(Tb.cuda.cta_sync()))
        for part in (self._arm_counts, self._arm_marks):  # every first push before any mark
            for k, name, _, _ in opened:
                out.append(self._guarded(part(name), opens[k]))
        out += [self._guarded(m, completed) for m in marks]
        return tirx.stmt_seq(*[s for s in out if s is not None])

    def _arm_counts(self, name: str) -> tirx.Stmt:
        """All threads of one CTA add ETensor ``name``'s run-time counts to its counters (from
        its count tensor, or one per data-dependent notify its notifiers will make), then,
        after a fence and a barrier (where there were counts), remove the bias: its elements
        can now complete, and those already complete push their tasks."""
        et, layout = self.graph.etensors[name], self.layout
        offset, size = layout.offsets[name], int(np.prod(et.shape, dtype=np.int64))
        status = self.status.ptr_to([0])
        steps = []
        if et.count_tensor is not None:
            counts = self.buffers[et.count_tensor]
            if tuple(int(d) for d in counts.shape) != tuple(et.shape):
                raise GraphError(f"{self.graph.name}: the wait_count tensor of {name} has shape "
                                 f"{[int(d) for d in counts.shape]}, {name} {list(et.shape)}")
            value = tirx.Var("count", "int32")
            steps.append(self.strided(size, lambda i: tirx.stmt_seq(
                tirx.Bind(value, tirx.Cast("int32", counts[tuple(unravel(i, et.shape))])),
                tirx.IfThenElse(
                    value < 0,
                    tirx.Evaluate(self.runtime_call("etc_record_stop", status, i32(5), i32(-1),
                                                    i32(offset) + i, value)),
                    tirx.Evaluate(self.runtime_call("etc_add", self.counters.ptr_to(
                        [i32(offset) + i]), value))))))
        else:
            steps += [self._count_notifies(call, e) for call in self.graph.calls
                      for e in call.out_edges
                      if e.etensor == name and e.map.is_data_dependent]
        if steps:  # every count lands before the bias lifts
            steps += [tirx.Evaluate(Tb.cuda.thread_fence()), tirx.Evaluate(Tb.cuda.cta_sync())]
        steps.append(self.strided(size, lambda i: self._unbias(name, i32(offset) + i)))
        if self.ring is not None and self.ring.unpublished:
            steps.append(self.ring.publish())
        return tirx.stmt_seq(*steps)

    def _arm_marks(self, name: str) -> tirx.Stmt | None:
        """All threads of one CTA, after ``_arm_counts(name)``: mark the tasks the trigger
        maps on ``name`` release and skip the others (``ReadyRing``); None without such maps.
        Off the way to the first push."""
        triggered = [] if self.ring is None else [
            c for c in self.graph.calls
            if c.index in self.ring.triggered and any(e.etensor == name for e in c.triggers)]
        if not triggered:
            return None
        # only this CTA's skip pass reads the marks: a barrier orders them
        return tirx.stmt_seq(*[self.ring.mark_released(c) for c in triggered],
                             tirx.Evaluate(Tb.cuda.cta_sync()),
                             *[self.ring.skip_unreleased(c) for c in triggered])

    def _unbias(self, name: str, flat) -> tirx.Stmt:
        left = self.runtime_call("etc_unbias", self.counters.ptr_to([flat]), return_type="int32")
        if self.ring is not None and name in self.ring.releases:
            return tirx.stmt_seq(tirx.Evaluate(left), self.ring.count_down_release(
                name, flat - i32(self.layout.offsets[name]), defer=True))
        if self.ring is None or name not in self.ring.trigger_sources:
            return tirx.Evaluate(left)
        return tirx.IfThenElse(left == 0, self.ring.fire(
            name, unravel(flat - i32(self.layout.offsets[name]), self.layout.shapes[name]),
            defer=True), None)

    def _count_notifies(self, call, edge) -> tirx.Stmt:
        """All threads: +1 on every element that ``edge`` will make a task of ``call``
        notify, for all its tasks."""
        if call.triggers:
            raise GraphError(
                f"{self.graph.name}: the wait counts of {edge.etensor} are inferred from the "
                f"notifies of {call.name}, whose tasks a trigger releases: give {edge.etensor} "
                "a wait_count tensor")
        coords = [tirx.Var(f"{c}_arm", "int32") for c in call.fn.coord_params]
        lowered = lower_edge(edge.map, dict(zip(edge.map.coords, coords)), self.params(call))
        count = lowered.nest(self.checked(call, edge, i32(-1), lowered.index, lambda flat: (
            tirx.Evaluate(self.runtime_call("etc_add", self.counters.ptr_to([flat]), i32(1))))))
        inside = self.inside(call, coords)
        if inside is not None:
            count = tirx.IfThenElse(inside, count, None)
        return self.strided(call.num_tasks, lambda j: tirx.stmt_seq(
            *[tirx.Bind(v, x) for v, x in zip(coords, unravel(j, call.grid))], count))

    def global_index(self, edge, index) -> tuple:
        """An in-edge's element in the ETensor's global coordinates: a wait through
        ``local_view()`` names the element of this rank's shard."""
        if not edge.local or self.rank is None:
            return index
        et = self.graph.etensors[edge.etensor]
        k, n = et.shard_dim, et.local_shape[et.shard_dim]
        return tuple(i + i32(self.rank * n) if d == k else i for d, i in enumerate(index))

    def owner(self, edge, index) -> tirx.Expr | None:
        """The rank that owns an out-edge's element of a sharded ETensor (None: this rank's
        own copy, or a kernel of one rank)."""
        et = self.graph.etensors[edge.etensor]
        if self.rank is None or et.shard_dim is None:
            return None
        return tirx.floordiv(index[et.shard_dim], i32(et.local_shape[et.shard_dim]))

    def inside(self, call, coords) -> tirx.Expr | None:
        """Whether the task at ``coords`` lies in the call's grid for the launch's sizes
        (None: always, the kernel being built for the sizes it runs)."""
        if not self.symbolic:
            return None
        cond = None
        for c, n, full in zip(coords, call.sym_grid, call.grid):
            if isinstance(n, tirx.IntImm) and int(n) == full:
                continue
            cond = _both(cond, c < tirx.Cast("int32", n))
        return cond

    def strided_grid(self, bx, n: int, body) -> tirx.Stmt:
        """``body(i)`` for i in 0..n-1, spread over every thread of the grid."""
        stride = self.num_ctas * self.scopes.num_threads
        r = tirx.Var("r", "int32")
        i = r * i32(stride) + bx * i32(self.scopes.num_threads) + self.tx
        return tirx.For(r, i32(0), i32(-(-n // stride)), tirx.ForKind.SERIAL,
                        tirx.IfThenElse(i < i32(n), body(i), None))

    def strided(self, n: int | tirx.Expr, body, first: int = 0) -> tirx.Stmt:
        """``body(i)`` for i in 0..n-1, spread over the CTA's threads from ``first`` on."""
        threads = self.scopes.num_threads - first
        n = n if isinstance(n, tirx.Expr) else i32(n)
        r = tirx.Var("r", "int32")
        i = r * i32(threads) + (self.tx - i32(first) if first else self.tx)
        loop = tirx.For(r, i32(0), tirx.floordiv(n + i32(threads - 1), i32(threads)),
                        tirx.ForKind.SERIAL, tirx.IfThenElse(i < n, body(i), None))
        return loop if first == 0 else tirx.IfThenElse(self.tx >= i32(first), loop, None)

    def arm_at_launch(self, bx) -> tirx.Stmt | None:
        """CTA 0 arms, after the grid-wide barrier, the ETensors no call's completion gates."""
        ready = [name for name, (_, calls) in self.layout.gates.items() if not calls]
        if not ready:
            return None
        counts = [self._arm_counts(n) for n in ready]
        marks = [m for m in (self._arm_marks(n) for n in ready) if m is not None]
        return tirx.IfThenElse(bx == 0, tirx.stmt_seq(*counts, *marks), None)

    def params(self, call) -> dict:
        """The call's device-function parameter names -> the kernel's buffers."""
        return {p.name: self.buffers[t] for p, t in zip(call.fn.buffer_params, call.tensor_args())}


def _rank(graph: TaskGraph, rank: int | None) -> int | None:
    """``rank``, checked against the graph: a kernel of several ranks runs one of them, and
    only the static events are lowered for it so far."""
    if graph.world_size == 1:
        if rank not in (None, 0):
            raise EtcError(f"{graph.name} runs on one rank; rank {rank} does not exist")
        return None
    if rank is None or not 0 <= rank < graph.world_size:
        raise EtcError(f"{graph.name} runs on {graph.world_size} ranks: build one kernel per "
                       f"rank (rank = 0 .. {graph.world_size - 1}), not rank {rank}")
    runtime = [n for n, et in graph.etensors.items() if et.count_tensor is not None]
    runtime += [c.name for c in graph.calls if any(
        e.map.is_data_dependent or e.map.is_trigger for e in c.in_edges + c.out_edges)]
    if runtime or graph.gates():
        raise NotImplementedError(
            f"{graph.name}: run-time counts, data-dependent and trigger edges are not lowered "
            f"for world size above 1 yet ({sorted(set(runtime))})")
    return rank


def _warp_sync() -> tirx.Stmt:
    return tirx.Evaluate(Tb.cuda.warp_sync())


def _both(a, b):
    """``a and b`` of two optional conditions (None: true)."""
    if a is None:
        return b
    return a if b is None else tirx.And(a, b)
