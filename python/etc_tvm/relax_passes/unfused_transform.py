"""UnfusedTransform: every call_device becomes its own grid launch, in program order.

Before::

    C = etc.call_device(gemm, ..., out_edges=[E: "ij->ij"])
    D = etc.call_device(reduce_scatter, ..., in_edges=[E: "ij->ij"])
    Y = etc.call_device(expert, args=[D, exp_indptr, ...],
                        in_edges=[R: "e=>exp_indptr[e]:exp_indptr[e+1]"])

After::

    C = call_tir(gemm_grid, (A, B))          # one CTA per task
    D = call_tir(reduce_scatter_grid, (C,))
    Y = call_tir(expert_grid, (D, exp_indptr, ...))

    expert_grid: skip = 1
                 for e in R's elements: if exp_indptr[e] <= g < exp_indptr[e+1]: skip = 0
                 if skip == 0: body of task g

The ETensors disappear: stream order between launches is a global barrier, which satisfies
every edge between calls. A call released by trigger maps still launches its whole grid; each
CTA evaluates the maps (``events.trigger_scan``, as the persistent kernels do, on tensors that
stream order has completed, so without waiting) and runs no body if no element releases its
task: the task is skipped, as in the megakernels. A call with edges among its own tasks (a
chain) launches its tasks one at a time, in a topological order, each into the same output
tensors; that order is fixed at compile time, so such edges may not be triggers or read tensors
(``GraphError``). This is the baseline the megakernels are measured against (the same tiles as
separate kernels); ``CompiledGraph.capture`` replays them from a CUDA graph.

Tiles that check their inputs (``device_func.input_check``) write one stop record: allocated
on every call, cleared by the call's first launch (or by a launch of its own where that one
checks), passed in place to each checking launch after its inputs, and returned last, as the
persistent kernels return theirs.
"""
from __future__ import annotations

from typing import Mapping

import tvm
from tvm import relax, tirx

from ..errors import GraphError
from ..tir_sched.device_runtime import STATUS_WORDS
from ..tir_sched.grid_kernel import build_grid_kernel, build_stop_record_clear
from ..tir_sched.inline import input_check_sites
from .instantiate import graph_functions, instantiate, without, without_device_funcs


@tvm.transform.module_pass(opt_level=0, name="etc.UnfusedTransform")
class UnfusedTransform:
    """Lower every graph function to one grid kernel launch per call_device."""

    def __init__(self, dims: Mapping[str, int] | None = None):
        self.dims = dict(dims or {})

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        for name in graph_functions(mod):
            mod, graph = instantiate(mod, name, self.dims)
            mod = _rewrite(mod, name, graph)
        return without_device_funcs(mod)


def _rewrite(mod, name, graph) -> tvm.IRModule:
    func = mod[name]
    bb = relax.BlockBuilder(without(mod, name))
    params = list(func.params)
    internal = graph.internal_etensors()
    _check_internal_edges(name, graph, internal)
    order = graph.topological_order()
    sites = {(c.index, k): n for n, (c, k) in enumerate(input_check_sites(graph))}
    with bb.function(name, params, attrs=dict(func.attrs) if func.attrs else None):
        value = {t.index: params[t.param] for t in graph.tensors if t.param is not None}
        clears = bool(sites) and not graph.calls[0].fn.checks
        status = _stop_record(bb, name, cleared=not clears) if sites else None
        for call in graph.calls:
            tensors = [graph.tensors[t] for t in call.tensor_args()]
            buffers = [tirx.decl_buffer(t.shape, t.dtype, t.name) for t in tensors]
            out_tys = [relax.TensorType(list(graph.tensors[t].shape), graph.tensors[t].dtype)
                       for t in call.outputs]
            inputs = [value[t] for t in call.inputs]
            triggers = [(e.map, graph.etensors[e.etensor].shape) for e in call.triggers]
            checks = [sites[(call.index, k)] for k in range(len(call.fn.checks))]
            clears_record = clears and call.index == 0
            checked = [status] if checks or clears_record else []
            launch = _Launch(bb, out_tys, takes_record=bool(checked))
            one_task = any(e.etensor in internal for e in call.in_edges)
            kernel_name = f"{call.name}_{'task' if one_task else 'grid'}"
            gv = bb.add_func(build_grid_kernel(
                call.fn, call.grid, buffers, kernel_name, inputs=len(inputs), one_task=one_task,
                triggers=triggers, checks=checks, first_task=call.first_task,
                clears_record=clears_record), kernel_name)
            if one_task:
                outs = None
                for task in (t for t in order if graph.task_call[t] == call.index):
                    index = relax.prim_value(tvm.tirx.IntImm("int64", task - call.first_task))
                    outs, checked = launch(gv, [*inputs, index], checked, outs)
            else:
                outs, checked = launch(gv, inputs, checked, None, call.name)
            if checked:
                (status,) = checked
            for t, out in zip(call.outputs, outs):
                value[t] = out
        bb.emit_func_output(relax.Tuple([value[t] for t in graph.outputs]
                                        + ([status] if sites else [])))
    return bb.finalize()


