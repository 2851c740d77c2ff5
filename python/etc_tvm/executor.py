"""The CPU reference executor: runs a graph function with the GPU's counter semantics.

Each task runs its device function's NumPy reference as one atomic step: wait, body, notify.
A task may start once the tensors its waits read are complete and every event element it waits
on is armed and at 0; a notify decrements one counter. Which of the startable tasks runs next
is the order's choice, so one graph can be run

* ``StaticOrder(queues)``: as a static per-SM schedule: SM k runs ``queues[k]`` in order and
  blocks at a task until it can start, as a persistent CTA spinning on its waits does;
* ``ReadyQueueOrder()``: as a ready queue, first ready first run;
* ``DynamicQueueOrder(num_ctas)``: as the GPU dynamic schedule, persistent CTAs popping a ring
  that a task enters when its producers have been dispatched (early push);
* ``MixedOrder(queues, ring_calls)``: as the GPU mixed schedule, static queues and a ring;
* ``ClaimedOrder(num_ctas)``: as the persistent kernel whose CTAs claim tasks in id order
  (``KernelOptions.claim``);
* ``RandomOrder(seed)``: as a random valid interleaving.

It is the oracle for schedules and GPU results: outputs start poisoned (NaN, or the most
negative integer), a deadlock is reported with the blocked tasks, their events and counters, and
an out-of-range data-dependent index, an over-notified element or a data race through an index
tensor is an ``ExecutionError``.

A graph function of world size W runs as W ranks at once (``execute_ranks``): the task graph
holds every rank's tasks (``TaskGraph``: rank-major ids, one counter array per rank for an
unsharded ETensor, one global array for a sharded one), so every order interleaves the ranks'
tasks and a deadlock or race across ranks gets the same report, naming the rank. A reference
that declares ``rank``, ``world_size`` or ``peers`` gets them (see ``device_func``).
"""
from __future__ import annotations

import random
from collections import defaultdict, deque
from typing import Mapping, Sequence

import ml_dtypes
import numpy as np
import tvm

from .errors import DeadlockError, EtcError, ExecutionError
from .graph_func import GraphFunc
from .schedule import DynamicPlan
from .task_graph import CallNode, TaskGraph
from .tir_sched.persistent import positive_count

class Order:
    """Chooses the next task among those that can start; subclasses are the policies."""

    def start(self, run: "_Run") -> None:
        self.run = run

    def became_ready(self, task: int) -> None:
        pass

    def next(self) -> int | None:
        raise NotImplementedError

    def blocked(self) -> list[tuple[int, str]]:
        """(task, where) for the report of a deadlock."""
        return [(t, "") for t in self.run.pending_tasks()]


class ReadyQueueOrder(Order):
    """The dynamic schedule: a FIFO of tasks in the order they became ready."""

    def start(self, run):
        super().start(run)
        self.queue = deque()

    def became_ready(self, task):
        self.queue.append(task)

    def next(self):
        return self.queue.popleft() if self.queue else None


class RandomOrder(Order):
    """A random valid interleaving: any ready task, uniformly."""

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    def start(self, run):
        super().start(run)
        self.ready: list[int] = []

    def became_ready(self, task):
        self.ready.append(task)

    def next(self):
        if not self.ready:
            return None
        k = self.rng.randrange(len(self.ready))
        self.ready[k], self.ready[-1] = self.ready[-1], self.ready[k]
        return self.ready.pop()


