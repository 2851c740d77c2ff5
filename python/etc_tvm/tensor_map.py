"""Tensor maps: what a device function's TMA loads (``cp.async.bulk.tensor``) read through.

A TMA load names its global tensor by a ``CUtensorMap``, a 128-byte descriptor that the CUDA
driver encodes on the host (``cuTensorMapEncodeTiled``) from the tensor's address, sizes and
strides and the box one load copies. A device function sees only buffers, and the same tile
runs in persistent kernels and grid launches on the tensors of each call, so it declares the
maps it needs and the kernel that runs it encodes them::

    a_map = TensorMap("A", box=(64, 64))

    @T.prim_func(check_well_formed=False)  # a_map.var is free until a kernel binds it
    def tile(i: T.int32, A: T.Buffer((M, K), "bfloat16"), ...):
        ... T.ptx["cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"](
                dst, T.address_of(a_map.var), k0, i * 64, barrier) ...

    tile = device_func(tile, tensor_maps=[a_map])

Every kernel (``tir_sched``) encodes one map per (call, declared map) in its host part, before
the device code (``tirx.tensormap_encode_tiled`` in TVM 0.27, whose CUDA codegen passes the
map as a ``const __grid_constant__ CUtensorMap`` parameter), and the inliner puts that map's
variable in place of ``var``. Coordinates of a load are (column, row): innermost first, in
elements.

A load's shared destination must be 128-byte aligned (1024 with the 128-byte swizzle). The
kernels' shared memory promises 64 bytes (a persistent kernel's arena starts where the CTA's
static shared variables end), so a tile aligns its destination at run time, as
``tiles.wgmma_gemm.SwizzledRing`` does; a misaligned one stops the kernel with
``cudaErrorMisalignedAddress``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import tvm
from tvm import tirx

from .errors import EtcError

SWIZZLES = {0: 0, 32: 1, 64: 2, 128: 3}  # bytes -> CUtensorMapSwizzle


@dataclass(frozen=True, eq=False)
class TensorMap:
    """A 2-D tiled tensor map over a device function's buffer parameter ``param`` (row-major;
    a parameter of more dimensions is seen as rows of its last one, the product of the others
    giving the row count): each load copies a ``box`` (rows, columns) of elements, ``swizzle``
    bytes wide in shared memory (0: unswizzled rows). ``var`` stands for the map in the device
    function's body."""

    param: str
    box: tuple[int, int]
    swizzle: int = 0
    var: tirx.Var = field(init=False)

    def __post_init__(self):
        rows, cols = self.box
        if self.swizzle not in SWIZZLES:
            raise EtcError(f"tensor map of {self.param}: swizzle must be one of "
                           f"{sorted(SWIZZLES)} bytes, got {self.swizzle}")
        if not (0 < rows <= 256 and 0 < cols <= 256):
            raise EtcError(f"tensor map of {self.param}: a box is 1..256 elements a side, "
                           f"got {self.box}")
        object.__setattr__(self, "var", tirx.Var(f"{self.param}_map",
                                                 tvm.ir.PointerType(tirx.TensorMapType())))

    def as_attr(self) -> list:
        """The map as a PrimFunc attribute (``etc.tensor_maps``), so that a device function
        rebuilt from a module (``GraphFunc.from_module``) keeps it."""
        return [self.param, self.box[0], self.box[1], self.swizzle]

    @staticmethod
    def from_attr(attr) -> "TensorMap":
        """The map of ``as_attr``; its ``var`` is found in the body by name (``inline``)."""
        return TensorMap(str(attr[0]), box=(int(attr[1]), int(attr[2])), swizzle=int(attr[3]))

    def check(self, shape, dtype: str, where: str) -> None:
        """Reject a parameter the map cannot describe: fewer than 2 dimensions, or a box row
        that TMA cannot copy (a multiple of 16 bytes, at most the swizzle width)."""
        if len(shape) < 2:
            raise EtcError(f"{where}: tensor map of {self.param} needs a tensor of 2 or more "
                           f"dimensions, {self.param} has shape {list(shape)}")
        row_bytes = self.box[1] * tvm.DataType(dtype).bits // 8
        if row_bytes % 16:
            raise EtcError(f"{where}: tensor map of {self.param}: a box row is {row_bytes} "
                           "bytes; TMA copies rows of multiples of 16")
        if self.swizzle and row_bytes > self.swizzle:
            raise EtcError(f"{where}: tensor map of {self.param}: a box row of {row_bytes} "
                           f"bytes is wider than its {self.swizzle}-byte swizzle")

    def encode(self, buffer: tirx.Buffer, name: str) -> tuple[tirx.Var, list[tirx.Stmt]]:
        """A fresh map variable ``name`` over ``buffer`` and the host statements that encode
        it (sizes read from the buffer's shape, so symbolic shapes are encoded per launch)."""
        *lead, cols = (tirx.Cast("int64", d) for d in buffer.shape)
        rows = functools.reduce(lambda a, b: a * b, lead)
        elem = tvm.DataType(buffer.dtype).bits // 8
        var = tirx.Var(name, self.var.ty)
        one = tirx.IntImm("int32", 1)
        encode = tirx.tensormap_encode_tiled(
            var, buffer.data, cols, rows, cols * tirx.IntImm("int64", elem),
            tirx.IntImm("int32", self.box[1]), tirx.IntImm("int32", self.box[0]), one, one,
            descriptor_dtype=buffer.dtype, rank=2, swizzle=SWIZZLES[self.swizzle])
        return var, [tirx.Bind(var, tirx.tvm_stack_alloca("tensormap", 1)),
                     tirx.Evaluate(encode)]
