"""Compile-only checks of the generated CUDA (no GPU): it builds with nvcc for sm_90a, and the
megakernel waits before a task's body and notifies after it."""
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from etc_tvm.build import build
from etc_tvm.errors import EtcError
from etc_tvm.relax_passes import STRATEGIES, StaticScheduleTransform
from etc_tvm.schedule import ONLY_PRODUCER, DynamicPlan
from etc_tvm.task_graph import TaskGraph
from etc_tvm.tir_sched.device_runtime import RUNTIME_SOURCE
from etc_tvm.tir_sched.persistent import KernelOptions

import graphs
from moe_graph import COUNT_MODES, moe_graph
from test_executor import chain
from tiles import ROWS, TILE

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
DIMS = {"M": 64, "K": 32, "N": 48}


def nvcc(source: str, tmp_path: Path) -> None:
    path = tmp_path / "kernel.cu"
    path.write_text(source)
    proc = subprocess.run(["nvcc", "-arch=sm_90a", "-c", str(path), "-o", str(tmp_path / "k.o")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


@needs_nvcc
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_generated_cuda_compiles_for_sm90a(strategy, tmp_path):
    source = build(graphs.gemm_reduce_scatter, DIMS, strategy=strategy, num_sms=132).cuda_source()
    assert "__global__" in source
    nvcc(source, tmp_path)


@needs_nvcc
def test_device_runtime_compiles_alone(tmp_path):
    nvcc(f'#include "{RUNTIME_SOURCE}"\n'
         "__global__ void k(int* c, int* s) { if (etc_wait(c, s, 0, 0, 1000) == 0) "
         "etc_notify(c + 1); }\n", tmp_path)


@needs_nvcc
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_prelude_kernels_compile_for_sm90a(strategy, tmp_path):
    nvcc(build(graphs.weighted_rows, PRELUDE_DIMS, strategy=strategy,
               num_sms=132).cuda_source(), tmp_path)


PRELUDE_DIMS = {"M": 160, "N": 7, "P": 40}


@pytest.mark.parametrize("claim", [False, True])
def test_prelude_runs_after_its_producers_and_before_the_task_waits(claim):
    """weight_row_tile's prelude (the copy of its weight row) runs once the call that picks
    the rows is complete and before the wait on its tile of scale; after the body the kernel
    drains the prelude's copies, which a task whose body did not run would leave in flight.
    The prelude's waits publish a failure in a flag of their own: the task's waits publish in
    ``stop`` with no barrier after the prelude's readers."""
    source = build(graphs.weighted_rows, PRELUDE_DIMS, num_sms=8,
                   options=KernelOptions(claim=claim)).cuda_source()
    branch = source[source.index("if (t < 120) {"):]  # the third call's tasks
    picks_done = branch.index("etc_wait((&(counters_ptr[40]))")
    copy = branch.index("cp_async_cg")
    tile_wait = branch.index("etc_wait((&(counters_ptr[(t % 40)]))")
    assert picks_done < branch.index("prelude_stop_ptr[0] = halt_ptr[0]") \
        < branch.index("if (prelude_stop_ptr[0] != 0)") < copy < tile_wait \
        < branch.index(" stop_ptr[0] = halt_ptr[0]", tile_wait) < branch.index("B_ptr[") \
        < branch.index("cp_async_wait_all")
    assert branch.count("prelude_stop_ptr[0] = halt_ptr[0]") == 1
    plain = build(graphs.gemm_reduce_scatter, DIMS, num_sms=8,
                  options=KernelOptions(claim=claim)).cuda_source()
    assert "prelude_stop" not in plain


def test_wait_before_body_before_notify():
    source = build(graphs.gemm_reduce_scatter, DIMS, num_sms=132).cuda_source()
    kernel = source[source.index("gemm_reduce_scatter_megakernel_kernel("):]
    kernel = kernel[kernel.index("{"):]
    producer, consumer = kernel.split("} else {", 1)
    assert producer.index("C_ptr[") < producer.index("tvm_builtin_cuda_cta_sync") \
        < producer.index("etc_notify(")
    assert "etc_wait" not in producer
    assert consumer.index("etc_wait(") < consumer.index("tvm_builtin_cuda_cta_sync") \
        < consumer.index("D_ptr[")
    assert "etc_notify" not in consumer


@needs_nvcc
@pytest.mark.parametrize("graph, dims", [(graphs.gemm_reduce_scatter, DIMS),
                                         (moe_graph(2, "tensor"), {"T": 7})])
@pytest.mark.parametrize("strategy", ["static", "barrier"])
def test_claiming_kernel_compiles_for_sm90a(graph, dims, strategy, tmp_path):
    nvcc(build(graph, dims, strategy=strategy, num_sms=132,
               options=KernelOptions(claim=True)).cuda_source(), tmp_path)


def test_claiming_kernel_claims_after_the_waits_and_peeks_before_fenced_notifies():
    """A CTA claims its next task once the current one's waits are done; before the
    notifies it peeks at the next task's element and fences (the release of the relaxed
    notifies, the acquire of the peek); a next task seen complete skips its wait."""
    source = build(graphs.gemm_reduce_scatter, DIMS, num_sms=132,
                   options=KernelOptions(claim=True)).cuda_source()
    kernel = source[source.index("gemm_reduce_scatter_megakernel_kernel("):]
    assert "queue" not in kernel and "indptr" not in kernel
    loop = kernel[kernel.index("while (1)"):]
    scatter = loop.index("if (t < 24) {")  # the second call's branch
    producer, consumer = loop[:scatter], loop[scatter:]
    assert producer.index("etc_claim(") < producer.index("C_ptr[") \
        < producer.index("etc_peek_complete(") < producer.index("etc_fence()") \
        < producer.index("etc_notify_fenced(")
    assert "etc_notify(" not in kernel
    assert consumer.index("if (ready == 0) {") < consumer.index("etc_wait(") \
        < consumer.index("etc_claim(") < consumer.index("D_ptr[")


def test_claiming_kernel_ctas_run_their_first_task_without_a_claim():
    """CTA bx runs task bx first: the claim counter starts past the 132 CTAs' ids, and a CTA
    claims (one atomic) only from its second task on."""
    source = build(graphs.gemm_reduce_scatter, DIMS, num_sms=132,
                   options=KernelOptions(claim=True)).cuda_source()
    kernel = source[source.index("gemm_reduce_scatter_megakernel_kernel("):]
    loop = kernel.index("while (1)")
    assert "claimed_ptr[0] = ((int)blockIdx.x);" in kernel[:loop]
    assert "claim_ptr[((((int)blockIdx.x) * 128) + ((int)threadIdx.x))] = 132;" in kernel[:loop]
    assert "etc_claim(" not in kernel[:loop] and "etc_claim(" in kernel[loop:]


def test_claimed_expert_tasks_are_peeked_through_their_trigger():
    """The peek at a next expert task reads the trigger's tensor only once the CTA has seen
    the routing complete, and a peek that found the trigger releasing nothing skips the
    task's body (and its data-dependent notifies) without its waits."""
    source = build(moe_graph(2, "tensor"), {"T": 7}, num_sms=132,
                   options=KernelOptions(claim=True)).cuda_source()
    kernel = source[source.index("megakernel_kernel("):]
    peek = kernel[kernel.index("following_ptr[0] = "):]
    peek = peek[:peek.index("etc_fence()")]
    seen = re.search(r"if \(seen_ptr\[\d+\] != 0\)", peek).start()
    assert seen < peek.index("looked_ptr[1] = 2;") < peek.index("exp_indptr_ptr[") \
        < peek.index("looked_ptr[1] = 1;", seen) < peek.index("etc_peek_complete(", seen)
    # the flag read as a warp-uniform value (test_moe_tiles: what ptxas makes of it)
    assert re.search(r"int skip = etc_uniform\(skip_ptr\[0\]\);\s+"
                     r"if \(\(ready != 0\) \? \(ready == 1\) : \(skip == 0\)\) \{", kernel)


def test_a_claimed_peek_reads_no_counter_this_cta_saw_complete():
    """A counter of fixed index (a barrier, a call's completion, a one-element ETensor) stays
    complete once a CTA's wait saw it so: the peek at the next task reads it only before
    that, where a tile-level counter, whose element moves with the task, is read every time."""
    for graph, dims, strategy in ((graphs.gemm_reduce_scatter, DIMS, "barrier"),
                                  (moe_graph(2, "tensor"), {"T": 7}, "static")):
        source = build(graph, dims, strategy=strategy, num_sms=132,
                       options=KernelOptions(claim=True)).cuda_source()
        lines = [line.strip() for line in source.splitlines()]
        peeks = [(lines[k - 1], re.search(r"counters_ptr\[(.*?)\]", line).group(1))
                 for k, line in enumerate(lines) if "etc_peek_complete((&(counters_ptr[" in line]
        fixed = [(before, index) for before, index in peeks if index.isdigit()]
        assert fixed and all(re.fullmatch(r"if \(seen_ptr\[\d+\] == 0\) \{", before)
                             for before, _ in fixed), fixed
        assert all(not before.startswith("if (seen_ptr[")
                   for before, index in peeks if not index.isdigit())


def test_claiming_needs_tasks_that_wait_only_on_lower_ids():
    with pytest.raises(EtcError, match="a task waits on a task of a higher id"):
        build(graphs.backward_chain, {"M": 4 * ROWS}, num_sms=132,
              options=KernelOptions(claim=True))


def counter_waits(source: str) -> list[tuple[str, str, str]]:
    """Each bounded wait of a generated kernel: (the line before it, its counter index as
    the CUDA writes it, the line after it)."""
    lines = [line.strip() for line in source.splitlines()]
    return [(lines[k - 1], re.search(r"counters_ptr\[(.*?)\]", lines[k]).group(1),
             lines[k + 1]) for k, line in enumerate(lines) if "= etc_wait(" in line]


def test_a_cta_polls_a_counter_of_fixed_index_until_it_saw_it_complete():
    """The barrier between two calls is one counter: a CTA that saw it complete skips the
    waits of its later tasks on it; a tile-level wait, whose element moves with the task,
    polls every time."""
    def waits(strategy):
        return counter_waits(build(graphs.gemm_reduce_scatter, DIMS, strategy=strategy,
                                   num_sms=132).cuda_source())

    assert waits("barrier") == [("if ((halt_ptr[0] == 0) && (seen_ptr[0] == 0)) {", "0",
                                 "seen_ptr[0] = (1 - halt_ptr[0]);")]
    [(guard, element, after)] = waits("static")
    assert (guard, element) == ("if (halt_ptr[0] == 0) {", "(t % 12)")
    assert "seen_ptr" not in after


def test_persistent_kernel_is_cooperative_with_one_cta_per_sm():
    mod = StaticScheduleTransform(DIMS, num_sms=132)(graphs.gemm_reduce_scatter.mod)
    kernel = mod["gemm_reduce_scatter_megakernel"]
    assert "tirx.use_cooperative_launch" in list(kernel.attrs["tirx.kernel_launch_params"])
    assert re.search(r"bx = T\.cta_id\(\[132\]\)", kernel.script())


def test_dynamic_kernel_pops_pushes_then_waits_runs_notifies():
    source = build(graphs.gemm_reduce_scatter, DIMS, strategy="dynamic", num_sms=132).cuda_source()
    kernel = source[source.index("gemm_reduce_scatter_dynamic_megakernel_kernel("):]
    order = [kernel.index(s) for s in ("tvm_builtin_cuda_grid_sync", "etc_take(",
                                       "etc_count_down(", "etc_notify(", "etc_wait(")]
    assert order == sorted(order)  # pop, early pushes, then the producer's branch, then the rest


def test_dynamic_kernel_ctas_take_their_first_slot_without_a_claim():
    """CTA bx holds ring slot bx from the launch: the head starts past the 132 CTAs' slots,
    and a CTA claims (one atomic) only from its second take on."""
    source = build(graphs.gemm_reduce_scatter, DIMS, strategy="dynamic", num_sms=132).cuda_source()
    kernel = source[source.index("gemm_reduce_scatter_dynamic_megakernel_kernel("):]
    assert "? (head_tail0_ptr[0] + 132) : head_tail0_ptr[" in kernel
    loop = kernel.index("while (1)")
    assert kernel.index("claim_ptr[0] = ((int)blockIdx.x);") < loop
    assert "claim_ptr[0] = -1;" not in kernel[:loop]


def test_dynamic_kernel_counts_consumers_down_while_warp_0_waits():
    """Warps 1.. count a task's consumers down while warp 0 waits on its events, no barrier
    between them; thread 0 claims the next slot only past a barrier after the waits, once
    ``held`` says whether the count-downs kept a consumer to run next."""
    source = build(graphs.backward_chain, {"M": 4 * ROWS}, strategy="dynamic",
                   num_sms=132).cuda_source()
    kernel = source[source.index("backward_chain_dynamic_megakernel_kernel("):]
    loop = kernel[kernel.index("while (1)"):]
    down, wait = loop.index("etc_count_down("), loop.index("etc_wait(")
    assert "if (32 <= ((int)threadIdx.x)) {" in loop[:down]
    assert down < wait and "cta_sync" not in loop[down:wait]
    claim = loop.index("etc_claim(", down)
    assert loop.index("tvm_builtin_cuda_cta_sync", wait) < loop.rindex("held_ptr[0] < 0", 0,
                                                                        claim) < claim


def test_dynamic_kernel_counts_a_fan_in_over_whole_calls_down_once_by_one_warp():
    """Each result tile waits on all 12 partial sums: a partial sum's dispatch counts the
    result's call down once, warp 1 storing the pushed call's slots, and counts no task down."""
    source = build(graphs.row_sum_after_all, {"M": 4 * TILE, "N": 3 * TILE}, strategy="dynamic",
                   num_sms=132).cuda_source()
    kernel = source[source.index("row_sum_after_all_dynamic_megakernel_kernel("):]
    loop = kernel[kernel.index("while (1)"):]
    down = loop.index("etc_count_down_call_warp((&(pending_ptr[16])), 12, 4, ")
    guard = loop.rindex("if ((((int)threadIdx.x) >> 5) == 1) {", 0, down)
    assert "if ((0 <= t) && (t < 12)) {" in loop[guard:down]  # warp 1, a partial sum's dispatch
    assert "etc_count_down(" not in loop


def test_dynamic_kernel_reads_the_held_tasks_consumers_beside_the_notifies():
    """A task kept to run next has its consumer list read by thread 32 while thread 0
    notifies, into shared memory; the next round counts its consumers down from there, and
    its first consumer, the one it may hold, with no load at all."""
    source = build(graphs.backward_chain, {"M": 4 * ROWS}, strategy="dynamic",
                   num_sms=132).cuda_source()
    kernel = source[source.index("backward_chain_dynamic_megakernel_kernel("):]
    loop = kernel[kernel.index("while (1)"):]
    take = loop.index("held_list_ptr[3] = ((int)(0 <= popped_ptr[0]));")
    down = loop.index("etc_count_down(")
    assert take < loop.index(" = held_list_ptr[0];") < down
    listing = loop.index("if (((int)threadIdx.x) == 32) {", down)
    assert loop.rindex("tvm_builtin_cuda_cta_sync", 0, listing) > loop.index("etc_wait(")
    assert "held_list_ptr[2] = first_consumer_ptr[h];" in loop[listing:loop.index(
        "etc_notify(", listing)]


def test_dynamic_kernel_clears_held_on_the_thread_that_reads_it_after_the_task():
    """Thread 32 reads ``held`` after the task and before the next round, with no barrier
    between it and thread 0's next take: thread 0 only moves the held task out (a write there
    raced thread 32's read, which could find the next round's -1 and leave the held task's
    list stale); thread 32 clears it at its next dispatch, past the take's barrier, before
    it counts down and may hold again."""
    source = build(graphs.backward_chain, {"M": 4 * ROWS}, strategy="dynamic",
                   num_sms=132).cuda_source()
    kernel = source[source.index("backward_chain_dynamic_megakernel_kernel("):]
    loop = kernel[kernel.index("while (1)"):]
    take = loop.index("popped_ptr[0] = held_ptr[0];")
    barrier = loop.index("tvm_builtin_cuda_cta_sync", take)
    assert "held_ptr[0] = " not in loop[take + 1:barrier]
    clear = loop.index("if (((int)threadIdx.x) == 32) {\n      held_ptr[0] = -1;\n    }")
    assert barrier < clear < loop.index("etc_count_down(")
    assert [m.start() for m in re.finditer(r"held_ptr\[0\] = -1;", loop)] == [
        loop.index("held_ptr[0] = -1;", clear)]  # the only one in the loop
    listing = loop.index("int h = held_ptr[0];")
    assert loop.rindex("if (((int)threadIdx.x) == 32) {", 0, listing) > clear


def test_dynamic_kernel_chains_a_consumer_the_task_alone_produces():
    """A chain link is its successor's only producer: at the link's dispatch every thread
    chains the successor, with no count-down, loading its consumer tables into registers
    (their round trip overlaps the link); the next round starts it with no take and no
    barrier, while thread 0 still notifies, and skips its waits: its own CTA did all it
    waits on. No claim and no consumer list for the link that chained. In the kernels of
    sampled sizes, where a task beyond the launch's grids has a pending count out of reach,
    every consumer is counted down (``etc_count_down``'s last argument) and none chained."""
    source = build(chain, {"M": 4 * ROWS}, strategy="dynamic", num_sms=132).cuda_source()
    kernel = source[source.index("chain_dynamic_megakernel_kernel("):]
    loop = kernel[kernel.index("while (1)"):]
    unchained = loop.index("if (chained_now == 0) {")
    take = loop.index("etc_take(", unchained)
    bind = loop.index("int t = condval;")
    assert unchained < take < loop.index("tvm_builtin_cuda_cta_sync", take) < bind
    assert "condval = chained_ptr[1];" in loop[take:bind]
    assert "condval_1 = 1;" in loop[take:loop.index("int here = condval_1;")]
    assert "condval_2 = chain_list_ptr[0];" in loop[bind:]
    chained = loop.index("if (chained_ptr[0] != 0) {", bind)
    tables = loop.index("chain_list_ptr[2] = first_consumer_ptr[(first & 1073741823)];",
                        chained)
    assert "if (((int)threadIdx.x)" not in loop[chained:tables]  # every thread
    wait = loop.index("etc_wait(", tables)
    assert loop.rindex("if (here == 0) {", 0, wait) > tables
    claim = loop.index("if (chained_ptr[0] == 0) {", wait)
    assert claim < loop.index("etc_claim(", claim)
    listing = loop.index("if (chained_ptr[0] == 0) {\n        if (((int)threadIdx.x) == 32) {",
                         claim)
    assert listing < loop.index("etc_notify(", listing)
    assert set(re.findall(r"etc_count_down\([^;]*, (\d)\);", loop)) == {"0"}
    sampled = build(chain, strategy="dynamic", num_sms=132,
                    samples=[{"M": 2 * ROWS}, {"M": 4 * ROWS}]).cuda_source()
    assert set(re.findall(r"etc_count_down\([^;]*, (\d)\);", sampled)) == {"1"}
    assert "chained_ptr" not in sampled


def test_dynamic_kernel_claims_past_the_barrier_that_ends_the_waits():
    """Thread 0 claims the next slot once the count-downs are done: past the barrier that
    ends the task's waits where they ran, past a barrier of its own only where they did not
    (a task held from its only producer)."""
    source = build(chain, {"M": 4 * ROWS}, strategy="dynamic", num_sms=132).cuda_source()
    kernel = source[source.index("chain_dynamic_megakernel_kernel("):]
    loop = kernel[kernel.index("while (1)"):]
    wait = loop.index("etc_wait(")
    claim = loop.index("etc_claim(", wait)
    own = loop.index("if (here != 0) {\n          tvm_builtin_cuda_cta_sync();\n        }", wait)
    assert loop.rindex("tvm_builtin_cuda_cta_sync", 0, own) < own < claim
    assert loop.count("tvm_builtin_cuda_cta_sync", wait, claim) == 2


def test_dispatch_reads_consumer_lists_only_for_calls_that_have_consumers():
    """In the MoE graph the router's and the grouping's tasks have consumers in the plan;
    scatter's, the expert tiles' (released by a trigger) and combine's have none: their
    dispatches skip the round trip to the consumer list."""
    graph = TaskGraph.build(moe_graph(2, "inferred"), {"T": 7})
    plan = DynamicPlan.of(graph)
    with_consumers = [c.name for c in graph.calls if plan.consumer_indptr[
        c.first_task + c.num_tasks] > plan.consumer_indptr[c.first_task]]
    assert with_consumers == ["router0", "grouping0"]
    scatter = graph.calls[2]
    source = build(moe_graph(2, "inferred"), {"T": 7}, strategy="dynamic",
                   num_sms=132).cuda_source()
    kernel = source[source.index("_dynamic_megakernel_kernel("):]
    guard = f"if ((0 <= t) && (t < {scatter.first_task})) {{"
    assert kernel.index(guard) < kernel.index("consumer_indptr_ptr[") \
        < kernel.index("etc_count_down((")


@needs_nvcc
@pytest.mark.parametrize("strategy", ["static", "dynamic", "mixed", "unfused"])
@pytest.mark.parametrize("count_mode", COUNT_MODES)
def test_moe_kernel_with_data_dependent_edges_compiles_for_sm90a(count_mode, strategy,
                                                                 tmp_path):
    source = build(moe_graph(2, count_mode), {"T": 7}, strategy=strategy,
                   num_sms=132).cuda_source()
    nvcc(source, tmp_path)


def test_mixed_kernel_polls_its_queue_head_on_warp_0():
    """Warp 0 polls the head of a CTA's queue before thread 0 takes a task, the points of a
    data-dependent map (a token's pair tiles) one a lane, their answer one vote; thread 0
    takes the head on that vote. A ring task the last round held goes first: no poll then."""
    source = build(moe_graph(2, "tensor"), {"T": 7}, strategy="mixed", num_sms=132).cuda_source()
    loop = source[source.index("taken_ptr[0] = held_ptr[0];"):]
    assert loop.index("polled_ptr[0] = ((((taken_ptr[0] < 0) &&") < loop.index("etc_poll(")
    loop = loop[loop.index("polled_ptr[0] ="):]
    poll, take = loop[:loop.index("taken_ptr[1] = 0;")], loop[
        loop.index("taken_ptr[1] = 0;"):loop.index("etc_try_pop(")]
    vote = "halt_ptr[0] = tvm_builtin_cuda_any_sync((uint)4294967295, halt_ptr[0]);"
    assert "tvm_builtin_cuda_warp_sync();" in poll and poll.rindex(vote) > poll.rindex("etc_poll(")
    lane_points = "pair_tile_ptr[(((polled_task * 2) + ((int)threadIdx.x)) - 54)]"
    assert lane_points in poll and "for (" not in poll
    assert "etc_poll(" not in take and "stop_ptr[0] = halt_ptr[0];" in take


def test_mixed_kernel_of_fewer_than_32_threads_polls_on_thread_0():
    """CTAs of 4 threads have no warp to share a poll over: thread 0 takes a held ring task,
    else polls its queue's head itself."""
    source = build(graphs.gathers, {}, strategy="mixed", num_sms=4).cuda_source()
    loop = source[source.index("while (1)"):]
    assert "polled_ptr" not in source and "any_sync" not in loop
    assert loop.index("taken_ptr[0] = held_ptr[0];") < loop.index("etc_poll(") \
        < loop.index("etc_try_pop(")


def test_mixed_kernel_runs_a_ring_task_held_from_its_only_producer_without_waits():
    """Each mix tile of ``two_ops_ring_mix`` goes through the ring and has one producer, a
    queued scale tile: the CTA that ran the scale tile holds it (``held[1]`` set, no
    count-down) and runs it next with its waits skipped, as it skips a queued task's."""
    source = build(graphs.two_ops_ring_mix, {"M": 8 * ROWS}, strategy="mixed",
                   num_sms=4).cuda_source()
    loop = source[source.index("while (1)"):]
    take = loop.index("done_here_ptr[0] = ((0 <= taken_ptr[0]) ? held_ptr[1] : 0);")
    bind = loop.index("int here = done_here_ptr[0];")
    wait = loop.index("etc_wait(", bind)
    assert take < bind < loop.rindex("if ((queued | here) == 0) {", 0, wait)
    plan = DynamicPlan.of(TaskGraph.build(graphs.two_ops_ring_mix, {"M": 8 * ROWS}), {1})
    assert (plan.first_consumers()[:8] == np.arange(8, 16) | ONLY_PRODUCER).all()


def test_moe_kernel_arms_then_releases_expert_tiles_through_the_trigger():
    """The task completing grouping arms expert_ready (counts added, a fence and a barrier,
    then the bias removed); an expert tile waits for grouping's completion, then finds the
    element whose exp_indptr range holds it and waits on that."""
    source = build(moe_graph(2, "tensor"), {"T": 7}, num_sms=132).cuda_source()
    kernel = source[source.index("moe_megakernel_kernel("):]
    assert "etc_complete((" not in kernel  # grouping is one task: a notify completes it
    arm = kernel[kernel.index("etc_add("):]
    order = [arm.index(s) for s in ("tvm_builtin_cuda_thread_fence",
                                    "tvm_builtin_cuda_cta_sync", "etc_unbias(")]
    assert order == sorted(order)
    scan = kernel.index("skip_ptr[0] = 1;")
    completion = kernel[kernel.rindex("etc_wait(", 0, scan):]  # once: remembered in seen
    assert "seen_ptr[" in completion[:completion.index("skip_ptr[0] = 1;")]
    assert completion.index("skip_ptr[0] = 1;") < completion.index("exp_indptr_ptr[") \
        < completion.index("skip_ptr[0] = 0;") < completion.index("if (skip == 0)")



def test_dynamic_kernel_publishes_released_runs_together():
    """An expert's tiles are a run of a data-dependent length: the arming lists the runs its
    unbias releases, then the CTA claims their ring slots at once and stores them side by
    side, before it marks the tasks no element releases. The same for an element completed
    by a notify, after the task's notifies."""
    source = build(moe_graph(2, "tensor"), {"T": 7}, strategy="dynamic",
                   num_sms=132).cuda_source()
    kernel = source[source.index("_dynamic_megakernel_kernel("):]
    arm = kernel[kernel.index("etc_unbias("):]
    order = [arm.index(s) for s in ("etc_defer_range(", "etc_claim_runs(", "etc_store_runs(",
                                    "etc_mark_range(")]
    assert order == sorted(order)
    notified = kernel[kernel.index("etc_notify_last("):]
    order = [notified.index(s) for s in ("etc_defer_range(", "etc_claim_runs(",
                                         "etc_store_runs(")]
    assert order == sorted(order)
    assert "etc_push_range(" not in kernel


def test_unfused_expert_tiles_scan_the_trigger_then_run_or_skip():
    """Unfused, an expert tile's CTA reads exp_indptr to find an element of expert_ready whose
    range holds its tile, waiting on nothing (the grouping launch has completed), and runs its
    body only if it found one."""
    source = build(moe_graph(2, "tensor"), {"T": 7}, strategy="unfused").cuda_source()
    assert "etc_wait" not in source and "etc_notify" not in source
    expert = source[source.rindex("expert0_grid_kernel(int"):]  # its definition
    expert = expert[expert.index("{"):]
    order = [expert.index(s) for s in ("skip_ptr[0] = 1;", "exp_indptr_ptr[", "skip_ptr[0] = 0;",
                                       "if (skip_ptr[0] == 0)", "expert0_ptr[")]
    assert order == sorted(order)