class StaticOrder(Order):
    """A static schedule: per-SM queues of task ids, each run in order.

    Among the SMs whose next task can start, the lowest-numbered goes first, or a random one
    when ``seed`` is given (other interleavings of the same schedule).
    """

    def __init__(self, queues: Sequence[Sequence[int]], seed: int | None = None):
        self.queues = [list(map(int, q)) for q in queues]
        self.rng = random.Random(seed) if seed is not None else None
        self.rank_queues = None
        self.labels = [f" on SM {sm}" for sm in range(len(self.queues))]

    @classmethod
    def per_rank(cls, rank_queues: Sequence[Sequence[Sequence[int]]],
                 seed: int | None = None) -> "StaticOrder":
        """A static schedule on every rank: ``rank_queues[r][k]`` is SM k's queue on rank r,
        in the task ids of one rank (``TaskGraph.rank_task`` maps them to the global ones)."""
        order = cls([], seed)
        order.rank_queues = [[list(map(int, q)) for q in queues] for queues in rank_queues]
        return order

    def start(self, run):
        super().start(run)
        if self.rank_queues is not None:
            graph = run.graph
            if len(self.rank_queues) != graph.world_size:
                raise EtcError(f"static queues for {len(self.rank_queues)} ranks, the graph "
                               f"runs on {graph.world_size}")
            self.queues = [[graph.rank_task(r, t) for t in q]
                           for r, queues in enumerate(self.rank_queues) for q in queues]
            self.labels = [f" on SM {sm} of rank {r}" for r, queues in
                           enumerate(self.rank_queues) for sm in range(len(queues))]
        listed = sorted(t for q in self.queues for t in q)
        if listed != list(range(run.graph.num_tasks)):
            missing = sorted(set(range(run.graph.num_tasks)) - set(listed))
            extra = sorted({t for t in listed if listed.count(t) > 1}
                           | {t for t in listed if not 0 <= t < run.graph.num_tasks})
            raise EtcError(f"static queues must hold every task exactly once: missing "
                           f"{missing[:8]}, repeated or unknown {extra[:8]}")
        self.heads = [0] * len(self.queues)

    def next(self):
        ready = [sm for sm, q in enumerate(self.queues)
                 if self.heads[sm] < len(q) and self.run.is_ready(q[self.heads[sm]])]
        if not ready:
            return None
        sm = self.rng.choice(ready) if self.rng else ready[0]
        self.heads[sm] += 1
        return self.queues[sm][self.heads[sm] - 1]

    def blocked(self):
        return [(q[self.heads[sm]], self.labels[sm]) for sm, q in enumerate(self.queues)
                if self.heads[sm] < len(q)]


class ClaimedOrder(Order):
    """The persistent kernel whose CTAs claim tasks in id order (``KernelOptions.claim``),
    modelled: each of ``num_ctas`` CTAs holds the task it claimed and blocks on it until it
    can start; when it starts, the CTA claims the next id (the kernel claims once a task's
    waits are done, which in this model's atomic tasks is the start). Among the CTAs whose
    task can start, the lowest-numbered goes first, or a random one given ``seed``. A task
    that waits on a higher id can deadlock it, as it would the kernel (which refuses such
    graphs)."""

    def __init__(self, num_ctas: int = 132, seed: int | None = None):
        self.num_ctas = positive_count(f"{type(self).__name__}: num_ctas", num_ctas)
        self.rng = random.Random(seed) if seed is not None else None

    def start(self, run):
        super().start(run)
        self.claimed = 0
        self.ctas = [self._claim() for _ in range(self.num_ctas)]

    def _claim(self) -> int | None:
        task, self.claimed = self.claimed, self.claimed + 1
        return task if task < self.run.graph.num_tasks else None

    def next(self):
        ready = [k for k, t in enumerate(self.ctas) if t is not None and self.run.is_ready(t)]
        if not ready:
            return None
        cta = self.rng.choice(ready) if self.rng else ready[0]
        task, self.ctas[cta] = self.ctas[cta], self._claim()
        return task

    def blocked(self):
        return [(t, f" claimed by CTA {k}") for k, t in enumerate(self.ctas) if t is not None]


