"""Offload on one GPU: peak GPU memory beside the formula, step time with and without cpu offload, and a
7B-class model trained with its optimizer state in host memory (the ZeRO-Offload paper's claim at this scale).

    python benchmarks/offload_gpu.py --out results/offload_gpu.json          # all parts, each its own process
    python benchmarks/offload_gpu.py --part run --variant cpu --layers 24 --n-embd 2048 --steps 4

One rank (one GPU, NCCL), bf16 parameters with fp32 masters, AdamW (fused),
GPT with a 32000-token vocabulary and 512-token sequences, micro batch 1.
Each variant runs in a fresh process: its peak GPU memory
(`torch.cuda.max_memory_allocated`), the device pool `engine.memory_stats`
reports and the formula (`estimate.offload.offload_pool_bytes`) for it,
the median step time after a warm-up step, the host's peak RSS and the losses.
The 7B-class run (33 blocks of 4096: 6.78B parameters, model states 108 GB
at 16 bytes each, over the GPU's 80 GB) first shows that without offload the
engine refuses it with OutOfMemoryError (the GPU's free memory), then trains
it with offload_optimizer cpu.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

VOCAB, BLOCK = 32000, 512


def config(variant: str, stage: int) -> dict:
    zero = {"stage": stage, "stage3_wrap_classes": ["Block"], "overlap_comm": True}
    if variant in ("cpu", "cpu_params"):
        zero["offload_optimizer"] = {"device": "cpu"}
    if variant == "cpu_params":
        zero["offload_param"] = {"device": "cpu"}
    return {"bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}


def run(args: argparse.Namespace) -> dict:
    """One variant in this process."""
    import torch

    import zeroshard
    from zeroshard.app.models.gpt import GPT, GPTConfig
    from zeroshard.estimate.formulas import state_bytes_per_element
    from zeroshard.estimate.offload import offload_pool_bytes, pool_totals

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=VOCAB, block_size=BLOCK, n_layer=args.layers, n_head=args.n_embd // 128,
                    n_embd=args.n_embd)
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 on the GPU: no fp32 copy of a 7B model
    cuda = args.device == "cuda"
    with torch.device(args.device):
        model = GPT(cfg)
    torch.set_default_dtype(torch.float32)
    numel = sum(p.numel() for p in model.parameters())
    out: dict = {"variant": args.variant, "stage": args.stage, "num_params": numel,
                 "gpu": torch.cuda.get_device_name() if cuda else "none"}
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    start = time.perf_counter()
    try:
        engine = zeroshard.initialize(model, optimizer, config(args.variant, args.stage))
    except zeroshard.OutOfMemoryError as exc:
        return out | {"error": "OutOfMemoryError", "message": str(exc)}
    out["build_s"] = time.perf_counter() - start
    rows = torch.randint(VOCAB, (1, BLOCK + 1), device=args.device,
                         generator=torch.Generator(args.device).manual_seed(1))
    losses, times = [], []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.steps):
        sync()
        t0 = time.perf_counter()
        loss = engine(rows[:, :-1], rows[:, 1:])
        engine.backward(loss)
        engine.step()
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    device = dict(engine.memory_stats("device"))
    per_element = state_bytes_per_element("bf16", None, 1, args.stage)
    padded = sum(b.flat.padded_numel for b in engine.buckets)
    largest = max((sum(f.padded_numel for f in u.gathered_flats) for u in engine.units), default=0)
    formula = offload_pool_bytes(padded, 1, args.stage, **per_element,
                                 offload_optimizer="cpu" if args.variant != "none" else "none",
                                 offload_param="cpu" if args.variant == "cpu_params" else "none",
                                 largest_unit=largest if args.stage == 3 else 0)
    return out | {"losses": losses, "step_s": times, "median_step_s": statistics.median(times[1:] or times),
                  "peak_gpu_allocated": torch.cuda.max_memory_allocated() if cuda else 0,
                  "memory_stats_device": device,
                  "formula_device": pool_totals(formula)["device"], "formula": formula,
                  "host_peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


PLAN = [  # (variant, stage, layers, n_embd, steps, timeout s)
    ("none", 2, 24, 2048, 4, 70), ("cpu", 2, 24, 2048, 4, 70), ("cpu_params", 3, 24, 2048, 4, 70),
    ("none", 2, 33, 4096, 2, 45), ("cpu", 2, 33, 4096, 3, 240),
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["all", "run"], default="all")
    p.add_argument("--variant", choices=["none", "cpu", "cpu_params"], default="none")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--n-embd", type=int, default=2048)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--device", default="cuda", help="cpu: a trial of the script without a GPU")
    p.add_argument("--out", type=Path, default=Path("offload_gpu.json"))
    args = p.parse_args()
    if args.part == "run":
        print(json.dumps(run(args)), flush=True)
        return 0
    results = []
    for variant, stage, layers, n_embd, steps, timeout in PLAN:
        cmd = [sys.executable, __file__, "--part", "run", "--variant", variant, "--stage", str(stage),
               "--layers", str(layers), "--n-embd", str(n_embd), "--steps", str(steps)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            last = done.stdout.strip().splitlines()[-1:] if done.returncode == 0 else []
            result = json.loads(last[0]) if last else {"error": f"exit {done.returncode}",
                                                       "stderr": done.stderr[-3000:]}
        except subprocess.TimeoutExpired:
            result = {"error": f"timed out after {timeout} s"}
        result |= {"plan": [variant, stage, layers, n_embd, steps]}
        results.append(result)
        print(json.dumps(result)[:1500], flush=True)
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
