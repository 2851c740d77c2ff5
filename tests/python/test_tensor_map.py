"""Tensor maps declared by device functions: checked when declared, encoded on the host by
every kernel that runs the tile (one ``cuTensorMapEncodeTiled`` a map), and passed to the
device code as a ``__grid_constant__ CUtensorMap`` parameter. The tile runs on the GPU in
test_tensor_map_gpu.py."""
import pytest
import tvm
from tvm import tirx
from tvm.script import tirx as T

from etc_tvm import device_func
from etc_tvm.build import build
from etc_tvm.errors import EtcError
from etc_tvm.tensor_map import TensorMap

from tma_tiles import tma_copy


@pytest.mark.parametrize("strategy", ["static", "dynamic", "unfused"])
def test_kernels_encode_the_map_on_the_host_and_take_it_as_a_grid_constant(strategy):
    compiled = build(tma_copy, {"R": 256}, strategy=strategy, num_sms=4)
    device = compiled.cuda_source()
    assert "const __grid_constant__ CUtensorMap" in device
    assert "cp_async_bulk_tensor" in device
    assert "runtime.cuTensorMapEncodeTiled" in compiled.host_source()


def bf16_tile(maps, shape=("M", 64)):
    M = tirx.Var("M", "int32")
    dims = [M if d == "M" else d for d in shape]

    @T.prim_func
    def tile(i: T.int32, A: T.Buffer(dims, "bfloat16")):
        T.device_entry()
        tx = T.thread_id([32])  # noqa: F841

    return device_func(tile, tensor_maps=maps)


def test_a_map_names_a_tensor_parameter():
    with pytest.raises(EtcError, match=r"tensor map of 'X', which is not one of its tensor "
                                       r"parameters \['A'\]"):
        bf16_tile([TensorMap("X", box=(64, 64))])


def test_a_map_needs_a_tensor_of_rows():
    with pytest.raises(EtcError, match="needs a tensor of 2 or more dimensions"):
        bf16_tile([TensorMap("A", box=(64, 64))], shape=("M",))


@pytest.mark.parametrize("box, swizzle, match", [
    ((64, 4), 0, "a box row is 8 bytes; TMA copies rows of multiples of 16"),
    ((64, 128), 128, "a box row of 256 bytes is wider than its 128-byte swizzle"),
])
def test_box_rows_tma_cannot_copy_are_refused(box, swizzle, match):
    with pytest.raises(EtcError, match=match):
        bf16_tile([TensorMap("A", box=box, swizzle=swizzle)])


@pytest.mark.parametrize("box, swizzle, match", [
    ((0, 64), 0, "a box is 1..256 elements a side"),
    ((64, 64), 16, r"swizzle must be one of \[0, 32, 64, 128\] bytes"),
])
def test_malformed_maps_are_refused(box, swizzle, match):
    with pytest.raises(EtcError, match=match):
        TensorMap("A", box=box, swizzle=swizzle)


def test_a_map_sees_leading_dimensions_as_rows():
    """A (R, M, K) tensor is encoded as R*M rows of K: (K, R*M) innermost first, rows of K
    elements apart."""
    R, M, K = (tirx.Var(d, "int32") for d in "RMK")
    buffer = tirx.decl_buffer((R, M, K), "bfloat16", "G")
    var, (bind, encode) = TensorMap("G", box=(128, 64), swizzle=128).encode(buffer, "G_map")
    assert bind.var.same_as(var)
    cols, rows, stride = encode.value.args[2:5]

    def wide(x):
        return tirx.Cast("int64", x)

    tvm.ir.assert_structural_equal(cols, wide(K))
    tvm.ir.assert_structural_equal(rows, wide(R) * wide(M))
    tvm.ir.assert_structural_equal(stride, wide(K) * tirx.IntImm("int64", 2))
