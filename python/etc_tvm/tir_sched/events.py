"""Event tensors in a generated kernel: one flat int32 counter array, edge maps as TIR.

Every ETensor of a task graph gets a contiguous range of the ``counters`` array (row-major),
followed by the run-time events: one completion counter per call whose completion something
waits for, and one gate per ETensor armed at run time (``TaskGraph.gates``), counting the calls
still to complete before it is armed. ``EventLayout`` gives the offsets and the initial values;
``lower_edge`` turns an edge map into TIR, and ``trigger_scan`` finds, from a task, the elements
whose trigger map releases it.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

import numpy as np
import tvm
from tvm import tirx

from .. import edge_map as em
from ..task_graph import TaskGraph
from .inline import substitute

ARM_BIAS = 1 << 29  # ETC_ARM_BIAS of src/etc_runtime.cuh


@dataclass(frozen=True)
class EventLayout:
    """Where each ETensor's counters start in the flat array, the run-time events' counters,
    and the values every launch starts from.

    done: call index -> its completion counter (its number of tasks at launch).
    gates: ETensor -> (its gate counter, the calls whose completion arms it); its elements
      start ``ARM_BIAS`` above their static counts.
    marks: ETensor that releases tasks through a trigger map, armed by no gate -> the call
      whose completion makes the map readable (``TaskGraph.trigger_marks``).
    """

    offsets: dict[str, int]
    shapes: dict[str, tuple[int, ...]]
    initial: np.ndarray  # int32
    done: dict[int, int]
    gates: dict[str, tuple[int, tuple[int, ...]]]
    marks: dict[str, int]

    @staticmethod
    def of(graph: TaskGraph) -> "EventLayout":
        counts = graph.static_counts()
        gate_calls, marks = graph.gates(), graph.trigger_marks()
        offsets, at = {}, 0
        for name, et in graph.etensors.items():
            offsets[name] = at
            at += int(np.prod(et.shape, dtype=np.int64))
        flat = [counts[name].ravel() + (ARM_BIAS if name in gate_calls else 0)
                for name in graph.etensors]
        tracked = sorted(set().union(*(graph.completion_waits(c) for c in graph.calls),
                                     *gate_calls.values(), marks.values()))
        done = {c: at + k for k, c in enumerate(tracked)}
        at += len(tracked)
        gates = {name: (at + k, tuple(sorted(calls)))
                 for k, (name, calls) in enumerate(sorted(gate_calls.items()))}
        flat.append(np.array([graph.calls[c].num_tasks for c in tracked], np.int64))
        flat.append(np.array([len(calls) for _, calls in gates.values()], np.int64))
        return EventLayout(offsets, {n: et.shape for n, et in graph.etensors.items()},
                           np.concatenate(flat).astype(np.int32), done, gates, marks)

    @property
    def size(self) -> int:
        return max(1, len(self.initial))

    def names(self, graph: TaskGraph) -> list:
        """``[name, offset, shape]`` of every counter range, for diagnostics."""
        out = [[n, self.offsets[n], list(s)] for n, s in self.shapes.items()]
        out += [[f"completion of {graph.calls[c].name}", at, []] for c, at in self.done.items()]
        out += [[f"arming of {n}", at, []] for n, (at, _) in self.gates.items()]
        return out

    def flat_index(self, etensor: str, idx) -> tirx.Expr:
        """The counter index of ``etensor[idx]`` (``idx``: TIR or int coordinates); of a
        one-element ETensor, its offset whatever ``idx`` says (a map such as ``i->i//n``
        reaches only element 0)."""
        flat = tirx.IntImm("int32", self.offsets[etensor])
        if all(n == 1 for n in self.shapes[etensor]):
            return flat
        stride = 1
        for i, n in reversed(list(zip(idx, self.shapes[etensor]))):
            flat = flat + i * stride
            stride *= n
        return flat


def edge_sites(graph: TaskGraph) -> list[tuple]:
    """Every ``(call, edge)`` of ``graph``, numbered as kernels report them: calls in order,
    each call's in-edges, then its out-edges."""
    return [(c, e) for c in graph.calls for e in c.in_edges + c.out_edges]


_BINARY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
           "//": tirx.floordiv, "%": tirx.floormod,
           "<": lambda a, b: a < b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b,
           ">=": lambda a, b: a >= b, "==": tirx.EQ, "!=": tirx.NE,
           "and": tirx.And, "or": tirx.Or}


