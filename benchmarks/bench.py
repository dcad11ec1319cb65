"""Side-by-side training benchmark: zeroshard stages 0-2 against DDP,
ZeroRedundancyOptimizer, FSDP1, FSDP2 and DeepSpeed, on gloo ranks on CPU.

Every variant runs in its own fresh process tree of `--world` ranks on a new
port, with the same GPT preset, initial weights, batches and step count.

    python benchmarks/bench.py --sizes 4m 100m --modes plain fused \\
        --variants all --steps 20 --warmup 3 --out BENCHMARKS.md

Results are kept in a JSON file (default benchmarks/results/<out stem>.json);
a run with a `--variants` subset replaces those entries and keeps the others
(unless `--fresh`), and the markdown report is rendered from all of them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from launch import launch
from report import render

# Kept in sync with variants.BUILDERS (not imported: this process stays free of torch).
VARIANTS = [
    "single", "ddp", "zero_redundancy", "fsdp1_shard_grad_op", "fsdp2", "fsdp1_full_shard", "fsdp2_reshard",
    "deepspeed_z0", "deepspeed_z1", "deepspeed_z2", "deepspeed_z3",
    "zeroshard_s0", "zeroshard_s1", "zeroshard_s2", "zeroshard_s3", "zeroshard_s1_overlap", "zeroshard_s2_overlap",
    "zeroshard_s3_reuse1", "zeroshard_s3_reuse",
]  # fmt: skip
GROUPS = {"all": VARIANTS, "peers": [v for v in VARIANTS if not v.startswith("zeroshard_")],
          "zeroshard": [v for v in VARIANTS if v.startswith("zeroshard_")]}
SIZES = ["4m", "100m"]
MODES = ["plain", "fused"]
BLOCK_SIZE = 128  # both presets' context length, for the report
# Settings that all merged results must share, or their numbers do not compare.
WORKLOAD = ["world", "micro_batch", "bucket_elems", "lr", "seed", "steps", "warmup", "rounds", "dtype"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", choices=SIZES, default=SIZES)
    p.add_argument("--modes", nargs="+", choices=MODES, default=MODES)
    p.add_argument("--variants", nargs="+", default=["all"], help="names, or the groups all / peers / zeroshard")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    # One sequence per rank keeps a 100M step near 1 s on this CPU, so the parallelism
    # overheads (communication, optimizer, copies) are a visible share of the step.
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per step")
    p.add_argument("--bucket-elems", type=int, default=25 * 2**20 // 4, help="gradient bucket (DDP's 25 MiB)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: zeroshard trains with bf16 enabled (bf16 parameters, fp32 master weights); "
                        "peers train the model cast to bf16")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every variant this many times, round-robin, and report its fastest round: "
                        "the machine's speed drifts over minutes, and drift only ever slows a run down")
    p.add_argument("--timeout", type=float, default=1200, help="seconds per variant")
    p.add_argument("--out", type=Path, default=REPO / "BENCHMARKS.md")
    p.add_argument("--json", type=Path, help="results file; default benchmarks/results/<out stem>.json")
    p.add_argument("--fresh", action="store_true", help="drop earlier results in the JSON file")
    p.add_argument("--render-only", action="store_true", help="rewrite --out from the JSON file; run nothing")
    args = p.parse_args()
    if min(args.steps, args.micro_batch, args.world, args.rounds) < 1 or args.warmup < 0:
        p.error("--steps, --micro-batch, --world and --rounds must be >= 1, --warmup >= 0")
    names = []
    for v in args.variants:
        if v not in GROUPS and v not in VARIANTS:
            p.error(f"unknown variant {v!r}; choose from {', '.join(list(GROUPS) + VARIANTS)}")
        names += [n for n in GROUPS.get(v, [v]) if n not in names]
    args.variants = [v for v in VARIANTS if v in names]  # report order
    args.json = args.json or HERE / "results" / f"{args.out.stem}.json"
    return args


def machine() -> dict:
    """This machine and the software versions: the part of the results header every benchmark shares."""
    def version(pkg: str) -> str:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return "not installed"

    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")), "?")
    mem_kib = next(int(ln.split()[1]) for ln in meminfo if ln.startswith("MemTotal"))
    return {
        "cpu": cpu, "cores": os.cpu_count(), "ram_gib": mem_kib / 2**20,
        "python": platform.python_version(), "torch": version("torch"), "deepspeed": version("deepspeed"),
        "safetensors": version("safetensors"), "backend": "gloo", "threads": 1,
    }  # fmt: skip


def machine_meta(args: argparse.Namespace) -> dict:
    return machine() | {
        "world": args.world, "block_size": BLOCK_SIZE,
        "micro_batch": args.micro_batch, "bucket_elems": args.bucket_elems, "lr": args.lr,
        "seed": args.seed, "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
        "dtype": args.dtype,
    }  # fmt: skip


def open_results(path: Path, fresh: bool, meta: dict, workload: list[str]) -> dict:
    """The results kept in `path` (unless `fresh`) with `meta` as their header; exits if the workload changed."""
    results = {"runs": {}}
    if path.exists() and not fresh:
        results = json.loads(path.read_text())
    changed = [k for k in workload if k in results.get("meta", {}) and results["meta"][k] != meta[k]]
    if changed:
        sys.exit(f"{path} was measured with other {', '.join(changed)}; pass --fresh or another --json")
    results["meta"] = meta
    return results


def command_line() -> str:
    """How this benchmark was started, relative to the repository root, for the report."""
    return "python " + shlex.join([os.path.relpath(os.path.abspath(sys.argv[0]), REPO), *sys.argv[1:]])


def rank_env(source: Path = REPO) -> dict[str, str]:
    """What every rank needs in its environment besides the rendezvous (which `launch` sets);
    `source`: the checkout whose `zeroshard` the ranks import (another revision, for a baseline)."""
    return {
        "DS_ACCELERATOR": "cpu",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(source), str(REPO), os.environ.get("PYTHONPATH")])),
    }


def slowest_per_step(rank_results: list[dict], warmup: int, key: str = "step_seconds") -> list[float]:
    """Per timed step, the slowest rank's seconds under `key`."""
    return [max(ts) for ts in zip(*(r[key][warmup:] for r in rank_results))]


