"""Offload's speed, side by side: zeroshard stages 1-3 with no offload, offload_optimizer cpu, offload_optimizer
nvme and (stage 3) offload_optimizer + offload_param nvme, beside the disk's bandwidth and the bytes a step moves.

    python benchmarks/offload_speed.py --nvme-path /var/tmp/zeroshard-offload --rounds 2

Per stage and variant, a fresh process tree of `--world` ranks (`launch.py`,
the ranks of `offload_worker.py`) trains the GPT preset with fused Adam as
bench.py does (1 sequence x 128 tokens per rank, fp32, bucket 6,553,600
elements, overlap_comm) and reports the median step time (per step the
slowest rank), the time inside the optimizer tiers' step, and the bytes each
rank's swap files read and wrote per step, counted beside the formula
(masters and optimizer state read and written once per step; stage 3's
parameter shards read at each gather, forward and backward, but those the step
keeps for the next forward, written once).

The disk: `zeroshard.offload.measure_bandwidth` on `--nvme-path` at the
engine's block size and thread count (aio.thread_count + 1 workers per rank),
O_DIRECT (the page cache out of the way), run by every rank at once before
and after the training runs; the best is kept. The I/O time of a step is then
bytes read / read bandwidth + bytes written / write bandwidth, per rank with
each rank's share of the disk (both ranks stream at once, as in training).

The offload issue's bounds (acceptance 5): a disk-offloaded step <= 1.25x
max(the in-memory step, its I/O time); a host-offloaded step <= 1.1x the
in-memory step. Results accumulate in benchmarks/results/offload_speed.json;
the section is written into `--out` (BENCHMARKS.md) by report.write_section.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from bench import BLOCK_SIZE, SIZES, command_line, machine, open_results, prepare_corpus, rank_env
from launch import launch
from report import write_section

# nvme_param: offload_optimizer and offload_param nvme, stage 3; nvme_delayed: offload_optimizer nvme with
# delayed_update (no warm-up): the CPU step and its disk I/O overlap the next forward and backward;
# nvme_stream: offload_optimizer nvme with sub_group_size = reduce_bucket_size, so the tier is more sub-groups
# than buffer_count and streams through them (the others run at --sub-group-size)
VARIANTS = ["none", "cpu", "nvme", "nvme_stream", "nvme_param", "nvme_delayed"]
ON_DISK = ("nvme", "nvme_stream", "nvme_param", "nvme_delayed")
LABELS = {"none": "no offload", "cpu": "offload_optimizer cpu", "nvme": "offload_optimizer nvme",
          "nvme_stream": "offload_optimizer nvme, sub-groups of one bucket",
          "nvme_param": "offload_optimizer + offload_param nvme",
          "nvme_delayed": "offload_optimizer nvme, delayed_update"}
HOST_BOUND, DISK_BOUND = 1.1, 1.25
WORKLOAD = ["world", "micro_batch", "bucket_elems", "lr", "seed", "steps", "warmup", "size", "mode",
            "sub_group_size", "buffer_count", "thread_count", "block_size"]
NOT_A_DISK = {"tmpfs", "ramfs", "devtmpfs", "overlay", "squashfs"}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nvme-path", type=Path, required=True, help="a directory on the disk under test (not tmpfs)")
    p.add_argument("--size", choices=SIZES, default="100m")
    p.add_argument("--mode", choices=["plain", "fused"], default="fused")
    p.add_argument("--stages", type=int, nargs="+", choices=[1, 2, 3], default=[1, 2, 3])
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=VARIANTS)
    p.add_argument("--steps", type=int, default=6, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before them (Adam's state appears in the first)")
    p.add_argument("--rounds", type=int, default=1, help="every variant this many times, round-robin; the fastest")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--bucket-elems", type=int, default=25 * 2**20 // 4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sub-group-size", type=int, default=1_000_000_000, help="zero_optimization.sub_group_size")
    p.add_argument("--buffer-count", type=int, default=4, help="offload_optimizer.buffer_count")
    p.add_argument("--thread-count", type=int, default=1, help="aio.thread_count")
    p.add_argument("--block-size", type=int, default=1 << 20, help="aio.block_size, bytes")
    p.add_argument("--bandwidth-mib", type=int, default=512, help="MiB each rank writes and reads per round")
    p.add_argument("--profile", action="store_true", help="cProfile each rank's timed steps (logs directory)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--out", type=Path, default=REPO / "BENCHMARKS.md")
    p.add_argument("--json", type=Path, default=HERE / "results" / "offload_speed.json")
    p.add_argument("--fresh", action="store_true", help="drop earlier results in the JSON file")
    args = p.parse_args()
    fstype = filesystem(args.nvme_path)
    if fstype in NOT_A_DISK:
        p.error(f"--nvme-path {args.nvme_path} is on {fstype}, not a disk: choose a directory on a real disk")
    args.fstype = fstype
    return args


def filesystem(path: Path) -> str:
    """The type of the filesystem `path` lives on (the longest mount point above it in /proc/mounts)."""
    path = path.resolve()
    best, fstype = "", "?"
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mount, kind, *_ = line.split()
        if (path == Path(mount) or Path(mount) in path.parents) and len(mount) > len(best):
            best, fstype = mount, kind
    return fstype


def worker_argv(args: argparse.Namespace, *extra: str) -> list[str]:
    argv = [str(HERE / "offload_worker.py"), "--nvme-path", str(args.nvme_path), "--block-size", str(args.block_size),
            "--thread-count", str(args.thread_count)]
    return argv + list(extra)


def run_bandwidth(args: argparse.Namespace, label: str) -> dict:
    stem = HERE / "results" / "logs" / f"offload_bandwidth_{label}"
    argv = worker_argv(args, "--bandwidth", "--bandwidth-mib", str(args.bandwidth_mib), "--result",
                       str(stem.with_suffix(".json")))
    run = launch(argv, args.world, stem, args.timeout, rank_env())
    ranks = run.results(stem.with_suffix(".json"))
    if not run.ok or not all(r and "error" not in r for r in ranks):
        sys.exit(f"bandwidth measurement failed: {run.error(ranks, args.timeout)}")
    return {"ranks": ranks, "read_bytes_per_s": min(r["read_bytes_per_s"] for r in ranks),
            "write_bytes_per_s": min(r["write_bytes_per_s"] for r in ranks), "direct": ranks[0]["direct"]}


def run_variant(args: argparse.Namespace, stage: int, variant: str, corpus: Path) -> dict:
    stem = HERE / "results" / "logs" / f"offload_{args.size}_s{stage}_{variant}"
    optimizer = {"none": "none", "cpu": "cpu"}.get(variant, "nvme")
    argv = worker_argv(
        args, "--train", "--size", args.size, "--mode", args.mode, "--stage", str(stage), "--offload", optimizer,
        "--offload-param", "nvme" if variant == "nvme_param" else "none", *(["--delayed-update"] * (
            variant == "nvme_delayed")), "--sub-group-size",
        str(args.bucket_elems if variant == "nvme_stream" else args.sub_group_size),
        "--buffer-count", str(args.buffer_count), "--steps", str(args.steps), "--warmup", str(args.warmup),
        "--micro-batch", str(args.micro_batch), "--bucket-elems", str(args.bucket_elems), "--lr", str(args.lr),
        "--seed", str(args.seed), "--corpus", str(corpus), "--result", str(stem.with_suffix(".json")))
    if args.profile:
        argv += ["--profile", str(stem.with_suffix(".prof"))]
    run = launch(argv, args.world, stem, args.timeout, rank_env())
    ranks = run.results(stem.with_suffix(".json"))
    if not (run.ok and all(r and "error" not in r for r in ranks)):
        return {"ok": False, "error": run.error(ranks, args.timeout)}
    return summarize(ranks, args.warmup) | {"launch_seconds": run.seconds}


def summarize(ranks: list[dict], warmup: int) -> dict:
    """Per timed step the slowest rank, then the median; swap bytes per step per rank (the largest rank's)."""
    def median_of_slowest(key: str) -> float:
        return statistics.median(max(ts) for ts in zip(*(r[key][warmup:] for r in ranks)))

    kinds = ["read_optimizer", "write_optimizer", "read_params", "write_params"]
    moved = {k: max(statistics.median(s.get(k, 0) for s in r["swap_bytes"][warmup:]) for r in ranks) for k in kinds}
    swapped = max((r["swapped_bytes"] for r in ranks), key=lambda b: b["optimizer"] + b["params"])  # the largest
    r0 = ranks[0]
    return {"ok": True, "num_params": r0["num_params"], "step_ms": 1000 * median_of_slowest("step_seconds"),
            "step_ms_each": [1000 * max(ts) for ts in zip(*(r["step_seconds"][warmup:] for r in ranks))],
            "optimizer_ms": 1000 * median_of_slowest("optimizer_seconds"), "moved": moved, "swapped": swapped,
            "sub_groups": r0["sub_groups"], "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks),
            "loss_first": r0["losses"][0], "loss_last": r0["losses"][-1], "pools": r0["pools"]}


def combine_rounds(entries: list[dict]) -> dict:
    failed = [e for e in entries if not e["ok"]]
    if failed:
        return failed[0]
    return min(entries, key=lambda e: e["step_ms"]) | {"step_ms_rounds": [e["step_ms"] for e in entries]}


def load_average() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def main() -> int:
    args = parse_args()
    args.nvme_path.mkdir(parents=True, exist_ok=True)
    (HERE / "results" / "logs").mkdir(parents=True, exist_ok=True)
    corpus = HERE / "results" / "corpus.pt"
    prepare_corpus(corpus)
    meta = machine() | {k: getattr(args, k) for k in WORKLOAD} | {
        "block_size_tokens": BLOCK_SIZE, "nvme_path": str(args.nvme_path), "fstype": args.fstype,
        "rounds": args.rounds}
    results = open_results(args.json, args.fresh, meta, WORKLOAD)
    results.setdefault("bandwidth", {})
    command = command_line()
    loads = [load_average()]
    results["bandwidth"]["before"] = run_bandwidth(args, "before")
    print(f"bandwidth before: {describe(results['bandwidth']['before'])}", flush=True)
    todo = [(s, v) for _ in range(args.rounds) for s in args.stages for v in args.variants
            if v != "nvme_param" or s == 3]
    rounds: dict[str, list[dict]] = {}
    for i, (stage, variant) in enumerate(todo, 1):
        entry = run_variant(args, stage, variant, corpus)
        loads.append(load_average())
        key = f"s{stage}/{variant}"
        rounds.setdefault(key, []).append(entry)
        results["runs"][key] = combine_rounds(rounds[key]) | {
            "stage": stage, "variant": variant, "command": command,
            "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        status = f"{entry['step_ms']:.0f} ms/step (optimizer {entry['optimizer_ms']:.0f} ms)" if entry["ok"] \
            else f"FAILED: {entry['error']}"
        print(f"[{i}/{len(todo)}] stage {stage} {LABELS[variant]}: {status}, load {loads[-1][0]:.1f}", flush=True)
        args.json.write_text(json.dumps(results, indent=1))
    results["bandwidth"]["after"] = run_bandwidth(args, "after")
    print(f"bandwidth after: {describe(results['bandwidth']['after'])}", flush=True)
    results["meta"]["load_average"] = {"min": min(x[0] for x in loads), "max": max(x[0] for x in loads)}
    args.json.write_text(json.dumps(results, indent=1))
    write_section(args.out, render(results))
    shutil.rmtree(args.nvme_path / "zeroshard-swap", ignore_errors=True)
    return 0


def describe(bw: dict) -> str:
    return (f"read {bw['read_bytes_per_s'] / 1e9:.2f} GB/s, write {bw['write_bytes_per_s'] / 1e9:.2f} GB/s per rank "
            f"({'O_DIRECT' if bw['direct'] else 'buffered'})")


def best_bandwidth(results: dict) -> dict:
    """The disk's best figures over the measurements: the shortest I/O time, so the strictest bound."""
    runs = list(results["bandwidth"].values())
    return {k: max(b[k] for b in runs) for k in ("read_bytes_per_s", "write_bytes_per_s")}


def io_ms(run: dict, bw: dict) -> float:
    """A rank's I/O time per step: its bytes read / read bandwidth + written / write bandwidth (each rank's share)."""
    m = run["moved"]
    return 1000 * ((m["read_optimizer"] + m["read_params"]) / bw["read_bytes_per_s"]
                   + (m["write_optimizer"] + m["write_params"]) / bw["write_bytes_per_s"])


def formula_bytes(run: dict) -> tuple[int, int]:
    """Bytes a step reads and writes per rank by the formula (one micro-step a step). Written: masters and
    optimizer state once; parameter shards once. Read: the masters and optimizer state of the sub-groups past
    the first `buffer_count` of the step's order (those stay in memory from the step before; the order
    alternates, so the median step reads the mean of both orders); parameter shards at both gathers (forward,
    backward), but those the step kept in memory for the next forward (offload_param's buffers). Stages 2-3: the gradient shards of the sub-groups past the first `buffer_count` written in
    backward and read back (the others stay in memory for the step). A delayed update reads the uncached
    masters once more, to cast them as it lands."""
    s = run["swapped"]
    params, budget = s["params"], s["budget"]

    def uncached(sizes: list[int]) -> float:
        return (sum(sizes[budget:]) + sum(sizes[::-1][budget:])) / 2

    grads = uncached(s["group_grads"])
    again = uncached(s["group_masters"]) if run["variant"] == "nvme_delayed" else 0
    read_params = 2 * params - s.get("kept_params", 0)
    return grads + uncached(s["group_bytes"]) + read_params + again, grads + sum(s["group_bytes"]) + params


def render(results: dict) -> str:
    """The BENCHMARKS.md section: the setup, the disk, and one row per stage and variant with its bound."""
    m, runs, bw = results["meta"], results["runs"], best_bandwidth(results)
    dates = sorted({r["measured_at"][:10] for r in runs.values()})
    commands = sorted({r["command"] for r in runs.values()})
    params = next((r["num_params"] for r in runs.values() if r.get("ok")), 0)
    load = m.get("load_average", {})
    lines = [
        "## Offload: step time beside the disk's bandwidth",
        "",
        f"- Date: {', '.join(dates)}",
        f"- Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']:.0f} GiB RAM, no GPU; 1-minute load average "
        f"{load.get('min', 0):.1f} to {load.get('max', 0):.1f} during the runs (the ranks and their I/O threads "
        "count in it)",
        f"- Software: Python {m['python']}, torch {m['torch']}",
        f"- Ranks: {m['world']} processes on this machine, gloo, 1 compute thread per rank",
        f"- Workload: GPT {m['size']} ({params / 1e6:.1f}M parameters), per-rank micro batch {m['micro_batch']} x "
        f"{m['block_size_tokens']} tokens, fp32, Adam(fused=True) lr {m['lr']}, reduce_bucket_size "
        f"{m['bucket_elems']:,}, overlap_comm, stage 3 with wrap=[Block]; seed {m['seed']}",
        f"- Offload settings: nvme_path {m['nvme_path']} ({m['fstype']}), sub_group_size {m['sub_group_size']:,}, "
        f"buffer_count {m['buffer_count']}, aio.block_size {m['block_size']:,}, aio.thread_count "
        f"{m['thread_count']} ({m['thread_count'] + 1} I/O threads per rank); offload_param with max_in_cpu 0 "
        "(every sharded unit's parameters on disk)",
        f"- Timing: {m['warmup']} warm-up steps, then {m['steps']} timed steps (forward + backward + step); step ms = "
        "median over the timed steps of the slowest rank's wall time; optimizer ms = the same for the time inside "
        f"the optimizer tiers' step (read ahead, step, write behind, cast); every variant run {m['rounds']} time(s), "
        "interleaved round-robin, fastest round reported",
        "- Bytes: each rank's swap file reads and writes per timed step, counted by wrapping SwapFile.read/write "
        "in the ranks (the largest rank's), beside the formula: masters + optimizer state written once per step and "
        "read but for the first buffer_count sub-groups of the step's order (kept in memory from the step before), "
        "gradient shards (stages 2-3) of the sub-groups past those written and read once, parameter shards read "
        "at each gather (forward and backward) but those a step keeps in memory for the next forward "
        "(offload_param's buffer_count x buffer_size), and written once",
        "- Disk: `zeroshard.offload.measure_bandwidth` on nvme_path at aio.block_size with the engine's I/O "
        "threads, O_DIRECT (no page cache), every rank at once (each rank's share of the disk, as in training), "
        "before and after the runs; the bound uses the best figures (the shortest I/O time)",
        "",
        *_command_lines(commands),
        "Disk bandwidth per rank, both ranks at once (GB/s = 1e9 bytes/s):",
        "",
        "| measured | read GB/s | write GB/s | I/O |",
        "|---|---:|---:|---|",
    ]
    for when, b in results["bandwidth"].items():
        lines.append(f"| {when} the runs | {b['read_bytes_per_s'] / 1e9:.2f} | {b['write_bytes_per_s'] / 1e9:.2f} | "
                     f"{'O_DIRECT' if b['direct'] else 'buffered'} |")
    lines += ["", "| stage | variant | step ms | optimizer ms | sub-groups | peak RSS GiB / rank | read MB / step "
              "/ rank | written MB / step / rank | bytes = formula | I/O ms | bound | ratio | status |",
              "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---|---:|---|"]
    for key, run in sorted(runs.items(), key=lambda kv: (kv[1]["stage"], VARIANTS.index(kv[1]["variant"]))):
        lines.append(_row(run, runs.get(f"s{run['stage']}/none"), bw))
    return "\n".join(lines) + "\n"


def _command_lines(commands: list[str]) -> list[str]:
    return ["Command" + ("s" if len(commands) > 1 else "") + ":", "", "```", *commands, "```", ""]


def _row(run: dict, plain: dict | None, bw: dict) -> str:
    head = f"| {run['stage']} | {LABELS[run['variant']]} |"
    if not run.get("ok"):
        return head + f" failed: {run['error'].replace('|', '/')} | | | | | | | | | | |"
    moved = run["moved"]
    read, written = moved["read_optimizer"] + moved["read_params"], moved["write_optimizer"] + moved["write_params"]
    cells = [f"{run['step_ms']:.0f}", f"{run['optimizer_ms']:.0f}", f"{run['sub_groups']}",
             f"{run['peak_rss_bytes'] / 2**30:.2f}", f"{read / 1e6:.0f}", f"{written / 1e6:.0f}"]
    on_disk = run["variant"] in ON_DISK
    formula = formula_bytes(run)
    cells.append(("yes" if (read, written) == formula else f"no: {formula[0] / 1e6:.0f} / {formula[1] / 1e6:.0f}")
                 if on_disk else "–")
    io = io_ms(run, bw) if on_disk else None
    cells.append(f"{io:.0f}" if io is not None else "–")
    if run["variant"] == "none" or not (plain and plain.get("ok")):
        return head + " " + " | ".join(cells + ["–", "–", "–"]) + " |"
    if on_disk:
        base, bound, what = max(plain["step_ms"], io), DISK_BOUND, "max(in-memory, I/O)"
    else:
        base, bound, what = plain["step_ms"], HOST_BOUND, "in-memory"
    ratio = run["step_ms"] / base
    cells += [f"<= {bound}x {what}", f"{ratio:.2f}x", "met" if ratio <= bound else "missed"]
    return head + " " + " | ".join(cells) + " |"

if __name__ == "__main__":
    sys.exit(main())