@dataclass(frozen=True)
class LoweredEdge:
    """An edge map as TIR: for each point of ``loops`` (nested, outermost first, each
    ``(var, lo, hi)``: a ``:`` slice or a ``lo:hi`` range), the coordinates ``index``, if
    ``guard`` holds. ``index`` is an event element for ``->`` maps and a task for ``=>`` maps;
    the points come in the order ``EdgeMap.evaluate`` lists them."""

    loops: tuple
    index: tuple
    guard: tirx.Expr | None

    def nest(self, body: tirx.Stmt) -> tirx.Stmt:
        """``body`` run for every point: inside the loops, under the guard."""
        for var, lo, hi in reversed(self.loops):
            body = tirx.For(var, lo, hi - lo, tirx.ForKind.SERIAL, body)
        return body if self.guard is None else tirx.IfThenElse(self.guard, body, None)

    def nest_strided(self, body: tirx.Stmt, lane: tirx.Expr, lanes: int) -> tirx.Stmt:
        """``nest`` with the points dealt out to ``lanes`` threads, so that the threads of a
        warp wait on a map's elements at once: thread ``lane`` runs points ``lane``, ``lane +
        lanes``, ... of all the loops flattened (innermost fastest), or, where a loop's bounds
        read another loop's variable, of the innermost loop alone, the others nested around
        it. (The combine of the MoE layer waits on 8 pairs of each of its tokens: dealt over
        the pairs alone, a task of 4 tokens made 4 rounds of loads, 2.8 us at 4096 tokens.)"""
        loop_vars = {var for var, _, _ in self.loops}
        if len(self.loops) > 1 and not any(
                v in loop_vars for _, lo, hi in self.loops
                for v in [*tirx.analysis.undefined_vars(lo), *tirx.analysis.undefined_vars(hi)]):
            return self._nest_flat(body, lane, lanes)
        *outer, (var, lo, hi) = self.loops
        r = tirx.Var(f"{var.name}_round", "int32")
        n = tirx.IntImm("int32", lanes)
        inner = tirx.For(r, tirx.IntImm("int32", 0), tirx.floordiv(hi - lo + n - 1, n),
                         tirx.ForKind.SERIAL, tirx.stmt_seq(
                             tirx.Bind(var, lo + r * n + lane),
                             tirx.IfThenElse(var < hi, body, None)))
        return LoweredEdge(tuple(outer), self.index, self.guard).nest(inner)

    def _nest_flat(self, body: tirx.Stmt, lane: tirx.Expr, lanes: int) -> tirx.Stmt:
        """``nest_strided`` over the loops flattened, their bounds read once."""
        first = self.loops[0][0].name
        n = tirx.IntImm("int32", lanes)
        setup, total = [], tirx.IntImm("int32", 1)
        los, extents = [], []
        for var, lo, hi in self.loops:
            lo_var = tirx.Var(f"{var.name}_lo", "int32")
            extent = tirx.Var(f"{var.name}_extent", "int32")
            setup += [tirx.Bind(lo_var, lo),
                      tirx.Bind(extent, tirx.max(hi - lo_var, tirx.IntImm("int32", 0)))]
            los.append(lo_var)
            extents.append(extent)
            total = total * extent
        point, r = tirx.Var(f"{first}_point", "int32"), tirx.Var(f"{first}_round", "int32")
        coords, rest = [], point
        for (var, _, _), lo, extent in reversed(list(zip(self.loops, los, extents))):
            coords.append(tirx.Bind(var, lo + tirx.floormod(rest, extent)))
            rest = tirx.floordiv(rest, extent)
        loop = tirx.For(r, tirx.IntImm("int32", 0), tirx.floordiv(total + n - 1, n),
                        tirx.ForKind.SERIAL, tirx.stmt_seq(
                            tirx.Bind(point, r * n + lane),
                            tirx.IfThenElse(point < total, tirx.stmt_seq(*coords, body), None)))
        return LoweredEdge((), self.index, self.guard).nest(tirx.stmt_seq(*setup, loop))


class _Lowering:
    """Lowers one map's expressions, opening a loop for every slice and range it meets."""

    def __init__(self, coords: dict, tensors: Mapping[str, tirx.Buffer], read=None):
        self.coords, self.tensors, self.loops = coords, tensors, []
        self.read = read or tirx.BufferLoad

    def loop(self, lo: tirx.Expr, hi: tirx.Expr) -> tirx.Var:
        var = tirx.Var(f"k{len(self.loops)}", "int32")
        self.loops.append((var, lo, hi))
        return var

    def expr(self, node: em.Node) -> tirx.Expr:
        if isinstance(node, em.Int):
            return tirx.IntImm("int32", node.value)
        if isinstance(node, em.Coord):
            return self.coords[node.name]
        if isinstance(node, em.Neg):
            return tirx.IntImm("int32", 0) - self.expr(node.operand)
        if isinstance(node, (em.BinOp, em.Compare, em.BoolOp)):
            return _BINARY[node.op](self.expr(node.lhs), self.expr(node.rhs))
        if isinstance(node, em.Read):
            if node.tensor not in self.tensors:
                raise NotImplementedError(f"'{node}' reads a runtime tensor this kernel does not "
                                          "bind")
            buf = self.tensors[node.tensor]
            index = [self.slice(i, tirx.Cast("int32", buf.shape[k]))
                     if isinstance(i, em.Slice) else self.expr(i)
                     for k, i in enumerate(node.indices)]
            return self.read(buf, index)
        if isinstance(node, em.Range):
            lo, hi = self.expr(node.lo), self.expr(node.hi)
            return self.loop(lo, hi)
        raise TypeError(f"cannot lower {type(node).__name__} '{node}'")

    def slice(self, node: em.Slice, extent: tirx.Expr) -> tirx.Var:
        """The loop over the indices of a dimension of ``extent`` that ``node`` takes."""
        zero = tirx.IntImm("int32", 0)
        if node.lo is None:
            return self.loop(zero, extent)
        lo = tirx.max(self.expr(node.lo), zero)
        return self.loop(lo, tirx.max(tirx.min(self.expr(node.hi), extent), lo))


