"""Device functions: one tile task, written once in TVMScript (TIRx).

A device function is a complete CTA kernel in "kernel style"::

    @device_func
    def add_tile(i: T.int32, A: T.Buffer((M, 64), "float32"), B: T.Buffer((M, 64), "float32")):
        T.device_entry()
        tx = T.thread_id([64])
        B[i, tx] = A[i, tx] + T.float32(1)

Its leading int32 parameters are the task coordinates, the rest are its tensors (inputs first,
then outputs, as in ``R.call_tir``), and its body is CTA-level code with no ``T.cta_id``: the
schedule transform inlines it into the persistent kernel, and the same function also compiles
as a kernel of its own. The thread count is read from ``T.thread_id`` (or declared).

A tile may update an input in place (a KV cache, say): it names such tensors in ``updates``.
Nothing orders that write before another call's read but the event edges between them, and the
CPU reference executor lets only those inputs be written.

In a graph function of several ranks, a body reads its rank and the world size as ``RANK`` and
``WORLD_SIZE`` (closure variables of the script; each kernel binds them, 0 and 1 on one GPU).
A task writes a symmetric output on the rank its out-edge notifies (the owner of the element):
the kernel hands the body that rank's copy, so the body addresses it as its own.

A value read from an input that the body indexes with (an expert id, a slot) goes through
``input_check(value, size, n)``: outside ``0..size-1`` the kernel records it and the host
raises the n-th of the function's ``checks`` messages, naming the task and the value.

A body may mark where its task waits for its in-edges with ``T.evaluate(await_inputs())``, a
statement of its top level. What comes before it, the task's *prelude*, a persistent kernel
runs before those waits, so that loads that need no producer (a weight slab into shared
memory) overlap them; where the task's inputs are ready anyway (its own grid, the reference
executor) the mark is nothing.

A device function carries a NumPy reference with the same parameters (coordinates as ints,
tensors as arrays whose outputs it writes in place); the CPU reference executor runs it. A
reference of a multi-rank graph function may also take keyword-only ``rank``, ``world_size``
and ``peers`` (``peers[q].name`` is rank q's copy of the symmetric tensor parameter ``name``:
what a put or get reaches on the GPU); the executor passes only those it declares.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Callable

import tvm
import tvm_ffi
from tvm import tirx
from tvm.script import tirx as T

from .errors import EtcError, GraphError
from .tensor_map import TensorMap

_CTA_THREAD_SCOPE = 7  # ScopeIdDef.scope of T.thread_id: (cta, thread)
REFERENCE_CONTEXT = ("rank", "world_size", "peers")
# In a body: the rank its kernel runs and the world size, constants each kernel substitutes
# (a placeholder call, so that the script is well formed on its own).
RANK = tirx.call_extern("int32", "etc_rank")
WORLD_SIZE = tirx.call_extern("int32", "etc_world_size")
INPUT_CHECK = "etc_input_check"
AWAIT_INPUTS = "etc_await_inputs"


def input_check(value, size, check: int = 0) -> tirx.PrimExpr:
    """In a body: 1 if ``0 <= value < size``, else 0, for a value read from an input that the
    tile indexes with (an expert id, a slot). Where it is outside, the kernel records it (a
    persistent kernel stops) and the host raises the device function's ``checks[check]``
    (``{value}`` in it becomes the value), naming the task; the body must leave such a value
    unused. A placeholder call that each kernel binds to its stop record and running task."""
    return tirx.call_extern("int32", INPUT_CHECK, value, size, tirx.IntImm("int32", check))


def await_inputs() -> tirx.PrimExpr:
    """In a body, as the statement ``T.evaluate(await_inputs())`` of its top level: where the
    task's waits for its in-edges go. Its prelude, the statements before, runs first in a
    persistent kernel, for every task of the call (released by its trigger or not, and, with
    symbolic sizes, inside the launch's grids only): it may read the task's coordinates,
    inputs that no call writes, and tensors whose producers the kernel then waits for first
    (``DeviceFunc.prelude_reads``); it writes shared and local memory only. The kernel drains
    the prelude's ``cp.async`` copies after the task, so that a task whose body does not run
    leaves none in flight."""
    return tirx.call_extern("int32", AWAIT_INPUTS)


@dataclass(frozen=True)
class BufferParam:
    """A tensor parameter of a device function."""

    name: str
    shape: tuple  # PrimExpr per dim; a tirx.Var is a symbolic dim bound at the call site
    dtype: str

    @property
    def rank(self) -> int:
        return len(self.shape)


class DeviceFunc:
    """A tile task: its TIRx PrimFunc, its parameters, thread count, cost hint and reference."""

    def __init__(self, prim_func: tirx.PrimFunc, *, name: str, num_threads: int | None = None,
                 cost=1.0, reference: Callable | None = None, updates=(), tensor_maps=(),
                 checks=(), requires=()):
        self.prim_func = prim_func
        self.name = name
        self.coord_params, self.buffer_params = _split_params(prim_func, name)
        self.requires = _check_requires(tuple(requires), self.buffer_params, name)
        self.updates = _check_updates(tuple(updates), self.buffer_params, name)
        self.tensor_maps = _check_tensor_maps(tuple(tensor_maps), self, name)
        self.checks = _check_input_checks(tuple(checks), prim_func, name)
        self.prelude_reads = _prelude_reads(prim_func, name)
        self.num_threads = _thread_count(prim_func, name, num_threads)
        self.cost = _check_cost(cost, self.buffer_params, name)
        self._reference = reference

    def _bound(self, shapes) -> tvm.sym.Analyzer:
        """An analyzer with the symbolic dims of the tensor parameters bound to ``shapes``
        (sizes, or expressions of a graph function's symbolic dims, taken in each dim's own
        type: a graph's dims are int64, a tile's usually int32)."""
        analyzer = tvm.sym.Analyzer()
        for param, shape in zip(self.buffer_params, shapes):
            for dim, n in zip(param.shape, shape):
                if isinstance(dim, tirx.Var):
                    dtype = str(dim.ty)
                    n = n if tvm.ir.is_prim_expr(n) else tirx.IntImm(dtype, int(n))
                    analyzer.bind(dim, n if str(n.ty) == dtype else tirx.Cast(dtype, n))
        return analyzer

    def check_requires(self, shapes, call: str) -> list[tuple]:
        """Raise ``GraphError`` naming ``call`` where the ``shapes`` of its tensors break one of
        the tile's ``requires``; return those the shapes leave open (shapes in a graph
        function's symbolic dims: a kernel on them checks these at launch) as (condition on
        those dims, error message)."""
        if not self.requires:
            return []
        analyzer = self._bound(shapes)

        def tensors() -> str:  # only for a message: most calls keep to every requirement
            return ", ".join(f"{p.name} ({', '.join(str(n) for n in shape)}"
                             f"{',' if len(shape) == 1 else ''})"
                             for p, shape in zip(self.buffer_params, shapes))

        open_ = []
        for cond, what in self.requires:
            value = analyzer.simplify(cond)
            if not isinstance(value, tirx.IntImm):
                open_.append((value, f"{call}: {self.name} takes {what}, which the sizes of "
                                     f"{tensors()} break"))
            elif not value.value:
                raise GraphError(f"{call}: {self.name} takes {what}, got {tensors()}")
        return open_

    def task_cost(self, shapes) -> float:
        """The cost hint of one task, given the concrete shapes of its tensors."""
        if isinstance(self.cost, float):
            return self.cost
        value = self._bound(shapes).simplify(tirx.Cast("float64", self.cost))
        if not isinstance(value, tirx.FloatImm) or not value.value > 0:
            raise EtcError(f"device function {self.name}: its cost {self.cost} is {value} for "
                           f"tensors of shapes {list(shapes)}; it must be a positive number")
        return float(value.value)

    @property
    def reference(self) -> Callable:
        if self._reference is None:
            raise EtcError(f"device function {self.name} has no NumPy reference: add one with "
                           f"@{self.name}.set_reference")
        return self._reference

    def set_reference(self, fn: Callable) -> Callable:
        """Decorator: ``@tile.set_reference`` registers the NumPy reference of this tile."""
        self._reference = fn
        return fn

    @property
    def reference_context(self) -> tuple[str, ...]:
        """The keyword-only parameters among ``REFERENCE_CONTEXT`` that the reference takes."""
        params = inspect.signature(self.reference).parameters.values()
        return tuple(p.name for p in params
                     if p.kind is p.KEYWORD_ONLY and p.name in REFERENCE_CONTEXT)

    @property
    def num_coords(self) -> int:
        return len(self.coord_params)

    def param(self, name: str) -> BufferParam:
        for p in self.buffer_params:
            if p.name == name:
                return p
        raise KeyError(name)

    def __repr__(self) -> str:
        params = ", ".join([*self.coord_params, *(p.name for p in self.buffer_params)])
        return f"<device_func {self.name}({params}), {self.num_threads} threads>"


def device_func(fn=None, *, num_threads: int | None = None, cost: float = 1.0,
                reference: Callable | None = None, updates=(), tensor_maps=(), checks=(),
                requires=()):
    """Declare a device function: ``@device_func`` or ``@device_func(num_threads=..., cost=...)``.

    ``fn`` is a Python function written in TVMScript (parsed here as a TIRx ``prim_func``) or an
    already parsed ``tirx.PrimFunc``. ``cost`` is a relative run-time hint for static schedules:
    a number, or an expression of the symbolic dims of the tensor parameters (a GEMM tile's
    ``K``), evaluated for each call. ``updates`` names tensor parameters that the tile writes
    in place although they are inputs (state such as a KV cache). ``tensor_maps``: the
    ``TensorMap`` s its TMA loads read through (``etc_tvm.tensor_map``), which every kernel
    running it encodes on the host. ``checks``: the errors its ``input_check`` s raise, by
    number. ``requires``: ``(condition, what)`` pairs, conditions on the symbolic dims of its
    tensor parameters that its grid arithmetic assumes (a GEMM tile's ``K % bk == 0``), each
    checked where a call's dims are known, a task graph's instantiation (``GraphError``:
    "<tile> takes <what>, got <its tensors' shapes>").
    """

    def wrap(f) -> DeviceFunc:
        if isinstance(f, DeviceFunc):
            raise EtcError(f"{f.name} is already a device function")
        if isinstance(f, tirx.PrimFunc):
            name = str(f.attrs["global_symbol"]) if f.attrs and "global_symbol" in f.attrs \
                else getattr(f, "__name__", "device_func")
            prim = f
        else:
            name, prim = f.__name__, T.prim_func(f)
        return DeviceFunc(prim, name=name, num_threads=num_threads, cost=cost,
                          reference=reference, updates=updates, tensor_maps=tensor_maps,
                          checks=checks, requires=requires)

    return wrap(fn) if fn is not None else _Decorator(wrap)


class _Decorator:
    """``device_func(...)`` used as the innermost decorator of a TVMScript function.

    The TVMScript parser dispatches on the innermost decorator, so it carries TIRx's token.
    """

    dispatch_token = "tirx"

    def __init__(self, wrap):
        self._wrap = wrap

    def __call__(self, f) -> DeviceFunc:
        return self._wrap(f)


device_func.dispatch_token = "tirx"


def _check_cost(cost, buffer_params, name: str):
    """A positive float, or an integer/float expression of the tensor parameters' dims."""
    if isinstance(cost, (int, float)) and not isinstance(cost, bool):
        if not cost > 0:
            raise EtcError(f"device function {name}: cost must be positive, got {cost}")
        return float(cost)
    if not tvm.ir.is_prim_expr(cost):
        raise EtcError(f"device function {name}: cost must be a number or an expression of its "
                       f"tensors' dims, got {cost!r}")
    dims = {d for p in buffer_params for d in p.shape if isinstance(d, tirx.Var)}
    stray = [v for v in tvm.tirx.analysis.undefined_vars(cost) if v not in dims]
    if stray:
        raise EtcError(f"device function {name}: its cost {cost} uses {stray}, which are not "
                       "dims of its tensor parameters")
    return cost


def _check_requires(requires: tuple, buffer_params, name: str) -> tuple:
    """(condition, what) pairs whose conditions are boolean expressions of the tensor
    parameters' dims."""
    dims = {d for p in buffer_params for d in p.shape if isinstance(d, tirx.Var)}
    checked = []
    for item in requires:
        cond = item[0] if isinstance(item, tuple) and len(item) == 2 else None
        if hasattr(cond, "asobject"):  # ``a == b`` of two expressions
            cond = cond.asobject()
        if not (tvm.ir.is_prim_expr(cond) and str(cond.ty) == "bool"
                and isinstance(item[1], str)):
            raise EtcError(f"device function {name}: requires takes (condition, what) pairs, "
                           f"a boolean expression of its tensors' dims and a string, got "
                           f"{item!r}")
        stray = [v for v in tvm.tirx.analysis.undefined_vars(cond) if v not in dims]
        if stray:
            raise EtcError(f"device function {name}: its requirement {cond} uses {stray}, "
                           "which are not dims of its tensor parameters")
        checked.append((cond, item[1]))
    return tuple(checked)


def _check_updates(updates: tuple, buffer_params, name: str) -> tuple:
    names = [p.name for p in buffer_params]
    stray = [u for u in updates if u not in names]
    if stray:
        raise EtcError(f"device function {name}: updates names {stray}, not among its tensor "
                       f"parameters {names}")
    return updates


def _check_tensor_maps(maps: tuple, fn: DeviceFunc, name: str) -> tuple:
    params = [p.name for p in fn.buffer_params]
    for m in maps:
        if not isinstance(m, TensorMap):
            raise EtcError(f"device function {name}: tensor_maps takes TensorMap objects, "
                           f"got {m!r}")
        if m.param not in params:
            raise EtcError(f"device function {name}: tensor map of '{m.param}', which is not "
                           f"one of its tensor parameters {params}")
        param = fn.param(m.param)
        m.check(param.shape, param.dtype, f"device function {name}")
    return maps


def is_input_check(call: tvm.ir.Call) -> bool:
    """Whether ``call`` is an ``input_check`` placeholder."""
    return (call.op.same_as(tvm.ir.Op.get("tirx.call_extern")) and
            isinstance(call.args[0], tvm.ir.StringImm) and call.args[0].value == INPUT_CHECK)


def _check_input_checks(checks: tuple, func: tirx.PrimFunc, name: str) -> tuple:
    if not all(isinstance(c, str) for c in checks):
        raise EtcError(f"device function {name}: checks are the messages of its input "
                       f"checks, got {checks!r}")
    calls = []
    tvm_ffi.structural_walk(func.body, [(tvm.ir.Call, calls.append)], order="pre")
    for call in filter(is_input_check, calls):
        check = call.args[3]
        if not isinstance(check, tirx.IntImm) or not 0 <= check.value < len(checks):
            raise EtcError(f"device function {name}: input_check number {check} has no "
                           f"message among its {len(checks)} checks")
    return checks


def is_await_inputs(stmt: tirx.Stmt) -> bool:
    """Whether ``stmt`` is the ``await_inputs`` mark."""
    return (isinstance(stmt, tirx.Evaluate) and isinstance(stmt.value, tvm.ir.Call)
            and stmt.value.op.same_as(tvm.ir.Op.get("tirx.call_extern"))
            and isinstance(stmt.value.args[0], tvm.ir.StringImm)
            and stmt.value.args[0].value == AWAIT_INPUTS)


def split_prelude(stmts: list) -> tuple[list, list] | None:
    """``(prelude, rest)`` of a body's top-level statements around its ``await_inputs``
    mark (dropped), or None where it has none."""
    marks = [i for i, s in enumerate(stmts) if is_await_inputs(s)]
    return None if not marks else (stmts[:marks[0]], stmts[marks[0] + 1:])


def _prelude_reads(func: tirx.PrimFunc, name: str) -> tuple[str, ...]:
    """The tensor parameters the prelude of ``func`` reads (``await_inputs``), after checking
    that the mark is one statement of the top level and that the prelude writes no tensor."""
    entry = func.body
    stmts = list(tirx.stmt_list(entry.body)) if isinstance(entry, tirx.AttrStmt) else []
    marks = []
    tvm_ffi.structural_walk(func.body, [(tirx.Evaluate, lambda s: marks.append(s)
                                         if is_await_inputs(s) else None)], order="pre")
    split = split_prelude(stmts)
    if len(marks) > 1 or (marks and split is None):
        raise EtcError(f"device function {name}: await_inputs() must be one statement of the "
                       f"body's top level (not inside a branch or loop); found {len(marks)}, "
                       f"{'none' if split is None else 'one'} at the top level")
    if split is None:
        return ()
    params = {p: p.name for p in func.params if tirx.is_buffer_var(p)}
    loads, stores = set(), set()

    def note(into, buffer):
        return lambda node: into.add(params[buffer(node)]) if buffer(node) in params else None

    prelude = tirx.stmt_seq(*split[0]) if split[0] else tirx.Evaluate(0)
    tvm_ffi.structural_walk(prelude, [(tvm.ir.TensorLoad, note(loads, lambda n: n.source)),
                                      (tirx.BufferStore, note(stores, lambda n: n.buffer))],
                            order="pre")
    bound = set()
    for stmt in split[0]:
        if isinstance(stmt, tirx.Bind):
            tvm_ffi.structural_walk(stmt.value, [(tvm.ir.TensorLoad,
                                                  note(bound, lambda n: n.source))], order="pre")
    if bound:
        raise EtcError(f"device function {name}: its prelude binds a value read from "
                       f"{sorted(bound)} at its top level, which runs for tasks outside the "
                       "launch's grids too; read it into a local scalar (T.local_scalar)")
    if stores:
        raise EtcError(f"device function {name}: its prelude (before await_inputs()) writes "
                       f"{sorted(stores)}; it runs before the task's waits, and writes shared "
                       "and local memory only")
    return tuple(p.name for p in func.params if tirx.is_buffer_var(p) and p.name in loads)


def _split_params(func: tirx.PrimFunc, name: str):
    coords, buffers = [], []
    for p in func.params:
        if tirx.is_buffer_var(p):
            buffers.append(BufferParam(p.name, tuple(p.shape), str(p.dtype)))
            continue
        if buffers:
            raise EtcError(f"device function {name}: scalar parameter '{p.name}' after a tensor "
                           "parameter; task coordinates come first")
        if str(p.ty) != "int32":
            raise EtcError(f"device function {name}: task coordinate '{p.name}' must be "
                           f"T.int32, got {p.ty}")
        coords.append(p.name)
    if not coords:
        raise EtcError(f"device function {name} has no task coordinates: its leading T.int32 "
                       "parameters index the task grid")
    names = [*coords, *(b.name for b in buffers)]
    if len(set(names)) != len(names):
        raise EtcError(f"device function {name}: parameter names must be distinct: {names}")
    return tuple(coords), tuple(buffers)


def _thread_count(func: tirx.PrimFunc, name: str, declared: int | None) -> int:
    entry = func.body
    if not (isinstance(entry, tirx.AttrStmt) and entry.attr_key == "tirx.device_entry"):
        raise EtcError(f"device function {name} must begin with T.device_entry()")
    found = None
    for stmt in tirx.stmt_list(entry.body):
        if not isinstance(stmt, tirx.ScopeIdDefStmt):
            break
        scope = getattr(stmt, "def")
        if int(scope.scope) in (0, 1, 2, 9):
            raise EtcError(f"device function {name} declares a cluster or CTA id: a task runs in "
                           "one CTA, its position in the grid comes from its coordinates")
        if int(scope.scope) == _CTA_THREAD_SCOPE:
            found = math.prod(int(e) for e in scope.extents)
    if found is None and declared is None:
        raise EtcError(f"device function {name} declares no T.thread_id: pass num_threads")
    if found is not None and declared is not None and found != declared:
        raise EtcError(f"device function {name} runs {found} threads (T.thread_id) but "
                       f"num_threads={declared} was declared")
    return found if found is not None else int(declared)
