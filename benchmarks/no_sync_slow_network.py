"""no_sync on a slow link: one gradient reduction per accumulation window against one per micro-step.

What it measures: the median optimizer-step time (4 micro-steps of forward +
`loss.backward()` + `engine.step()`, the 4th one updating; bf16; Adam) of one
GPT at ZeRO stages 2 and 3, trained on 4 ranks laid out as 2 nodes x 2 ranks
whose nodes talk over a link limited to `--rate` (default 1gbit) each way.
Variants, per stage S:

- zeroshard_sS: every micro-step's backward reduce-scatters its gradients
  (the default);
- zeroshard_sS_no_sync: micro-steps 1-3 of each window run inside
  `engine.no_sync()` (gradients kept whole on .grad), the 4th one's backward
  reduces the window's sum once;
- zeroshard_sS_per_window (`--variants all`): the same through the config key
  `zero_optimization.reduce_once_per_window: true`, no context in the loop.

Per variant: the median step seconds, zeroshard_sS's time over the variant's,
rank 0's reduce-scatter and all-gather bytes and calls per optimizer step from
`engine.comm_stats()`, the bytes that crossed the link per step (both veth
counters), and the largest `engine.memory_stats()` "grads" and "peak" seen
after any micro-step's backward (read outside the timed span) on any rank.

How it runs: benchmarks/zeropp_slow_network.py's namespaces, tbf-shaped veth
pair, torchrun per node (GLOO_SOCKET_IFNAME on the veth), result collection
and section writing, imported; its stage-3 settings (each Block a unit,
`stage3_param_persistence_threshold: 0`, `overlap_comm: true`) at both stages.
Every variant is a fresh process tree; `--rounds` rounds, interleaved.

    sudo python benchmarks/no_sync_slow_network.py [--size 25m] [--steps 4] [--warmup 1]
        [--rate 1gbit] [--rounds 2] [--variants default|all|NAME...] [--out BENCHMARKS.md]

The defaults (GPT 25m, 1 warm-up and 4 timed optimizer steps of 4 micro-steps, 2 rounds) with `--variants
all` (6 variants) took 11 minutes on 2 cores (30-80 s a variant, a third of it start-up); the default 4
variants, about 7.

Needs: root, iproute2. Results: benchmarks/results/no_sync_slow_network_<rate>.json (git-ignored), rank
logs in benchmarks/results/logs/; `--out FILE` writes the section "no_sync on a shaped <rate> link" of FILE.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import resource
import sys
import time
from pathlib import Path

import zeropp_slow_network as net

HERE = Path(__file__).resolve()
REPO = HERE.parent.parent
ACCUMULATION = 4  # micro-steps per optimizer step
HOLDS = {"": "every", "_no_sync": "no_sync", "_per_window": "per_window"}
# variant -> (stage, how the micro-steps before the window's last reduce: every / no_sync / per_window)
VARIANTS: dict[str, tuple[int, str]] = {f"zeroshard_s{stage}{suffix}": (stage, hold)
                                        for stage in (2, 3) for suffix, hold in HOLDS.items()}
DEFAULT = [v for v in VARIANTS if not v.endswith("_per_window")]
OPS = ("reduce_scatter", "all_gather")


# ---------------------------------------------------------------- one rank (under torchrun)

def build(args: argparse.Namespace):
    """(the engine, its GPT's parameter count, how its micro-steps hold: every / no_sync / per_window)."""
    stage, hold = VARIANTS[args.variant]
    model, optimizer = net.gpt(args)
    extra = {"stage": stage} | ({"reduce_once_per_window": True} if hold == "per_window" else {})
    return net.build_zeroshard(model, optimizer, extra, ACCUMULATION), model.num_params(), hold


def counters(engine) -> dict:
    """The link's and the engine's counters so far on this rank: what a timed span's difference is made of."""
    cross, logical = net.cross_node_bytes(engine)
    stats = engine.comm_stats()
    return {"tx": net.tx_bytes(), "cross": cross, "bytes": logical,
            **{f"{op}_{kind}": getattr(stats[op], kind) for op in OPS for kind in ("calls", "bytes")}}


def window(engine, hold: str, step: int, args: argparse.Namespace, memory: dict) -> tuple[float, float]:
    """One optimizer step of ACCUMULATION micro-steps: (its seconds less the memory reads', mean loss);
    `memory`'s "grads" and "peak" raised to what `engine.memory_stats()` says after each backward."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    start, aside, losses = time.perf_counter(), 0.0, []
    for micro in range(ACCUMULATION):
        x, y = net.batch(step * ACCUMULATION + micro, args.seed, args.tokens, rank, world)
        held = hold == "no_sync" and micro < ACCUMULATION - 1
        with engine.no_sync() if held else contextlib.nullcontext():
            loss = engine(x, y)
            loss.backward()
        read = time.perf_counter()
        stats = engine.memory_stats()
        memory.update({kind: max(memory.get(kind, 0), stats[kind]) for kind in ("grads", "peak")})
        aside += time.perf_counter() - read
        engine.step()  # after every micro-step: the engine updates at the window's boundary
        losses.append(loss.item())
    return time.perf_counter() - start - aside, sum(losses) / len(losses)


def train(args: argparse.Namespace) -> dict:
    """Build the variant, run the warm-up then the timed optimizer steps; the counters around the timed ones."""
    import torch.distributed as dist

    engine, num_params, hold = build(args)
    times, losses, memory = [], [], {}
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            dist.barrier()  # both nodes start counting at the same step
            before = counters(engine)
        seconds, loss = window(engine, hold, i, args, memory)
        times.append(seconds)
        losses.append(loss)
        if dist.get_rank() == 0:
            print(f"step {i}: {seconds:.3f} s, loss {loss:.4f}", flush=True)
    dist.barrier()
    spent = {key: value - before[key] for key, value in counters(engine).items()}
    return {"rank": dist.get_rank(), "local_rank": int(os.environ["LOCAL_RANK"]), "num_params": num_params,
            "step_seconds": times, "losses": losses, "link_tx_bytes": spent.pop("tx"),
            "engine_cross_node_bytes": spent.pop("cross"), "engine_bytes": spent.pop("bytes"), "ops": spent,
            "grads_bytes": memory["grads"], "peak_bytes": memory["peak"],
            "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


# ---------------------------------------------------------------- the runs

def summarize(variant: str, ranks: list[dict], warmup: int) -> dict:
    """zeropp_slow_network's summary, and rank 0's ops per optimizer step, the ranks' largest memory figures."""
    summary = net.summarize(variant, ranks, warmup)
    rank0 = next(r for r in ranks if r["rank"] == 0)
    timed = len(summary["step_seconds"])
    return summary | {"ops_per_step_rank0": {key: n / timed for key, n in rank0["ops"].items()},
                      **{key: max(r[key] for r in ranks) for key in ("grads_bytes", "peak_bytes", "max_rss_bytes")}}


def run_variant(args: argparse.Namespace, variant: str, port: int, tag: str) -> dict:
    return net.run_variant(args, variant, port, tag, HERE, [], summarize)


# ---------------------------------------------------------------- report

def row(r: dict, rounds: list[dict], base: float | None) -> str:
    """One variant's table row (`base`: the same stage's every-micro-step seconds)."""
    if "error" in r:
        return f"| {r['variant']} | failed: `{r['error'].splitlines()[0][:300]}` |" + " |" * 9
    ops, mb = r["ops_per_step_rank0"], 1e6
    secs = " / ".join(f"{x['median_step_seconds']:.2f}" for x in rounds
                      if x["variant"] == r["variant"] and "error" not in x)
    ratio = f"{base / r['median_step_seconds']:.2f}x" if base else "n/a"
    return (f"| {r['variant']} | {r['median_step_seconds']:.2f} | {secs} | {ratio} | "
            f"{ops['reduce_scatter_bytes'] / mb:.1f} ({ops['reduce_scatter_calls']:.0f}) | "
            f"{ops['all_gather_bytes'] / mb:.1f} ({ops['all_gather_calls']:.0f}) | "
            f"{r['link_bytes_per_step'] / mb:.1f} | {r['grads_bytes'] / mb:.1f} | {r['peak_bytes'] / mb:.1f} | "
            f"{r['max_rss_bytes'] / mb:.0f} | {r['losses_rank0'][0]:.4f} → {r['losses_rank0'][-1]:.4f} |")


def table(rounds: list[dict], variants: list[str]) -> str:
    """One row per variant, each against the every-micro-step variant of its stage."""
    best = net.fastest_rounds(rounds)
    lines = ["| variant | optimizer step s (median) | all rounds | zeroshard_sS / variant "
             "| reduce-scatter MB/step (calls) | all-gather MB/step (calls) | link MB/step (both ways) "
             "| grads MB (max) | peak MB (max) | RSS MB (max) | loss first → last |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for v in variants:
        base = best.get(f"zeroshard_s{VARIANTS[v][0]}", {}).get("median_step_seconds")
        lines.append(row(best[v], rounds, base))
    return "\n".join(lines)


def section(args: argparse.Namespace, rounds: list[dict], command: str) -> str:
    """The BENCHMARKS.md section: set-up, command, table, how to read it."""
    n_layer, n_embd = net.SIZES[args.size]
    params = next((r["num_params"] for r in rounds if "num_params" in r), None)
    size = f"{params / 1e6:.1f}M parameters, M = {2 * params / 1e6:.0f} MB in bf16" if params else args.size
    return f"""## no_sync on a shaped {net.pretty_rate(args.rate)} link

- Date: {datetime.date.today()}
- Machine: {net.machine()}; CPU only, 4 ranks on 2 cores (1 thread each)
- zeroshard: {net.zeroshard_revision()}
- Network: 2 network namespaces as 2 nodes x 2 ranks, joined by a veth pair shaped with `tc qdisc ... root tbf rate {args.rate} {' '.join(net.TBF)}` on both ends (each direction); ranks of one node talk over the local stack, unshaped
- Workload: GPT {args.size} ({n_layer} layers, width {n_embd}, vocabulary {net.VOCAB}; {size}), 1 sequence x {args.tokens} tokens per rank per micro-step, `gradient_accumulation_steps: {ACCUMULATION}`, Adam lr 1e-4, bf16, ZeRO stage 2 or 3, each Block a unit, `stage3_param_persistence_threshold: 0`, `overlap_comm: true`, `zeropp_ranks_per_node: 2`; loop `loss = engine(x, y); loss.backward(); engine.step()` per micro-step
- Variants: `zeroshard_sS` reduces in every micro-step's backward; `_no_sync` runs micro-steps 1-{ACCUMULATION - 1} of each window inside `engine.no_sync()`; `_per_window` sets `zero_optimization.reduce_once_per_window: true` instead
- Timing: {args.warmup} warm-up optimizer steps, then {args.steps} timed ones of {ACCUMULATION} micro-steps each; step s = median over the timed steps of the slowest rank's step; {args.rounds} round(s) of all variants, interleaved, fastest round shown ("all rounds" lists each)
- Bytes per optimizer step: reduce-scatter and all-gather from rank 0's `comm_stats()` (logical buffer bytes; calls in brackets); link MB: bytes sent by both veth ends during the timed steps (TCP/IP headers included) / steps
- Memory: the largest `memory_stats()["grads"]` and `["peak"]` over every rank and micro-step, read after each backward (outside the timed span); RSS: the largest rank's `ru_maxrss`

Command:

```
{command}
```

{table(rounds, args.variants)}
"""


# ---------------------------------------------------------------- command line

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=sorted(net.SIZES), default="25m")
    p.add_argument("--tokens", type=int, default=64, help="sequence length, 1 sequence per rank per micro-step")
    p.add_argument("--steps", type=int, default=4, help="timed optimizer steps (of 4 micro-steps each)")
    p.add_argument("--warmup", type=int, default=1, help="optimizer steps before the timed ones")
    p.add_argument("--rounds", type=int, default=2, help="run all variants this many times, interleaved")
    p.add_argument("--rate", default="1gbit", help="tbf rate of each direction, in tc's units")
    p.add_argument("--variants", nargs="+", default=["default"], choices=["default", "all", *VARIANTS])
    net.add_run_flags(p, VARIANTS)
    args = p.parse_args(argv)
    groups = {"default": DEFAULT, "all": list(VARIANTS)}
    args.variants = list(dict.fromkeys(v for name in args.variants for v in groups.get(name, [name])))
    return args


def main() -> int:
    return net.serve(HERE, parse_args(), train, section, run_variant)


if __name__ == "__main__":
    sys.exit(main())
