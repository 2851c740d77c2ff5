"""How the benchmarks run a variant: checked once against a reference, then timed by
CUDA-event medians, the variants taking turns."""
import statistics

import numpy as np
import torch


def checked_run(label: str, compiled, inputs, on_device, want, rtol: float, replay: bool):
    """A function running ``compiled`` on the device tensors ``on_device`` (through the VM,
    or replayed from a CUDA graph), after one run on ``inputs`` that the watchdog and
    ``want`` (relative L2 error under ``rtol``) accept."""
    if replay:
        run, outputs = compiled.capture(*on_device)
        run()
        torch.cuda.synchronize()
        got = outputs[0].numpy()
        if compiled.meta.has_status:
            compiled.meta.check(outputs[len(outputs) - 1].numpy())
    else:
        got = compiled(*inputs)
        run = lambda: compiled.run(*on_device)  # noqa: E731
    error = np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want)
    assert error < rtol, f"{label}: relative error {error:.2e}"
    return run


def time_interleaved(runs: dict, reps: int = 200, warmup: int = 20) -> dict:
    """Median device time in us of one call of each of ``runs`` (label -> fn), from CUDA
    events.

    The variants take turns, one call each per round, so that a drift of the GPU's clocks or
    of its neighbours' load over the measurement falls on every variant alike."""
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
    return {label: statistics.median(t) for label, t in times.items()}
