// etc_tvm device runtime: the event operations that generated megakernels call.
//
// Protocol (DESIGN.md, "Rules that make a megakernel correct"):
//   notify: every thread of the CTA has written its data, the CTA has passed a barrier, then ONE
//           thread does a release decrement of the event counter.
//   wait:   ONE thread spins until the counter is <= 0 (relaxed polls, then an acquire load),
//           then the CTA passes a barrier.
// Every spin is bounded. Past its time limit a waiter claims the status record, writes which
// task waited on which element, the counter value and its SM, and returns; the other CTAs see
// status[0] != 0 at their next poll and stop too. The host reads the record after the kernel.
//
// status layout (int32): [0] state (0 running, 1 a wait timed out, 2 a pop timed out, 3 the
//                        ready ring overflowed, 4 a data-dependent index fell outside its
//                        event tensor or grid, 5 a run-time wait count was negative, 6 a
//                        trigger released a task twice, 7 a CTA found nothing to run for too
//                        long, 8 a tile's input check failed),
//                        [1] task id (-1: none), [2] element index, ring slot or the index
//                        (the value checked, kind 8), [3] counter value seen, or the edge
//                        (kind 4), value (kind 5) or check (kind 8), [4] SM id.
//
// Run-time events. A call whose completion something waits for counts its unfinished tasks in
// a counter of its own; the task that takes it to zero acquires every task's writes. An event
// tensor whose wait counts are known only at run time starts each counter ETC_ARM_BIAS above
// its static part, so no number of notifies can take it to zero early; once the tensors its
// counts read are complete, one CTA adds the counts and then removes the bias (arming).
//
// The dynamic schedule's ready ring: ``ring`` has one slot per task (each task is pushed at
// most once), -1 until published; ``head_tail[0]`` counts pops, ``head_tail[1]`` pushes and
// ``head_tail[2]`` the tasks that will be pushed. A pop claims the next slot and waits
// (bounded) for its task id; a push claims a slot and publishes the id with a release store.
#ifndef ETC_TVM_RUNTIME_CUH_
#define ETC_TVM_RUNTIME_CUH_

#ifdef __CUDACC_RTC__
#include <cuda/std/cstdint>
using cuda::std::int64_t;
using cuda::std::uint64_t;
#else
#include <cstdint>
#endif

__device__ __forceinline__ unsigned long long etc_globaltimer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// ``v``, which every lane of the warp holds alike (a shared word the CTA wrote before a
// barrier), through redux.sync: its result is a uniform register, so ptxas knows a branch on it
// does not diverge and keeps the code it guards in the uniform datapath (wgmma descriptors in
// uniform registers, not rebuilt a K step). Every lane of the warp must run it.
__device__ __forceinline__ int etc_uniform(int v) { return __reduce_max_sync(0xffffffffu, v); }

// Loads of a counter at the scope of the agents that change it: the GPU's CTAs (kGpu), or
// other GPUs as well (kSys: counters a remote rank decrements).
enum EtcScope { kGpu, kSys };

