"""16-byte copies between tensors and registers, spelled out.

Inside a megakernel on symbolic shapes TVM's CUDA codegen turns a vectorized bf16x8 access
into eight scalar ones that it packs wrongly (a ``make_uint4`` of eight values, which nvcc
refuses); a copy through ``uint4`` pointers is one 16-byte load or store whatever the shapes.
"""
from tvm.script import tirx as T

COPY_16_BYTES = """
__device__ __forceinline__ void etc_copy_16_bytes(void* dst, const void* src) {
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
}
"""


@T.inline
def copy_16_bytes(dst, src):
    """Copy 16 bytes from pointer ``src`` to pointer ``dst`` (``buf.ptr_to([...])``), both
    16-byte aligned."""
    T.cuda.func_call("etc_copy_16_bytes", dst, src, source_code=COPY_16_BYTES)
