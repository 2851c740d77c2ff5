"""The errors etc_tvm raises for bad programs, one class per stage that can find them."""


class EtcError(ValueError):
    """Base of every error that reports a mistake in an etc_tvm program."""


class EdgeMapError(EtcError):
    """A malformed edge map: the message quotes the map and points at the offending position."""


class GraphError(EtcError):
    """A graph function or task graph that cannot run correctly: cycles, bad wait counts, ..."""


class ExecutionError(EtcError):
    """A run that went wrong: an out-of-range data-dependent index, an over-notified event."""


class DeadlockError(ExecutionError):
    """No task can make progress; the message lists the blocked tasks and their events."""