class DynamicQueueOrder(Order):
    """The GPU dynamic schedule, modelled: ``num_ctas`` persistent CTAs pop a FIFO ring.

    It follows ``schedule.DynamicPlan``: a task is pushed once every task that notifies an
    element it waits on has been dispatched (``early_push``, the default) or has finished; an
    idle CTA pops the oldest task and stays on it, spinning, until its waits are satisfied.
    Early push is deadlock-free: the earliest-dispatched unfinished task waits only on tasks
    dispatched before it, which have finished. The first consumer that a CTA's dispatch makes
    ready is not pushed: that CTA keeps it and runs it next. A late call's tasks are pushed
    together once every task of the calls it depends on is dispatched; a triggered task once
    it is ready, or, where its trigger is released at dispatch (``DispatchRelease``), once its
    element's notifiers are dispatched and the trigger armed (it then waits on a CTA).
    ``max_queued`` records the deepest the ring got (the plan's capacity covers it). With
    several ranks, each rank has ``num_ctas`` CTAs and a ring of its own tasks; a CTA keeps
    only a consumer of its own rank.
    """

    def __init__(self, num_ctas: int = 132, early_push: bool = True, rank_local: bool = False):
        """``rank_local``: the plan of the ranks' own kernels (``DynamicPlan.of``), in which
        a dispatch counts down only tasks of its rank."""
        self.num_ctas = positive_count(f"{type(self).__name__}: num_ctas", num_ctas)
        self.early_push, self.rank_local = early_push, rank_local

    def start(self, run):
        super().start(run)
        self.plan = self.make_plan(run.graph)
        self.pending = self.plan.pending.copy()
        self.late_pending = [lc.pending for lc in self.plan.late_calls]
        self.release_left = {name: r.counts.copy() for name, r in self.plan.releases.items()}
        gates = run.graph.gates()
        self.unarmed = {name: gates[name] for name in self.plan.releases}
        self.released_by: dict[str, dict[tuple, list[int]]] = {}  # name -> element -> tasks
        world = run.graph.world_size
        self.rings, self.pushed = [deque() for _ in range(world)], set()
        self.ctas: list[int | None] = [None] * (self.num_ctas * world)  # rank-major
        self.held: list[int | None] = [None] * (self.num_ctas * world)  # each CTA's next task
        self.max_queued = 0
        for task in self.plan.seeds:
            self._push(task)

    def make_plan(self, graph) -> DynamicPlan:
        return DynamicPlan.of(graph, rank_local=self.rank_local, num_ctas=self.num_ctas)

    @property
    def ring(self) -> deque:
        """Rank 0's ring (the only one with one rank)."""
        return self.rings[0]

    def _cta_rank(self, cta: int) -> int:
        return cta // self.num_ctas

    def _cta_name(self, cta: int) -> str:
        world = self.run.graph.world_size
        return f"CTA {cta % self.num_ctas}" + (f" of rank {cta // self.num_ctas}"
                                               if world > 1 else "")

    def _push(self, task: int) -> None:
        if task not in self.pushed:
            self.pushed.add(task)
            ring = self.rings[self.run.graph.rank_of(task)]
            ring.append(task)
            self.max_queued = max(self.max_queued, len(ring))

    def _take(self, cta: int, task: int) -> None:
        """CTA ``cta`` takes ``task``; under early push its consumers are counted down now."""
        self.ctas[cta] = task
        if self.early_push:
            self._release_consumers(task, cta)

    def _take_held(self, cta: int) -> bool:
        task, self.held[cta] = self.held[cta], None
        if task is not None:
            self._take(cta, task)
        return task is not None

    def _release_consumers(self, task: int, cta: int) -> None:
        for k, c in enumerate(self.plan.consumers(task)):
            self.pending[c] -= 1
            if self.pending[c] == 0:
                if k == 0 and self.run.graph.rank_of(int(c)) == self._cta_rank(cta):
                    self.pushed.add(int(c))
                    self.held[cta] = int(c)
                else:
                    self._push(int(c))
        for name, idx in self.run.graph.notifies[task]:
            if name in self.release_left:
                self._count_down_release(name, idx)
        for k in self.plan.late_dependents(self.run.graph.task_call[task]):
            self.late_pending[k] -= 1
            if self.late_pending[k] == 0:
                for t in self.run.graph.calls[self.plan.late_calls[k].call].tasks:
                    self._push(t)

    def _count_down_release(self, name: str, idx: tuple) -> None:
        """One notifier of element ``idx`` of ``name`` was dispatched, or ``name`` armed: the
        last count pushes the tasks the element releases."""
        graph = self.run.graph
        flat = int(np.ravel_multi_index(idx, graph.etensors[name].shape))
        self.release_left[name][flat] -= 1
        if self.release_left[name][flat]:
            return
        if name not in self.released_by:  # armed: the maps can be read
            by = self.released_by[name] = {}
            for call in graph.calls:
                if any(e.etensor == name for e in call.triggers):
                    for task, elems in self.run.triggers_of(call).items():
                        for elem in elems:
                            by.setdefault(elem[1], []).append(task)
        for task in self.released_by[name].get(tuple(idx), ()):
            self._push(task)

    def _arm_releases(self) -> None:
        """Count down every element of each trigger released at dispatch whose arming calls
        have all finished."""
        for name, calls in list(self.unarmed.items()):
            if all(self.run.unfinished[c] == 0 for c in calls):
                del self.unarmed[name]
                for idx in np.ndindex(*self.run.graph.etensors[name].shape):
                    self._count_down_release(name, idx)

    def became_ready(self, task):
        """A triggered task is pushed when its releasing element completes (or, skipped, when
        its trigger resolves); one its trigger releases at dispatch, only if skipped."""
        call = self.run.graph.call_of(task)
        if call.index in self.plan.triggered and (
                not any(e.etensor in self.release_left for e in call.triggers)
                or task in self.run.skipped.get(call.index, ())):
            self._push(task)

    def next(self):
        self._arm_releases()
        for k, task in enumerate(self.ctas):
            ring = self.rings[self._cta_rank(k)]
            if task is None and not self._take_held(k) and ring:
                self._take(k, ring.popleft())
        for k, task in enumerate(self.ctas):
            if task is not None and self.run.is_ready(task):
                self.ctas[k] = None
                if not self.early_push:
                    self._release_consumers(task, k)
                return task
        return None

    def blocked(self):
        held = [(t, f" on {self._cta_name(k)}") for k, t in enumerate(self.ctas)
                if t is not None]
        queued = [(t, " (in the ring)") for ring in self.rings for t in ring]
        queued += [(t, f" (next on {self._cta_name(k)})") for k, t in enumerate(self.held)
                   if t is not None]
        unpushed = [(t, " (not pushed)") for t in self.run.pending_tasks()
                    if t not in self.pushed]
        return held + queued + unpushed


