"""The demo trained with each gradient codec at stages 1-3 (and PowerSGD at stage 1) against the exact run.

    python benchmarks/compression_convergence.py [--steps 300] [--nproc 2] [--dtype fp32] [--only NAME ...]
                                                 [--out benchmarks/results/compression_convergence]
    python benchmarks/compression_convergence.py --merge A/results.json B/results.json [--out DIR]
    python benchmarks/compression_convergence.py --spread [--seeds 0 1 2 3 4] [--texts embedded FILE ...]
                                                 [--spread-stage 2] [--steps 100] [--out DIR]
                                                 [--spread-variants exact int8 ...] [--lrs 0.0045 ...]
    python benchmarks/compression_convergence.py --bias [--bias-stages 1 2 3] [--texts FILE] [--steps 60]

Each run is `zeroshard train --stage S --config FILE --log-csv ...` in a child
process: the demo's own config (app/demo/config.py) with one
`communication_compression.gradients` block, the same seed and batches, so
the curves differ only by what the codec does to the gradients on the wire.
Printed, per run: the mean loss of the last 10 steps, its ratio to the exact
run's at the same stage, the bound the issue sets (2% for int8 and fp8, 4%
for int4 with its default, no rotation; none for int4 rotated or PowerSGD,
reported as they are), and whether it holds; and the bytes each reduction
sent against the exact run's (comm_stats' ratio, from --report). Written:
OUT/results.json and OUT/loss.png, every curve in one chart.

`--spread`: convergence as a spread over seeds instead of one run per
variant: the exact run and each codec of SPREAD (`zeroshard train --stage S
--compress C --seed K [--data FILE]`, the demo's defaults otherwise) for each
seed and text ("embedded": the demo's own corpus; any other: a file read at
run time, e.g. a Python source of the local standard library). Printed and
written (OUT/spread.json, kept after every run: a sweep cut short resumes
where it stopped): per text and variant the mean of the last 10 steps' losses
of each seed, their mean, std, min and max, and the statement each codec
earns against the exact runs' spread (`verdict`). `--lrs` adds the exact
run at other peak learning rates: whether a smaller step alone does what a
codec does.

`--bias`: for the same step's gradients, what each codec delivered against
the exact mean, along the compressed run's own training
(benchmarks/compression_bias.py on each rank; "exact" is the control: the
uncompressed reduction watched the same way). Printed and written
(OUT/bias.json) per stage and codec, medians over the steps: the relative
error per bucket, the cosine between delivered - exact and exact (and the
share of bucket-steps where it is negative), |delivered| / |exact| (per
bucket and of the whole gradient), the clip coefficient's ratio, the error
feedback's norm against |exact| (first and last third of the steps), and
AdamW's update from each: the norm ratio, the cosine, sqrt(v) ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sysconfig
from pathlib import Path

from launch import launch
from matplotlib.figure import Figure
from zeropp_training import train

from zeroshard.app.demo.config import DEMO_CONFIG

CODECS = {
    "exact": None,
    "int8": {"codec": "int8"},
    "fp8_e4m3": {"codec": "fp8_e4m3"},
    "int4 (rotated)": {"codec": "int4", "hadamard": True},
    "int4 (no rotation)": {"codec": "int4"},  # the default
}
BOUND = {"int8": 0.02, "fp8_e4m3": 0.02, "int4 (no rotation)": 0.04}
RUNS = [(stage, name) for stage in (1, 2, 3) for name in CODECS] + [(1, "powersgd")]
SPREAD = {"exact": [], "int8": ["--compress", "int8"], "fp8_e4m3": ["--compress", "fp8"],
          "int4": ["--compress", "int4"]}  # the demo's --compress flags, each codec with its defaults
PYTHON_TEXT = str(Path(sysconfig.get_paths()["stdlib"]) / "argparse.py")  # 2,630 lines of Python


def config_file(work: Path, stage: int, name: str) -> Path:
    """The demo's config with the stage (a file is checked whole before --stage applies) and the codec."""
    gradients = {"codec": "powersgd"} if name == "powersgd" else CODECS[name]
    raw = json.loads(json.dumps(DEMO_CONFIG)) | (
        {"communication_compression": {"gradients": gradients}} if gradients else {})
    raw["zero_optimization"]["stage"] = stage
    path = work / f"s{stage}-{name.split()[0]}-{len(name)}.json"
    path.write_text(json.dumps(raw))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--model", default="demo")
    parser.add_argument("--only", nargs="*", default=None, help="run names to run (default: all)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "compression_convergence")
    parser.add_argument("--merge", nargs="*", type=Path, default=None,
                        help="no training: the curves of earlier runs' results.json files (run in parts with "
                             "--only), tabled and charted together")
    parser.add_argument("--spread", action="store_true", help="the exact run and each codec over --seeds on "
                        "--texts, at --spread-stage: the last-10-step mean's spread per variant")
    parser.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--texts", nargs="*", default=["embedded", PYTHON_TEXT],
                        help="'embedded' (the demo's corpus) or text files (default: embedded and argparse.py "
                             "of this Python's standard library)")
    parser.add_argument("--spread-stage", type=int, default=2)
    parser.add_argument("--spread-variants", nargs="*", default=list(SPREAD), help="of " + ", ".join(SPREAD))
    parser.add_argument("--lrs", nargs="*", type=float, default=[],
                        help="also the exact run at these peak learning rates (the demo's --lr; its default 0.006)")
    parser.add_argument("--bias", action="store_true", help="each codec's delivered gradient against the exact "
                        "mean of the same gradients, per step, at --bias-stages on the first of --texts")
    parser.add_argument("--bias-stages", nargs="*", type=int, default=[1, 2, 3])
    parser.add_argument("--bias-codecs", nargs="*", default=["exact", "int8", "fp8", "fp8_e5m2", "int4"])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.spread:
        return spread(args)
    if args.bias:
        return bias(args)
    curves, results = {}, {}
    for path in args.merge or ():
        curves |= json.loads(path.read_text())["curves"]
    work = args.out / "runs"  # each run's config and CSV log, kept: a failed run loses none before it
    work.mkdir(exist_ok=True)
    for stage, name in RUNS if args.merge is None else ():
        if args.only and name not in args.only:
            continue
        flags = ["--config", str(config_file(work, stage, name)), "--seed", "0"]
        curves[f"stage {stage}, {name}"] = train(flags, args, work, f"s{stage}-{name}", stage=stage)
        (args.out / "curves.json").write_text(json.dumps(curves))
    curves = {f"stage {stage}, {name}": curves[f"stage {stage}, {name}"] for stage, name in RUNS
              if f"stage {stage}, {name}" in curves}
    for label, losses in curves.items():
        stage, name = label.split(", ", 1)
        exact = curves.get(f"{stage}, exact")
        last = statistics.fmean(losses[-10:])
        ratio = last / statistics.fmean(exact[-10:]) if exact else None
        bound = BOUND.get(name)
        results[label] = {"last10": last, "ratio": ratio, "bound": bound,
                          "holds": None if bound is None or ratio is None else abs(ratio - 1) <= bound}
        print(f"{label:32s} last 10: {last:.4f}  ratio {ratio if ratio is None else f'{ratio:.4f}'}  "
              f"bound {bound}  holds {results[label]['holds']}")
    (args.out / "results.json").write_text(json.dumps({"steps": args.steps, "nproc": args.nproc,
                                                        "dtype": args.dtype, "runs": results, "curves": curves},
                                                       indent=1))
    chart(args.out / "loss.png", curves, f"demo, {args.nproc} ranks, {args.dtype}")


