"""One rank of the offload speed benchmark (`offload_speed.py`), never started by hand.

`--train`: build zeroshard at `--stage` with the offload blocks of `--offload`
(none | cpu | nvme) and `--offload-param` (none | nvme), train warmup + steps
on the GPT preset and write, per step: the wall time (forward + backward +
step), the time inside the optimizer tiers' step, and the bytes this rank's
swap files read and wrote, split into optimizer (masters and optimizer
state, files `bucket*`) and params (stage 3's parameter shards, `unit*`).
The bytes are counted by wrapping `SwapFile.read` / `SwapFile.write` in this
process: every transfer moves exactly the file's `nbytes`.

`--bandwidth`: `zeroshard.offload.measure_bandwidth` on `--nvme-path`, every
rank at once (each its own rank directory), so the figures are what each
rank gets while the other does the same.
"""

from __future__ import annotations

import argparse
import cProfile
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from variants import Settings, make_adam  # noqa: E402 (after the path set-up)
from worker import build_model, load_corpus, model_config, peak_rss_bytes, run_rank  # noqa: E402

from zeroshard.app.demo.data import micro_batch  # noqa: E402
from zeroshard.offload import SwapFile, measure_bandwidth  # noqa: E402

MOVED: Counter = Counter()  # ("read" | "write", "optimizer" | "params") -> bytes, this process


def count_swap_bytes() -> None:
    """Count every swap file transfer of this process in MOVED."""
    def counted(verb: str, original):
        def transfer(self: SwapFile, tensor: torch.Tensor):
            MOVED[verb, "params" if self.name.startswith("unit") else "optimizer"] += self.nbytes
            return original(self, tensor)
        return transfer

    SwapFile.read = counted("read", SwapFile.read)
    SwapFile.write = counted("write", SwapFile.write)


def offload_config(args: argparse.Namespace) -> dict:
    zero: dict = {"stage": args.stage, "reduce_bucket_size": args.bucket_elems, "overlap_comm": True}
    if args.offload != "none":
        zero["offload_optimizer"] = {"device": args.offload, "buffer_count": args.buffer_count} | (
            {"nvme_path": args.nvme_path} if args.offload == "nvme" else {}) | (
            {"delayed_update": True, "delayed_update_warmup": 0} if args.delayed_update else {})
        zero["sub_group_size"] = args.sub_group_size
    if args.offload_param != "none":  # every shard on disk: none kept on the host (max_in_cpu 0)
        zero["offload_param"] = {"device": args.offload_param, "nvme_path": args.nvme_path, "max_in_cpu": 0}
    config = {"zero_optimization": zero, "train_micro_batch_size_per_gpu": args.micro_batch,
              "gradient_accumulation_steps": 1}
    if "nvme" in (args.offload, args.offload_param):
        config["aio"] = {"block_size": args.block_size, "thread_count": args.thread_count}
    return config


def train(args: argparse.Namespace) -> dict:
    import zeroshard

    count_swap_bytes()
    rank, world = dist.get_rank(), dist.get_world_size()
    corpus = load_corpus(args.corpus)
    cfg = model_config(args.size, corpus)
    settings = Settings(mode=args.mode, lr=args.lr, micro_batch=args.micro_batch, bucket_elems=args.bucket_elems)
    model, num_params = build_model("zeroshard_s0", cfg, settings, args.seed)
    wrap = [type(model.blocks[0])] if args.stage == 3 else None  # bench.py's units
    engine = zeroshard.initialize(model, make_adam(model.parameters(), settings), offload_config(args), wrap=wrap)

    tiers, opt_seconds = engine.offload.tiers, [0.0]
    tiers_step = tiers.step

    def timed_step(*args, **kwargs):
        start = time.perf_counter()
        try:
            tiers_step(*args, **kwargs)
        finally:
            opt_seconds[0] += time.perf_counter() - start

    tiers.step = timed_step
    profile = cProfile.Profile() if args.profile else None
    times, opt_times, losses, moved = [], [], [], []
    for i in range(args.warmup + args.steps):
        batch = corpus.global_batch(i, rows=args.micro_batch * world, block_size=cfg.block_size, seed=args.seed)
        x, y = micro_batch(batch, rank, world, 0, 1)
        before, opt_seconds[0] = Counter(MOVED), 0.0
        if profile is not None and i == args.warmup:
            profile.enable()
        start = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
        opt_times.append(opt_seconds[0])
        losses.append(loss.item())
        moved.append({f"{verb}_{kind}": n - before[verb, kind] for (verb, kind), n in MOVED.items()})
    if profile is not None:
        profile.disable()
        profile.dump_stats(f"{args.profile}.rank{rank}")
    pools = {pool: engine.memory_stats(pool) for pool in ("device", "host", "disk")}
    engine.offload.close()
    return {"rank": rank, "num_params": num_params, "step_seconds": times, "optimizer_seconds": opt_times,
            "losses": losses, "swap_bytes": moved, "pools": pools, "peak_rss_bytes": peak_rss_bytes(),
            "sub_groups": len(tiers.sub_groups), "swapped_bytes": swapped_bytes(engine)}


