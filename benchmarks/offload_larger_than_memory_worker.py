"""One rank of `offload_larger_than_memory.py`, or the launcher of both ranks; never started by hand.

`--launch N`: the launcher, started inside the memory cgroup. It imports no
torch (its memory is a few MB of the cap), starts N rank processes of this
file with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so they are in the cgroup too,
and exits with the first non-zero exit status (a signal as 128 + its number).

Otherwise one rank: joins the gloo group, builds the GPT under
`zeroshard.meta_init()` (no rank ever holds the whole model), initializes
the engine at stage 3 with the config given as JSON, trains `--steps` steps on
fixed token rows, and writes `rank<r>.json` into `--out`: its losses, step
times, the bytes its swap files read and wrote per step, `memory_stats()` by
pool, peak RSS, and the baseline RSS (torch and zeroshard imported, process
group joined). An error at construction (zeroshard's OutOfMemoryError) is
written there too, with its type and message.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def launch(world: int, argv: list[str]) -> int:
    """Start `world` ranks of this file with `argv`; the first non-zero exit status, 0 if all succeeded."""
    port = str(29500 + os.getpid() % 1000)
    procs = []
    for rank in range(world):
        env = os.environ | {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                            "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs.append(subprocess.Popen([sys.executable, __file__, *argv], env=env))
    codes = [p.wait() for p in procs]
    failed = [c for c in codes if c != 0]
    return (128 - failed[0] if failed[0] < 0 else failed[0]) if failed else 0


def status_rss() -> dict[str, int]:
    """VmRSS, RssAnon, RssFile and VmHWM of this process, bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def count_swap_bytes(moved: dict) -> None:
    """Count every swap file transfer of this process into `moved[(verb, kind)]`, bytes: each moves `nbytes`."""
    from zeroshard.offload import SwapFile

    def counted(verb: str, original):
        def transfer(self, tensor):
            kind = "params" if self.name.startswith("unit") else "optimizer"
            moved[f"{verb}_{kind}"] = moved.get(f"{verb}_{kind}", 0) + self.nbytes
            return original(self, tensor)
        return transfer

    SwapFile.read = counted("read", SwapFile.read)
    SwapFile.write = counted("write", SwapFile.write)


def gpt_init(module) -> None:
    """The GPT's own scheme, module by module (docs/stage-3.md)."""
    from zeroshard.app.models.gpt import GPT

    if hasattr(module, "reset_parameters"):
        module.reset_parameters()
    GPT._init_weights(module)


def train(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    import zeroshard
    from zeroshard.app.models.gpt import GPT, GPTConfig

    rank = dist.get_rank()
    result: dict = {"rank": rank, "baseline": status_rss(), "pid": os.getpid()}
    moved: dict = {}
    count_swap_bytes(moved)
    cfg = GPTConfig(**json.loads(args.model))
    torch.manual_seed(args.seed)
    with zeroshard.meta_init():
        model = GPT(cfg)
    result["num_params"] = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    start = time.perf_counter()
    try:
        engine = zeroshard.initialize(model, optimizer, json.loads(args.config), init=gpt_init)
    except zeroshard.ZeroshardError as exc:
        result |= {"error": type(exc).__name__, "message": str(exc), "is_memory_error": isinstance(exc, MemoryError),
                   "peak_rss": peak_rss(), "after": status_rss()}
        return result
    result |= {"build_s": time.perf_counter() - start, "after_build": status_rss(), "build_moved": dict(moved)}
    gen = torch.Generator().manual_seed(1000 + rank)  # fixed rows, different on each rank, the same in every run
    rows = torch.randint(cfg.vocab_size, (args.rows, cfg.block_size + 1), generator=gen)
    losses, times, per_step = [], [], []
    for _ in range(args.steps):
        moved.clear()
        dist.barrier()
        t0 = time.perf_counter()
        loss = engine(rows[:, :-1], rows[:, 1:])
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        per_step.append(dict(moved))
    result |= {"losses": losses, "step_s": times, "moved": per_step, "peak_rss": peak_rss(), "after": status_rss(),
               "memory_stats": {pool: dict(engine.memory_stats(pool)) for pool in ("device", "host", "disk")}}
    if getattr(engine, "offload", None) is not None:
        engine.offload.close()
    return result


def peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--launch", type=int, default=0, help="start this many ranks (the launcher)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", required=True, help="GPTConfig's fields as JSON")
    p.add_argument("--config", required=True, help="the zeroshard config as JSON")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--threads", type=int, default=1)
    args, _ = p.parse_known_args()
    if args.launch:
        argv = [a for i, a in enumerate(sys.argv[1:]) if a != "--launch" and sys.argv[i] != "--launch"]
        return launch(args.launch, argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    result = train(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{result['rank']}.json").write_text(json.dumps(result, indent=1))
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
