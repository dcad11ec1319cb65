"""`zeroshard tune`'s search: count, calibrate, predict every candidate, measure the best few, choose.

1. Count the model on the meta device: Ψ, stage 3's units, one micro-batch's
   activations at each micro-batch with and without checkpointing.
2. Calibrate: one launch of the ranks (tune/calibrate.py) measures what a
   rank holds before any model and how fast the ranks compute and
   communicate together.
3. Predict each candidate's peak per rank (`tune_candidates.predict_peak`);
   reject those over the memory given, each with its reason; where offload
   has a pool, try it for those. Predict each remaining one's step
   (`tune_time.predict_step`) and rank by seconds per row of the global batch.
4. Measure them in that order, each a trial of a few steps under the limit
   (`tune_trials.run_trial`) of the very config tune writes, until `top` have
   run. A trial that runs out of memory, fails or times out is recorded with
   its reason, and the next one takes its place (at most 2 x `top` trials);
   after an out-of-memory trial, those predicted to need as much are passed over.
5. Choose the fastest measured; with `top` 0 the first predicted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from zeroshard.app.tune.candidates import (
    Candidate,
    Counts,
    Peak,
    Setup,
    count,
    grid,
    offload_variants,
    predict_peak,
    rejection,
)
from zeroshard.app.tune.config import ds_config, trial_argv, write_config
from zeroshard.app.tune.step_time import Calibration, StepTime, predict_step
from zeroshard.app.tune.trials import Limit, Outcome, TrialResult, run_trial
from zeroshard.app.units import human_bytes
from zeroshard.errors import ZeroshardError

log = logging.getLogger(__name__)


class TuneError(ZeroshardError, RuntimeError):
    """The search cannot go on (the calibration failed); the message says why and what to change."""


@dataclass
class Row:
    """One line of tune's table: a candidate, what was predicted and what was measured."""

    candidate: Candidate
    peak: Peak
    reason: str | None  # why it does not fit (None: it fits)
    step: StepTime | None = None  # predicted, for those that fit
    trial: TrialResult | None = None  # measured, for the top ones
    untried: str | None = None  # why the search did not try it after another ran out of memory

    @property
    def rows_per_step(self) -> int:
        return self.candidate.micro_batch * self.candidate.accumulation

    def predicted_per_row(self) -> float:
        return self.step.total / self.rows_per_step

    def measured_per_row(self) -> float | None:
        measured = self.trial.measured_step if self.trial is not None else None
        return None if measured is None else measured / self.rows_per_step


@dataclass
class Search:
    """Everything the search found: the table's rows in rank order, the skipped micro-batches, the choice."""

    setup: Setup
    counts: Counts
    calibration: Calibration
    limit: Limit
    rows: list[Row]
    skipped: list[tuple[str, str]]
    choice: Row | None = None


def calibrate(setup: Setup, counts: Counts, limit: Limit, timeout: float, workdir: Path) -> Calibration:
    """Run the calibration's ranks (uncapped, counted as the trials' limit counts); raises TuneError if it fails.

    It times the smallest micro-batch of the grid and the largest whose activations alone fit the device memory."""
    batches = sorted({candidate.micro_batch for candidate in grid(setup, counts)[0]})
    fitting = [b for b in batches if counts.activations[b, "none"][0] <= setup.device_mem]
    sizes = sorted({batches[0], max(fitting, default=batches[0])})
    out = workdir / "calibration.json"
    argv = ["zeroshard.app.tune.calibrate", "--model", setup.model, "--numel", str(counts.numel), "--seq",
            str(setup.seq), "--micro-batches", *map(str, sizes), "--dtype", setup.dtype, "--measure", limit.kind,
            "--out", str(out)]
    result = run_trial(argv, setup.ranks, Limit(limit.kind, None, limit.parent), timeout, workdir / "calibration")
    if result.outcome is not Outcome.OK:
        raise TuneError(f"the calibration run ({result.outcome.value}): {result.reason}; its logs are in "
                        f"{workdir / 'calibration'}")
    return Calibration.read(out)


