"""ZeRO++ on a slow link: stage-3 step time with two emulated nodes joined by a shaped 1 Gbit/s link.

What it measures: the median step time (forward + backward + Adam step, bf16,
ZeRO stage 3, stage3_param_persistence_threshold 0) of one GPT, trained on 4
ranks laid out as 2 nodes x 2 ranks, where the two nodes talk over a link
limited to `--rate` (default 1gbit) in each direction and the two ranks of a
node talk over the local stack (fast, unshaped). Variants: zeroshard stage 3
plain, with ZeRO++ (qwZ + hpZ + qgZ) and with each part alone, and DeepSpeed
ZeRO-3 plain and with hpZ (its only ZeRO++ part that runs on CPU). Per variant:
the median step seconds, zeroshard_s3's time over the variant's, the bytes
that crossed the link per step (the veth counters of both nodes) and, for
zeroshard, the cross-node bytes per step that `engine.comm_stats()` recorded.

How it runs: two network namespaces (`zs_node0`, `zs_node1`) joined by a
veth pair (10.77.0.1/24, 10.77.0.2/24), each end shaped with a `tbf` root
qdisc; per variant, in each namespace, `torchrun --nnodes 2 --nproc-per-node 2
--node-rank K --master-addr 10.77.0.1` starts this file again with `--worker`,
with GLOO_SOCKET_IFNAME set to that namespace's veth so that gloo's
cross-node traffic goes through the shaped link. Every variant is a fresh
process tree; the namespaces are removed at the end, on failure and on
Ctrl-C, and stale ones of a crashed run are removed at the start.

    sudo python benchmarks/zeropp_slow_network.py [--size 25m] [--steps 5] [--warmup 2]
        [--rate 1gbit] [--rounds 2] [--variants default|all|NAME...] [--out BENCHMARKS.md]

The defaults (GPT 25m, 6 variants, 2 interleaved rounds) take about 12 minutes on 2 cores.

Needs: root (namespaces and qdiscs), iproute2 (`ip`, `tc`), torch, and for
the DeepSpeed variants deepspeed (benchmarks/requirements.txt). Results go to
benchmarks/results/zeropp_slow_network_<rate>.json (git-ignored), rank logs
to benchmarks/results/logs/; `--out FILE` writes the markdown table into the
section "ZeRO++ on a shaped <rate> link" of FILE.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

from report import write_section

HERE = Path(__file__).resolve()
REPO = HERE.parent.parent
RESULTS = REPO / "benchmarks" / "results"
RunVariant = Callable[[argparse.Namespace, str, int, str], dict]  # (args, variant, port, tag) -> its result

NODES = ("zs_node0", "zs_node1")
VETHS = ("zs_veth0", "zs_veth1")
ADDRS = ("10.77.0.1", "10.77.0.2")
RANKS_PER_NODE = 2
# tbf: `burst` is the bucket the link may send at once at full speed. 128 KiB holds one 64 KiB
# GSO/TSO super-packet of the veth (tbf drops a packet larger than its bucket after trying to
# segment it) and lasts about 1 ms at 1 Gbit/s, so it does not inflate the rate over a step's
# megabytes. `latency` bounds the queue (limit = rate x latency + burst, about 1.3 MB at 1 Gbit/s):
# deep enough that a TCP window of gloo's bursts queues instead of being dropped (retransmissions
# would measure TCP recovery, not bandwidth), shallow enough to add at most 10 ms of queueing.
TBF = ("burst", "128kb", "latency", "10ms")

# GPT shapes (n_layer, n_embd); vocabulary 256, context `--tokens`. Parameters at 64 tokens.
SIZES = {"10m": (6, 384), "25m": (8, 512), "50m": (8, 720)}
VOCAB = 256

ZEROPP = {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}
# variant -> (library, extra zero_optimization keys)
VARIANTS: dict[str, tuple[str, dict]] = {
    "zeroshard_s3": ("zeroshard", {}),
    "zeroshard_s3_zeropp": ("zeroshard", ZEROPP),  # its quantizers compiled where a compiler is (the default)
    "zeroshard_s3_zeropp_eager": ("zeroshard", ZEROPP | {"zeropp_compile_quantizers": False}),
    "zeroshard_s3_hpz": ("zeroshard", {"zero_hpz_partition_size": 2}),
    "deepspeed_z3": ("deepspeed", {}),
    "deepspeed_z3_hpz": ("deepspeed", {"zero_hpz_partition_size": 2}),
    "zeroshard_s3_qwz_qgz": ("zeroshard", {"zero_quantized_weights": True, "zero_quantized_gradients": True}),
    "zeroshard_s3_zeropp_int4": ("zeroshard", ZEROPP | {"zeropp_gradient_bits": 4}),
    "zeroshard_s3_zeropp_int4_unrotated": ("zeroshard", ZEROPP | {"zeropp_gradient_bits": 4,
                                                                   "zeropp_gradient_hadamard": False}),
    "zeroshard_s3_qwz": ("zeroshard", {"zero_quantized_weights": True}),
    "zeroshard_s3_qgz": ("zeroshard", {"zero_quantized_gradients": True}),
}
BASELINE = "zeroshard_s3"
# `--variants default`: the comparison of the report (about 6 minutes a round); `all` adds the other parts alone
# and int4 gradients.
DEFAULT = list(VARIANTS)[:6]


# ---------------------------------------------------------------- one rank (under torchrun)

def zero_block(extra: dict) -> dict:
    """The stage-3 settings every variant shares, so that they differ only in ZeRO++."""
    return {"stage": 3, "stage3_param_persistence_threshold": 0, "overlap_comm": True, **extra}


def build_zeroshard(model, optimizer, extra: dict, accumulation: int = 1):
    """zeroshard stage 3 (or `extra`'s stage) with each Block a unit (as benchmarks/variants.py); nodes of 2
    ranks declared; `accumulation` micro-steps per optimizer step."""
    import zeroshard

    config = {"zero_optimization": zero_block(extra) | {"zeropp_ranks_per_node": RANKS_PER_NODE},
              "bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 1,
              "gradient_accumulation_steps": accumulation}
    return zeroshard.initialize(model=model, optimizer=optimizer, config=config, wrap=[type(model.blocks[0])])


def build_deepspeed(model, optimizer, extra: dict, dtype: str):
    """DeepSpeed ZeRO-3 on the existing gloo group, set up as benchmarks/README.md says it needs on CPU."""
    import deepspeed

    # stage3_max_reuse_distance 0 asks DeepSpeed to release each unit after use, as zeroshard does with
    # persistence threshold 0 (its default, 1e9 elements, would keep this whole model gathered from forward to
    # backward). DeepSpeed 0.19.8 on CPU gathers M once per step from step 1 on either way (counted per call).
    zero = zero_block(extra) | {"stage3_max_reuse_distance": 0}
    config = {"zero_optimization": zero, "train_micro_batch_size_per_gpu": 1,
              "gradient_accumulation_steps": 1, "zero_allow_untested_optimizer": True,
              "gradient_clipping": 0.0,  # DeepSpeed clips to 1.0 by default; zeroshard does not
              "steps_per_print": 10**9}
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    return engine


def batch(step: int, seed: int, tokens: int, rank: int, world: int):
    """This rank's row of the step's global batch: the same data in every variant."""
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    rows = torch.randint(VOCAB, (world, tokens + 1), generator=g)
    return rows[rank : rank + 1, :-1], rows[rank : rank + 1, 1:]


def tx_bytes() -> int:
    """Bytes this namespace's veth has sent: what crossed the shaped link, whoever sent it."""
    iface = os.environ["GLOO_SOCKET_IFNAME"]
    return int(Path(f"/sys/class/net/{iface}/statistics/tx_bytes").read_text())


def cross_node_bytes(engine) -> tuple[int, int]:
    """zeroshard's recorded (cross-node, all) logical bytes so far on this rank; (0, 0) for DeepSpeed."""
    if not hasattr(engine, "comm_stats"):
        return 0, 0
    stats = engine.comm_stats().values()
    return sum(s.by_scope.get("cross_node", 0) for s in stats), sum(s.bytes for s in stats)


def gpt(args: argparse.Namespace):
    """(the `--size` GPT, Adam lr 1e-4 over it): the same initial weights on every rank and in every variant."""
    import torch

    sys.path.insert(0, str(REPO))
    from zeroshard.app.models.gpt import GPT, GPTConfig

    n_layer, n_embd = SIZES[args.size]
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=args.tokens, n_layer=n_layer, n_head=8, n_embd=n_embd))
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def train(args: argparse.Namespace) -> dict:
    """Build the variant, run warm-up then timed steps; the link's and the engine's bytes around the timed ones."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    library, extra = VARIANTS[args.variant]
    model, optimizer = gpt(args)
    num_params = model.num_params()
    if library == "zeroshard":
        engine = build_zeroshard(model, optimizer, extra)
    else:
        engine = build_deepspeed(model, optimizer, extra, args.deepspeed_dtype)
    times, losses, marks = [], [], {}
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            dist.barrier()  # both nodes start counting at the same step
            marks["start"] = (tx_bytes(), *cross_node_bytes(engine))
        x, y = batch(i, args.seed, args.tokens, rank, world)
        start = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        if rank == 0:
            print(f"step {i}: {times[-1]:.3f} s, loss {losses[-1]:.4f}", flush=True)
    dist.barrier()
    end = (tx_bytes(), *cross_node_bytes(engine))
    tx, cross, logical = (b - a for a, b in zip(marks["start"], end))
    return {"rank": rank, "local_rank": int(os.environ["LOCAL_RANK"]), "num_params": num_params,
            "step_seconds": times, "losses": losses, "link_tx_bytes": tx, "engine_cross_node_bytes": cross,
            "engine_bytes": logical}


def run_worker(args: argparse.Namespace, train_rank: Callable[[argparse.Namespace], dict] = train) -> int:
    """One rank: join gloo over the veth, train (`train_rank`), write rank<r>.json (or the error, then exit
    at once)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # the ranks share 2 cores
    dist.init_process_group("gloo")
    out = args.result_dir / f"rank{dist.get_rank()}.json"
    try:
        result = train_rank(args)
    except Exception as exc:  # noqa: BLE001 -- the variant's error is a result, reported in the table
        traceback.print_exc()
        out.write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        sys.stdout.flush()
        os._exit(1)  # the other ranks may wait in a collective forever; the parent kills them
    out.write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------- the network

