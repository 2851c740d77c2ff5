"""Data tensors of a graph function: the ``Tensor`` type spec and the values seen while tracing."""
from __future__ import annotations

from typing import Sequence

import tvm
from tvm import relax, tirx

from .errors import EtcError

Dim = "int | str | tvm PrimExpr"


class Tensor:
    """A tensor type: ``Tensor(("B", 128), "bfloat16")``.

    Annotates a graph function's parameters and gives ``call_device`` its output types. A str
    dim is a symbolic size, one per name in a graph function (int64, as Relax shapes are).
    ``symmetric=True`` (call outputs only) makes one copy per rank at the same place (the
    symmetric heap), which the tasks of other ranks may write (a put) or read (a get).
    """

    def __init__(self, shape: Sequence, dtype: str = "float32", name: str | None = None,
                 symmetric: bool = False):
        if isinstance(shape, (int, str)) or tvm.ir.is_prim_expr(shape):
            shape = (shape,)
        self.shape = tuple(shape)
        self.dtype = str(dtype)
        self.name = name
        self.symmetric = bool(symmetric)

    def __repr__(self) -> str:
        sym = ", symmetric=True" if self.symmetric else ""
        return f"Tensor({self.shape}, {self.dtype!r}{sym})"


class TracedTensor:
    """A tensor-typed Relax variable of a graph function being traced."""

    var: relax.Var

    @property
    def shape(self) -> tuple:
        return tuple(self.var.ty.shape.values)

    @property
    def ndim(self) -> int:
        return len(self.shape)


class TensorValue(TracedTensor):
    """A data tensor inside a graph function being traced."""

    def __init__(self, var: relax.Var):
        self.var = var

    @property
    def name(self) -> str:
        return self.var.name

    @property
    def dtype(self) -> str:
        return str(self.var.ty.dtype)

    def __repr__(self) -> str:
        return f"<tensor {self.name}: {list(self.shape)} {self.dtype}>"


def dim_str(dim) -> str:
    """A dim as users write it: ``8``, not ``T.int64(8)``."""
    return str(int(dim)) if isinstance(dim, tirx.IntImm) else str(dim)


def shape_str(shape) -> str:
    return "[" + ", ".join(dim_str(d) for d in shape) + "]"


def as_dim(dim, symbols) -> tirx.Expr:
    """An int64 PrimExpr for a user dim; str names come from (and go into) ``symbols``."""
    if isinstance(dim, bool):
        raise EtcError(f"a dimension must be an int, a name or an expression, got {dim!r}")
    if isinstance(dim, int):
        if dim < 0:
            raise EtcError(f"a dimension must not be negative, got {dim}")
        return tirx.const(dim, "int64")
    if isinstance(dim, str):
        if not dim.isidentifier():
            raise EtcError(f"a symbolic dimension is a name, got {dim!r}")
        if dim not in symbols:
            symbols[dim] = tirx.Var(dim, "int64")
        return symbols[dim]
    if tvm.ir.is_prim_expr(dim):
        ty = str(dim.ty)
        if ty == "int64":
            return dim
        if ty.startswith("int"):
            return tirx.Cast("int64", dim)
    raise EtcError(f"a dimension must be an int, a name or an integer expression, got {dim!r}")
