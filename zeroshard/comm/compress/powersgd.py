"""PowerSGD (Vogels et al. 2019, Algorithm 1): the low-rank all-reduce of one bucket's gradients (stages 0-1).

It runs as torch's DDP hook `powerSGD_hook` runs it
(torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py), to the bit
for the same gradients, rank and seed (tests/comm/compress/test_powersgd.py). For one
bucket and one optimizer step, M being each rank's own gradients (the
window's sum):

1. warm-up: the first `start_step` reductions are one exact all-reduce
   (each rank's gradients divided by N first, as torch's);
2. error feedback: M += error, this rank's error of the last step;
3. each tensor is viewed as a matrix (n, m) and compressed when that pays
   (`estimate.low_rank_plan`); the rest travel exactly, in one flat
   all-reduce, and become their mean;
4. each compressed matrix: Q (m, r) is the last step's (warm start) or a
   random start, orthogonalized; P = M Q; all-reduce P (the sum); P
   orthogonalized; Q = M^T P; all-reduce Q; Q /= N; M = P Q^T, the rank-r
   approximation of the mean;
5. error = M (as in 2) - the result of 3-4.

A bucket's Ps and Qs are one fp32 buffer each, the matrices grouped by
their (n, m) in order of first appearance (torch's layout: the random starts
are drawn in that order). Everything is computed and sent in fp32, whatever
the reduce dtype.

The error, as torch keeps it: each rank's own input less the common result,
so besides what the approximation left out it holds the rank's deviation
from the mean (of its exact tensors too), which sums to zero over the
ranks. Only the sum of the ranks' errors, N x what the mean lost, reaches a
result, since P, Q and the exact part are sums over the ranks. A rank's own
error therefore drifts like a random walk of its deviations; in fp32 that
costs nothing a run of 10^5 steps would see.

Seeds: every random start draws one seed from `QSeeds`, numpy's
RandomState(0) as torch's PowerSGDState.rng, in the order the buckets
reduce, the same on every rank. Beyond torch: a zero column (a matrix whose
gradients are all zero) stays zero where torch divides by its norm, 0, and
gets nan; and a result that holds inf or nan (an overflowed gradient: the
engine skips that step) leaves the state (error, Q) as it was, so one bad
batch does not poison every later step.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from zeroshard.comm.collectives import Comm, Landing, Pending, all_reduce
from zeroshard.config.compression import GradientCompression
from zeroshard.estimate.powersgd import LowRank, low_rank_plan, powersgd_sizes

SEED = 0  # torch's PowerSGDState random_seed default
_SEEDS_BELOW = 1_000_000_000  # torch draws each start's seed as rng.randint(10^9)


class QSeeds:
    """The seeds of Q's random starts: one sequence for all buckets, drawn in reduction order on every rank."""

    def __init__(self, seed: int = SEED):
        self.seed = seed
        self.restore(0)

    def draw(self) -> int:
        self.draws += 1
        return int(self._rng.randint(_SEEDS_BELOW))

    def restore(self, draws: int) -> None:
        """Stand where `draws` seeds were drawn (a checkpoint's buckets' draws, summed)."""
        self._rng = np.random.RandomState(self.seed)
        if draws:
            self._rng.randint(_SEEDS_BELOW, size=draws)  # the same numbers as `draws` draws one by one
        self.draws = draws


def orthogonalize(matrices: torch.Tensor) -> None:
    """Orthonormal columns for each matrix of a batch (B, n, r), r <= n, in place: torch's `_orthogonalize`
    (QR for r > 2, Gram-Schmidt for r <= 2), except that a zero column stays zero (torch: 0 / 0)."""
    batch, _, rank = matrices.shape
    if rank > 2:
        torch.linalg.qr(matrices, out=(matrices, matrices.new_empty(batch, rank, rank)))
        return
    for i in range(rank):
        col = matrices[:, :, i : i + 1]
        norm = torch.norm(col, dim=1, keepdim=True)
        col /= norm.masked_fill_(norm == 0, 1.0)
        if i + 1 < rank:
            rest = matrices[:, :, i + 1 :]
            rest -= torch.sum(col * rest, dim=1, keepdim=True) * col


