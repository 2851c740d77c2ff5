"""Graph functions: a Python function traced into a Relax function of ETensors and call_devices.

    @graph_func
    def mlp(x: Tensor(("M", 256)), w: Tensor((256, 256))):
        M = x.shape[0]
        E = ETensor((M // 64,))
        h = call_device(gemm_tile, tile_num=(M // 64,), args=[x, w], out=Tensor((M, 256)),
                        out_edges={E: "i->i"})
        return call_device(relu_tile, tile_num=(M // 64,), args=[h], out=Tensor((M, 256)),
                           in_edges={E: "i->i"})

``mlp.mod`` is an IRModule holding the Relax function ``mlp`` and the device functions as
PrimFuncs; ``mlp.script()`` prints it.
"""
from __future__ import annotations

import inspect
from typing import Callable, Mapping, Sequence

import tvm
from tvm import relax

from . import edge_map, ops, tracing
from .device_func import DeviceFunc
from .errors import EtcError
from .etensor import ETensor
from .tensor import Tensor, TensorValue, as_dim, dim_str, shape_str
from .tensor_map import TensorMap


class GraphFunc:
    """A traced graph function: the IRModule plus the device functions it calls, by name."""

    def __init__(self, name: str, mod: tvm.IRModule, device_funcs: Mapping[str, DeviceFunc]):
        self.name = name
        self.mod = mod
        self.device_funcs = dict(device_funcs)

    @staticmethod
    def from_module(mod: tvm.IRModule, name: str) -> "GraphFunc":
        """The graph function ``name`` of a module, e.g. one that went through other passes;
        its device functions are rebuilt from their PrimFuncs (with no NumPy reference)."""
        funcs = {}
        for gv, f in mod.functions_items():
            if isinstance(f, tvm.tirx.PrimFunc) and f.attrs and "etc.device_func" in f.attrs:
                cost = f.attrs.get("etc.cost", 1.0)
                maps = [TensorMap.from_attr(a) for a in f.attrs.get("etc.tensor_maps", [])]
                checks = [str(c) for c in f.attrs.get("etc.checks", [])]
                requires = [(cond, str(what)) for cond, what in f.attrs.get("etc.requires", [])]
                funcs[gv.name_hint] = DeviceFunc(f, name=gv.name_hint, cost=cost.value if
                                                 isinstance(cost, tvm.tirx.FloatImm) else cost,
                                                 tensor_maps=maps, checks=checks,
                                                 requires=requires)
        return GraphFunc(name, mod, funcs)

    @property
    def func(self) -> relax.Function:
        return self.mod[self.name]

    @property
    def world_size(self) -> int:
        """How many ranks run the function (SPMD); 1 unless ``@graph_func(world_size=W)``."""
        attrs = self.func.attrs
        return int(attrs["etc.world_size"]) if attrs and "etc.world_size" in attrs else 1

    def script(self) -> str:
        return self.mod.script()

    def __repr__(self) -> str:
        return f"<graph_func {self.name}: {len(self.device_funcs)} device functions>"


def graph_func(fn: Callable | None = None, *, world_size: int = 1):
    """Trace ``fn`` into a ``GraphFunc``; its parameters are annotated with ``Tensor`` types."""
    if not (isinstance(world_size, int) and world_size >= 1):
        raise EtcError(f"world_size must be a positive int, got {world_size!r}")

    def trace(f: Callable) -> GraphFunc:
        tracer = tracing.Tracer(world_size)
        params = []
        try:
            signature = inspect.signature(f, eval_str=True)
        except NameError as err:
            raise EtcError(f"graph function {f.__name__}: its annotations cannot be evaluated "
                           f"({err}); under 'from __future__ import annotations' they may only "
                           "name module-level values") from None
        for p in signature.parameters.values():
            if not isinstance(p.annotation, Tensor):
                raise EtcError(f"graph function {f.__name__}: parameter '{p.name}' needs a "
                               "Tensor(shape, dtype) annotation")
            if p.annotation.symmetric:
                raise EtcError(f"graph function {f.__name__}: parameter '{p.name}' is "
                               "symmetric; only call outputs can be (each rank passes its own "
                               "inputs)")
            ty = relax.TensorType([as_dim(d, tracer.symbols) for d in p.annotation.shape],
                                  p.annotation.dtype)
            params.append(relax.Var(tracer.claim_name(p.name, p.name), ty))
        with tracer, tracer.builder.function(f.__name__, params,
                                             attrs={"etc.world_size": world_size}):
            with tracer.builder.dataflow():
                result = f(*(TensorValue(v) for v in params))
                outputs = result if isinstance(result, (tuple, list)) else (result,)
                for r in outputs:
                    if not isinstance(r, TensorValue):
                        raise EtcError(f"graph function {f.__name__} must return tensors, "
                                       f"got {r!r}")
                out = [tracer.builder.emit_output(r.var) for r in outputs]
            tracer.builder.emit_func_output(out[0] if len(out) == 1 and not isinstance(
                result, (tuple, list)) else relax.Tuple(out))
        return GraphFunc(f.__name__, tracer.builder.finalize(), tracer.device_funcs)

    return trace(fn) if fn is not None else trace


