"""BarrierEdgesTransform: replace tile-level edges by one global barrier between operators.

Before::

    E = etc.event_tensor((M/64,))
    C = etc.call_device(gemm, ..., out_edges=[E: "i->i"])
    D = etc.call_device(relu, ..., in_edges=[E: "i->i"])

After::

    barrier0 = etc.event_tensor((1,))
    C = etc.call_device(gemm, ..., out_edges=[barrier0: "i->0"])
    D = etc.call_device(relu, ..., in_edges=[barrier0: "i->0"])

Every task of a call waits for every task of the call before it, in program order (which the
data flow already respects). ETensors internal to one call (a chain inside a call) stay.
Followed by ``StaticScheduleTransform`` this is the "barrier" strategy: the same megakernel
and tiles, without tile-level pipelining.
"""
from __future__ import annotations

import tvm
from tvm import relax

from .. import ops
from ..task_graph import internal_events
from .instantiate import graph_functions, without


@tvm.transform.module_pass(opt_level=0, name="etc.BarrierEdgesTransform")
class BarrierEdgesTransform:
    """Rewrite the edges of every graph function into barriers between consecutive calls."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        for name in graph_functions(mod):
            mod = _rewrite(mod, name)
        return mod


def _rewrite(mod: tvm.IRModule, name: str) -> tvm.IRModule:
    func = mod[name]
    bindings = [b for block in func.body.blocks for b in block.bindings]
    base = {b.var: b.value.args[0] for b in bindings if ops.is_op(b.value, ops.LOCAL_VIEW)}
    calls = [ops.CallDeviceCall.of(b.value) for b in bindings
             if ops.is_op(b.value, ops.CALL_DEVICE)]
    internal = internal_events([({base.get(e, e) for e in c.in_events},
                                 {base.get(e, e) for e in c.out_events}) for c in calls])
    bb = relax.BlockBuilder(without(mod, name))
    with bb.function(name, list(func.params), attrs=dict(func.attrs) if func.attrs else None):
        value = {p: p for p in func.params}
        previous = None  # the barrier the next call waits on
        seen = []
        with bb.dataflow():
            for block in func.body.blocks:
                for binding in block.bindings:
                    v = binding.value
                    if ops.is_op(v, ops.EVENT_TENSOR) and binding.var not in internal:
                        continue
                    if ops.is_op(v, ops.LOCAL_VIEW):
                        if v.args[0] in value:
                            value[binding.var] = value[v.args[0]]
                        continue
                    if ops.is_op(v, ops.CALL_DEVICE):
                        call = calls[len(seen)]
                        seen.append(call)
                        coords = "".join(chr(ord("i") + k) for k in range(len(call.tile_num)))
                        waits = [previous] if previous is not None else []
                        in_maps = [f"{coords}->0"] * len(waits)
                        barrier = None
                        if len(seen) < len(calls):  # the last call needs no barrier
                            barrier = bb.emit(ops.event_tensor([1], name=f"{call.name}_done"),
                                              f"{call.name}_done")
                        out_maps = [f"{coords}->0"] if barrier is not None else []
                        kept_in = [(value[e], m) for e, m in zip(call.in_events, call.in_edges)
                                   if base.get(e, e) in internal]
                        kept_out = [(value[e], m) for e, m in zip(call.out_events,
                                                                  call.out_edges)
                                    if base.get(e, e) in internal]
                        v = ops.call_device(call.fn, [value[a] for a in call.args],
                                            waits + [e for e, _ in kept_in],
                                            in_maps + [m for _, m in kept_in],
                                            [barrier] * (barrier is not None)
                                            + [e for e, _ in kept_out],
                                            out_maps + [m for _, m in kept_out],
                                            call.tile_num, call.out_ty,
                                            name=call.name, out_names=call.out_names,
                                            schedule=call.schedule or "")
                        previous = barrier
                    else:
                        v = _substitute(v, value)
                    emit = bb.emit if isinstance(binding.var, relax.DataflowVar) \
                        else bb.emit_output
                    value[binding.var] = emit(v, binding.var.name)
        bb.emit_func_output(_substitute(func.body.body, value))
    return bb.finalize()


def _substitute(expr, value):
    if isinstance(expr, tvm.ir.Call):
        return tvm.ir.Call(expr.op, [_substitute(a, value) for a in expr.args], expr.attrs,
                           expr.ty_args)
    if isinstance(expr, relax.Tuple):
        return relax.Tuple([_substitute(f, value) for f in expr.fields])
    if isinstance(expr, relax.TupleGetItem):
        return relax.TupleGetItem(_substitute(expr.tuple_value, value), expr.index)
    return value.get(expr, expr)
