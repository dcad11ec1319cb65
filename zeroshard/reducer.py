"""GradReducer: launches the units' gradient reductions in a fixed order as backward frees them.

Every rank must issue the same collectives in the same order. Backward
finishes units in an order that can differ between ranks (a parameter unused
on one rank, threads racing), so a unit is launched only once it and every
unit before it in the fixed list are ready; a late unit delays its
successors but never swaps places with them. Units never reached (unused
parameters) are launched at the end of backward with zero gradients.
"""

from __future__ import annotations

from zeroshard.buffers import BufferPool
from zeroshard.comm import Comm, Pending
from zeroshard.unit import ShardedUnit


class GradReducer:
    """Per-backward bookkeeping: which units are ready, launched, in flight."""

    def __init__(self, units: list[ShardedUnit], comm: Comm, pool: BufferPool, overlap: bool,
                 max_in_flight: int = 1):
        self.units = units
        self.comm = comm
        self.pool = pool
        self.overlap = overlap
        # Reductions in flight while backward goes on: one overlaps the next unit's compute
        # (double buffering); more only hold more staging and scratch buffers.
        self.max_in_flight = max_in_flight
        self._missing = [0] * len(units)
        self._next = 0
        self._in_flight: list[Pending] = []
        self._reduce = False
        self._scale = 1.0
        self.active = False

    def begin(self, reduce: bool, scale: float) -> None:
        """Start one backward; `reduce` says whether this micro-step communicates."""
        self.active, self._reduce, self._scale, self._next = True, reduce, scale, 0
        self._missing = [sum(p.requires_grad for p in u.params) for u in self.units]
        for unit in self.units:
            unit.attach_grads()

    def on_grad(self, unit_index: int, param_index: int) -> None:
        """A parameter's gradient for this backward is complete (autograd hook)."""
        unit = self.units[unit_index]
        if unit.switches.shard_grads:
            unit.stage_grad(param_index, self.pool)
        self._missing[unit_index] -= 1
        if self._reduce:
            self._launch_ready()

    def finish(self) -> None:
        """After backward: launch what is left, in order, and wait for everything."""
        if self._reduce:
            while self._next < len(self.units):
                self._launch(self._next)
        for pending in self._in_flight:
            pending.wait()
        self._in_flight.clear()
        self.active = False

    def _launch_ready(self) -> None:
        while self._next < len(self.units) and self._missing[self._next] <= 0:
            self._launch(self._next)

    def _launch(self, index: int) -> None:
        self._next = index + 1
        while len(self._in_flight) >= self.max_in_flight:  # frees its buffers before taking new ones
            self._in_flight.pop(0).wait()
        pending = self.units[index].reduce_grad(self.comm, self.pool, self._scale)
        if self.overlap:
            self._in_flight.append(pending)
        else:
            pending.wait()
