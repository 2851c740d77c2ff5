"""The tracing context of a graph function: turns front-end calls into Relax bindings."""
from __future__ import annotations

from tvm import ir, relax

from .device_func import DeviceFunc
from .errors import EtcError

_ACTIVE: list["Tracer"] = []


class Tracer:
    """Collects one graph function: its Relax bindings, symbolic dims and device functions."""

    def __init__(self, world_size: int):
        self.builder = relax.BlockBuilder()
        self.symbols: dict = {}  # dim name -> int64 tirx.Var
        self.device_funcs: dict[str, DeviceFunc] = {}
        self.world_size = world_size
        self._gvars: dict[int, ir.GlobalVar] = {}
        self._names: set[str] = set()

    def __enter__(self) -> "Tracer":
        _ACTIVE.append(self)
        return self

    def __exit__(self, exc_type, *_) -> None:
        _ACTIVE.pop()
        if exc_type is not None:  # close what the failed trace left open in the builder
            self.builder._end_block()
            self.builder.end_scope()

    def emit(self, expr: relax.Expr, name: str) -> relax.Var:
        return self.builder.emit(expr, name)

    def claim_name(self, name: str | None, base: str) -> str:
        """A binding name unique in the graph function: ``name`` as given, else ``base<n>``."""
        if name is not None:
            if name in self._names:
                raise EtcError(f"two values of the graph function are named {name!r}")
            self._names.add(name)
            return name
        n = 0
        while f"{base}{n}" in self._names:
            n += 1
        self._names.add(f"{base}{n}")
        return f"{base}{n}"

    def global_var(self, fn: DeviceFunc) -> ir.GlobalVar:
        """The module's GlobalVar of a device function, added on first use."""
        if id(fn) not in self._gvars:
            name = fn.name
            n = 1
            while name in self.device_funcs:
                name, n = f"{fn.name}_{n}", n + 1
            attrs = {"global_symbol": name, "tirx.is_scheduled": True, "etc.device_func": name,
                     "etc.cost": fn.cost}
            if fn.tensor_maps:
                attrs["etc.tensor_maps"] = [m.as_attr() for m in fn.tensor_maps]
            if fn.checks:
                attrs["etc.checks"] = list(fn.checks)
            if fn.requires:
                attrs["etc.requires"] = [[cond, what] for cond, what in fn.requires]
            prim = fn.prim_func.with_attr(attrs)
            self._gvars[id(fn)] = self.builder.add_func(prim, name)
            self.device_funcs[name] = fn
        return self._gvars[id(fn)]


def current(what: str) -> Tracer:
    if not _ACTIVE:
        raise EtcError(f"{what} can only be used inside a @graph_func")
    return _ACTIVE[-1]
