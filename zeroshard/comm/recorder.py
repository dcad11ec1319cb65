"""The communication log: every collective the engine runs is recorded here.

Bytes are logical, in the nccl-tests sense of "size": the full buffer of the
collective (the input of all-reduce and reduce-scatter, the output of
all-gather and broadcast, the input of all-to-all), whatever algorithm ran it.
A quantized collective (ZeRO++, communication_compression) counts what it
sends: payload and scales; its `uncompressed` bytes are what the exact
collective of the same buffer would have counted, so `ratio` is the
compression an op got (1.0 for exact ops; a qgZ hop across nodes adds bytes,
not uncompressed ones: it has no exact counterpart).

Bytes are also split by scope when the comm knows where its group lies
(`Comm.scope`): "node" for a group inside one node, "cross_node" for one
that spans nodes. A comm of unknown scope adds to `bytes` only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# Where a comm's group lies (`Comm.scope`): inside one node, or across nodes.
Scope = Literal["node", "cross_node"]

# object_gather: all_gather_object of small picklable objects (checks that ranks agree), bytes pickled.
# step_check: before each optimizer step, an all-gather of each rank's few figures (norm, flag, counters).
# fault_check: after work that may fail on one rank alone (offload's disk I/O), an all-gather of a flag per rank.
# unit_check: at stage 3, the ranks' agreement on the units of a step (stage3/agreement.py), a few bytes per rank.
OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "object_gather", "step_check",
       "fault_check", "unit_check")


@dataclass
class OpStats:
    """Cumulative figures for one logical collective on this rank."""

    calls: int = 0
    bytes: int = 0  # logical buffer bytes, summed over calls
    seconds: float = 0.0  # time this rank spent blocked in the call or waiting on it
    algorithms: set[str] = field(default_factory=set)  # how the backend ran it
    by_scope: dict[Scope, int] = field(default_factory=dict)  # the bytes of calls whose scope is known, by scope
    uncompressed: int = 0  # what the same calls would have counted exact (= bytes when none is quantized)

    @property
    def ratio(self) -> float:
        """Bytes sent over what the exact calls would have sent (1.0: nothing compressed, or no call)."""
        return self.bytes / self.uncompressed if self.uncompressed else 1.0

    def copy(self) -> "OpStats":
        return OpStats(self.calls, self.bytes, self.seconds, set(self.algorithms), dict(self.by_scope),
                       self.uncompressed)


class CommRecorder:
    """Counts calls, bytes and blocked seconds per logical collective."""

    def __init__(self) -> None:
        self._stats = {op: OpStats() for op in OPS}

    def record(self, op: str, nbytes: int, algorithm: str, scope: Scope | None = None,
               uncompressed: int | None = None) -> None:
        """One call of `op`: `nbytes` logical bytes, run by `algorithm`, over a group of `scope` (None: unknown);
        `uncompressed`: a quantized call's exact counterpart's bytes (None: an exact call, `nbytes`)."""
        stats = self._stats[op]
        stats.calls += 1
        stats.bytes += nbytes
        stats.uncompressed += nbytes if uncompressed is None else uncompressed
        stats.algorithms.add(algorithm)
        if scope is not None:
            stats.by_scope[scope] = stats.by_scope.get(scope, 0) + nbytes

    def add_seconds(self, op: str, seconds: float) -> None:
        self._stats[op].seconds += seconds

    def snapshot(self) -> dict[str, OpStats]:
        return {op: stats.copy() for op, stats in self._stats.items()}
