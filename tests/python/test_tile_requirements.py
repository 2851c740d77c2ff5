"""The tiles' ``requires``: each tile alone in a graph function builds for dims that keep to
them, and dims that would leave rows, columns or elements uncomputed, or reach past a tensor,
are refused where the graph is instantiated, naming the tile and what it takes; on symbolic
dims they are left to the launch."""
import inspect
import re

import pytest
from tvm import tirx

from etc_tvm import GraphError, Tensor, call_device, graph_func
from etc_tvm.task_graph import TaskGraph
from etc_tvm.tiles import attention, elementwise, gemv, moe, norm, reduction, tp


def alone(tile, inputs, outputs):
    """``tile`` as the one call of a graph function, a grid of one task: ``inputs`` are the
    shapes of its input tensors (names are the graph's symbolic dims), ``outputs(dims)`` those
    of its outputs, from those dims."""
    params = tile.buffer_params

    def one_call(*args):
        dims = {d: arg.shape[k] for shape, arg in zip(inputs, args)
                for k, d in enumerate(shape) if isinstance(d, str)}
        out = [Tensor(shape, p.dtype) for shape, p in zip(outputs(dims), params[len(inputs):])]
        return call_device(tile, tile_num=(1,) * tile.num_coords, args=list(args), out=out)

    one_call.__signature__ = inspect.Signature([
        inspect.Parameter(p.name, inspect.Parameter.POSITIONAL_ONLY,
                          annotation=Tensor(shape, p.dtype))
        for shape, p in zip(inputs, params)])
    return graph_func(one_call)


