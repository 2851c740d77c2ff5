"""Event tensors in a generated kernel: one flat int32 counter array, edge maps as TIR.

Every ETensor of a task graph gets a contiguous range of the ``counters`` array (row-major);
``EventLayout`` gives the offsets, and ``lower_edge`` turns a static edge map into the TIR
index of the element a task waits on or notifies, with its guard.
"""
from __future__ import annotations

from dataclasses import dataclass

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


def lower_expr(node: em.Node, coords: dict) -> tirx.Expr:
    """A static edge-map expression as TIR over the task coordinates ``coords`` (name -> var)."""
    if isinstance(node, em.Int):
        return tirx.IntImm("int32", node.value)
    if isinstance(node, em.Coord):
        return coords[node.name]
    if isinstance(node, em.Neg):
        return tirx.IntImm("int32", 0) - lower_expr(node.operand, coords)
    if isinstance(node, (em.BinOp, em.Compare, em.BoolOp)):
        return _BINARY[node.op](lower_expr(node.lhs, coords), lower_expr(node.rhs, coords))
    raise NotImplementedError(f"'{node}' reads a runtime tensor: data-dependent edges need the "
                              "dynamic schedule")


def lower_edge(edge_map: em.EdgeMap, coords: dict):
    """(element coordinates as TIR, guard as TIR or None) of a static ``->`` map."""
    index = [lower_expr(i, coords) for i in edge_map.indices]
    guard = lower_expr(edge_map.guard, coords) if edge_map.guard is not None else None
    return index, guard