class MixedOrder(DynamicQueueOrder):
    """The GPU mixed schedule, modelled: persistent CTA k runs ``queues[k]`` (the static
    calls' tasks) and the ready ring of ``ring_calls``' tasks. An idle CTA takes the head of
    its queue if it can start (after the ring task its last dispatch held), else pops the
    ring (never blocking on an empty ring); taking a task counts down its consumers in the
    ring either way."""

    def __init__(self, queues: Sequence[Sequence[int]], ring_calls):
        super().__init__(num_ctas=len(queues))
        self.queues = [list(map(int, q)) for q in queues]
        self.ring_calls = set(ring_calls)

    def make_plan(self, graph) -> DynamicPlan:
        return DynamicPlan.of(graph, self.ring_calls, num_ctas=self.num_ctas)

    def start(self, run):
        if run.graph.world_size > 1:
            raise EtcError("the mixed schedule is modelled for one rank; run a graph of world "
                           f"size {run.graph.world_size} under another order")
        ring_tasks = {t for c in self.ring_calls for t in run.graph.calls[c].tasks}
        listed = sorted(t for q in self.queues for t in q)
        if listed != sorted(set(range(run.graph.num_tasks)) - ring_tasks):
            raise EtcError("the queues of a mixed schedule must hold every task outside the "
                           "ring exactly once, and none of the ring's")
        super().start(run)
        self.heads = [0] * len(self.queues)

    def next(self):
        self._arm_releases()
        for k, task in enumerate(self.ctas):
            if task is not None or self._take_held(k):
                continue
            queue, head = self.queues[k], self.heads[k]
            if head < len(queue) and self.run.is_ready(queue[head]):
                self.heads[k] += 1
                self._take(k, queue[head])
            elif self.ring:
                self._take(k, self.ring.popleft())
        for k, task in enumerate(self.ctas):
            if task is not None and self.run.is_ready(task):
                self.ctas[k] = None
                return task
        return None

    def blocked(self):
        queued = [(q[self.heads[k]], f" (next in the queue of CTA {k})")
                  for k, q in enumerate(self.queues) if self.heads[k] < len(q)]
        return super().blocked() + queued


def execute(graph: GraphFunc, *inputs: np.ndarray, order: Order | None = None,
            trace: list | None = None, schedule_dims: Mapping[str, int] | None = None):
    """Run ``graph`` on NumPy ``inputs``; returns its output array(s).

    ``order`` defaults to ``ReadyQueueOrder()``. When ``trace`` is a list, the ids of the tasks
    run are appended to it in order (skipped tasks included).

    ``schedule_dims`` runs the task graph instantiated for larger sizes (a schedule compiled for
    a sample size, reused for a smaller one): the tasks outside the inputs' own grids are
    skipped. A skipped task waits for nothing, runs no body and performs its static notifies,
    so every count of the larger graph still completes.

    A graph of world size above 1 runs with ``execute_ranks``.
    """
    if graph.world_size != 1:
        raise EtcError(f"{graph.name} has world size {graph.world_size}: run it with "
                       "execute_ranks(graph, [inputs of rank 0, ..., inputs of rank "
                       f"{graph.world_size - 1}])")
    return execute_ranks(graph, [inputs], order=order, trace=trace,
                         schedule_dims=schedule_dims)[0]