def lower_edge(edge_map: em.EdgeMap, coords: dict,
               tensors: Mapping[str, tirx.Buffer] = MappingProxyType({}),
               read=None) -> LoweredEdge:
    """``edge_map`` as TIR over ``coords`` (letter -> TIR), reading ``tensors`` (name -> buffer)
    through ``read(buffer, index)`` (by default a ``BufferLoad``).

    Without ``tensors`` a map that reads one raises ``NotImplementedError``."""
    lowering = _Lowering(coords, tensors, read)
    guard = lowering.expr(edge_map.guard) if edge_map.guard is not None else None
    index = tuple(lowering.expr(i) for i in edge_map.indices)
    return LoweredEdge(tuple(lowering.loops), index, guard)


def trigger_scan(edge_map: em.EdgeMap, shape, coords, tensors: Mapping[str, tirx.Buffer],
                 hit, read=None) -> tirx.Stmt:
    """``hit(element)`` for every element of the ETensor (of ``shape``) whose trigger map
    ``edge_map`` releases the task at ``coords`` (TIR), the map reading ``tensors`` (through
    ``read``, as ``lower_edge``). A task that no element releases is skipped: the kernels run
    its body only after a hit.

    An element coordinate that the map turns into a task coordinate affinely and one to one
    (``g=>g:g+1``, ``i=>2*i:2*i+2``) is solved for from the task, not looped: a task of the
    MoE layer's down GEMM finds its one element instead of testing every tile's. The other
    coordinates are looped, row-major, and so are the map's slices and the ranges that give
    no task coordinate; a range ``lo:hi`` that gives one is tested, not looped."""
    elem = [tirx.Var(f"e{k}", "int32") for k in range(len(shape))]
    lowered = lower_edge(edge_map, dict(zip(edge_map.coords, elem)), tensors, read)
    loops, conds, vmap, given = [], [], {}, []
    for var, lo, hi in lowered.loops:
        dims = [k for k, i in enumerate(lowered.index) if i.same_as(var)]
        if dims:
            conds += [lo <= coords[dims[0]], coords[dims[0]] < hi]
            vmap[var] = coords[dims[0]]
            given.append((lo, hi - lo, coords[dims[0]]))
        else:
            loops.append((var, lo, hi))
    for i, c in zip(lowered.index, coords):
        if not any(i.same_as(v) for v in vmap):
            conds.append(substitute(i, vmap) == c)
            given.append((substitute(i, vmap), tirx.IntImm("int32", 1), c))
    cond = conds[0]
    for c in conds[1:]:
        cond = tirx.And(cond, c)
    solved = _solve_elements(elem, given, [v for v, _, _ in lowered.loops])
    body = LoweredEdge(tuple(loops), lowered.index, lowered.guard).nest(
        tirx.IfThenElse(cond, hit(elem), None))
    for var, n in reversed(list(zip(elem, shape))):
        if var not in solved:
            body = tirx.For(var, tirx.IntImm("int32", 0), tirx.IntImm("int32", n),
                            tirx.ForKind.SERIAL, body)
    if not solved:
        return body
    inside = None
    for var, n in zip(elem, shape):
        if var in solved:
            ok = tirx.And(tirx.IntImm("int32", 0) <= var, var < tirx.IntImm("int32", n))
            inside = ok if inside is None else tirx.And(inside, ok)
    return tirx.stmt_seq(*[tirx.Bind(v, x) for v, x in solved.items()],
                         tirx.IfThenElse(inside, body, None))


def _solve_elements(elem, given, map_vars) -> dict:
    """Element coordinates determined by a task: from ``(lo, width, c)``, a task coordinate
    ``c`` in ``[lo, lo + width)`` with ``lo = a * e + b`` (``b`` free of elements and of the
    map's own variables) and ``0 < width <= a``, the only candidate is ``e = (c - b) // a``;
    the scan's conditions still check it."""
    analyzer = tvm.sym.Analyzer()
    bound = {*elem, *map_vars}
    solved = {}
    for lo, width, c in given:
        width = analyzer.simplify(width)
        if not isinstance(width, tirx.IntImm) or width.value <= 0:
            continue
        for e in elem:
            if e in solved:
                continue
            linear = tvm.sym.detect_linear_equation(lo, [e])
            if len(linear) != 2 or not isinstance(linear[0], tirx.IntImm):
                continue
            a, b = linear[0].value, linear[1]
            if a < width.value or any(v in bound for v in tirx.analysis.undefined_vars(b)):
                continue
            solved[e] = analyzer.simplify(tirx.floordiv(c - b, tirx.IntImm("int32", a)))
    return solved
