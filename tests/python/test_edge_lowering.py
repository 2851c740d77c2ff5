"""Edge maps lowered to TIR give, compiled and run (for the CPU), what ``EdgeMap.evaluate``
gives: the same coordinates, in the same order, for every task or event coordinate; and a
trigger's scan finds, from each task, exactly the elements whose map releases it."""
import itertools

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as Tb

from etc_tvm import edge_map
from etc_tvm.tir_sched.events import lower_edge, trigger_scan

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
    # blocks of two rows, the last one clipped to the tensor's three
    ("bc->pair_tile[2*b:2*b+2, :], c", "in", (2, 2), 2, {"pair_tile": (3, 2)}),
    ("i->a[i-1:i+1]", "out", (4,), 1, {"a": (4,)}),
    # an inner slice whose start the outer slice's point reads
    ("i->a[b[i, 0:2]:4]", "out", (3,), 1, {"a": (5,), "b": (3, 2)}),
    ("e=>ptr[e]:ptr[e+1]", "in", (4,), 1, {"ptr": (5,)}),
    ("e=>ptr[e]:ptr[e+1], 0:2", "in", (3,), 2, {"ptr": (4,)}),
]


TRIGGERS = [  # text, event shape, task grid, tensors: name -> (shape, largest value)
    ("e=>ptr[e]:ptr[e+1]", (4,), (9,), {"ptr": ((5,), 8)}),
    ("e=>ptr[e]:ptr[e+1], 0:2", (3,), (7, 2), {"ptr": ((4,), 6)}),
    ("e=>ptr[e]:ptr[e+1], e", (3,), (7, 3), {"ptr": ((4,), 6)}),
    ("e=>e*2:e*2+2 if e < 2", (3,), (6,), {}),
    ("e=>idx[e, :]", (3,), (5,), {"idx": ((3, 2), 3)}),
    ("a=>0:ptr[4], 0:3", (1,), (9, 3), {"ptr": ((5,), 8)}),  # the MoE layer's two triggers
    ("g=>g:g+1, 0:3 if g < ptr[4]", (9,), (9, 3), {"ptr": ((5,), 8)}),
    ("ij=>i:i+1, ptr[j]:ptr[j+1]", (2, 4), (2, 9), {"ptr": ((5,), 8)}),
    # element coordinates solved from the task (no loop over them)
    ("e=>e+1", (3,), (5,), {}),
    ("e=>2*e", (3,), (7,), {}),
    ("e=>e*3:e*3+2", (3,), (9,), {}),
    ("ij=>j:j+1, i:i+1", (2, 2), (3, 2), {}),
]


def prim_func(name: str, params, body: tirx.Stmt) -> tirx.PrimFunc:
    """A CPU function of ``params`` running ``body``."""
    with IRBuilder() as ib:
        with Tb.prim_func():
            Tb.func_name(name)
            Tb.func_attr({"global_symbol": name})
            for b in params:
                Tb.arg(b.name, b)
            Tb.add_to_parent(body)
    return ib.get()


def collect_rows(name, arrays, width, limit, body):
    """The rows ``body(buffers, record)`` records (``record(values)`` appends one row of
    ``width`` int32 values), from a TIR function built for the CPU and run on ``arrays``."""
    buffers = {n: tirx.decl_buffer(a.shape, "int32", n) for n, a in arrays.items()}
    out = tirx.decl_buffer((limit, width), "int32", "out")
    count = tirx.decl_buffer((1,), "int32", "count")

    def record(values):
        return tirx.stmt_seq(*[tirx.BufferStore(out, v, [count[0], k])
                               for k, v in enumerate(values)],
                             tirx.BufferStore(count, count[0] + 1, [0]))

    func = prim_func(name, [*buffers.values(), out, count],
                     tirx.stmt_seq(tirx.BufferStore(count, tirx.IntImm("int32", 0), [0]),
                                   body(buffers, record)))
    executable = tvm.compile(tvm.IRModule({name: func}), target="llvm")
    result = tvm.runtime.tensor(np.zeros((limit, width), "int32"))
    n = tvm.runtime.tensor(np.zeros(1, "int32"))
    executable[name](*(tvm.runtime.tensor(a) for a in arrays.values()), result, n)
    return result.numpy()[:int(n.numpy()[0])]