def predict(setup: Setup, counts: Counts, calibration: Calibration) -> list[Row]:
    """Every candidate with its peak and reason, offload tried where one does not fit; those that fit first,
    fastest per row first, then the rest in grid order."""
    rows = []
    candidates, _ = grid(setup, counts)
    measured = (calibration.runtime, calibration.workspace(counts))
    for candidate in candidates:
        peak = predict_peak(candidate, setup, counts, *measured)
        rows.append(Row(candidate, peak, rejection(candidate, peak, setup)))
        if rows[-1].reason is not None:
            for variant in offload_variants(candidate, setup):
                peak = predict_peak(variant, setup, counts, *measured)
                rows.append(Row(variant, peak, rejection(variant, peak, setup)))
    for row in rows:
        if row.reason is None:
            row.step = predict_step(row.candidate, setup, counts, calibration)
    fit = sorted((r for r in rows if r.reason is None), key=Row.predicted_per_row)
    return fit + [r for r in rows if r.reason is not None]


def run_candidate(candidate: Candidate, setup: Setup, limit: Limit, steps: int, timeout: float,
                  trial_dir: Path) -> TrialResult:
    """One trial of `candidate`: its config written to `trial_dir`/ds_config.json, the demo trained on it."""
    config = trial_dir / "ds_config.json"
    write_config(config, ds_config(candidate, setup))
    argv = trial_argv(setup, config, steps, trial_dir / "steps.csv")
    return run_trial(argv, setup.ranks, limit, timeout, trial_dir, trial_dir / "steps.csv")


def measure(rows: list[Row], setup: Setup, limit: Limit, top: int, steps: int, timeout: float,
            workdir: Path) -> None:
    """Run rows that fit as trials in rank order until `top` have run; each row keeps its result.

    A trial that runs out of memory, fails or times out gives its place to the next row, up to 2 x `top`
    trials in all. After one runs out of memory, a row of the same kind (stage, offload, ZeRO++) predicted
    to need at least as much is not tried (`Row.untried` says so): within a kind the prediction orders
    the candidates as their memory does, whatever it leaves out.
    """
    ran = attempts = 0
    out_of_memory: list[Row] = []
    for row in (row for row in rows if row.reason is None):
        if ran == top or attempts == 2 * top:
            return
        heavier = next((r for r in out_of_memory if _kind(r) == _kind(row) and row.peak.device >= r.peak.device),
                       None)
        if heavier is not None:
            row.untried = f"predicted to need at least the {human_bytes(heavier.peak.device)} of " \
                          f"{heavier.candidate.label()}, which ran out of memory"
            continue
        attempts += 1
        log.info("trial %d: %s", attempts, row.candidate.label())
        row.trial = run_candidate(row.candidate, setup, limit, steps, timeout, workdir / f"trial{attempts}")
        measured = row.trial.measured_step
        log.info("  %s", f"{measured:.3f} s per step" if measured is not None
                 else f"{row.trial.outcome.value}: {row.trial.reason}")
        ran += row.trial.outcome is Outcome.OK
        if row.trial.outcome is Outcome.OUT_OF_MEMORY:
            out_of_memory.append(row)


def _kind(row: Row) -> tuple:
    c = row.candidate
    return c.stage, c.offload_optimizer, c.offload_params, c.zeropp


def choose(rows: list[Row], top: int) -> Row | None:
    """The fastest measured row per row of the global batch; with `top` 0 the first predicted one."""
    if top == 0:
        return next((row for row in rows if row.reason is None), None)
    ran = [row for row in rows if row.measured_per_row() is not None]
    return min(ran, key=Row.measured_per_row, default=None)


def search(setup: Setup, limit: Limit, top: int, steps: int, timeout: float, workdir: Path) -> Search:
    """Count, calibrate, predict, measure and choose (the module's steps 1-5)."""
    if top:  # refuse a model the trials cannot train before anything runs
        trial_argv(setup, Path("ds_config.json"), steps, Path("steps.csv"))
    counts = count(setup)
    calibration = calibrate(setup, counts, limit, timeout, workdir)
    rows = predict(setup, counts, calibration)
    measure(rows, setup, limit, top, steps, timeout, workdir)
    return Search(setup, counts, calibration, limit, rows, grid(setup, counts)[1], choose(rows, top))
