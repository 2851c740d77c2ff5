"""Tests of the edge-map language: parsing, the AST, evaluation and error messages."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from etc_tvm.edge_map import BinOp, BoolOp, Compare, Coord, Int, Neg, Range, Read, Slice, parse
from etc_tvm.errors import EdgeMapError

TENSORS = {
    "topk": np.array([[1, 3], [0, 2], [3, 3]], dtype=np.int32),
    "tile_expert": np.array([2, 0, 1], dtype=np.int32),
    "idx": np.arange(12, dtype=np.int32).reshape(3, 4),
    "a": np.array([2, 0, 1, 3], dtype=np.int32),
    "ptr": np.array([0, 2, 2, 5], dtype=np.int32),
}
RANKS = {name: array.ndim for name, array in TENSORS.items()}


def parse_in(text: str, task_rank: int, event_rank: int, **kwargs):
    return parse(text, kind="in", task_rank=task_rank, event_rank=event_rank, tensors=RANKS,
                 **kwargs)


def caret_column(message: str) -> int:
    """Where the caret line of an EdgeMapError points, as an index into the map text."""
    return message.splitlines()[-1].index("^") - 4


@pytest.mark.parametrize("text, ranks, coord, expected", [
    ("ij->ij", (2, 2), (1, 2), [(1, 2)]),
    ("ij->ji", (2, 2), (1, 2), [(2, 1)]),
    ("ij->i", (2, 1), (3, 4), [(3,)]),
    (" i j -> j , i ", (2, 2), (1, 2), [(2, 1)]),
    ("i j -> j i", (2, 2), (1, 2), [(2, 1)]),
    ("i->i//4", (1, 1), (9,), [(2,)]),
    ("ij->i*2+j", (2, 1), (3, 1), [(7,)]),
    ("ij->0", (2, 1), (5, 5), [(0,)]),
    ("i->i+1", (1, 1), (3,), [(4,)]),
    ("i->-i//4", (1, 1), (1,), [(-1,)]),  # floor division, as in Python
    ("i->(i-7)%4", (1, 1), (1,), [(2,)]),
    ("i->i-1 if i > 0", (1, 1), (2,), [(1,)]),
    ("i->i-1 if i > 0", (1, 1), (0,), []),
    ("ij->i if (i > 0 or j > 0) and i != j", (2, 1), (0, 0), []),
    ("ij->i if (i > 0 or j > 0) and i != j", (2, 1), (0, 1), [(0,)]),
    ("i->topk[i,:]", (1, 1), (1,), [(0,), (2,)]),
    ("i->topk[i, :]", (1, 1), (2,), [(3,), (3,)]),  # a double notify is kept
    ("i->topk[:, 0]", (1, 1), (0,), [(1,), (0,), (3,)]),
    ("i->topk[i,:], i", (1, 2), (0,), [(1, 0), (3, 0)]),
    ("i->topk[i,:], topk[i,:]", (1, 2), (0,), [(1, 1), (1, 3), (3, 1), (3, 3)]),
    ("t->tile_expert[t]", (1, 1), (0,), [(2,)]),
    ("ij->idx[i, j+1] % 8, j", (2, 2), (1, 2), [(7 % 8, 2)]),
    ("i->a[a[i]]", (1, 1), (0,), [(1,)]),
    ("i->a[i-1] if i > 0", (1, 1), (0,), []),  # the guard keeps the read in bounds
    ("i->i if a[i] > 0 and topk[i, 0] < 3", (1, 1), (0,), [(0,)]),
    # a block of rows, clipped to the tensor: task 1 of blocks of 2 has one row of three
    ("b->topk[2*b:2*b+2, :]", (1, 1), (0,), [(1,), (3,), (0,), (2,)]),
    ("b->topk[2*b:2*b+2, :]", (1, 1), (1,), [(3,), (3,)]),
    ("i->idx[i, 1:3]", (1, 1), (2,), [(9,), (10,)]),
    ("i->a[i-1:i+1]", (1, 1), (0,), [(2,)]),  # below 0 clipped too
    ("i->a[i:i]", (1, 1), (1,), []),
])
def test_evaluate(text, ranks, coord, expected):
    assert parse_in(text, *ranks).evaluate(coord, TENSORS) == expected


@pytest.mark.parametrize("text, task_rank, event, expected", [
    ("e=>ptr[e]:ptr[e+1]", 1, (0,), [(0,), (1,)]),
    ("e=>ptr[e]:ptr[e+1]", 1, (1,), []),  # an empty row releases nothing
    ("e=>ptr[e]:ptr[e+1]", 1, (2,), [(2,), (3,), (4,)]),
    ("e=>ptr[e]:ptr[e+1], 0:2", 2, (0,), [(0, 0), (0, 1), (1, 0), (1, 1)]),
    ("e=>ptr[e]:ptr[e+1], e", 2, (0,), [(0, 0), (1, 0)]),
    ("e=>e*2:e*2+2 if e < 2", 1, (1,), [(2,), (3,)]),
    ("e=>e*2:e*2+2 if e < 2", 1, (2,), []),
])
def test_trigger_evaluate(text, task_rank, event, expected):
    edge_map = parse_in(text, task_rank, 1)
    assert edge_map.is_trigger
    assert edge_map.evaluate(event, TENSORS) == expected


def test_map_attributes_and_ast():
    edge_map = parse("ij->i//2, j if i > 0", kind="out", task_rank=2, event_rank=2)
    assert (edge_map.kind, edge_map.is_trigger, edge_map.coords) == ("out", False, ("i", "j"))
    assert edge_map.indices == (BinOp("//", Coord("i"), Int(2)), Coord("j"))
    assert edge_map.guard == Compare(">", Coord("i"), Int(0))
    assert edge_map.reads == frozenset() and not edge_map.is_data_dependent
    assert str(edge_map) == "ij->i//2, j if i > 0"
    with pytest.raises(dataclasses.FrozenInstanceError):
        edge_map.kind = "in"


def test_reads_include_guards_and_trigger_ranges():
    edge_map = parse_in("e=>ptr[e]:ptr[e+1] if a[e] >= 0 or e == 0", 1, 1)
    assert edge_map.reads == {"ptr", "a"} and edge_map.is_data_dependent
    assert edge_map.indices == (Range(Read("ptr", (Coord("e"),)),
                                      Read("ptr", (BinOp("+", Coord("e"), Int(1)),))),)
    assert isinstance(edge_map.guard, BoolOp) and edge_map.guard.op == "or"
    assert parse_in("i->topk[i,:]", 1, 1).indices == (Read("topk", (Coord("i"), Slice())),)
    assert parse_in("i->topk[i:i+2, 0]", 1, 1).indices == (
        Read("topk", (Slice(Coord("i"), BinOp("+", Coord("i"), Int(2))), Int(0))),)


@pytest.mark.parametrize("text, printed", [
    ("ij->i*2+j", "i * 2 + j"),
    ("ij->(i+1)*2", "(i + 1) * 2"),
    ("ij->i-(j-1)", "i - (j - 1)"),
    ("ij->-(i+j)", "-(i + j)"),
    ("ij->idx[i,j+1]%8", "idx[i, j + 1] % 8"),
    ("ij->idx[2*i:2*i+2,:]", "idx[2 * i:2 * i + 2, :]"),
])
def test_ast_prints_back(text, printed):
    assert str(parse_in(text, 2, 1).indices[0]) == printed


# (map, kind, task_rank, event_rank, message regex, caret column)
BAD_MAPS = [
    ("ij ij", "in", 2, 2, r"missing arrow", 0),
    ("i->j->i", "in", 1, 1, r"more than one arrow", 4),
    ("->i", "in", 1, 1, r"empty left-hand side", 0),
    ("i->", "in", 1, 1, r"empty right-hand side", 3),
    ("i-> if i > 0", "in", 1, 1, r"empty right-hand side \('if' is reserved", 4),
    ("i1->i", "in", 1, 1, r"must be distinct single letters, one per task dimension", 0),
    ("i,j->i", "in", 2, 1, r"must be distinct single letters", 1),
    ("iji->i", "in", 3, 1, r"duplicate coordinate letter 'i'", 2),
    ("ij->i", "in", 1, 1, r"left-hand side gives 2 task coordinates but the task grid is 1-D", 0),
    ("e=>e", "in", 1, 2, r"left-hand side gives 1 event coordinate but E is 2-D", 0),
    ("ij->i", "in", 2, 2, r"right-hand side gives 1 event coordinate but E is 2-D", 4),
    ("e=>e", "in", 2, 1, r"right-hand side gives 1 task coordinate but the task grid is 2-D", 3),
    ("i->i+k", "in", 1, 1, r"unknown index letter 'k' \(the task coordinates are i\)", 5),
    ("e=>k", "in", 1, 1, r"unknown index letter 'k' \(the event coordinates are e\)", 3),
    ("i->a[i", "in", 1, 1, r"unclosed '\['", 4),
    ("i->(i+1))", "in", 1, 1, r"unmatched '\)'", 8),
    ("i->a[i)", "in", 1, 1, r"unmatched '\)'", 6),
    ("i->i$1", "in", 1, 1, r"unexpected character '\$'", 4),
    ("i->1.5", "in", 1, 1, r"non-integer literal '1.5'", 3),
    ("i->i/2", "in", 1, 1, r"use // for integer division", 4),
    ("i->i < 2", "in", 1, 1, r"expected an integer expression, found a condition", 3),
    ("i->(i > 0) + 1", "in", 1, 1, r"expected an integer expression, found a condition", 3),
    ("i->:", "in", 1, 1, r"':' \(a whole dimension\) is only allowed as a tensor index", 3),
    ("i->0:4", "in", 1, 1, r"a range 'lo:hi' is only allowed on the right of a trigger map", 4),
    ("e=>:4", "in", 1, 1, r"a range needs a lower bound", 3),
    ("e=>0:", "in", 1, 1, r"a range needs an upper bound", 5),
    ("i->foo[i]", "in", 1, 1, r"'foo' is not a tensor argument \(the arguments are: a, idx,", 3),
    ("i->topk[i]", "in", 1, 1, r"'topk' is 2-D but is read with 1 index", 3),
    ("i->a[i, 0]", "in", 1, 1, r"'a' is 1-D but is read with 2 indices", 3),
    ("i->topk[i, 0:]", "in", 1, 1, r"a tensor index is an expression, ':' or 'lo:hi'", 13),
    ("i->topk[i, :1]", "in", 1, 1, r"a tensor index is an expression, ':' or 'lo:hi'", 11),
    ("i->i if topk[i, 0:1] > 0", "in", 1, 1, r"a guard cannot use ':'", 8),
    ("i->topk", "in", 1, 1, r"tensor 'topk' must be read with indices", 3),
    ("i->i+ab", "in", 1, 1, r"unknown name 'ab'", 5),
    ("e=>e", "out", 1, 1, r"a trigger map '=>' is only allowed on in_edges", 1),
    ("i->i 1", "in", 1, 1, r"unexpected '1'; expected ',', 'if' or the end of the map", 5),
    ("ij->i+1 j", "in", 2, 1, r"unexpected 'j'; expected ',', 'if' or the end of the map", 8),
    ("i->i if i > 0 j", "in", 1, 1, r"unexpected 'j'; expected the end of the map", 14),
    ("i->i if i", "in", 1, 1, r"expected a condition \(a comparison\), found an integer", 8),
    ("i->i if i > 0 and i", "in", 1, 1, r"expected a condition", 18),
    ("i->i if 0 < i < 4", "in", 1, 1, r"chained comparisons are not supported", 14),
    ("i->i if topk[i,:] > 0", "in", 1, 1, r"a guard cannot use ':'", 8),
    ("i->i,", "in", 1, 2, r"expected an expression, found the end of the map", 5),
]


@pytest.mark.parametrize("text, kind, task_rank, event_rank, message, column", BAD_MAPS)
def test_malformed_map(text, kind, task_rank, event_rank, message, column):
    with pytest.raises(EdgeMapError, match=message) as info:
        parse(text, kind=kind, task_rank=task_rank, event_rank=event_rank, tensors=RANKS)
    assert str(info.value).startswith(f"edge map {text!r} for E: ")
    assert caret_column(str(info.value)) == column


def test_error_message_layout():
    with pytest.raises(EdgeMapError) as info:
        parse("ij->ik", kind="in", task_rank=2, event_rank=2, etensor="E_gate")
    assert str(info.value) == (
        "edge map 'ij->ik' for E_gate: unknown index letter 'k' (the task coordinates are i, j)\n"
        "    ij->ik\n"
        "         ^")


def test_no_tensor_arguments_is_said_plainly():
    with pytest.raises(EdgeMapError, match=r"the arguments are: none"):
        parse("i->a[i]", kind="in", task_rank=1, event_rank=1)


def test_kind_must_be_in_or_out():
    with pytest.raises(ValueError, match="kind must be 'in' or 'out'"):
        parse("i->i", kind="inout", task_rank=1, event_rank=1)


@pytest.mark.parametrize("text, coord, message", [
    ("i->a[i-1]", (0,), r"'i->a\[i-1\]' for E: a\[-1\] is out of bounds for 'a' of shape \(4,\) "
                        r"\(evaluating task \(0,\)\)"),
    ("i->topk[i,:]", (3,), r"topk\[3, 0\] is out of bounds for 'topk' of shape \(3, 2\)"),
    ("i->a[topk[i, 1]+1]", (0,), r"a\[4\] is out of bounds .* \(evaluating task \(0,\)\)"),
    ("i->i // a[i]", (1,), r"division by zero in i // a\[i\] \(evaluating task \(1,\)\)"),
    ("e=>ptr[e]:ptr[e+1]", (3,), r"ptr\[4\] is out of bounds .* \(evaluating event \(3,\)\)"),
    ("i->i", (0, 1), r"expected 1 coordinates"),
])
def test_evaluation_errors(text, coord, message):
    with pytest.raises(EdgeMapError, match=message):
        parse_in(text, 1, 1).evaluate(coord, TENSORS)


def test_missing_tensor_at_evaluation():
    with pytest.raises(EdgeMapError, match=r"tensor 'a' was not given"):
        parse_in("i->a[i]", 1, 1).evaluate((0,))


int_exprs = st.recursive(
    st.one_of(st.integers(0, 20).map(Int), st.sampled_from("ij").map(Coord)),
    lambda sub: st.one_of(st.builds(BinOp, st.sampled_from(["+", "-", "*", "//", "%"]), sub, sub),
                          st.builds(Neg, sub)),
    max_leaves=10)
conditions = st.recursive(
    st.builds(Compare, st.sampled_from(["<", "<=", ">", ">=", "==", "!="]), int_exprs, int_exprs),
    lambda sub: st.builds(BoolOp, st.sampled_from(["and", "or"]), sub, sub),
    max_leaves=4)
coords = st.tuples(st.integers(-50, 50), st.integers(-50, 50))


@given(int_exprs, conditions)
def test_printed_ast_parses_back_to_itself(expr, cond):
    edge_map = parse(f"ij->{expr} if {cond}", kind="in", task_rank=2, event_rank=1)
    assert edge_map.indices == (expr,) and edge_map.guard == cond


@given(int_exprs, coords)
def test_evaluation_agrees_with_python(expr, coord):
    """The language is a subset of Python's integer arithmetic, floor division included."""
    edge_map = parse(f"ij->{expr}", kind="out", task_rank=2, event_rank=1)
    env = dict(zip("ij", coord, strict=True))
    try:
        expected = [(eval(str(expr), {}, env),)]
    except ZeroDivisionError:
        with pytest.raises(EdgeMapError, match="division by zero"):
            edge_map.evaluate(coord)
        return
    assert edge_map.evaluate(coord) == expected


