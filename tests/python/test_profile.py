"""Task timelines: the profiled kernel's extra output, its stamps, and reading them back."""
import json

import numpy as np
import pytest

from etc_tvm.build import build
from etc_tvm.profile import (BODY_CLK, END_CLK, END_NS, ENTERED_NS, LEFT_NS, PLACE, READY_NS,
                             START_CLK, START_NS, WAITED_CLK, WORDS, Timeline)
from etc_tvm.relax_passes import StaticScheduleTransform
from etc_tvm.runtime import GraphMeta
from etc_tvm.tir_sched.persistent import KernelOptions

import graphs
from cubin import build_cubin
from test_executor import chain

PROFILE = KernelOptions(profile=True)


def test_a_profiled_function_returns_the_timeline_after_the_watchdog_record():
    plain = StaticScheduleTransform({"M": 64}, num_sms=8)(graphs.two_ops.mod)
    profiled = StaticScheduleTransform({"M": 64}, num_sms=8, options=PROFILE)(graphs.two_ops.mod)
    fields = profiled["two_ops"].ret_ty.fields
    assert len(fields) == len(plain["two_ops"].ret_ty.fields) + 1
    timeline = fields[-1]
    assert timeline.dtype == "int64"
    # 2 calls of 16 tasks, then 8 CTAs
    assert [int(d) for d in timeline.shape.values] == [(32 + 8) * WORDS]


@pytest.mark.parametrize("strategy", ["static", "dynamic", "mixed", "barrier"])
def test_every_task_branch_stamps_start_waits_and_end(strategy):
    def kernel_of(options):
        source = build(chain, {"M": 32}, strategy=strategy, num_sms=4,
                       options=options).cuda_source()
        return source[source.index("extern \"C\" __global__"):]

    kernel = kernel_of(PROFILE)
    stamps = ("etc_trace_start(", "etc_trace_waited(", "etc_trace_body_done(", "etc_trace_end(")
    for stamp in stamps:
        assert kernel.count(stamp) == 1, stamp  # one call, one branch
    at = [kernel.index(stamp) for stamp in stamps]
    assert at == sorted(at)
    # the body done: past the body's CTA barrier, before the notifies
    done = at[2]
    assert kernel.rindex("tvm_builtin_cuda_cta_sync()", 0, done) > at[1]
    assert kernel.index("etc_notify", done) < at[3]
    # each CTA: its entry, the end of its prologue (after the grid-wide barrier), its leaving
    entered, ready = kernel.index("etc_trace_now()"), kernel.index("etc_trace_cta_ready(")
    assert entered < kernel.index("grid_sync()") < ready < kernel.index("etc_trace_start(")
    assert kernel.rindex("etc_trace_end(") < kernel.index("etc_trace_cta_left(")
    assert kernel.count("etc_trace_cta_left(") == 1
    assert "etc_trace" not in kernel_of(KernelOptions())


@pytest.mark.parametrize("strategy", ["static", "dynamic", "mixed"])
def test_profiled_kernels_compile_for_sm90a(strategy, tmp_path):
    build_cubin(build(chain, {"M": 32}, strategy=strategy, num_sms=4,
                      options=PROFILE).cuda_source(), tmp_path)


def test_sampled_functions_say_they_are_profiled():
    meta = build(graphs.two_ops, samples=[{"M": 16}, {"M": 64}], num_sms=8,
                 options=PROFILE).meta
    assert all(m.profiled for _, _, m in meta.samples)
    assert not build(graphs.two_ops, {"M": 16}, strategy="unfused").meta.profiled


def rows_of(*tasks):
    """Timeline rows from (start ns, end ns, share of the task spent waiting, SM[, CTA[, share
    spent on its notifies]]); the CTA is the SM's where none is given (one CTA an SM)."""
    rows = np.zeros((len(tasks), WORDS), np.int64)
    for r, (start, end, waiting, sm, *rest) in zip(rows, tasks):
        if start is None:
            continue  # a skipped task keeps zeros
        cta = rest[0] if rest else sm
        notifying = rest[1] if len(rest) > 1 else 0.0
        r[START_NS], r[END_NS], r[PLACE] = start, end, cta << 32 | sm
        r[START_CLK], r[END_CLK] = 10_000, 10_000 + 1000
        r[WAITED_CLK] = 10_000 + int(1000 * waiting)
        r[BODY_CLK] = r[END_CLK] - int(1000 * notifying)
    return rows.ravel()


META = GraphMeta("g", ["a(0)", "a(1)", "b(0)", "b(1)"], [], 4.0, profiled=True)