def _stop_record(bb, name: str, cleared: bool):
    """The stop record the input checks write (``src/etc_runtime.cuh``), allocated on every
    call and, if ``cleared``, zeroed by a launch of its own; then threaded through the
    launches that check."""
    record = bb.emit(relax.op.builtin.alloc_tensor(relax.ShapeExpr([STATUS_WORDS]), "int32", 0))
    if not cleared:
        return record
    clear = bb.add_func(build_stop_record_clear(f"{name}_clear_stop_record"),
                        f"{name}_clear_stop_record")
    return bb.emit(relax.op.call_tir_inplace(clear, [record], 0,
                                             relax.TensorType([STATUS_WORDS], "int32")), "status")


class _Launch:
    """One grid launch of a call's kernel: its outputs fresh (``call_tir``) or, given
    ``outs``, written in place (a call launched task by task); the stop record, if the kernel
    takes one, written in place after the inputs."""

    def __init__(self, bb, out_tys, takes_record: bool):
        self.bb, self.out_tys, self.record = bb, out_tys, int(takes_record)

    def __call__(self, gv, args, checked, outs, name=None):
        """(the call's outputs, the stop record as a list of one or none) after the launch."""
        n = len(args)
        args = [*args, *checked, *(outs or [])]
        tys = [*self.out_tys, *([relax.TensorType([STATUS_WORDS], "int32")] * self.record)]
        inplace = [n + self.record + k if outs else -1 for k in range(len(self.out_tys))] \
            + list(range(n, n + self.record))
        single = len(tys) == 1
        if all(i == -1 for i in inplace):
            call = relax.call_tir(gv, args, tys[0] if single else tys)
        else:
            call = relax.op.call_tir_inplace(gv, args, inplace[0] if single else inplace,
                                             tys[0] if single else tys)
        result = self.bb.emit(call, name) if name else self.bb.emit(call)
        got = _unpack(self.bb, result, len(tys))
        return got[:len(self.out_tys)], got[len(self.out_tys):]


def _check_internal_edges(name, graph, internal) -> None:
    """A call whose tasks wait on each other launches them one at a time, in a topological
    order of its static edges fixed at compile time; a trigger or a map that reads a tensor
    orders them by run-time data, which that order cannot follow."""
    for call in graph.calls:
        for e in call.in_edges:
            if e.etensor in internal and (e.map.is_trigger or e.map.is_data_dependent):
                raise GraphError(
                    f"{name}: {call.name} waits on its own tasks through '{e.map}' on "
                    f"{e.etensor}, an order that run-time data decides: the unfused strategy "
                    "launches such tasks one at a time in an order fixed at compile time")


def _unpack(bb, result, n: int) -> list:
    """The outputs of a call_tir: the result itself, or its tuple fields."""
    return [result] if n == 1 else [bb.emit(relax.TupleGetItem(result, k)) for k in range(n)]
