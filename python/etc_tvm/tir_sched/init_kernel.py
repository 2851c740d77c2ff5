"""The per-launch initialisation of a megakernel's state.

Event counters are mutated by the kernel, so each launch starts from fresh ones: this kernel
copies the read-only initial counts into a new ``counters`` tensor and clears the watchdog's
``status`` record. Both are outputs of the init call, never Relax constants.
"""
from tvm.script import tirx as T

from .static_kernel import STATUS_WORDS

THREADS = 256
n = T.int32()


@T.prim_func
def etc_init(initial: T.Buffer((n,), "int32"), counters: T.Buffer((n,), "int32"),
             status: T.Buffer((STATUS_WORDS,), "int32")):
    T.func_attr({"tirx.is_scheduled": True})
    T.device_entry()
    bx = T.cta_id([(n + THREADS - 1) // THREADS])
    tx = T.thread_id([THREADS])
    if bx * THREADS + tx < n:
        counters[bx * THREADS + tx] = initial[bx * THREADS + tx]
    if bx == 0 and tx < STATUS_WORDS:
        status[tx] = 0