def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run one command (ip, tc, git); with `check`, its stderr becomes the error's message."""
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if check and done.returncode:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")
    return done


def in_node(node: int, *cmd: str) -> list[str]:
    """`cmd` run inside node `node`'s namespace."""
    return ["ip", "netns", "exec", NODES[node], *cmd]


def kill_namespace_processes(ns: str) -> None:
    """Kill what runs in `ns` (torchrun starts its ranks in their own sessions, so killing it is not enough)."""
    pids = sh("ip", "netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


def teardown() -> None:
    """Remove both namespaces (and with them the veth pair and its qdiscs), killing what runs inside."""
    existing = sh("ip", "netns", "list", check=False).stdout
    for ns in NODES:
        if re.search(rf"^{ns}\b", existing, re.MULTILINE):
            kill_namespace_processes(ns)
            sh("ip", "netns", "del", ns, check=False)


def setup(rate: str) -> None:
    """Two namespaces, a veth pair between them, lo up in each, both directions shaped to `rate`."""
    for ns in NODES:
        sh("ip", "netns", "add", ns)
        sh(*in_node(NODES.index(ns), "ip", "link", "set", "lo", "up"))
    sh("ip", "link", "add", VETHS[0], "netns", NODES[0], "type", "veth", "peer", "name", VETHS[1], "netns", NODES[1])
    for k in (0, 1):
        sh(*in_node(k, "ip", "addr", "add", f"{ADDRS[k]}/24", "dev", VETHS[k]))
        sh(*in_node(k, "ip", "link", "set", VETHS[k], "up"))
        # tbf on each end's egress: node0 -> node1 on veth0, node1 -> node0 on veth1
        sh(*in_node(k, "tc", "qdisc", "add", "dev", VETHS[k], "root", "tbf", "rate", rate, *TBF))
    if shutil.which("ping"):  # fail here, with ping's words, rather than in torchrun's rendezvous
        sh(*in_node(0, "ping", "-c", "1", "-W", "2", ADDRS[1]))


@contextlib.contextmanager
def network(rate: str) -> Iterator[None]:
    """The two shaped nodes for the duration of the block; gone afterwards whatever happened."""
    teardown()  # a crashed earlier run may have left them
    try:
        setup(rate)
        print(f"network: {NODES[0]} {ADDRS[0]} <-> {NODES[1]} {ADDRS[1]}, tbf {rate} each way", flush=True)
        yield
    finally:
        teardown()
        print("network: namespaces removed", flush=True)


# ---------------------------------------------------------------- one variant = two torchruns

def node_command(k: int, port: int, args: argparse.Namespace, variant: str, result_dir: Path,
                 script: Path = HERE, own: list[str] | None = None) -> list[str]:
    """`torchrun` for node k (as `python -m torch.distributed.run`, so the ranks use this interpreter) of
    `script`'s worker; `own`: its flags beyond the common ones (None: this file's --deepspeed-dtype)."""
    own = ["--deepspeed-dtype", args.deepspeed_dtype] if own is None else own
    return in_node(k, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                   "--nproc-per-node", str(RANKS_PER_NODE), "--node-rank", str(k), "--master-addr", ADDRS[0],
                   "--master-port", str(port), str(script), "--worker", "--variant", variant, "--size", args.size,
                   "--tokens", str(args.tokens), "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--seed", str(args.seed), *own, "--result-dir", str(result_dir))


def run_variant(args: argparse.Namespace, variant: str, port: int, tag: str, script: Path = HERE,
                own: list[str] | None = None, summary: Callable[[str, list[dict], int], dict] | None = None) -> dict:
    """Start both nodes' torchrun, wait (stopping both once one fails or at --timeout), read the ranks' JSON;
    `script`, `own` (node_command) and `summary` (default `summarize`): another benchmark's worker."""
    name = script.stem
    result_dir = RESULTS / name / tag
    commands = [node_command(k, port, args, variant, result_dir, script, own) for k in (0, 1)]
    ranks, logs, timed_out = run_nodes(commands, result_dir, f"{name}_{tag}", args.timeout)
    if len(ranks) != 2 * RANKS_PER_NODE or any("error" in r for r in ranks):
        return {"variant": variant, "error": first_error(ranks, logs, timed_out, args.timeout),
                "logs": [str(p.relative_to(REPO)) for p in logs]}
    return (summary or summarize)(variant, ranks, args.warmup) | {"logs": [str(p.relative_to(REPO)) for p in logs]}


def run_nodes(commands: list[list[str]], result_dir: Path, log_name: str,
              timeout: float) -> tuple[list[dict], list[Path], bool]:
    """Run each node's command (in its namespace, gloo on its veth) until all end, one fails or `timeout`;
    then kill what is left in both namespaces. Returns the rank*.json the ranks wrote into `result_dir`,
    the nodes' logs and whether it timed out."""
    shutil.rmtree(result_dir, ignore_errors=True)
    result_dir.mkdir(parents=True)
    (RESULTS / "logs").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    procs, logs = [], []
    for k, command in enumerate(commands):
        log = RESULTS / "logs" / f"{log_name}.node{k}.log"
        with open(log, "w") as out:
            procs.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                          env=env | {"GLOO_SOCKET_IFNAME": VETHS[k]}))
        logs.append(log)
    start, timed_out = time.monotonic(), False
    try:
        while any(p.poll() is None for p in procs) and not any(p.returncode for p in procs):
            if time.monotonic() - start > timeout:
                timed_out = True
                break
            time.sleep(0.5)
    finally:
        for ns in NODES:  # the ranks of a failed node's peer would wait in a collective until gloo's timeout
            kill_namespace_processes(ns)
        for p in procs:
            p.wait()
    return [json.loads(f.read_text()) for f in sorted(result_dir.glob("rank*.json"))], logs, timed_out