template <EtcScope S = kGpu>
__device__ __forceinline__ int etc_load_relaxed(const int* p) {
  int v;
  if (S == kGpu) {
    asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  } else {
    asm volatile("ld.relaxed.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  }
  return v;
}

template <EtcScope S = kGpu>
__device__ __forceinline__ int etc_load_acquire(const int* p) {
  int v;
  if (S == kGpu) {
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  } else {
    asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  }
  return v;
}

// Claim the stop record (first caller only) and describe why the grid stops. Inlined where a
// task body records (an input check): a call there makes ptxas save registers around it on
// every task, at the price of spills where the body uses all of them.
__device__ __forceinline__ void etc_record_stop_inline(int* status, int kind, int task,
                                                       int where, int seen) {
  if (atomicCAS(status, 0, -1) == 0) {
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    status[1] = task;
    status[2] = where;
    status[3] = seen;
    status[4] = (int)smid;
    asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(status), "r"(kind) : "memory");
  }
}

__device__ __noinline__ void etc_record_stop(int* status, int kind, int task, int where,
                                             int seen) {
  etc_record_stop_inline(status, kind, task, where, seen);
}

// Returns 0 once *counter <= 0 (acquire at scope S), 1 if the grid is stopping (this or
// another waiter timed out: the stop record, kind 1, names the task, the element and the
// count it saw). Called by one thread.
template <EtcScope S>
__device__ __forceinline__ int etc_wait_at(const int* counter, int* status, int task,
                                           int element, long long limit_ns) {
  if (etc_load_acquire<S>(counter) <= 0) return 0;
  const unsigned long long start = etc_globaltimer_ns();
  for (unsigned polls = 1;; ++polls) {
    const int seen = etc_load_relaxed<S>(counter);
    if (seen <= 0) {
      etc_load_acquire<S>(counter);
      return 0;
    }
    if (polls % 64 != 0) continue;  // poll hot; look at the clock and the grid now and then
    if (etc_load_relaxed(status) != 0) return 1;
    if ((long long)(etc_globaltimer_ns() - start) > limit_ns) {
      etc_record_stop(status, 1, task, element, seen);
      return 1;
    }
    __nanosleep(20);
  }
}

__device__ __noinline__ int etc_wait(const int* counter, int* status, int task, int element,
                                     long long limit_ns) {
  return etc_wait_at<kGpu>(counter, status, task, element, limit_ns);
}

// A claim on the next slot of the ready ring. A CTA claims its next slot while it runs its
// current task: the atomic's result is not read until ``etc_take``, so its round trip
// overlaps the task instead of delaying it. Called by one thread. An increment, not an add:
// ptxas aggregates an add on a warp-uniform address over the warp's active lanes, and its
// shuffle of the result waited for the round trip right away, before the task started; an
// increment below 2^31 - 1 (never reached: slots are fewer) is not aggregated.
__device__ __forceinline__ int etc_claim(int* head_tail) {
  unsigned slot;
  asm volatile("atom.relaxed.gpu.global.inc.u32 %0, [%1], 2147483647;"
               : "=r"(slot) : "l"(head_tail));
  return (int)slot;
}

// The task of claimed slot ``slot`` (acquire: the pusher's writes happen before the task
// runs), -1 once the slot lies past the tasks the ring will hold, -2 if the grid is stopping.
// ``head_tail[2]`` is how many tasks will be pushed: the task count, lowered at run time by the
// tasks no trigger releases, and the tasks held or chained. Both loads leave before either is
// looked at, on every poll: one round trip when the task is there, and a CTA whose slot no task
// will fill leaves as soon as the count says so (the last tasks' CTAs wait on nothing else).
// Called by the thread that claimed it.
__device__ __noinline__ int etc_take(int* head_tail, const int* ring, int slot, int capacity,
                                     int* status, long long limit_ns) {
  int expected = etc_load_relaxed(head_tail + 2);
  int task = etc_load_acquire(ring + min(slot, capacity - 1));
  if (slot >= expected) return -1;
  if (task >= 0) return task;
  const unsigned long long start = etc_globaltimer_ns();
  for (unsigned polls = 0;; ++polls) {
    expected = etc_load_relaxed(head_tail + 2);
    task = etc_load_relaxed(ring + slot);
    if (task >= 0) return etc_load_acquire(ring + slot);
    if (slot >= expected) return -1;
    if (polls % 64 != 63) continue;
    if (etc_load_relaxed(status) != 0) return -2;
    if ((long long)(etc_globaltimer_ns() - start) > limit_ns) {
      etc_record_stop(status, 2, -1, slot, task);
      return -2;
    }
    __nanosleep(20);
  }
}

// The task of claimed slot ``slot`` if it is published now, else -1 (acquire, as etc_take);
// a -1 leaves the slot to etc_take. Called by the thread that claimed it, after the current
// task's body, before its notifies. A relaxed load and a fence make the acquire: the fence
// waits for the load and the task's stores together, one round trip, where an acquire load
// waited out its own before the notifies' fence waited for the stores.
__device__ __forceinline__ int etc_peek(const int* ring, int slot, int capacity) {
  if (slot >= capacity) return -1;
  const int task = etc_load_relaxed(ring + slot);
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
  return task;
}

// Publish ``task`` in the next free slot of the ring (release). The lanes of a warp that push
// together claim their slots with one atomic.
__device__ __forceinline__ void etc_push(int* head_tail, int* ring, int task, int capacity,
                                         int* status) {
  const unsigned active = __activemask();
  unsigned lane;
  asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
  const int leader = __ffs(active) - 1;
  int base = 0;
  if ((int)lane == leader) base = atomicAdd(head_tail + 1, __popc(active));
  const int slot = __shfl_sync(active, base, leader) + __popc(active & ((1u << lane) - 1u));
  if (slot >= capacity) {
    etc_record_stop(status, 3, task, slot, capacity);
    return;
  }
  asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(ring + slot), "r"(task) : "memory");
}

