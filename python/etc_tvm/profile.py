"""Task timelines of a profiled megakernel run: where each task ran, when, and how long it
waited before its body could start.

Build with ``options=KernelOptions(profile=True)`` and run with ``CompiledGraph.profile``::

    outputs, timeline = compiled.profile(*inputs)
    print(timeline.summary())              # per call: tasks, wait and body time; hand-offs
    timeline.write_chrome_trace("run.json")  # a track per CTA, for Perfetto or chrome://tracing

The kernel stamps each task four times on thread 0 (start, waits done, body done, end; the
row layout is in src/etc_runtime.cuh). Start and end come from the global nanosecond timer,
which all SMs share, so tasks on different SMs line up; the split of a task into waiting, its
body and its notifies (with what they start: pushes onto a ring, arming at run time, a call's
completion) comes from its SM's cycle counter, which is finer but only comparable within one
SM. Each CTA also stamps its entry, the end of its prologue (the grid-wide barrier after the
state's initialisation) and its leaving: the kernel's time outside its tasks.
"""
from __future__ import annotations

import collections
import json
import os
from dataclasses import dataclass

import numpy as np

from .runtime import GraphMeta

WORDS = 7  # TIMELINE_WORDS; ETC_TIMELINE_WORDS in src/etc_runtime.cuh
# PLACE: CTA << 32 | SM; BODY_CLK: the body done, before the notifies
START_NS, END_NS, START_CLK, WAITED_CLK, END_CLK, PLACE, BODY_CLK = range(WORDS)
ENTERED_NS, READY_NS, LEFT_NS = range(3)  # a CTA's row, after the task rows; PLACE as a task's
FULL_SHARE = 0.9  # of the most bodies a call ran at once: the bar of its "full to" time


@dataclass(frozen=True)
class TaskSpan:
    """One task that ran: times in microseconds from the first task's start."""

    task: int
    name: str
    sm: int
    cta: int  # the persistent CTA (blockIdx.x) that ran it; several may share an SM
    start_us: float
    end_us: float
    wait_us: float  # of (end - start), the share before the body could start
    notify_us: float = 0.0  # of it, the share after the body: notifies, pushes, arming

    @property
    def call(self) -> str:
        return self.name.split("(", 1)[0]

    @property
    def body_us(self) -> float:
        """From the waits' end to the task's end: the body and its notifies."""
        return self.end_us - self.start_us - self.wait_us


@dataclass(frozen=True)
class CtaSpan:
    """One persistent CTA: times in microseconds from the first task's start (its prologue's
    are negative)."""

    cta: int
    sm: int
    entered_us: float
    ready_us: float  # past the prologue
    left_us: float