def spread(args: argparse.Namespace) -> None:
    """Every variant of SPREAD for every seed and text; the last-10-step means and their spread."""
    path = args.out / "spread.json"
    done = json.loads(path.read_text()) if path.exists() else {}
    if done and (done["steps"], done["stage"]) != (args.steps, args.spread_stage):
        raise SystemExit(f"{path} holds runs of {done['steps']} steps at stage {done['stage']}: another --out")
    runs = done.get("runs", {})
    work = args.out / "runs"
    work.mkdir(exist_ok=True)
    for text in args.texts:
        for seed in args.seeds:
            variants = {name: SPREAD[name] for name in args.spread_variants} | {
                f"exact, lr {lr:g}": ["--lr", str(lr)] for lr in args.lrs}
            for name, flags in variants.items():
                key = f"{Path(text).name}|{name}|{seed}"
                if key in runs:
                    continue
                data = [] if text == "embedded" else ["--data", text]
                losses = train([*flags, *data, "--seed", str(seed), "--sample", "0"], args, work,
                               key.replace("|", "-"), stage=args.spread_stage)
                runs[key] = statistics.fmean(losses[-10:])
                path.write_text(json.dumps({"steps": args.steps, "stage": args.spread_stage, "nproc": args.nproc,
                                            "dtype": args.dtype, "runs": runs}, indent=1))
    table = spread_table(runs)
    for row in table:
        print(" | ".join(str(v) for v in row.values()))
    path.write_text(json.dumps({"steps": args.steps, "stage": args.spread_stage, "nproc": args.nproc,
                                "dtype": args.dtype, "runs": runs, "table": table}, indent=1))