// A consumer entry of ``first_consumer`` with this bit: the dispatched task is the consumer's
// only producer (``DynamicPlan.first_consumers``).
#define ETC_ONLY_PRODUCER (1 << 30)

// One producer of ``consumer`` was dispatched: the last one pushes it, or, with ``may_hold``,
// keeps it in ``held[0]`` for its own CTA to run next (it never enters the ring, so the count
// of tasks the ring will hold drops by one). A consumer marked ``ETC_ONLY_PRODUCER`` is ready
// now: no count-down, unless ``count_all`` (a launch on smaller sizes, where a pending count
// can be out of reach); held, it has ``held[1]`` set: everything it waits on was done by the
// holding CTA.
__device__ __forceinline__ void etc_count_down(int* pending, int consumer, int* held,
                                               int may_hold, int* head_tail, int* ring,
                                               int capacity, int* status, int count_all) {
  const int only = consumer & ETC_ONLY_PRODUCER;
  const int task = consumer & ~ETC_ONLY_PRODUCER;
  if ((!only || count_all) && atomicSub(pending + task, 1) != 1) return;
  if (may_hold) {
    held[0] = task;
    held[1] = only != 0;
    atomicAdd(head_tail + 2, -1);
    return;
  }
  etc_push(head_tail, ring, task, capacity, status);
}

// Claim ``count`` consecutive slots of the ready ring, the first for ``task``: where they
// start, or -1 where fewer are left (the stop names ``task`` and the last slot needed).
__device__ __forceinline__ int etc_claim_slots(int* head_tail, int count, int task, int capacity,
                                               int* status) {
  const int base = atomicAdd(head_tail + 1, count);
  if (base + count <= capacity) return base;
  etc_record_stop(status, 3, task, base + count - 1, capacity);
  return -1;
}

// Publish the run of tasks ``first`` .. ``first + count - 1``: one atomic claims their slots,
// and one fence before the (strong, relaxed) stores makes each of them a release of what the
// caller's CTA wrote. Called by one thread.
__device__ __forceinline__ void etc_push_range(int* head_tail, int* ring, int first, int count,
                                               int capacity, int* status) {
  if (count <= 0) return;
  const int base = etc_claim_slots(head_tail, count, first, capacity, status);
  if (base < 0) return;
  __threadfence();
  for (int k = 0; k < count; ++k) {
    asm volatile("st.relaxed.gpu.global.s32 [%0], %1;" ::"l"(ring + base + k), "r"(first + k)
                 : "memory");
  }
}

// Deferred runs: a CTA that releases long runs of tasks (a trigger element over every used tile)
// lists them in shared memory, ``runs`` = [n, base, total, first[ETC_RUN_SLOTS],
// count[ETC_RUN_SLOTS]], and publishes them together (``etc_claim_runs``, then every thread
// ``etc_store_runs``): one thread's stores would come out one slot at a time while the CTAs
// waiting on those slots poll them. A run past the list's slots is pushed at once.
#define ETC_RUN_SLOTS 16

__device__ __forceinline__ void etc_defer_range(int* runs, int first, int count, int* head_tail,
                                                int* ring, int capacity, int* status) {
  if (count <= 0) return;
  const int k = atomicAdd(runs, 1);
  if (k < ETC_RUN_SLOTS) {
    runs[3 + k] = first;
    runs[3 + ETC_RUN_SLOTS + k] = count;
    return;
  }
  etc_push_range(head_tail, ring, first, count, capacity, status);
}