def execute_ranks(graph: GraphFunc, inputs: Sequence[Sequence[np.ndarray]], *,
                  order: Order | None = None, trace: list | None = None,
                  schedule_dims: Mapping[str, int] | None = None) -> list:
    """Run ``graph`` as all its ranks at once: ``inputs[r]`` are rank r's input arrays (the
    same shapes on every rank, as SPMD needs); returns ``[outputs of rank 0, ...]``, each as
    ``execute`` returns them. ``order`` and ``trace`` see the tasks of every rank, numbered
    rank-major (``TaskGraph.rank_task``); the rest is as for ``execute``.
    """
    world = graph.world_size
    if isinstance(inputs, np.ndarray) or len(inputs) != world or not all(
            isinstance(x, (list, tuple)) for x in inputs):
        got = "an array" if isinstance(inputs, np.ndarray) else f"{len(inputs)} entries" \
            if all(isinstance(x, (list, tuple)) for x in inputs) else "not a list of lists"
        raise EtcError(f"{graph.name} runs on {world} ranks: execute_ranks needs one list of "
                       f"inputs per rank, got {got}")
    if order is not None and not isinstance(order, Order):
        raise EtcError(f"{graph.name}: order={order!r} is not an executor Order (e.g. "
                       "ReadyQueueOrder(), StaticOrder(queues), ClaimedOrder(num_ctas))")
    dims = bind_dims(graph, inputs[0])
    for r in range(1, world):
        other = bind_dims(graph, inputs[r], where=f"rank {r}: ")
        if other != dims:
            raise EtcError(f"{graph.name}: rank {r}'s inputs give dims {other}, rank 0's "
                           f"{dims}; every rank runs the same shapes")
    actual = task_graph = TaskGraph.build(graph, dims)
    out_of_range: set[int] = set()
    if schedule_dims is not None:
        task_graph = TaskGraph.build(graph, _at_least(dims, schedule_dims))
        out_of_range = {t for big, c in zip(task_graph.calls, actual.calls) for t in big.tasks
                        if not all(x < n for x, n in zip(big.coords(t), c.grid))}
    task_graph.validate()
    for call in task_graph.calls:
        call.fn.reference  # noqa: B018 (raises for a device function without one)
    run = _Run(task_graph, inputs, order or ReadyQueueOrder(), trace, out_of_range,
               [t.shape for t in actual.tensors])
    run.run()
    results = []
    for r in range(world):
        outs = tuple(run.arrays[t] for t in task_graph.rank_outputs(r))
        results.append(outs if task_graph.returns_tuple else outs[0])
    return results


def _at_least(dims: Mapping[str, int], schedule_dims: Mapping[str, int]) -> dict[str, int]:
    for name, n in schedule_dims.items():
        if name not in dims:
            raise EtcError(f"schedule_dims names '{name}', not a dim of the graph ({sorted(dims)})")
        if n < dims[name]:
            raise EtcError(f"schedule_dims {name}={n} is smaller than the inputs' {dims[name]}")
    return {**dims, **schedule_dims}


def bind_dims(graph: GraphFunc, inputs: Sequence[np.ndarray], where: str = "") -> dict[str, int]:
    """The symbolic dims of ``graph`` from the shapes of its inputs, checked for consistency;
    ``where`` prefixes the errors (which rank's inputs)."""
    try:
        return _bind_dims(graph, inputs)
    except EtcError as err:
        if not where:
            raise
        raise EtcError(f"{where}{err}") from None


def _bind_dims(graph: GraphFunc, inputs: Sequence[np.ndarray]) -> dict[str, int]:
    params = graph.func.params
    if len(inputs) != len(params):
        raise EtcError(f"{graph.name} takes {len(params)} inputs, got {len(inputs)}")
    dims: dict[str, int] = {}
    for p, x in zip(params, inputs):
        want = [d for d in p.ty.shape.values]
        if not isinstance(x, np.ndarray):
            raise EtcError(f"{graph.name}: input '{p.name}' is a {type(x).__name__}, not a "
                           "NumPy array")
        if x.ndim != len(want):
            raise EtcError(f"{graph.name}: input '{p.name}' has rank {len(want)}, "
                           f"got shape {x.shape}")
        if np.dtype(x.dtype) != numpy_dtype(str(p.ty.dtype)):
            raise EtcError(f"{graph.name}: input '{p.name}' is {p.ty.dtype}, "
                           f"got {x.dtype}")
        for k, (d, n) in enumerate(zip(want, x.shape)):
            if isinstance(d, tvm.tirx.Var):
                expect, ok = f"{dims.get(d.name, n)} ({d.name})", dims.setdefault(d.name, n) == n
            else:
                expect, ok = str(int(d)), int(d) == n
            if not ok:
                raise EtcError(f"{graph.name}: dim {k} of input '{p.name}' is {n}, "
                               f"expected {expect}")
    return dims


def numpy_dtype(dtype: str) -> np.dtype:
    try:
        return np.dtype(dtype)
    except TypeError:
        return np.dtype(getattr(ml_dtypes, dtype))


def poison(shape, dtype: str) -> np.ndarray:
    dt = numpy_dtype(dtype)
    if np.issubdtype(dt, np.integer):
        return np.full(shape, np.iinfo(dt).min, dt)
    if dt == np.bool_:
        return np.zeros(shape, dt)
    return np.full(shape, np.nan, dt)


