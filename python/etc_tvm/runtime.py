"""Running compiled graph functions: the watchdog check, and loading exported libraries.

A compiled graph function returns its outputs and then the watchdog ``status`` record of its
persistent kernel (and, built to profile, its task timeline). ``CompiledGraph`` hides the
record and turns a stopped kernel into an ``ExecutionError`` naming the task, the event
element, its counter and the SM.

``load(path)`` runs an exported library in a TVM runtime without the compiler library
(``TVM_USE_RUNTIME_LIB=1``), as a deployment does: in that mode TVM 0.27 does not load its CUDA
backend by itself, so it is opened first.
"""
from __future__ import annotations

import bisect
import contextlib
import ctypes
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from .errors import EtcError, ExecutionError


@dataclass(frozen=True)
class GraphMeta:
    """What the host needs to report on a run (names of tasks and event elements) and to
    refuse a GPU the kernels cannot run on."""

    name: str
    task_names: list
    etensors: list  # [name, offset, shape] of every counter range
    timeout_s: float
    has_status: bool = True  # the function returns the watchdog record after its outputs
    edges: list = ()  # the edge maps, numbered as the kernel reports them
    checks: list = ()  # the device functions' input check messages, numbered likewise
    profiled: bool = False  # the task timeline follows the watchdog record
    ctas: int = 0  # persistent CTAs, launched cooperatively (all resident at once); 0: none
    ctas_per_sm: int = 1
    arch: str = ""  # the CUDA arch the kernels were compiled for ("sm_90a"); "": not known

    def check_device(self, device) -> None:
        """Raise where ``device`` (a ``tvm.runtime.Device``) cannot run these kernels: a
        compute capability their machine code does not load on, or fewer SMs than the
        persistent CTAs were placed on (its cooperative launch would be refused)."""
        name = f"{device.device_name} (GPU {device.index})"
        have = device.compute_version.replace(".", "")
        arch = re.fullmatch(r"sm_(\d+)(a?)", self.arch)
        if arch and (int(have) < int(arch[1]) or (arch[2] and have != arch[1])):
            runs_on = f"sm_{arch[1]} only" if arch[2] else f"sm_{arch[1]} and later minors"
            raise EtcError(f"{self.name} was compiled for {self.arch}, whose machine code runs "
                           f"on {runs_on}; {name} is sm_{have}: build it for this GPU's "
                           "arch")
        sms = -(-self.ctas // self.ctas_per_sm)
        if sms > device.multi_processor_count:
            raise EtcError(
                f"{self.name}: its persistent kernel was built for {sms} SMs ({self.ctas} "
                f"CTAs, {self.ctas_per_sm} an SM, all resident at once); {name} has "
                f"{device.multi_processor_count}: build it on this GPU (num_sms=None) or "
                f"with num_sms={device.multi_processor_count}")

    def element_name(self, flat: int) -> str:
        for name, offset, shape in self.etensors:
            size = int(np.prod(shape, dtype=np.int64))
            if offset <= flat < offset + size:
                if not shape:
                    return name
                idx = np.unravel_index(flat - offset, shape)
                return f"{name}[{','.join(str(int(i)) for i in idx)}]"
        return f"counter {flat}"

    def check(self, status: np.ndarray) -> None:
        """Raise for a stopped kernel (the record's layout is in src/etc_runtime.cuh)."""
        kind = int(status[0])
        if kind == 0:
            return
        task, where, seen, sm = (int(v) for v in status[1:5])
        if kind == 1:
            why = (f"task {self.task_names[task]} on SM {sm} waited on "
                   f"{self.element_name(where)} (counter {seen}) for more than "
                   f"{self.timeout_s} s")
        elif kind == 2:
            why = (f"a CTA on SM {sm} waited for slot {where} of the ready ring for more than "
                   f"{self.timeout_s} s: a task was never pushed")
        elif kind == 3:
            why = (f"the ready ring overflowed: a push from task {self.task_names[task]} "
                   f"(with any tasks claimed beside it) needed slot {where}, past the ring's "
                   f"{seen} slots")
        elif kind == 4:
            who = f"task {self.task_names[task]}" if task >= 0 else "arming"
            why = (f"{who} on SM {sm}: the edge map {self.edges[seen]} gave the index {where}, "
                   "outside its event tensor or grid")
        elif kind == 5:
            why = (f"the run-time wait count of {self.element_name(where)} is {seen}, "
                   "negative (or never written)")
        elif kind == 7:
            nxt = self.task_names[task] if task >= 0 else "none"
            why = (f"a CTA on SM {sm} found no task ready, in its queue or the ready ring, for "
                   f"more than {self.timeout_s} s (its next queued task: {nxt})")
        elif kind == 8:
            why = (f"task {self.task_names[task]} on SM {sm}: "
                   f"{self.checks[seen].replace('{value}', str(where))}")
        elif kind == 6:
            why = (f"trigger maps released task {self.task_names[task]} twice (their ranges "
                   "overlap)")
        else:
            why = f"unknown stop record {status.tolist()}"
        raise ExecutionError(f"{self.name}: {why}; the kernel stopped")


@dataclass(frozen=True)
class SampledMeta:
    """A graph compiled once for sampled sizes: the function (and its report metadata) that
    serves each sample, smallest first, and where each symbolic dim is read from the inputs.
    Sizes between samples run on the next larger one; above the largest is an error."""

    name: str
    dims: dict  # dim name -> [input index, axis]
    samples: list  # [sample dims, function name, GraphMeta], ascending

    def __post_init__(self):
        metas = [m if isinstance(m, GraphMeta) else GraphMeta(**m) for _, _, m in self.samples]
        object.__setattr__(self, "samples", [[dict(d), f, m] for (d, f, _), m in
                                             zip(self.samples, metas)])
        # one dim (the usual batch size): a binary search over the samples' values
        one = len(self.dims) == 1 and all(len(d) == 1 for d, _, _ in self.samples)
        object.__setattr__(self, "_bounds", [next(iter(d.values())) for d, _, _ in
                                             self.samples] if one else None)

    def check_device(self, device) -> None:
        for _, _, meta in self.samples:
            meta.check_device(device)

    def select(self, inputs) -> tuple[str, GraphMeta]:
        """The function and metadata of the smallest sample holding the inputs' sizes."""
        if self._bounds is not None:
            ((k, axis),) = self.dims.values()
            at = bisect.bisect_left(self._bounds, inputs[k].shape[axis])
            if at < len(self._bounds):
                return self.samples[at][1], self.samples[at][2]
        else:
            sizes = {d: inputs[k].shape[axis] for d, (k, axis) in self.dims.items()}
            for sample, function, meta in self.samples:
                if all(sizes[d] <= n for d, n in sample.items()):
                    return function, meta
        sizes = {d: int(inputs[k].shape[axis]) for d, (k, axis) in self.dims.items()}
        raise ExecutionError(f"{self.name}: sizes {sizes} exceed the largest sample the graph "
                             f"was compiled for, {self.samples[-1][0]}: compile with larger "
                             "samples")


class CompiledGraph:
    """A graph function compiled to a Relax VM executable, ready to run on ``device``."""

    def __init__(self, executable, meta: GraphMeta | SampledMeta, device=None):
        import tvm
        from tvm.runtime.vm import VirtualMachine

        self.executable = executable
        self.meta = meta
        self.device = device if device is not None else tvm.cuda(0)
        meta.check_device(self.device)
        self.vm = VirtualMachine(executable, self.device)
        if isinstance(meta, SampledMeta):
            self._fns = {f: self.vm[f] for _, f, _ in meta.samples}
        else:
            self._fn = self.vm[meta.name]

    def run(self, *inputs):
        """Run on tvm tensors (or NumPy arrays); returns tvm tensors without checking."""
        return self._run(inputs)[0]

    def _run(self, inputs):
        import tvm

        args = [x if not isinstance(x, np.ndarray) else tvm.runtime.tensor(x, self.device)
                for x in inputs]
        if isinstance(self.meta, SampledMeta):
            function, meta = self.meta.select(args)
            return self._fns[function](*args), meta
        return self._fn(*args), self.meta

    def __call__(self, *inputs):
        """Run, check the watchdog record, return the outputs as NumPy arrays."""
        return self._checked(inputs)[0]

    def profile(self, *inputs):
        """Run a graph built with ``KernelOptions(profile=True)``: (its outputs as ``__call__``
        returns them, the ``profile.Timeline`` of its tasks)."""
        from .profile import Timeline

        outs, meta, timeline = self._checked(inputs)
        if timeline is None:
            raise ExecutionError(f"{meta.name} was not built to profile: build it with "
                                 "options=KernelOptions(profile=True)")
        return outs, Timeline(meta, timeline)

    def _checked(self, inputs):
        return self._read(*self._run(inputs))

    @staticmethod
    def _read(result, meta):
        """(outputs as ``__call__`` returns them, meta, timeline or None) of a run's result,
        its watchdog record checked."""
        n = len(result) - meta.has_status - meta.profiled
        if meta.has_status:
            meta.check(result[n].numpy())
        timeline = result[len(result) - 1].numpy() if meta.profiled else None
        outs = [result[k].numpy() for k in range(n)]
        return (outs[0] if len(outs) == 1 else tuple(outs)), meta, timeline

    def capture(self, *inputs):
        """Capture one run on ``inputs`` (device tensors) into a CUDA graph.

        Returns ``(replay, outputs)``: each ``replay()`` re-runs the captured launches on the
        same buffers, refreshing ``outputs``; the replay holds them all (the inputs, the
        outputs, the VM's intermediates of the captured run), so that no later allocation
        takes their memory. ``replay.checked()`` reads ``outputs`` after a replay (and a
        synchronisation) as ``__call__`` returns them, the watchdog record checked. This is
        how the unfused baseline is replayed without launch overhead (see ``cuda_graph``).
        """
        import torch

        held = []

        def work():
            # Held, a call's intermediates are not lent again within the call either, so the
            # captured call needs more memory than a plain one: the warm-up runs hold theirs
            # too, and hand them back to the pool for the capture, which may not allocate.
            with holding_allocations(self.vm) as allocated:
                ran = self._run(inputs)  # (outputs, the meta of the function that ran)
            if torch.cuda.is_current_stream_capturing():
                held.extend(allocated)
            return ran

        replay, (outputs, meta) = cuda_graph(work)
        replay.compiled, replay.held = self, held  # the kernels, the intermediates
        replay.checked = lambda: self._read(outputs, meta)[0]
        return replay, outputs

    def cuda_source(self) -> str:
        """The generated CUDA C++ of every kernel (for inspection and compile-only checks)."""
        return self._sources("cuda", "cuda")

    def host_source(self) -> str:
        """The LLVM IR of the host functions: kernel launches, tensor-map encodes."""
        return self._sources("llvm", "ll")

    def _sources(self, kind: str, fmt: str) -> str:
        sources, todo = [], [self.executable.mod]
        while todo:
            module = todo.pop()
            if module.kind == kind:
                sources.append(module.inspect_source(fmt))
            todo.extend(module.imports)
        return "\n".join(sources)

    def export(self, path: str | os.PathLike) -> None:
        """Write the library ``path`` and its metadata ``path + '.json'``."""
        self.executable.export_library(str(path))
        Path(f"{path}.json").write_text(json.dumps(asdict(self.meta)))


def load(path: str | os.PathLike, device=None) -> CompiledGraph:
    """Load an exported graph; works with ``TVM_USE_RUNTIME_LIB=1`` (no compiler library).
    A GPU it was not built for is refused here (``GraphMeta.check_device``)."""
    import tvm

    if not Path(path).is_file():
        raise EtcError(f"load: no library at {path}")
    if not Path(f"{path}.json").is_file():
        raise EtcError(f"load: {path}.json is missing: the metadata that CompiledGraph.export "
                       "writes beside the library")
    lib_dir = Path(tvm.__file__).parent / "lib"
    for name in ("libtvm_runtime_cuda.so", "libtvm_runtime_extra.so"):
        if (lib_dir / name).exists():
            ctypes.CDLL(str(lib_dir / name), mode=ctypes.RTLD_GLOBAL)
    fields = json.loads(Path(f"{path}.json").read_text())
    meta = SampledMeta(**fields) if "samples" in fields else GraphMeta(**fields)
    return CompiledGraph(tvm.runtime.load_module(str(path)), meta, device)


@contextlib.contextmanager
def holding_allocations(vm) -> Iterator[list]:
    """Within the block, every storage and tensor that ``vm``'s calls allocate is kept in the
    list it yields.

    The VM hands a call's intermediates back to TVM's memory pool when the call ends, and the
    pool lends them to the next allocation: another VM's constants, say. A CUDA graph
    captured from the call keeps launching on them, so each replay would overwrite whatever
    holds them now. Held, they stay the graph's."""
    held = []

    def keep(_func, _symbol, before_run, result, *_args):
        if not before_run and result is not None:
            held.append(result)
        return 0  # VMInstrumentReturnKind.NO_OP: run on

    vm.set_instrument(keep)
    try:
        yield held
    finally:
        vm.set_instrument(None)


def cuda_graph(work: Callable[[], object]):
    """``work()`` captured into a CUDA graph: ``(replay, what work returned)``.

    ``work`` launches on the current PyTorch stream: PyTorch operations, and calls of
    compiled graphs (TVM launches on that stream during the capture). It runs three times on
    a side stream first, so that the allocators' pools hold its buffers before the capture.
    Needs PyTorch's CUDA graph support.
    """
    import torch
    import tvm_ffi

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), tvm_ffi.use_torch_stream():
        for _ in range(3):
            work()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), tvm_ffi.use_torch_stream():
        result = work()

    def replay() -> None:
        graph.replay()

    # the buffers the graph reads (held by work) and writes live as long as the replay
    replay.work, replay.result = work, result
    return replay, result
