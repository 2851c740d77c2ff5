"""The task graph: one graph function instantiated for concrete sizes.

Every later stage reads this one model: the checks, the CPU reference executor, the schedules
and the visualiser. It holds

* tensors: the graph function's parameters and each ``call_device`` output;
* calls and tasks: every coordinate of every ``tile_num`` grid, numbered in program order;
* event tensors (ETensors): shapes and wait counts, with ``local_view`` aliases resolved;
* ranks: a graph function of world size W is instantiated as W copies, rank-major (rank r's
  tensors, calls and tasks follow rank r-1's, each in program order). An unsharded ETensor
  has one copy per rank; a sharded one (``shard="S[k]"``) is one global ETensor whose
  elements rank r owns along dim k in ``[r*n_k/W, (r+1)*n_k/W)``. An edge names global
  elements, except one through ``local_view()``, whose coordinates are its rank's shard;
  edge maps may use the constants ``rank`` and ``world_size``;
* static edges: the event elements each task waits on and notifies, from the edge maps that
  read no runtime tensor;
* dynamic edges: the edge maps that read runtime tensors (``i->topk[i,:]``), trigger maps
  (``e=>ptr[e]:ptr[e+1]``) and runtime wait counts, instantiated only when the tensors they
  read are complete.

Tensor completion is itself an event: a tensor produced by a call is complete once every task
of that call has finished. A task whose waits read a runtime tensor first waits for it to be
complete; an ETensor whose counts depend on runtime tensors is *armed* (its counts added to its
counters) when they are complete, and its waiters wait for the arming. A task that no trigger
releases is *skipped*: it runs no body and only performs its static notifies, so that fan-ins
counted over the whole grid still complete.
"""
from __future__ import annotations

import itertools
import operator
from collections import defaultdict, deque
from dataclasses import dataclass, field, replace
from typing import Mapping

import numpy as np
import tvm
from tvm import relax

from . import edge_map as edge_lang
from . import ops
from .device_func import DeviceFunc
from .errors import GraphError
from .graph_func import GraphFunc


@dataclass(frozen=True)
class TensorNode:
    """A data tensor: a parameter (``producer`` None) or an output of the call ``producer``."""

    index: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    producer: int | None = None
    param: int | None = None
    sym_shape: tuple = ()  # the shape in the graph function's symbolic dims
    rank: int = 0
    symmetric: bool = False  # one array per rank at the same place; peers write it


@dataclass(frozen=True)
class ETensorNode:
    """An event tensor. ``wait_count`` is an int, None (inferred) or a tensor index.

    ``name`` is the key in ``TaskGraph.etensors``; with several ranks an unsharded ETensor's
    copies are ``E@r`` (``rank`` r, ``label`` E), a sharded one is global (``rank`` None) and
    has ``shard_dim``.
    """

    name: str
    shape: tuple[int, ...]
    wait_count: int | None
    count_tensor: int | None
    shard: str | None
    label: str = ""
    rank: int | None = None
    world_size: int = 1
    shard_dim: int | None = None

    def element_name(self, idx: tuple[int, ...]) -> str:
        text = f"{self.label or self.name}[{','.join(map(str, idx))}]"
        if self.rank is not None:
            return f"{text} of rank {self.rank}"
        if self.shard_dim is not None and self.world_size > 1 and len(idx) == len(self.shape):
            return f"{text} (on rank {self.owner(idx)})"
        return text

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of one rank's shard."""
        k, shape = self.shard_dim, list(self.shape)
        shape[k] //= self.world_size
        return tuple(shape)

    def owner(self, idx: tuple[int, ...]) -> int:
        """The rank that holds global element ``idx`` of a sharded ETensor."""
        return int(idx[self.shard_dim]) // self.local_shape[self.shard_dim]

    def local_view(self, rank: int) -> "ETensorNode":
        """Rank ``rank``'s shard, in its local coordinates (for checks and reports)."""
        return ETensorNode(self.name, self.local_shape, self.wait_count, None, None,
                           f"{self.label or self.name}.local_view()", rank)

    def to_global(self, idx: tuple[int, ...], rank: int) -> tuple[int, ...]:
        k = self.shard_dim
        return idx[:k] + (idx[k] + rank * self.local_shape[k],) + idx[k + 1:]


@dataclass(frozen=True)
class Edge:
    etensor: str
    map: edge_lang.EdgeMap
    local: bool = False  # through local_view(): the map gives the rank's local coordinates