// Thread 0, after a barrier over the CTA's ``etc_defer_range``: claims the slots of every listed
// run with one atomic; ``runs[1]`` and ``runs[2]`` are then where they start and how many; the
// list is empty again.
__device__ __forceinline__ void etc_claim_runs(int* runs, int* head_tail, int capacity,
                                               int* status) {
  const int n = min(runs[0], ETC_RUN_SLOTS);
  int total = 0;
  for (int k = 0; k < n; ++k) total += runs[3 + ETC_RUN_SLOTS + k];
  runs[0] = 0;
  runs[2] = total;
  if (total == 0) return;
  runs[1] = etc_claim_slots(head_tail, total, runs[3], capacity, status);
  if (runs[1] < 0) runs[2] = 0;
}

// Every thread, after a barrier over ``etc_claim_runs``: writes its share of the claimed slots,
// consecutive slots by consecutive threads. The fence makes each store a release of what the
// CTA wrote before the barrier.
__device__ __forceinline__ void etc_store_runs(const int* runs, int* ring, int thread,
                                               int threads) {
  const int total = runs[2];
  if (thread >= total) return;
  __threadfence();
  int run = 0, before = 0;
  for (int k = thread; k < total; k += threads) {
    while (k - before >= runs[3 + ETC_RUN_SLOTS + run]) {
      before += runs[3 + ETC_RUN_SLOTS + run];
      ++run;
    }
    asm volatile("st.relaxed.gpu.global.s32 [%0], %1;"
                 ::"l"(ring + runs[1] + k), "r"(runs[3 + run] + k - before) : "memory");
  }
}

// One task a whole call waits for was dispatched (or skipped): the last one pushes the call's
// tasks ``first`` .. ``first + count - 1``, claiming their slots at once. Called by one thread.
__device__ __forceinline__ void etc_count_down_call(int* pending, int first, int count,
                                                    int* head_tail, int* ring, int capacity,
                                                    int* status) {
  if (atomicSub(pending, 1) != 1) return;
  etc_push_range(head_tail, ring, first, count, capacity, status);
}

// etc_count_down_call by the first ``lanes`` lanes of one warp, at a dispatch: lane 0 counts
// down and, the last, claims the slots, which the lanes then fill side by side. No release: a
// late call's tasks wait on their events before their bodies.
__device__ __forceinline__ void etc_count_down_call_warp(int* pending, int first, int count,
                                                         int* head_tail, int* ring,
                                                         int capacity, int* status, int lanes) {
  const unsigned mask = lanes >= 32 ? 0xffffffffu : (1u << lanes) - 1u;
  unsigned lane;
  asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
  int base = -1;
  if (lane == 0 && atomicSub(pending, 1) == 1 && count > 0) {
    base = etc_claim_slots(head_tail, count, first, capacity, status);
  }
  base = __shfl_sync(mask, base, 0);
  if (base < 0) return;
  for (int k = (int)lane; k < count; k += lanes) {
    asm volatile("st.relaxed.gpu.global.s32 [%0], %1;" ::"l"(ring + base + k), "r"(first + k)
                 : "memory");
  }
}

// One count of a trigger element released at dispatch (a notifier dispatched, or the
// arming): 1 for the last, which pushes the tasks the element releases. No release: the tasks
// wait on the element.
__device__ __forceinline__ int etc_count_down_release(int* pending) {
  return atomicSub(pending, 1) == 1;
}

