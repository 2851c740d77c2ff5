"""Edge maps lowered to TIR give, compiled and run (for the CPU), what ``EdgeMap.evaluate``
gives: the same coordinates, in the same order, for every task or event coordinate."""
import itertools

import numpy as np
import pytest
import tvm
from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as Tb

from etc_tvm import edge_map
from etc_tvm.tir_sched.events import lower_edge

CASES = [  # text, kind, grid (task or event coordinates), event/task rank, tensors
    ("ij->ji", "out", (3, 4), 2, {}),
    ("ij->i*2+j if j < 2", "out", (3, 4), 1, {}),
    ("i->i-1 if i > 0", "in", (5,), 1, {}),
    ("ij->i//2, j%3", "in", (5, 4), 2, {}),
    ("t->topk[t,:]", "out", (6,), 1, {"topk": (6, 3)}),
    ("t->pair_tile[t,:] if t % 2 == 0", "in", (6,), 1, {"pair_tile": (6, 2)}),
    ("ij->idx[i, j+1] % 8, j", "out", (3, 2), 2, {"idx": (3, 3)}),
    ("i->a[b[i]]", "out", (4,), 1, {"a": (5,), "b": (4,)}),
    ("i->a[i,:] + b[:]", "out", (2,), 1, {"a": (2, 3), "b": (2,)}),
    ("e=>ptr[e]:ptr[e+1]", "in", (4,), 1, {"ptr": (5,)}),
    ("e=>ptr[e]:ptr[e+1], 0:2", "in", (3,), 2, {"ptr": (4,)}),
]


def run_lowered(emap, grid, rank, arrays):
    """All points of the lowered map over ``grid``, from a TIR function built for the CPU."""
    limit = int(np.prod(grid)) * 64
    buffers = {n: tirx.decl_buffer(a.shape, "int32", n) for n, a in arrays.items()}
    out = tirx.decl_buffer((limit, rank), "int32", "out")
    count = tirx.decl_buffer((1,), "int32", "count")
    coords = [tirx.Var(c, "int32") for c in emap.coords]
    lowered = lower_edge(emap, dict(zip(emap.coords, coords)), buffers)
    store = tirx.stmt_seq(*[tirx.BufferStore(out, v, [count[0], k])
                            for k, v in enumerate(lowered.index)],
                          tirx.BufferStore(count, count[0] + 1, [0]))
    for var, lo, hi in reversed(lowered.loops):
        store = tirx.For(var, lo, hi - lo, tirx.ForKind.SERIAL, store)
    if lowered.guard is not None:
        store = tirx.IfThenElse(lowered.guard, store, None)
    for var, n in reversed(list(zip(coords, grid))):
        store = tirx.For(var, tirx.IntImm("int32", 0), tirx.IntImm("int32", n),
                         tirx.ForKind.SERIAL, store)
    with IRBuilder() as ib:
        with Tb.prim_func():
            Tb.func_name("points")
            Tb.func_attr({"global_symbol": "points"})
            for b in [*buffers.values(), out, count]:
                Tb.arg(b.name, b)
            Tb.buffer_store(count, tirx.IntImm("int32", 0), [0])
            Tb.add_to_parent(store)
    executable = tvm.compile(tvm.IRModule({"points": ib.get()}), target="llvm")
    result = tvm.runtime.tensor(np.zeros((limit, rank), "int32"))
    n = tvm.runtime.tensor(np.zeros(1, "int32"))
    executable["points"](*(tvm.runtime.tensor(a) for a in arrays.values()), result, n)
    return [tuple(int(v) for v in row) for row in result.numpy()[:int(n.numpy()[0])]]


@pytest.mark.parametrize("text, kind, grid, rank, shapes", CASES, ids=[c[0] for c in CASES])
def test_lowered_map_lists_what_evaluate_lists(text, kind, grid, rank, shapes, rng):
    arrays = {n: rng.integers(0, 4, shape).astype("int32") for n, shape in shapes.items()}
    if "ptr" in arrays:  # a CSR row pointer: non-decreasing
        arrays["ptr"] = np.cumsum(rng.integers(0, 3, shapes["ptr"])).astype("int32")
    if "b" in arrays and "a" in arrays and arrays["a"].ndim == 1:
        arrays["b"] %= shapes["a"][0]
    emap = edge_map.parse(text, kind=kind, task_rank=len(grid) if "=>" not in text else rank,
                          event_rank=rank if "=>" not in text else len(grid),
                          tensors={n: len(s) for n, s in shapes.items()})
    want = [p for c in itertools.product(*map(range, grid)) for p in emap.evaluate(c, arrays)]
    assert run_lowered(emap, grid, rank, arrays) == want
