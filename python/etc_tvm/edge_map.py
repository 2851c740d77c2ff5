"""The edge-map language: which event elements a tile task waits on or notifies.

An edge map relates one ``call_device`` (a grid of tile tasks) to one event tensor:

* ``ij -> i//2, j [if COND]`` gives, for a *task* coordinate, the event coordinates it
  waits on (in-edge) or notifies (out-edge). An RHS that is one bare run of coordinate
  letters is einsum shorthand: ``ij->ji`` has one event dimension per letter.
* ``e => ptr[e]:ptr[e+1], 0:4 [if COND]`` (in-edges only) gives, for an *event*
  coordinate, the consumer task coordinates it releases; ``lo:hi`` is half-open.

Expressions follow Python (precedence, floor ``//`` and ``%``) and may read the int32
tensor arguments of the call, ``name[idx, ...]``, where ``:`` is a whole dimension and
``lo:hi`` the indices lo, ..., hi - 1 inside it (a block of rows may run past the end). ``rank``
and ``world_size`` are the constants of an SPMD graph function (``EdgeMap.bind`` gives them
their values for one rank).
``if``, ``and`` and ``or`` are reserved words, so an einsum RHS ``if`` is written ``i, f``.
The AST stays plain and printable because a later stage lowers it to TIR.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from itertools import product
from types import MappingProxyType
from typing import Any, NamedTuple, NoReturn, TypeVar

import numpy as np

from .errors import EdgeMapError

__all__ = ["Node", "Int", "Const", "Coord", "BinOp", "Neg", "Read", "Slice", "Range", "Compare",
           "BoolOp", "EdgeMap", "parse"]

_NO_TENSORS: Mapping = MappingProxyType({})
_ARITH = {"+": operator.add, "-": operator.sub, "*": operator.mul,
          "//": operator.floordiv, "%": operator.mod}
_COMPARE = {"<": operator.lt, "<=": operator.le, ">": operator.gt,
            ">=": operator.ge, "==": operator.eq, "!=": operator.ne}
# Binary operators from loosest to tightest; unary minus (6) binds tighter.
_LEVELS = (("or",), ("and",), tuple(_COMPARE), ("+", "-"), ("*", "//", "%"))
_PRECEDENCE = {op: level + 1 for level, ops in enumerate(_LEVELS) for op in ops}


class Node:
    """Base of the AST; ``str(node)`` prints it back in the language."""

    def walk(self) -> Iterator[Node]:
        """This node and every node below it, pre-order."""
        yield self
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            for child in value if isinstance(value, tuple) else (value,):
                if isinstance(child, Node):
                    yield from child.walk()

    def __str__(self) -> str:
        return _show(self)


@dataclass(frozen=True)
class Int(Node):
    """A non-negative integer literal; ``-3`` is ``Neg(Int(3))``."""
    value: int


@dataclass(frozen=True)
class Const(Node):
    """A named constant of the graph function, ``rank`` or ``world_size``."""
    name: str


CONSTANTS = ("rank", "world_size")


@dataclass(frozen=True)
class Coord(Node):
    """An LHS letter: a task coordinate in ``->`` maps, an event coordinate in ``=>`` maps."""
    name: str


@dataclass(frozen=True)
class BinOp(Node):
    """Integer ``lhs op rhs`` with op in ``+ - * // %``; ``//`` and ``%`` floor, as in Python."""
    op: str
    lhs: IntExpr
    rhs: IntExpr


@dataclass(frozen=True)
class Neg(Node):
    """Unary minus."""
    operand: IntExpr


@dataclass(frozen=True)
class Slice(Node):
    """A tensor index of several values, each giving its own: ``:`` (no bounds), every index
    of the dimension; ``lo:hi``, the indices lo, ..., hi - 1 that lie inside it (clipped, so
    that task b of a block of B rows reads ``t[B*b:B*b+B, ...]`` whatever the rows' count)."""
    lo: IntExpr | None = None
    hi: IntExpr | None = None


@dataclass(frozen=True)
class Read(Node):
    """``tensor[indices]``: an element of a runtime int32 tensor argument."""
    tensor: str
    indices: tuple[IntExpr | Slice, ...]


