"""UnfusedTransform: every call_device becomes its own grid launch, in program order.

Before::

    C = etc.call_device(gemm, ..., out_edges=[E: "ij->ij"])
    D = etc.call_device(reduce_scatter, ..., in_edges=[E: "ij->ij"])

After::

    C = call_tir(gemm_grid, (A, B))          # one CTA per task
    D = call_tir(reduce_scatter_grid, (C,))

The ETensors disappear: stream order between launches is a global barrier, which satisfies
every edge between calls. A call with edges among its own tasks (a chain) launches its tasks
one at a time, in a topological order, each into the same output tensors. This is the
baseline the megakernels are measured against (the same tiles as separate kernels);
``CompiledGraph.capture`` replays them from a CUDA graph.
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
    triggered = ", ".join(f"{c.name}: '{e.map}'" for c in graph.calls for e in c.triggers)
    if triggered:
        raise GraphError(f"{name}: trigger maps ({triggered}) release a data-dependent subset of "
                         "a call's tasks; grid launches do not support them yet")
    func = mod[name]
    bb = relax.BlockBuilder(without(mod, name))
    params = list(func.params)
    internal = graph.internal_etensors()
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
            if any(e.etensor in internal for e in call.in_edges):
                kernel = build_grid_kernel(call.fn, call.grid, buffers, f"{call.name}_task",
                                           num_inputs=len(inputs))
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
                kernel = build_grid_kernel(call.fn, call.grid, buffers, f"{call.name}_grid")
                gv = bb.add_func(kernel, f"{call.name}_grid")
                outs = _unpack(bb, bb.emit(relax.call_tir(gv, inputs, out_ty), call.name),
                               len(out_tys))
            for t, out in zip(call.outputs, outs):
                value[t] = out
        bb.emit_func_output(relax.Tuple([value[t] for t in graph.outputs]))
    return bb.finalize()


def _unpack(bb, result, n: int) -> list:
    """The outputs of a call_tir: the result itself, or its tuple fields."""
    return [result] if n == 1 else [bb.emit(relax.TupleGetItem(result, k)) for k in range(n)]