def first_error(ranks: list[dict], logs: list[Path], timed_out: bool, timeout: float) -> str:
    """The error a rank reported, else a timeout, else the last error-looking line of a node's log."""
    for r in ranks:
        if "error" in r:
            return r["error"]
    if timed_out:
        return f"timed out after {timeout:.0f} s"
    for log in logs:
        hits = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if "Error" in ln]
        if hits:
            return hits[-1]
    return "a node exited without results"


def summarize(variant: str, ranks: list[dict], warmup: int) -> dict:
    """Per step the slowest rank; the median of that; the link's bytes of both nodes; rank 0's engine bytes."""
    by_rank = sorted(ranks, key=lambda r: r["rank"])
    steps = [max(times) for times in zip(*(r["step_seconds"] for r in by_rank))][warmup:]
    timed = len(steps)
    return {
        "variant": variant,
        "num_params": by_rank[0]["num_params"],
        "step_seconds": steps,
        "median_step_seconds": statistics.median(steps),
        "losses_rank0": by_rank[0]["losses"],
        # counted on the local rank 0 of each node: the veth is one per namespace
        "link_bytes_per_step": sum(r["link_tx_bytes"] for r in by_rank if r["local_rank"] == 0) / timed,
        "engine_cross_node_bytes_per_step_rank0": by_rank[0]["engine_cross_node_bytes"] / timed,
        "engine_bytes_per_step_rank0": by_rank[0]["engine_bytes"] / timed,
    }


