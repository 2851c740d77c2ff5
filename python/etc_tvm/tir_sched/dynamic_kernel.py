"""The persistent kernel of a dynamic schedule: CTAs pop tasks from a ready ring in memory.

    grid = ctas CTAs (cooperative launch)
    prologue: counters, pending counts, ring (seeds then -1), head/tail/expected and the
              release marks from their initial values, the head past slots 0..ctas-1 (CTA
              bx holds slot bx for its first take); status cleared; grid-wide barrier
    CTA:  loop:
              unless the last round chained t (below), which needs no take and no barrier:
              thread 0: t = the task held by the last round, else the task the last round
                        read from the slot it claimed, else that slot's (or a slot claimed
                        now's) task: etc_take (-1: every task taken, -2: stopping)
              barrier; t broadcast through shared memory; leave the loop if t < 0
              warps 1.. (all threads in a CTA of one warp), while warp 0 waits on t's
                        events: for each consumer c of t: etc_count_down(pending[c])
                        (early push: c enters the ring once its last producer is
                        dispatched; it still waits on its events before its body; the first
                        consumer, made ready so, is held for this CTA's next round instead)
                        one warp: for each late call L waiting for t's call: count L down
                        (the last dispatch pushes all of L's tasks, its lanes side by side)
              every thread, where t is its first consumer's only producer: chain that
                        consumer (no count-down; its id and consumer tables in registers),
                        the next round running it without waits: this CTA did all it waits
                        on
              thread 0, unless t's dispatch made a task to hold or chain: claim the next
                        slot (etc_claim), so that the claim's round trip overlaps task t: at
                        once for a task without consumers, else past the barrier that ends
                        the waits (one of its own where they did not run)
              run task t as the static kernel does: waits, inlined body, barrier, then
                        thread 0 reads the claimed slot (etc_peek: its load overlaps the
                        notifies' wait for t's stores; if the task is there, the next round
                        takes it without a round trip), thread 32 the held task's consumer
                        list (the next round's count-down reads it from shared memory), then
                        thread 0's notifies, which a chained task's body does not wait for

Data-dependent graphs: the task that completes an element of an ETensor with trigger maps
(its last notify, or the arming that removes its bias) pushes the tasks the maps release (a
run not known to be short is published by the whole CTA after its notifies or the unbias,
``ReadyRing.publish``);
arming first lifts the bias (pushing what the elements already complete release), then marks
the tasks of each triggered call that some element will release and dispatches the others as
skipped (their static notifies and count-downs, and ``expected``, the number of tasks the ring
will hold, lowered by their number): the marks and the skip pass are off the path to the first
released task, and until the pass ends ``expected`` only overstates, so no CTA leaves early.
An ETensor armed at run time whose trigger releases ring tasks only (``DispatchRelease``)
fires instead once its element's notifiers are dispatched and it is armed (a count each, in
the pending counts): its tasks then find the element and wait on it, their preludes first.

The plan (pending counts, consumer lists, seeds, late calls) is ``schedule.DynamicPlan``; the
CPU executor's ``DynamicQueueOrder`` follows the same plan and protocol. Kernel parameters, in
order: the graph's inputs; the read-only initial state ``initial`` (counts), ``pending0``,
``consumer_indptr``, ``consumer_tasks``, ``first_consumer``, ``ring0`` (seeds padded with -1),
``head_tail0``; then the outputs ``counters``, ``status``, ``pending``, ``ring``, ``head_tail``,
``marks`` and every call's output tensors.
"""
from __future__ import annotations

import tvm
from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as Tb

from ..errors import GraphError
from ..schedule import ONLY_PRODUCER, DynamicPlan
from ..task_graph import TaskGraph
from .events import EventLayout, LoweredEdge, lower_edge
from .grid_kernel import in_call, unravel
from .inline import i32
from .persistent import DEFAULT_OPTIONS, WARP, KernelOptions, PersistentKernel


def pointer(buf: tirx.Buffer, at: int = 0):
    return buf.ptr_to([i32(at)])


def _is(expr, value: int) -> bool:
    """Whether ``expr`` is the constant ``value``."""
    return isinstance(expr, tirx.IntImm) and expr.value == value


def _ravel(index, grid) -> tirx.Expr:
    flat = i32(0)
    for i, n in zip(index, grid):
        flat = flat * i32(n) + i
    return flat