// The next task of the ready ring if one is there now: the task, -1 once every task the ring
// will hold is taken, -3 if none is ready now. A CTA that also has a static queue must not
// block on the ring: it claims a slot only when a push has reached past the head, and keeps
// its claim in ``*claimed`` (-1: none) until the slot's task is published. Called by one
// thread; the caller bounds how long it finds nothing (``etc_idle``).
__device__ __noinline__ int etc_try_pop(int* head_tail, const int* ring, int* claimed) {
  if (*claimed < 0) {
    const int head = etc_load_relaxed(head_tail);
    if (head >= etc_load_relaxed(head_tail + 2)) return -1;
    if (head >= etc_load_relaxed(head_tail + 1)) return -3;
    *claimed = atomicAdd(head_tail, 1);
  }
  if (*claimed >= etc_load_relaxed(head_tail + 2)) return -1;  // no task will fill it
  const int task = etc_load_acquire(ring + *claimed);
  if (task < 0) return -3;
  *claimed = -1;
  return task;
}

// Task timeline (KernelOptions.profile): one row of ETC_TIMELINE_WORDS int64 per task, written
// by thread 0 of the CTA that runs it: [0] start and [1] end on the global nanosecond timer
// (comparable across SMs), [2] start, [3] waits done and [4] end on the SM's cycle counter
// (precise within a task), [5] the CTA (high 32 bits) and its SM (low 32 bits): several
// persistent CTAs may share an SM; [6] the body done (the CTA's threads past it), before the
// notifies and what they start (pushes, arming, completions), on the cycle counter. A task
// that never ran keeps zeros. A row per CTA follows the task rows (etc_trace_cta_ready).
#define ETC_TIMELINE_WORDS 7

// Word [5] of a row: the CTA (high 32 bits) and its SM (low 32 bits).
__device__ __forceinline__ int64_t etc_trace_place() {
  unsigned smid;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  return ((int64_t)blockIdx.x << 32) | smid;
}

__device__ __forceinline__ void etc_trace_start(int64_t* row) {
  row[0] = (int64_t)etc_globaltimer_ns();
  row[2] = clock64();
  row[5] = etc_trace_place();
}

__device__ __forceinline__ void etc_trace_waited(int64_t* row) { row[3] = clock64(); }

__device__ __forceinline__ void etc_trace_body_done(int64_t* row) { row[6] = clock64(); }

__device__ __forceinline__ void etc_trace_end(int64_t* row) {
  row[4] = clock64();
  row[1] = (int64_t)etc_globaltimer_ns();
}

// A CTA's row, after the task rows: [0] it entered the kernel, [1] it passed the prologue (the
// grid-wide barrier and any arming at launch), [2] it left, on the global nanosecond timer;
// [5] its place, as a task row's. Thread 0 keeps the entry time until the prologue, whose
// clearing of the timeline would overwrite it, is over.
__device__ __forceinline__ int64_t etc_trace_now() { return (int64_t)etc_globaltimer_ns(); }

__device__ __forceinline__ void etc_trace_cta_ready(int64_t* row, int64_t entered) {
  row[0] = entered;
  row[1] = (int64_t)etc_globaltimer_ns();
  row[5] = etc_trace_place();
}

__device__ __forceinline__ void etc_trace_cta_left(int64_t* row) {
  row[2] = (int64_t)etc_globaltimer_ns();
}

// 1 if ``counter`` is complete now (acquire), else 0: a wait that does not block.
__device__ __forceinline__ int etc_poll(const int* counter) {
  return etc_load_acquire(counter) <= 0;
}

// A CTA found nothing to run: 1 if the grid is stopping, or if it has found nothing for longer
// than the limit (then it records kind 7 with its next queued task, -1 if none). ``since``:
// when the idle stretch began, 0 while the CTA is busy.
__device__ __noinline__ int etc_idle(uint64_t* since, int* status, int task,
                                     long long limit_ns) {
  if (etc_load_relaxed(status) != 0) return 1;
  const unsigned long long now = etc_globaltimer_ns();
  if (*since == 0) {
    *since = now;
  } else if ((long long)(now - *since) > limit_ns) {
    etc_record_stop(status, 7, task, -1, 0);
    return 1;
  }
  __nanosleep(32);
  return 0;
}

// Release marks are bits, 32 tasks a word: a trigger that releases a run of tasks sets them
// with one atomic per word, and the skip pass reads a word per 32 tasks.

