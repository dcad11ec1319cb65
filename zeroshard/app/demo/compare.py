"""`zeroshard compare`: the demo once per stage, measured memory and traffic beside the estimate.

Each run is `zeroshard train ... --report DIR` in a child process (the same
torchrun launcher as `zeroshard train`); the figures come back through the
run's report.json, not its printed text. The runs are data (`RUNS`): a new
stage is one more entry.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from zeroshard import estimate
from zeroshard.app.estimate.cli import human_bytes
from zeroshard.app.flags import add_command, add_data, add_micro_batch, add_model, add_nproc, add_steps, as_argv
from zeroshard.app.demo.plots import COLLECTIVES, STATES, compare_chart


@dataclass(frozen=True)
class Run:
    """One demo run: a short key for --runs and the directory, a label, and its train flags."""

    key: str
    name: str
    flags: tuple[str, ...]


RUNS = (
    Run("0", "stage 0", ("--stage", "0")),
    Run("1", "stage 1", ("--stage", "1")),
    Run("1-allreduce", "stage 1 AR", ("--stage", "1", "--reduce-scatter", "false")),
    Run("2", "stage 2", ("--stage", "2")),
    Run("2-allreduce", "stage 2 AR", ("--stage", "2", "--reduce-scatter", "false")),
    Run("3", "stage 3", ("--stage", "3", "--nodes", "2")),
    Run("3-zeropp", "stage 3 ZeRO++", ("--stage", "3", "--zeropp", "--nodes", "2")),
)
_TRAIN_FLAGS = ("nproc", "steps", "model", "micro_batch", "data")  # passed on to each run's `zeroshard train`


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register `zeroshard compare` and its flags."""
    parser = add_command(
        commands, "compare", help="run the demo at every stage and put measured memory and traffic beside the estimate",
        description="Run the demo once per ZeRO stage (and with all-reduce instead of reduce-scatter)\n"
                    "on N local ranks, then print each run's measured per-rank model-state memory\n"
                    "and bytes per collective beside the ZeRO formulas, and draw both as a PNG.")
    add_nproc(parser, 4, "ranks (processes) per run")
    add_steps(parser, 20, "optimizer steps per run")
    add_model(parser)
    add_micro_batch(parser, 8, "sequences per rank per step; memory and traffic do not depend on it "
                               "(default: %(default)s)")
    add_data(parser)
    parser.add_argument("--runs", nargs="+", choices=[run.key for run in RUNS], default=[run.key for run in RUNS],
                        metavar="RUN", help=f"which runs, of {', '.join(run.key for run in RUNS)} (default: all)")
    parser.add_argument("--out", metavar="DIR", default="zeroshard-compare",
                        help="where each run's report, compare.json and compare.png go (default: %(default)s)")


def run(args: argparse.Namespace, console: Console | None = None) -> int:
    """Launch the runs one after another, then print the tables and write the chart."""
    console = console or Console()
    out = Path(args.out)
    runs = [r for r in RUNS if r.key in args.runs]
    reports = []
    for i, demo in enumerate(runs, 1):
        with console.status(f"run {i}/{len(runs)}: {demo.name} on {args.nproc} ranks, {args.steps} steps"):
            report = _launch(demo, args, out / demo.key)
        if report is None:
            console.print(f"[red]error[/]: the {demo.name} run failed; its output is above")
            return 1
        reports.append(report)
    rows = [_row(demo, report) for demo, report in zip(runs, reports)]
    console.print(memory_table(rows, args.nproc))
    console.print(comm_table(rows, args.nproc))
    (out / "compare.json").write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    compare_chart(out / "compare.png", rows, args.nproc)
    console.print(f"chart: {out / 'compare.png'}; figures: {out / 'compare.json'}")
    return 0 if all(row["memory_ok"] and row["comm_ok"] for row in rows) else 1


def _launch(demo: Run, args: argparse.Namespace, report_dir: Path) -> dict | None:
    """`zeroshard train` for one run; its report.json, or None (its output printed) if it failed."""
    cmd = [sys.executable, "-m", "zeroshard.app.cli", "train", *as_argv(args, _TRAIN_FLAGS, paths=("data",)),
           "--report", str(report_dir), *demo.flags]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stdout + done.stderr, file=sys.stderr)
        return None
    return json.loads((report_dir / "report.json").read_text(encoding="utf-8"))


