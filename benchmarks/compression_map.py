"""The map of when compression pays: stage-2 step time with each gradient codec on a shaped two-node link.

What it measures: the median step time (forward + backward + Adam step, fp32,
1 sequence per rank) of one GPT on 2 nodes x 1 rank, the two nodes joined by a
link shaped to 10 Gbit/s, 1 Gbit/s and 100 Mbit/s in each direction, for:

- zeroshard_s2: ZeRO stage 2, exact (every ratio divides its time);
- zeroshard_s2_int8, _fp8_e4m3, _int4: the same with
  `communication_compression.gradients.codec`, error feedback on (the default),
  int4 with the codec's default (no rotation since the convergence runs; the
  table in BENCHMARKS.md was measured with int4 rotated, the default then);
  the parameter all-gather stays exact;
- zeroshard_s1_powersgd: zeroshard's PowerSGD (rank 4) at stage 1, run only
  when zeroshard/comm/compress/powersgd.py exists and the config accepts it (else a
  printed note says it was skipped);
- ddp, ddp_powersgd: torch DDP (25 MiB buckets), plain and with torch's
  `powerSGD_hook` (matrix_approximation_rank 4, start_powerSGD_iter 2: the
  warm-up steps, exact, are not timed), in one bucket: on gloo the hook's
  chained all-reduces of several buckets can run in different orders on
  different ranks and fail.

Per variant and rate: the median over the timed steps of the slowest rank's
step, zeroshard_s2's over it, the bytes that crossed the link per step (the
veth counters of both nodes) beside comm_stats()'s logical bytes per step and
the estimate's (`estimate.step_bytes` over the engine's buckets). Then the
estimate's break-even bandwidth per codec (`estimate.compression_summary`,
the model of zeroshard/estimate/break_even.py) for C = zeroshard_s2's step
less its seconds blocked in collectives, and each codec's seconds per element
measured here as `zeroshard estimate --compress` measures them; beside it,
where the measured ratio to zeroshard_s2 crosses 1 between two rates
(interpolated in log bandwidth).

How it runs: benchmarks/zeropp_slow_network.py's namespaces, veth pair, tbf
shaping and launcher (imported), one torchrun per node with 1 rank each;
the rate changes between rates with `tc qdisc change`; `--rounds` rounds of
every rate and variant, interleaved, each a fresh process tree.

    sudo python benchmarks/compression_map.py [--rates 10gbit 1gbit 100mbit] [--rounds 2] [--steps 4]
        [--warmup 3] [--size 10m] [--tokens 64] [--out BENCHMARKS.md]

The defaults take about 18 minutes on 2 cores (a round: 2.5 minutes at 10 Gbit/s, 3 at 1 Gbit/s, 8 at
100 Mbit/s).

Results: benchmarks/results/compression_map.json (git-ignored); `--out FILE`
writes the section "Compression on a shaped link" of FILE.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import zeropp_slow_network as net

HERE = Path(__file__).resolve()
REPO = HERE.parent.parent
BUCKET = 6_553_600  # elements: DDP's default 25 MiB of fp32, for zeroshard's buckets too
CODEC = {"zeroshard_s2_int8": "int8", "zeroshard_s2_fp8_e4m3": "fp8_e4m3", "zeroshard_s2_int4": "int4"}
# variant -> (library, stage, communication_compression.gradients)
VARIANTS: dict[str, tuple[str, int, dict]] = {
    "zeroshard_s2": ("zeroshard", 2, {}),
    **{name: ("zeroshard", 2, {"codec": codec}) for name, codec in CODEC.items()},
    "zeroshard_s1_powersgd": ("zeroshard", 1, {"codec": "powersgd", "rank": 4, "start_step": 2}),
    "ddp": ("ddp", 0, {}),
    "ddp_powersgd": ("ddp", 0, {"rank": 4}),
}
BASELINE = "zeroshard_s2"
CONSTRUCTION = ("broadcast", "object_gather", "fault_check")  # initialize()'s ops, not a step's


# ---------------------------------------------------------------- one rank (under torchrun)

def zeroshard_config(variant: str) -> dict:
    _, stage, gradients = VARIANTS[variant]
    config = {"zero_optimization": {"stage": stage, "overlap_comm": True, "reduce_bucket_size": BUCKET,
                                    "allgather_bucket_size": BUCKET},
              "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}
    return config | ({"communication_compression": {"gradients": gradients}} if gradients else {})


def build(variant: str, model, optimizer):
    """(one training step of (x, y) -> loss, the zeroshard engine or None)."""
    import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as powersgd
    from torch.nn.parallel import DistributedDataParallel

    import zeroshard

    library, _, extra = VARIANTS[variant]
    if library == "zeroshard":
        engine = zeroshard.initialize(model=model, optimizer=optimizer, config=zeroshard_config(variant))

        def zero_step(x, y):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return loss
        return zero_step, engine
    # torch's PowerSGD hook issues a bucket's later all-reduces from the callback of its first; with several
    # buckets the ranks may issue them in different orders, which gloo cannot match ("Received data size
    # doesn't match expected size"): one bucket for the whole model avoids it (at no cost of overlap worth
    # counting: its messages are small).
    one_bucket = 4 * sum(p.numel() for p in model.parameters()) / 2**20 + 1
    ddp = DistributedDataParallel(model, bucket_cap_mb=one_bucket if extra else BUCKET * 4 / 2**20)
    if extra:
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=extra["rank"],
                                       start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)

    def ddp_step(x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = ddp(x, y)
        loss.backward()
        optimizer.step()
        return loss
    return ddp_step, None


def engine_totals(engine) -> tuple[dict[str, int], float]:
    """zeroshard's logical bytes per op and blocked seconds so far on this rank, setup ops left out."""
    if engine is None:
        return {}, 0.0
    stats = {op: s for op, s in engine.comm_stats().items() if op not in CONSTRUCTION}
    return {op: s.bytes for op, s in stats.items()}, sum(s.seconds for s in stats.values())