// Mark tasks ``first`` .. ``first + count - 1`` released (kind 6 if a task already was).
// Thread ``lane`` of ``lanes`` takes every lanes-th word of the run.
__device__ __forceinline__ void etc_mark_range(int* marks, int first, int count, int lane,
                                               int lanes, int* status) {
  if (count <= 0) return;
  const int last = first + count - 1;
  for (int w = (first >> 5) + lane; w <= (last >> 5); w += lanes) {
    const int lo = max(first, w << 5) & 31, hi = min(last, (w << 5) + 31) & 31;
    const unsigned mask = (0xffffffffu >> (31 - hi)) & (0xffffffffu << lo);
    const unsigned twice = atomicOr(reinterpret_cast<unsigned*>(marks) + w, mask) & mask;
    if (twice) {
      const int task = (w << 5) + __ffs(twice) - 1;
      etc_record_stop(status, 6, task, task, 0);
    }
  }
}

// One more (a shared-memory tally of one CTA's threads).
__device__ __forceinline__ void etc_count(int* tally) { atomicAdd(tally, 1); }

// The release marks of tasks 32 * word .. 32 * word + 31, one bit each.
__device__ __forceinline__ int etc_release_word(const int* marks, int word) {
  return etc_load_relaxed(marks + word);
}

// A decrement (release, then acquire) that says whether it completed the element: the caller
// then releases the tasks its trigger maps give, having seen every notifier's writes.
__device__ __forceinline__ int etc_notify_last(int* counter) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], -1;"
               : "=r"(old) : "l"(counter) : "memory");
  return old == 1;
}

#define ETC_ARM_BIAS (1 << 29)

// Count down a completion counter (release, then acquire): 1 for the caller that took it to
// zero, which then sees every write ordered before each decrement.
__device__ __forceinline__ int etc_complete(int* counter) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], -1;"
               : "=r"(old) : "l"(counter) : "memory");
  return old == 1;
}

// Add ``value`` to a counter, unordered (arming adds counts, then a fence and a barrier).
__device__ __forceinline__ void etc_add(int* counter, int value) {
  asm volatile("red.relaxed.gpu.global.add.s32 [%0], %1;" ::"l"(counter), "r"(value) : "memory");
}

// Remove the arming bias; returns the counter's new value (0: the element is complete).
__device__ __forceinline__ int etc_unbias(int* counter) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;"
               : "=r"(old) : "l"(counter), "r"(-ETC_ARM_BIAS) : "memory");
  return old - ETC_ARM_BIAS;
}

// 1 if 0 <= value < size; otherwise records why the grid stops (kind 4) and returns 0.
__device__ __forceinline__ int etc_in_range(int value, int size, int* status, int task,
                                            int edge) {
  if (value >= 0 && value < size) return 1;
  etc_record_stop(status, 4, task, value, edge);
  return 0;
}

// A tile's ``input_check``: 1 if 0 <= value < size; otherwise records which check of which task
// failed and the value (kind 8) and returns 0, so that the tile leaves the value unused.
__device__ __forceinline__ int etc_input_check(int value, int size, int* status, int task,
                                               int check) {
  if (value >= 0 && value < size) return 1;
  etc_record_stop_inline(status, 8, task, value, check);
  return 0;
}

// One release decrement: the CTA's writes (ordered before by a barrier) happen before it.
__device__ __forceinline__ void etc_notify(int* counter) {
  asm volatile("red.release.gpu.global.add.s32 [%0], -1;" ::"l"(counter) : "memory");
}

// A decrement after ``etc_fence``: the fence made it a release (one fence for every notify of
// a task, and an acquire for the relaxed loads before it).
__device__ __forceinline__ void etc_notify_fenced(int* counter) {
  asm volatile("red.relaxed.gpu.global.add.s32 [%0], -1;" ::"l"(counter) : "memory");
}

__device__ __forceinline__ void etc_fence() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

// 1 if ``counter`` looks complete (a relaxed load: an ``etc_fence`` after it acquires).
__device__ __forceinline__ int etc_peek_complete(const int* counter) {
  return etc_load_relaxed(counter) <= 0;
}

#endif  // ETC_TVM_RUNTIME_CUH_