def _row(demo: Run, report: dict) -> dict:
    """One run's measured figures (rank 0; the checks cover every rank) and the estimate."""
    memory, comm = report["memory_stats"], report["comm_stats"]
    expected_comm = report["estimate"]["comm"]
    return {
        "name": demo.name, "stage": report["config"]["zero_optimization"]["stage"],
        "psi_padded": report["psi_padded"],
        "memory": {k: memory[0][k] for k in STATES}, "staging": memory[0]["staging"],
        "memory_estimate": report["estimate"]["memory"],
        "memory_ok": all(rank[k] == v for rank in memory for k, v in report["estimate"]["memory"].items()),
        "comm": {op: comm[0][op]["bytes"] for op in COLLECTIVES},
        "calls": {op: comm[0][op]["calls"] for op in COLLECTIVES},
        "comm_estimate": expected_comm,
        "comm_ok": all(_comm_matches(rank, expected_comm, report["world_size"]) for rank in comm),
        "cross_node": sum(comm[0][op].get("by_scope", {}).get("cross_node", 0) for op in COLLECTIVES),
        "wire_bytes_per_rank": round(sum(estimate.wire_bytes(b, report["world_size"], op)
                                         for op, b in expected_comm.items())),
    }


def _comm_matches(rank: dict, expected: dict, world: int) -> bool:
    """Every collective equals the estimate, and the step check its own rule."""
    rules = expected | {"step_check": estimate.step_check_bytes(world)}
    return all(stats["bytes"] == rules.get(op, 0) for op, stats in rank.items())


def _ok(ok: bool) -> str:
    return "[green]✓[/]" if ok else "[red]✗[/]"


def memory_table(rows: list[dict], world: int) -> Table:
    """Model-state bytes per rank, measured (rank 0) and estimated, one row per run."""
    table = Table(title=f"Model states per rank, {world} ranks", title_justify="left", show_edge=False,
                  caption="measured: rank 0's memory_stats(); ok: every rank equals the estimate to the "
                          "byte; staging: communication staging memory, outside the formula; AR: "
                          "--reduce-scatter false; exact bytes in compare.json", caption_justify="left")
    states = [k for k in STATES if any(row["memory"][k] for row in rows)]  # master is 0 in fp32
    for column in ("run", *states, "total", "estimate", "staging", "ok"):
        table.add_column(column, justify="left" if column in ("run", "ok") else "right", no_wrap=True)
    for row in rows:
        table.add_row(row["name"], *(human_bytes(row["memory"][k]) for k in states),
                      human_bytes(sum(row["memory"].values())), human_bytes(sum(row["memory_estimate"].values())),
                      human_bytes(row["staging"]), _ok(row["memory_ok"]))
    return table


def comm_table(rows: list[dict], world: int) -> Table:
    """Logical bytes per optimizer step per collective, measured (rank 0) and estimated, one row per run."""
    table = Table(title=f"Communication per optimizer step (last step), {world} ranks", title_justify="left",
                  show_edge=False, caption_justify="left",
                  caption="AR all-reduce, RS reduce-scatter, AG all-gather: logical bytes as comm_stats() "
                          "records them; ok: every rank equals the estimate to the byte (and the step check its "
                          "own: 40 bytes per rank per step); sent/rank: bytes "
                          "each rank sends on rings, by the estimate; across nodes: RS + AG bytes of groups that span "
                          "the --nodes 2 declared on this machine (stage 3 runs)")
    for column in ("run", "AR", "RS", "AG", "total", "estimate", "across nodes", "sent/rank", "ok"):
        table.add_column(column, justify="left" if column in ("run", "ok") else "right", no_wrap=True)
    for row in rows:
        cells = [human_bytes(row["comm"][op]) if row["calls"][op] else "-" for op in COLLECTIVES]
        table.add_row(row["name"], *cells, human_bytes(sum(row["comm"].values())),
                      human_bytes(sum(row["comm_estimate"].values())),
                      human_bytes(row["cross_node"]) if row["cross_node"] else "-",
                      human_bytes(row["wire_bytes_per_rank"]), _ok(row["comm_ok"]))
    return table
