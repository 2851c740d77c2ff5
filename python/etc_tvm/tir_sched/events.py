"""Event tensors in a generated kernel: one flat int32 counter array, edge maps as TIR.

Every ETensor of a task graph gets a contiguous range of the ``counters`` array (row-major);
``EventLayout`` gives the offsets, and ``lower_edge`` turns a static edge map into the TIR
index of the element a task waits on or notifies, with its guard.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

import numpy as np
from tvm import tirx

from .. import edge_map as em
from ..task_graph import TaskGraph


@dataclass(frozen=True)
class EventLayout:
    """Where each ETensor's counters start in the flat array, and their initial values."""

    offsets: dict[str, int]
    shapes: dict[str, tuple[int, ...]]
    initial: np.ndarray  # int32, the counts every launch starts from

    @staticmethod
    def of(graph: TaskGraph) -> "EventLayout":
        counts = graph.static_counts()
        offsets, at = {}, 0
        for name, et in graph.etensors.items():
            offsets[name] = at
            at += int(np.prod(et.shape, dtype=np.int64))
        flat = [counts[name].ravel() for name in graph.etensors] or [np.zeros(0, np.int64)]
        return EventLayout(offsets, {n: et.shape for n, et in graph.etensors.items()},
                           np.concatenate(flat).astype(np.int32))

    @property
    def size(self) -> int:
        return max(1, len(self.initial))

    def flat_index(self, etensor: str, idx) -> tirx.Expr:
        """The counter index of ``etensor[idx]`` (``idx``: TIR or int coordinates)."""
        flat = tirx.IntImm("int32", self.offsets[etensor])
        stride = 1
        for i, n in reversed(list(zip(idx, self.shapes[etensor]))):
            flat = flat + i * stride
            stride *= n
        return flat


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


class _Lowering:
    """Lowers one map's expressions, opening a loop for every slice and range it meets."""

    def __init__(self, coords: dict, tensors: Mapping[str, tirx.Buffer]):
        self.coords, self.tensors, self.loops = coords, tensors, []

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
            index = [self.loop(tirx.IntImm("int32", 0), tirx.Cast("int32", buf.shape[k]))
                     if isinstance(i, em.Slice) else self.expr(i)
                     for k, i in enumerate(node.indices)]
            return tirx.BufferLoad(buf, index)
        if isinstance(node, em.Range):
            lo, hi = self.expr(node.lo), self.expr(node.hi)
            return self.loop(lo, hi)
        raise TypeError(f"cannot lower {type(node).__name__} '{node}'")


def lower_edge(edge_map: em.EdgeMap, coords: dict,
               tensors: Mapping[str, tirx.Buffer] = MappingProxyType({})) -> LoweredEdge:
    """``edge_map`` as TIR over ``coords`` (letter -> TIR), reading ``tensors`` (name -> buffer).

    Without ``tensors`` a map that reads one raises ``NotImplementedError``."""
    lowering = _Lowering(coords, tensors)
    guard = lowering.expr(edge_map.guard) if edge_map.guard is not None else None
    index = tuple(lowering.expr(i) for i in edge_map.indices)
    return LoweredEdge(tuple(lowering.loops), index, guard)
