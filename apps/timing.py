"""How the benchmarks run a variant: checked once against a reference, then timed by
CUDA-event medians, the variants taking turns."""
import statistics

import numpy as np
import torch

from etc_tvm.errors import EtcError


def checked_run(label: str, compiled, on_device, want, rtol: float, replay: bool):
    """A function running ``compiled`` on the device tensors ``on_device`` (through the VM,
    or replayed from a CUDA graph). Its ``check()`` runs it once more and holds the outputs
    to the watchdog and to ``want`` (relative L2 error under ``rtol``): here, before it is
    timed, and in ``time_interleaved`` after, so that no time stands for runs that went
    wrong."""
    if replay:
        run, _ = compiled.capture(*on_device)

        def result():
            run()
            torch.cuda.synchronize()
            return run.checked()
    else:
        def run():
            compiled.run(*on_device)

        def result():
            return compiled(*on_device)

    def check():
        got = result()
        error = np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want)
        assert error < rtol, f"{label}: relative error {error:.2e}"

    check()
    run.check = check
    return run


def time_interleaved(runs: dict, reps: int = 200, warmup: int = 20) -> dict:
    """Median device time in us of one call of each of ``runs`` (label -> fn), from CUDA
    events.

    The variants take turns, one call each per round, so that a drift of the GPU's clocks or
    of its neighbours' load over the measurement falls on every variant alike. Runs that
    ``checked_run`` made are checked again at the end."""
    for fn in runs.values():
        for _ in range(warmup):
            fn()
    times = {label: [] for label in runs}
    for _ in range(reps):
        for label, fn in runs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[label].append(start.elapsed_time(end) * 1e3)
    for label, fn in runs.items():
        if hasattr(fn, "check"):
            try:
                fn.check()
            except (AssertionError, EtcError) as err:
                raise AssertionError(f"{label}, checked after its timing: {err}") from err
    return {label: statistics.median(t) for label, t in times.items()}
