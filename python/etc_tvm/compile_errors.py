"""Errors of the CUDA compiler on generated kernels, reported so that a person can act on them.

TVM's compile callback raises a ``RuntimeError`` that holds the whole generated source (tens of
thousands of lines for a megakernel) followed by everything nvcc printed, warnings first.
``ReportedCompile`` wraps the callback: where it fails, the source and the compiler's output are
kept in files, and a ``CompileError`` names the kernels, the target's arch, the compiler's
errors alone (its warnings left out), and, where an instruction needs a newer arch than the
target's (a tile on wgmma, TMA or bulk copies built for sm_80), the arch to build for.
"""
from __future__ import annotations

import re
import tempfile
from pathlib import Path

import tvm

from .errors import CompileError

SHOWN_ERRORS = 12
# where TVM's message turns to the compiler's output (nvcc: after the source; NVRTC: its log)
_OUTPUT = re.compile(r"\nCompilation error:\n|NVRTC compilation failed:\n")
_KERNEL = re.compile(r"__global__ void (?:__launch_bounds__\([^)]*\) )?(\w+)\(")
_ERROR = re.compile(r"\berror\b|\bfatal\b", re.IGNORECASE)
_NEWER_ARCH = re.compile(r"requires \.target sm_|not supported on \.target")  # ptxas's words
_PLACE = re.compile(r", line \d+;|\(\d+\):")  # where ptxas and nvcc put a line number
_SOURCE = re.compile(r"\S*tvm_kernels\.cu\b")  # nvcc's name of its temporary copy


class ReportedCompile:
    """TVM's CUDA compile callback ``compile``, its failures raised as ``CompileError``."""

    def __init__(self, compile):
        self.compile = compile

    def __call__(self, code: str):
        try:
            return self.compile(code)
        except RuntimeError as err:
            refused = _OUTPUT.search(str(err))
            if refused is None:  # not the compiler's verdict (no nvcc, no NVRTC, ...)
                raise
            raise report(code, str(err)[refused.end():]) from None


def report(code: str, output: str) -> CompileError:
    """The ``CompileError`` of ``code``, which the compiler refused with ``output``."""
    kept = Path(tempfile.mkdtemp(prefix="etc_tvm_compile_"))
    source, log = kept / "kernels.cu", kept / "compiler.log"
    source.write_text(code)
    log.write_text(output)
    errors: dict[str, list[str]] = {}  # an error without its place -> its lines
    for line in output.splitlines():
        if _ERROR.search(line) and "warning" not in line.lower():
            line = _SOURCE.sub(str(source), line.strip())
            errors.setdefault(_PLACE.sub("", line), []).append(line)
    shown = [places[0] + (f" (and {len(places) - 1} more places)" if len(places) > 1 else "")
             for places in errors.values()]
    if not shown:  # no line says which: the output's end
        shown = [line.strip() for line in output.strip().splitlines()[-SHOWN_ERRORS:]]
    target = tvm.target.Target.current(allow_none=True)
    arch = str(target.attrs.get("arch", "")) if target is not None else ""
    kernels = sorted(set(_KERNEL.findall(code)))
    lines = [f"the CUDA compiler refused the generated kernels "
             f"({', '.join(kernels) or 'none named'}) for {arch or 'the default arch'}:",
             *(f"  {line}" for line in shown[:SHOWN_ERRORS])]
    if len(shown) > SHOWN_ERRORS:
        lines.append(f"  ... and {len(shown) - SHOWN_ERRORS} more")
    if _NEWER_ARCH.search(output):
        lines.append(f"Instructions of these kernels need a newer arch than "
                     f"{arch or 'the default'} (wgmma, TMA and bulk copies need sm_90a): build "
                     "for one, e.g. target={'kind': 'cuda', 'arch': 'sm_90a'}.")
    lines.append(f"The source is kept in {source}, the compiler's whole output in {log}.")
    return CompileError("\n".join(lines))
