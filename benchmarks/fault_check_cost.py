"""The cost of offload's fault checks (zeroshard/core/faults.py) inside real steps, and of one check alone.

    python benchmarks/fault_check_cost.py --nvme-path /var/tmp/zeroshard-faults --size 100m --steps 5

Two gloo ranks on CPU (`tests/distributed.py`'s spawn) train the GPT preset with fused Adam, one sequence per
rank, with offload_optimizer nvme at stage 2 (one check per step, before the post-step all-gather) and with
offload_optimizer + offload_param nvme at stage 3 (that one, and one before each gather of a unit whose
shards are on disk). Per timed step: the wall time (the slower rank's) and `comm_stats()["fault_check"]`'s
calls and blocked seconds. The blocked seconds bound the checks' cost from above: they include waiting
for the slower rank, which the collective after the check would wait for anyway. Then the check alone,
the median of 1000 back to back. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.distributed import run_ranks  # noqa: E402 (after the path set-up)

VARIANTS = {"stage 2, optimizer on disk": (2, "none"), "stage 3, optimizer and parameters on disk": (3, "nvme")}


def _rank(rank, world, device, args):
    import torch

    import zeroshard
    from zeroshard.app.models import GPT, PRESETS
    from zeroshard.comm import FaultFlags

    torch.set_num_threads(args.threads)
    cfg = PRESETS[args.size]
    out = {}
    for label, (stage, params) in VARIANTS.items():
        torch.manual_seed(0)
        model = GPT(cfg)
        zero = {"stage": stage, "offload_optimizer": {"device": "nvme", "nvme_path": args.nvme_path}} | (
            {"offload_param": {"device": params, "nvme_path": args.nvme_path, "max_in_cpu": 0}}
            if params != "none" else {}) | ({"stage3_wrap_classes": ["Block"]} if stage == 3 else {})
        opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)
        engine = zeroshard.initialize(model, opt, {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero})
        steps = []
        for step in range(args.warmup + args.steps):
            g = torch.Generator().manual_seed(step)
            tokens = torch.randint(cfg.vocab_size, (1, cfg.block_size + 1), generator=g)
            before = engine.comm_stats()["fault_check"]
            start = time.perf_counter()
            engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
            engine.step()
            after = engine.comm_stats()["fault_check"]
            steps.append((time.perf_counter() - start, after.calls - before.calls, after.seconds - before.seconds))
        out[label] = {"params": sum(p.numel() for p in model.parameters()), "steps": steps[args.warmup:]}
        engine.offload.close()
    comm = engine.comm
    alone = []
    for _ in range(1000):
        start = time.perf_counter()
        FaultFlags(comm, False, torch.device("cpu")).failed()
        alone.append(time.perf_counter() - start)
    out["check_alone_us"] = 1e6 * statistics.median(alone)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nvme-path", required=True, help="a directory on the disk under test")
    p.add_argument("--size", default="100m", choices=["tiny", "4m", "100m"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=4, help="torch threads per rank")
    args = p.parse_args()
    Path(args.nvme_path).mkdir(parents=True, exist_ok=True)
    per_rank = run_ranks(_rank, 2, args, timeout_s=1200)
    report = {"check_alone_us": [r["check_alone_us"] for r in per_rank]}
    for label in VARIANTS:
        steps = list(zip(*(r[label]["steps"] for r in per_rank)))  # per step, each rank's (seconds, calls, blocked)
        wall = statistics.median(max(s[0] for s in ranks) for ranks in steps)
        blocked = statistics.median(max(s[2] for s in ranks) for ranks in steps)
        report[label] = {"params": per_rank[0][label]["params"], "step_ms": 1000 * wall,
                         "checks_per_step": steps[0][0][1], "checks_blocked_ms": 1000 * blocked,
                         "share": blocked / wall}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
