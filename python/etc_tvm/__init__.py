"""etc_tvm: an Event Tensor Compiler for GPU megakernels, as a plugin on Apache TVM.

Write tiled operators (``@device_func``) and their tile-level dependencies (``ETensor`` and the
edge maps of ``call_device``) once in a ``@graph_func``; etc_tvm checks the task graph, runs it
on the CPU reference executor (``executor.execute``) and compiles it into one persistent GPU
kernel (``build``), which ``load`` runs elsewhere.

In a TVM runtime without the compiler library (``TVM_USE_RUNTIME_LIB=1``, a deployment) only
``load`` and ``etc_tvm.runtime`` are available.
"""
import os

from . import build_env

BUILD_ENV = build_env.prepare()  # before anything imports tvm
RUNTIME_ONLY = os.environ.get("TVM_USE_RUNTIME_LIB", "0") not in ("", "0")

from .errors import (CompileError, DeadlockError, EdgeMapError, EtcError,  # noqa: E402
                     ExecutionError, GraphError)
from .runtime import load  # noqa: E402

__all__ = ["CompileError", "DeadlockError", "EdgeMapError", "EtcError", "ExecutionError",
           "GraphError", "load"]

if not RUNTIME_ONLY:
    from . import cuda_cache, edge_map
    from .build import build
    from .device_func import (RANK, WORLD_SIZE, DeviceFunc, await_inputs, device_func,
                              input_check)
    from .etensor import ETensor
    from .graph_func import GraphFunc, call_device, graph_func
    from .tensor import Tensor
    from .tir_sched.persistent import KernelOptions

    __all__ += ["RANK", "WORLD_SIZE", "DeviceFunc", "ETensor", "GraphFunc", "KernelOptions",
                "Tensor", "await_inputs", "build", "call_device", "device_func", "edge_map",
                "graph_func", "input_check"]
    cuda_cache.install()
