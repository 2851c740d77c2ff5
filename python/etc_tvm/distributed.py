"""Running a graph function of several ranks: one process per GPU, NVSHMEM between them.

Each process (started by torchrun, mpirun or any launcher) sets its CUDA device, joins with
``Nvshmem.init`` (rank 0's ``Nvshmem.unique_id()`` handed to every rank over the launcher's
own channel), compiles its rank's kernel with ``build_rank`` and calls it::

    world = Nvshmem.init(rank, world_size, unique_id)
    program = build_rank(gemm_rs, {"M": 4096, "K": 1024, "N": 4096}, rank)
    D = program(world, A_r, B_r)

Built with ``options=KernelOptions(profile=True)``, ``program.timeline()`` gives the task
timeline of the rank's last launch (``etc_tvm.profile``).

The event counters and the symmetric tensors live on NVSHMEM's symmetric heap. Allocating
there is collective (every rank the same sizes, in the same order): a program allocates its
state at its first call, and every rank must call its program in the same order. From then on
the world holds the program: its module stays loaded while the process runs, as NVSHMEM needs.

TVM 0.27's PyPI runtime is built without NVSHMEM, so this module brings what it lacks: the
host calls (``src/etc_nvshmem_host.cu``, compiled on first use), the hook by which TVM's CUDA
runtime hands NVSHMEM each module it loads (``runtime.nvshmem.cumodule_init``), and the
``NVSHMEM_HOME`` that TVM's compiler links rank kernels against. docs/distributed.md says why.
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Mapping

import numpy as np

from .errors import EtcError, ExecutionError
from .graph_func import GraphFunc
from .profile import Timeline
from .tir_sched.device_runtime import RUNTIME_SOURCE, STATUS_WORDS
from .tir_sched.persistent import (DEFAULT_OPTIONS, KernelOptions, kernel_options, kernel_table,
                                   positive_count, timeline_size)

HOST_SOURCE = RUNTIME_SOURCE.with_name("etc_nvshmem_host.cu")
MODULE_HOOK = "runtime.nvshmem.cumodule_init"


def nvshmem_home() -> Path:
    """A directory TVM's ``find_nvshmem_paths`` accepts: ``$NVSHMEM_HOME``, or one made from the
    nvidia-nvshmem wheel (which names ``libnvshmem.so`` ``libnvshmem_host.so.3``)."""
    if "NVSHMEM_HOME" in os.environ:
        return Path(os.environ["NVSHMEM_HOME"])
    spec = importlib.util.find_spec("nvidia")
    roots = [Path(b) / "nvshmem" for b in (spec.submodule_search_locations if spec else [])]
    root = next((r for r in roots if (r / "include" / "nvshmem.h").exists()), None)
    if root is None:
        raise EtcError("NVSHMEM not found: set NVSHMEM_HOME, or pip install nvidia-nvshmem-cu13")
    lib = root / "lib"
    if (lib / "libnvshmem.a").exists() or (lib / "libnvshmem.so").exists():
        return root
    home = _cache_dir() / f"nvshmem_home_{_digest(str(root))}"
    if not (home / "lib" / "libnvshmem.so").exists():
        (home / "lib").mkdir(parents=True, exist_ok=True)
        for link, target in ((home / "include", root / "include"),
                             (home / "lib" / "libnvshmem_device.a", lib / "libnvshmem_device.a"),
                             (home / "lib" / "libnvshmem.so", lib / "libnvshmem_host.so.3")):
            if not link.exists():
                link.symlink_to(target)
    return home


@contextmanager
def nvshmem_compiler():
    """TVM's compiler links modules that include the NVSHMEM headers against ``nvshmem_home``."""
    before = os.environ.get("NVSHMEM_HOME")
    os.environ["NVSHMEM_HOME"] = str(nvshmem_home())
    try:
        yield
    finally:
        if before is None:
            del os.environ["NVSHMEM_HOME"]
        else:
            os.environ["NVSHMEM_HOME"] = before