class ReadyRing:
    """The ring operations of a dynamic kernel, as TIR statements for ``PersistentKernel``."""

    def __init__(self, kernel: PersistentKernel, plan: DynamicPlan, calls: set[int],
                 claimed_at_launch: bool = False):
        """``calls``: the calls whose tasks go through the ring (the others run from static
        queues of the same kernel). ``claimed_at_launch``: CTA ``bx`` holds slot ``bx`` from
        the start, the head starting past them, so that a CTA's first take needs no claim of
        its own (the dynamic kernel's CTAs all take at once). Declares the ring's buffers;
        ``kernel.ring`` becomes it."""
        self.kernel, self.graph, self.plan, self.calls = kernel, kernel.graph, plan, set(calls)
        self.claimed_at_launch = claimed_at_launch
        self.triggered = plan.triggered
        n = max(1, self.graph.num_tasks)
        shapes = plan.state_sizes()
        self.work = {k: kernel.state_buffer(k, m) for k, m in shapes.items()}
        self.initial = {k: tirx.decl_buffer((shapes[k],), "int32", f"{k}0")
                        for k in ("pending", "ring", "head_tail")}
        self.pending, self.ring = self.work["pending"], self.work["ring"]
        self.head_tail, self.marks = self.work["head_tail"], self.work["marks"]
        self.consumer_indptr = tirx.decl_buffer((n + 1,), "int32", "consumer_indptr")
        self.consumer_tasks = tirx.decl_buffer((max(1, len(plan.consumer_tasks)),), "int32",
                                               "consumer_tasks")
        self.first_consumer = tirx.decl_buffer((n,), "int32", "first_consumer")
        self.skipped = tirx.decl_buffer((1,), "int32", "skipped", scope="shared")
        # release marks read back by ``resolve``, a chunk of words at a time
        self.released = tirx.decl_buffer((RELEASE_WORDS,), "int32", "released",
                                         scope="shared")
        # a task the CTA's last dispatch made ready and keeps to run next (-1: none), and
        # whether that dispatch was of its only producer
        self.held = tirx.decl_buffer((2,), "int32", "held", scope="shared")
        # the held task's consumers (begin, count, first; ``list_held``), and whether the
        # round's task is that one, its list read
        self.held_list = tirx.decl_buffer((4,), "int32", "held_list", scope="shared")
        # ``chains``: in every thread's registers, whether the round's task chained its first
        # consumer (1) and that consumer, and the consumer's tables (begin, end, first)
        self.chained = tirx.decl_buffer((2,), "int32", "chained", scope="local")
        self.chain_list = tirx.decl_buffer((3,), "int32", "chain_list", scope="local")
        # runs of released tasks the CTA publishes together (etc_defer_range)
        self.runs = tirx.decl_buffer((3 + 2 * RUN_SLOTS,), "int32", "runs", scope="shared")
        self.unpublished = False  # a run was deferred since the last ``publish`` generated
        self.trigger_sources = {e.etensor for c in self.graph.calls for e in c.triggers
                                if c.index in self.triggered}
        self.releases = plan.releases
        self._check(kernel.layout)
        kernel.ring = self

    @property
    def inputs(self) -> list:
        """Read-only parameters, in order: initial pending counts, consumer CSR, each task's
        first consumer, initial ring (the seeds), initial head/tail/expected."""
        return [self.initial["pending"], self.consumer_indptr, self.consumer_tasks,
                self.first_consumer, self.initial["ring"], self.initial["head_tail"]]

    @property
    def outputs(self) -> list:
        """The ring's working state, fresh every launch: pending, ring, head_tail, marks."""
        return list(self.work.values())

    def initialisation(self) -> list:
        """``(dst, src, n)`` for ``PersistentKernel.initialise``: working state from the
        initial values, release marks zeroed."""
        src = {**self.initial, "pending": self.initial_pending}
        if self.claimed_at_launch:
            head_tail0 = self.initial["head_tail"]
            src["head_tail"] = lambda i: tirx.Select(
                i == 0, head_tail0[0] + i32(self.kernel.num_ctas), head_tail0[i])
        return [(buf, src.get(k), int(buf.shape[0])) for k, buf in self.work.items()]

    def _check(self, layout: EventLayout) -> None:
        for call in self.graph.calls:
            if call.index not in self.triggered:
                continue
            why = None
            if len(call.triggers) > 1:
                why = "has more than one trigger map"
            elif len(call.in_edges) > 1:
                why = "waits on other events besides its trigger"
            elif call.index in layout.done:
                why = "has a completion that other calls wait for"
            if why:
                raise GraphError(f"{self.graph.name}: {call.name} {why}; the dynamic kernel "
                                 "supports a triggered call with one trigger map as its only "
                                 "in-edge, whose completion nothing waits for")

    def _call(self, name: str, *args, return_type: str = "void"):
        return self.kernel.runtime_call(name, *args, return_type=return_type)

    def claim(self) -> tirx.Expr:
        """A claim on the ring's next slot (``etc_claim``), for ``take``."""
        return self._call("etc_claim", pointer(self.head_tail), return_type="int32")

    def peek(self, slot: tirx.Expr) -> tirx.Expr:
        """The task of claimed slot ``slot`` if published now, else -1 (``etc_peek``)."""
        return self._call("etc_peek", pointer(self.ring), slot, i32(max(1, self.plan.capacity)),
                          return_type="int32")

    def take(self, slot: tirx.Expr) -> tirx.Expr:
        """The task of claimed slot ``slot`` (``etc_take``: -1 past the end, -2 stopping)."""
        kernel = self.kernel
        return self._call("etc_take", pointer(self.head_tail), pointer(self.ring), slot,
                          i32(max(1, self.plan.capacity)), pointer(kernel.status), kernel.limit,
                          return_type="int32")

    def push(self, task: tirx.Expr) -> tirx.Stmt:
        return tirx.Evaluate(self._call("etc_push", pointer(self.head_tail), pointer(self.ring),
                                        task, i32(self.plan.capacity),
                                        pointer(self.kernel.status)))

    @property
    def shared(self) -> tuple:
        """The ring's shared-memory scratch, for ``PersistentKernel.begin``."""
        return (self.skipped, self.held, self.held_list, self.released, self.runs)

    def clear_runs(self) -> tirx.Stmt:
        """Thread 0, before the first ``publish``: no run is deferred."""
        return tirx.IfThenElse(self.kernel.tx == 0,
                               tirx.BufferStore(self.runs, i32(0), [i32(0)]), None)

    def publish(self) -> tirx.Stmt:
        """All threads of the CTA: push the runs deferred since the last publish, thread 0
        claiming their slots with one atomic and every thread storing its share of them."""
        kernel = self.kernel
        self.unpublished = False
        sync = tirx.Evaluate(Tb.cuda.cta_sync())
        claim = tirx.Evaluate(self._call("etc_claim_runs", pointer(self.runs),
                                         pointer(self.head_tail), i32(self.plan.capacity),
                                         pointer(kernel.status)))
        store = tirx.Evaluate(self._call("etc_store_runs", pointer(self.runs),
                                         pointer(self.ring), kernel.tx,
                                         i32(kernel.scopes.num_threads)))
        # the last barrier keeps the next deferral from rewriting runs still being stored
        return tirx.stmt_seq(sync, tirx.IfThenElse(kernel.tx == 0, claim, None), sync, store,
                             sync)

    def take_held(self, into: tirx.Buffer, listed: bool = False,
                  done_here: tirx.Buffer | None = None) -> tirx.Stmt:
        """Thread 0: move the held task (or -1) to ``into[0]``; ``listed``: its consumer
        list is in ``held_list`` (``list_held`` ran at the last dispatch), and ``held`` is
        cleared by the thread that reads it there, at the next dispatch
        (``count_down_consumers(listed=True)``): that thread may read it after thread 0 got
        here, with no barrier between; ``done_here[0]``: 1 where the task is held from its
        only producer, which this CTA ran last (its waits may be elided), else 0."""
        steps = [tirx.BufferStore(into, self.held[0], [i32(0)])]
        if not listed:
            steps.append(tirx.BufferStore(self.held, i32(-1), [i32(0)]))
        if done_here is not None:
            steps.append(tirx.BufferStore(done_here, tirx.Select(
                into[0] >= 0, self.held[1], i32(0)) if self.runs_held_without_waits
                else i32(0), [i32(0)]))
        if listed:
            steps.append(tirx.BufferStore(self.held_list, tirx.Cast("int32", into[0] >= 0),
                                          [i32(3)]))
        return tirx.stmt_seq(*steps)

    def take_next(self, slot: tirx.Buffer, claim: tirx.Buffer, peeked: tirx.Buffer,
                  listed: bool, done_here: tirx.Buffer) -> tirx.Stmt:
        """Thread 0: the round's task into ``slot[0]``: the held one (``take_held``), else
        the one ``peeked[0]`` read early from the claimed slot, else that slot's (claimed now
        if ``claim[0]`` holds none), waiting for it (``take``)."""
        from_slot = tirx.stmt_seq(
            tirx.IfThenElse(claim[0] < 0, tirx.BufferStore(claim, self.claim(), [i32(0)]),
                            None),
            tirx.BufferStore(slot, self.take(claim[0]), [i32(0)]))
        return tirx.stmt_seq(
            self.take_held(slot, listed=listed, done_here=done_here),
            tirx.IfThenElse(slot[0] < 0, tirx.stmt_seq(
                tirx.IfThenElse(peeked[0] >= 0, tirx.BufferStore(slot, peeked[0], [i32(0)]),
                                from_slot),
                tirx.BufferStore(claim, i32(-1), [i32(0)])), None),
            tirx.BufferStore(peeked, i32(-1), [i32(0)]))

    @property
    def runs_held_without_waits(self) -> bool:
        """Whether a task held from its only producer skips its waits: on one rank (where
        several, an element a task notifies may live on another rank)."""
        return self.kernel.rank is None

    @property
    def chains(self) -> bool:
        """Whether a first consumer whose only producer is the dispatched task is chained
        (``count_down_consumers(chained=...)``): every thread keeps it in registers and runs it
        next, with no count-down, no barrier before it and no waits, as the static kernel
        runs its queue. Where some task has one, held tasks skip their waits, and the launch
        runs every task (a launch on smaller sizes counts every consumer down: its pending
        count may be out of reach)."""
        return self.runs_held_without_waits and not self.kernel.symbolic and bool(
            (self.plan.first_consumers() & ONLY_PRODUCER).any())

    def list_held(self, thread: int, chain: bool = False) -> tirx.Stmt:
        """``thread`` reads the consumer list of the task this dispatch holds, if any, into
        ``held_list`` (beside thread 0's notifies, whose fence it waits as long as), so that
        the next round counts that task's consumers down with no round trip to the tables;
        ``chain``: not where the dispatch chained a task (its list is in registers)."""
        h = tirx.Var("h", "int32")
        read = tirx.IfThenElse(self.kernel.tx == i32(thread), tirx.stmt_seq(
            tirx.Bind(h, self.held[0]),
            tirx.IfThenElse(h >= 0, tirx.stmt_seq(*(
                tirx.BufferStore(self.held_list, word, [i32(k)])
                for k, word in enumerate(self._tabled_list(h)))), None)),
            None)
        return tirx.IfThenElse(self.chained[0] == 0, read, None) if chain else read

    def _chain(self, first: tirx.Expr) -> tirx.Stmt:
        """Every thread: chain ``first``, whose only producer is the round's task, loading its
        consumer tables into registers (their round trip overlaps the task); thread 0 takes it
        off the count of tasks the ring will hold."""
        h = tirx.Var("chained_task", "int32")
        begin = self.consumer_indptr[h]
        return tirx.stmt_seq(
            tirx.Bind(h, tirx.bitwise_and(first, i32(ONLY_PRODUCER - 1))),
            tirx.BufferStore(self.chained, h, [i32(1)]),
            *(tirx.BufferStore(self.chain_list, word, [i32(k)]) for k, word in enumerate(
                (begin, self.consumer_indptr[h + 1], self.first_consumer[h]))),
            tirx.IfThenElse(self.kernel.tx == 0, tirx.Evaluate(self._call(
                "etc_add", pointer(self.head_tail, 2), i32(-1))), None))

    def _tabled_list(self, task: tirx.Expr) -> list[tirx.Expr]:
        """``task``'s consumers as (begin, count, first), read from the tables."""
        begin = self.consumer_indptr[task]
        return [begin, self.consumer_indptr[task + 1] - begin, self.first_consumer[task]]

    def _consumer_list(self, task: tirx.Expr, listed: bool,
                       chained: tirx.Expr | None = None) -> list[tirx.Expr]:
        """``task``'s consumers as (begin, count, first): from ``chain_list`` where
        ``chained`` (nonzero: the round's task was chained), from ``held_list`` where
        ``listed`` and the round's task is the held one, else from the tables."""
        found = self._tabled_list(task)
        if listed:
            kept = self.held_list[3] != 0
            found = [tirx.if_then_else(kept, self.held_list[k], value)
                     for k, value in enumerate(found)]
        if chained is not None:
            carried = self.chain_list
            found = [tirx.if_then_else(chained != 0, value, other) for value, other in zip(
                (carried[0], carried[1] - carried[0], carried[2]), found)]
        return found

    def count_down_consumers(self, task: tirx.Expr, dispatch: bool = False,
                             first_thread: int = 0, listed: bool = False,
                             chained: tirx.Expr | None = None) -> tirx.Stmt:
        """``task`` was dispatched (or skipped): count down the tasks and late calls waiting
        for it; the last count-down of each pushes it. ``dispatch``: called by every thread of
        the CTA that runs ``task``, which spread the consumers over threads ``first_thread``
        on and keep the first consumer, if this makes it ready, in ``held`` to run next: a
        chain hands over without a push or a pop, and on the same SM. ``listed``: a held
        task's list is in ``held_list`` (``take_held(listed=True)``), and thread
        ``first_thread``, which holds, clears ``held`` first. ``chained`` (with
        ``dispatch``, ``first_thread`` > 0 and ``chains``; nonzero where ``task`` was
        chained itself: its list is in ``chain_list``): where ``task`` is the first
        consumer's only producer, every thread chains it (``chained[0]`` = 1), the threads
        from ``first_thread`` on counting the rest down."""
        kernel = self.kernel
        begin, count, first = (tirx.Var(name, "int32") for name in ("begin", "count", "first"))
        consumer = lambda k: tirx.if_then_else(  # noqa: E731
            k == 0, first, self.consumer_tasks[begin + k])
        down = lambda k, hold: tirx.Evaluate(self._call(  # noqa: E731
            "etc_count_down", pointer(self.pending), consumer(k),
            pointer(self.held), hold, pointer(self.head_tail), pointer(self.ring),
            i32(len(self.plan.pending)), pointer(kernel.status), i32(int(kernel.symbolic))))
        if dispatch:
            loop = kernel.strided(count, lambda k: down(k, tirx.Cast("int32", k == 0)),
                                  first_thread)
            if chained is not None:
                only = tirx.Cast("int32", tirx.And(
                    first >= 0, tirx.bitwise_and(first, i32(ONLY_PRODUCER)) != 0))
                loop = tirx.stmt_seq(
                    tirx.BufferStore(self.chained, only, [i32(0)]),
                    tirx.IfThenElse(self.chained[0] != 0, tirx.stmt_seq(
                        self._chain(first),
                        kernel.strided(count - i32(1), lambda k: down(k + i32(1), i32(0)),
                                       first_thread)), loop))
        else:
            k = tirx.Var("k", "int32")
            loop = tirx.For(k, i32(0), count, tirx.ForKind.SERIAL, down(k, i32(0)))
        steps = [tirx.stmt_seq(*(tirx.Bind(var, value) for var, value in zip(
            (begin, count, first), self._consumer_list(task, listed, chained))), loop)]
        among = self.has_consumers(task)
        if among is not None:  # the other calls' tasks read no consumer list
            steps = [tirx.IfThenElse(among, steps[0], None)]
            if chained is not None:
                steps.insert(0, tirx.BufferStore(self.chained, i32(0), [i32(0)]))
        if dispatch and listed:
            steps.insert(0, tirx.IfThenElse(kernel.tx == i32(first_thread), tirx.BufferStore(
                self.held, i32(-1), [i32(0)]), None))
        warp = first_thread // WARP
        late = self._count_down_late_calls(
            task, lanes=min(WARP, kernel.scopes.num_threads - warp * WARP) if dispatch else None)
        if late is not None:
            steps.append(tirx.IfThenElse(
                tirx.floordiv(kernel.tx, i32(WARP)) == i32(warp), late, None)
                if dispatch else late)
        releases = self._count_down_releases(task)
        if releases is not None:
            steps.append(tirx.IfThenElse(kernel.tx == i32(first_thread), releases, None)
                         if dispatch else releases)
        return tirx.stmt_seq(*steps)

    def _count_down_releases(self, task: tirx.Expr) -> tirx.Stmt | None:
        """One thread counts down the trigger elements released at dispatch that ``task``
        notifies (``DispatchRelease``); the last count of an element pushes what it
        releases."""
        out = None
        for call in reversed(self.kernel.calls):
            edges = [e for e in call.out_edges if e.etensor in self.releases]
            if not edges or not call.num_tasks:
                continue
            coords = [tirx.Var(f"{c}_released", "int32") for c in call.fn.coord_params]
            steps = [tirx.Bind(v, x) for v, x in zip(
                coords, unravel(task - i32(call.first_task), call.grid))]
            for e in edges:
                lowered = lower_edge(e.map, dict(zip(e.map.coords, coords)))
                steps.append(lowered.nest(self.count_down_release(e.etensor, _ravel(
                    lowered.index, self.kernel.layout.shapes[e.etensor]))))
            out = tirx.IfThenElse(in_call(call, task), tirx.stmt_seq(*steps), out)
        return out

    def count_down_release(self, etensor: str, k: tirx.Expr, defer: bool = False) -> tirx.Stmt:
        """One count of element ``k`` (flat) of ``etensor``, whose trigger is released at
        dispatch: the last one fires it (``defer``: the CTA publishes long runs after)."""
        release = self.releases[etensor]
        counter = self.pending.ptr_to([i32(release.offset) + k])
        last = self._call("etc_count_down_release", counter, return_type="int32")
        return tirx.IfThenElse(last != 0, self.fire(
            etensor, unravel(k, self.kernel.layout.shapes[etensor]), defer), None)

    def has_consumers(self, task: tirx.Expr) -> tirx.Expr | None:
        """Whether ``task`` lies in a call some of whose tasks have consumers in the plan
        (None: every call's do); a dispatch of another call's task skips the round trip to
        the consumer list, and can hold no task. In the MoE layer only the router's and
        top-K's tasks have any."""
        indptr, ranges = self.plan.consumer_indptr, []
        for call in self.kernel.calls:
            if not call.num_tasks:
                continue
            if indptr[call.first_task + call.num_tasks] > indptr[call.first_task]:
                if ranges and ranges[-1][1] == call.first_task:
                    ranges[-1][1] = call.first_task + call.num_tasks
                else:
                    ranges.append([call.first_task, call.first_task + call.num_tasks])
        covered = sum(hi - lo for lo, hi in ranges)
        if covered == sum(c.num_tasks for c in self.kernel.calls):
            return None
        cond = tirx.IntImm("bool", 0)
        for lo, hi in ranges:
            cond = tirx.Or(cond, tirx.And(i32(lo) <= task, task < i32(hi)))
        return cond

    def _count_down_late_calls(self, task: tirx.Expr,
                               lanes: int | None = None) -> tirx.Stmt | None:
        """One thread counts down each late call that waits for ``task``'s call; ``lanes``:
        the first lanes of one warp, which store a pushed call's slots side by side."""
        n = len(self.plan.pending)
        name, lane_arg = (("etc_count_down_call", []) if lanes is None
                          else ("etc_count_down_call_warp", [i32(lanes)]))
        late = None
        for call in reversed(self.kernel.calls):
            dependents = self.plan.late_dependents(call.index)
            if not dependents:
                continue
            downs = [tirx.Evaluate(self._call(
                name, pointer(self.pending, n + j),
                i32(self.graph.calls[self.plan.late_calls[j].call].first_task),
                i32(self.graph.calls[self.plan.late_calls[j].call].num_tasks),
                pointer(self.head_tail), pointer(self.ring), i32(n),
                pointer(self.kernel.status), *lane_arg)) for j in dependents]
            late = tirx.IfThenElse(in_call(call, task), tirx.stmt_seq(*downs), late)
        return late

    def fire(self, etensor: str, elem, defer: bool = False) -> tirx.Stmt:
        """Element ``elem`` of ``etensor`` completed: push every task its trigger maps give.
        ``defer``: the CTA publishes long runs after this (``publish``)."""
        steps = []
        for call in self.graph.calls:
            for e in call.triggers:
                if e.etensor != etensor or call.index not in self.triggered:
                    continue
                lowered = lower_edge(e.map, dict(zip(e.map.coords, elem)),
                                     self.kernel.params(call))
                steps.append(self._push_released(call, e, lowered, defer))
        return tirx.stmt_seq(*steps)

    def _push_released(self, call, edge, lowered, defer: bool) -> tirx.Stmt:
        """Push the tasks of ``call`` that ``lowered`` (a trigger map at one element) gives:
        a run of consecutive tasks claims its slots with one atomic; with ``defer``, a run that
        may be long is left to the CTA's ``publish`` (the MoE layer's ``aligned`` element
        releases every gate-up task at once)."""
        def action(first, count):
            if _is(count, 1):
                return self.push(first)
            if defer and not _analyzer.can_prove(count <= i32(SHORT_RUN)):
                self.unpublished = True
                return tirx.Evaluate(self._call(
                    "etc_defer_range", pointer(self.runs), first, count,
                    pointer(self.head_tail), pointer(self.ring), i32(self.plan.capacity),
                    pointer(self.kernel.status)))
            return self._push_range(first, count)

        return self._released_runs(call, edge, lowered, action)

    def _released_runs(self, call, edge, lowered, action) -> tirx.Stmt:
        """``action(first, count)`` for the runs of consecutive task ids of ``call`` that
        ``lowered`` (a trigger map at one element) gives, first and last bounds-checked.
        Trailing task coordinates that the map's innermost slices cover whole, with the range
        just before them, make one run; a map of another form gives runs of one task."""
        grid, index, loops = call.grid, list(lowered.index), list(lowered.loops)
        d = len(index) - 1
        while (d >= 0 and loops and loops[-1][0].same_as(index[d])
               and _is(loops[-1][1], 0) and _is(loops[-1][2], grid[d])):
            loops.pop()
            d -= 1
        if d >= 0 and loops and loops[-1][0].same_as(index[d]):
            _, lo, hi = loops.pop()
        elif d >= 0:
            lo, hi = index[d], index[d] + i32(1)
        popped = {v for v, _, _ in lowered.loops} - {v for v, _, _ in loops}
        outer = [*index[:max(d, 0)], *([] if lowered.guard is None else [lowered.guard])]
        if any(v in popped for x in outer for v in tirx.analysis.undefined_vars(x)):
            return lowered.nest(self.kernel.checked(
                call, edge, i32(-1), lowered.index,
                lambda idx: action(i32(call.first_task) + _ravel(idx, grid), i32(1)),
                shape=grid))
        inner = 1
        for n in grid[d + 1:]:
            inner *= n
        if d < 0:  # the whole grid
            run = action(i32(call.first_task), i32(call.num_tasks))
        else:
            zeros = [i32(0)] * (len(index) - d - 1)
            first, last = [*index[:d], lo, *zeros], [*index[:d], hi - i32(1), *zeros]
            run = tirx.IfThenElse(lo < hi, self.kernel.checked(
                call, edge, i32(-1), first, lambda idx: self.kernel.checked(
                    call, edge, i32(-1), last, lambda _: action(
                        i32(call.first_task) + _ravel(idx, grid), (hi - lo) * i32(inner)),
                    shape=grid), shape=grid), None)
        return LoweredEdge(tuple(loops), tuple(index), lowered.guard).nest(run)

    def _push_range(self, first: tirx.Expr, count: tirx.Expr) -> tirx.Stmt:
        return tirx.Evaluate(self._call("etc_push_range", pointer(self.head_tail),
                                        pointer(self.ring), first, count,
                                        i32(self.plan.capacity), pointer(self.kernel.status)))

    def mark_released(self, call) -> tirx.Stmt:
        """All threads of one CTA, once ``call``'s trigger maps can be read: mark each task an
        element will release (twice is an error). Marks are bits set a word of 32 tasks at a
        time: the threads share the elements, or, for a trigger of one element, its words.
        Only this CTA reads them (``skip_unreleased``, after a barrier)."""
        kernel, (edge,) = self.kernel, call.triggers
        shape = kernel.layout.shapes[edge.etensor]
        size = 1
        for n in shape:
            size *= n
        elem = [tirx.Var(f"e{k}_resolve", "int32") for k in range(len(shape))]
        lowered = lower_edge(edge.map, dict(zip(edge.map.coords, elem)), kernel.params(call))
        tx, threads = kernel.tx, i32(kernel.scopes.num_threads)
        lane, lanes = (tx, threads) if size == 1 else (i32(0), i32(1))

        def mark_run(first, count):
            return tirx.Evaluate(self._call("etc_mark_range", pointer(self.marks), first, count,
                                            lane, lanes, pointer(kernel.status)))

        mark = self._released_runs(call, edge, lowered, mark_run)
        return tirx.stmt_seq(*[tirx.Bind(v, x) for v, x in zip(elem, unravel(i32(0), shape))],
                             mark) if size == 1 else kernel.strided(
            size, lambda i: tirx.stmt_seq(
                *[tirx.Bind(v, x) for v, x in zip(elem, unravel(i, shape))], mark))

    def skip_unreleased(self, call) -> tirx.Stmt:
        """All threads of one CTA, after ``mark_released`` of ``call`` and a barrier:
        dispatch the unmarked tasks as skipped and lower ``expected`` by their number. Each
        thread takes single tasks, so that a run of unreleased tasks is skipped by all the
        threads at once."""
        kernel, tx = self.kernel, self.kernel.tx
        coords = [tirx.Var(f"{c}_skip", "int32") for c in call.fn.coord_params]
        first_word = call.first_task // 32
        words = (call.first_task + call.num_tasks - 1) // 32 - first_word + 1
        chunk, task = tirx.Var("words_chunk", "int32"), tirx.Var("skipped_task", "int32")
        base = i32(first_word) + chunk * i32(RELEASE_WORDS)  # the chunk's first word
        count = tirx.min(i32(RELEASE_WORDS), i32(first_word + words) - base)

        def skip_task(i):
            unmarked = tirx.And(
                in_call(call, task),
                tirx.bitwise_and(tirx.shift_right(self.released[i // 32], i % 32), i32(1))
                == i32(0))
            return tirx.stmt_seq(
                tirx.Bind(task, base * i32(32) + i),
                tirx.IfThenElse(unmarked, tirx.stmt_seq(
                    *[tirx.Bind(v, x) for v, x in zip(
                        coords, unravel(task - i32(call.first_task), call.grid))],
                    self.dispatched_as_skipped(call, task, coords),
                    tirx.Evaluate(self._call("etc_count", self.skipped.ptr_to([i32(0)])))),
                    None))

        # the marks come into shared memory a chunk of words at a time, then each thread
        # takes single tasks: a trigger leaves its unreleased tasks in one run at the end
        # (tiles past the used ones), which the threads then skip side by side
        skips = tirx.For(chunk, i32(0), i32(-(-words // RELEASE_WORDS)), tirx.ForKind.SERIAL,
                         tirx.stmt_seq(
            kernel.strided(count, lambda w: tirx.BufferStore(
                self.released, self._call("etc_release_word", pointer(self.marks), base + w,
                                          return_type="int32"), [w])),
            tirx.Evaluate(Tb.cuda.cta_sync()),
            kernel.strided(count * i32(32), skip_task),
            tirx.Evaluate(Tb.cuda.cta_sync())))

        return tirx.stmt_seq(
            tirx.IfThenElse(tx == 0, tirx.BufferStore(self.skipped, i32(0), [i32(0)]), None),
            skips,
            tirx.IfThenElse(tx == 0, tirx.Evaluate(self._call(
                "etc_add", pointer(self.head_tail, 2), i32(0) - self.skipped[0])), None))

    def dispatched_as_skipped(self, call, task, coords) -> tirx.Stmt:
        """What a skipped task does instead of entering the ring: its static notifies (fan-ins
        over whole grids complete) and its consumers' count-downs."""
        steps = [self.kernel.static_notifies(call, coords), self.count_down_consumers(task)]
        return tirx.stmt_seq(*[s for s in steps if s is not None])

    def launch(self, bx) -> tirx.Stmt | None:
        """For a kernel on symbolic shapes, after the grid-wide barrier: every thread of the
        grid takes a share of the ring's tasks that count-downs push; a task inside the
        launch's grids that waits for nothing is pushed, one outside is dispatched as skipped
        and leaves ``expected`` (it never enters the ring: its pending count started out of
        reach). Late calls that wait for nothing are pushed whole."""
        kernel = self.kernel
        if not kernel.symbolic:
            return None
        late = {lc.call: lc.pending for lc in self.plan.late_calls}
        steps = []
        for call in self.graph.calls:
            if call.index not in self.calls or call.index in self.triggered:
                continue
            if call.index in late:
                if late[call.index] == 0:
                    steps.append(kernel.strided_grid(
                        bx, call.num_tasks,
                        lambda j, c=call: self.push(i32(c.first_task) + j)))
                continue
            coords = [tirx.Var(f"{c}_launch", "int32") for c in call.fn.coord_params]
            task = tirx.Var("launched_task", "int32")
            inside = self._skipped_at_launch(call, coords)
            seed = tirx.IfThenElse(self.initial["pending"][task] == 0, self.push(task), None)
            skip = tirx.stmt_seq(self.dispatched_as_skipped(call, task, coords),
                                 tirx.Evaluate(self._call("etc_add", pointer(self.head_tail, 2),
                                                          i32(-1))))
            body = seed if inside is None else tirx.IfThenElse(inside, seed, skip)
            steps.append(kernel.strided_grid(bx, call.num_tasks, lambda j, c=call,
                                             coords=coords, task=task, body=body: tirx.stmt_seq(
                tirx.Bind(task, i32(c.first_task) + j),
                *[tirx.Bind(v, x) for v, x in zip(coords, unravel(j, c.grid))], body)))
        return tirx.stmt_seq(*steps) if steps else None

    def initial_pending(self, idx: tirx.Expr) -> tirx.Expr:
        """A task's pending count at launch: out of reach for a task outside the launch's
        grids (a skipped task is never pushed), its plan's count otherwise."""
        value = self.initial["pending"][idx]
        if not self.kernel.symbolic:
            return value
        late = {lc.call for lc in self.plan.late_calls}
        for call in self.graph.calls:
            if call.index not in self.calls or call.index in self.triggered | late:
                continue
            inside = self._skipped_at_launch(call, unravel(idx - i32(call.first_task),
                                                           call.grid))
            if inside is not None:
                value = tirx.Select(tirx.And(in_call(call, idx), tirx.Not(inside)),
                                    i32(OUT_OF_REACH), value)
        return value


    def _skipped_at_launch(self, call, coords) -> tirx.Expr | None:
        """Whether the task at ``coords`` is inside the launch's grids, for the calls whose
        tasks outside are skipped at launch (None: every task goes through the ring). A
        call whose completion is counted keeps them in the ring: the count needs a whole CTA
        (the last task arms), which dispatch has and the launch's share of a thread has not."""
        if call.index in self.kernel.layout.done:
            return None
        return self.kernel.inside(call, coords)


OUT_OF_REACH = 1 << 30  # a pending count no count-down reaches
RUN_SLOTS = 16  # ETC_RUN_SLOTS: the runs a CTA defers before it pushes one at once
SHORT_RUN = 32  # a run of at most this many tasks is pushed by the thread that releases it
_analyzer = tvm.sym.Analyzer()
RELEASE_WORDS = 128  # release-mark words (32 tasks each) ``resolve`` reads per round


def build_dynamic_kernel(graph: TaskGraph, plan: DynamicPlan, layout: EventLayout, name: str,
                         num_ctas: int, options: KernelOptions = DEFAULT_OPTIONS,
                         symbolic: bool = False, rank: int | None = None) -> tirx.PrimFunc:
    """The persistent kernel that runs ``graph`` from a ready ring, following ``plan``; with
    ``symbolic``, on tensors of any sizes up to ``graph``'s (the plan's seeds are then pushed
    at launch, those inside the launch's grids). For a graph of several ranks, rank
    ``rank``'s kernel: ``plan`` is that rank's (``DynamicPlan.of(graph, its calls,
    rank_local=True)``), its ring holds that rank's tasks."""
    kernel = PersistentKernel(graph, layout, options, num_ctas, symbolic, rank)
    ring = ReadyRing(kernel, plan, {c.index for c in kernel.calls}, claimed_at_launch=True)
    slot = tirx.decl_buffer((1,), "int32", "popped", scope="shared")
    # 1: the round's task is held from its only producer, run here last round
    done_here = tirx.decl_buffer((1,), "int32", "done_here", scope="shared")
    claim = tirx.decl_buffer((1,), "int32", "claim", scope="local")  # thread 0's claimed slot
    peeked = tirx.decl_buffer((1,), "int32", "peeked", scope="local")  # its task, read early
    task, here = tirx.Var("t", "int32"), tirx.Var("here", "int32")
    tx = kernel.tx
    # warps past the first count the task's consumers down while warp 0 waits on its events
    counting = WARP if kernel.scopes.num_threads > WARP else 0
    # every thread chains a consumer the task alone produces: the next round starts it with
    # no barrier, while thread 0 notifies, and its tables' round trip overlaps the task
    chain = bool(counting) and ring.chains
    chained = tirx.Var("chained_now", "int32") if chain else None
    held_some = ring.has_consumers(task)

    def claim_next(cond: tirx.Expr) -> tirx.Stmt:
        """Thread 0 claims the next task's slot, so that the claim's round trip overlaps
        task t; not where t's dispatch made a task to hold."""
        return tirx.IfThenElse(tirx.And(tx == 0, cond),
                               tirx.BufferStore(claim, ring.claim(), [i32(0)]), None)

    def late_claim(synced: tirx.Expr) -> tirx.Stmt:
        """Once the count-downs are done (a barrier: the waits' own where they ran) and
        ``held`` tells; not where the task chained one (no claim, and no barrier for it)."""
        stmt = tirx.stmt_seq(*[s for s in (
            None if _is(synced, 1) else
            tirx.Evaluate(Tb.cuda.cta_sync()) if _is(synced, 0) else
            tirx.IfThenElse(tirx.Not(synced), tirx.Evaluate(Tb.cuda.cta_sync()), None),
            claim_next(ring.held[0] < 0 if held_some is None
                       else tirx.And(held_some, ring.held[0] < 0))) if s is not None])
        return tirx.IfThenElse(ring.chained[0] == 0, stmt, None) if chain else stmt

    peek = tirx.IfThenElse(tirx.And(tx == 0, claim[0] >= 0),
                           tirx.BufferStore(peeked, ring.peek(claim[0]), [i32(0)]), None)
    dispatch = kernel.dispatch(
        task, skip_waits=here, after_waits=late_claim if counting else None,
        before_notifies=(lambda: tirx.stmt_seq(peek, ring.list_held(counting, chain)))
        if counting else peek)

    with IRBuilder() as ib:
        with Tb.prim_func():
            bx = kernel.begin(name, [*kernel.inputs, kernel.initial, *ring.inputs,
                                     *kernel.returned(ring.outputs)],
                              shared=(slot, done_here, *ring.shared),
                              state=ring.initialisation())
            launch = ring.launch(bx)
            if launch is not None:
                Tb.add_to_parent(launch)
            for buf in (claim, peeked, *((ring.chained, ring.chain_list) if chain else ())):
                Tb.add_to_parent(tirx.AllocBuffer(buf))
            if chain:
                Tb.buffer_store(ring.chained, i32(0), [0])
            with Tb.If(tx == 0):
                with Tb.Then():
                    Tb.buffer_store(ring.held, i32(-1), [0])
                    Tb.buffer_store(claim, bx, [0])
                    Tb.buffer_store(peeked, i32(-1), [0])
            with Tb.While(tirx.IntImm("bool", 1)):
                take = tirx.stmt_seq(
                    tirx.IfThenElse(tx == 0, ring.take_next(slot, claim, peeked, bool(counting),
                                                            done_here), None),
                    tirx.Evaluate(Tb.cuda.cta_sync()))
                if chain:  # a chained task needs no take and no barrier
                    Tb.add_to_parent(tirx.Bind(chained, ring.chained[0]))
                    take = tirx.IfThenElse(chained == 0, take, None)
                Tb.add_to_parent(take)
                # every thread reads the slot before the barrier after the count-downs, and
                # thread 0 rewrites it only past that barrier
                taken, taken_here = slot[0], done_here[0]
                if chain:
                    taken = tirx.if_then_else(chained != 0, ring.chained[1], taken)
                    taken_here = tirx.if_then_else(chained != 0, i32(1), taken_here)
                Tb.add_to_parent(tirx.Bind(task, taken))
                Tb.add_to_parent(tirx.Bind(here, taken_here))
                with Tb.If(task < 0):
                    with Tb.Then():
                        Tb.Break()
                Tb.add_to_parent(ring.count_down_consumers(task, dispatch=True,
                                                           first_thread=counting,
                                                           listed=bool(counting),
                                                           chained=chained))
                if not counting:
                    Tb.evaluate(Tb.cuda.cta_sync())  # ``held`` is read at the next round
                    Tb.add_to_parent(claim_next(ring.held[0] < 0))
                elif held_some is not None:  # a task that holds none claims at once
                    Tb.add_to_parent(claim_next(tirx.Not(held_some)))
                Tb.add_to_parent(dispatch)
            kernel.end(bx)
    return ib.get()
