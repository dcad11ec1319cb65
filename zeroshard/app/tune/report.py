"""`zeroshard tune`'s output: the table of every candidate (predicted peak, fit or the reason it does not, predicted
step, measured step or how its trial ended), the choice, and the same as one JSON object with --json."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from rich.console import Console
from rich.table import Table

from zeroshard.app.tune.candidates import Candidate
from zeroshard.app.tune.search import Row, Search
from zeroshard.app.units import human_bytes, human_count


def _seconds(value: float | None) -> str:
    return "" if value is None else f"{value:.3f} s"


def _measured(row: Row) -> str:
    """The measured step of a row's trial, or how the trial ended."""
    if row.trial is None:
        return "passed over" if row.untried else ""
    return _seconds(row.trial.measured_step) if row.trial.measured_step is not None else row.trial.outcome.value


def _more(candidate: Candidate) -> str:
    """Offload and ZeRO++, briefly: "opt nvme", "opt+par cpu", "ZeRO++"."""
    if candidate.offload_optimizer != "none":
        return ("opt+par " if candidate.offload_params != "none" else "opt ") + candidate.offload_optimizer
    return "ZeRO++" if candidate.zeropp else ""


def print_search(console: Console, search: Search, out: Path | None) -> None:
    """The setup and calibration, the table, the trials' failures, and the choice."""
    setup, cal = search.setup, search.calibration
    console.print(f"[bold]{setup.model}[/]: Ψ = {search.counts.numel:,} ({human_count(search.counts.numel)}), "
                  f"{setup.dtype}, {setup.seq} tokens per row; {setup.ranks} ranks"
                  + f" as {setup.nodes} nodes" * (setup.nodes > 1)
                  + f", {human_bytes(setup.device_mem)} per rank, trials capped by {search.limit.kind}")
    console.print("calibration: runtime " + human_bytes(cal.runtime) + " per rank; forward + backward "
                  + ", ".join(f"{s:.3f} s at micro-batch {b}" for b, s in sorted(cal.forward_backward.items()))
                  + f"; AdamW {cal.adam_per_element * 1e9:.2f} ns per element"
                  + (f"; all-reduce {human_bytes(cal.bandwidth)}/s per rank" if cal.bandwidth else ""))
    table = Table(show_edge=False)
    for column in ("#", "stage", "micro", "accum", "ckpt", "more", "peak", "fits", "step", "measured"):
        table.add_column(column, justify="left" if column in ("ckpt", "more", "fits") else "right")
    for index, row in enumerate(search.rows, 1):
        c = row.candidate
        table.add_row(str(index), str(c.stage), str(c.micro_batch), str(c.accumulation),
                      "full" if c.checkpointing == "full" else "", _more(c), human_bytes(row.peak.device),
                      "yes" if row.reason is None else "no", _seconds(row.step.total if row.step else None),
                      _measured(row), style="bold" if row is search.choice else None)
    console.print(table)
    for index, row in enumerate(search.rows, 1):
        if row.reason is not None:
            console.print(f"{index:>3} {row.reason}", highlight=False)
        elif row.trial is not None and row.trial.measured_step is None:
            console.print(f"{index:>3} [red]{row.trial.outcome.value}[/]: {row.trial.reason}", highlight=False)
        elif row.untried:
            console.print(f"{index:>3} passed over: {row.untried}", highlight=False)
    for label, reason in search.skipped:
        console.print(f"  - {label}: {reason}", highlight=False)
    console.print("[dim]micro: rows per micro-step; accum: micro-steps per step; ckpt: activation checkpointing; "
                  "more: offload of the optimizer state (opt) and parameters (par), ZeRO++\n"
                  "peak: predicted per rank: runtime + model states + buffers + activations (+ one block's "
                  "recompute with checkpointing)\n"
                  "step: predicted seconds per optimizer step: micro-steps x measured forward + backward (x 4/3 "
                  "with checkpointing) + AdamW over the rank's elements + bytes sent / measured bandwidth\n"
                  "measured: the trial's median step after the first, or how the trial ended (above)[/]")
    _print_choice(console, search, out)


def _print_choice(console: Console, search: Search, out: Path | None) -> None:
    choice = search.choice
    if choice is None:
        console.print(f"[red]no configuration ran[/]: {why_none(search)}", highlight=False)
        return
    trial = choice.trial
    how = "by the estimate (no trial)" if trial is None else \
        f"measured {trial.measured_step:.3f} s per step, peak {human_bytes(max(trial.peak_bytes))} per rank;"
    console.print(f"[bold green]chose[/] {choice.candidate.label()}: {how} predicted {choice.step.total:.3f} s, "
                  f"{human_bytes(choice.peak.device)}", highlight=False)
    if out is not None:
        console.print(f"wrote {out}; run it: zeroshard train --config {out} --model {search.setup.model} "
                      f"--nproc {search.setup.ranks}", highlight=False)


def why_none(search: Search) -> str:
    """Why the search chose nothing, and what to change: nothing fitted the limit, or every trial failed."""
    if all(row.reason is not None for row in search.rows):
        least = min(row.peak.device for row in search.rows)
        return (f"no configuration fits {human_bytes(search.setup.device_mem)} per rank (the least any needs is "
                f"{human_bytes(least)}, the reasons above); raise --device-mem to at least that, try smaller "
                "micro-batches, or give a pool to offload to (--disk-mem with --nvme-path)")
    return "every trial failed (above); raise --device-mem, add micro-batches, or raise --trial-timeout"


def _row_dict(row: Row) -> dict:
    return {"label": row.candidate.label(), **dataclasses.asdict(row.candidate), "peak": row.peak.as_dict(),
            "fits": row.reason is None, "reason": row.reason,
            "predicted_step": row.step.as_dict() if row.step else None,
            "trial": row.trial.as_dict() if row.trial else None, "untried": row.untried}


def search_dict(search: Search, config: dict | None, out: Path | None) -> dict:
    """The search as one JSON object: bytes, seconds; candidates in the table's order."""
    return {"model": search.setup.model, "params": search.counts.numel,
            "setup": dataclasses.asdict(search.setup), "limit": {"kind": search.limit.kind,
                                                                  "bytes": search.limit.nbytes},
            "calibration": search.calibration.as_dict(),
            "candidates": [_row_dict(row) for row in search.rows],
            "skipped": [{"label": label, "reason": reason} for label, reason in search.skipped],
            "choice": search.choice.candidate.label() if search.choice else None,
            "why_none": None if search.choice else why_none(search),
            "config": config, "out": None if out is None else str(out)}
