"""What a training run leaves behind on rank 0: a log line every few steps, a CSV row per
step, and with `--report DIR` a JSON of every figure plus charts of the loss and memory."""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path

log = logging.getLogger("zeroshard.app.demo.train")


class StepLog:
    """Per optimizer step: a console log line every `every` steps, and a row of `csv_path`.

    The CSV has a header and one row per step (step, loss, lr, step_seconds,
    tokens_per_second), flushed as it goes, so a run that stops early keeps
    its rows; an existing file is appended to (a resumed run continues it).
    TensorBoard, pandas and spreadsheets read it as is.
    """

    FIELDS = ("step", "loss", "lr", "step_seconds", "tokens_per_second")

    def __init__(self, csv_path: str | None, every: int, total: int):
        self.every, self.total = every, total
        new = csv_path is not None and (not Path(csv_path).exists() or Path(csv_path).stat().st_size == 0)
        self._file = open(csv_path, "a", newline="", encoding="utf-8") if csv_path else None
        self._csv = csv.writer(self._file) if self._file else None
        if new:  # a resumed run adds its rows under the first run's
            self._csv.writerow(self.FIELDS)

    def __enter__(self) -> "StepLog":
        return self

    def __exit__(self, *exc) -> None:
        if self._file:
            self._file.close()

    def __call__(self, step: int, loss: float, lr: float, seconds: float, tokens_per_second: float) -> None:
        if self._csv:
            self._csv.writerow((step, f"{loss:.6f}", f"{lr:.6g}", f"{seconds:.6f}", f"{tokens_per_second:.1f}"))
            self._file.flush()
        if step % self.every == 0 or step == self.total:
            log.info("step %d/%d  loss %.4f  lr %.2e  %.3f s  %s tokens/s", step, self.total, loss, lr,
                     seconds, f"{tokens_per_second:,.0f}")


def write_report(directory: str, figures: dict) -> list[Path]:
    """Write report.json, loss.png and memory.png into `directory` (created); returns their paths."""
    from zeroshard.app.demo import plots  # matplotlib loads only when a report is asked for

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "report.json", out / "loss.png", out / "memory.png"]
    paths[0].write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    plots.loss_chart(paths[1], figures["losses"], figures["lr"], figures["first_step"])
    plots.memory_chart(paths[2], figures["memory_stats"], figures["estimate"]["memory"],
                       f"stage {figures['config']['zero_optimization']['stage']}, "
                       f"{figures['world_size']} ranks, GPT '{figures['model']}'")
    return paths
