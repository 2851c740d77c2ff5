"""The device runtime every generated kernel includes (``src/etc_runtime.cuh``: bounded waits,
notifies, the ready ring, the stop record the host reads), and the size of that record."""
from __future__ import annotations

from pathlib import Path

STATUS_WORDS = 8  # int32 words of the stop record (its layout: src/etc_runtime.cuh)
RUNTIME_SOURCE = Path(__file__).resolve().parents[3] / "src" / "etc_runtime.cuh"
NVSHMEM_RUNTIME_SOURCE = RUNTIME_SOURCE.with_name("etc_runtime_nvshmem.cuh")


def runtime_source(ranks: bool = False) -> str:
    """The device runtime; with ``ranks``, followed by its NVSHMEM part (kernels of world size
    above 1 only: TVM links a module against NVSHMEM when its source includes the header)."""
    paths = [RUNTIME_SOURCE, NVSHMEM_RUNTIME_SOURCE] if ranks else [RUNTIME_SOURCE]
    for path in paths:
        if not path.exists():
            raise FileNotFoundError(f"the etc_tvm device runtime {path} is missing: "
                                    "install etc_tvm from its source tree (pip install -e .)")
    return "\n".join(path.read_text() for path in paths)