def run_lowered(emap, grid, rank, arrays):
    """All points of the lowered map over ``grid``, from a TIR function built for the CPU."""
    coords = [tirx.Var(c, "int32") for c in emap.coords]

    def points(buffers, record):
        lowered = lower_edge(emap, dict(zip(emap.coords, coords)), buffers)
        store = record(lowered.index)
        for var, lo, hi in reversed(lowered.loops):
            store = tirx.For(var, lo, hi - lo, tirx.ForKind.SERIAL, store)
        if lowered.guard is not None:
            store = tirx.IfThenElse(lowered.guard, store, None)
        return over_grid(coords, grid, store)

    rows = collect_rows("points", arrays, rank, int(np.prod(grid)) * 64, points)
    return [tuple(int(v) for v in row) for row in rows]


def over_grid(coords, grid, body: tirx.Stmt) -> tirx.Stmt:
    """``body`` for every point of ``grid`` (row-major), its coordinates bound to ``coords``."""
    for var, n in reversed(list(zip(coords, grid))):
        body = tirx.For(var, tirx.IntImm("int32", 0), tirx.IntImm("int32", n),
                        tirx.ForKind.SERIAL, body)
    return body


def run_trigger_scan(emap, shape, grid, arrays):
    """``(task, element)`` for every hit of ``trigger_scan`` over the tasks of ``grid``, from a
    TIR function built for the CPU."""
    coords = [tirx.Var(f"t{k}", "int32") for k in range(len(grid))]

    def hits(buffers, record):
        return over_grid(coords, grid, trigger_scan(
            emap, shape, coords, buffers, lambda elem: record([*coords, *elem])))

    rows = collect_rows("hits", arrays, len(grid) + len(shape),
                        int(np.prod(grid)) * int(np.prod(shape)) * 4, hits)
    return [(tuple(map(int, r[:len(grid)])), tuple(map(int, r[len(grid):]))) for r in rows]


@pytest.mark.parametrize("text, shape, grid, shapes", TRIGGERS, ids=[c[0] for c in TRIGGERS])
def test_trigger_scan_finds_the_elements_that_release_each_task(text, shape, grid, shapes,
                                                                 rng):
    """For each task, the scan hits the elements ``evaluate`` says release it, in row-major
    element order (once per time the map lists the task); the tasks it hits no element for,
    those no element releases, are the tasks every kernel skips. The tensors' values stop
    short of the last task row, so some are."""
    arrays = {n: np.sort(rng.integers(0, high + 1, s), axis=-1).astype("int32")
              for n, (s, high) in shapes.items()}  # sorted: a CSR row pointer
    emap = edge_map.parse(text, kind="in", task_rank=len(grid), event_rank=len(shape),
                          tensors={n: len(s) for n, (s, _) in shapes.items()})
    released = {c: [] for c in itertools.product(*map(range, grid))}
    for elem in itertools.product(*map(range, shape)):
        for task in emap.evaluate(elem, arrays):
            released[task].append(elem)
    want = [(task, elem) for task, elems in released.items() for elem in elems]
    assert want and len(released) > len({task for task, _ in want})
    assert run_trigger_scan(emap, shape, grid, arrays) == want


@pytest.mark.parametrize("text, shape, loops", [
    ("g=>g:g+1, 0:3 if g < ptr[4]", (640,), 0),  # the MoE layer's down GEMM: one element
    ("ij=>i:i+1, ptr[j]:ptr[j+1]", (2, 4), 1),  # i solved, j looped
    ("e=>e*2:e*2+3", (3,), 1),  # overlapping ranges: several elements may release a task
    ("e=>ptr[e]:ptr[e+1]", (4,), 1),
])
def test_trigger_scan_solves_the_coordinates_a_task_determines(text, shape, loops):
    task_rank = len(text.split("=>")[1].split(" if ")[0].split(","))
    emap = edge_map.parse(text, kind="in", task_rank=task_rank, event_rank=len(shape),
                          tensors={"ptr": 1})
    coords = [tirx.Var(f"t{k}", "int32") for k in range(task_rank)]
    scan = trigger_scan(emap, shape, coords, {"ptr": tirx.decl_buffer((5,), "int32", "ptr")},
                        lambda elem: tirx.Evaluate(tirx.IntImm("int32", 0)))
    found = []
    tvm_ffi.structural_walk(scan, [(tirx.For, found.append)])
    assert len(found) == loops


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


