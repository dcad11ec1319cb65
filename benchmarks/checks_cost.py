"""The step-time cost of zeroshard's checks (the step check, the watched waits): this tree
against a revision before them, stages 0-3, side by side on one machine.

Each round runs every stage once with the baseline revision's `zeroshard` and once with this
tree's, alternating, through `bench.py`'s worker and launcher (fresh process trees, same
model, batches and steps); the report takes each one's fastest round, as `bench.py` does.

    python benchmarks/checks_cost.py --baseline 225074f --size 4m --steps 30 --rounds 3
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import bench

HERE = Path(__file__).resolve().parent


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, help="a git revision of this repository without the checks")
    p.add_argument("--size", choices=bench.SIZES, default="4m")
    p.add_argument("--mode", choices=bench.MODES, default="fused")
    p.add_argument("--stages", type=int, nargs="+", choices=range(4), default=[0, 1, 2, 3])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--timeout", type=float, default=1200)
    args = p.parse_args()
    # What bench.run_variant reads besides these.
    args.micro_batch, args.bucket_elems, args.lr, args.seed = 1, 25 * 2**20 // 4, 1e-4, 0
    return args


def measure(args: argparse.Namespace, baseline: Path, corpus: Path) -> dict[tuple[int, str], list[float]]:
    """(stage, "baseline" or "this tree") -> step milliseconds of each round."""
    times: dict[tuple[int, str], list[float]] = {}
    for r in range(args.rounds):
        for stage in args.stages:
            for label, source in (("baseline", baseline), ("this tree", bench.REPO)):
                entry = bench.run_variant(args, args.size, args.mode, f"zeroshard_s{stage}", corpus, source,
                                          label="_baseline" if source == baseline else "")
                if not entry["ok"]:
                    raise SystemExit(f"stage {stage} ({label}) failed: {entry['error']}")
                times.setdefault((stage, label), []).append(entry["step_ms"])
                print(f"round {r + 1} stage {stage} {label}: {entry['step_ms']:.1f} ms/step", flush=True)
    return times


def report(args: argparse.Namespace, times: dict[tuple[int, str], list[float]]) -> str:
    lines = [f"`{bench.command_line()}` ({bench.machine()['cpu']}, {args.world} gloo ranks, {args.size}, "
             f"{args.mode} Adam, {args.dtype}; fastest of {args.rounds} rounds, {args.steps} timed steps each)", "",
             "| stage | baseline ms/step | this tree ms/step | ratio |", "|---|---:|---:|---:|"]
    for stage in args.stages:
        base, mine = min(times[(stage, "baseline")]), min(times[(stage, "this tree")])
        lines.append(f"| {stage} | {base:.1f} | {mine:.1f} | {mine / base:.3f}x |")
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    (HERE / "results" / "logs").mkdir(parents=True, exist_ok=True)
    corpus = HERE / "results" / "corpus.pt"
    bench.prepare_corpus(corpus)
    with tempfile.TemporaryDirectory() as tmp:
        baseline = Path(tmp) / "baseline"
        subprocess.run(["git", "-C", str(bench.REPO), "worktree", "add", "--detach", str(baseline), args.baseline],
                       check=True, capture_output=True)
        try:
            times = measure(args, baseline, corpus)
        finally:
            subprocess.run(["git", "-C", str(bench.REPO), "worktree", "remove", "--force", str(baseline)],
                           check=False, capture_output=True)
    print(report(args, times))
    return 0


if __name__ == "__main__":
    sys.exit(main())