def host_library_path() -> Path:
    """``src/etc_nvshmem_host.cu`` compiled (nvcc) against ``nvshmem_home``, once per source."""
    home = nvshmem_home().resolve()
    source = HOST_SOURCE.read_text()
    out = _cache_dir() / f"libetc_nvshmem_host_{_digest(source + str(home))}.so"
    if out.exists():
        return out
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise EtcError("nvcc is needed to build the NVSHMEM host library, and not on PATH")
    lib = (home / "lib" / "libnvshmem.so").resolve().parent
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        built = Path(tmp) / out.name
        cmd = [nvcc, "-shared", "-Xcompiler", "-fPIC", "-O2", f"-I{home / 'include'}",
               "-o", str(built), str(HOST_SOURCE), f"-L{lib}",
               f"-l:{(home / 'lib' / 'libnvshmem.so').resolve().name}",
               "-Xlinker", f"-rpath={lib}"]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise EtcError(f"building the NVSHMEM host library failed:\n{' '.join(cmd)}\n"
                           f"{result.stderr}")
        built.replace(out)
    return out


class Nvshmem:
    """This process's place among the ranks: NVSHMEM initialised, and the symmetric heap."""

    _lib: ctypes.CDLL | None = None
    _joined: "Nvshmem | None" = None

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        # NVSHMEM keeps a pointer into every module it initialised and updates them all when
        # it initialises the next: a module must not be unloaded while the process runs
        self.programs = []

    @classmethod
    def library(cls) -> ctypes.CDLL:
        if cls._lib is None:
            lib = ctypes.CDLL(str(host_library_path()))
            lib.etc_nvshmem_malloc.restype = ctypes.c_void_p
            lib.etc_nvshmem_malloc.argtypes = [ctypes.c_size_t]
            lib.etc_nvshmem_free.argtypes = [ctypes.c_void_p]
            lib.etc_nvshmem_module_init.argtypes = [ctypes.c_void_p]
            lib.etc_nvshmem_init.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p]
            cls._lib = lib
        return cls._lib

    @classmethod
    def unique_id(cls) -> bytes:
        """The id that rank 0 draws and every rank passes to ``init``."""
        lib = cls.library()
        out = ctypes.create_string_buffer(lib.etc_nvshmem_unique_id_size())
        _check(lib.etc_nvshmem_unique_id(out), "nvshmemx_get_uniqueid")
        return out.raw

    @classmethod
    def init(cls, rank: int, world_size: int, unique_id: bytes) -> "Nvshmem":
        """Join the ranks (collective; once per process, after the CUDA device is set)."""
        if cls._joined is not None:
            raise EtcError(f"this process already joined as rank {cls._joined.rank} of "
                           f"{cls._joined.world_size}")
        if not 0 <= rank < world_size:
            raise EtcError(f"rank {rank} is outside a world of {world_size}")
        import tvm_ffi

        lib = cls.library()
        _check(lib.etc_nvshmem_init(rank, world_size, unique_id), "nvshmemx_hostlib_init_attr")
        pe, n_pes = lib.etc_nvshmem_my_pe(), lib.etc_nvshmem_n_pes()
        if (pe, n_pes) != (rank, world_size):
            raise EtcError(f"NVSHMEM made this process PE {pe} of {n_pes}, not rank {rank} of "
                           f"{world_size}")

        def module_init(module) -> None:
            handle = module.value if isinstance(module, ctypes.c_void_p) else module
            _check(lib.etc_nvshmem_module_init(handle), "nvshmemx_cumodule_init")

        tvm_ffi.register_global_func(MODULE_HOOK, module_init, override=True)
        cls._joined = cls(rank, world_size)
        return cls._joined

    def empty(self, shape, dtype: str):
        """A TVM tensor on the symmetric heap (collective: every rank, same shape, same turn)."""
        import torch
        import tvm

        nbytes = max(1, int(np.prod(shape, dtype=np.int64)) * np.dtype(_numpy_dtype(dtype))
                     .itemsize)
        ptr = self.library().etc_nvshmem_malloc(nbytes)
        if not ptr:
            raise ExecutionError(f"nvshmem_malloc of {nbytes} bytes failed on rank {self.rank}: "
                                 "the symmetric heap is full (NVSHMEM_SYMMETRIC_SIZE)")
        view = _DeviceMemory(ptr, tuple(int(s) for s in shape), _numpy_dtype(dtype))
        tensor = torch.as_tensor(view, device=f"cuda:{torch.cuda.current_device()}")
        if dtype == "bfloat16":
            tensor = tensor.view(torch.bfloat16)
        return tvm.runtime.from_dlpack(tensor)

    def barrier(self) -> None:
        self.library().etc_nvshmem_barrier_all()


