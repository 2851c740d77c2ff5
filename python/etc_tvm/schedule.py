"""Static schedules: per-SM task queues computed at compile time.

``list_schedule`` is list scheduling over the task graph, simulated in time: the SM that frees up
first takes, among the tasks whose predecessors have finished by then, the one with the longest
cost-weighted path to the end (critical path first); if none has, the first to become ready. Tasks are placed in a topological order and every SM runs its
queue in placement order, so the earliest unfinished task in that order is never blocked: the
schedule cannot deadlock. Costs come from each device function's ``cost`` hint.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from .task_graph import TaskGraph


@dataclass(frozen=True)
class StaticSchedule:
    """``queues[sm]``: the task ids SM ``sm`` runs, in order; ``makespan``: the estimate."""

    queues: tuple[tuple[int, ...], ...]
    makespan: float

    @property
    def num_sms(self) -> int:
        return len(self.queues)

    def csr(self) -> tuple[np.ndarray, np.ndarray]:
        """(indptr int32[num_sms + 1], tasks int32[num_tasks]): the layout kernels read."""
        indptr = np.zeros(self.num_sms + 1, np.int32)
        indptr[1:] = np.cumsum([len(q) for q in self.queues])
        tasks = np.array([t for q in self.queues for t in q], np.int32)
        return indptr, tasks


def list_schedule(graph: TaskGraph, num_sms: int) -> StaticSchedule:
    """Critical-path-first list scheduling of ``graph`` onto ``num_sms`` queues."""
    if num_sms < 1:
        raise ValueError(f"num_sms must be positive, got {num_sms}")
    order = graph.topological_order()  # also rejects cycles
    succ, indeg = graph.dependency_graph()
    cost = [graph.call_of(t).fn.cost for t in range(graph.num_tasks)]

    level: dict = {}  # longest cost-weighted path from a node to the end
    for task in reversed(order):
        level[("t", task)] = cost[task] + _max_level(("t", task), succ, level)

    remaining = dict(indeg)
    ready_at: dict = {}
    waiting = []  # (ready time, -level, task): every predecessor placed
    for t in range(graph.num_tasks):
        if remaining[("t", t)] == 0:
            waiting.append((0.0, -level[("t", t)], t))
    for node in [n for n, d in indeg.items() if d == 0 and n[0] != "t"]:  # unnotified elements
        waiting += [(0.0, -level[m], m[1]) for m in _released(node, 0.0, succ, remaining,
                                                              ready_at)]
    heapq.heapify(waiting)
    ready = []  # (-level, task): ready by the time the next SM frees up
    sms = [(0.0, sm) for sm in range(num_sms)]
    queues = [[] for _ in range(num_sms)]
    makespan = 0.0
    while waiting or ready:
        free, sm = heapq.heappop(sms)
        if not ready or (waiting and waiting[0][0] <= free):
            now = max(free, waiting[0][0]) if not ready else free
            while waiting and waiting[0][0] <= now:
                at, priority, task = heapq.heappop(waiting)
                heapq.heappush(ready, (priority, task))
            free = now
        _, task = heapq.heappop(ready)
        finish = free + cost[task]
        queues[sm].append(task)
        heapq.heappush(sms, (finish, sm))
        makespan = max(makespan, finish)
        for node in _released(("t", task), finish, succ, remaining, ready_at):
            heapq.heappush(waiting, (ready_at[node], -level[node], node[1]))
    return StaticSchedule(tuple(tuple(q) for q in queues), makespan)


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