class PowerSgd:
    """One bucket's PowerSGD: which of its tensors are compressed, and the state it carries between steps.

    State (fp32, on the bucket's device, allocated once; `tensors()`):
    `p` and `q` (1-D: every compressed matrix's P (n x r) and Q (m x r));
    `error` (1-D, the bucket's elements without padding; None without
    error feedback). Counters: `step` (reductions so far: stages 0-1 reduce
    once per optimizer step), `draws` (this bucket's random starts),
    `q_valid` (q holds the last step's Q, for the warm start).
    """

    def __init__(self, shapes: list[torch.Size], settings: GradientCompression, seeds: QSeeds,
                 device: torch.device):
        self.settings, self.seeds = settings, seeds
        numels = [s.numel() for s in shapes]
        self.numel = sum(numels)
        offsets = [sum(numels[:i]) for i in range(len(shapes))]
        self._tensors = list(zip(offsets, shapes))  # where each tensor lies in the bucket, and its shape
        plan = low_rank_plan([tuple(s) for s in shapes], settings.rank)
        self._exact = [i for i, low in enumerate(plan) if low is None]
        by_matrix: dict[tuple[int, int], list[int]] = {}
        for i, low in enumerate(plan):
            if low is not None:
                by_matrix.setdefault((low.n, low.m), []).append(i)
        self._compressed: list[tuple[int, LowRank]] = [(i, plan[i]) for group in by_matrix.values() for i in group]
        sizes = powersgd_sizes([tuple(s) for s in shapes], settings.rank)
        self.p = torch.zeros(sizes.p, dtype=torch.float32, device=device)
        self.q = torch.zeros(sizes.q, dtype=torch.float32, device=device)
        self.error = torch.zeros(self.numel, dtype=torch.float32, device=device) if settings.error_feedback else None
        self.step, self.draws, self.q_valid = 0, 0, False

    def tensors(self) -> list[torch.Tensor]:
        """What this bucket keeps between steps (memory_stats()['compression'])."""
        return [t for t in (self.p, self.q, self.error) if t is not None]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps, 1-D: `q`, `error` (with error feedback), `counters` (int64: step, draws,
        q_valid). P is made anew at every step."""
        state = {"q": self.q, "counters": torch.tensor([self.step, self.draws, int(self.q_valid)])}
        return state | ({"error": self.error} if self.error is not None else {})

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Take a `state_dict()` of a bucket like this one (the seeds are restored apart: `QSeeds.restore`)."""
        self.q.copy_(state["q"])
        if self.error is not None:
            self.error.copy_(state["error"])
        self.step, self.draws, q_valid = (int(v) for v in state["counters"].tolist())
        self.q_valid = bool(q_valid)

    def reset(self, step: int) -> None:
        """Start over at reduction `step`: no error, Q drawn afresh (a checkpoint's state could not be used)."""
        if self.error is not None:
            self.error.zero_()
        self.step, self.q_valid = step, False

    def reduce(self, comm: Comm, buffer: torch.Tensor, what: str = "") -> Landing:
        """The mean over the group of each rank's gradients, `buffer`'s first `numel` elements (1-D, in the
        reduce dtype), written over them; exact during the warm-up, of rank r after it. Launches the exact
        part's and P's all-reduces now; `wait` runs the rest (Q's all-reduce needs the sum of P first)."""
        grads = buffer[: self.numel]
        self.step += 1
        if self.step <= self.settings.start_step:
            return all_reduce(comm, grads.div_(comm.world_size), what=what)
        work = grads if grads.dtype == torch.float32 else grads.float()
        kept = None
        if self.error is not None:
            work.add_(self.error)
            kept = work.clone()  # M with the error: the next error is measured against it
        views = [work[offset : offset + shape.numel()].view(shape) for offset, shape in self._tensors]
        exact = torch.cat([views[i].reshape(-1) for i in self._exact]) if self._exact else None
        exact_sum = all_reduce(comm, exact, what=f"{what} (PowerSGD, exact part)") if exact is not None else None
        matrices = [views[i].view(low.n, -1).unsqueeze(0) for i, low in self._compressed]
        ps, qs = self._views(self.p, "n"), self._views(self.q, "m")
        q_before = self.q.clone() if self.q_valid else None
        self._start_q(qs)
        for m, q, p in zip(matrices, qs, ps):
            torch.bmm(m, q, out=p)
        p_sum = all_reduce(comm, self.p, what=f"{what} (PowerSGD, P)") if self._compressed else None

        def finish() -> None:
            n = comm.world_size
            if exact_sum is not None:
                exact_sum.wait()
                exact.div_(n)
                for i, values in zip(self._exact, exact.split([views[i].numel() for i in self._exact])):
                    views[i].copy_(values.view_as(views[i]))
            if p_sum is not None:
                self._approximate(comm, p_sum, matrices, ps, qs, what)
            self._keep(work, kept, q_before)
            if work is not grads:
                grads.copy_(work)

        return LowRankPending(finish)

    def _views(self, buffer: torch.Tensor, side: str) -> list[torch.Tensor]:
        """Each compressed matrix's P (1, n, r) or Q (1, m, r) in `buffer`."""
        views, at = [], 0
        for _, low in self._compressed:
            rows = low.n if side == "n" else low.m
            views.append(buffer[at : at + rows * low.r].view(1, rows, low.r))
            at += rows * low.r
        return views

    def _start_q(self, qs: list[torch.Tensor]) -> None:
        """Q to multiply by: the last step's, orthogonalized (warm start), or a random start every rank draws
        alike (torch draws the seed even for a bucket with nothing to compress)."""
        if self.q_valid and self.settings.warm_start:
            for q in qs:
                orthogonalize(q)
            return
        generator = torch.Generator().manual_seed(self.seeds.draw())
        self.draws += 1
        for q in qs:  # drawn on the CPU, as torch's, so that every device starts from the same values
            q.copy_(torch.randn(*q.shape, generator=generator, dtype=torch.float32))
            orthogonalize(q)

    def _approximate(self, comm: Comm, p_sum: Pending, matrices: list[torch.Tensor], ps: list[torch.Tensor],
                     qs: list[torch.Tensor], what: str) -> None:
        """Once P is summed: Q = M^T P, summed and averaged, and each matrix replaced by P Q^T."""
        p_sum.wait()
        for p in ps:
            orthogonalize(p)
        for m, p, q in zip(matrices, ps, qs):
            torch.bmm(m.transpose(1, 2), p, out=q)
        all_reduce(comm, self.q, what=f"{what} (PowerSGD, Q)").wait()
        self.q.div_(comm.world_size)
        for p, q, m in zip(ps, qs, matrices):
            torch.bmm(p, q.transpose(1, 2), out=m)

    def _keep(self, result: torch.Tensor, kept: torch.Tensor | None, q_before: torch.Tensor | None) -> None:
        """The state for the next step: the new error and Q; or, when the result is not finite (a step the
        engine skips), the state as it was (the same on every rank: the result is)."""
        if not bool(torch.isfinite(result).all()):
            if q_before is not None:
                self.q.copy_(q_before)
            self.q_valid = q_before is not None
            return
        if kept is not None:
            torch.sub(kept, result, out=self.error)
        self.q_valid = self.settings.warm_start


class LowRankPending(Landing):
    """A PowerSGD reduction in flight: its exact part and P launched; `wait` runs the rest, once."""

    def __init__(self, finish: Callable[[], None]):
        super().__init__()
        self._finish: Callable[[], None] | None = finish
        self._failure: BaseException | None = None

    def wait(self) -> None:
        if self._failure is not None:  # failed once: it never lands
            raise self._failure
        if self._done:
            return
        finish, self._finish = self._finish, None
        try:
            finish()
        except BaseException as error:
            self._failure = error
            raise
        self._landed()
