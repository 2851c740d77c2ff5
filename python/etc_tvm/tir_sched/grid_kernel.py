"""A device function as an ordinary grid launch: one CTA per task, no events.

The "unfused" baseline runs each ``call_device`` so, in stream order; it is also how a tile is
tested on its own. CTA ``b`` runs the task at ``unravel(b, tile_num)``.

A call released by trigger maps launches its whole grid too: each CTA first scans the trigger
ETensors for an element whose map releases its task (``events.trigger_scan``, the scan of the
persistent kernels) and, finding none, runs no body: the task is skipped. There is nothing to
wait for: stream order has completed the launches that wrote the tensors the maps read. Every
thread scans (the maps read the same, unchanging data), so the CTA agrees without a barrier.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as Tb

from .. import edge_map as em
from ..device_func import DeviceFunc
from .events import trigger_scan
from .inline import ThreadScopes, encode_tensor_maps, i32, inline_task


def unravel(flat: tirx.Expr, grid: Sequence[int]) -> list:
    """Row-major coordinates of ``flat`` in ``grid``."""
    out = []
    for k, n in enumerate(grid):
        stride = int(np.prod(grid[k + 1:], dtype=np.int64))
        out.append(tirx.floormod(tirx.floordiv(flat, i32(stride)), i32(n)))
    return out


def build_grid_kernel(fn: DeviceFunc, grid: Sequence[int], buffers: Sequence[tirx.Buffer],
                      name: str, num_inputs: int | None = None,
                      triggers: Sequence[tuple[em.EdgeMap, tuple[int, ...]]] = ()
                      ) -> tirx.PrimFunc:
    """A kernel of ``prod(grid)`` CTAs running ``fn`` on ``buffers`` (inputs, then outputs).

    With ``num_inputs``, the kernel runs ONE task instead, the one whose row-major index is an
    int64 parameter ``task`` placed after the inputs: tasks that depend on tasks of the same
    call launch one at a time.

    ``triggers``: each trigger map of the call and the shape of its ETensor; a task that no
    element of them releases is skipped. The maps read ``fn``'s tensor parameters, which
    ``buffers`` are.
    """
    scopes = ThreadScopes(fn.num_threads)
    num_tasks = int(np.prod(grid, dtype=np.int64))
    task = tirx.Var("task", "int64")
    params = list(buffers) if num_inputs is None else [*buffers[:num_inputs], task,
                                                       *buffers[num_inputs:]]
    (maps,), encodes = encode_tensor_maps([(fn, buffers, name)])
    with IRBuilder() as ib:
        with Tb.prim_func():
            Tb.func_name(name)
            Tb.func_attr({"global_symbol": name, "tirx.is_scheduled": True})
            for p in params:
                Tb.arg(p.name, p)
            for stmt in encodes:  # host: the tensor maps of the tile's TMA loads
                Tb.add_to_parent(stmt)
            Tb.device_entry()
            bx = IRBuilder.name("bx", Tb.cta_id([num_tasks if num_inputs is None else 1]))
            flat = bx if num_inputs is None else bx + tirx.Cast("int32", task)
            coords = unravel(flat, grid)
            body = inline_task(fn, coords, buffers, scopes, arena=None, maps=maps)
            for d in scopes.defs:
                Tb.add_to_parent(tirx.ScopeIdDefStmt(d))
            if triggers:
                body = _unless_skipped(body, triggers, coords,
                                       {p.name: b for p, b in zip(fn.buffer_params, buffers)})
            Tb.add_to_parent(body)
    return ib.get()


def _unless_skipped(body: tirx.Stmt, triggers, coords, tensors) -> tirx.Stmt:
    """``body`` if some element of ``triggers`` releases the task at ``coords``."""
    skip = tirx.decl_buffer((1,), "int32", "skip", scope="local")
    cleared = tirx.BufferStore(skip, i32(0), [i32(0)])
    scans = [trigger_scan(m, shape, coords, tensors, lambda _: cleared) for m, shape in triggers]
    return tirx.stmt_seq(tirx.AllocBuffer(skip), tirx.BufferStore(skip, i32(1), [i32(0)]),
                         *scans, tirx.IfThenElse(skip[0] == 0, body, None))