# ---------------------------------------------------------------- report

def fastest_rounds(rounds: list[dict]) -> dict:
    """Each variant's fastest successful round (the machine is shared: slower rounds are other load)."""
    best: dict[str, dict] = {}
    for r in rounds:
        old = best.get(r["variant"])
        if old is None or ("error" in old and "error" not in r) or (
                "error" not in r and r["median_step_seconds"] < old["median_step_seconds"]):
            best[r["variant"]] = r
    return best


def table(rounds: list[dict], variants: list[str]) -> str:
    """The markdown table: one row per variant, ratios against zeroshard_s3, bytes in MB and in M."""
    best = fastest_rounds(rounds)
    base = best.get(BASELINE, {}).get("median_step_seconds")
    header = ("| variant | step s (median) | all rounds | zeroshard_s3 / variant | link MB/step (both ways) "
              "| link bytes / M | engine cross-node MB/step/rank | loss first → last |")
    lines = [header, "|---|---:|---|---:|---:|---:|---:|---|"]
    for v in variants:
        r = best[v]
        if "error" in r:
            lines.append(f"| {v} | failed: `{r['error'].splitlines()[0][:300]}` | | | | | | |")
            continue
        m = 2 * r["num_params"]  # M: the model's bytes in bf16
        secs = " / ".join(f"{x['median_step_seconds']:.2f}" for x in rounds if x["variant"] == v and "error" not in x)
        ratio = f"{base / r['median_step_seconds']:.2f}x" if base else "n/a"
        engine = r["engine_cross_node_bytes_per_step_rank0"]
        engine_col = f"{engine / 1e6:.1f}" if engine else ("n/a" if v.startswith("deepspeed") else "0 (not recorded)")
        lines.append(f"| {v} | {r['median_step_seconds']:.2f} | {secs} | {ratio} | "
                     f"{r['link_bytes_per_step'] / 1e6:.1f} | {r['link_bytes_per_step'] / m:.2f} | {engine_col} | "
                     f"{r['losses_rank0'][0]:.4f} → {r['losses_rank0'][-1]:.4f} |")
    return "\n".join(lines)


