"""A model whose model states are over 3x the memory cap trains with disk offload; without it, a clear error.

    python benchmarks/offload_larger_than_memory.py --nvme-path /var/tmp/zeroshard-ltm --out BENCHMARKS.md

Three runs of the same GPT (built under `zeroshard.meta_init()`, its units
made one by one), 2 ranks (`offload_larger_than_memory_worker.py`), stage 3,
fp32, AdamW, the same rows on each rank in every run:

1. capped, disk offload: both ranks inside a cgroup v1 memory group of
   `--cap` bytes (it counts the page cache, so the swap files' O_DIRECT I/O
   matters), offload_optimizer and offload_param "nvme" (every shard on
   disk, max_in_cpu 0); the gradient shards wait on disk too;
2. capped, no offload: the same group and cap; the run must end in
   zeroshard's OutOfMemoryError on every rank before any state is made,
   not in a kernel kill;
3. uncapped, no offload: the reference; run 1's losses must equal its own.

The report: the model and its model states (16 bytes per element: fp32
parameters, gradients and AdamW's two moments) against the cap, the
group's peak usage (`memory.max_usage_in_bytes`, page cache included) and
each rank's peak RSS, the step times and the bytes each rank's swap files
moved per step. The section goes into `--out` (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench import command_line, machine, rank_env  # noqa: E402
from report import write_section  # noqa: E402

WORKER = HERE / "offload_larger_than_memory_worker.py"
CGROUP_V1 = Path("/sys/fs/cgroup/memory")
GIB = 2**30
# About 510M parameters in 72 blocks of 7.1M: small units, so a gathered unit and a sub-group in flight are
# small beside the cap, and the model states (16 bytes each) over 3x a 2.5 GiB cap.
MODEL = {"vocab_size": 256, "block_size": 64, "n_layer": 72, "n_head": 12, "n_embd": 768}


def zero_config(nvme_path: Path | None) -> dict:
    zero = {"stage": 3, "stage3_wrap_classes": ["Block"], "stage3_prefetch_bucket_size": 8_000_000,
            "sub_group_size": 1, "reduce_bucket_size": 8_000_000}  # sub-groups of one bucket each
    if nvme_path is not None:
        zero |= {"offload_optimizer": {"device": "nvme", "nvme_path": str(nvme_path), "buffer_count": 3},
                 "offload_param": {"device": "nvme", "nvme_path": str(nvme_path), "max_in_cpu": 0}}
    return {"zero_optimization": zero}


def run(name: str, args: argparse.Namespace, config: dict, group: Path | None) -> dict:
    """The two ranks of one run (inside `group` if given); their result files, the exit code and the seconds."""
    out = args.work / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)

    def join():  # in the launcher before it execs: it and the ranks it starts are charged to the group
        (group / "cgroup.procs").write_text(str(os.getpid()))

    argv = [sys.executable, str(WORKER), "--launch", "2", "--out", str(out), "--model", json.dumps(MODEL),
            "--config", json.dumps(config), "--steps", str(args.steps), "--lr", str(args.lr)]
    start = time.monotonic()
    with open(out / "log.txt", "w") as log:
        code = subprocess.run(argv, env=os.environ | rank_env(), stdout=log, stderr=subprocess.STDOUT,
                              preexec_fn=join if group else None, timeout=args.timeout).returncode
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    return {"exit_code": code, "seconds": time.monotonic() - start, "ranks": ranks}


def make_group(cap: int) -> Path:
    group = CGROUP_V1 / f"zeroshard-ltm-{os.getpid()}"
    group.mkdir()
    (group / "memory.limit_in_bytes").write_text(str(cap))
    return group


def group_figures(group: Path) -> dict:
    stat = dict(line.split() for line in (group / "memory.stat").read_text().splitlines())
    oom = dict(line.split() for line in (group / "memory.oom_control").read_text().splitlines())
    return {"max_usage": int((group / "memory.max_usage_in_bytes").read_text()),
            "failcnt": int((group / "memory.failcnt").read_text()), "oom_kill": int(oom.get("oom_kill", 0)),
            "cache": int(stat["total_cache"]), "rss": int(stat["total_rss"])}


def capped(name: str, args: argparse.Namespace, config: dict) -> dict:
    group = make_group(args.cap)
    try:
        result = run(name, args, config, group)
        return result | {"group": group_figures(group)}
    finally:
        group.rmdir()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cap", type=lambda s: int(float(s) * GIB), default=int(2.5 * GIB), help="GiB (default 2.5)")
    p.add_argument("--nvme-path", type=Path, required=True, help="a directory on a real disk")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--n-layer", type=int, default=MODEL["n_layer"], help="blocks (fewer: a quick trial)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--work", type=Path, default=HERE / "results" / "larger_than_memory")
    p.add_argument("--out", type=Path, default=HERE.parent / "BENCHMARKS.md")
    args = p.parse_args()
    args.nvme_path.mkdir(parents=True, exist_ok=True)
    MODEL["n_layer"] = args.n_layer
    results = {"meta": machine() | {"cap": args.cap, "model": MODEL, "steps": args.steps, "lr": args.lr,
                                    "nvme_path": str(args.nvme_path), "command": command_line(),
                                    "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds")},
               "offload": capped("offload", args, zero_config(args.nvme_path)),
               "no_offload": capped("no_offload", args, zero_config(None)),
               "reference": run("reference", args, zero_config(None), None)}
    (args.work / "results.json").write_text(json.dumps(results, indent=1))
    text, ok = render(results)
    print(text)
    write_section(args.out, text)
    return 0 if ok else 1


def render(results: dict) -> tuple[str, bool]:
    """The BENCHMARKS.md section, and whether every claim held."""
    m, off, none, ref = results["meta"], results["offload"], results["no_offload"], results["reference"]
    r0 = off["ranks"][0] if off["ranks"] else {}
    numel = r0.get("num_params", 0)
    states = 16 * numel
    losses, ref_losses = r0.get("losses"), (ref["ranks"][0].get("losses") if ref["ranks"] else None)
    errors = [r.get("error") for r in none["ranks"]]
    checks = {
        "model states >= 3x the cap": states >= 3 * m["cap"],
        "the offloaded run trained every step, no kernel kill": off["exit_code"] == 0 and off["group"]["oom_kill"] == 0
        and losses is not None and len(losses) == m["steps"],
        "its losses equal the uncapped run's without offload, bit for bit": losses is not None and losses == ref_losses,
        "without offload: OutOfMemoryError on every rank, no kernel kill": len(errors) == 2
        and errors == ["OutOfMemoryError"] * 2 and none["group"]["oom_kill"] == 0,
    }
    step_s = [max(ts) for ts in zip(*(r["step_s"] for r in off["ranks"]))] if off["exit_code"] == 0 else []
    ref_s = [max(ts) for ts in zip(*(r["step_s"] for r in ref["ranks"]))] if ref["exit_code"] == 0 else []
    moved = r0.get("moved", [{}])[-1]
    lines = [
        "## Offload: a model over 3x larger than memory",
        "",
        f"- Date: {m['measured_at'][:10]}; machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']:.0f} GiB RAM, "
        f"no GPU; torch {m['torch']}, gloo, 2 ranks, 1 compute thread each",
        f"- Model: GPT {json.dumps(m['model'])}, {numel / 1e6:.1f}M parameters; model states in fp32 with AdamW "
        f"16 bytes per parameter = {states / GIB:.2f} GiB = {states / m['cap']:.2f}x the cap",
        f"- Cap: a cgroup v1 memory group of {m['cap'] / GIB:.2f} GiB holding the launcher and both ranks "
        "(it counts the page cache)",
        "- Offloaded run: stage 3, offload_optimizer nvme (buffer_count 3, sub-groups of one bucket), offload_param "
        f"nvme with max_in_cpu 0, on {m['nvme_path']} (O_DIRECT); the gradient shards wait on disk too",
        f"- Steps: {m['steps']}, one 64-token row per rank per step, AdamW lr {m['lr']}",
        "",
        "```", m["command"], "```", "",
        "| run | outcome | peak memory of the group | peak RSS per rank | step s (slowest rank) |",
        "|---|---|---:|---:|---|",
        _row("capped, disk offload", off, step_s),
        _row("capped, no offload", none, []),
        _row("uncapped, no offload (reference)", ref, ref_s),
        "",
        f"Bytes each rank's swap files moved in the last step (rank 0): {_moved(moved)}.",
        f"Losses, offloaded: {losses}; reference: {ref_losses}.",
        "",
        *[f"- {'met' if ok else 'MISSED'}: {claim}" for claim, ok in checks.items()],
    ]
    if none["ranks"]:
        lines += ["", "The error without offload (rank 0):", "", "> " + none["ranks"][0].get("message", "")]
    return "\n".join(lines) + "\n", all(checks.values())


def _row(name: str, run: dict, step_s: list[float]) -> str:
    ranks = run["ranks"]
    if run["exit_code"] == 0:
        outcome = f"trained {len(ranks[0]['losses'])} steps"
    elif ranks and all("error" in r for r in ranks):
        outcome = f"{ranks[0]['error']} on every rank (exit {run['exit_code']})"
    else:
        outcome = f"exit {run['exit_code']}" + (" (oom_kill)" if run.get("group", {}).get("oom_kill") else "")
    peak = f"{run['group']['max_usage'] / GIB:.2f} GiB" if "group" in run else "–"
    rss = ", ".join(f"{r['peak_rss'] / GIB:.2f}" for r in ranks) + " GiB" if ranks else "–"
    steps = ", ".join(f"{s:.1f}" for s in step_s) or "–"
    return f"| {name} | {outcome} | {peak} | {rss} | {steps} |"


def _moved(moved: dict) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {v / 1e9:.2f} GB" for k, v in sorted(moved.items())) or "none"


if __name__ == "__main__":
    sys.exit(main())