@dataclass(frozen=True)
class Range(Node):
    """``lo:hi``, an RHS item of a trigger map: the task indices lo, ..., hi - 1."""
    lo: IntExpr
    hi: IntExpr


@dataclass(frozen=True)
class Compare(Node):
    """``lhs op rhs`` with op in ``< <= > >= == !=``; never chained."""
    op: str
    lhs: IntExpr
    rhs: IntExpr


@dataclass(frozen=True)
class BoolOp(Node):
    """``lhs and rhs`` / ``lhs or rhs``; short-circuits, so a guard can protect a read."""
    op: str
    lhs: Cond
    rhs: Cond


def _show(node: Node, context: int = 0) -> str:
    """``node`` in the language, in parentheses if it binds looser than ``context`` needs."""
    match node:
        case Int(value):
            return str(value)
        case Coord(name) | Const(name):
            return name
        case Slice(None, None):
            return ":"
        case Slice(lo, hi):
            return f"{_show(lo)}:{_show(hi)}"
        case Read(tensor, indices):
            return f"{tensor}[{', '.join(map(_show, indices))}]"
        case Range(lo, hi):
            return f"{_show(lo)}:{_show(hi)}"
        case Neg(operand):
            precedence, text = 6, f"-{_show(operand, 6)}"
        case BinOp(op, lhs, rhs) | Compare(op, lhs, rhs) | BoolOp(op, lhs, rhs):
            precedence = _PRECEDENCE[op]  # left-associative: the rhs needs one level more
            text = f"{_show(lhs, precedence)} {op} {_show(rhs, precedence + 1)}"
        case _:
            raise TypeError(f"not an edge-map node: {node!r}")
    return f"({text})" if precedence < context else text


IntExpr = Int | Const | Coord | BinOp | Neg | Read
Cond = Compare | BoolOp
Item = IntExpr | Range


def _error(text: str, etensor: str, message: str, pos: int | None = None) -> EdgeMapError:
    head = f"edge map {text!r} for {etensor}: {message}"
    if pos is None:
        return EdgeMapError(head)
    shown = re.sub(r"\s", " ", text)  # keeps the caret aligned under tabs and newlines
    return EdgeMapError(f"{head}\n    {shown}\n    {' ' * pos}^")


@dataclass(frozen=True)
class EdgeMap:
    """A checked edge map; ``indices`` (the RHS items) and ``guard`` are its AST."""
    text: str
    kind: str
    is_trigger: bool
    coords: tuple[str, ...]
    indices: tuple[Item, ...]
    guard: Cond | None
    reads: frozenset[str]
    etensor: str = "E"

    @property
    def is_data_dependent(self) -> bool:
        """Whether the map reads runtime tensors, so its edges are known only at run time."""
        return bool(self.reads)

    def __str__(self) -> str:
        return self.text

    @property
    def constants(self) -> frozenset[str]:
        """The named constants (``rank``, ``world_size``) the map uses, unbound."""
        return frozenset(n.name for item in (*self.indices, self.guard) if item is not None
                         for n in item.walk() if isinstance(n, Const))

    def bind(self, **values: int) -> "EdgeMap":
        """This map with its named constants replaced by ``values`` (one rank's)."""
        if not self.constants:
            return self
        return replace(self, indices=tuple(_bind(i, values) for i in self.indices),
                       guard=None if self.guard is None else _bind(self.guard, values))

    def evaluate(self, coords: Sequence[int],
                 tensors: Mapping[str, np.ndarray] = _NO_TENSORS) -> list[tuple[int, ...]]:
        """The event coordinates of task ``coords`` (``->``), or the task coordinates event
        ``coords`` releases (``=>``): row-major, duplicates kept, none if the guard fails."""
        ev = _Evaluator(self, coords, tensors)
        if self.guard is not None and not ev.truth(self.guard):
            return []
        return list(product(*(ev.values(item) for item in self.indices)))

    def evaluate_grid(self, coords: Sequence[np.ndarray]) \
            -> tuple[tuple[np.ndarray, ...], np.ndarray] | None:
        """``evaluate`` at many coordinates at once (``coords[k]``: coordinate k of each), for
        a map that gives at most one element per coordinate without reading tensors: (the
        element's coordinates, whether the guard holds), arrays over the coordinates. None
        for the other maps, and where a division by zero needs ``evaluate``'s error."""
        try:
            ev = _Evaluator(self, coords, _NO_TENSORS, grid=True)
            n = len(coords[0]) if coords else 1
            live = np.ones(n, bool) if self.guard is None else \
                np.broadcast_to(ev.truth(self.guard), (n,))
            indices = []
            for item in self.indices:
                (value,) = ev.values(item)
                indices.append(np.broadcast_to(np.asarray(value, np.int64), (n,)))
            return tuple(indices), live
        except _NotOnGrid:
            return None


