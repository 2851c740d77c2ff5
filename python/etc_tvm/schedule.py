"""Schedules: per-CTA task queues computed at compile time (static), and the plan a GPU ready
queue follows (dynamic).

``list_schedule`` is list scheduling over the task graph, simulated in time: the SM that frees up
first takes, among the tasks whose predecessors have finished by then, the one with the longest
cost-weighted path to the end (critical path first); if none has, the first to become ready.
A task goes to the SM of the predecessor that released it when that SM is free as early: the
consumer then finds its data where it was written, and its wait on that producer is elided.
Tasks are placed in a topological order and every SM runs its queue in placement order, so the
earliest unfinished task in that order is never blocked: the schedule cannot deadlock. Costs
come from each device function's ``cost`` hint, evaluated for each call's shapes, plus a fixed
``TASK_OVERHEAD`` per task: its dispatch, waits, barriers and notifies. Without it a stream of
cheap tasks looks free and piles up on the few SMs that are idle first, delaying everything
that waits for them.
"""
from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from .task_graph import MAX_TASKS, TaskGraph

LOCAL_WAITS = MAX_TASKS  # flag in a queue entry: the task's producers ran earlier on its SM
ONLY_PRODUCER = MAX_TASKS  # flag in first_consumers: the task is that consumer's only producer
TASK_OVERHEAD = 3.0  # in cost-hint units (one elementwise pass over a tile, one GEMM K step)


