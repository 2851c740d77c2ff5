"""etc_tvm: an Event Tensor Compiler for GPU megakernels, as a plugin on Apache TVM.

Write tiled operators (``@device_func``) and their tile-level dependencies (``ETensor`` and the
edge maps of ``call_device``) once in a ``@graph_func``; etc_tvm checks the task graph and runs
it (``execute``, the CPU reference executor).
"""
from . import edge_map
from .device_func import DeviceFunc, device_func
from .errors import DeadlockError, EdgeMapError, EtcError, ExecutionError, GraphError
from .etensor import ETensor
from .graph_func import GraphFunc, call_device, graph_func
from .tensor import Tensor

__all__ = [
    "DeadlockError", "DeviceFunc", "ETensor", "EdgeMapError", "EtcError", "ExecutionError",
    "GraphError", "GraphFunc", "Tensor", "call_device", "device_func", "edge_map", "graph_func",
]