def train(args: argparse.Namespace) -> dict:
    """Build the variant, warm up, time the steps; the link's and the engine's counters around the timed ones."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO))
    from zeroshard.app.models.gpt import GPT, GPTConfig

    rank, world = dist.get_rank(), dist.get_world_size()
    n_layer, n_embd = net.SIZES[args.size]
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig(vocab_size=net.VOCAB, block_size=args.tokens, n_layer=n_layer, n_head=8, n_embd=n_embd))
    num_params = model.num_params()
    step, engine = build(args.variant, model, torch.optim.Adam(model.parameters(), lr=1e-4))
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            dist.barrier()  # both nodes start counting at the same step
            tx0, (ops0, blocked0) = net.tx_bytes(), engine_totals(engine)
        x, y = net.batch(i, args.seed, args.tokens, rank, world)
        start = time.perf_counter()
        losses.append(step(x, y).item())
        times.append(time.perf_counter() - start)
    dist.barrier()
    ops, blocked = engine_totals(engine)
    return {"rank": rank, "local_rank": int(os.environ["LOCAL_RANK"]), "num_params": num_params,
            "step_seconds": times, "losses": losses, "link_tx_bytes": net.tx_bytes() - tx0,
            "engine_ops": {op: b - ops0.get(op, 0) for op, b in ops.items() if b - ops0.get(op, 0)},
            "engine_bytes": sum(ops.values()) - sum(ops0.values()), "engine_cross_node_bytes": 0,
            "blocked_seconds": blocked - blocked0,
            "buckets": [b.flat.padded_numel for b in engine.buckets] if engine is not None else []}


# ---------------------------------------------------------------- the runs

def node_command(k: int, port: int, args: argparse.Namespace, variant: str, result_dir: Path) -> list[str]:
    return net.in_node(k, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                       "--node-rank", str(k), "--master-addr", net.ADDRS[0], "--master-port", str(port), str(HERE),
                       "--worker", "--variant", variant, "--size", args.size, "--tokens", str(args.tokens),
                       "--steps", str(args.steps), "--warmup", str(args.warmup), "--seed", str(args.seed),
                       "--result-dir", str(result_dir))


def run_variant(args: argparse.Namespace, variant: str, port: int, tag: str) -> dict:
    result_dir = net.RESULTS / "compression_map" / tag
    commands = [node_command(k, port, args, variant, result_dir) for k in (0, 1)]
    ranks, logs, timed_out = net.run_nodes(commands, result_dir, f"compression_map_{tag}", args.timeout)
    logs = [str(p.relative_to(REPO)) for p in logs]
    if len(ranks) != 2 or any("error" in r for r in ranks):
        return {"variant": variant, "error": net.first_error(ranks, [REPO / p for p in logs], timed_out,
                                                             args.timeout), "logs": logs}
    timed = args.steps
    # C: the step less the time blocked in collectives, mean over the timed steps, the slower rank
    compute = max((sum(r["step_seconds"][args.warmup:]) - r["blocked_seconds"]) / timed for r in ranks)
    return net.summarize(variant, ranks, args.warmup) | {
        "logs": logs, "compute_seconds": compute, "buckets": ranks[0]["buckets"],
        "engine_ops_per_step": {op: b / timed for op, b in ranks[0]["engine_ops"].items()}}


def skipped(variants: list[str]) -> dict[str, str]:
    """Variants this tree cannot run, and why: zeroshard's PowerSGD without its module or refused by the config."""
    sys.path.insert(0, str(REPO))
    from zeroshard.config import Config, ConfigError

    out = {}
    for v in variants:
        if VARIANTS[v][2].get("codec") == "powersgd" and not (REPO / "zeroshard/comm/compress/powersgd.py").exists():
            out[v] = "zeroshard/comm/compress/powersgd.py is not in this tree: the engine does not implement PowerSGD here"
            continue
        if VARIANTS[v][0] == "zeroshard":
            try:
                Config.load(zeroshard_config(v))
            except ConfigError as error:
                out[v] = f"the config refuses it: {str(error).splitlines()[0]}"
    return out