def summarize(rank_results: list[dict], warmup: int) -> dict:
    """Step time: per step the slowest rank, then the median over timed steps."""
    per_step = slowest_per_step(rank_results, warmup)
    r0 = rank_results[0]
    return {
        "ok": True,
        "num_params": r0["num_params"],
        "step_ms": 1000 * statistics.median(per_step),
        "step_ms_each": [1000 * t for t in per_step],
        "step_ms_per_rank": [1000 * statistics.median(r["step_seconds"][warmup:]) for r in rank_results],
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in rank_results),
        "peak_rss_bytes_per_rank": [r["peak_rss_bytes"] for r in rank_results],
        "base_rss_bytes": max(r["base_rss_bytes"] for r in rank_results),
        "loss_first": r0["losses"][0],
        "loss_last": r0["losses"][-1],
        "model_states": r0.get("model_states"),
    }


def combine_rounds(entries: list[dict]) -> dict:
    """One entry for a variant run several times: the fastest round's step time, the largest RSS."""
    failed = [e for e in entries if not e["ok"]]
    if failed:
        return failed[0]
    fastest = min(entries, key=lambda e: e["step_ms"])
    return fastest | {
        "step_ms_rounds": [e["step_ms"] for e in entries],
        "peak_rss_bytes": max(e["peak_rss_bytes"] for e in entries),
    }


def run_variant(args: argparse.Namespace, size: str, mode: str, variant: str, corpus: Path,
                source: Path = REPO, label: str = "") -> dict:
    stem = HERE / "results" / "logs" / f"{size}_{mode}_{variant}{label}"
    argv = [str(HERE / "worker.py"), "--variant", variant, "--size", size, "--mode", mode]
    argv += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--micro-batch", str(args.micro_batch)]
    argv += ["--bucket-elems", str(args.bucket_elems), "--lr", str(args.lr), "--seed", str(args.seed)]
    argv += ["--corpus", str(corpus), "--dtype", args.dtype]
    return run_ranks(args, argv, stem, source)


def run_ranks(args: argparse.Namespace, argv: list[str], stem: Path, source: Path = REPO,
              summary: Callable[[list[dict], int], dict] = summarize) -> dict:
    """`argv` (a worker, given `--result <stem>.json`) as `args.world` ranks of a fresh process tree, logging to
    `stem`.rank<r>.log: `summary` of the ranks' results, or the first error."""
    for old in stem.parent.glob(stem.name + ".*"):
        old.unlink()
    result = stem.with_suffix(".json")
    run = launch([*argv, "--result", str(result)], args.world, stem, args.timeout, rank_env(source))
    rank_results = run.results(result)
    if run.ok and all(r and "error" not in r for r in rank_results):
        entry = summary(rank_results, args.warmup)
    else:
        entry = {"ok": False, "error": run.error(rank_results, args.timeout)}
    return entry | {"launch_seconds": run.seconds, "returncodes": run.returncodes}


def prepare_corpus(path: Path) -> None:
    import subprocess

    subprocess.run([sys.executable, str(HERE / "worker.py"), "--prepare-corpus", str(path)], check=True)


def main() -> int:
    args = parse_args()
    if args.render_only:
        args.out.write_text(render(json.loads(args.json.read_text()), SIZES, MODES, VARIANTS))
        return 0
    (HERE / "results" / "logs").mkdir(parents=True, exist_ok=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    corpus = HERE / "results" / "corpus.pt"
    prepare_corpus(corpus)
    results = open_results(args.json, args.fresh, machine_meta(args), WORKLOAD)
    command = command_line()
    todo = [(s, m, v) for s in args.sizes for m in args.modes for _ in range(args.rounds) for v in args.variants]
    rounds: dict[str, list[dict]] = {}
    for i, (size, mode, variant) in enumerate(todo, 1):
        entry = run_variant(args, size, mode, variant, corpus)
        key = f"{size}/{mode}/{variant}"
        rounds.setdefault(key, []).append(entry)
        results["runs"][key] = combine_rounds(rounds[key]) | {
            "size": size, "mode": mode, "variant": variant, "command": command,
            "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        if entry["ok"]:
            status = f"{entry['step_ms']:.0f} ms/step, peak RSS {entry['peak_rss_bytes'] / 2**20:.0f} MiB"
        else:
            status = f"FAILED: {entry['error']}"
        print(f"[{i}/{len(todo)}] {size} {mode} {variant}: {status} ({entry['launch_seconds']:.0f} s)", flush=True)
        # written after every variant, so an interrupted run keeps what it measured
        args.json.write_text(json.dumps(results, indent=1))
        args.out.write_text(render(results, SIZES, MODES, VARIANTS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
