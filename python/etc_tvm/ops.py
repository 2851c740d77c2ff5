"""The etc Relax operators: how an event-tensor program lives in a Relax function.

``etc.event_tensor(shape[, wait_count])``
    A fresh ETensor: an int32 tensor of event counters with a (symbolic) shape. Attrs: ``name``,
    ``wait_count`` (an int, absent when inferred from the producers or given as the tensor
    argument), ``shard`` (``"S[k]"``, absent when not sharded).
``etc.local_view(E)``
    This rank's shard of a sharded ETensor. Attr ``world_size``.
``etc.call_device(fn, (args...), (waited ETensors...), (notified ETensors...), tile_num)``
    A grid of ``tile_num`` tasks of the device function ``fn``. Attrs ``in_edges`` and
    ``out_edges`` hold one edge-map string per waited / notified ETensor; ``name`` and
    ``out_names`` label the call and its outputs in reports (binding names change under
    passes); ``symmetric`` holds 1 for each output that is a symmetric tensor (one copy per
    rank at the same place, which other ranks' tasks may write); the output type is the
    call's ``ty_args[0]`` (a tensor, or a tuple of tensors), as for ``R.call_tir``.

The ops are pure: at the Relax level an ETensor is a value that names a set of counters, and a
call's outputs are fresh tensors, so the standard Relax passes keep or drop them by data flow
alone. A custom Relax Type for ETensors does not survive normalisation in TVM 0.27, so an
ETensor is an int32 ``relax.TensorType`` and its metadata lives in the attrs above. The schedule
transforms lower the ops; left unlowered, they fail at VM code generation.
"""
from __future__ import annotations

from dataclasses import dataclass

from tvm import ir, relax
from tvm.ir import Op, register_op_attr

EVENT_TENSOR = "etc.event_tensor"
LOCAL_VIEW = "etc.local_view"
CALL_DEVICE = "etc.call_device"


def _infer_event_tensor(call, _bb):
    return relax.TensorType(call.args[0], "int32")


def _infer_from_ty_args(call, _bb):
    return call.ty_args[0]


for _name, _infer in ((EVENT_TENSOR, _infer_event_tensor), (LOCAL_VIEW, _infer_from_ty_args),
                      (CALL_DEVICE, _infer_from_ty_args)):
    register_op_attr(_name, "FInferType", _infer)
    register_op_attr(_name, "FPurity", True)


def event_tensor(shape, *, name: str, wait_count=None, shard: str | None = None) -> ir.Call:
    """``wait_count``: None (inferred), an int, or a relax int32 tensor of the same shape."""
    args = [relax.ShapeExpr(list(shape))]
    attrs = {"name": name}
    if isinstance(wait_count, int):
        attrs["wait_count"] = wait_count
    elif wait_count is not None:
        args.append(wait_count)
    if shard is not None:
        attrs["shard"] = shard
    return ir.Call(Op.get(EVENT_TENSOR), args, attrs=attrs)


def local_view(etensor: relax.Expr, shape, world_size: int) -> ir.Call:
    return ir.Call(Op.get(LOCAL_VIEW), [etensor], attrs={"world_size": world_size},
                   ty_args=[relax.TensorType(list(shape), "int32")])


def call_device(fn: ir.GlobalVar, args, in_events, in_edges, out_events, out_edges, tile_num,
                out_ty, *, name: str, out_names, schedule: str = "", symmetric=()) -> ir.Call:
    attrs = {"in_edges": list(in_edges), "out_edges": list(out_edges), "name": name,
             "out_names": list(out_names), "schedule": schedule}
    if any(symmetric):
        attrs["symmetric"] = [int(s) for s in symmetric]
    return ir.Call(Op.get(CALL_DEVICE),
                   [fn, relax.Tuple(list(args)), relax.Tuple(list(in_events)),
                    relax.Tuple(list(out_events)), relax.ShapeExpr(list(tile_num))],
                   attrs=attrs, ty_args=[out_ty])


def is_op(expr, name: str) -> bool:
    return isinstance(expr, ir.Call) and isinstance(expr.op, Op) and expr.op.name == name


@dataclass(frozen=True)
class EventTensorCall:
    """Typed view of an ``etc.event_tensor`` call."""

    shape: tuple
    name: str
    wait_count: int | relax.Expr | None
    shard: str | None

    @property
    def shard_dim(self) -> int | None:
        return None if self.shard is None else int(self.shard.strip()[2:-1])

    @staticmethod
    def of(call: ir.Call) -> "EventTensorCall":
        attrs = call.attrs
        if len(call.args) > 1:
            count = call.args[1]
        else:
            count = int(attrs["wait_count"]) if "wait_count" in attrs else None
        return EventTensorCall(tuple(call.args[0].values), str(attrs["name"]), count,
                               str(attrs["shard"]) if "shard" in attrs else None)


@dataclass(frozen=True)
class CallDeviceCall:
    """Typed view of an ``etc.call_device`` call."""

    fn: ir.GlobalVar
    args: tuple
    in_events: tuple
    in_edges: tuple
    out_events: tuple
    out_edges: tuple
    tile_num: tuple
    out_ty: ir.Type
    name: str
    out_names: tuple
    schedule: str | None  # "static", "dynamic", or None: the strategy's
    symmetric: tuple = ()  # per output

    @staticmethod
    def of(call: ir.Call) -> "CallDeviceCall":
        fn, args, ins, outs, grid = call.args
        return CallDeviceCall(fn, tuple(args.fields), tuple(ins.fields),
                              tuple(str(s) for s in call.attrs["in_edges"]), tuple(outs.fields),
                              tuple(str(s) for s in call.attrs["out_edges"]), tuple(grid.values),
                              call.ty_args[0], str(call.attrs["name"]),
                              tuple(str(n) for n in call.attrs["out_names"]),
                              str(call.attrs["schedule"]) or None
                              if "schedule" in call.attrs else None,
                              tuple(bool(int(s)) for s in call.attrs["symmetric"])
                              if "symmetric" in call.attrs else (False,) * len(call.attrs[
                                  "out_names"]))

    @property
    def out_types(self) -> tuple:
        ty = self.out_ty
        return tuple(ty.fields) if isinstance(ty, relax.TupleType) else (ty,)