def swapped_bytes(engine) -> dict:
    """The bytes of this rank's swap files: optimizer (masters and optimizer state) and params (stage 3's shards)."""
    tiers = engine.offload.tiers
    optimizer = (sum(s.nbytes for swaps in tiers.swaps.values() for s in swaps.values() if s.bound)
                 + sum(g.nbytes for g in tiers.grad_swaps.values()))  # stages 2-3: the gradient shards too
    params = sum(f.shard_swap.nbytes for u in engine.units or [] for f in u.gathered_flats if f.shard_swap)
    masters = sum(swaps["master"].nbytes for swaps in tiers.swaps.values())
    kept = sum(tiers.buckets[i].flat.shard_swap.nbytes for i in tiers.shards_kept)  # not read by the next forward
    groups = [[sum(s.nbytes for s in tiers.swaps[i].values() if s.bound) for i in g] for g in tiers.sub_groups]
    group_masters = [[tiers.swaps[i]["master"].nbytes for i in g] for g in tiers.sub_groups]
    group_grads = [sum(tiers.grad_swaps[i].nbytes for i in g if i in tiers.grad_swaps) for g in tiers.sub_groups]
    return {"optimizer": optimizer, "params": params, "kept_params": kept, "masters": masters, "budget": tiers.budget,
            "group_bytes": [sum(g) for g in groups], "group_masters": [sum(g) for g in group_masters],
            "group_grads": group_grads}


def bandwidth(args: argparse.Namespace) -> dict:
    dist.barrier()  # both ranks measure at once
    return measure_bandwidth(args.nvme_path, block_size=args.block_size, nbytes=args.bandwidth_mib << 20,
                             threads=args.thread_count + 1, rounds=args.rounds, rank=dist.get_rank())


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--train", action="store_true")
    p.add_argument("--bandwidth", action="store_true")
    p.add_argument("--size", default="100m")
    p.add_argument("--mode", choices=["plain", "fused"], default="fused")
    p.add_argument("--stage", type=int)
    p.add_argument("--offload", choices=["none", "cpu", "nvme"], default="none")
    p.add_argument("--offload-param", choices=["none", "nvme"], default="none")
    p.add_argument("--delayed-update", action="store_true", help="offload_optimizer.delayed_update, no warm-up")
    p.add_argument("--nvme-path")
    p.add_argument("--sub-group-size", type=int, default=1_000_000_000)
    p.add_argument("--buffer-count", type=int, default=4)
    p.add_argument("--block-size", type=int, default=1 << 20)
    p.add_argument("--thread-count", type=int, default=1)
    p.add_argument("--bandwidth-mib", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--bucket-elems", type=int, default=25 * 2**20 // 4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus", type=Path)
    p.add_argument("--profile", help="cProfile the timed steps into PROFILE.rank<r>")
    p.add_argument("--result", type=Path, required=True)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    return run_rank(lambda: bandwidth(args) if args.bandwidth else train(args), args.result)


if __name__ == "__main__":
    sys.exit(main())