@pytest.mark.parametrize("lanes", [2, 32])
@pytest.mark.parametrize("text, kind, grid, rank, shapes", [c for c in CASES if ":" in c[0]],
                         ids=[c[0] for c in CASES if ":" in c[0]])
def test_strided_nest_deals_each_point_to_one_lane(text, kind, grid, rank, shapes, lanes, rng):
    """``nest_strided`` (the lanes of a warp sharing a map's waits): the lanes together list,
    for every coordinate, each point of the map as often as ``evaluate`` does. Ranges up to
    80 long: a lane takes several points of a loop."""
    arrays = {n: rng.integers(0, 4, shape).astype("int32") for n, shape in shapes.items()}
    if "ptr" in arrays:
        arrays["ptr"] = np.cumsum(rng.integers(0, 40, shapes["ptr"])).astype("int32")
    emap = edge_map.parse(text, kind=kind, task_rank=len(grid) if "=>" not in text else rank,
                          event_rank=rank if "=>" not in text else len(grid),
                          tensors={n: len(s) for n, s in shapes.items()})
    coords = [tirx.Var(c, "int32") for c in emap.coords]
    lane = tirx.Var("lane", "int32")

    def points(buffers, record):
        lowered = lower_edge(emap, dict(zip(emap.coords, coords)), buffers)
        body = lowered.nest_strided(record([*coords, *lowered.index]), lane, lanes)
        return over_grid(coords, grid, tirx.For(lane, tirx.IntImm("int32", 0),
                                                tirx.IntImm("int32", lanes),
                                                tirx.ForKind.SERIAL, body))

    rows = collect_rows("strided", arrays, len(grid) + rank, int(np.prod(grid)) * 512, points)
    want = sorted(c + p for c in itertools.product(*map(range, grid))
                  for p in emap.evaluate(c, arrays))
    assert want and sorted(tuple(map(int, r)) for r in rows) == want


@pytest.mark.parametrize("text, kind, task_rank, event_rank, tensors, loops", [
    ("bc->pair_tile[4*b:4*b+4, :], c", "in", 2, 2, {"pair_tile": (9, 8)}, 1),  # the combine's
    ("e=>ptr[e]:ptr[e+1], 0:2", "in", 2, 1, {"ptr": (4,)}, 1),
    ("i->a[b[i, 0:2]:4]", "out", 1, 1, {"a": (5,), "b": (3, 2)}, 2),  # bounds read a point
])
def test_strided_nest_flattens_loops_with_independent_bounds(text, kind, task_rank, event_rank,
                                                             tensors, loops):
    """The lanes of a warp take the points of all of a map's loops in one round of loads
    where no loop's bounds read another's point (one loop over the rounds), else of the
    innermost loop, the outer loops around it."""
    emap = edge_map.parse(text, kind=kind, task_rank=task_rank, event_rank=event_rank,
                          tensors={n: len(s) for n, s in tensors.items()})
    buffers = {n: tirx.decl_buffer(s, "int32", n) for n, s in tensors.items()}
    coords = [tirx.Var(c, "int32") for c in emap.coords]
    lowered = lower_edge(emap, dict(zip(emap.coords, coords)), buffers)
    nest = lowered.nest_strided(tirx.Evaluate(tirx.IntImm("int32", 0)),
                                tirx.Var("lane", "int32"), 32)
    found = []
    tvm_ffi.structural_walk(nest, [(tirx.For, found.append)])
    assert len(lowered.loops) == 2 and len(found) == loops
