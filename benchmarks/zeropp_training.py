"""The demo trained at stage 3 with and without ZeRO++ (qwZ + hpZ + qgZ), same seed and data: two loss curves.

    python benchmarks/zeropp_training.py [--steps 200] [--nproc 4] [--nodes 2] [--dtype bf16] [--model demo]
                                         [--out benchmarks/results/zeropp_training]

Each run is `zeroshard train --stage 3 --nodes K [--zeropp] --log-csv ...` in a
child process (4 ranks declared 2 nodes x 2 by default), the tied-embedding
demo GPT on the embedded corpus. Both runs see the same batches in the same
order, so the curves differ only by what ZeRO++ quantizes: int8 weights in
the gathers and int4 gradients (Hadamard-rotated blocks of 128) in the
reduction. Printed: the final loss of each run (last step, and the mean of
the last 10 steps, which one batch's noise moves less) and their relative
difference; written: OUT/losses.json and OUT/loss.png, the two curves in
one chart.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from matplotlib.figure import Figure

RUNS = {"stage 3": [], "stage 3 + ZeRO++": ["--zeropp"]}


def train(flags: list[str], args: argparse.Namespace, work: Path, name: str, stage: int = 3) -> list[float]:
    """One `zeroshard train` run; its loss per optimizer step, read back from its CSV log."""
    log = work / f"{name.replace(' ', '_').replace('+', 'plus').replace('(', '').replace(')', '')}.csv"
    log.unlink(missing_ok=True)  # the trainer appends to its CSV log: this run's rows only
    cmd = [sys.executable, "-m", "zeroshard.app.cli", "train", "--nproc", str(args.nproc), "--stage", str(stage),
           "--nodes", str(args.nodes), "--dtype", args.dtype, "--model", args.model, "--steps", str(args.steps),
           "--log-csv", str(log), *flags]
    print("$", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with log.open() as f:
        return [float(row["loss"]) for row in csv.DictReader(f)]


def chart(path: Path, curves: dict[str, list[float]], title: str) -> None:
    fig = Figure(figsize=(8, 4.5), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    for name, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=name, linewidth=1.2)
    ax.set(xlabel="optimizer step", ylabel="loss (global mean)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--model", default="demo")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/zeropp_training"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        curves = {name: train(flags, args, Path(work), name) for name, flags in RUNS.items()}
    plain, zeropp = curves.values()
    final = {name: {"last": losses[-1], "last10": sum(losses[-10:]) / len(losses[-10:])}
             for name, losses in curves.items()}
    for key in ("last", "last10"):
        a, b = final["stage 3"][key], final["stage 3 + ZeRO++"][key]
        print(f"final loss ({key}): stage 3 {a:.4f}, with ZeRO++ {b:.4f}, difference {(b - a) / a:+.2%}")
    (args.out / "losses.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                      "losses": curves, "final": final}, indent=1))
    chart(args.out / "loss.png", curves, f"demo GPT, {args.nproc} ranks as {args.nodes} nodes, {args.dtype}, "
                                         f"{args.steps} steps")
    print(f"chart: {args.out / 'loss.png'}")


if __name__ == "__main__":
    main()