def call_device(fn: DeviceFunc, tile_num, args: Sequence[TensorValue], out,
                in_edges: Mapping[ETensor, str] | None = None,
                out_edges: Mapping[ETensor, str] | None = None, schedule: str | None = None):
    """Launch a grid of ``tile_num`` tasks of ``fn``; returns its output tensor(s).

    ``args`` are the input tensors and ``out`` the output type(s), matching ``fn``'s tensor
    parameters in order. ``in_edges`` maps each ETensor a task waits on to its edge map,
    ``out_edges`` each ETensor it notifies (see ``edge_map``). ``schedule`` ("static" or
    "dynamic") places this call's tasks under the "mixed" strategy: in the per-SM queues or
    in the ready ring of the same kernel (unset: static); other strategies ignore it.
    """
    tracer = tracing.current("call_device")
    if not isinstance(fn, DeviceFunc):
        raise EtcError(f"call_device needs a @device_func, got {fn!r}")
    if schedule not in SCHEDULES:
        raise EtcError(f"call_device({fn.name}): schedule must be one of {SCHEDULES}, "
                       f"got {schedule!r}")
    grid = _as_tuple(tile_num)
    if len(grid) != fn.num_coords:
        raise EtcError(f"call_device({fn.name}): tile_num has {len(grid)} dims but {fn.name} "
                       f"takes {fn.num_coords} task coordinates {fn.coord_params}")
    grid = [as_dim(d, tracer.symbols) for d in grid]
    args = list(_as_tuple(args))
    outs = list(_as_tuple(out))
    if len(args) + len(outs) != len(fn.buffer_params):
        raise EtcError(f"call_device({fn.name}): {len(args)} args and {len(outs)} outputs for "
                       f"{len(fn.buffer_params)} tensor parameters "
                       f"{[p.name for p in fn.buffer_params]}")
    for a, p in zip(args, fn.buffer_params):
        if not isinstance(a, TensorValue):
            raise EtcError(f"call_device({fn.name}): argument '{p.name}' must be a tensor of the "
                           f"graph function, got {a!r}")
    for o in outs:
        if not isinstance(o, Tensor):
            raise EtcError(f"call_device({fn.name}): out must be Tensor types, got {o!r}")
    out_tys = [relax.TensorType([as_dim(d, tracer.symbols) for d in o.shape], o.dtype)
               for o in outs]
    _bind_params(fn, [a.var.ty for a in args] + out_tys)

    inputs = {p.name for p in fn.buffer_params[:len(args)]}
    readable = {p.name: p.rank for p in fn.buffer_params if p.dtype == "int32"}
    in_events, in_maps = _edges(fn, in_edges, "in", len(grid),
                                {k: v for k, v in readable.items() if k in inputs})
    out_events, out_maps = _edges(fn, out_edges, "out", len(grid), readable)

    out_ty = out_tys[0] if len(outs) == 1 and isinstance(out, Tensor) \
        else relax.TupleType(out_tys)
    single = isinstance(out_ty, relax.TensorType)
    name = tracer.claim_name(outs[0].name if single else None, fn.name)
    out_names = [name] if single else [tracer.claim_name(o.name, f"{name}_out") for o in outs]
    call = ops.call_device(tracer.global_var(fn), [a.var for a in args], in_events, in_maps,
                           out_events, out_maps, grid, out_ty, name=name, out_names=out_names,
                           schedule=schedule or "", symmetric=[o.symmetric for o in outs])
    if single:
        return TensorValue(tracer.emit(call, name))
    tup = tracer.emit(call, name)
    return tuple(TensorValue(tracer.emit(relax.TupleGetItem(tup, k), n))
                 for k, n in enumerate(out_names))


SCHEDULES = (None, "static", "dynamic")


def _as_tuple(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _edges(fn: DeviceFunc, edges, kind: str, task_rank: int, tensors: dict):
    events, maps = [], []
    for etensor, text in (edges or {}).items():
        if not isinstance(etensor, ETensor):
            raise EtcError(f"call_device({fn.name}): {kind}_edges keys must be ETensors, "
                           f"got {etensor!r}")
        if not isinstance(text, str):
            raise EtcError(f"call_device({fn.name}): the edge map of {etensor.name} must be a "
                           f"string like 'ij->ij', got {text!r}")
        edge_map.parse(text, kind=kind, task_rank=task_rank, event_rank=etensor.ndim,
                       tensors=tensors, etensor=etensor.name)
        events.append(etensor.var)
        maps.append(text)
    return events, maps


def _bind_params(fn: DeviceFunc, types: list) -> None:
    """Check the tensors against ``fn``'s parameters, binding its symbolic dims consistently."""
    analyzer = tvm.sym.Analyzer()
    bound: dict = {}
    for ty, p in zip(types, fn.buffer_params):
        where = f"call_device({fn.name}): tensor parameter '{p.name}'"
        shape = list(ty.shape.values)
        if str(ty.dtype) != p.dtype:
            raise EtcError(f"{where} is {p.dtype}, got {ty.dtype}")
        if len(shape) != p.rank:
            raise EtcError(f"{where} has rank {p.rank}, got a tensor of shape {shape_str(shape)}")
        for k, (want, got) in enumerate(zip(p.shape, shape)):
            if isinstance(want, tvm.tirx.Var):
                if want not in bound:
                    bound[want] = got
                    continue
                want = bound[want]
            if not analyzer.can_prove_equal(tvm.tirx.Cast("int64", want), got):
                raise EtcError(f"{where}: dim {k} is {dim_str(got)}, expected {dim_str(want)}")