def _bind(node: Node, values: Mapping[str, int]) -> Node:
    if isinstance(node, Const):
        return Int(values[node.name]) if node.name in values else node
    changes = {}
    for f in fields(node):  # type: ignore[arg-type]
        value = getattr(node, f.name)
        if isinstance(value, Node):
            changes[f.name] = _bind(value, values)
        elif isinstance(value, tuple):
            changes[f.name] = tuple(_bind(v, values) if isinstance(v, Node) else v
                                    for v in value)
    return replace(node, **changes)


class _NotOnGrid(Exception):
    """The map needs ``EdgeMap.evaluate`` coordinate by coordinate."""


class _Evaluator:
    """One map at one coordinate. An integer expression has a list of values, since each
    ``:`` and each range inside it stands for several (combined as a cartesian product)."""

    def __init__(self, edge_map: EdgeMap, coords: Sequence, tensors: Mapping[str, np.ndarray],
                 grid: bool = False) -> None:
        """``grid``: each coordinate is an array (``EdgeMap.evaluate_grid``)."""
        self.map, self.tensors, self.grid = edge_map, tensors, grid
        self.coords = tuple(coords) if grid else tuple(int(c) for c in coords)
        if len(self.coords) != len(edge_map.coords):
            self.fail(f"expected {len(edge_map.coords)} coordinates")
        self.env = dict(zip(edge_map.coords, self.coords, strict=True))

    def fail(self, message: str) -> NoReturn:
        role = "event" if self.map.is_trigger else "task"
        where = f"evaluating {role} {self.coords}"
        raise _error(self.map.text, self.map.etensor, f"{message} ({where})")

    def values(self, node: Node) -> list[int]:
        match node:
            case Int(value):
                return [value]
            case Coord(name):
                return [self.env[name]]
            case Const(name):
                self.fail(f"'{name}' has no value here: bind it for a rank first")
            case Neg(operand):
                return [-v for v in self.values(operand)]
            case BinOp(op, lhs, rhs) if self.grid:
                (a,), (b,) = self.values(lhs), self.values(rhs)
                if op in ("//", "%") and np.any(np.asarray(b) == 0):
                    raise _NotOnGrid
                return [_ARITH[op](a, b)]
            case Range() | Read() if self.grid:
                raise _NotOnGrid
            case BinOp(op, lhs, rhs):
                try:
                    return [_ARITH[op](a, b) for a in self.values(lhs) for b in self.values(rhs)]
                except ZeroDivisionError:
                    self.fail(f"division by zero in {node}")
            case Range(lo, hi):
                return [t for a in self.values(lo) for b in self.values(hi) for t in range(a, b)]
            case Read(name, indices):
                if name not in self.tensors:
                    self.fail(f"tensor {name!r} was not given")
                array = np.asarray(self.tensors[name])
                if array.ndim != len(indices):
                    self.fail(f"{name!r} is read with {len(indices)} indices "
                              f"but has shape {array.shape}")
                axes = [self.axis(ix, n) if isinstance(ix, Slice) else self.values(ix)
                        for ix, n in zip(indices, array.shape, strict=True)]
                return [self.element(name, array, index) for index in product(*axes)]
        raise TypeError(f"not an integer expression: {node!r}")

    def axis(self, index: Slice, n: int) -> list[int]:
        """The indices ``index`` takes of a dimension of ``n``."""
        if index.lo is None:
            return list(range(n))
        return [i for lo in self.values(index.lo) for hi in self.values(index.hi)
                for i in range(max(lo, 0), min(hi, n))]

    def element(self, name: str, array: np.ndarray, index: tuple[int, ...]) -> int:
        """``array[index]`` without Python's negative wraparound."""
        if not all(0 <= i < n for i, n in zip(index, array.shape, strict=True)):
            self.fail(f"{name}[{', '.join(map(str, index))}] is out of bounds "
                      f"for {name!r} of shape {array.shape}")
        return int(array[index])

    def truth(self, node: Node) -> bool:
        match node:
            case Compare(op, lhs, rhs):  # guards have no ':', so each side has one value
                return _COMPARE[op](*self.values(lhs), *self.values(rhs))
            case BoolOp(op, lhs, rhs) if self.grid:
                both = np.logical_and if op == "and" else np.logical_or
                return both(self.truth(lhs), self.truth(rhs))
            case BoolOp("and", lhs, rhs):
                return self.truth(lhs) and self.truth(rhs)
            case BoolOp("or", lhs, rhs):
                return self.truth(lhs) or self.truth(rhs)
        raise TypeError(f"not a condition: {node!r}")