class Peers:
    """``peers[q].name``: rank q's copy of the symmetric tensor parameter ``name`` of a task's
    device function, which its reference may write (a put) or read (a get)."""

    def __init__(self, run: "_Run", call: CallNode):
        self._run, self._call = run, call
        self._params = dict(zip((p.name for p in call.fn.buffer_params), call.tensor_args()))

    def __len__(self) -> int:
        return self._run.graph.world_size

    def __getitem__(self, rank: int) -> "_PeerTensors":
        if not 0 <= rank < len(self):
            raise ExecutionError(f"{self._call.name} on rank {self._call.rank} reaches rank "
                                 f"{rank}; the world size is {len(self)}")
        return _PeerTensors(self, rank)


class _PeerTensors:
    def __init__(self, peers: Peers, rank: int):
        self._peers, self._rank = peers, rank

    def __getattr__(self, name: str) -> np.ndarray:
        peers = self._peers
        fn = peers._call.fn.name
        if name not in peers._params:
            raise ExecutionError(f"{fn}: peers[{self._rank}].{name}: {fn} has no tensor "
                                 f"parameter '{name}'")
        graph = peers._run.graph
        node = graph.tensors[peers._params[name]]
        if not node.symmetric:
            raise ExecutionError(f"{fn}: peers[{self._rank}].{name}: '{node.name}' is not "
                                 "symmetric; only Tensor(..., symmetric=True) outputs are "
                                 "reachable on other ranks")
        return peers._run.arrays[graph.replicas(node.index)[self._rank]]