def test_timeline_spans_waits_and_handoffs():
    timeline = Timeline(META, rows_of((5_000, 7_000, 0.0, 3), (5_500, 6_500, 0.5, 4),
                                      (7_400, 9_000, 0.25, 3, 3, 0.125), (None, None, 0, 0)))
    spans = {s.name: s for s in timeline.spans}
    assert sorted(spans) == ["a(0)", "a(1)", "b(0)"]  # b(1) never ran
    assert spans["a(1)"].start_us == pytest.approx(0.5)
    assert spans["a(1)"].wait_us == pytest.approx(0.5)
    assert spans["b(0)"].body_us == pytest.approx(1.2)
    assert spans["b(0)"].notify_us == pytest.approx(0.2)  # the last eighth of its 1.6 us
    assert spans["a(1)"].notify_us == 0.0
    assert timeline.makespan_us == pytest.approx(4.0)
    np.testing.assert_allclose(timeline.handoffs_us(), [0.4])  # SM 3: a(0) ends, b(0) starts
    summary = timeline.summary()
    assert "makespan 4.0 us on 2 SMs (2 CTAs); median hand-off 0.40 us" in summary
    # call, tasks, median wait, body, notifies, hand-off before (none before a CTA's first
    # task), busy, from, to, full to (a's two bodies run together from 1.0 to 1.5 us), the
    # most tasks an SM took, the SMs that took none
    assert summary.splitlines()[1].split() == ["a", "2", "0.25", "1.25", "0.00", "0.00", "3.0",
                                               "0.0", "2.0", "1.5", "1", "0"]
    assert summary.splitlines()[2].split() == ["b", "1", "0.40", "1.20", "0.20", "0.40", "1.6",
                                               "2.4", "4.0", "4.0", "1", "1"]


def test_a_calls_last_wave_drains_from_where_its_bodies_stop_filling_the_ctas():
    """Four bodies start together and end at 4, 6, 10 and 10 us: all four run to 4 us, then
    the call drains; a second call's body keeps the kernel's CTAs busy in part."""
    meta = GraphMeta("g", ["a(0)", "a(1)", "a(2)", "a(3)", "b(0)"], [], 4.0, profiled=True)
    timeline = Timeline(meta, rows_of((1_000, 11_000, 0.0, 0), (1_000, 11_000, 0.0, 1),
                                      (1_000, 7_000, 0.0, 2), (1_000, 5_000, 0.0, 3),
                                      (5_000, 10_000, 0.2, 3)))
    times, running = timeline.bodies_running("a")
    np.testing.assert_allclose(times, [0, 0, 0, 0, 4, 6, 10, 10])
    np.testing.assert_array_equal(running, [1, 2, 3, 4, 3, 2, 1, 0])
    assert timeline.full_until_us("a") == pytest.approx(4.0)
    assert timeline.full_until_us("b") == pytest.approx(9.0)
    # every call: b's body (5 to 9 us) keeps four running until a's second end
    assert timeline.full_until_us() == pytest.approx(6.0)
    assert timeline.summary().splitlines()[1].split()[-3] == "4.0"


def test_two_ctas_on_one_sm_hand_off_each_on_its_own():
    """CTAs 3 and 135 share SM 3: their tasks overlap, and each CTA's hand-off is taken
    between its own tasks (across the SM's two CTAs the gaps would be negative)."""
    timeline = Timeline(META, rows_of((5_000, 7_000, 0.0, 3, 3), (5_500, 8_000, 0.0, 3, 135),
                                      (7_300, 9_000, 0.0, 3, 3), (8_600, 9_500, 0.0, 3, 135)))
    assert {(s.name, s.sm, s.cta) for s in timeline.spans} == {
        ("a(0)", 3, 3), ("a(1)", 3, 135), ("b(0)", 3, 3), ("b(1)", 3, 135)}
    np.testing.assert_allclose(sorted(timeline.handoffs_us()), [0.3, 0.6])
    assert "on 1 SMs (2 CTAs); median hand-off 0.45 us" in timeline.summary()


def test_tasks_per_sm_counts_a_calls_tasks_on_every_sm_the_kernel_ran_on():
    """Two CTAs an SM on SMs 3, 4 and 5 (CTA rows for all six): a's three tasks pile on SMs
    3 and 4, and SM 5, whose CTAs ran only b, takes none of them."""
    meta = GraphMeta("g", ["a(0)", "a(1)", "a(2)", "b(0)"], [], 4.0, profiled=True)
    tasks = rows_of((1_000, 5_000, 0.0, 3, 3), (1_000, 5_000, 0.0, 3, 135),
                    (1_000, 4_000, 0.0, 4, 4), (1_000, 2_000, 0.0, 5, 5))
    timeline = Timeline(meta, with_ctas(tasks, *((500, 900, 6_000, sm, cta) for sm, cta in (
        (3, 3), (3, 135), (4, 4), (4, 136), (5, 5), (5, 137)))))
    np.testing.assert_array_equal(timeline.tasks_per_sm("a"), [2, 1, 0])
    np.testing.assert_array_equal(timeline.tasks_per_sm("b"), [0, 0, 1])
    np.testing.assert_array_equal(timeline.tasks_per_sm(), [2, 1, 1])
    assert timeline.summary().splitlines()[1].split()[-2:] == ["2", "1"]
    assert timeline.summary().splitlines()[2].split()[-2:] == ["1", "2"]


