// etc_tvm device runtime, multi-GPU part: appended to etc_runtime.cuh in kernels of world size
// above 1 only. It lives in its own file because TVM 0.27 compiles a module the NVSHMEM way
// (relocatable device code, nvlink with libnvshmem_device.a, a cubin) whenever the source
// contains the text "#include <nvshmem.h>": a kernel of one rank must not carry it.
//
// Protocol across ranks (docs/distributed.md): waits stay local, on counters in the symmetric
// heap; a notify of an element another rank owns is an NVSHMEM atomic on the owner's copy of
// the counter array, after a fence that orders the CTA's earlier puts to that rank before it.
// Remote atomics are performed by another GPU, so local waits on such counters acquire at
// system scope.
#ifndef ETC_TVM_RUNTIME_NVSHMEM_CUH_
#define ETC_TVM_RUNTIME_NVSHMEM_CUH_

// A kernel includes these first, through TVM's NVSHMEM intrinsics (its barrier across ranks):
// included after TVM's preamble, whose `#define uint`, the NVSHMEM headers do not parse.
#include <nvshmem.h>
#include <nvshmemx.h>

// etc_wait on a counter that other GPUs decrement: system-scope loads, the same bound and
// stop record. Called by one thread.
__device__ __noinline__ int etc_wait_sys(const int* counter, int* status, int task, int element,
                                         long long limit_ns) {
  return etc_wait_at<kSys>(counter, status, task, element, limit_ns);
}

// ``ptr`` (symmetric) in rank ``pe``'s copy, for plain loads and stores over NVLink: a task
// writes a symmetric output on the rank it notifies. Ranks of one node: across nodes NVSHMEM
// has no such address, and the kernel stops rather than store through a null pointer.
template <typename T>
__device__ __forceinline__ T* etc_peer(T* ptr, int pe) {
  T* peer = static_cast<T*>(nvshmem_ptr(ptr, pe));
  if (peer == nullptr) __trap();
  return peer;
}

// One notify of ``counter`` (a symmetric address) on rank ``pe``. Called by one thread, after
// the CTA's barrier: the system-scope fence is cumulative over the CTA's stores to ``pe``'s
// memory that the barrier ordered before it, and nvshmem_fence orders its puts.
__device__ __forceinline__ void etc_notify_remote(int* counter, int pe) {
  __threadfence_system();
  nvshmem_fence();
  nvshmem_int_atomic_add(counter, -1, pe);
}

#endif  // ETC_TVM_RUNTIME_NVSHMEM_CUH_