class _Run:
    """The state of one run: counters, armed ETensors, complete tensors, task states."""

    def __init__(self, graph: TaskGraph, inputs, order: Order, trace, out_of_range, shapes):
        """``shapes``: of the tensors at the inputs' sizes (``graph`` may be for larger ones)."""
        self.graph, self.order, self.trace = graph, order, trace
        self.out_of_range = out_of_range
        self.arrays = {}
        updated = {t for c in graph.calls for p, t in zip(c.fn.buffer_params, c.tensor_args())
                   if p.name in c.fn.updates}
        for node, shape in zip(graph.tensors, shapes):
            if node.param is not None:  # a copy: inputs a tile updates change only in the run
                arr = np.array(inputs[node.rank][node.param], copy=True)
                arr.flags.writeable = node.index in updated
                self.arrays[node.index] = arr
            else:
                self.arrays[node.index] = poison(shape, node.dtype)
        self.counters = graph.static_counts()
        self.initial = {name: c.copy() for name, c in self.counters.items()}
        self.arm_inputs = graph.arm_inputs()
        self.armed = {name: name not in self.arm_inputs for name in graph.etensors}
        self.touched = {name: np.zeros(et.shape, bool) for name, et in graph.etensors.items()}
        self.unfinished = [c.num_tasks for c in graph.calls]
        self.needs = [self._needed_tensors(c) for c in graph.calls]
        self.skipped: dict[int, set[int]] = {}  # call -> skipped tasks, once triggers resolve
        self.released: dict[int, dict[int, list]] = {}  # call -> task -> trigger elements
        self.wait_list: dict[int, list] = {}
        self.cursor = [0] * graph.num_tasks
        self.done = [False] * graph.num_tasks
        self.blocked_on = defaultdict(list)
        self.remaining = graph.num_tasks
        self.contexts: dict[int, dict] = {}  # call -> the reference's keyword arguments

    # ---------------------------------------------------------------- readiness
    def _needed_tensors(self, call: CallNode) -> set[int]:
        """Tensors that must be complete before a task of ``call`` can evaluate its waits."""
        need = call.reads(call.in_edges) | call.prelude_reads()
        for e in call.in_edges:
            need |= self.arm_inputs.get(e.etensor, set())
        return {t for t in need if self.graph.tensors[t].producer is not None}

    def complete(self, tensor: int) -> bool:
        """Written: by its rank's producer call, or for a symmetric tensor (which peers write)
        by every rank's."""
        node = self.graph.tensors[tensor]
        if node.symmetric:
            return all(self.unfinished[self.graph.tensors[t].producer] == 0
                       for t in self.graph.replicas(tensor))
        return node.producer is None or self.unfinished[node.producer] == 0

    def blocker(self, task: int):
        """What ``task`` waits for now, or None if it can start."""
        if task in self.out_of_range:
            return None
        call = self.graph.call_of(task)
        for t in self.needs[call.index]:
            if not self.complete(t):
                return ("tensor", t)
        waits = self.wait_list.get(task)
        if waits is None:
            waits = self.wait_list[task] = self._resolve_waits(call, task)
        while self.cursor[task] < len(waits):
            name, idx = waits[self.cursor[task]]
            if not self.armed[name]:
                return ("arm", name)
            if self.counters[name][idx] != 0:
                return ("element", (name, idx))
            self.cursor[task] += 1
        return None

    def is_ready(self, task: int) -> bool:
        return self.blocker(task) is None

    def _resolve_waits(self, call: CallNode, task: int) -> list:
        waits = list(self.graph.waits[task])
        tensors = self._index_tensors(call)
        coords = call.coords(task)
        for e in call.in_edges:
            if e.map.is_data_dependent and not e.map.is_trigger:
                for idx in e.map.evaluate(coords, tensors):
                    waits.append((e.etensor, self.graph.place(
                        e, call, idx, self.graph.task_name(task), ExecutionError)))
        if call.triggers:
            waits += self.triggers_of(call).get(task, [])
        for name, idx in waits:
            self.touched[name][idx] = True
        return waits

    def triggers_of(self, call: CallNode) -> dict[int, list]:
        """Task -> the elements whose trigger maps release it; unreleased tasks are skipped."""
        if call.index not in self.released:
            tensors = self._index_tensors(call)
            released = defaultdict(list)
            for e in call.triggers:
                et = self.graph.etensors[e.etensor]
                for idx in np.ndindex(*et.shape):
                    for coords in e.map.evaluate(idx, tensors):
                        if len(coords) != len(call.grid) or not all(
                                0 <= c < n for c, n in zip(coords, call.grid)):
                            raise ExecutionError(
                                f"trigger map '{e.map}' of {call.name}: "
                                f"{et.element_name(idx)} releases task {call.name}{coords}, "
                                f"outside its tile_num {list(call.grid)}")
                        released[call.first_task + int(np.ravel_multi_index(
                            coords, call.grid))].append((e.etensor, tuple(idx)))
            self.released[call.index] = released
            self.skipped[call.index] = set(call.tasks) - set(released)
        return self.released[call.index]

    def _index_tensors(self, call: CallNode) -> dict[str, np.ndarray]:
        return {p.name: self.arrays[t] for p, t in zip(call.fn.buffer_params, call.tensor_args())}

    # ---------------------------------------------------------------- the loop
    def pending_tasks(self) -> list[int]:
        return [t for t in range(self.graph.num_tasks) if not self.done[t]]

    def run(self) -> None:
        self.order.start(self)
        for name in self.graph.etensors:
            if not self.armed[name] and all(self.complete(t) for t in self.arm_inputs[name]):
                self._arm(name)
        for task in range(self.graph.num_tasks):
            self._examine(task)
        while self.remaining:
            task = self.order.next()
            if task is None:
                raise DeadlockError(self._deadlock_report())
            self._run_task(task)
        self._check_final_counters()

    def _examine(self, task: int) -> None:
        why = self.blocker(task)
        if why is None:
            self.order.became_ready(task)
        else:
            self.blocked_on[why].append(task)

    def _release(self, key) -> None:
        for task in self.blocked_on.pop(key, ()):
            self._examine(task)

    def _run_task(self, task: int) -> None:
        call = self.graph.call_of(task)
        if self.blocker(task) is not None:
            raise AssertionError(f"the order chose {self.graph.task_name(task)}, not ready")
        skipped = task in self.out_of_range or (call.triggers and task in self.skipped[call.index])
        if not skipped:
            arrays = [self.arrays[t] for t in call.tensor_args()]
            call.fn.reference(*call.coords(task), *arrays, **self._context(call))
        notifies = list(self.graph.notifies[task])
        if not skipped:
            notifies += self._dynamic_notifies(call, task)
        self.done[task] = True
        self.remaining -= 1
        if self.trace is not None:
            self.trace.append(task)
        for name, idx in notifies:
            self._notify(name, idx, task)
        self.unfinished[call.index] -= 1
        if self.unfinished[call.index] == 0:
            for t in call.outputs:
                for r in (self.graph.replicas(t) if self.graph.tensors[t].symmetric else (t,)):
                    self._release(("tensor", r))
            for name, need in self.arm_inputs.items():
                if not self.armed[name] and need & set(call.outputs) and all(
                        self.complete(t) for t in need):
                    self._arm(name)

    def _context(self, call: CallNode) -> dict:
        """What the reference declares of ``rank``, ``world_size`` and ``peers``."""
        if call.index not in self.contexts:
            values = {"rank": call.rank, "world_size": self.graph.world_size,
                      "peers": Peers(self, call)}
            self.contexts[call.index] = {k: values[k] for k in call.fn.reference_context}
        return self.contexts[call.index]

    def _dynamic_notifies(self, call: CallNode, task: int) -> list:
        dyn = [e for e in call.out_edges if e.map.is_data_dependent]
        for t in call.reads(dyn):
            if not self.complete(t) and self.graph.tensors[t].producer != call.index:
                raise ExecutionError(
                    f"{self.graph.task_name(task)} notifies through "
                    f"'{self.graph.tensors[t].name}' before "
                    f"{self.graph.calls[self.graph.tensors[t].producer].name} finished writing "
                    "it: make the call wait for it")
        out, tensors = [], self._index_tensors(call)
        for e in dyn:
            for idx in e.map.evaluate(call.coords(task), tensors):
                out.append((e.etensor, self.graph.place(
                    e, call, idx, self.graph.task_name(task), ExecutionError)))
        return out

    def _notify(self, name: str, idx: tuple, task: int) -> None:
        counter = self.counters[name]
        counter[idx] -= 1
        self.touched[name][idx] = True
        if not self.armed[name]:
            return
        if counter[idx] < 0:
            et = self.graph.etensors[name]
            raise ExecutionError(f"{et.element_name(idx)} is notified more times than its wait "
                                 f"count (by {self.graph.task_name(task)})")
        if counter[idx] == 0:
            self._release(("element", (name, idx)))

    def _arm(self, name: str) -> None:
        """Add the runtime part of ``name``'s counts; its waiters may then proceed."""
        et = self.graph.etensors[name]
        added = np.zeros(et.shape, np.int64)
        if et.count_tensor is not None:
            given = self.arrays[et.count_tensor]
            if et.shard_dim is not None and et.world_size > 1:  # each owner's counts
                given, k = given.copy(), et.shard_dim
                n = et.local_shape[k]
                for r, t in enumerate(self.graph.replicas(et.count_tensor)):
                    shard = (slice(None),) * k + (slice(r * n, (r + 1) * n),)
                    given[shard] = self.arrays[t][shard]
            if (given < 0).any():
                source = self.graph.tensors[et.count_tensor].name
                raise ExecutionError(f"the wait_count tensor '{source}' of {name} holds a "
                                     "negative (or unwritten) count")
            added += given
        else:
            for call in self.graph.calls:
                dyn = [e for e in call.out_edges if e.etensor == name and e.map.is_data_dependent]
                if not dyn:
                    continue
                skipped = self.skipped_tasks(call)
                tensors = self._index_tensors(call)
                for task in call.tasks:
                    if task in skipped:
                        continue
                    for e in dyn:
                        for idx in e.map.evaluate(call.coords(task), tensors):
                            added[self.graph.place(e, call, idx, self.graph.task_name(task),
                                                   ExecutionError)] += 1
        counts = self.counters[name]
        counts += added
        self.initial[name] = self.initial[name] + added
        self.armed[name] = True
        if (counts < 0).any():
            idx = tuple(int(i) for i in np.argwhere(counts < 0)[0])
            raise ExecutionError(f"{et.element_name(idx)} is notified more times than its wait "
                                 "count")
        self._release(("arm", name))

    def skipped_tasks(self, call: CallNode) -> set[int]:
        out = self.out_of_range & set(call.tasks)
        if call.triggers:
            self.triggers_of(call)
            out |= self.skipped[call.index]
        return out

    def _check_final_counters(self) -> None:
        for name, counter in self.counters.items():
            bad = np.argwhere((counter != 0) & self.touched[name])
            if len(bad):
                idx = tuple(int(i) for i in bad[0])
                raise ExecutionError(
                    f"{self.graph.etensors[name].element_name(idx)} ended at {counter[idx]}: it "
                    "was notified fewer times than its wait count")

    # ---------------------------------------------------------------- reports
    def _deadlock_report(self) -> str:
        blocked = self.order.blocked()
        lines = [f"deadlock in {self.graph.name}: {self.remaining} tasks left, none can start"]
        for task, where in blocked[:12]:
            lines.append(f"  {self.graph.task_name(task)}{where} {self._describe(task)}")
        if len(blocked) > 12:
            lines.append(f"  ... and {len(blocked) - 12} more")
        return "\n".join(lines)

    def _describe(self, task: int) -> str:
        kind, what = self.blocker(task)
        if kind == "tensor":
            node = self.graph.tensors[what]
            return (f"waits for tensor '{node.name}' ({self.unfinished[node.producer]} tasks of "
                    f"{self.graph.calls[node.producer].name} unfinished)")
        if kind == "arm":
            need = ", ".join(f"'{self.graph.tensors[t].name}'" for t in self.arm_inputs[what]
                             if not self.complete(t))
            return f"waits on {what}, whose wait counts wait for {need}"
        name, idx = what
        et = self.graph.etensors[name]
        return (f"waits on {et.element_name(idx)}: counter {self.counters[name][idx]} of "
                f"wait count {self.initial[name][idx]}")