def set_rate(rate: str) -> None:
    """Both directions of the link shaped to `rate` (the qdiscs of net.setup, changed in place)."""
    for k in (0, 1):
        net.sh(*net.in_node(k, "tc", "qdisc", "change", "dev", net.VETHS[k], "root", "tbf", "rate", rate, *net.TBF))


def run_all(args: argparse.Namespace, variants: list[str]) -> list[dict]:
    """Every rate and variant `--rounds` times, rate by rate inside each round, each on a fresh port."""
    rounds, port = [], 29800
    with net.network(args.rates[0]):
        for rnd in range(args.rounds):
            for rate in args.rates:
                set_rate(rate)
                for variant in variants:
                    port += 1
                    print(f"[{time.strftime('%H:%M:%S')}] round {rnd + 1}/{args.rounds} {rate} {variant}", flush=True)
                    result = run_variant(args, variant, port, f"{variant}.{rate}.round{rnd}")
                    rounds.append(result | {"round": rnd, "rate": rate})
                    net.print_result(result)
    return rounds


# ---------------------------------------------------------------- command line

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=sorted(net.SIZES), default="10m")
    p.add_argument("--tokens", type=int, default=64, help="sequence length, 1 sequence per rank per step")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3, help="at least 2: torch's PowerSGD starts at step 2")
    p.add_argument("--rounds", type=int, default=2, help="run every rate and variant this many times, interleaved")
    p.add_argument("--rates", nargs="+", default=["10gbit", "1gbit", "100mbit"], help="tbf rates, in tc's units")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    net.add_run_flags(p, VARIANTS)
    args = p.parse_args(argv)
    if args.warmup < 2 and not args.worker:
        p.error("--warmup must be at least 2: DDP's PowerSGD hook runs exact until its step 2")
    if BASELINE not in args.variants:
        p.error(f"--variants must include {BASELINE}: every ratio divides its time")
    return args


def load() -> str:
    """The load averages (1, 5, 15 minutes), as `uptime` prints them."""
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip().split("load average: ")[-1]


def main() -> int:
    args = parse_args()
    if args.worker:
        return net.run_worker(args, train)
    problem = net.missing_prerequisites()
    if problem:
        print(f"compression_map: {problem}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(REPO))
    from compression_map_report import analyse, section

    from zeroshard.app.estimate.compress import codec_seconds_per_element

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks (teardown) on kill too
    command = "python " + " ".join([str(HERE.relative_to(REPO)), *sys.argv[1:]])
    not_run = skipped(args.variants)
    for variant, why in not_run.items():
        print(f"compression_map: skipping {variant}: {why}", flush=True)
    variants = [v for v in args.variants if v not in not_run]
    codecs = {v: c for v, c in CODEC.items() if v in variants}
    before = load()
    # the codec's time per element, as `zeroshard estimate --compress` measures it, before the runs load the cores
    per_element = {c: codec_seconds_per_element(c, 128, 2) for c in codecs.values()}
    rounds = net.on_the_network("compression_map", lambda: run_all(args, variants))
    if isinstance(rounds, int):
        return rounds
    found = analyse(rounds, args.rates, codecs, BASELINE, per_element)
    context = {"command": command, "codecs": codecs, "baseline": BASELINE, "variants": variants,
               "skipped": not_run, "loads": (before, load())}
    net.publish(net.RESULTS / "compression_map.json", args, {"context": context, "per_element": per_element,
                                                              "rounds": rounds, "found": found},
                section(args, rounds, found, context))
    return 0


if __name__ == "__main__":
    sys.exit(main())
