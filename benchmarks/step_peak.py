"""The peak of a training step, predicted and measured, per ZeRO stage (issue 25, acceptance 2).

    python benchmarks/step_peak.py --models demo 100m --dtypes fp32 bf16 --out BENCHMARKS.md \\
        --plot docs/images/step-peak.png

For each model, dtype and stage, `--world` ranks of their own (gloo, one
thread each) train the preset; a rank reads the resident high-water
mark of its second step above its RSS before the model was built
(`zeroshard.app.estimate.step_peak.measure`: VmHWM reset through /proc/self/clear_refs,
freed blocks handed back to the system). The prediction is
`zeroshard.estimate.step_peak` on the model's meta-device counts
(`zeroshard.app.estimate.step_peak.predict`). The table gives the largest rank's
measurement; `--plot` draws, for the last of `--models`, each stage's estimate
by part beside the measurement (memory_stats' kinds, the measured
activations, and the rest of the measured peak).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench import command_line, machine, rank_env  # noqa: E402
from launch import launch  # noqa: E402
from report import write_section  # noqa: E402

from zeroshard.app.estimate.model_count import DEMO_BUCKET_SIZE  # noqa: E402
from zeroshard.app.estimate.step_peak import PeakRun, predict  # noqa: E402

MB = 1e6
HEADING = "## The peak of a step: predicted and measured, stages 0-3"  # + ", with activation checkpointing"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["demo", "100m"])
    p.add_argument("--dtypes", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"])
    p.add_argument("--stages", nargs="+", type=int, choices=(0, 1, 2, 3), default=[0, 1, 2, 3])
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--bucket", type=int, default=DEMO_BUCKET_SIZE, help="reduce_bucket_size, elements")
    p.add_argument("--checkpointing", choices=("none", "full"), default="none")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900, help="seconds per model, dtype and stage")
    p.add_argument("--json", type=Path, default=None, help="also keep the results here")
    p.add_argument("--out", type=Path, default=None, help="write the section into this markdown file")
    p.add_argument("--plot", type=Path, default=None, help="draw the stacked bars into this PNG")
    p.add_argument("--results", type=Path, default=None,
                   help="draw --plot from the results an earlier run kept with --json, without measuring")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a rank: the run as JSON
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def worker(run_json: str, result: str) -> None:
    """One rank: measure the run, write its result to `result`.rank<r>."""
    import torch
    import torch.distributed as dist

    from zeroshard.app.estimate.step_peak import measure

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out = measure(PeakRun(**json.loads(run_json)))
    Path(f"{result}.rank{dist.get_rank()}").write_text(json.dumps(out))
    dist.destroy_process_group()


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def run_all(args: argparse.Namespace) -> list[dict]:
    """Each model, dtype and stage on ranks of its own (an engine's memory is not handed back when it is
    dropped: see the report's notes), the largest rank's measurement beside the prediction."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="zeroshard-step-peak-") as tmp:
        for model in args.models:
            for dtype in args.dtypes:
                for stage in args.stages:
                    run = PeakRun(model, stage, dtype, args.micro_batch, args.seq, args.bucket, args.checkpointing)
                    rows.append(_launch_one(run, args, Path(tmp) / f"{model}-{dtype}-{stage}.json"))
    return rows


def _launch_one(run: PeakRun, args: argparse.Namespace, result: Path) -> dict:
    before = load()
    done = launch([__file__, "--worker", json.dumps(asdict(run)), "--result", str(result)], args.world, result,
                  args.timeout, rank_env())
    ranks = done.results(result)
    if not done.ok or None in ranks:
        raise SystemExit(f"{run}: {done.error(ranks, args.timeout)}")
    return {"run": asdict(run), "predicted": predict(run, args.world).as_dict(),
            "measured": max(ranks, key=lambda m: m["peak"]), "ranks": ranks, "load": f"{before} -> {load()}",
            "seconds": done.seconds}


def render(rows: list[dict], command: str) -> str:
    m = machine()
    run = rows[0]["run"]
    heading = HEADING + (", with activation checkpointing" if run["checkpointing"] == "full" else "")
    lines = [heading, "",
             f"- Date: {datetime.now(timezone.utc).date()}",
             f"- Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']:.0f} GiB RAM, no GPU; Python {m['python']}, "
             f"torch {m['torch']}",
             f"- Ranks: {len(rows[0]['ranks'])} processes, gloo, 1 thread each; micro-batch {run['micro_batch']} x "
             f"{run['seq']} tokens per rank, AdamW, gradient clipping 1.0, reduce_bucket_size {run['bucket']:,}, "
             f"checkpointing {run['checkpointing']}; stage 3 with each Block a unit",
             "- Measured: per rank, the RSS high-water mark (VmHWM, reset through /proc/self/clear_refs) of the "
             "second step above the RSS before the model was built, after a warm-up (a tiny model's step through an "
             "engine, then a plain forward and backward of the same model: the code a step runs and the math "
             "libraries' buffers stay in the base); freed blocks of 64 KiB and more go back to the system at once (mallopt), the heap is "
             "trimmed before each reading; the largest rank's figure",
             "- Predicted: `zeroshard.estimate.step_peak` on the model's meta-device counts "
             "(`zeroshard estimate --model M --micro-batch B --seq S --gpus 2 --backend gloo`)",
             "- Predicted buffers and temporaries: at the backward's start the staging pool, stage 3's gathered units, "
             "one parameter's and the largest activation's gradients and the recompute; at the optimizer step the "
             "staging pool and the fp32 copies of 16-bit gradients (docs/memory.md)",
             "- Load: the machine's load average (1, 5, 15 min) before -> after each run (the machine is shared)", "",
             "Command:", "", "```", command, "```", "",
             "| model | dtype | stage | predicted MB | measured MB | measured / predicted | peak at "
             "| predicted: model states MB | activations MB | buffers and temporaries MB | RSS file pages moved MB | load |",
             "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---|"]
    for row in rows:
        p, m, r = row["predicted"], row["measured"], row["run"]
        extra = p["total"] - p["model_states"] - (p["activations"] if p["phase"] == "backward" else 0)
        lines.append(f"| {r['model']} | {r['dtype']} | {r['stage']} | {p['total'] / MB:.1f} | {m['peak'] / MB:.1f} "
                     f"| {m['peak'] / p['total']:.3f} | {p['phase']} | {p['model_states'] / MB:.1f} "
                     f"| {p['activations'] / MB:.1f} | {extra / MB:.1f} | {m['file_moved'] / MB:.1f} | {row['load']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parse_args()
    if args.worker is not None:
        worker(args.worker, args.result)
        return
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")  # see tests/conftest.py: AMX faults here
    if args.results:  # the table was written by the run that measured them
        rows = json.loads(args.results.read_text())
    else:
        rows = run_all(args)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        text = render(rows, command_line())
        print(text)
        if args.out:
            write_section(args.out, text)
    if args.plot:
        from zeroshard.app.demo.plots import peak_chart

        last = rows[-1]["run"]["model"]  # the last of --models
        peak_chart(args.plot, [row for row in rows if row["run"]["model"] == last])



if __name__ == "__main__":
    main()
