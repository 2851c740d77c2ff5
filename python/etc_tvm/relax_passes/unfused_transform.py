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
"""
from __future__ import annotations

from typing import Mapping

import tvm
from tvm import relax, tirx

from ..errors import GraphError
from ..tir_sched.grid_kernel import build_grid_kernel
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
    with bb.function(name, params, attrs=dict(func.attrs) if func.attrs else None):
        value = {t.index: params[t.param] for t in graph.tensors if t.param is not None}
        for call in graph.calls:
            tensors = [graph.tensors[t] for t in call.tensor_args()]
            buffers = [tirx.decl_buffer(t.shape, t.dtype, t.name) for t in tensors]
            out_tys = [relax.TensorType(list(graph.tensors[t].shape), graph.tensors[t].dtype)
                       for t in call.outputs]
            single = len(out_tys) == 1
            out_ty = out_tys[0] if single else out_tys
            inputs = [value[t] for t in call.inputs]
            triggers = [(e.map, graph.etensors[e.etensor].shape) for e in call.triggers]
            if any(e.etensor in internal for e in call.in_edges):
                kernel = build_grid_kernel(call.fn, call.grid, buffers, f"{call.name}_task",
                                           num_inputs=len(inputs), triggers=triggers)
                gv = bb.add_func(kernel, f"{call.name}_task")
                outs = None
                for task in (t for t in order if graph.task_call[t] == call.index):
                    index = relax.prim_value(tvm.tirx.IntImm("int64", task - call.first_task))
                    if outs is None:
                        result = bb.emit(relax.call_tir(gv, [*inputs, index], out_ty))
                    else:
                        n = len(inputs) + 1
                        inplace = list(range(n, n + len(outs)))
                        result = bb.emit(relax.op.call_tir_inplace(
                            gv, [*inputs, index, *outs], inplace[0] if single else inplace,
                            out_ty))
                    outs = _unpack(bb, result, len(out_tys))
            else:
                kernel = build_grid_kernel(call.fn, call.grid, buffers, f"{call.name}_grid",
                                           triggers=triggers)
                gv = bb.add_func(kernel, f"{call.name}_grid")
                outs = _unpack(bb, bb.emit(relax.call_tir(gv, inputs, out_ty), call.name),
                               len(out_tys))
            for t, out in zip(call.outputs, outs):
                value[t] = out
        bb.emit_func_output(relax.Tuple([value[t] for t in graph.outputs]))
    return bb.finalize()


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
