"""Inlining a device function's body into a generated kernel.

A device function is a complete CTA kernel ("kernel style", see ``etc_tvm.device_func``). To run
one of its tasks inside a persistent kernel, its body is taken out of the ``T.device_entry()``
region, given fresh definitions (the same function may be inlined many times), its thread and
warp ids are mapped onto the kernel's, its coordinates are bound to the decoded task, its
symbolic dims to the sizes of the tensors it is given, and its tensor parameters become views
of the kernel's buffers.
"""
from __future__ import annotations

from typing import Callable, Sequence

import tvm
import tvm_ffi
from tvm import tirx
from tvm.tirx import buffer_data

from ..device_func import RANK, WORLD_SIZE, DeviceFunc, is_input_check, split_prelude

# ScopeIdDef.scope values (tvm/tirx/exec_scope.py) -> (parent, current) scope names
SCOPE_NAMES = {3: ("cta", "warpgroup"), 4: ("cta", "warp"), 5: ("warpgroup", "warp"),
               6: ("warp", "thread"), 7: ("cta", "thread"), 8: ("warpgroup", "thread")}
CTA_THREAD = 7


def i32(value: int) -> tirx.IntImm:
    return tirx.IntImm("int32", value)


def substitute(node, vmap: dict):
    """Replace Vars (scalars and buffers alike: buffers are Vars in TVM 0.27)."""
    return tvm_ffi.structural_map(node, (tvm.ir.Var, lambda v: vmap.get(v, v)), order="post")


class ThreadScopes:
    """The kernel's scope ids: ``tx`` plus one definition per other id the bodies declare."""

    def __init__(self, num_threads: int):
        self.num_threads = num_threads
        self.tx = tirx.Var("tx", "int32")
        self.defs = [tirx.ScopeIdDef([self.tx], [i32(num_threads)], "cta", "thread")]
        self._ids = {(CTA_THREAD, (num_threads,)): [self.tx]}

    def map_ids(self, scope_def, fn: str) -> dict:
        key = (int(scope_def.scope), tuple(int(e) for e in scope_def.extents))
        if key not in self._ids:
            if key[0] == CTA_THREAD:
                raise ValueError(f"device function {fn} runs {list(key[1])} threads, the kernel "
                                 f"{self.num_threads}: every task of one kernel has the same "
                                 "thread count")
            fresh = [tirx.Var(v.name, v.ty) for v in scope_def.def_ids]
            self.defs.append(tirx.ScopeIdDef(fresh, list(scope_def.extents),
                                             *SCOPE_NAMES[key[0]]))
            self._ids[key] = fresh
        return dict(zip(scope_def.def_ids, self._ids[key]))


def shared_allocations(body: tirx.Stmt) -> list:
    allocs = []
    tvm_ffi.structural_walk(body, [(tirx.AllocBuffer, allocs.append)], order="pre")
    return [a for a in allocs if a.buffer.scope() in ("shared", "shared.dyn")]


def nbytes(buf) -> int:
    n = tvm.DataType(buf.dtype).bits // 8
    for d in buf.shape:
        n *= int(d)
    return n


def shared_bytes(fn: DeviceFunc, align: int = 128) -> int:
    """Bytes of shared memory one task of ``fn`` needs in the kernel's arena."""
    total = 0
    for a in shared_allocations(fn.prim_func.body):
        total = (total + align - 1) // align * align + nbytes(a.buffer)
    return total


def input_check_sites(graph) -> list[tuple]:
    """Every ``(call, check number)`` of ``graph``'s device functions, numbered as kernels
    report a failed ``input_check``: calls in order, each call's checks in order."""
    return [(c, k) for c in graph.calls for k in range(len(c.fn.checks))]


