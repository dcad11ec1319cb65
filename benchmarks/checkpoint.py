"""Checkpoint benchmark: save and load time, size on disk, RSS during the save, and reloads
on other world sizes, for zeroshard stages 2 and 3 against FSDP2 + torch.distributed.checkpoint
and DeepSpeed ZeRO-2/3, on gloo ranks on CPU.

    python benchmarks/checkpoint.py --sizes 4m 100m --rounds 3 --reshard

Per preset and variant, in fresh process trees started like bench.py's
(`launch.py`, the ranks of `checkpoint_worker.py`):

1. `--world` ranks build the variant, train `--train-steps` steps and save
   `--rounds` times (save time, time until on disk, bytes, files, RSS);
2. `--world` ranks build it afresh and load the last save `--rounds` times
   (load time, then the loaded weights against the saved ones);
3. with `--reshard`, the same at each of `--reshard-worlds` (default 1 and 4).
   DeepSpeed is expected to fail there (its ZeRO checkpoints reload on another
   world size only through its universal-checkpoint conversion): the failure
   is recorded and the benchmark goes on.

Results accumulate in benchmarks/results/checkpoint.json (a run of some
sizes or variants replaces those entries) and are rendered as a "Checkpoints"
section to benchmarks/results/checkpoint.md. Checkpoints are written under
benchmarks/results/checkpoints/ and deleted once read (`--keep` keeps them).
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
sys.path.insert(0, str(HERE))

from bench import BLOCK_SIZE, SIZES, command_line, machine, open_results, prepare_corpus, rank_env
from launch import launch
from report import render_checkpoints

# Kept in sync with checkpoint_worker.checkpointer (not imported: this process stays free of torch).
VARIANTS = ["fsdp2", "fsdp2_reshard", "deepspeed_z2", "deepspeed_z3", "zeroshard_s2", "zeroshard_s3"]
DEFAULT_VARIANTS = ["fsdp2", "deepspeed_z2", "deepspeed_z3", "zeroshard_s2", "zeroshard_s3"]
# Settings that all merged results must share, or their numbers do not compare.
WORKLOAD = ["world", "micro_batch", "lr", "seed", "train_steps", "rounds", "mode"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", choices=SIZES, default=SIZES)
    p.add_argument("--variants", nargs="+", choices=VARIANTS + ["all"], default=DEFAULT_VARIANTS,
                   help=f"default: {' '.join(DEFAULT_VARIANTS)}; all adds fsdp2_reshard (the same DCP state dicts)")
    p.add_argument("--world", type=int, default=2, help="ranks that train, save and load")
    p.add_argument("--reshard", action="store_true", help="also load every checkpoint at --reshard-worlds ranks")
    p.add_argument("--reshard-worlds", type=int, nargs="+", default=[1, 4])
    p.add_argument("--rounds", type=int, default=3, help="saves and loads per variant; the median is reported")
    p.add_argument("--train-steps", type=int, default=3, help="training steps before saving")
    p.add_argument("--mode", choices=["plain", "fused"], default="plain", help="Adam as in bench.py")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1200, help="seconds per process tree")
    p.add_argument("--json", type=Path, default=HERE / "results" / "checkpoint.json")
    p.add_argument("--out", type=Path, default=HERE / "results" / "checkpoint.md")
    p.add_argument("--dir", type=Path, default=HERE / "results" / "checkpoints", help="where checkpoints are written")
    p.add_argument("--keep", action="store_true", help="keep the last checkpoint of each variant")
    p.add_argument("--fresh", action="store_true", help="drop earlier results in the JSON file")
    p.add_argument("--render-only", action="store_true", help="rewrite --out from the JSON file; run nothing")
    args = p.parse_args()
    if min(args.world, args.rounds, args.train_steps, args.micro_batch, *args.reshard_worlds) < 1:
        p.error("--world, --rounds, --train-steps, --micro-batch and --reshard-worlds must be >= 1")
    chosen = VARIANTS if "all" in args.variants else args.variants
    args.variants = [v for v in VARIANTS if v in chosen]  # report order
    args.read_worlds = [args.world] + ([w for w in args.reshard_worlds if w != args.world] if args.reshard else [])
    return args


def _max_over_ranks(rank_results: list[dict], key: str) -> list[float]:
    """Per round, the largest value of `key` over the ranks."""
    return [max(r["rounds"][i][key] for r in rank_results) for i in range(len(rank_results[0]["rounds"]))]


def _rss_deltas(rank_results: list[dict]) -> list[int]:
    return [max(r["rounds"][i]["rss_peak_bytes"] - r["rounds"][i]["rss_before_bytes"] for r in rank_results)
            for i in range(len(rank_results[0]["rounds"]))]


def summarize_write(rank_results: list[dict], world: int) -> dict:
    r0 = rank_results[0]
    save = [1000 * s for s in _max_over_ranks(rank_results, "seconds")]
    # from the first rank's start to rank 0's last fsync (the ranks share one monotonic clock)
    durable = [1000 * (m["durable_end"] - min(r["rounds"][i]["start"] for r in rank_results))
               for i, m in enumerate(r0["rounds"])]
    deltas = _rss_deltas(rank_results)
    last = r0["rounds"][-1]
    return {
        "ok": True,
        "writer_world": world,
        "num_params": r0["num_params"],
        "losses": r0["losses"],
        "save_ms": statistics.median(save),
        "save_ms_rounds": save,
        "durable_ms": statistics.median(durable),
        "durable_ms_rounds": durable,
        "bytes": last["bytes"],
        "bytes_rounds": [m["bytes"] for m in r0["rounds"]],
        "files": last["files"],
        "file_names": last["file_names"],
        "save_rss_delta_bytes": max(deltas),
        "save_rss_delta_bytes_rounds": deltas,
        "save_rss_delta_bytes_per_rank": [max(m["rss_peak_bytes"] - m["rss_before_bytes"] for m in r["rounds"])
                                          for r in rank_results],
        "rss_before_save_bytes": max(r["rounds"][0]["rss_before_bytes"] for r in rank_results),
        "fingerprint": r0["fingerprint"],
    }


def summarize_read(rank_results: list[dict], saved: dict[str, str]) -> dict:
    r0 = rank_results[0]
    load = [1000 * s for s in _max_over_ranks(rank_results, "seconds")]
    loaded = r0["fingerprint"]
    keys = sorted(set(saved) | set(loaded))
    differ = [k for k in keys if saved.get(k) != loaded.get(k)]
    return {
        "ok": True,
        "load_ms": statistics.median(load),
        "load_ms_rounds": load,
        "load_rss_delta_bytes": max(_rss_deltas(rank_results)),
        "tensors": len(keys),
        "tensors_differ": differ,
        "exact": not differ,
        "changed_by_load": r0["fingerprint_before"] != loaded,
        "client_state_ok": all(r["client_state_ok"] for r in rank_results),
    }


def run_ranks(args: argparse.Namespace, role: str, size: str, variant: str, world: int, directory: Path,
              corpus: Path) -> tuple[list[dict] | None, str | None, float]:
    """One process tree of `world` ranks in `role`: (their results, or None and the error; its seconds)."""
    stem = HERE / "results" / "logs" / f"checkpoint_{size}_{variant}_{role}{world}"
    for old in stem.parent.glob(stem.name + ".*"):
        old.unlink()
    argv = [str(HERE / "checkpoint_worker.py"), "--role", role, "--variant", variant, "--size", size]
    argv += ["--mode", args.mode, "--train-steps", str(args.train_steps), "--rounds", str(args.rounds)]
    argv += ["--micro-batch", str(args.micro_batch), "--lr", str(args.lr), "--seed", str(args.seed)]
    argv += ["--corpus", str(corpus), "--dir", str(directory), "--result", str(stem.with_suffix(".json"))]
    run = launch(argv, world, stem, args.timeout, rank_env())
    results = run.results(stem.with_suffix(".json"))
    if run.ok and all(r and "error" not in r for r in results):
        return results, None, run.seconds
    return None, run.error(results, args.timeout), run.seconds


def run_variant(args: argparse.Namespace, size: str, variant: str, corpus: Path) -> dict:
    root = args.dir / f"{size}_{variant}"
    shutil.rmtree(root, ignore_errors=True)
    written, error, seconds = run_ranks(args, "write", size, variant, args.world, root, corpus)
    print(f"  write at {args.world} ranks: " + (f"FAILED: {error}" if error else "ok") + f" ({seconds:.0f} s)",
          flush=True)
    if error:
        shutil.rmtree(root, ignore_errors=True)
        return {"ok": False, "error": error}
    entry = summarize_write(written, args.world) | {"loads": {}}
    kept = Path(written[0]["kept"])
    for world in args.read_worlds:
        read, error, seconds = run_ranks(args, "read", size, variant, world, kept, corpus)
        load = {"ok": False, "error": error} if error else summarize_read(read, entry["fingerprint"])
        entry["loads"][str(world)] = load
        if error:
            status = f"FAILED: {error}"
        else:
            status = f"{load['load_ms']:.0f} ms, " + ("exact" if load["exact"] else
                                                      f"{len(load['tensors_differ'])} tensors differ")
        print(f"  read at {world} ranks: {status} ({seconds:.0f} s)", flush=True)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return entry


def main() -> int:
    args = parse_args()
    if args.render_only:
        args.out.write_text(render_checkpoints(json.loads(args.json.read_text()), SIZES, VARIANTS))
        return 0
    (HERE / "results" / "logs").mkdir(parents=True, exist_ok=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    corpus = HERE / "results" / "corpus.pt"
    prepare_corpus(corpus)
    meta = machine() | {
        "world": args.world, "block_size": BLOCK_SIZE, "micro_batch": args.micro_batch, "lr": args.lr,
        "seed": args.seed, "train_steps": args.train_steps, "rounds": args.rounds, "mode": args.mode,
    }  # fmt: skip
    results = open_results(args.json, args.fresh, meta, WORKLOAD)
    command = command_line()
    todo = [(size, variant) for size in args.sizes for variant in args.variants]
    for i, (size, variant) in enumerate(todo, 1):
        print(f"[{i}/{len(todo)}] {size} {variant}", flush=True)
        entry = run_variant(args, size, variant, corpus)
        results["runs"][f"{size}/{variant}"] = entry | {
            "size": size, "variant": variant, "command": command,
            "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        if entry["ok"]:
            print(f"  save {entry['save_ms']:.0f} ms (+fsync {entry['durable_ms']:.0f} ms), "
                  f"{entry['bytes'] / 2**20:.1f} MiB in {entry['files']} files, "
                  f"save RSS +{entry['save_rss_delta_bytes'] / 2**20:.1f} MiB", flush=True)
        # written after every variant, so an interrupted run keeps what it measured
        args.json.write_text(json.dumps(results, indent=1))
        args.out.write_text(render_checkpoints(results, SIZES, VARIANTS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
