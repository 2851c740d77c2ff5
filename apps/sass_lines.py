"""The lines of generated CUDA behind a sanitizer report's kernel offsets.

compute-sanitizer names a hazard or a fault by a kernel and an offset into its machine code
(``row_sum_megakernel_kernel+0x670``). This builds the megakernel again, compiles its CUDA
with TVM's nvcc and flags plus line information, and prints, for each offset, the SASS
instruction there and the line of the generated CUDA it comes from:

    python apps/sass_lines.py fan_in_row_sum barrier 0x670 0x720
    python apps/sass_lines.py moe:tensor static_claimed 0x1910 0x1a00

The graphs and kernels are apps/sanitize_megakernels.py's (``moe:<count mode>`` for the MoE
graph), built for this machine's GPU or, where it has none, for 132 SMs (an H100's or an
H200's). Needs nvcc and nvdisasm (the nvidia-cuda-nvdisasm wheel will do), not a GPU; a
build by another nvcc than the report's may place the instructions at other offsets.
"""
import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import tvm
from tvm.support import nvcc

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sanitize_megakernels import CASES, COUNT_MODES, MEGAKERNELS, megakernel  # noqa: E402


def nvdisasm() -> str:
    """nvdisasm: on PATH, or from the nvidia-cuda-nvdisasm wheel."""
    found = shutil.which("nvdisasm")
    wheel = Path(sys.prefix).glob("lib/python3*/site-packages/nvidia/cu*/bin/nvdisasm")
    found = found or next((str(p) for p in wheel), None)
    if found is None:
        raise SystemExit("sass_lines: no nvdisasm (pip install nvidia-cuda-nvdisasm)")
    return found


def line_table(source: str, arch: str = "sm_90a") -> list[tuple[str, int, str, int]]:
    """(function, offset, SASS instruction, line of ``source``) for every instruction of
    ``source`` compiled as TVM compiles it, with ``-lineinfo``; a function's offsets count
    from its entry, as compute-sanitizer's do. Callees that nvcc does not inline are
    functions of their own (``$<kernel>$<callee>``)."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        with tvm.target.Target({"kind": "cuda", "arch": arch}):
            nvcc.compile_cuda(source, "cubin", arch=arch, options=["-lineinfo"],
                              path_target=str(cubin), compiler="nvcc")
        listing = subprocess.run([nvdisasm(), "-g", "-c", str(cubin)], capture_output=True,
                                 text=True, check=True).stdout
    table, function, line = [], None, 0
    for text in listing.splitlines():
        if m := re.match(r"\s*(?!\.L)(\S+):$", text):  # a function, not a branch label
            function = m.group(1).removeprefix(".text.")
        elif m := re.search(r'//## File ".*", line (\d+)', text):
            line = int(m.group(1))
        elif m := re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", text):
            table.append((function, int(m.group(1), 16), m.group(2), line))
    return table


def at_offsets(source: str, kernel: str, offsets: list[int]) -> list[tuple[int, str, str]]:
    """(offset, instruction, source line) of ``kernel``'s instructions at ``offsets``; an
    offset that is no instruction of it gives ``?`` and an empty line."""
    lines = source.splitlines()
    found = {offset: (ins, lines[line - 1].strip() if line else "")
             for function, offset, ins, line in line_table(source) if function == kernel}
    return [(offset, *found.get(offset, ("?", ""))) for offset in offsets]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=[*sorted(CASES), *(f"moe:{m}" for m in COUNT_MODES)],
                        help="a graph of megakernel_cases.CASES, or the MoE graph")
    parser.add_argument("kernel", choices=sorted(MEGAKERNELS),
                        help="a kernel of megakernel_cases.MEGAKERNELS")
    parser.add_argument("offsets", nargs="+", type=lambda x: int(x, 16),
                        help="offsets into the kernel's code, hexadecimal (0x670)")
    args = parser.parse_args()
    compiled = megakernel(args.case, args.kernel)
    source = compiled.cuda_source()
    name = re.search(r"__global__ void (?:__launch_bounds__\([^)]*\) )?(\w+_megakernel_kernel)",
                     source).group(1)
    for offset, ins, line in at_offsets(source, name, args.offsets):
        print(f"{name}+0x{offset:x}  {ins:<40}  {line}")


if __name__ == "__main__":
    main()
