"""Finding graph functions in a module and fixing their sizes: what every etc pass starts with."""
from __future__ import annotations

from typing import Mapping

import tvm
from tvm import relax

from .. import ops
from ..errors import GraphError
from ..graph_func import GraphFunc
from ..task_graph import TaskGraph


def graph_functions(mod: tvm.IRModule) -> list[str]:
    """Names of the Relax functions that call device functions."""
    return [gv.name_hint for gv, func in mod.functions_items()
            if isinstance(func, relax.Function) and _calls_devices(func)]


def _calls_devices(func: relax.Function) -> bool:
    found = []
    relax.analysis.post_order_visit(func, lambda e: found.append(ops.is_op(e, ops.CALL_DEVICE)))
    return any(found)


def instantiate(mod: tvm.IRModule, name: str, dims: Mapping[str, int]):
    """(module with ``name``'s symbolic dims bound to ``dims``, its validated TaskGraph)."""
    func = mod[name]
    symbols = {v.name: v for v in relax.analysis.defined_symbolic_vars(func)}
    missing = sorted(set(symbols) - set(dims))
    if missing:
        raise GraphError(f"{name}: this strategy needs concrete sizes; give dims for {missing}")
    func = func.bind_symbolic_vars({symbols[k]: v for k, v in dims.items() if k in symbols})
    mod = tvm.IRModule({**dict(mod.functions_items()), mod.get_global_var(name): func},
                       attrs=mod.attrs)
    graph = TaskGraph.build(GraphFunc.from_module(mod, name), {})
    graph.validate()
    return mod, graph


def without(mod: tvm.IRModule, *names: str) -> tvm.IRModule:
    return tvm.IRModule({g: f for g, f in mod.functions_items() if g.name_hint not in names},
                        attrs=mod.attrs)


def without_device_funcs(mod: tvm.IRModule) -> tvm.IRModule:
    """The module less the device functions (inlined or turned into grid kernels by now)."""
    return without(mod, *(gv.name_hint for gv, f in mod.functions_items()
                          if isinstance(f, tvm.tirx.PrimFunc) and f.attrs
                          and "etc.device_func" in f.attrs))