class _DeviceMemory:
    """Raw device memory as the CUDA array interface describes it (for a zero-copy tensor)."""

    def __init__(self, ptr: int, shape: tuple, dtype: np.dtype):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": np.dtype(dtype).str,
                                         "data": (ptr, False), "version": 3, "strides": None}


def _numpy_dtype(dtype: str) -> np.dtype:
    return np.dtype("int16" if dtype == "bfloat16" else dtype)


def _check(status: int, what: str) -> None:
    if status != 0:
        raise ExecutionError(f"{what} failed with status {status}")


def _cache_dir() -> Path:
    path = Path(os.environ.get("ETC_TVM_CACHE", Path.home() / ".cache" / "etc_tvm"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class RankProgram:
    """One rank's persistent kernel of a graph of several ranks, and its launch."""

    def __init__(self, graph, executable, name: str, rank: int, arrays, meta,
                 num_counters: int, num_ctas: int, work=()):
        """``arrays``: the kernel's read-only tables, after the inputs (static: queue CSR and
        initial counts; dynamic: initial counts and ``DynamicPlan.tables``); ``num_counters``:
        the event counters (on the symmetric heap); ``num_ctas``: the kernel's persistent CTAs;
        ``work``: the sizes of the kernel's int32 working state after ``status`` (a ready
        ring's)."""
        self.graph, self.executable, self.name, self.rank = graph, executable, name, rank
        self.arrays, self.meta, self.work = arrays, meta, tuple(work)
        self.num_counters, self.num_ctas = num_counters, num_ctas
        self.state = None  # device tensors, allocated at the first call (collective)

    def __call__(self, world: Nvshmem, *inputs):
        """Run on this rank's ``inputs`` (NumPy arrays); its outputs as NumPy arrays, after the
        watchdog check."""
        import tvm

        dev = tvm.cuda(_current_device())
        outputs = self.launch(world, *(tvm.runtime.tensor(np.ascontiguousarray(x), dev)
                                       for x in inputs))
        self.check()
        results = [out.numpy() for out in outputs]
        return results[0] if len(results) == 1 else tuple(results)

    def launch(self, world: Nvshmem, *inputs) -> list:
        """Launch on this rank's ``inputs`` (device tensors) and return its output tensors
        without waiting: a timing loop launches many times, then calls ``check`` once."""
        import tvm

        if world.rank != self.rank or world.world_size != self.graph.world_size:
            raise EtcError(f"{self.name} is rank {self.rank} of {self.graph.world_size}; this "
                           f"process is rank {world.rank} of {world.world_size}")
        if self.state is None:
            device = tvm.cuda(_current_device())
            self.meta.check_device(device)
            self.state = self._allocate(world, device)
            world.programs.append(self)
        params = [self.graph.tensors[t] for t in self._own(lambda t: t.param is not None)]
        if len(inputs) != len(params):
            raise EtcError(f"{self.name} takes {len(params)} inputs "
                           f"({', '.join(p.name for p in params)}), got {len(inputs)}")
        counters, status, outputs = self.state["counters"], self.state["status"], \
            self.state["outputs"]
        self.executable[self.name](*inputs, *self.state["arrays"], counters, status,
                                   *self.state["work"], *self.state["timeline"], *outputs)
        produced = self._own(lambda t: t.producer is not None)
        return [outputs[produced.index(t)] for t in self.graph.rank_outputs(self.rank)]

    def check(self) -> None:
        """Raise the watchdog's error if the last launch stopped (waits for it)."""
        self.meta.check(self.state["status"].numpy())

    def timeline(self) -> Timeline:
        """The task timeline of this rank's last launch (built with ``KernelOptions(profile=
        True)``): its own tasks, timed by its GPU's clock, after the watchdog check."""
        if not self.meta.profiled:
            raise EtcError(f"{self.name} was not built to profile: build_rank(..., "
                           "options=KernelOptions(profile=True))")
        if self.state is None:
            raise EtcError(f"{self.name} has not been launched")
        self.check()
        return Timeline(self.meta, self.state["timeline"][0].numpy())

    def _own(self, which) -> list[int]:
        return [t.index for t in self.graph.tensors if t.rank == self.rank and which(t)]

    def _allocate(self, world: Nvshmem, dev) -> dict:
        import tvm

        outputs = []
        for t in (self.graph.tensors[i] for i in self._own(lambda t: t.producer is not None)):
            outputs.append(world.empty(t.shape, t.dtype) if t.symmetric
                           else tvm.runtime.empty(t.shape, t.dtype, dev))
        counters = world.empty((self.num_counters,), "int32")
        timeline = [tvm.runtime.empty((timeline_size(self.graph, self.num_ctas),), "int64",
                                      dev)] \
            if self.meta.profiled else []
        return {"arrays": [tvm.runtime.tensor(a, dev) for a in self.arrays],
                "work": [tvm.runtime.empty((n,), "int32", dev) for n in self.work],
                "counters": counters, "outputs": outputs, "timeline": timeline,
                "status": tvm.runtime.empty((STATUS_WORDS,), "int32", dev)}


def _current_device() -> int:
    import torch

    return torch.cuda.current_device()


def build_rank(graph: GraphFunc, dims: Mapping[str, int], rank: int, *,
               strategy: str = "static", num_sms: int | None = None,
               options: KernelOptions = DEFAULT_OPTIONS, target=None) -> RankProgram:
    """Compile rank ``rank``'s persistent kernel of ``graph`` (a graph function of world size
    above 1) for ``dims``, on ``num_sms`` SMs (default: this GPU's, else 132, an H200's),
    ``options.ctas_per_sm`` CTAs each. ``strategy``: "static", every rank's tasks
    list-scheduled together onto a queue a CTA, each rank's kernel running its own; or
    "dynamic", each rank popping its own tasks from its own ready ring
    (``DynamicPlan.of(..., rank_local=True)``: a call that waits on other ranks enters the
    ring after the rank's earlier calls)."""
    import tvm

    from .build import (check_dims, default_num_sms, default_target, has_gpu,
                        task_graph_meta)
    from .schedule import DynamicPlan, list_schedule
    from .task_graph import TaskGraph
    from .tir_sched.dynamic_kernel import build_dynamic_kernel
    from .tir_sched.events import EventLayout
    from .tir_sched.static_kernel import build_static_kernel

    if strategy not in ("static", "dynamic"):
        raise EtcError(f"a kernel of several ranks runs the static or the dynamic schedule, "
                       f"not {strategy!r}")
    check_dims(graph, dims, "dims")
    task_graph = TaskGraph.build(graph, dims)
    if task_graph.world_size == 1:
        raise EtcError(f"{graph.name} runs on one rank: build it with etc_tvm.build")
    task_graph.validate()
    if num_sms is None:
        num_sms = default_num_sms(tvm.cuda(_current_device()) if has_gpu() else None)
    num_ctas = positive_count("build_rank: num_sms", num_sms) \
        * kernel_options(options, "build_rank").ctas_per_sm
    layout = EventLayout.of(task_graph)
    name = f"{graph.name}_rank{rank}" if strategy == "static" else \
        f"{graph.name}_{strategy}_rank{rank}"
    work = ()
    if strategy == "static":
        schedule = list_schedule(task_graph, num_ctas).for_rank(task_graph, rank)
        kernel = build_static_kernel(task_graph, schedule, layout, name, options, rank=rank)
        indptr, tasks = schedule.csr(task_graph)
        tasks = np.pad(tasks, (0, max(1, task_graph.num_tasks) - len(tasks)))  # its shape
        arrays = (indptr, tasks, layout.initial)
    else:
        own = {c.index for c in task_graph.calls if c.rank == rank}
        plan = DynamicPlan.of(task_graph, own, rank_local=True)
        kernel = build_dynamic_kernel(task_graph, plan, layout, name, num_ctas, options,
                                      rank=rank)
        arrays = (layout.initial, *plan.tables())
        work = tuple(plan.state_sizes().values())
    target = target or default_target()
    with target, nvshmem_compiler():
        executable = tvm.compile(tvm.IRModule({name: kernel}), target=target,
                                 tir_pipeline="tirx")
    return RankProgram(task_graph, executable, name, rank, [kernel_table(a) for a in arrays],
                       task_graph_meta(task_graph, layout, options, has_status=True,
                                       ctas=num_ctas, arch=str(target.attrs.get("arch", ""))),
                       len(layout.initial), num_ctas, work)
