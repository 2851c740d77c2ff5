"""The host's reading of a stopped kernel's status record (src/etc_runtime.cuh): every kind
of stop becomes an ExecutionError that names what a user needs to find the cause."""
import re

import numpy as np
import pytest

from etc_tvm import ExecutionError
from etc_tvm.build import graph_meta
from etc_tvm.task_graph import TaskGraph
from etc_tvm.tir_sched.events import EventLayout, edge_sites
from etc_tvm.tir_sched.inline import input_check_sites
from etc_tvm.tir_sched.persistent import KernelOptions

from moe_graph import make_moe_graph
from moe_tile_graphs import one_call_graphs

GRAPH = TaskGraph.build(make_moe_graph(32, 8, 2, 16, 4, "tensor"), {"T": 7})
LAYOUT = EventLayout.of(GRAPH)
SITES = edge_sites(GRAPH)
CALLS = {c.name: c for c in GRAPH.calls}


def task(call, k):
    return CALLS[call].first_task + k


def site(call, etensor):
    return next(k for k, (c, e) in enumerate(SITES) if c.name == call and e.etensor == etensor)


@pytest.fixture(scope="module")
def meta():
    return graph_meta(make_moe_graph(32, 8, 2, 16, 4, "tensor"), {"T": 7}, KernelOptions(),
                      has_status=True)


def status(kind, who, where, seen, sm):
    return np.array([kind, who, where, seen, sm, 0, 0, 0], np.int32)


def test_a_running_record_is_no_error(meta):
    meta.check(status(0, 0, 0, 0, 0))


RECORDS = {  # name: (record, what the error says)
    "wait": ((1, task("scatter0", 0), LAYOUT.offsets["expert_ready"], 1, 17),
             r"task scatter0\(0\) on SM 17 waited on expert_ready\[0\] \(counter 1\) for more "
             r"than 4.0 s"),
    "completion wait": ((1, task("expert0", 0), LAYOUT.done[1], 1, 3),
                        r"task expert0\(0\) on SM 3 waited on completion of grouping0 "),
    "pop": ((2, -1, 40, -1, 5), r"a CTA on SM 5 waited for slot 40 of the ready ring"),
    "overflow": ((3, task("expert0", 9), 44, 44, 2),
                 r"the ready ring overflowed: a push from task expert0\(9\) \(with any tasks "
                 r"claimed beside it\) needed slot 44, past the ring's 44 slots"),
    "index": ((4, task("scatter0", 0), 9, site("scatter0", "expert_ready"), 1),
              r"task scatter0\(0\) on SM 1: the edge map scatter0: expert_ready "
              r"'t->topk\[t,:\]' gave the index 9, outside its event tensor or grid"),
    "index when arming": ((4, -1, 13, site("expert0", "expert_ready"), 0),
                          r"arming on SM 0: the edge map expert0: expert_ready "
                          r"'e=>exp_indptr\[e\]:exp_indptr\[e\+1\]' gave the index 13"),
    "negative count": ((5, -1, LAYOUT.offsets["expert_ready"] + 1, -7, 0),
                       r"the run-time wait count of expert_ready\[1\] is -7, negative"),
    "released twice": ((6, task("expert0", 4), task("expert0", 4), 0, 0),
                       r"trigger maps released task expert0\(4\) twice"),
    "idle": ((7, task("combine0", 0), -1, 0, 9),
             r"a CTA on SM 9 found no task ready, in its queue or the ready ring, for more "
             r"than 4.0 s \(its next queued task: combine0\(0\)\)"),
}


@pytest.mark.parametrize("kind", RECORDS)
def test_each_stop_is_named(meta, kind):
    record, message = RECORDS[kind]
    with pytest.raises(ExecutionError, match=r"moe: " + message):
        meta.check(status(*record))


def test_a_failed_input_check_names_the_task_and_the_value():
    """Kind 8: the message of the check that failed (numbered over the calls' device
    functions, as ``input_check_sites``), the task that ran it and the value it found."""
    graph = one_call_graphs(128, 32, 4, 64)["align_chunked"]
    tasks = TaskGraph.build(graph, {"T": 100})
    checks = input_check_sites(tasks)
    assert [(c.fn.name, k) for c, k in checks] == [("align_count_32_top4_c32_t128", 0),
                                                    ("align_place_32_top4_bt16_c32_t128", 0)]
    place = checks[1][0]
    meta = graph_meta(graph, {"T": 100}, KernelOptions(), has_status=True)
    with pytest.raises(ExecutionError, match=rf"align_chunked: task "
                                             rf"{re.escape(tasks.task_name(place.first_task + 2))}"
                                             r" on SM 6: topk holds the expert id 40, outside "
                                             r"0\.\.31; the kernel stopped"):
        meta.check(status(8, place.first_task + 2, 40, 1, 6))