def inline_task(fn: DeviceFunc, coords: Sequence, buffers: Sequence, scopes: ThreadScopes,
                arena: tirx.Buffer | None, align: int = 128, rank: int = 0,
                world_size: int = 1, maps: Sequence[tirx.Var] = (),
                check: Callable | None = None) -> tuple[list | None, tirx.Stmt]:
    """``(prelude, body)``: the statements that run ``fn``'s body for the task at ``coords``
    on ``buffers``, split at its ``await_inputs`` mark (the prelude a list of statements;
    None, and all of it the body, where it has none), on
    rank ``rank`` of ``world_size`` (``RANK`` and ``WORLD_SIZE`` in the body); ``maps``: the
    kernel's encoded tensor maps in place of ``fn.tensor_maps``, in order. ``check(value,
    size, number)``: what the body's ``input_check`` s become (a call that records a failed
    check in the kernel's stop record); a body with checks needs it."""
    if len(maps) != len(fn.tensor_maps):
        raise ValueError(f"{fn.name} reads {len(fn.tensor_maps)} tensor maps, "
                         f"{len(maps)} given")
    func = tvm.s_tir.renew_defs(fn.prim_func)
    stmts = list(tirx.stmt_list(func.body.body))
    # renew_defs renews the free map variables too; their names are the parameters'
    free = {v.name: v for v in tirx.analysis.undefined_vars(func.body, func.params)}
    vmap = {free[m.var.name]: v for m, v in zip(fn.tensor_maps, maps) if m.var.name in free}
    prologue = []
    while stmts and isinstance(stmts[0], tirx.ScopeIdDefStmt):
        vmap.update(scopes.map_ids(getattr(stmts.pop(0), "def"), fn.name))
    params = list(func.params)
    coord_params, buffer_params = params[:fn.num_coords], params[fn.num_coords:]
    prologue += [tirx.Bind(p, v) for p, v in zip(coord_params, coords)]
    bound = set()
    for param, buf in zip(buffer_params, buffers):
        for want, have in zip(param.shape, buf.shape):
            if isinstance(want, tirx.Var) and want not in bound:
                prologue.append(tirx.Bind(want, tirx.Cast(str(want.ty), have)
                                          if str(have.ty) != str(want.ty) else have))
                bound.add(want)
        prologue.append(tirx.DeclBuffer(param, data=buffer_data(buf)))
    if fn.checks and check is None:
        raise ValueError(f"{fn.name} checks its inputs: the kernel must bind its checks to a "
                         "stop record")
    body = _bind_placeholders(substitute(tirx.stmt_seq(*stmts), vmap), rank, world_size, check)
    body = tirx.stmt_seq(*prologue, body)
    if arena is not None:
        body = _into_arena(body, arena, align)
    split = split_prelude(tirx.stmt_list(body))
    if split is None:
        return None, body
    return split[0], tirx.stmt_seq(*split[1]) if split[1] else tirx.Evaluate(0)


# Statements that only name things: a prelude leaves them unguarded, for the body after it.
DECLARATIONS = (tirx.Bind, tirx.DeclBuffer, tirx.AllocBuffer)


def encode_tensor_maps(tasks) -> tuple[list[list[tirx.Var]], list[tirx.Stmt]]:
    """For each ``(fn, buffers, name)`` (a device function, the kernel buffers of its tensor
    parameters, a name for its maps), the kernel's variables of ``fn.tensor_maps``, and the
    host statements that encode them. One map per buffer, box and swizzle: calls that load
    the same tensor alike share it."""
    made, out, stmts = {}, [], []
    for fn, buffers, name in tasks:
        by_name = {p.name: b for p, b in zip(fn.buffer_params, buffers)}
        own = []
        for m in fn.tensor_maps:
            buf = by_name[m.param]
            key = (buf, m.box, m.swizzle)
            if key not in made:
                made[key], encode = m.encode(buf, f"{name}_{m.param}_map")
                stmts += encode
            own.append(made[key])
        out.append(own)
    return out, stmts


def _bind_placeholders(body: tirx.Stmt, rank: int, world_size: int,
                       check: Callable | None) -> tirx.Stmt:
    """``RANK`` and ``WORLD_SIZE`` of the body replaced by their values, its input checks by
    ``check``'s."""
    values = {RANK.args[0].value: i32(rank), WORLD_SIZE.args[0].value: i32(world_size)}

    def replace(call):
        if is_input_check(call):
            value, size, number = call.args[1:]
            return check(value, size, number.value)
        if call.op.same_as(RANK.op) and isinstance(call.args[0], tvm.ir.StringImm):
            return values.get(call.args[0].value, call)
        return call

    return tvm_ffi.structural_map(body, (tvm.ir.Call, replace), order="post")


def _into_arena(body: tirx.Stmt, arena: tirx.Buffer, align: int) -> tirx.Stmt:
    """Shared allocations become views of the kernel's one dynamic arena, from byte 0 (tasks
    run one after another in a CTA, separated by barriers, so they reuse the same bytes)."""
    replace, views, offset = {}, {}, 0
    for alloc in shared_allocations(body):
        offset = (offset + align - 1) // align * align
        b = alloc.buffer
        view = tirx.decl_buffer(b.shape, b.dtype, b.name, data=buffer_data(arena),
                                elem_offset=i32(offset // (tvm.DataType(b.dtype).bits // 8)),
                                scope="shared.dyn")
        views[b] = view
        replace[alloc] = tirx.DeclBuffer(view, data=buffer_data(arena))
        offset += nbytes(b)
    if not replace:
        return body
    body = tvm_ffi.structural_map(body, [(tirx.AllocBuffer, lambda s: replace.get(s, s))],
                                  order="pre")
    return substitute(body, views)