@dataclass
class CallNode:
    """One ``call_device``: its grid of tasks, tensors and edges."""

    index: int
    name: str
    fn: DeviceFunc
    grid: tuple[int, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    in_edges: tuple[Edge, ...]
    out_edges: tuple[Edge, ...]
    cost: float = 1.0  # of one task, from the device function's hint and these shapes
    first_task: int = 0
    schedule: str | None = None  # the call_device's choice for the "mixed" strategy
    sym_grid: tuple = ()  # tile_num in the graph function's symbolic dims
    rank: int = 0

    @property
    def num_tasks(self) -> int:
        return int(np.prod(self.grid, dtype=np.int64))

    @property
    def tasks(self) -> range:
        return range(self.first_task, self.first_task + self.num_tasks)

    @property
    def triggers(self) -> tuple[Edge, ...]:
        return tuple(e for e in self.in_edges if e.map.is_trigger)

    def coords(self, task: int) -> tuple[int, ...]:
        """The task's coordinates in the grid, row-major."""
        rest, out = task - self.first_task, []
        for n in reversed(self.grid):
            rest, c = divmod(rest, n)
            out.append(c)
        return tuple(reversed(out))

    def tensor_args(self) -> tuple[int, ...]:
        return self.inputs + self.outputs

    def reads(self, edges) -> set[int]:
        """Tensor indices read by ``edges``' maps (names are the device function's params)."""
        params = dict(zip((p.name for p in self.fn.buffer_params), self.tensor_args()))
        return {params[name] for e in edges for name in e.map.reads}

    def prelude_reads(self) -> set[int]:
        """Tensor indices its device function's prelude reads (``await_inputs``)."""
        params = dict(zip((p.name for p in self.fn.buffer_params), self.tensor_args()))
        return {params[name] for name in self.fn.prelude_reads}


Element = tuple  # (etensor name, coordinate tuple)


def internal_events(uses) -> set:
    """ETensors that one call both waits on and notifies, and no other call touches.

    ``uses``: per call, a pair (ETensors it waits on, ETensors it notifies). Such an ETensor
    orders tasks within one call (a chain, a scan); a global barrier between calls cannot
    replace it.
    """
    users = defaultdict(set)
    waited = set()
    for k, (waits, notifies) in enumerate(uses):
        for e in waits:
            users[e].add(k)
            waited.add(e)
        for e in notifies:
            users[e].add(k)
    return {e for e, calls in users.items() if len(calls) == 1 and e in waited
            and any(e in uses[k][1] for k in calls)}


# task ids share the kernels' int32 words with flags at bit 30 (``schedule.LOCAL_WAITS``,
# ``schedule.ONLY_PRODUCER``)
MAX_TASKS = 1 << 30


@dataclass
class TaskGraph:
    """Calls, tasks, tensors, ETensors and their static edges, for concrete sizes."""

    name: str
    dims: dict[str, int]
    tensors: list[TensorNode]
    etensors: dict[str, ETensorNode]
    calls: list[CallNode]
    outputs: tuple[int, ...]
    returns_tuple: bool
    waits: list[list[Element]] = field(default_factory=list)
    notifies: list[list[Element]] = field(default_factory=list)
    task_call: list[int] = field(default_factory=list)
    world_size: int = 1
    # what the queries below derive, computed once: a built graph does not change
    _derived: dict = field(default_factory=dict, repr=False, compare=False)

    # ------------------------------------------------------------------ construction
    @staticmethod
    def build(graph: GraphFunc, dims: Mapping[str, int]) -> "TaskGraph":
        """Instantiate ``graph`` for the sizes ``dims`` (symbolic dim name -> int)."""
        return _Builder(graph, dims).build()

    # ------------------------------------------------------------------ queries
    @property
    def num_tasks(self) -> int:
        return len(self.task_call)

    def call_of(self, task: int) -> CallNode:
        return self.calls[self.task_call[task]]

    def task_name(self, task: int) -> str:
        call = self.call_of(task)
        name = f"{call.name}({','.join(map(str, call.coords(task)))})"
        return f"{name} on rank {call.rank}" if self.world_size > 1 else name

    # ------------------------------------------------------------------ ranks
    @property
    def tasks_per_rank(self) -> int:
        return self.num_tasks // self.world_size

    def rank_of(self, task: int) -> int:
        return self.call_of(task).rank

    def rank_task(self, rank: int, task: int) -> int:
        """The id of rank ``rank``'s copy of task ``task`` (an id of the one-rank numbering)."""
        return rank * self.tasks_per_rank + task

    def replicas(self, tensor: int) -> tuple[int, ...]:
        """Every rank's copy of ``tensor``, in rank order."""
        per_rank = len(self.tensors) // self.world_size
        return tuple(tensor % per_rank + r * per_rank for r in range(self.world_size))

    def rank_outputs(self, rank: int) -> tuple[int, ...]:
        """Rank ``rank``'s copies of the graph function's results."""
        return tuple(self.replicas(t)[rank] for t in self.outputs)

    def place(self, edge: Edge, call: CallNode, idx: tuple, where: str, error) -> tuple:
        """The global element of ``idx``, an element ``edge``'s map gave a task of ``call``:
        checked against the ETensor (a local view's shard for a local edge)."""
        et = self.etensors[edge.etensor]
        if not edge.local:
            check_element(et, idx, edge.map, where, error)
            return idx
        check_element(et.local_view(call.rank), idx, edge.map, where, error)
        return et.to_global(idx, call.rank)

    def internal_etensors(self) -> set[str]:
        """See ``internal_events``."""
        return internal_events([({e.etensor for e in c.in_edges}, {e.etensor for e in c.out_edges})
                                for c in self.calls])

    def arm_inputs(self) -> dict[str, set[int]]:
        """ETensors counted at run time -> the tensors written in the graph that their counts
        read (a count tensor, or the index tensors of data-dependent notifies)."""
        out = {}
        for et in self.etensors.values():
            if et.count_tensor is not None:
                need = set(self.replicas(et.count_tensor)) if et.shard_dim is not None \
                    else {et.count_tensor}
            elif et.wait_count is None and et.name in self.dynamically_notified():
                need = set()
                for call in self.calls:
                    dyn = [e for e in call.out_edges
                           if e.etensor == et.name and e.map.is_data_dependent]
                    if dyn:
                        need |= call.reads(dyn) | call.reads(call.triggers)
            else:
                continue
            out[et.name] = {t for t in need if self.tensors[t].producer is not None}
        return out

    def completion_waits(self, call: CallNode) -> set[int]:
        """The calls whose completion ``call``'s tasks wait for before reading their in-edge
        maps or running their prelude: the producers of the tensors those read."""
        return {self.tensors[t].producer for t in call.reads(call.in_edges)
                | call.prelude_reads() if self.tensors[t].producer is not None}

    def prelude_waits(self, call: CallNode) -> set[int]:
        """The calls whose completion ``call``'s tasks wait for before their prelude: the
        producers of the tensors it reads."""
        return {self.tensors[t].producer for t in call.prelude_reads()
                if self.tensors[t].producer is not None}

    def gates(self) -> dict[str, set[int]]:
        """ETensors a kernel arms at run time -> the calls whose completion arms them.

        Those counted at run time wait for the producers of the tensors their counts read; an
        ETensor that releases tasks through a trigger map also for the producers of the
        tensors the map reads, so that no element fires before its range can be read, unless
        it has one such producer and no element can complete before that producer has
        (``trigger_marks``)."""
        gates = {name: {self.tensors[t].producer for t in need}
                 for name, need in self.arm_inputs().items()}
        marks = self.trigger_marks()
        for name, producers in self.trigger_producers().items():
            if name in gates or name not in marks:
                gates.setdefault(name, set()).update(producers)
        return gates

    def trigger_producers(self) -> dict[str, set[int]]:
        """ETensors that release tasks through trigger maps -> the calls that write the
        tensors those maps read."""
        out = {}
        for call in self.calls:
            for e in call.triggers:
                out.setdefault(e.etensor, set()).update(
                    self.tensors[t].producer for t in call.reads([e])
                    if self.tensors[t].producer is not None)
        return out

    def trigger_marks(self) -> dict[str, int]:
        """ETensors that release tasks through trigger maps and need no arming -> the one call
        whose completion makes their maps readable (where a ready ring marks the tasks they
        release). Such an ETensor is counted only at launch, and none of its elements can
        complete before that call has (``completes_after``)."""
        counted = self.arm_inputs()
        out = {}
        for name, producers in self.trigger_producers().items():
            if name not in counted and len(producers) == 1:
                (producer,) = producers
                if self.completes_after(name, producer):
                    out[name] = producer
        return out

    def completes_after(self, name: str, call: int) -> bool:
        """Whether no element of ETensor ``name`` can complete before call ``call`` has: each
        element waits for a notify of every task of ``call``. (That the notifiers wait for
        ``call``'s completion is not enough: a task outside a launch's grids notifies at once,
        without waiting.)"""
        producer = self.calls[call]
        tasks = range(producer.first_task, producer.first_task + producer.num_tasks)
        every = {(name, idx) for idx in np.ndindex(*self.etensors[name].shape)}
        return bool(tasks) and all(every <= set(self.notifies[t]) for t in tasks)

    def element_notifiers(self) -> dict[Element, list[int]]:
        """Event element -> the tasks that notify it through static edges, in task order."""
        notifiers = defaultdict(list)
        for task in range(self.num_tasks):
            for elem in self.notifies[task]:
                notifiers[elem].append(task)
        return notifiers

    def dynamically_notified(self) -> set[str]:
        """ETensors that some call notifies through a data-dependent map."""
        return {e.etensor for c in self.calls for e in c.out_edges if e.map.is_data_dependent}

    def static_counts(self) -> dict[str, np.ndarray]:
        """Per ETensor, the counts known before the run: given, or inferred from static edges.

        An ETensor counted from runtime tensors starts from its static part (inferred) or 0.
        """
        hits = {name: np.zeros(et.shape, np.int64) for name, et in self.etensors.items()}
        for elems in self.notifies:
            for name, idx in elems:
                hits[name][idx] += 1
        counts = {}
        for name, et in self.etensors.items():
            if et.count_tensor is not None:
                counts[name] = np.zeros(et.shape, np.int64)
            elif et.wait_count is not None:
                counts[name] = np.full(et.shape, et.wait_count, np.int64)
            else:
                counts[name] = hits[name]
        return counts

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Raise ``GraphError`` for a cycle, a wait that nothing can satisfy, a wrong count, or
        a call that reads a tensor no event orders it after."""
        self._check_counts()
        self._check_ordering()
        self.topological_order()

    def _check_counts(self) -> None:
        unchecked = set(self.arm_inputs()) | self.dynamically_notified()
        notifiers, waiters = self.element_notifiers(), defaultdict(list)
        for task in range(self.num_tasks):
            for elem in self.waits[task]:
                waiters[elem].append(task)
        for (name, idx), tasks in waiters.items():
            et = self.etensors[name]
            have = len(notifiers.get((name, idx), ()))
            if name in unchecked or have >= (et.wait_count or 0) and (have or et.wait_count == 0):
                continue
            raise GraphError(
                f"{et.element_name(idx)} is waited on by {self.task_name(tasks[0])} but "
                + ("no task notifies it: check the out_edges of its producers" if have == 0 else
                   f"is notified {have} times, fewer than its wait_count {et.wait_count}"))
        for (name, idx), tasks in notifiers.items():
            et = self.etensors[name]
            if name not in unchecked and et.wait_count is not None and len(tasks) > et.wait_count:
                who = ", ".join(self.task_name(t) for t in tasks[:4])
                raise GraphError(
                    f"{et.element_name(idx)} has wait_count {et.wait_count} but is notified "
                    f"{len(tasks)} times (by {who}{', ...' if len(tasks) > 4 else ''})")

    def call_dependencies(self, conservative_only: bool = False) -> dict[int, set[int]]:
        """Call-level edges: call -> the calls some of its tasks wait for.

        With ``conservative_only``, just the edges that element-level edges do not already
        express: waits through data-dependent maps or triggers, on ETensors notified through
        data or counted at run time, and on the completion of tensors those or a prelude
        (``await_inputs``) read.
        """
        dynamic = self.dynamically_notified()
        notifiers = defaultdict(set)
        for call in self.calls:
            for e in call.out_edges:
                notifiers[e.etensor].add(call.index)
        arm = self.arm_inputs()
        deps = defaultdict(set)
        for call in self.calls:
            for e in call.in_edges:
                runtime = e.map.is_data_dependent or e.map.is_trigger or \
                    e.etensor in dynamic or e.etensor in arm
                if runtime or not conservative_only:
                    deps[call.index] |= notifiers[e.etensor]
                deps[call.index] |= {self.tensors[t].producer for t in arm.get(e.etensor, ())}
            for t in call.reads(call.in_edges) | call.prelude_reads():
                if self.tensors[t].producer is not None:
                    deps[call.index].add(self.tensors[t].producer)
            deps[call.index].discard(call.index)
        return deps

    def _check_ordering(self) -> None:
        deps = self.call_dependencies()
        for call in self.calls:
            reach, todo = set(), deque(deps[call.index])
            while todo:
                c = todo.popleft()
                if c not in reach:
                    reach.add(c)
                    todo.extend(deps[c])
            for t in call.inputs:
                producer = self.tensors[t].producer
                if producer is not None and producer not in reach:
                    raise GraphError(
                        f"{call.name} reads '{self.tensors[t].name}', written by "
                        f"{self.calls[producer].name}, but waits on no event that "
                        f"{self.calls[producer].name} notifies (directly or through other "
                        "calls): its tasks could run before the data is written")

    def dependency_graph(self):
        """(successors, in-degrees) over nodes ``("t", task)``, ``("e", element)`` and
        ``("c", call)``: a task precedes the elements it notifies, an element the tasks that
        wait on it; a call node stands for "every task of that call", the conservative form of
        the dependencies that only run-time data can make precise. Shared: do not change."""
        if "dependency_graph" not in self._derived:
            self._derived["dependency_graph"] = self._dependency_graph()
        return self._derived["dependency_graph"]

    def _dependency_graph(self):
        succ, indeg = defaultdict(list), defaultdict(int)

        def edge(a, b):
            succ[a].append(b)
            indeg[b] += 1

        for task in range(self.num_tasks):
            indeg[("t", task)] += 0
            for elem in self.notifies[task]:
                edge(("t", task), ("e", elem))
            for elem in self.waits[task]:
                edge(("e", elem), ("t", task))
        for consumer, producers in self.call_dependencies(conservative_only=True).items():
            for producer in producers:
                for task in self.calls[producer].tasks:
                    edge(("t", task), ("c", producer))
                for task in self.calls[consumer].tasks:
                    edge(("c", producer), ("t", task))
        return succ, indeg

    def ids_are_topological(self) -> bool:
        """Whether every task waits only on tasks of lower ids (through elements and calls,
        ``dependency_graph``), so that tasks taken in id order cannot wait on a later one."""
        succ, _ = self.dependency_graph()
        last_producer = {}
        for task in range(self.num_tasks):  # ascending: each node ends at its last producer
            for node in succ.get(("t", task), ()):
                last_producer[node] = task
        return all(m[1] > last for node, last in last_producer.items()
                   for m in succ.get(node, ()))

    def topological_order(self) -> list[int]:
        """Task ids in an order that respects every edge, dynamic ones conservatively
        (``dependency_graph``). Raises ``GraphError`` naming a cycle."""
        if "topological_order" not in self._derived:
            self._derived["topological_order"] = self._topological_order()
        return list(self._derived["topological_order"])

    def _topological_order(self) -> list[int]:
        succ, indeg = self.dependency_graph()
        indeg = dict(indeg)
        nodes = set(indeg) | set(succ)
        ready = deque(sorted((n for n in nodes if indeg.get(n, 0) == 0),
                             key=lambda n: (n[0] == "t", n[1] if n[0] == "t" else 0)))
        order, seen = [], 0
        while ready:
            n = ready.popleft()
            seen += 1
            if n[0] == "t":
                order.append(n[1])
            for m in succ[n]:
                indeg[m] -= 1
                if indeg[m] == 0:
                    (ready.appendleft if m[0] != "t" else ready.append)(m)
        if seen != len(nodes):
            raise GraphError("the task graph has a cycle: " + self._describe_cycle(
                {n for n in nodes if indeg.get(n, 0) > 0}, succ))
        return order

    def _describe_cycle(self, stuck: set, succ) -> str:
        start = min((n for n in stuck if n[0] == "t"), default=next(iter(stuck)))
        path, index, n = [], {}, start
        while n not in index:
            index[n] = len(path)
            path.append(n)
            n = next(m for m in succ[n] if m in stuck)
        cycle = path[index[n]:] + [n]
        return " -> ".join(self._node_name(m) for m in cycle)

    def _node_name(self, node) -> str:
        kind, key = node
        if kind == "t":
            return self.task_name(key)
        if kind == "e":
            return self.etensors[key[0]].element_name(key[1])
        return f"(all of {self.calls[key].name})"

    # ------------------------------------------------------------------ reports
    def summary(self) -> str:
        lines = [f"task graph {self.name} ({', '.join(f'{k}={v}' for k, v in self.dims.items())}"
                 f"): {self.num_tasks} tasks in {len(self.calls)} calls, "
                 f"{len(self.etensors)} event tensors"]
        for call in self.calls:
            edges = [f"waits {e.etensor}:'{e.map}'" for e in call.in_edges]
            edges += [f"notifies {e.etensor}:'{e.map}'" for e in call.out_edges]
            lines.append(f"  {call.name}: {call.fn.name} x {call.num_tasks} "
                         f"{list(call.grid)}  {'; '.join(edges) or 'no edges'}")
        counts, runtime = self.static_counts(), self.arm_inputs()
        for name, et in self.etensors.items():
            how = ("at run time" if name in runtime else
                   f"given {et.wait_count}" if et.wait_count is not None else "inferred")
            c = counts[name]
            lines.append(f"  {name}{list(et.shape)}: wait counts {how}"
                         + ("" if name in runtime else f", {int(c.min())}..{int(c.max())}"))
        return "\n".join(lines)

    def to_dot(self) -> str:
        """Graphviz: tasks (boxes, one cluster per call), event elements (ellipses), static
        edges solid, data-dependent edges dashed from the call to its ETensor."""
        counts = self.static_counts()
        out = [f'digraph "{self.name}" {{', "  rankdir=LR;", "  node [fontsize=10];"]
        for call in self.calls:
            out.append(f'  subgraph "cluster_{call.name}" {{ label="{call.name}: {call.fn.name}";')
            out += [f'    t{t} [shape=box, label="{self.task_name(t)}"];' for t in call.tasks]
            out.append("  }")
        for name, et in self.etensors.items():
            out.append(f'  subgraph "cluster_{name}" {{ label="{name}"; style=dashed;')
            for idx in itertools.product(*map(range, et.shape)):
                out.append(f'    "{et.element_name(idx)}" [shape=ellipse, '
                           f'label="{et.element_name(idx)} / {counts[name][idx]}"];')
            out.append("  }")
        for task in range(self.num_tasks):
            out += [f'  t{task} -> "{self.etensors[n].element_name(i)}";'
                    for n, i in self.notifies[task]]
            out += [f'  "{self.etensors[n].element_name(i)}" -> t{task};'
                    for n, i in self.waits[task]]
        for call in self.calls:
            anchor = f"t{call.first_task}"
            for e in call.out_edges + call.in_edges:
                if e.map.is_data_dependent or e.map.is_trigger:
                    target = self.etensors[e.etensor]
                    first = f'"{target.element_name((0,) * len(target.shape))}"'
                    a, b = (anchor, first) if e in call.out_edges else (first, anchor)
                    out.append(f'  {a} -> {b} [style=dashed, label="{e.map}", '
                               f'ltail="cluster_{call.name}", lhead="cluster_{e.etensor}"];')
        out.append("}")
        return "\n".join(out)


class _Builder:
    """Reads a graph function's Relax bindings into a ``TaskGraph`` for concrete dims."""

    def __init__(self, graph: GraphFunc, dims: Mapping[str, int]):
        self.graph = graph
        self.func = graph.func
        world = self.func.attrs.get("etc.world_size", 1) if self.func.attrs else 1
        self.world = int(world)
        self.dims = {}
        for name, value in dims.items():
            try:
                self.dims[str(name)] = operator.index(value)
            except TypeError:
                raise GraphError(f"{graph.name}: the symbolic dim {name} = {value!r} is not an "
                                 f"integer (given: {dict(dims)})") from None
        self.analyzer = tvm.sym.Analyzer()
        self.symbols = {}
        for v in relax.analysis.defined_symbolic_vars(self.func):
            if v.name not in self.dims:
                raise GraphError(f"{graph.name}: no value given for the symbolic dim "
                                 f"'{v.name}' (given: {sorted(self.dims)})")
            self.analyzer.bind(v, self.dims[v.name])
        self.tensors: list[TensorNode] = []
        self.etensors: dict[str, ETensorNode] = {}
        self.calls: list[CallNode] = []
        self.value = {}  # relax.Var -> ("tensor", idx) | ("etensor", name) | ("tuple", [idx])

    def eval(self, expr, what: str) -> int:
        value = self.analyzer.simplify(expr)
        if not isinstance(value, tvm.tirx.IntImm):
            raise GraphError(f"{self.graph.name}: {what} = {expr} is not a constant for "
                             f"{self.dims}")
        if value.value < 0:
            raise GraphError(f"{self.graph.name}: {what} = {expr} is negative ({value.value}) "
                             f"for {self.dims}")
        return int(value.value)

    def shape(self, ty, what: str) -> tuple[int, ...]:
        return tuple(self.eval(d, f"dim {k} of {what}") for k, d in enumerate(ty.shape.values))

    def add_tensor(self, name, ty, **kw) -> int:
        """A tensor of rank 0's copy of the graph (``replicate`` makes the others)."""
        node = TensorNode(len(self.tensors), name, self.shape(ty, name), str(ty.dtype), **kw,
                          sym_shape=tuple(ty.shape.values))
        self.tensors.append(node)
        return node.index

    def tensor(self, expr, what: str) -> int:
        kind, v = self.value[expr]
        if kind != "tensor":
            raise GraphError(f"{self.graph.name}: {what} must be a data tensor")
        return v

    def build(self) -> TaskGraph:
        for k, p in enumerate(self.func.params):
            self.value[p] = ("tensor", self.add_tensor(p.name, p.ty, param=k))
        body = self.func.body
        for block in body.blocks:
            for binding in block.bindings:
                self.bind(binding.var, binding.value)
        result = body.body
        fields = result.fields if isinstance(result, relax.Tuple) else (result,)
        outputs = tuple(self.tensor(f, "a graph function result") for f in fields)
        graph = TaskGraph(self.graph.name, self.dims, *self.replicate(), outputs,
                          isinstance(result, relax.Tuple), world_size=self.world)
        self.instantiate_static_edges(graph)
        return graph

    def replicate(self):
        """(tensors, etensors, calls) of every rank, from rank 0's: each rank's copies of the
        tensors, calls and unsharded ETensors; one global copy of a sharded ETensor; edge maps
        bound to their rank."""
        world, n_tensors, n_calls = self.world, len(self.tensors), len(self.calls)
        tensors = [replace(t, index=t.index + r * n_tensors, rank=r,
                           producer=None if t.producer is None else t.producer + r * n_calls)
                   for r in range(world) for t in self.tensors]
        etensors, keys = {}, {}
        for et in self.etensors.values():
            if world == 1 or et.shard_dim is not None:
                etensors[et.name] = replace(et, world_size=world)
                keys.update({(et.name, r): et.name for r in range(world)})
                continue
            for r in range(world):
                key = keys[(et.name, r)] = f"{et.name}@{r}"
                etensors[key] = replace(et, name=key, label=et.name, rank=r, world_size=world,
                                        count_tensor=None if et.count_tensor is None
                                        else et.count_tensor + r * n_tensors)

        def edges(es, r):
            return tuple(Edge(keys[(e.etensor, r)], e.map.bind(rank=r, world_size=world),
                              e.local) for e in es)

        calls = [replace(c, index=c.index + r * n_calls, rank=r,
                         inputs=tuple(t + r * n_tensors for t in c.inputs),
                         outputs=tuple(t + r * n_tensors for t in c.outputs),
                         in_edges=edges(c.in_edges, r), out_edges=edges(c.out_edges, r))
                 for r in range(world) for c in self.calls]
        return tensors, etensors, calls

    def bind(self, var, value) -> None:
        name = var.name
        if ops.is_op(value, ops.EVENT_TENSOR):
            decl = ops.EventTensorCall.of(value)
            count_tensor = None if not isinstance(decl.wait_count, relax.Expr) \
                else self.tensor(decl.wait_count, f"the wait_count of {decl.name}")
            shape = tuple(self.eval(d, f"dim {k} of ETensor {decl.name}")
                          for k, d in enumerate(decl.shape))
            shard_dim = decl.shard_dim
            if shard_dim is not None and shape[shard_dim] % self.world:
                raise GraphError(f"{self.graph.name}: ETensor {decl.name} is sharded on dim "
                                 f"{shard_dim} ({decl.shard}) of size {shape[shard_dim]}, which "
                                 f"does not divide over world size {self.world}")
            self.etensors[decl.name] = ETensorNode(
                decl.name, shape, decl.wait_count if isinstance(decl.wait_count, int) else None,
                count_tensor, decl.shard, shard_dim=shard_dim)
            self.value[var] = ("etensor", decl.name)
        elif ops.is_op(value, ops.LOCAL_VIEW):
            self.value[var] = ("local", self.value[value.args[0]][1])
        elif ops.is_op(value, ops.CALL_DEVICE):
            self.add_call(var, ops.CallDeviceCall.of(value))
        elif isinstance(value, relax.TupleGetItem):
            kind, items = self.value[value.tuple_value]
            self.value[var] = ("tensor", items[value.index])
        elif isinstance(value, relax.Var):
            self.value[var] = self.value[value]
        else:
            raise GraphError(f"{self.graph.name}: binding '{name}' is not an etc operation "
                             f"({type(value).__name__}); a graph function holds ETensors and "
                             "call_devices")

    def add_call(self, var, call: ops.CallDeviceCall) -> None:
        fn = self.graph.device_funcs[call.fn.name_hint]
        index = len(self.calls)
        name = call.name
        grid = tuple(self.eval(d, f"tile_num[{k}] of {name}") for k, d in enumerate(call.tile_num))
        inputs = tuple(self.tensor(a, f"argument {k} of {name}") for k, a in enumerate(call.args))
        outputs = tuple(self.add_tensor(n, ty, producer=index, symmetric=sym)
                        for n, ty, sym in zip(call.out_names, call.out_types, call.symmetric))
        readable = {p.name: p.rank for p in fn.buffer_params if p.dtype == "int32"}
        inputs_readable = {k: v for k, v in readable.items()
                           if k in {p.name for p in fn.buffer_params[:len(inputs)]}}

        def edges(events, maps, kind, tensors):
            out = []
            for ev, text in zip(events, maps):
                view, et_name = self.value[ev]
                et = self.etensors[et_name]
                emap = edge_lang.parse(text, kind=kind, task_rank=len(grid),
                                       event_rank=len(et.shape), tensors=tensors,
                                       etensor=et.name)
                if view == "local" and emap.is_trigger:
                    raise GraphError(f"{name}: the trigger map '{text}' reads a local_view of "
                                     f"{et.name}; trigger maps take the global ETensor")
                out.append(Edge(et.name, emap, local=view == "local"))
            return tuple(out)

        shapes = [self.tensors[t].shape for t in inputs + outputs]
        fn.check_requires(shapes, f"{self.graph.name}: call {name}")
        self.calls.append(CallNode(index, name, fn, grid, inputs, outputs,
                                   edges(call.in_events, call.in_edges, "in", inputs_readable),
                                   edges(call.out_events, call.out_edges, "out", readable),
                                   fn.task_cost(shapes), schedule=call.schedule,
                                   sym_grid=tuple(call.tile_num)))
        self.value[var] = ("tensor", outputs[0]) if len(outputs) == 1 and isinstance(
            call.out_ty, relax.TensorType) else ("tuple", outputs)

    def instantiate_static_edges(self, graph: TaskGraph) -> None:
        total = sum(call.num_tasks for call in graph.calls)
        if total >= MAX_TASKS:
            raise GraphError(
                f"{graph.name}: {total} tasks ("
                + ", ".join(f"{c.name} {c.num_tasks}" for c in graph.calls)
                + f"); a graph holds fewer than {MAX_TASKS} (2^30) tasks: coarser tiles, or "
                "several graphs")
        first = 0
        for call in graph.calls:
            call.first_task = first
            first += call.num_tasks
            graph.task_call.extend([call.index] * call.num_tasks)
            graph.waits.extend(self.elements(graph, call, call.in_edges))
            graph.notifies.extend(self.elements(graph, call, call.out_edges))

    @staticmethod
    def elements(graph: TaskGraph, call: CallNode, edges) -> list[list[Element]]:
        """Each task's elements of the static maps among ``edges``, in edge order: the maps
        that give one element a task evaluated over the whole grid at once."""
        n = call.num_tasks
        grid = np.unravel_index(np.arange(n), call.grid) if call.grid else ()
        out: list[list[Element]] = [[] for _ in range(n)]
        for e in edges:
            if e.map.is_data_dependent or e.map.is_trigger:
                continue
            et = graph.etensors[e.etensor]
            if e.local:  # checked against the rank's shard, then made global
                et = et.local_view(call.rank)
            on_grid = e.map.evaluate_grid(grid)
            if on_grid is None:
                for k in range(n):
                    coords = call.coords(call.first_task + k)
                    for idx in e.map.evaluate(coords):
                        check_element(et, idx, e.map, _where(graph, call, coords), GraphError)
                        if e.local:
                            idx = graph.etensors[e.etensor].to_global(idx, call.rank)
                        out[k].append((e.etensor, idx))
                continue
            indices, live = on_grid
            inside = np.ones(n, bool) if len(indices) == len(et.shape) else np.zeros(n, bool)
            for i, size in zip(indices, et.shape):
                inside &= (i >= 0) & (i < size)
            for k in np.flatnonzero(live & ~inside)[:1]:  # the first task outside, as evaluate
                coords = call.coords(call.first_task + int(k))
                check_element(et, tuple(int(i[k]) for i in indices), e.map,
                              _where(graph, call, coords), GraphError)
            if e.local:
                glob = graph.etensors[e.etensor]
                indices = tuple(i + call.rank * et.shape[d] if d == glob.shard_dim else i
                                for d, i in enumerate(indices))
            for k, idx in zip(np.flatnonzero(live).tolist(),
                              zip(*(i[live].tolist() for i in indices))):
                out[k].append((e.etensor, idx))
        return out


def _where(graph: TaskGraph, call: CallNode, coords: tuple) -> str:
    return f"{call.name}{coords}" + (f" on rank {call.rank}" if graph.world_size > 1 else "")


def check_element(et: ETensorNode, idx: tuple, emap, where: str, error) -> None:
    """Raise ``error`` if the edge map ``emap`` gave an element outside ``et``."""
    if len(idx) != len(et.shape) or not all(0 <= i < n for i, n in zip(idx, et.shape)):
        raise error(f"edge map '{emap}' of task {where} gives {et.element_name(idx)}, outside "
                    f"{et.name} of shape {list(et.shape)}")