class _Token(NamedTuple):
    kind: str  # "num", "name", "kw", "op" or "end"
    text: str
    pos: int


_TOKEN = re.compile(r"(?P<space>\s+)|(?P<num>[0-9]+(\.[0-9]*)?)|(?P<name>[A-Za-z_][A-Za-z0-9_]*)"
                    r"|(?P<op>->|=>|//|<=|>=|==|!=|[-+*%<>()\[\],:])")
_CLOSERS = {")": "(", "]": "["}
_T = TypeVar("_T")


def _plural(n: int, noun: str, nouns: str = "") -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {nouns or noun + 's'}"


class _Parser:
    """Recursive descent over the token list of one map."""

    def __init__(self, text: str, kind: str, ranks: dict[str, int],
                 tensors: Mapping[str, int], etensor: str) -> None:
        self.text, self.kind, self.ranks, self.tensors = text, kind, ranks, tensors
        self.etensor, self.i = etensor, 0
        self.toks = self.tokenize()
        self.coords: tuple[str, ...] = ()
        self.role = "task"  # whose coordinates the LHS letters are

    def fail(self, message: str, pos: int) -> NoReturn:
        raise _error(self.text, self.etensor, message, pos)

    def tokenize(self) -> list[_Token]:
        toks, pos = [], 0
        while pos < len(self.text):
            m = _TOKEN.match(self.text, pos)
            if m is None:
                char = self.text[pos]
                self.fail("'/' is not an operator; use // for integer division" if char == "/"
                          else f"unexpected character {char!r}", pos)
            kind, tok = m.lastgroup or "", m.group()
            if kind == "num" and "." in tok:
                self.fail(f"non-integer literal {tok!r}; only integers are allowed", pos)
            if kind != "space":
                toks.append(_Token("kw" if tok in ("if", "and", "or") else kind, tok, pos))
            pos = m.end()
        return [*toks, _Token("end", "", len(self.text))]

    @property
    def tok(self) -> _Token:
        return self.toks[self.i]

    def describe(self) -> str:
        return "the end of the map" if self.tok.kind == "end" else repr(self.tok.text)

    def take(self, text: str) -> bool:
        if self.tok.text != text:
            return False
        self.i += 1
        return True

    def expect(self, text: str) -> None:
        if not self.take(text):
            self.fail(f"expected {text!r}, found {self.describe()}", self.tok.pos)

    def at_item_end(self) -> bool:
        return self.tok.kind == "end" or self.tok.text in (",", "if")

    def check_rank(self, count: int, side: str, role: str, pos: int) -> None:
        if count != self.ranks[role]:
            shape = self.etensor if role == "event" else "the task grid"
            self.fail(f"the {side} gives {_plural(count, role + ' coordinate')} "
                      f"but {shape} is {self.ranks[role]}-D", pos)

    def parse(self) -> EdgeMap:
        self.check_brackets()
        arrows = [k for k, t in enumerate(self.toks) if t.text in ("->", "=>")]
        if not arrows:
            self.fail("missing arrow: write 'LHS -> RHS' or 'LHS => RHS'", 0)
        if len(arrows) > 1:
            self.fail("more than one arrow", self.toks[arrows[1]].pos)
        self.i = arrows[0]
        arrow, trigger = self.tok, self.tok.text == "=>"
        if trigger and self.kind == "out":
            self.fail("a trigger map '=>' is only allowed on in_edges", arrow.pos)
        self.role, rhs_role = ("event", "task") if trigger else ("task", "event")
        self.coords = self.lhs(self.toks[:self.i], arrow)
        self.i += 1
        start = self.tok.pos
        if self.at_item_end():
            reserved = " ('if' is reserved: it starts a guard)" if self.tok.text == "if" else ""
            self.fail(f"empty right-hand side{reserved}", start)
        indices: tuple[Item, ...] = self.einsum() or self.comma_list(lambda: self.item(trigger))
        self.check_rank(len(indices), "right-hand side", rhs_role, start)
        guard = self.guard()
        if self.tok.kind != "end":
            expected = "the end of the map" if guard else "',', 'if' or the end of the map"
            self.fail(f"unexpected {self.describe()}; expected {expected}", self.tok.pos)
        roots = indices if guard is None else (*indices, guard)
        reads = frozenset(n.tensor for root in roots for n in root.walk() if isinstance(n, Read))
        return EdgeMap(self.text, self.kind, trigger, self.coords, indices, guard, reads,
                       self.etensor)

    def check_brackets(self) -> None:
        stack: list[_Token] = []
        for tok in self.toks:
            if tok.text in ("(", "["):
                stack.append(tok)
            elif tok.text in _CLOSERS and (not stack or stack.pop().text != _CLOSERS[tok.text]):
                self.fail(f"unmatched {tok.text!r}", tok.pos)
        if stack:
            self.fail(f"unclosed {stack[-1].text!r}", stack[-1].pos)

    def lhs(self, toks: list[_Token], arrow: _Token) -> tuple[str, ...]:
        if not toks:
            self.fail("empty left-hand side", arrow.pos)
        letters: list[str] = []
        for tok in toks:  # whitespace between letters is allowed; "if"/"or" are letters here
            if tok.kind not in ("name", "kw") or not tok.text.isalpha():
                self.fail(f"the left-hand side must be distinct single letters, "
                          f"one per {self.role} dimension", tok.pos)
            for k, letter in enumerate(tok.text):
                if letter in letters:
                    self.fail(f"duplicate coordinate letter {letter!r}", tok.pos + k)
                letters.append(letter)
        self.check_rank(len(letters), "left-hand side", self.role, toks[0].pos)
        return tuple(letters)

    def einsum(self) -> tuple[Coord, ...]:
        """``ij->ji``: an RHS of bare letters only (``j i`` too) has one coordinate per letter."""
        end = self.i
        while (self.toks[end].kind == "name" and self.toks[end].text.isalpha()
               and self.toks[end].text not in self.tensors):  # an unindexed tensor: see atom
            end += 1
        after = self.toks[end]
        if end == self.i or not (after.kind == "end" or after.text == "if"):
            return ()
        runs, self.i = self.toks[self.i:end], end
        return tuple(self.coord(letter, tok.pos + k)
                     for tok in runs for k, letter in enumerate(tok.text))

    def coord(self, letter: str, pos: int) -> Coord:
        if letter not in self.coords:
            self.fail(f"unknown index letter {letter!r} "
                      f"(the {self.role} coordinates are {', '.join(self.coords)})", pos)
        return Coord(letter)

    def comma_list(self, parse_one: Callable[[], _T]) -> tuple[_T, ...]:
        items = [parse_one()]
        while self.take(","):
            items.append(parse_one())
        return tuple(items)

    def item(self, trigger: bool) -> Item:
        if self.tok.text == ":":
            self.fail("a range needs a lower bound, lo:hi" if trigger else
                      "':' (a whole dimension) is only allowed as a tensor index", self.tok.pos)
        lo = self.int_expr()
        if self.tok.text != ":":
            return lo
        if not trigger:
            self.fail("a range 'lo:hi' is only allowed on the right of a trigger map '=>'",
                      self.tok.pos)
        self.i += 1
        if self.at_item_end():
            self.fail("a range needs an upper bound, lo:hi", self.tok.pos)
        return Range(lo, self.int_expr())

    def guard(self) -> Cond | None:
        if not self.take("if"):
            return None
        pos, cond = self.tok.pos, self.expr()
        if any(isinstance(n, Slice) for n in cond.walk()):
            self.fail("a guard cannot use ':'; it must give one truth value", pos)
        return self.check(cond, pos, want_cond=True)

    def int_expr(self) -> IntExpr:
        pos = self.tok.pos
        return self.check(self.expr(), pos, want_cond=False)

    def check(self, node: Node, pos: int, *, want_cond: bool) -> Any:
        """``node``, once checked to be a condition (or an integer expression) as wanted."""
        kinds = ("an integer expression", "a condition (a comparison)")
        if isinstance(node, (Compare, BoolOp)) != want_cond:
            self.fail(f"expected {kinds[want_cond]}, found {kinds[not want_cond]}", pos)
        return node

    def expr(self, level: int = 0) -> Node:
        """Precedence climbing over ``_LEVELS``; every binary operator is left-associative."""
        if level == len(_LEVELS):
            return self.unary()
        pos, node = self.tok.pos, self.expr(level + 1)
        while self.tok.text in _LEVELS[level]:
            op, cls = self.tok.text, (BoolOp, BoolOp, Compare, BinOp, BinOp)[level]
            self.i += 1
            rpos, rhs = self.tok.pos, self.expr(level + 1)
            node = cls(op, self.check(node, pos, want_cond=cls is BoolOp),
                       self.check(rhs, rpos, want_cond=cls is BoolOp))
            if cls is Compare and self.tok.text in _COMPARE:
                self.fail("chained comparisons are not supported; join them with 'and'",
                          self.tok.pos)
        return node

    def unary(self) -> Node:
        if not self.take("-"):
            return self.atom()
        pos = self.tok.pos
        return Neg(self.check(self.unary(), pos, want_cond=False))

    def atom(self) -> Node:
        tok = self.tok
        if tok.kind not in ("num", "name") and tok.text != "(":
            self.fail(f"expected an expression, found {self.describe()}", tok.pos)
        self.i += 1
        if tok.kind == "num":
            return Int(int(tok.text))
        if tok.text == "(":
            node = self.expr()
            self.expect(")")
            return node
        if self.tok.text == "[":
            return self.read(tok)
        if tok.text in CONSTANTS and tok.text not in self.tensors:
            return Const(tok.text)
        if tok.text in self.tensors:
            self.fail(f"tensor {tok.text!r} must be read with indices, {tok.text}[...]", tok.pos)
        if len(tok.text) != 1 or not tok.text.isalpha():
            self.fail(f"unknown name {tok.text!r}: coordinates are single letters "
                      f"and tensors are read as name[...]", tok.pos)
        return self.coord(tok.text, tok.pos)

    def read(self, name: _Token) -> Read:
        if name.text not in self.tensors:
            known = ", ".join(sorted(self.tensors)) or "none"
            self.fail(f"{name.text!r} is not a tensor argument (the arguments are: {known})",
                      name.pos)
        self.expect("[")
        indices = self.comma_list(self.index)
        self.expect("]")
        if len(indices) != self.tensors[name.text]:
            self.fail(f"{name.text!r} is {self.tensors[name.text]}-D but is read with "
                      f"{_plural(len(indices), 'index', 'indices')}", name.pos)
        return Read(name.text, indices)

    def index(self) -> IntExpr | Slice:
        if self.tok.text == ":" and self.toks[self.i + 1].text in (",", "]"):
            self.i += 1
            return Slice()
        if self.tok.text != ":":
            lo = self.int_expr()
            if self.tok.text != ":":
                return lo
            self.i += 1
            if self.tok.text not in (",", "]"):
                return Slice(lo, self.int_expr())
        self.fail("a tensor index is an expression, ':' or 'lo:hi'", self.tok.pos)


def parse(text: str, *, kind: str, task_rank: int, event_rank: int,
          tensors: Mapping[str, int] = _NO_TENSORS, etensor: str = "E") -> EdgeMap:
    """Parse and check one edge map of a ``call_device``: ``kind`` is "in" or "out",
    ``tensors`` maps the readable tensor arguments to their ranks. Raises ``EdgeMapError``."""
    if kind not in ("in", "out"):
        raise ValueError(f"kind must be 'in' or 'out', not {kind!r}")
    ranks = {"task": task_rank, "event": event_rank}
    return _Parser(text, kind, ranks, tensors, etensor).parse()