def bias(args: argparse.Namespace) -> None:
    """benchmarks/compression_bias.py for each stage and codec on 2 ranks; the summaries, tabled."""
    path, here = args.out / "bias.json", Path(__file__).parent
    done = json.loads(path.read_text()) if path.exists() else {}
    text = args.texts[0]
    for stage in args.bias_stages:
        for codec in args.bias_codecs:
            key = f"stage {stage}, {codec}"
            if key in done:
                continue
            out = args.out / f"bias-s{stage}-{codec}.json"
            flags = ["--stage", str(stage), "--compress", "none" if codec == "exact" else codec,
                     "--steps", str(args.steps), "--seed", "0", *([] if text == "embedded" else ["--data", text])]
            print("$ compression_bias.py", " ".join(flags), flush=True)
            run = launch([str(here / "compression_bias.py"), "--out", str(out), *flags], args.nproc,
                         args.out / f"bias-s{stage}-{codec}", 3600, {})
            if not run.ok:
                raise SystemExit(f"{key}: {run.error([], 3600)}")
            done[key] = json.loads(out.read_text())["summary"]
            path.write_text(json.dumps(done, indent=1))
    columns = list(next(iter(done.values())))
    print(" | ".join(["run", *columns]))
    for key, row in done.items():
        print(" | ".join([key, *(f"{row[c]:.4g}" for c in columns)]))


def spread_table(runs: dict[str, float]) -> list[dict]:
    """One row per text and variant: each seed's last-10 mean, their mean, std, min, max, and its verdict."""
    by: dict[tuple[str, str], dict[int, float]] = {}
    for key, last10 in runs.items():
        text, name, seed = key.split("|")
        by.setdefault((text, name), {})[int(seed)] = last10
    rows = []
    for (text, name), seeds in by.items():
        values = [seeds[s] for s in sorted(seeds)]
        exact = [v for _, v in sorted(by.get((text, "exact"), {}).items())]
        rows.append({"text": text, "variant": name, "seeds": len(values), "each": [round(v, 4) for v in values],
                     "mean": round(statistics.fmean(values), 4),
                     "std": round(statistics.stdev(values), 4) if len(values) > 1 else None,
                     "min": round(min(values), 4), "max": round(max(values), 4),
                     "verdict": verdict(values, exact) if name != "exact" and len(exact) > 1 else ""})
    return rows


def verdict(values: list[float], exact: list[float]) -> str:
    """Within the exact runs' spread (its mean inside their min..max and the difference of the means under
    two standard errors of it), or worse / better by the difference of the means, in % of the exact mean."""
    diff = statistics.fmean(values) - statistics.fmean(exact)
    error = (statistics.variance(values) / len(values) + statistics.variance(exact) / len(exact)) ** 0.5
    share = diff / statistics.fmean(exact)
    if min(exact) <= statistics.fmean(values) <= max(exact) and abs(diff) <= 2 * error:
        return f"within the exact spread ({share:+.1%})"
    return f"{'worse' if diff > 0 else 'better'} by {abs(share):.1%} (the difference is {abs(diff) / error:.1f} " \
           "standard errors)"


def chart(path: Path, curves: dict[str, list[float]], title: str, window: int = 10) -> None:
    """One figure, a panel per stage, every run's loss as a moving mean over `window` steps (one batch's
    noise hides the codecs' differences otherwise)."""
    fig = Figure(figsize=(13, 4.2), dpi=100, layout="constrained")
    axes = fig.subplots(1, 3, sharey=True)
    for ax, stage in zip(axes, (1, 2, 3)):
        for label, losses in curves.items():
            if label.startswith(f"stage {stage}, "):
                smooth = [statistics.fmean(losses[max(0, i - window + 1): i + 1]) for i in range(len(losses))]
                ax.plot(range(1, len(losses) + 1), smooth, label=label.split(", ", 1)[1], linewidth=1.1)
        ax.set(xlabel="optimizer step", title=f"stage {stage}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel(f"loss, mean of the last {window} steps")
    fig.suptitle(f"{title}: gradient codecs against the exact run")
    fig.savefig(path)


if __name__ == "__main__":
    main()