def test_chrome_trace_has_one_track_per_cta(tmp_path):
    timeline = Timeline(META, rows_of((5_000, 7_000, 0.5, 3), (5_500, 6_500, 0.0, 4),
                                      (5_200, 6_000, 0.0, 3, 135, 0.25), (None, None, 0, 0)))
    timeline.write_chrome_trace(tmp_path / "run.json")
    events = json.loads((tmp_path / "run.json").read_text())["traceEvents"]
    tasks = [e for e in events if e["ph"] == "X" and e["name"] not in ("wait", "notify")]
    assert {(e["name"], e["pid"], e["tid"], e["ts"], e["dur"]) for e in tasks} == {
        ("a(0)", 3, 3, 0.0, 2.0), ("a(1)", 4, 4, 0.5, 1.0), ("b(0)", 3, 135, 0.2, 0.8)}
    assert [e["dur"] for e in events if e["name"] == "wait"] == [1.0]
    # b(0)'s notifies: the last quarter of its 0.8 us
    assert [(e["tid"], e["ts"], e["dur"]) for e in events if e["name"] == "notify"] == [
        (135, pytest.approx(0.8), pytest.approx(0.2))]
    names = {(e["name"], e["pid"], e.get("tid"), e["args"]["name"])
             for e in events if e["ph"] == "M"}
    assert names == {("process_name", 3, None, "SM 3"), ("process_name", 4, None, "SM 4"),
                     ("thread_name", 3, 3, "CTA 3"), ("thread_name", 3, 135, "CTA 135"),
                     ("thread_name", 4, 4, "CTA 4")}


def with_ctas(task_rows, *ctas):
    """``task_rows`` (of ``rows_of``) followed by CTA rows from (entered ns, ready ns, left ns,
    SM, CTA)."""
    rows = np.zeros((len(ctas), WORDS), np.int64)
    for r, (entered, ready, left, sm, cta) in zip(rows, ctas):
        r[ENTERED_NS], r[READY_NS], r[LEFT_NS], r[PLACE] = entered, ready, left, cta << 32 | sm
    return np.concatenate([task_rows, rows.ravel()])


def test_cta_rows_give_the_kernel_time_around_its_tasks(tmp_path):
    tasks = rows_of((5_000, 7_000, 0.0, 3), (5_500, 6_500, 0.0, 4), (7_400, 9_000, 0.0, 3),
                    (None, None, 0, 0))
    timeline = Timeline(META, with_ctas(tasks, (2_000, 4_800, 9_300, 3, 3),
                                        (2_500, 4_900, 9_900, 4, 4), (0, 0, 0, 0, 0)))
    assert [(c.cta, c.sm, c.entered_us, c.ready_us, c.left_us) for c in timeline.ctas] == [
        (3, 3, -3.0, -0.2, 4.3), (4, 4, -2.5, -0.1, 4.9)]  # a CTA row never written: none
    assert timeline.makespan_us == pytest.approx(4.0)
    assert timeline.kernel_us == pytest.approx(7.9)
    assert ("kernel 7.9 us: CTAs entered from -3.0 us, all past the prologue at -0.1, the "
            "last left at 4.9") in timeline.summary()
    timeline.write_chrome_trace(tmp_path / "run.json")
    events = json.loads((tmp_path / "run.json").read_text())["traceEvents"]
    around = {(e["name"], e["tid"], e["ts"], round(e["dur"], 6)) for e in events
              if e["name"] in ("prologue", "leaving")}
    # each CTA leaves after its last task: CTA 3 after b(0) (4.0), CTA 4 after a(1) (1.5)
    assert around == {("prologue", 3, -3.0, 2.8), ("prologue", 4, -2.5, 2.4),
                      ("leaving", 3, 4.0, 0.3), ("leaving", 4, 1.5, 3.4)}


def test_a_timeline_without_cta_rows_has_no_kernel_time():
    timeline = Timeline(META, rows_of((5_000, 7_000, 0.0, 3), (None, None, 0, 0),
                                      (None, None, 0, 0), (None, None, 0, 0)))
    assert timeline.ctas == [] and timeline.kernel_us == 0.0
    assert "kernel" not in timeline.summary()


def test_an_empty_timeline_is_empty():
    timeline = Timeline(META, np.zeros(4 * WORDS, np.int64))
    assert timeline.spans == [] and timeline.makespan_us == 0.0