class Timeline:
    """The tasks of one profiled run, from the kernel's timeline rows."""

    def __init__(self, meta: GraphMeta, rows: np.ndarray):
        table = np.asarray(rows, np.int64).reshape(-1, WORDS)
        rows = table[:len(meta.task_names)]
        ran = np.flatnonzero(rows[:, START_NS] != 0)  # skipped tasks keep zeros
        self.meta = meta
        self.spans: list[TaskSpan] = []
        self.ctas: list[CtaSpan] = []
        if ran.size == 0:
            return
        origin = rows[ran, START_NS].min()
        spans = []
        for t in ran.tolist():
            r = rows[t]
            start, end = (r[START_NS] - origin) / 1e3, (r[END_NS] - origin) / 1e3
            cycles = r[END_CLK] - r[START_CLK]
            waited = (r[WAITED_CLK] - r[START_CLK]) / cycles if cycles > 0 else 0.0
            notified = (r[END_CLK] - r[BODY_CLK]) / cycles if cycles > 0 and r[BODY_CLK] else 0.0
            spans.append(TaskSpan(t, meta.task_names[t], int(r[PLACE] & 0xFFFFFFFF),
                                  int(r[PLACE] >> 32), start, end, (end - start) * waited,
                                  (end - start) * notified))
        self.spans = sorted(spans, key=lambda s: (s.start_us, s.task))
        ctas = table[max(1, len(meta.task_names)):]
        self.ctas = [CtaSpan(int(r[PLACE] >> 32), int(r[PLACE] & 0xFFFFFFFF),
                             *((r[k] - origin) / 1e3 for k in (ENTERED_NS, READY_NS, LEFT_NS)))
                     for r in ctas if r[ENTERED_NS] != 0]

    @property
    def makespan_us(self) -> float:
        """From the first task's start to the last task's end."""
        return max((s.end_us for s in self.spans), default=0.0)

    @property
    def kernel_us(self) -> float:
        """From the first CTA's entry to the last CTA's leaving (0 without CTA rows)."""
        if not self.ctas:
            return 0.0
        return max(c.left_us for c in self.ctas) - min(c.entered_us for c in self.ctas)

    def handoffs_us(self) -> np.ndarray:
        """Gaps on each CTA between one task's end and the next task's start: what taking
        the next task (a queue read, a pop) costs, plus any idle time."""
        return np.asarray(list(self._handoffs_before().values()))

    def _handoffs_before(self) -> dict[int, float]:
        """Task -> the hand-off before it on its CTA (a CTA's first task has none)."""
        before, last = {}, {}
        for s in self.spans:  # in start order
            if s.cta in last:
                before[s.task] = s.start_us - last[s.cta].end_us
            last[s.cta] = s
        return before

    def bodies_running(self, call: str | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(times, running): how many task bodies (of ``call``'s tasks, or of every task) run
        from each time in us until the next; none after the last."""
        edges = sorted((t, step) for s in self.spans if call in (None, s.call)
                       for t, step in ((s.start_us + s.wait_us, 1), (s.end_us, -1)))
        return (np.asarray([t for t, _ in edges], np.float64),
                np.cumsum([step for _, step in edges], dtype=np.int64))

    def full_until_us(self, call: str | None = None) -> float:
        """The end of the last stretch in which at least ``FULL_SHARE`` of the most bodies
        ``call`` (or the kernel) ever ran at once still ran: from there to its last end its
        last wave drains, the CTAs it held freeing up one by one."""
        times, running = self.bodies_running(call)
        if not times.size:
            return 0.0
        return float(times[np.flatnonzero(running >= FULL_SHARE * running.max())[-1] + 1])

    def tasks_per_sm(self, call: str | None = None) -> np.ndarray:
        """How many of ``call``'s tasks (or of every task) each SM the kernel ran on took, in
        SM order: tasks that share an SM share its memory bandwidth, so a call whose tasks
        pile up on some SMs while others hold none streams slower than its task count says."""
        sms = sorted({s.sm for s in self.spans} | {c.sm for c in self.ctas})
        taken = collections.Counter(s.sm for s in self.spans if call in (None, s.call))
        return np.asarray([taken[sm] for sm in sms], np.int64)

    def summary(self) -> str:
        """A table per call (tasks, median wait, body and the notifies' share of the body,
        median hand-off before its tasks, total busy time, the window from its first task's
        start to its last task's end, where its bodies stopped filling the CTAs they held:
        ``full_until_us``, and how its tasks spread over the SMs: the most an SM took and
        the SMs that took none, ``tasks_per_sm``), then the makespan, the SMs used and the
        median hand-off, and the kernel's time around its tasks."""
        calls: dict[str, list[TaskSpan]] = {}
        for s in self.spans:
            calls.setdefault(s.call, []).append(s)
        before = self._handoffs_before()
        lines = [f"{'call':>16} {'tasks':>6} {'wait us':>9} {'body us':>9} {'notify us':>10} "
                 f"{'taken us':>9} {'busy us':>9} {'from us':>9} {'to us':>9} {'full to us':>11} "
                 f"{'most an SM':>11} {'SMs none':>9}"]
        for name, spans in calls.items():
            taken = [before[s.task] for s in spans if s.task in before]
            per_sm = self.tasks_per_sm(name)
            lines.append(f"{name:>16} {len(spans):>6} "
                         f"{np.median([s.wait_us for s in spans]):>9.2f} "
                         f"{np.median([s.body_us for s in spans]):>9.2f} "
                         f"{np.median([s.notify_us for s in spans]):>10.2f} "
                         f"{np.median(taken) if taken else 0.0:>9.2f} "
                         f"{sum(s.end_us - s.start_us for s in spans):>9.1f} "
                         f"{min(s.start_us for s in spans):>9.1f} "
                         f"{max(s.end_us for s in spans):>9.1f} "
                         f"{self.full_until_us(name):>11.1f} "
                         f"{per_sm.max():>11} {np.count_nonzero(per_sm == 0):>9}")
        gaps = self.handoffs_us()
        lines.append(f"makespan {self.makespan_us:.1f} us on {len({s.sm for s in self.spans})} "
                     f"SMs ({len({s.cta for s in self.spans})} CTAs); median hand-off "
                     f"{np.median(gaps) if gaps.size else 0.0:.2f} us")
        if self.ctas:
            lines.append(
                f"kernel {self.kernel_us:.1f} us: CTAs entered from "
                f"{min(c.entered_us for c in self.ctas):.1f} us, all past the prologue at "
                f"{max(c.ready_us for c in self.ctas):.1f}, the last left at "
                f"{max(c.left_us for c in self.ctas):.1f}")
        return "\n".join(lines)

    def chrome_trace(self) -> dict:
        """The run in the Trace Event Format: one process per SM and one thread per CTA on
        it, each task a complete event split into its wait, its body and its notifies; each
        CTA's prologue and, from its last task's end, its leaving."""
        events = []
        for s in self.spans:
            common = {"pid": s.sm, "tid": s.cta, "args": {"task": s.task}}
            events.append({"name": s.name, "ph": "X", "ts": s.start_us,
                           "dur": s.end_us - s.start_us, **common})
            if s.wait_us > 0:
                events.append({"name": "wait", "ph": "X", "ts": s.start_us, "dur": s.wait_us,
                               **common})
            if s.notify_us > 0:
                events.append({"name": "notify", "ph": "X", "ts": s.end_us - s.notify_us,
                               "dur": s.notify_us, **common})
        last = {s.cta: s.end_us for s in self.spans}  # in start order: each CTA's last task
        for c in self.ctas:
            common = {"pid": c.sm, "tid": c.cta}
            events.append({"name": "prologue", "ph": "X", "ts": c.entered_us,
                           "dur": c.ready_us - c.entered_us, **common})
            done = last.get(c.cta, c.ready_us)
            events.append({"name": "leaving", "ph": "X", "ts": done, "dur": c.left_us - done,
                           **common})
        places = sorted({(s.sm, s.cta) for s in self.spans} | {(c.sm, c.cta) for c in self.ctas})
        events += [{"name": "process_name", "ph": "M", "pid": sm, "args": {"name": f"SM {sm}"}}
                   for sm in sorted({sm for sm, _ in places})]
        events += [{"name": "thread_name", "ph": "M", "pid": sm, "tid": cta,
                    "args": {"name": f"CTA {cta}"}} for sm, cta in places]
        return {"traceEvents": events, "displayTimeUnit": "ns",
                "otherData": {"graph": self.meta.name}}

    def write_chrome_trace(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)