@given(conditions, coords)
def test_guard_agrees_with_python(cond, coord):
    edge_map = parse(f"ij->j, i if {cond}", kind="in", task_rank=2, event_rank=2)
    try:
        holds = eval(str(cond), {}, dict(zip("ij", coord, strict=True)))
    except ZeroDivisionError:
        with pytest.raises(EdgeMapError, match="division by zero"):
            edge_map.evaluate(coord)
        return
    assert edge_map.evaluate(coord) == ([coord[::-1]] if holds else [])


@given(int_exprs, int_exprs, conditions)
def test_grid_evaluation_agrees_with_one_coordinate_at_a_time(first, second, cond):
    """``evaluate_grid`` (task graphs evaluate a static map over a whole grid at once) gives
    what ``evaluate`` gives at each coordinate, or declines where a division by zero needs
    ``evaluate``'s error."""
    edge_map = parse(f"ij->{first}, {second} if {cond}", kind="out", task_rank=2, event_rank=2)
    grid = [(i, j) for i in range(-4, 5) for j in range(-3, 4)]
    on_grid = edge_map.evaluate_grid([np.array(c) for c in zip(*grid)])
    if on_grid is None:
        return
    (rows, cols), live = on_grid
    for k, coord in enumerate(grid):
        expected = edge_map.evaluate(coord)
        assert ([(int(rows[k]), int(cols[k]))] if live[k] else []) == expected


def test_grid_evaluation_declines_ranges_and_reads():
    assert parse_in("e=>2*e:2*e+2", 1, 1).evaluate_grid([np.arange(3)]) is None
    assert parse_in("i->a[i]", 1, 1).evaluate_grid([np.arange(3)]) is None
    assert parse("i->i // (i - 1)", kind="out", task_rank=1, event_rank=1).evaluate_grid(
        [np.arange(3)]) is None
