"""ETensor: an N-d array of event counters, the unit of synchronisation between tile tasks.

Element ``E[i]`` starts at its wait count; every notify of a producer task decrements it, and a
consumer task that waits on it runs once it reaches 0. The shape may be symbolic, so the
dependency graph stays a template until the sizes are known at run time.
"""
from __future__ import annotations

import re
from typing import Sequence

import tvm

from . import ops, tracing
from .errors import EtcError
from .tensor import TensorValue, TracedTensor, as_dim, shape_str

_SHARD = re.compile(r"S\[(\d+)\]")


class ETensor(TracedTensor):
    """``ETensor(shape, wait_count=None, shard=None, name=None)``, inside a ``@graph_func``.

    wait_count: None infers each element's count from the producers' ``out_edges``; an int gives
      every element that count; an int32 tensor of the same shape gives per-element counts known
      only at run time (tokens routed to each expert, say).
    shard: ``"S[k]"`` shards the ETensor along dim k across ranks (see ``local_view``).
    """

    def __init__(self, shape: Sequence, wait_count=None, shard: str | None = None,
                 name: str | None = None):
        tracer = tracing.current("ETensor")
        if isinstance(shape, int) or isinstance(shape, str) or tvm.ir.is_prim_expr(shape):
            shape = (shape,)
        dims = [as_dim(d, tracer.symbols) for d in shape]
        if not dims:
            raise EtcError("an ETensor needs at least one dimension")
        self.name = tracer.claim_name(name, "E")
        self.shard_dim = _parse_shard(shard, len(dims), self.name)
        count = wait_count
        if isinstance(wait_count, TensorValue):
            _check_count_tensor(wait_count, dims, self.name)
            count = wait_count.var
        elif isinstance(wait_count, bool) or not (
                wait_count is None or isinstance(wait_count, int)):
            raise EtcError(f"ETensor {self.name}: wait_count must be None, an int or an int32 "
                           f"tensor, got {wait_count!r}")
        elif isinstance(wait_count, int) and wait_count < 0:
            raise EtcError(f"ETensor {self.name}: wait_count must not be negative")
        self.wait_count = wait_count
        self.var = tracer.emit(ops.event_tensor(dims, name=self.name, wait_count=count,
                                                shard=shard), self.name)

    def local_view(self) -> "ETensor":
        """This rank's shard: dim k of the shape divided by the world size."""
        if self.shard_dim is None:
            raise EtcError(f"ETensor {self.name} is not sharded: local_view needs shard='S[k]'")
        tracer = tracing.current("ETensor.local_view")
        shape = list(self.shape)
        shape[self.shard_dim] = shape[self.shard_dim] // tracer.world_size
        view = object.__new__(ETensor)
        view.name, view.shard_dim, view.wait_count = self.name, None, self.wait_count
        view.var = tracer.emit(ops.local_view(self.var, shape, tracer.world_size),
                               tracer.claim_name(None, f"{self.name}_local"))
        return view

    def __repr__(self) -> str:
        return f"<ETensor {self.name}: {list(self.shape)}>"


def _parse_shard(shard: str | None, ndim: int, name: str) -> int | None:
    if shard is None:
        return None
    m = _SHARD.fullmatch(str(shard).replace(" ", ""))
    if not m:
        raise EtcError(f"ETensor {name}: shard must look like 'S[0]', got {shard!r}")
    dim = int(m.group(1))
    if dim >= ndim:
        raise EtcError(f"ETensor {name}: shard {shard!r} names dim {dim} of a {ndim}-d ETensor")
    return dim


def _check_count_tensor(counts: TensorValue, dims: list, name: str) -> None:
    if counts.dtype != "int32":
        raise EtcError(f"ETensor {name}: a wait_count tensor must be int32, "
                       f"{counts.name} is {counts.dtype}")
    analyzer = tvm.sym.Analyzer()
    if len(counts.shape) != len(dims) or not all(
            analyzer.can_prove_equal(a, b) for a, b in zip(counts.shape, dims)):
        raise EtcError(f"ETensor {name}: its wait_count tensor {counts.name} has shape "
                       f"{shape_str(counts.shape)}, the ETensor {shape_str(dims)}")
