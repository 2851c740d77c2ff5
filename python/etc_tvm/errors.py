"""The errors etc_tvm raises for bad programs, one class per stage that can find them.

Each is registered with the TVM FFI, so one raised inside a pass keeps its class through
``tvm.transform`` calls instead of becoming a RuntimeError.
"""
import tvm_ffi


@tvm_ffi.register_error
class EtcError(ValueError):
    """Base of every error that reports a mistake in an etc_tvm program."""


@tvm_ffi.register_error
class EdgeMapError(EtcError):
    """A malformed edge map: the message quotes the map and points at the offending position."""


@tvm_ffi.register_error
class GraphError(EtcError):
    """A graph function or task graph that cannot run correctly: cycles, bad wait counts, ..."""


@tvm_ffi.register_error
class ExecutionError(EtcError):
    """A run that went wrong: an out-of-range data-dependent index, an over-notified event."""


@tvm_ffi.register_error
class DeadlockError(ExecutionError):
    """No task can make progress; the message lists the blocked tasks and their events."""


@tvm_ffi.register_error
class CompileError(EtcError):
    """Generated CUDA that the CUDA compiler refused: the kernels, the arch, its errors."""
