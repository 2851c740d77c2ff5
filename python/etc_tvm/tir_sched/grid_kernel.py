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
from .device_runtime import STATUS_WORDS, runtime_source
from .events import trigger_scan
from .inline import ThreadScopes, encode_tensor_maps, i32, inline_task


def unravel(flat: tirx.Expr, grid: Sequence[int]) -> list:
    """Row-major coordinates of ``flat`` in ``grid``."""
    out = []
    for k, n in enumerate(grid):
        stride = int(np.prod(grid[k + 1:], dtype=np.int64))
        out.append(tirx.floormod(tirx.floordiv(flat, i32(stride)), i32(n)))
    return out


def in_call(call, task: tirx.Expr) -> tirx.Expr:
    """Whether the flat task id ``task`` is one of ``call``'s tasks."""
    return tirx.And(i32(call.first_task) <= task, task < i32(call.first_task + call.num_tasks))


def build_grid_kernel(fn: DeviceFunc, grid: Sequence[int], buffers: Sequence[tirx.Buffer],
                      name: str, inputs: int | None = None, one_task: bool = False,
                      triggers: Sequence[tuple[em.EdgeMap, tuple[int, ...]]] = (),
                      checks: Sequence[int] = (), first_task: int = 0,
                      clears_record: bool = False) -> tirx.PrimFunc:
    """A kernel of ``prod(grid)`` CTAs running ``fn`` on ``buffers``: ``inputs`` of them
    inputs (all of them if not given), then the outputs.

    With ``one_task``, the kernel runs ONE task instead, the one whose row-major index is an
    int64 parameter ``task`` placed after the inputs: tasks that depend on tasks of the same
    call launch one at a time.

    ``triggers``: each trigger map of the call and the shape of its ETensor; a task that no
    element of them releases is skipped. The maps read ``fn``'s tensor parameters, which
    ``buffers`` are.

    ``checks``: the graph's number of each of ``fn``'s input checks. Given them, the kernel
    takes the stop record ``status`` (int32, ``STATUS_WORDS``) after its ``inputs`` input
    buffers (and ``task``), and a failed check records there the task (the call's tasks
    number from ``first_task``), the value and the check, as in the persistent kernels.

    ``clears_record``: the kernel takes the stop record there too and its first CTA zeroes it
    before its task; the first launch of a call so clears the record that later launches'
    checks write, which saves a launch of its own (``build_stop_record_clear``). A kernel
    that checks cannot clear: its other CTAs may record before the first one clears.
    """
    if checks and clears_record:
        raise ValueError(f"{fn.name} checks its inputs, so it cannot clear the stop record")
    if len(checks) != len(fn.checks):
        raise ValueError(f"{fn.name} has {len(fn.checks)} input checks, {len(checks)} numbered")
    takes_record = bool(checks) or clears_record
    if (takes_record or one_task) and inputs is None:
        raise ValueError(f"{fn.name}: the task index and the stop record follow the inputs: "
                         "give their number")
    scopes = ThreadScopes(fn.num_threads)
    num_tasks = int(np.prod(grid, dtype=np.int64))
    task = tirx.Var("task", "int64")
    status = tirx.decl_buffer((STATUS_WORDS,), "int32", "status") if takes_record else None
    inputs = len(buffers) if inputs is None else inputs
    params = [*buffers[:inputs], *([task] if one_task else []),
              *([status] if takes_record else []), *buffers[inputs:]]
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
            bx = IRBuilder.name("bx", Tb.cta_id([1 if one_task else num_tasks]))
            flat = bx + tirx.Cast("int32", task) if one_task else bx
            coords = unravel(flat, grid)
            check = None if not checks else (lambda value, size, k: Tb.cuda.func_call(
                "etc_input_check", value, size, status.ptr_to([0]), i32(first_task) + flat,
                i32(checks[k]), source_code=runtime_source(), return_type="int32"))
            prelude, body = inline_task(fn, coords, buffers, scopes, arena=None, maps=maps,
                                        check=check)
            body = tirx.stmt_seq(*(prelude or []), body)  # in stream order inputs are ready
            for d in scopes.defs:
                Tb.add_to_parent(tirx.ScopeIdDefStmt(d))
            if triggers:
                body = _unless_skipped(body, triggers, coords,
                                       {p.name: b for p, b in zip(fn.buffer_params, buffers)})
            if clears_record:
                Tb.add_to_parent(_cleared_by_first_thread(status, bx, scopes.tx))
            Tb.add_to_parent(body)
    return ib.get()


def _cleared_by_first_thread(status: tirx.Buffer, bx: tirx.Var, tx: tirx.Var) -> tirx.Stmt:
    zeroes = [tirx.BufferStore(status, i32(0), [i32(w)]) for w in range(STATUS_WORDS)]
    return tirx.IfThenElse(tirx.all(bx == 0, tx == 0), tirx.stmt_seq(*zeroes), None)


def _unless_skipped(body: tirx.Stmt, triggers, coords, tensors) -> tirx.Stmt:
    """``body`` if some element of ``triggers`` releases the task at ``coords``."""
    skip = tirx.decl_buffer((1,), "int32", "skip", scope="local")
    cleared = tirx.BufferStore(skip, i32(0), [i32(0)])
    scans = [trigger_scan(m, shape, coords, tensors, lambda _: cleared) for m, shape in triggers]
    return tirx.stmt_seq(tirx.AllocBuffer(skip), tirx.BufferStore(skip, i32(1), [i32(0)]),
                         *scans, tirx.IfThenElse(skip[0] == 0, body, None))


def build_stop_record_clear(name: str) -> tirx.PrimFunc:
    """A kernel that zeroes the stop record ``status`` in place (one CTA): the unfused
    launches' record is allocated fresh and cleared on every call, where a constant of zeros
    would be folded into the module and then written by the kernels."""
    scopes = ThreadScopes(STATUS_WORDS)
    status = tirx.decl_buffer((STATUS_WORDS,), "int32", "status")
    with IRBuilder() as ib:
        with Tb.prim_func():
            Tb.func_name(name)
            Tb.func_attr({"global_symbol": name, "tirx.is_scheduled": True})
            Tb.arg("status", status)
            Tb.device_entry()
            IRBuilder.name("bx", Tb.cta_id([1]))
            for d in scopes.defs:
                Tb.add_to_parent(tirx.ScopeIdDefStmt(d))
            Tb.add_to_parent(tirx.BufferStore(status, i32(0), [scopes.tx]))
    return ib.get()
