"""Run each megakernel of the GPU tests once, for compute-sanitizer:

    for tool in memcheck racecheck synccheck; do
        compute-sanitizer --tool $tool --error-exitcode 1 python3 apps/sanitize_megakernels.py
    done

Every graph of tests/python/megakernel_cases.py under the static strategy (list and
round-robin queues), the dynamic and the barrier strategies, checked against the CPU reference
executor.
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))

from etc_tvm import build  # noqa: E402
from etc_tvm.executor import execute  # noqa: E402
from etc_tvm.schedule import list_schedule, round_robin_schedule  # noqa: E402

from megakernel_cases import ATOL, CASES, RTOL  # noqa: E402


def main() -> None:
    rng = np.random.default_rng(0)
    for name, (graph, dims, make, _) in sorted(CASES.items()):
        inputs = make(rng)
        want = execute(graph, *inputs)
        for strategy, scheduler in (("static", list_schedule), ("static", round_robin_schedule),
                                    ("dynamic", list_schedule), ("barrier", list_schedule)):
            got = build(graph, dims, strategy=strategy, scheduler=scheduler)(*inputs)
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
            print(f"{name} {strategy} {scheduler.__name__}: ok", flush=True)


if __name__ == "__main__":
    main()
