"""One benchmark rank: train one variant for warmup + steps and write its measurements.

Started by `launch.py` (one process per rank, env:// rendezvous), never by hand.
`--prepare-corpus FILE` instead tokenizes the demo corpus once into FILE, so
that no rank pays (in time or in peak RSS) for tokenizing 4M characters.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from variants import BUILDERS, LIBRARY, PEERS, ZEROSHARD, Settings, StepFn, cast_for_peer  # noqa: E402 (after the path set-up)

from zeroshard.app.demo.data import CharCorpus, load_text, micro_batch  # noqa: E402
from zeroshard.app.models.gpt import GPT, PRESETS, GPTConfig  # noqa: E402


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def prepare_corpus(path: Path) -> None:
    corpus = CharCorpus.from_text(load_text())
    torch.save({"ids": corpus.ids, "alphabet": corpus.alphabet}, path)


def load_corpus(path: Path) -> CharCorpus:
    saved = torch.load(path, weights_only=True)
    return CharCorpus(saved["ids"], saved["alphabet"])


def model_config(size: str, corpus: CharCorpus) -> GPTConfig:
    return replace(PRESETS[size], vocab_size=corpus.vocab_size)


def build_model(variant: str, cfg: GPTConfig, settings: Settings, seed: int) -> tuple[nn.Module, int]:
    """The GPT every variant starts from (the same weights for one seed), ready for its builder; and its size."""
    torch.manual_seed(seed)  # the same initial weights on every rank and in every variant
    model = GPT(cfg)
    num_params = model.num_params()
    if variant in PEERS:
        model = cast_for_peer(model, settings)
    return model, num_params


def train_steps(step: StepFn, corpus: CharCorpus, cfg: GPTConfig, settings: Settings, seed: int,
                steps: range) -> tuple[list[float], list[float]]:
    """Run `step` on this rank's micro batch of each global step in `steps`; its seconds and losses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    times, losses = [], []
    for i in steps:
        batch = corpus.global_batch(i, rows=settings.micro_batch * world, block_size=cfg.block_size, seed=seed)
        x, y = micro_batch(batch, rank, world, 0, 1)
        start = time.perf_counter()
        loss = step(x, y)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return times, losses


def model_states(step, world: int) -> dict | None:
    """zeroshard's per-rank `memory_stats()` next to the ZeRO formula for its precision."""
    from zeroshard import estimate

    engine = step.engine
    config, units = engine.config, len(engine.buckets)
    per = estimate.state_bytes_per_element(config.training_dtype, config.communication_data_type,
                                           config.gradient_accumulation_steps, config.stage)
    padded = sum(u.flat.padded_numel for u in engine.buckets)
    formula = estimate.model_state_bytes(padded, world, config.stage, **per, optimizer_scalar_bytes=4 * units)
    # Stage 3 keeps parameters under stage3_param_persistence_threshold whole on every rank.
    persistent = sum(u.flat.padded_numel for u in engine.buckets if config.stage == 3 and not u.switches.shard_params)
    formula["params"] += per["param_bytes"] * (persistent - persistent // world)
    return {"measured": engine.memory_stats(), "formula": formula, "per_element": per}


def train(args: argparse.Namespace) -> dict:
    world = dist.get_world_size()
    corpus = load_corpus(args.corpus)
    cfg = model_config(args.size, corpus)
    settings = Settings(mode=args.mode, lr=args.lr, micro_batch=args.micro_batch, bucket_elems=args.bucket_elems,
                        dtype=args.dtype)

    importlib.import_module(LIBRARY[args.variant])  # its import cost belongs to the baseline
    base_rss = peak_rss_bytes()  # imports, process group and corpus; before any model state
    model, num_params = build_model(args.variant, cfg, settings, args.seed)
    step = BUILDERS[args.variant](model, settings)
    times, losses = train_steps(step, corpus, cfg, settings, args.seed, range(args.warmup + args.steps))
    return {
        "model_states": model_states(step, world) if args.variant in ZEROSHARD else None,
        "rank": dist.get_rank(),
        "num_params": num_params,
        "step_seconds": times,  # warm-up steps included; the caller drops them
        "losses": losses,
        "base_rss_bytes": base_rss,
        "peak_rss_bytes": peak_rss_bytes(),
    }


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--prepare-corpus", type=Path)
    p.add_argument("--variant", choices=sorted(BUILDERS))
    p.add_argument("--size")
    p.add_argument("--mode", choices=["plain", "fused"])
    p.add_argument("--steps", type=int)
    p.add_argument("--warmup", type=int)
    p.add_argument("--micro-batch", type=int)
    p.add_argument("--bucket-elems", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--corpus", type=Path)
    p.add_argument("--result", type=Path, help="where this rank writes its JSON; .rank<r> is appended")
    return p.parse_args()


def run_rank(work: Callable[[], dict], result: Path) -> int:
    """Join the gloo group, run `work` and write its dict (or its error) to `result`.rank<r>."""
    torch.set_num_threads(1)  # two ranks share two cores
    dist.init_process_group("gloo")
    result_path = result.with_name(f"{result.name}.rank{dist.get_rank()}")
    try:
        out = work()
    except Exception as exc:  # noqa: BLE001 -- any failure is reported as this variant's error
        traceback.print_exc()
        result_path.write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        sys.stdout.flush()
        os._exit(1)  # do not wait in collectives for a peer that may never come
    result_path.write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main() -> int:
    args = parse_args()
    if args.prepare_corpus:
        prepare_corpus(args.prepare_corpus)
        return 0
    return run_rank(lambda: train(args), args.result)


if __name__ == "__main__":
    sys.exit(main())
