"""The step check: before each optimizer step the ranks agree, in one collective, on the gradients and counters.

Each rank sends five float64 figures, all-gathered (`comm.step_check`): the
sum of squares of its reduced gradients, whether any of them is inf or nan,
its `global_steps`, its `micro_steps`, and the running checksum of the
collectives it ran (`comm.trace.digest`, comm/watch/stall.py). From every rank's
row, every rank takes the same decisions:

- the ranks' counters differ: `CollectiveError` (they would reduce
  gradients of different steps into one update);
- the ranks' checksums differ: they ran different collectives (gathered
  another unit than their peers, of the same size or not), so what they
  reduced is not what they meant to: `CollectiveError` naming the first
  collective that differs, found by comparing the ranks' rings of recent
  collectives through the store; nothing is updated;
- some rank's gradients are non-finite: the step is not applied (the engine
  skips it, or raises `NonFiniteError`);
- else the global L2 norm, as `torch.nn.utils.clip_grad_norm_` computes it on
  one process, for `engine.get_global_grad_norm()` and for clipping (no
  second collective).

The squares are each bucket's fp32 norm (`torch._foreach_norm`), squared and
summed in float64: an inf or nan element makes its bucket's norm inf or nan,
and so does a bucket whose fp32 norm overflows (above ~1.8e19), which counts
as non-finite too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from zeroshard.comm import CollectiveError, Comm, divergence, step_check
from zeroshard.config.schema import NonFiniteConfig
from zeroshard.errors import ZeroshardError

_SQUARES, _NONFINITE, _GLOBAL_STEPS, _MICRO_STEPS, _RECORD = range(5)  # the columns of a rank's row


class NonFiniteError(ZeroshardError, FloatingPointError):
    """Gradients with inf or nan: raised on every rank, the step not applied (config `non_finite`)."""


@dataclass(frozen=True)
class StepCheck:
    """What every rank agreed on before an optimizer step."""

    norm: float  # global L2 norm of the unscaled gradients; inf if any element is inf or nan
    # Ranks whose reduced gradients (their shard at stages 1-3) hold inf or nan; empty: apply the step.
    nonfinite_ranks: tuple[int, ...]


def check_step(norms: list[torch.Tensor], comm: Comm, global_steps: int, micro_steps: int,
               loss_scale: float = 1.0, device: torch.device | None = None, record: Comm | None = None,
               peers: list[list[int]] | None = None) -> StepCheck:
    """Exchange this rank's figures with every rank (one collective) and agree on the step.

    `norms`: the L2 norms (`torch._foreach_norm`) of this rank's disjoint part
    of the reduced gradients (fp32), still multiplied by `loss_scale`: its
    shard at stages 1-3, and at stage 0 its shard's slice of the replicated
    gradient, so that the ranks split the work there too. The squares are
    summed over ranks, on `device` (the training device: NCCL's collectives take no host tensor,
    and offloaded gradients' norms are on the host). Raises `CollectiveError`, on every rank, if the
    ranks' counters differ, or their records of the collectives they ran: `record`'s (default `comm`),
    compared among each group of `peers` (ranks of `comm`; default: all of them), the ranks that run the
    same collectives (a mesh's data-parallel groups).
    """
    device = device or (norms[0].device if norms else torch.device("cpu"))
    squares = torch.zeros((), dtype=torch.float64, device=device)
    if norms:
        squares = torch.stack([n.to(device) for n in norms]).double().square().sum()
    # The checksum is below 2**32: exact in float64.
    record = record or comm
    counters = torch.tensor([global_steps, micro_steps, record.trace.digest], dtype=torch.float64, device=device)
    mine = torch.cat([squares.reshape(1), torch.isfinite(squares).logical_not().double().reshape(1), counters])
    rows = step_check(comm, mine).cpu().tolist()
    _check_counters(rows)
    _check_records(rows, comm.rank, record, peers or [list(range(len(rows)))])
    nonfinite = tuple(rank for rank, row in enumerate(rows) if row[_NONFINITE])
    if nonfinite:
        return StepCheck(math.inf, nonfinite)
    total = sum(row[_SQUARES] for row in rows)
    return StepCheck(math.sqrt(total) / loss_scale, ())


def _check_counters(rows: list[list[float]]) -> None:
    counters = [(int(row[_GLOBAL_STEPS]), int(row[_MICRO_STEPS])) for row in rows]
    if len(set(counters)) == 1:
        return
    at = ", ".join(f"rank {r} at step {g} (micro-step {m})" for r, (g, m) in enumerate(counters))
    raise CollectiveError(
        f"the ranks reached an optimizer step at different points of training: {at}. Their gradients "
        "would be averaged across different steps. Every rank must run the same number of engine.backward() "
        "and engine.step() calls (give each rank the same number of batches: drop the last uneven batch, or "
        "stop every rank together), and load the same checkpoint on every rank; restart from a checkpoint")


def _check_records(rows: list[list[float]], rank: int, record: Comm, peers: list[list[int]]) -> None:
    differ = [group for group in peers if len({rows[r][_RECORD] for r in group}) > 1]
    if not differ:
        return
    when = "at the step check the ranks found that they ran different collectives; no update was applied on any rank"
    if any(rank in group for group in differ):
        raise divergence(record, when)
    raise CollectiveError(f"{when}: ranks {differ[0]} did (their errors name the first collective that differs). "
                          "Every rank must run the same collectives in the same order; restart from a checkpoint")


def clip_coefficient(norm: float, max_norm: float) -> float:
    """The factor that brings a global norm of `norm` to at most `max_norm` (1.0 if it is already),
    as `torch.nn.utils.clip_grad_norm_` computes it."""
    return min(1.0, max_norm / (norm + 1e-6))


class NonFiniteSkips:
    """fp32 and bf16: the config's `non_finite` policy over the steps that were not applied."""

    def __init__(self, policy: NonFiniteConfig):
        self.policy = policy
        self.in_a_row = 0  # steps skipped since the last applied one

    def applied(self) -> None:
        self.in_a_row = 0

    def skipped(self, step: int, ranks: tuple[int, ...]) -> int:
        """Count step `step` as skipped (inf or nan on `ranks`); returns the skips in a row, or raises
        `NonFiniteError` as the policy says (the same on every rank: every argument is agreed)."""
        self.in_a_row += 1
        where = f"at step {step} (in the reduced gradients that rank(s) {', '.join(map(str, ranks))} hold)"
        if self.policy.action == "error":
            raise NonFiniteError(
                f"gradients hold inf or nan {where}: the step was not applied on any rank (weights, optimizer "
                "state and LR scheduler unchanged, the window's gradients dropped, counted in "
                "engine.skipped_steps). Look for the cause (a bad batch, a loss that is inf or nan, a learning "
                'rate too high), or set "non_finite": {"action": "skip"} to skip such steps and go on')
        if self.in_a_row > self.policy.max_consecutive_skips:
            raise NonFiniteError(
                f"gradients hold inf or nan in {self.in_a_row} consecutive steps ({step - self.in_a_row + 1} to "
                f"{step}; the last {where}), more than non_finite.max_consecutive_skips="
                f"{self.policy.max_consecutive_skips}: training is diverging, not meeting one bad batch. None of "
                "them was applied. Restart from the last checkpoint with a lower learning rate (or gradient "
                "clipping), check the data and the loss, or raise non_finite.max_consecutive_skips")
        return self.in_a_row
