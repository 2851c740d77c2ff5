"""Timing for the benchmarks: CUDA-event medians, the variants taking turns."""
import statistics

import torch


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
