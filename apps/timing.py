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


def time_interleaved(runs: dict, reps: int = 200, warmup: int = 20,
                     queued: bool = False) -> dict:
    """Median device time in us of one call of each of ``runs`` (label -> fn), from CUDA
    events.

    The variants take turns, one call each per round, so that a drift of the GPU's clocks or
    of its neighbours' load over the measurement falls on every variant alike. Runs that
    ``checked_run`` made are checked again at the end. An idle GPU records the start event at
    once and then waits for the host to submit the call, so the time includes the host's
    latency to launch it (2 - 8 us for a CUDA graph on the H200); ``queued`` puts a sleep
    kernel before the start event, which the host outruns: the time is then the device's
    alone, the call's kernels and the gaps between them, as when the host runs ahead."""
    for fn in runs.values():
        for _ in range(warmup):
            fn()
    cover = _cycles_per_us() * QUEUED_COVER_US if queued else 0
    times = {label: [] for label in runs}
    for _ in range(reps):
        for label, fn in runs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if cover:
                torch.cuda._sleep(cover)
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


QUEUED_COVER_US = 300  # the sleep a queued call waits behind: longer than the host's launch


def _cycles_per_us() -> int:
    """The GPU's clock, from a timed sleep kernel (``torch.cuda._sleep`` counts cycles)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    return int(1_000_000 / (start.elapsed_time(end) * 1e3))


def kernel_times(fn, reps: int = 20) -> list[tuple[str, float]]:
    """What one call of ``fn`` runs on the GPU (its kernels, and any copies or sets), in
    launch order, with their mean device time in us (from the profiler's device records):
    what a call's time beyond its kernels' is spent on, and how long a megakernel runs
    against its tasks' makespan."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    names = list(dict.fromkeys(e.name for e in kernels))
    total = {n: sum(e.time_range.elapsed_us() for e in kernels if e.name == n) for n in names}
    return [(n, total[n] / reps) for n in names]