def pretty_rate(rate: str) -> str:
    """tc's `1gbit` as `1 Gbit/s`."""
    m = re.fullmatch(r"([\d.]+)([kmg]?)bit", rate.lower())
    return f"{m[1]} {m[2].upper()}bit/s" if m else rate


def machine() -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    versions = []
    for pkg in ("torch", "deepspeed"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions.append(f"{pkg} {importlib.metadata.version(pkg)}")
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, {', '.join(versions)}, gloo"


def zeroshard_revision() -> str:
    """The commit measured, and whether zeroshard/ had uncommitted edits (others may be editing it)."""
    head = sh("git", "-C", str(REPO), "rev-parse", "--short", "HEAD", check=False).stdout.strip() or "unknown"
    dirty = sh("git", "-C", str(REPO), "status", "--porcelain", "--", "zeroshard", check=False).stdout.strip()
    return f"{head} + uncommitted edits in zeroshard/" if dirty else head


def section(args: argparse.Namespace, rounds: list[dict], command: str) -> str:
    """The BENCHMARKS.md section: set-up, command, table, how to read it."""
    n_layer, n_embd = SIZES[args.size]
    params = next((r["num_params"] for r in rounds if "num_params" in r), None)
    size = f"{params / 1e6:.1f}M parameters, M = {2 * params / 1e6:.0f} MB in bf16" if params else args.size
    ds_dtype = "bf16 (its `bf16` section)" if args.deepspeed_dtype == "bf16" else "fp32 (M is then twice as large)"
    return f"""## ZeRO++ on a shaped {pretty_rate(args.rate)} link

- Date: {datetime.date.today()}
- Machine: {machine()}; CPU only, 4 ranks on 2 cores (1 thread each)
- zeroshard: {zeroshard_revision()}
- Network: 2 network namespaces as 2 nodes x 2 ranks, joined by a veth pair shaped with `tc qdisc ... root tbf rate {args.rate} {' '.join(TBF)}` on both ends (each direction); ranks of one node talk over the local stack, unshaped
- Workload: GPT {args.size} ({n_layer} layers, width {n_embd}, vocabulary {VOCAB}; {size}), 1 sequence x {args.tokens} tokens per rank per step, Adam lr 1e-4, ZeRO stage 3, `stage3_param_persistence_threshold: 0`, `overlap_comm: true`; zeroshard in bf16 (`zeropp_ranks_per_node: 2`), DeepSpeed in {ds_dtype}
- Timing: {args.warmup} warm-up steps, then {args.steps} timed steps; step s = median over the timed steps of the slowest rank's step; {args.rounds} round(s) of all variants, interleaved, fastest round shown ("all rounds" lists each)
- Link MB/step: bytes sent by both veth ends during the timed steps (TCP/IP headers included) / steps; in units of M. Engine cross-node MB: rank 0's `comm_stats()` bytes with scope `cross_node` (logical buffer bytes, not wire bytes)

Command:

```
{command}
```

{table(rounds, args.variants)}
"""


# ---------------------------------------------------------------- command line

def missing_prerequisites() -> str | None:
    """What this machine lacks to run the benchmark, in one line; None when nothing."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc qdiscs): run it with sudo"
    lacking = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if lacking:
        return f"needs iproute2 ({' and '.join(lacking)} not found): install iproute2"
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", "--params", dest="size", choices=sorted(SIZES), default="25m")
    p.add_argument("--tokens", type=int, default=64, help="sequence length, 1 sequence per rank per step")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="run all variants this many times, interleaved")
    p.add_argument("--rate", default="1gbit", help="tbf rate of each direction, in tc's units")
    p.add_argument("--variants", nargs="+", default=["default"], choices=["default", "all", *VARIANTS])
    p.add_argument("--deepspeed-dtype", choices=["bf16", "fp32"], default="bf16")
    # DeepSpeed's first import on a machine JIT-builds an op for minutes (benchmarks/README.md): --timeout 600
    add_run_flags(p, VARIANTS)
    args = p.parse_args(argv)
    groups = {"default": DEFAULT, "all": list(VARIANTS)}
    args.variants = list(dict.fromkeys(v for name in args.variants for v in groups.get(name, [name])))
    return args


def add_run_flags(p: argparse.ArgumentParser, variants: dict) -> None:
    """The flags every shaped-link benchmark takes: seed, timeout, output file, and its workers' own."""
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600, help="seconds per variant before both nodes are killed")
    p.add_argument("--out", type=Path, help="write the section into this markdown file (e.g. BENCHMARKS.md)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", choices=sorted(variants), help=argparse.SUPPRESS)
    p.add_argument("--result-dir", type=Path, help=argparse.SUPPRESS)


