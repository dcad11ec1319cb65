"""`zeroshard tune`'s step-time model: a candidate's seconds per optimizer step, from the calibration's figures.

    step = A x (a + b x B) x (4/3 with checkpointing) + adam x E + wire bytes / bandwidth

- A micro-steps of B rows each; a + b x B is one micro-step's forward and
  backward, the line through the calibration's two micro-batches (through
  the origin with one): compute, about 6 x Ψ x tokens, at the rate this
  machine's ranks reach all at once. Checkpointing runs each block's forward
  again inside backward; a forward is about a third of forward + backward,
  hence 4/3.
- adam x E: the optimizer step over the E elements a rank steps (Ψ at
  stage 0, its shard at stages 1-3), at the calibration's seconds per element.
- The bytes each rank sends per step on rings (`zeroshard.estimate`:
  `comm_bytes_per_step` at stages 0-2, `stage3_comm_bytes` at stage 3, with
  ZeRO++'s parts when on), at the bandwidth the calibration's all-reduce
  reached, added to the compute: on a CPU the collectives and the compute
  share the cores.

Left out, and measured by the trials instead: offload's disk reads and
writes and host-device copies, the quantization work of ZeRO++, the step
check's few bytes, and any overlap of communication with compute.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from zeroshard.app.tune.candidates import Candidate, Counts, Setup
from zeroshard.estimate import (
    DTYPE_BYTES,
    ZeroPP,
    comm_bytes_per_step,
    shard_numel,
    stage3_comm_bytes,
    wire_bytes,
)

RECOMPUTE = 4 / 3  # forward + backward + the forward again, over forward + backward


@dataclass(frozen=True)
class Calibration:
    """What the calibration measured on this machine's ranks (tune/calibrate.py), the slowest rank's figures."""

    runtime: int  # bytes a rank holds before any model
    forward_backward: dict[int, float]  # micro-batch -> seconds of one forward + backward
    step_added: dict[int, int]  # micro-batch -> bytes a forward + backward added at its peak, gradients held
    adam_per_element: float  # seconds of AdamW per fp32 element
    bandwidth: float | None  # bytes each rank sends per second in an all-reduce (None: one rank)

    @classmethod
    def read(cls, path: Path) -> Calibration:
        figures = json.loads(path.read_text(encoding="utf-8"))
        return cls(figures["runtime"], {int(b): s for b, s in figures["forward_backward"].items()},
                   {int(b): n for b, n in figures["step_added"].items()}, figures["adam_per_element"],
                   figures["bandwidth"])

    def workspace(self, counts: Counts) -> float:
        """The temporaries of a forward + backward as a fraction of its saved activations (the counted ones):
        what the calibration's step added at its peak over the count, the largest ratio of its micro-batches."""
        return max(max(0.0, added / counts.activations[b, "none"][0] - 1) for b, added in self.step_added.items())

    def micro_step(self, micro_batch: int) -> float:
        """Seconds of one forward + backward of `micro_batch` rows: the line through the measured points."""
        points = sorted(self.forward_backward.items())
        (b0, s0), (b1, s1) = points[0], points[-1]
        if b0 == b1:
            return s0 * micro_batch / b0
        slope = (s1 - s0) / (b1 - b0)
        return max(0.0, s0 + slope * (micro_batch - b0))

    def as_dict(self) -> dict:
        return {"runtime": self.runtime, "forward_backward": self.forward_backward, "step_added": self.step_added,
                "adam_per_element": self.adam_per_element, "bandwidth": self.bandwidth}


@dataclass(frozen=True)
class StepTime:
    """A candidate's predicted seconds per optimizer step, by part."""

    compute: float
    optimizer: float
    comm: float

    @property
    def total(self) -> float:
        return self.compute + self.optimizer + self.comm

    def as_dict(self) -> dict:
        return {"compute": self.compute, "optimizer": self.optimizer, "comm": self.comm, "total": self.total}


def wire_bytes_per_step(candidate: Candidate, setup: Setup, counts: Counts) -> float:
    """Bytes each rank sends per optimizer step on rings, from the estimate's logical bytes per collective."""
    elem = DTYPE_BYTES[setup.dtype][0]  # parameters and gradients travel in the training dtype
    if candidate.stage < 3:
        by_op = comm_bytes_per_step(counts.numel, candidate.stage, elem_bytes=elem,
                                    accumulation=candidate.accumulation)
    else:
        parts = ZeroPP(qwz=True, hpz=setup.ranks_per_node > 1, qgz=True) if candidate.zeropp else ZeroPP()
        scoped = stage3_comm_bytes(counts.flats, setup.ranks, setup.ranks_per_node, elem,
                                   accumulation=candidate.accumulation, zeropp=parts)
        by_op = {op: sum(scopes.values()) for op, scopes in scoped.items()}
    return sum(wire_bytes(nbytes, setup.ranks, op) for op, nbytes in by_op.items())


def predict_step(candidate: Candidate, setup: Setup, counts: Counts, calibration: Calibration) -> StepTime:
    """The candidate's seconds per optimizer step (the module's model)."""
    compute = candidate.accumulation * calibration.micro_step(candidate.micro_batch)
    if candidate.checkpointing == "full":
        compute *= RECOMPUTE
    stepped = counts.numel if candidate.stage == 0 else shard_numel(counts.numel, setup.ranks)
    sent = wire_bytes_per_step(candidate, setup, counts)
    comm = 0.0 if calibration.bandwidth is None else sent / calibration.bandwidth
    return StepTime(compute, calibration.adam_per_element * stepped, comm)
