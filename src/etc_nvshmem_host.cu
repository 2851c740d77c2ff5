// etc_tvm host runtime, multi-GPU part: what one process of a multi-rank run asks of NVSHMEM,
// as C functions that etc_tvm.distributed calls through ctypes. The TVM runtime of the PyPI
// wheel is built without NVSHMEM, and NVSHMEM's initialisation is an inline function of its
// headers, so it cannot be reached from Python without a compiled piece.
//
// Compiled on first use by etc_tvm.distributed (nvcc, linked with the libnvshmem_host of the
// NVSHMEM whose libnvshmem_device the rank kernels link): one NVSHMEM per process.
#include <cuda.h>
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstring>

extern "C" {

int etc_nvshmem_unique_id_size() { return sizeof(nvshmemx_uniqueid_t); }

// Rank 0 draws the id, every rank passes the same bytes to etc_nvshmem_init.
int etc_nvshmem_unique_id(void* out) {
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  const int status = nvshmemx_get_uniqueid(&id);
  std::memcpy(out, &id, sizeof id);
  return status;
}

// Collective over the ranks; the process's CUDA device must be set first.
int etc_nvshmem_init(int rank, int world_size, const void* unique_id) {
  nvshmemx_uniqueid_t id;
  std::memcpy(&id, unique_id, sizeof id);
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  const int status = nvshmemx_set_attr_uniqueid_args(rank, world_size, &id, &attr);
  if (status != 0) return status;
  // The kernels live in modules of their own (nvshmemx_cumodule_init), so the host library's
  // initialisation is all this process needs; nvshmemx_init_attr would also need the device
  // library linked here.
  return nvshmemx_hostlib_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr);
}

int etc_nvshmem_my_pe() { return nvshmem_my_pe(); }
int etc_nvshmem_n_pes() { return nvshmem_n_pes(); }

// Collective: every rank allocates the same sizes in the same order.
void* etc_nvshmem_malloc(size_t bytes) { return nvshmem_malloc(bytes); }
void etc_nvshmem_free(void* ptr) { nvshmem_free(ptr); }

void etc_nvshmem_barrier_all() { nvshmem_barrier_all(); }
void etc_nvshmem_finalize() { nvshmemx_hostlib_finalize(); }

// A loaded module that links NVSHMEM's device library needs its device state set before its
// first launch; a module without it is left alone. Returns 0, or NVSHMEM's error.
// (The driver's cuModuleGetGlobal is reached through the runtime: no libcuda at link time.)
int etc_nvshmem_module_init(void* module) {
  using GetGlobal = CUresult (*)(CUdeviceptr*, size_t*, CUmodule, const char*);
  void* entry = nullptr;
  cudaDriverEntryPointQueryResult found;
  if (cudaGetDriverEntryPointByVersion("cuModuleGetGlobal", &entry, 12000, cudaEnableDefault,
                                       &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    return -1;
  }
  CUdeviceptr ptr;
  size_t bytes;
  if (reinterpret_cast<GetGlobal>(entry)(&ptr, &bytes, static_cast<CUmodule>(module),
                                         "nvshmemi_device_state_d") != CUDA_SUCCESS) {
    return 0;
  }
  return nvshmemx_cumodule_init(static_cast<CUmodule>(module));
}

}  // extern "C"
