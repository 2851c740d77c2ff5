"""Finding graph functions in a module, fixing their sizes, and replacing them by a kernel:
what the etc passes share."""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import tvm
from tvm import relax

from .. import ops
from ..errors import EtcError, GraphError
from ..graph_func import GraphFunc
from ..schedule import list_schedule
from ..task_graph import TaskGraph
from ..tir_sched.inline import substitute
from ..tir_sched.persistent import (DEFAULT_OPTIONS, WORKSPACE, WORKSPACE_ATTR, KernelOptions,
                                    kernel_options, kernel_table, positive_count,
                                    returned_tensors)


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
    graph = single_rank(TaskGraph.build(GraphFunc.from_module(mod, name), {}))
    graph.validate()
    return mod, graph


def single_rank(graph: TaskGraph) -> TaskGraph:
    """``graph``, if one GPU runs it: a graph of several ranks compiles to one kernel per rank,
    each in the process of its GPU (``etc_tvm.distributed.build_rank``)."""
    if graph.world_size != 1:
        raise GraphError(f"{graph.name}: world size {graph.world_size} runs one kernel per rank, "
                         "each in its GPU's process: build it with "
                         "etc_tvm.distributed.build_rank (or run it on the CPU with "
                         "execute_ranks)")
    return graph


def sample_function(name: str, k: int) -> str:
    """The function of graph function ``name`` that serves the ``k``-th sample."""
    return f"{name}__sample{k}"


class PersistentScheduleTransform:
    """What the persistent-kernel transforms share: every graph function lowered for ``dims``
    in place, or, given ``samples``, once per sample into ``sample_function(name, k)`` (a
    kernel on the function's symbolic shapes that serves sizes up to the sample's). A
    subclass says how one task graph is lowered (``lower``) and what its kernels are called
    (``kernel_name``).

    dims: values of the symbolic dims. num_sms: SMs of the target (132 on an H200);
    ``options.ctas_per_sm`` persistent CTAs each. scheduler: (task graph, number of queues) ->
    StaticSchedule, for the kernels with static queues. samples: instead of ``dims``, sizes to
    compute kernels for; each gives a function ``sample_function(name, k)`` with the graph
    function's symbolic parameters, whose kernel serves any sizes up to the sample's by
    skipping the tasks outside the launch's grids.
    """

    kernel_name = "megakernel"

    def __init__(self, dims: Mapping[str, int] | None = None, num_sms: int = 132,
                 options: KernelOptions = DEFAULT_OPTIONS, scheduler=list_schedule,
                 samples: Sequence[Mapping[str, int]] | None = None):
        if dims and samples:
            raise EtcError(f"{type(self).__name__}: dims {dict(dims)} and samples: give "
                           "dims for one size, or samples for every size up to theirs, not "
                           "both")
        self.dims = dict(dims or {})
        self.num_sms = positive_count(f"{type(self).__name__}: num_sms", num_sms)
        self.options = kernel_options(options, type(self).__name__)
        if not callable(scheduler):
            raise EtcError(f"{type(self).__name__}: scheduler={scheduler!r} is not callable (a "
                           "function of the task graph and the number of queues, as "
                           "schedule.list_schedule)")
        self.scheduler = scheduler
        self.samples = [dict(s) for s in samples] if samples else None

    @property
    def num_ctas(self) -> int:
        """The kernel's persistent CTAs."""
        return self.num_sms * self.options.ctas_per_sm

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        for name in graph_functions(mod):
            if self.samples is None:
                mod, graph = instantiate(mod, name, self.dims)
                mod = self.lower(mod, name, graph, f"{name}_{self.kernel_name}")
                continue
            for k, sample in enumerate(self.samples):
                graph = single_rank(TaskGraph.build(GraphFunc.from_module(mod, name), sample))
                graph.validate()
                mod = self.lower(mod, name, graph, f"{name}_{self.kernel_name}_{k}",
                                 variant=sample_function(name, k))
            mod = without(mod, name)
        return without_device_funcs(mod)

    def lower(self, mod, name, graph, kernel_name, variant=None) -> tvm.IRModule:
        raise NotImplementedError


def without(mod: tvm.IRModule, *names: str) -> tvm.IRModule:
    return tvm.IRModule({g: f for g, f in mod.functions_items() if g.name_hint not in names},
                        attrs=mod.attrs)


def without_device_funcs(mod: tvm.IRModule) -> tvm.IRModule:
    """The module less the device functions (inlined or turned into grid kernels by now)."""
    return without(mod, *(gv.name_hint for gv, f in mod.functions_items()
                          if isinstance(f, tvm.tirx.PrimFunc) and f.attrs
                          and "etc.device_func" in f.attrs))


def replace_with_persistent_kernel(mod: tvm.IRModule, name: str, graph: TaskGraph,
                                   kernel: tvm.tirx.PrimFunc, constants: Sequence[np.ndarray],
                                   variant: str | None = None) -> tvm.IRModule:
    """Make ``name`` one ``call_tir`` of ``kernel``.

    The kernel takes the function's parameters and ``constants`` (read-only int32 tables);
    its remaining parameters are what the call returns: its state (fresh every launch: the
    watchdog record ``status``, when profiled the task ``timeline``, and the ``Workspace``
    that holds the counters and the internal tensors) and then the ``returned_tensors``. The
    function returns its outputs, then the watchdog record, then the timeline if there is
    one. A plain binding block: the s_tir-only dataflow passes
    (FuseOps, RewriteDataflowReshape) must not look into TIRx kernels.

    With ``variant``, ``name`` stays and a function of that name is added, keeping the
    symbolic shapes of ``name``'s parameters and outputs (a kernel built for the largest sizes
    it serves, ``graph``'s).
    """
    func = mod[name]
    bb = relax.BlockBuilder(mod if variant else without(mod, name))
    gv = bb.add_func(kernel, kernel.attrs["global_symbol"])
    fresh = {}
    if variant:  # a function of its own defines its own symbolic dims
        fresh = {v: tvm.tirx.Var(v.name, v.ty)
                 for v in relax.analysis.defined_symbolic_vars(func)}
        func = func.bind_symbolic_vars(fresh)

    def out_type(buf) -> relax.TensorType:
        shape = [kernel.attrs[WORKSPACE_ATTR]] if buf.name == WORKSPACE else buf.shape
        return relax.TensorType([int(d) if isinstance(d, tvm.tirx.IntImm) else substitute(d, fresh)
                                 for d in shape], str(buf.dtype))

    params = [relax.Var(p.name, p.ty) for p in func.params] if variant else list(func.params)
    outs = kernel.params[len(params) + len(constants):]
    names = [b.name for b in outs]
    produced = returned_tensors(graph)
    state = len(outs) - len(produced)  # the kernel's state comes before the calls' outputs
    with bb.function(variant or name, params, attrs=dict(func.attrs) if func.attrs else None):
        args = [*params, *(relax.const(kernel_table(c)) for c in constants)]
        result = bb.emit(relax.call_tir(gv, args, [out_type(b) for b in outs]), "result")
        value = {t.index: params[t.param] for t in graph.tensors if t.param is not None}
        for k, t in enumerate(produced):
            value[t.index] = bb.emit(relax.TupleGetItem(result, state + k), t.name)
        records = [bb.emit(relax.TupleGetItem(result, names.index(r)), r)
                   for r in ("status", "timeline") if r in names[:state]]
        bb.emit_func_output(relax.Tuple([*(value[t] for t in graph.outputs), *records]))
    return bb.finalize()
