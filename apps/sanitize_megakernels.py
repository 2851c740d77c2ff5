"""Run each megakernel of the GPU tests once, for compute-sanitizer:

    for tool in memcheck racecheck synccheck; do
        compute-sanitizer --tool $tool --error-exitcode 1 python3 apps/sanitize_megakernels.py
    done

(``apps/sanitize_megakernels.py mixed dynamic``: only those strategies; ``--cases
prelude_weighted_rows``: only those graphs of megakernel_cases, and not the MoE graph.)
A report's offsets (``row_sum_megakernel_kernel+0x670``) map to the generated CUDA's lines
with ``apps/sass_lines.py fan_in_row_sum barrier 0x670``.

Every graph of tests/python/megakernel_cases.py built into each of its ``MEGAKERNELS`` (the
persistent kernels the GPU tests run: static on list and round-robin queues and claiming,
dynamic, mixed, barrier and barrier claiming), and the MoE graph of tests/python/moe_graph.py
(data-dependent edges, run-time counts, a trigger) under the strategies that run it, each
checked against the CPU reference executor.
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))

from etc_tvm import build  # noqa: E402
from etc_tvm.executor import execute  # noqa: E402

from megakernel_cases import ATOL, CASES, MEGAKERNELS, RTOL  # noqa: E402
from moe_graph import COUNT_MODES, make_inputs, moe_graph  # noqa: E402

MOE_KERNELS = ("static", "static_claimed", "dynamic", "mixed")  # those that run the MoE graph


def megakernel(case: str, kernel: str):
    """The compiled megakernel of graph ``case`` (a name of ``CASES``, or ``moe:<count
    mode>``) under ``kernel`` (a name of ``MEGAKERNELS``), built as ``main`` builds it."""
    how = MEGAKERNELS[kernel]
    if case.startswith("moe:"):
        return build(moe_graph(2, case.removeprefix("moe:")), {"T": 12}, **how)
    graph, dims = CASES[case][:2]
    return build(graph, dims, **how)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("strategies", nargs="*", default=None,
                        help="run only these strategies (default: all)")
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES),
                        help="run only these graphs of megakernel_cases (default: all, then "
                        "the MoE graph)")
    args = parser.parse_args()
    wanted = args.strategies or None
    rng = np.random.default_rng(0)
    for name, (graph, _, make, _) in sorted(CASES.items()):
        if args.cases and name not in args.cases:
            continue
        inputs = make(rng)
        want = execute(graph, *inputs)
        for kernel, how in MEGAKERNELS.items():
            if wanted and how["strategy"] not in wanted:
                continue
            got = megakernel(name, kernel)(*inputs)
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
            print(f"{name} {kernel}: ok", flush=True)
    for count_mode in () if args.cases else COUNT_MODES:
        graph, inputs = moe_graph(2, count_mode), make_inputs("random", 12, 2)
        want = execute(graph, *inputs)
        for kernel in MOE_KERNELS:
            if wanted and MEGAKERNELS[kernel]["strategy"] not in wanted:
                continue
            got = megakernel(f"moe:{count_mode}", kernel)(*inputs)
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
            print(f"moe ({count_mode} counts) {kernel}: ok", flush=True)


if __name__ == "__main__":
    main()
