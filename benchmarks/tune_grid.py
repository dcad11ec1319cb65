"""`zeroshard tune`'s choice against the whole grid, every candidate measured with the same trial runner.

    python benchmarks/tune_grid.py --out BENCHMARKS.md -- --model demo --device-mem 700MB \\
        --global-batch 32 --micro-batches 1 2 4 8 16 --top 3 --steps 4
    python benchmarks/tune_grid.py --out BENCHMARKS.md -- --model 100m --device-mem 2GB \\
        --global-batch 8 --micro-batches 1 2 4 --top 3 --steps 3

The flags after `--` are `zeroshard tune`'s. Three parts, one after the other:

1. tune: the search exactly as `zeroshard tune` runs it with those flags
   (`tune_search.search`: calibration, prediction, its top T measured), timed;
2. the grid: every candidate tune listed, those it rejected included,
   measured again as a trial of the same steps under the same limit
   (`tune_search.run_candidate`, tune's own runner), so tune's choice and the
   fastest are timed under the same conditions;
3. the comparison: tune's choice's grid step against the fastest grid step,
   per row of the global batch (the same global batch for every candidate
   when --global-batch is given); met when within 10%. Also: the choice ran
   without running out of memory, every out-of-memory or failed trial is
   recorded with its reason (and the search went on past it), and every
   trial ended within its timeout.

The section "## zeroshard tune against the whole grid: MODEL" goes into --out;
the figures into --json (default benchmarks/results/tune_grid_MODEL.json).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

from bench import command_line, machine  # noqa: E402
from report import write_section  # noqa: E402

from zeroshard.app.cli import build_parser  # noqa: E402
from zeroshard.app.tune.cli import make_setup  # noqa: E402
from zeroshard.app.tune.search import Row, Search, run_candidate, search  # noqa: E402
from zeroshard.app.tune.trials import Outcome, choose_limit  # noqa: E402
from zeroshard.app.units import human_bytes  # noqa: E402

WITHIN = 1.10  # the acceptance: tune's choice within 10% of the fastest configuration measured


def measure_grid(found: Search, steps: int, timeout: float, workdir: Path) -> list[Row]:
    """Every row of tune's table measured again, in the table's order; a fresh Row each (tune's stay as they are)."""
    grid = []
    for index, row in enumerate(found.rows, 1):
        print(f"grid {index}/{len(found.rows)}: {row.candidate.label()}", file=sys.stderr, flush=True)
        trial = run_candidate(row.candidate, found.setup, found.limit, steps, timeout, workdir / f"grid{index}")
        grid.append(Row(row.candidate, row.peak, row.reason, row.step, trial))
        print(f"  {trial.outcome.value} {trial.measured_step or trial.reason}", file=sys.stderr, flush=True)
    return grid


def _cell_seconds(row: Row | None) -> str:
    if row is None or row.trial is None:
        return ""
    return f"{row.trial.measured_step:.3f}" if row.trial.measured_step is not None else row.trial.outcome.value


def _table(found: Search, grid: list[Row]) -> list[str]:
    lines = ["| # | configuration | peak (pred.) | tune: fits | step s (pred.) | tune's trial s | grid: step s "
             "| grid: peak |", "|---:|---|---:|---|---:|---:|---:|---:|"]
    for index, (row, again) in enumerate(zip(found.rows, grid), 1):
        fits = "yes" if row.reason is None else row.reason.removeprefix(row.candidate.label() + ": ")
        label = f"**{row.candidate.label()}**" if row is found.choice else row.candidate.label()
        predicted = f"{row.step.total:.3f}" if row.step else ""
        lines.append(f"| {index} | {label} | {human_bytes(row.peak.device)} | {fits} | {predicted} | "
                     f"{_cell_seconds(row)} | {_cell_seconds(again)} | {human_bytes(max(again.trial.peak_bytes))} |")
    return lines


def verdicts(found: Search, grid: list[Row], timeout: float) -> tuple[list[str], dict]:
    """The acceptance lines ("met: ..." / "NOT met: ...") and their figures."""
    ran = [row for row in grid if row.measured_per_row() is not None]
    fastest = min(ran, key=Row.measured_per_row, default=None)
    choice = next((row for row in grid if found.choice is not None and row.candidate == found.choice.candidate), None)
    failed = [row for row in [*found.rows, *grid] if row.trial is not None and row.trial.outcome is not Outcome.OK]
    longest = max(row.trial.seconds for row in [*found.rows, *grid] if row.trial is not None)
    ratio = None if choice is None or fastest is None or choice.measured_per_row() is None \
        else choice.measured_per_row() / fastest.measured_per_row()
    chose_ran = found.choice is not None and found.choice.trial is not None and found.choice.trial.outcome is Outcome.OK

    def line(ok: bool, text: str) -> str:
        return f"- {'met' if ok else 'NOT met'}: {text}"

    lines = [line(chose_ran, "tune's choice ran its trial without running out of memory"),
             line(bool(failed), f"{len(failed)} trials ran out of memory or failed, each recorded with its reason "
                                "(below), and the search went on past them"),
             line(longest <= timeout + 5, f"every trial bounded: the longest took {longest:.1f} s of its "
                                          f"{timeout:g} s limit"),
             line(ratio is not None and ratio <= WITHIN,
                  f"tune's choice measured {ratio:.3f}x the fastest of the grid ({fastest.candidate.label()})"
                  if ratio is not None else "tune's choice or the grid's fastest did not run")]
    figures = {"ratio": ratio, "fastest": fastest.candidate.label() if fastest else None, "failed": len(failed),
               "longest_trial_seconds": longest}
    return lines, figures


def render(found: Search, grid: list[Row], tune_seconds: float, tune_args: argparse.Namespace) -> str:
    m, setup = machine(), found.setup
    verdict, _ = verdicts(found, grid, tune_args.trial_timeout)
    failures = [f"- {kind} {row.candidate.label()}: {row.trial.outcome.value}: {row.trial.reason}"
                for kind, rows in (("tune's trial,", found.rows), ("grid,", grid)) for row in rows
                if row.trial is not None and row.trial.outcome is not Outcome.OK]
    return "\n".join([
        f"## zeroshard tune against the whole grid: {setup.model}", "",
        f"- Date: {datetime.now(timezone.utc):%Y-%m-%d}; machine: {m['cpu']}, {m['cores']} cores, "
        f"{m['ram_gib']:.0f} GiB RAM, no GPU; torch {m['torch']}, gloo, {setup.ranks} ranks",
        f"- Model: {setup.model}, {found.counts.numel:,} parameters, {setup.dtype}, {setup.seq} tokens per row; "
        f"global batch {setup.global_batch or 'free (accumulation 1)'} rows",
        f"- Memory limit: {human_bytes(setup.device_mem)} per rank, each rank under its own {found.limit.kind}",
        f"- tune: calibration and {tune_args.top} trials of {tune_args.steps} steps in {tune_seconds:.0f} s; chose "
        f"{found.choice.candidate.label() if found.choice else 'nothing'}",
        f"- Grid: all {len(grid)} candidates measured again, {tune_args.steps} steps each, the median step after "
        "the first; step s = seconds per optimizer step", "",
        "Command:", "", "```", command_line(), "```", "",
        *_table(found, grid), "", *verdict, "", *failures, ""])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "BENCHMARKS.md")
    p.add_argument("--json", type=Path, default=None, help="default: benchmarks/results/tune_grid_MODEL.json")
    p.add_argument("tune", nargs=argparse.REMAINDER, help="-- then zeroshard tune's flags")
    args = p.parse_args()
    tune_args = build_parser().parse_args(["tune", *[f for f in args.tune if f != "--"]])
    setup = make_setup(tune_args)
    limit = choose_limit(tune_args.limit_with, setup.device_mem)
    workdir = Path(tempfile.mkdtemp(prefix="zeroshard-tune-grid-"))
    try:
        start = time.monotonic()
        found = search(setup, limit, tune_args.top, tune_args.steps, tune_args.trial_timeout, workdir / "tune")
        tune_seconds = time.monotonic() - start
        grid = measure_grid(found, tune_args.steps, tune_args.trial_timeout, workdir / "grid")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    text = render(found, grid, tune_seconds, tune_args)
    write_section(args.out, text)
    _, figures = verdicts(found, grid, tune_args.trial_timeout)
    path = args.json or HERE / "results" / f"tune_grid_{setup.model}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"command": command_line(), "tune_seconds": tune_seconds, **figures,
                                "choice": found.choice.candidate.label() if found.choice else None,
                                "rows": [_row_json(r, g) for r, g in zip(found.rows, grid)]}, indent=2) + "\n")
    print(text)
    return 0


def _row_json(row: Row, again: Row) -> dict:
    return {"label": row.candidate.label(), "peak": row.peak.as_dict(), "reason": row.reason,
            "predicted_step": row.step.as_dict() if row.step else None,
            "tune_trial": row.trial.as_dict() if row.trial else None, "grid_trial": again.trial.as_dict()}


if __name__ == "__main__":
    sys.exit(main())