# name -> (tile, input shapes, output shapes from the dims, dims that keep to its requires)
TILES = {
    "gemv": (gemv.make_gemv_tile(128), [("M", "K"), ("K", "N")],
             lambda d: [(d["M"], d["N"])], {"M": 16, "K": 256, "N": 256}),
    "gemv_split": (gemv.make_gemv_tile(128, split_k=4), [("M", "K"), ("K", "N")],
                   lambda d: [(4, d["M"], d["N"])], {"M": 3, "K": 512, "N": 128}),
    "gemv_sum": (gemv.make_gemv_sum_tile(4, cols=128), [(4, "M", "N")],
                 lambda d: [(d["M"], d["N"])], {"M": 3, "N": 384}),
    "activation": (elementwise.make_activation_tile("relu", "bfloat16"), [("M", "N")],
                   lambda d: [(d["M"], d["N"])], {"M": 128, "N": 192}),
    "activation_sum": (elementwise.make_activation_tile("identity", "float32", rows=16,
                                                        split_k=4),
                       [(4, "M", "N")], lambda d: [(d["M"], d["N"])], {"M": 32, "N": 64}),
    "silu_mul": (elementwise.make_silu_mul_tile(128), [("M", "F2")],
                 lambda d: [(d["M"], d["F2"] // 2)], {"M": 3, "F2": 512}),
    "residual_add": (elementwise.make_residual_add_tile(128), [("M", "N"), ("M", "N")],
                     lambda d: [(d["M"], d["N"])], {"M": 3, "N": 384}),
    "rmsnorm": (norm.make_rmsnorm_tile(), [("M", "H"), ("H",)], lambda d: [(d["M"], d["H"])],
                {"M": 3, "H": 1032}),
    "row_sum": (reduction.make_row_sum_tile(), [("M", "N")], lambda d: [(d["M"],)],
                {"M": 128, "N": 200}),
    "partial_row_sum": (reduction.make_partial_row_sum_tile(), [("M", "N")],
                        lambda d: [(d["M"], 3)], {"M": 128, "N": 192}),
    "decode_split": (attention.make_decode_split_tile(256),
                     [("B", 32, 128), ("B", 4, "L", 128), ("B", 4, "L", 128), ("B",)],
                     lambda d: [(d["B"], 4, 4, 8, 128), (d["B"], 4, 4, 8)],
                     {"B": 2, "L": 1000}),
    "gate_up": (moe.make_gate_up_tile(256, 128, 8),
                [("T", 256), (8, 256, 256), ("rows",), ("tiles",), (9,)],
                lambda d: [(d["rows"], 128)], {"T": 5, "rows": 48, "tiles": 3}),
    "down": (moe.make_down_tile(128, 256, 8),
             [("rows", 128), (8, 128, 256), ("rows",), ("tiles",), (9,)],
             lambda d: [(d["rows"], 256)], {"rows": 48, "tiles": 3}),
    "gemm_scatter": (tp.make_gemm_scatter_tile(), [("M", "K"), ("K", "N")],
                     lambda d: [(2, d["M"] // 2, d["N"])], {"M": 256, "K": 128, "N": 256}),
    "partial_sum": (tp.make_partial_sum_tile(), [("R", "Q", "N")],
                    lambda d: [(d["Q"], d["N"])], {"R": 2, "Q": 256, "N": 128}),
    "gather_rows": (tp.make_gather_rows_tile(), [("M", "K")],
                    lambda d: [(2, d["M"], d["K"])], {"M": 256, "K": 200}),
    "ring_gemm": (tp.make_ring_gemm_tile(), [("R", "M", "K"), ("K", "N")],
                  lambda d: [(2 * d["M"], d["N"])], {"R": 2, "M": 128, "K": 128, "N": 128}),
}

# (tile, the dims that change from its TILES entry, what the tile takes)
BROKEN = [
    ("gemv", {"M": 0}, "M of 1 to 16"),
    ("gemv", {"M": 17}, "M of 1 to 16"),
    ("gemv", {"N": 192}, "N a multiple of 128"),
    ("gemv", {"K": 200}, "K a multiple of 128"),
    ("gemv_split", {"K": 448}, "K a multiple of 128"),
    ("gemv_sum", {"N": 200}, "N a multiple of 128"),
    ("activation", {"M": 96}, "M a multiple of 64"),
    ("activation", {"N": 100}, "N a multiple of 64"),
    ("activation_sum", {"M": 40}, "M a multiple of 16"),
    ("silu_mul", {"F2": 384}, "F a multiple of 128"),
    ("silu_mul", {"F2": 513}, "H twice as wide as Y"),
    ("residual_add", {"N": 200}, "N a multiple of 128"),
    ("rmsnorm", {"H": 1028}, "H a multiple of 8"),
    ("row_sum", {"M": 100}, "M a multiple of 64"),
    ("partial_row_sum", {"M": 100}, "M a multiple of 64"),
    ("partial_row_sum", {"N": 200}, "N a multiple of 64"),
    ("partial_row_sum", {"N": 256}, "P of N / 64 columns"),
    ("decode_split", {"L": 1100}, "L at most S x 256"),
    ("gate_up", {"rows": 40}, "rows = 16 x tiles"),
    ("down", {"rows": 64}, "rows = 16 x tiles"),
    ("gemm_scatter", {"M": 384}, "Q a multiple of 128"),
    ("gemm_scatter", {"M": 257}, "M = R x Q"),
    ("gemm_scatter", {"N": 200}, "N a multiple of 128"),
    ("gemm_scatter", {"K": 96}, "K a multiple of 64"),
    ("partial_sum", {"Q": 192}, "Q a multiple of 128"),
    ("partial_sum", {"N": 200}, "N a multiple of 128"),
    ("gather_rows", {"M": 200}, "M a multiple of 128"),
    ("gather_rows", {"K": 100}, "K a multiple of 8"),
    ("ring_gemm", {"M": 192}, "M a multiple of 128"),
    ("ring_gemm", {"R": 3}, "Q = R x M"),
    ("ring_gemm", {"N": 200}, "N a multiple of 128"),
    ("ring_gemm", {"K": 96}, "K a multiple of 64"),
]


@pytest.mark.parametrize("name", sorted(TILES))
def test_a_tile_builds_for_dims_that_keep_to_its_requires(name):
    tile, inputs, outputs, dims = TILES[name]
    assert TaskGraph.build(alone(tile, inputs, outputs), dims).num_tasks == 1


@pytest.mark.parametrize("name, change, what", BROKEN,
                         ids=[name + "".join(f"-{d}{n}" for d, n in change.items())
                              for name, change, _ in BROKEN])
def test_a_tile_refuses_dims_that_break_its_requires(name, change, what):
    tile, inputs, outputs, dims = TILES[name]
    with pytest.raises(GraphError, match=rf"{re.escape(tile.name)} takes "
                                         rf"{re.escape(what)}, got "):
        TaskGraph.build(alone(tile, inputs, outputs), {**dims, **change})


@pytest.mark.parametrize("name", sorted(TILES))
def test_a_tile_leaves_its_requires_on_symbolic_dims_to_the_launch(name):
    """A kernel built on a graph's symbolic (int64) dims asserts at launch what they leave
    open: each requirement simplifies to a condition on them."""
    tile, inputs, outputs, _ = TILES[name]
    dims = {d: tirx.Var(d, "int64") for shape in inputs for d in shape if isinstance(d, str)}
    shapes = [[dims[d] if isinstance(d, str) else tirx.const(d, "int64") if isinstance(d, int)
               else d for d in shape] for shape in [*inputs, *outputs(dims)]]
    left = tile.check_requires(shapes, "call")
    assert len(left) == len(tile.requires)
    for (_, message), (_, what) in zip(left, tile.requires):
        assert message.startswith(f"call: {tile.name} takes {what}, which the sizes of ")