@dataclass(frozen=True)
class StaticSchedule:
    """``queues[c]``: the task ids persistent CTA ``c`` runs, in order (the hardware places the
    CTAs on SMs, several to an SM when asked); ``makespan``: the estimate."""

    queues: tuple[tuple[int, ...], ...]
    makespan: float

    @property
    def num_ctas(self) -> int:
        return len(self.queues)

    def csr(self, graph: TaskGraph | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(indptr int32[num_ctas + 1], tasks int32[num_tasks]): the layout kernels read.

        With ``graph``, a task whose waits are all notified by tasks earlier in its own queue
        carries ``LOCAL_WAITS`` (bit 30): its CTA has run them already, so it need not wait.
        """
        indptr = np.zeros(self.num_ctas + 1, np.int32)
        indptr[1:] = np.cumsum([len(q) for q in self.queues])
        local = self.local_waits(graph) if graph is not None else set()
        tasks = np.array([t | (LOCAL_WAITS if t in local else 0)
                          for q in self.queues for t in q], np.int32)
        return indptr, tasks

    def without(self, tasks) -> "StaticSchedule":
        """The queues less ``tasks`` (those a ready ring runs instead), in the same order."""
        tasks = set(tasks)
        return StaticSchedule(tuple(tuple(t for t in q if t not in tasks) for q in self.queues),
                              self.makespan)

    def for_rank(self, graph: TaskGraph, rank: int) -> "StaticSchedule":
        """Rank ``rank``'s tasks of a schedule of every rank's, in the same queues and order:
        one rank's GPU runs them. A queue's order is the schedule's start order, so its
        subsequence needs nothing that starts later, on any rank."""
        return StaticSchedule(tuple(tuple(t for t in q if graph.rank_of(t) == rank)
                                    for q in self.queues), self.makespan)

    def local_waits(self, graph: TaskGraph) -> set[int]:
        """Tasks with waits, all of whose elements are notified only by tasks placed earlier
        on the same SM (static edges; data-dependent ones never count as local, nor tasks of
        a ready ring)."""
        where = {t: (sm, k) for sm, q in enumerate(self.queues) for k, t in enumerate(q)}
        notifiers = graph.element_notifiers()
        dynamic = {c.index for c in graph.calls
                   if any(e.map.is_data_dependent or e.map.is_trigger for e in c.in_edges)}
        runtime = graph.dynamically_notified() | set(graph.arm_inputs())
        local = set()
        for task, (sm, k) in where.items():
            if graph.waits[task] and graph.task_call[task] not in dynamic and all(
                    e[0] not in runtime and notifiers[e]
                    and all(p in where and where[p][0] == sm and where[p][1] < k
                            for p in notifiers[e])
                    for e in graph.waits[task]):
                local.add(task)
        return local


def list_schedule(graph: TaskGraph, num_queues: int,
                  task_overhead: float = TASK_OVERHEAD) -> StaticSchedule:
    """Critical-path-first list scheduling of ``graph`` onto ``num_queues`` queues (one per
    persistent CTA); each task costs its hint plus ``task_overhead``."""
    if num_queues < 1:
        raise ValueError(f"num_queues must be positive, got {num_queues}")
    order = graph.topological_order()  # also rejects cycles
    succ, indeg = graph.dependency_graph()
    if task_overhead < 0:
        raise ValueError(f"task_overhead must not be negative, got {task_overhead}")
    cost = [graph.call_of(t).cost + task_overhead for t in range(graph.num_tasks)]

    level: dict = {}  # longest cost-weighted path from a node to the end
    for task in reversed(order):
        level[("t", task)] = cost[task] + _max_level(("t", task), succ, level)

    remaining = dict(indeg)
    ready_at: dict = {}
    released_by: dict = {}  # task -> SM of the predecessor that made it ready
    waiting = []  # (ready time, -level, task): every predecessor placed
    for t in range(graph.num_tasks):
        if remaining[("t", t)] == 0:
            waiting.append((0.0, -level[("t", t)], t))
    for node in [n for n, d in indeg.items() if d == 0 and n[0] != "t"]:  # unnotified elements
        waiting += [(0.0, -level[m], m[1]) for m in _released(node, 0.0, succ, remaining,
                                                              ready_at)]
    heapq.heapify(waiting)
    ready = []  # (-level, task): ready by the time the next SM frees up
    free_at = [0.0] * num_queues
    queues = [[] for _ in range(num_queues)]
    makespan = 0.0
    while waiting or ready:
        free = min(free_at)
        if not ready or (waiting and waiting[0][0] <= free):
            now = max(free, waiting[0][0]) if not ready else free
            while waiting and waiting[0][0] <= now:
                _, priority, task = heapq.heappop(waiting)
                heapq.heappush(ready, (priority, task))
            free = now
        _, task = heapq.heappop(ready)
        sm = free_at.index(min(free_at))
        start = max(free, ready_at.get(("t", task), 0.0))
        near = released_by.get(task)
        if near is not None and free_at[near] <= start:  # as early there: stay by the producer
            sm = near
        finish = start + cost[task]
        queues[sm].append(task)
        free_at[sm] = finish
        makespan = max(makespan, finish)
        for node in _released(("t", task), finish, succ, remaining, ready_at):
            released_by[node[1]] = sm
            heapq.heappush(waiting, (ready_at[node], -level[node], node[1]))
    return StaticSchedule(tuple(tuple(q) for q in queues), makespan)


def mixed_schedule(graph: TaskGraph, num_queues: int, ring_calls=None,
                   scheduler=list_schedule) -> tuple[StaticSchedule, set[int]]:
    """(the static queues, the ring's calls) of a mixed schedule: ``ring_calls`` (by default
    the calls marked ``schedule="dynamic"``) go through the ready ring; the others keep their
    places in ``scheduler``'s queues over the whole graph, so that queues and ring follow one
    topological order."""
    if ring_calls is None:
        ring_calls = {c.index for c in graph.calls if c.schedule == "dynamic"}
    ring_calls = set(ring_calls)
    schedule = scheduler(graph, num_queues)
    return schedule.without(t for c in ring_calls for t in graph.calls[c].tasks), ring_calls


def round_robin_schedule(graph: TaskGraph, num_queues: int) -> StaticSchedule:
    """The topological order dealt onto the SMs in turn: no cost model, no locality (every
    dependent pair of consecutive tasks lands on different SMs). A baseline for schedules."""
    order = graph.topological_order()
    queues = tuple(tuple(order[k::num_queues]) for k in range(num_queues))
    return StaticSchedule(queues, float("nan"))


def _max_level(node, succ, level) -> float:
    best = 0.0
    for m in succ.get(node, ()):
        if m[0] != "t" and m not in level:
            level[m] = _max_level(m, succ, level)
        best = max(best, level[m])
    return best


def _released(node, time, succ, remaining, ready_at):
    """Tasks that become ready when ``node`` completes at ``time``, through element/call nodes."""
    for m in succ.get(node, ()):
        ready_at[m] = max(ready_at.get(m, 0.0), time)
        remaining[m] -= 1
        if remaining[m] == 0:
            if m[0] == "t":
                yield m
            else:
                yield from _released(m, ready_at[m], succ, remaining, ready_at)


@dataclass(frozen=True)
class LateCall:
    """A call whose tasks are pushed at once when every task of the calls it depends on
    (``deps``) has been dispatched or skipped, ``pending`` in all: a call whose tasks' waits
    are known only at run time (data-dependent in-edges, events counted or notified through
    data), or one each of whose tasks waits on every task of ``deps`` (a fan-in over whole
    calls: a dispatch counts the call down once, not each of its tasks)."""

    call: int
    deps: tuple[int, ...]
    pending: int


@dataclass(frozen=True, eq=False)
class DispatchRelease:
    """An ETensor whose trigger maps push their tasks once the element's notifiers are all
    dispatched and the ETensor is armed, not once the element completes: the tasks then wait on
    the element, their preludes (an expert's weights) loading meanwhile, as the static
    kernel's tasks wait on theirs. ``counts[k]``: element k's notifiers, plus one for the
    arming; the counts sit in the pending counts from ``offset`` on."""

    etensor: str
    offset: int
    counts: np.ndarray


@dataclass(frozen=True)
class DynamicPlan:
    """What a dynamic schedule needs to know of a task graph before it runs.

    pending[t]: how many tasks must be dispatched (early push) or finished before t is pushed:
      the tasks that notify an element t waits on (static edges).
    consumers: CSR (indptr, tasks) of the tasks each task's dispatch counts down (late tasks
      are never among them).
    seeds: the tasks pushed at launch (nothing to wait for), in id order.
    late_calls: calls pushed whole once the calls they depend on are dispatched
      (``LateCall``).
    triggered: calls whose tasks their trigger maps push, when the releasing element completes.
    late: the tasks of late and triggered calls.
    releases: the triggers released at dispatch (``DispatchRelease``), from ETensor name.
    num_ring_tasks: the tasks that go through the ring (before any is skipped).
    capacity: ring slots: every task is pushed at most once.
    """

    pending: np.ndarray
    consumer_indptr: np.ndarray
    consumer_tasks: np.ndarray
    seeds: tuple[int, ...]
    late_calls: tuple[LateCall, ...]
    triggered: frozenset[int]
    late: frozenset[int]
    num_ring_tasks: int
    releases: dict[str, DispatchRelease]

    @property
    def capacity(self) -> int:
        return len(self.pending)

    def consumers(self, task: int) -> np.ndarray:
        return self.consumer_tasks[self.consumer_indptr[task]:self.consumer_indptr[task + 1]]

    def first_consumers(self) -> np.ndarray:
        """Each task's first consumer (-1: none), so that a dispatch finds it without the
        round trip through ``consumer_indptr``; with ``ONLY_PRODUCER`` where the task is that
        consumer's only producer: its dispatch makes the consumer ready without a count-down,
        and a CTA that runs the consumer next has done all it waits on."""
        n = len(self.consumer_indptr) - 1
        first = np.full(max(1, n), -1, np.int32)
        some = np.flatnonzero(np.diff(self.consumer_indptr) > 0)
        consumers = self.consumer_tasks[self.consumer_indptr[some]]
        first[some] = consumers | np.where(self.pending[consumers] == 1, ONLY_PRODUCER, 0)
        return first

    def tables(self, seeds_at_launch: bool = False) -> list[np.ndarray]:
        """The read-only int32 tables a ring kernel takes (``ReadyRing.inputs``): pending
        counts (tasks, then late calls), the consumer CSR and each task's first consumer,
        the ring's initial slots (seeds, then -1) and its initial head, tail and expected
        task count. ``seeds_at_launch``:
        the ring starts empty, the kernel pushing the seeds the launch's sizes keep."""
        seeds = () if seeds_at_launch else self.seeds
        ring0 = np.full(max(1, self.capacity), -1, np.int32)
        ring0[:len(seeds)] = seeds
        return [self.initial_pending(), self.consumer_indptr, self.consumer_tasks,
                self.first_consumers(), ring0,
                np.array([0, len(seeds), self.num_ring_tasks], np.int32)]

    def state_sizes(self) -> dict[str, int]:
        """The ring kernel's working state, fresh every launch (``ReadyRing.outputs``):
        pending counts (tasks, late calls, then the elements of triggers released at
        dispatch), one ring slot and one release mark bit per task, and head, tail and the
        expected task count."""
        n = max(1, self.capacity)
        return {"pending": len(self.initial_pending()), "ring": n, "head_tail": 3,
                "marks": -(-n // 32)}

    def initial_pending(self) -> np.ndarray:
        return np.concatenate([self.pending, [lc.pending for lc in self.late_calls],
                               *(r.counts for r in self.releases.values())]).astype(np.int32)

    def late_dependents(self, call: int) -> list[int]:
        """Positions in ``late_calls`` of the late calls that wait for ``call``."""
        return [k for k, late in enumerate(self.late_calls) if call in late.deps]

    @staticmethod
    def of(graph: TaskGraph, ring_calls: set[int] | None = None, *,
           rank_local: bool = False, num_ctas: int | None = None) -> "DynamicPlan":
        """The plan for the tasks of ``ring_calls`` (all calls by default); the others run
        from static queues in the same kernel and count their consumers down as the ring's
        tasks do.

        ``rank_local``: a plan of several ranks whose dispatches count down only tasks of
        their own rank, one ring per rank (a rank's kernel runs on it alone). A call with a
        task that waits on another rank's notifies is late: it is pushed once every task of
        the rank's earlier calls (program order, the same on every rank) is dispatched.
        That keeps the ranks free of deadlock: take the earliest call whose tasks wait
        forever somewhere, on remote producers of earlier calls; those producers' rank
        dispatched them before pushing any task of a later call that could wait, so they
        run, and they wait only on earlier calls, which complete.

        ``num_ctas``: the CTAs that take the ring's tasks. A trigger is released at dispatch
        (``DispatchRelease``) only where the tasks it releases are at most that many (None:
        any count): a released task holds its CTA while it waits, and more of them than
        CTAs could keep every CTA from ready work (the MoE layer's down tasks at 1024 tokens
        ran 1.2% slower so)."""
        ring_calls = set(range(len(graph.calls))) if ring_calls is None else set(ring_calls)
        runtime = graph.dynamically_notified() | set(graph.arm_inputs())
        triggered = frozenset(c.index for c in graph.calls
                              if c.triggers and c.index in ring_calls)
        notifiers = graph.element_notifiers()
        deps = defaultdict(set, graph.call_dependencies())
        remote = set()
        if rank_local:
            remote = {graph.task_call[t] for t in range(graph.num_tasks)
                      if any(graph.rank_of(p) != graph.rank_of(t)
                             for e in graph.waits[t] for p in notifiers[e])}
            for c in remote:
                deps[c] = {d.index for d in graph.calls[:c] if d.rank == graph.calls[c].rank}
        late_calls = tuple(
            LateCall(c.index, tuple(sorted(deps[c.index])),
                     sum(graph.calls[d].num_tasks for d in deps[c.index]))
            for c in graph.calls if c.index in ring_calls and c.index not in triggered and (
                c.index in remote or any(e.map.is_data_dependent or e.etensor in runtime
                                         for e in c.in_edges)))
        late = frozenset(t for k in (*triggered, *(lc.call for lc in late_calls))
                         for t in graph.calls[k].tasks)
        producers = {task: frozenset(p for e in graph.waits[task] for p in notifiers[e])
                     - {task} for task in range(graph.num_tasks)
                     if task not in late and graph.task_call[task] in ring_calls}
        whole = tuple(LateCall(c.index, deps, len(producers[c.first_task]))
                      for c in graph.calls if c.first_task in producers
                      for deps in [_whole_calls_waited(graph, c, producers)] if deps)
        late_calls += whole
        late |= {t for lc in whole for t in graph.calls[lc.call].tasks}
        consumers = [set() for _ in range(graph.num_tasks)]
        pending = np.zeros(graph.num_tasks, np.int32)
        for task, of in producers.items():
            if task in late:
                continue
            pending[task] = len(of)
            for p in of:
                consumers[p].add(task)
        indptr = np.zeros(graph.num_tasks + 1, np.int32)
        indptr[1:] = np.cumsum([len(c) for c in consumers])
        flat = np.array([t for c in consumers for t in sorted(c)], np.int32)
        seeds = tuple(t for t in range(graph.num_tasks) if pending[t] == 0 and t not in late
                      and graph.task_call[t] in ring_calls) \
            + tuple(t for lc in late_calls if lc.pending == 0 for t in graph.calls[lc.call].tasks)
        releases, at = {}, len(pending) + len(late_calls)
        if not rank_local and graph.world_size == 1:
            for name in sorted(_released_at_dispatch(graph, triggered, num_ctas)):
                counts = np.ones(graph.etensors[name].shape, np.int32)
                for elem, tasks in notifiers.items():
                    if elem[0] == name:
                        counts[elem[1]] += len(tasks)
                releases[name] = DispatchRelease(name, at, counts.ravel())
                at += counts.size
        return DynamicPlan(pending, indptr, flat, seeds, late_calls, triggered, late,
                           sum(graph.calls[c].num_tasks for c in ring_calls), releases)


def _released_at_dispatch(graph: TaskGraph, triggered: frozenset[int],
                          num_ctas: int | None) -> set[str]:
    """The ETensors whose triggers a ready ring releases at dispatch: armed at run time
    (``TaskGraph.gates``), notified through static maps only, and releasing tasks of ring
    calls only, whose one in-edge the trigger is, at most ``num_ctas`` of them."""
    gates = graph.gates()
    sources = {e.etensor for c in graph.calls for e in c.triggers}
    released = {name: [c for c in graph.calls if any(e.etensor == name for e in c.triggers)]
                for name in sources & set(gates)}
    return {name for name, calls in released.items()
            if graph.etensors[name].count_tensor is None
            and all(c.index in triggered and len(c.in_edges) == 1 for c in calls)
            and (num_ctas is None or sum(c.num_tasks for c in calls) <= num_ctas)
            and not any(e.etensor == name and e.map.is_data_dependent
                        for c in graph.calls for e in c.out_edges)}


def _whole_calls_waited(graph: TaskGraph, call, producers: dict) -> tuple[int, ...] | None:
    """The calls every task of which each task of ``call`` waits on (``producers``: each
    task's), where they are the same for all its tasks and there are several tasks on either
    side: pushed whole, ``call`` costs each producer's dispatch one count-down rather than one
    per task. None otherwise (a single consumer is held by the CTA its count-down makes it
    ready on; a single producer chains its first consumer)."""
    waited = producers[call.first_task]
    if call.num_tasks < 2 or len(waited) < 2 or any(producers[t] != waited
                                                    for t in call.tasks):
        return None
    deps = sorted({graph.task_call[p] for p in waited})
    if sum(graph.calls[d].num_tasks for d in deps) != len(waited):
        return None
    return tuple(deps)