def run_all(args: argparse.Namespace, report: Callable[[dict], None],
            run: RunVariant | None = None) -> list[dict]:
    """Every variant `--rounds` times, round-robin, each on a fresh port and process tree (`run`: one
    variant's run, default `run_variant`)."""
    rounds = []
    port = 29600
    for rnd in range(args.rounds):
        for variant in args.variants:
            port += 1  # a fresh port: the last run's sockets may linger in TIME_WAIT
            print(f"[{time.strftime('%H:%M:%S')}] round {rnd + 1}/{args.rounds} {variant}: running", flush=True)
            result = (run or run_variant)(args, variant, port, f"{variant}.round{rnd}") | {"round": rnd}
            rounds.append(result)
            report(result)
    return rounds


def print_result(r: dict) -> None:
    if "error" in r:
        print(f"    failed: {r['error'].splitlines()[0]}", flush=True)
    else:
        print(f"    median step {r['median_step_seconds']:.3f} s, link {r['link_bytes_per_step'] / 1e6:.1f} MB/step",
              flush=True)


def main() -> int:
    args = parse_args()
    return serve(HERE, args, train, section)


def serve(script: Path, args: argparse.Namespace, train_rank: Callable[[argparse.Namespace], dict],
          section_of: Callable[[argparse.Namespace, list[dict], str], str], run: RunVariant | None = None) -> int:
    """A shaped-link benchmark's main: with `--worker` one rank (`train_rank`); else every variant's rounds on
    the network (`run`: one variant's run, default `run_variant`), published as results/<script>_<rate>.json
    with the section `section_of(args, rounds, command)`. Exit status 2: a prerequisite or ip/tc command
    missing; 130: interrupted."""
    if args.worker:
        return run_worker(args, train_rank)
    problem = missing_prerequisites()
    if problem:
        print(f"{script.stem}: {problem}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks (teardown) on kill too
    command = "python " + " ".join([str(script.relative_to(REPO)), *sys.argv[1:]])
    rounds = on_the_network(script.stem, lambda: _with_network(args, run))
    if isinstance(rounds, int):
        return rounds
    publish(RESULTS / f"{script.stem}_{args.rate}.json", args,
            {"command": command, "machine": machine(), "rounds": rounds}, section_of(args, rounds, command))
    return 0


def _with_network(args: argparse.Namespace, run: RunVariant | None) -> list[dict]:
    with network(args.rate):
        return run_all(args, print_result, run)


def on_the_network(name: str, runs: Callable[[], list[dict]]) -> list[dict] | int:
    """`runs()`'s rounds, or the exit status after saying why there are none: an ip/tc command refused (2),
    or an interrupt (130; the namespaces are removed by then)."""
    try:
        return runs()
    except RuntimeError as exc:  # an ip/tc command refused: say which, without a traceback
        print(f"{name}: cannot set up the network: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{name}: interrupted; namespaces removed", file=sys.stderr)
        return 130


def publish(results: Path, args: argparse.Namespace, record: dict, text: str) -> None:
    """Write the run (`record` and the flags) as JSON into `results`, print the markdown section `text`,
    and write it into `args.out` (e.g. BENCHMARKS.md) when given."""
    flags = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    results.write_text(json.dumps(record | {"args": flags}, indent=1))
    print("\n" + text)
    print(f"results: {results.relative_to(REPO)}")
    if args.out:
        write_section(args.out, text)
        print(f"section written into {args.out}")


if __name__ == "__main__":
    sys.exit(main())
