"""3D parallelism: zeroshard against the FSDP2 composition on the same meshes, step time and peak RSS.

What it measures: one GPT preset (default 4m) trained on 4 CPU ranks (gloo,
1 thread each) laid out as `dp2xtp2` (pp=1) and `pp2xdp2` (tp=1), fp32,
torch AdamW, the same initial weights and the same global batch in every
variant. Per mesh and ZeRO stage, two variants:

- zeroshard: `GPTStage` + `parallelize_gpt` (the Megatron TP plan over the
  mesh's `tp`), `zeroshard.initialize(part, AdamW, config, mesh=, tied=)`,
  at pp > 1 `zeroshard.parallel.PipelineStage(engine)` and `Schedule1F1B`.
- FSDP2: the same `GPTStage` and TP plan (`parallelize_module` over the
  mesh's `tp`), then `fully_shard(block, mesh=device_mesh["dp"])` per Block
  and on the root (stage 2: `reshard_after_forward=False`, stage 3: `True`),
  torch's own `PipelineStage(part, stage, stages, cpu, group=<pp group>)`
  and the same `Schedule1F1B`, torch AdamW over the DTensor parameters. The
  embedding tied across stages: after `schedule.step()` the first stage's
  `wte.weight` and the last stage's `head.weight` gradients (dp shards of the
  same shape) are all-reduced over the `pp` group, as zeroshard does for its
  `tied=` declaration, so both copies take the same update.

Every variant is a fresh process tree of 4 spawned ranks (so `ru_maxrss` is
the variant's own); rounds alternate which library goes first. Step time:
per step the slowest rank's wall time (forward + backward + optimizer step),
median over the timed steps, fastest round shown. Peak RSS: each rank's
`getrusage(RUSAGE_SELF).ru_maxrss` at the end.

    python benchmarks/parallel_3d.py [--size 4m] [--stages 2 3] [--rows 8] [--micro-batches 4]
        [--steps 8] [--warmup 3] [--rounds 2] [--out BENCHMARKS.md]

Results go to benchmarks/results/parallel_3d.json (git-ignored); `--out FILE`
writes the section "3D parallelism: zeroshard against FSDP2 + TP + PP" of FILE.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path

from report import write_section

HERE = Path(__file__).resolve()
REPO = HERE.parent.parent
RESULTS = REPO / "benchmarks" / "results"
WORLD = 4
MESHES = {"dp2xtp2": (1, 2), "pp2xdp2": (2, 1)}  # name -> (pp, tp); dp is what is left of 4 ranks
LIBRARIES = ("zeroshard", "fsdp2")
HEADING = "## 3D parallelism: zeroshard against FSDP2 + TP + PP"


# ---------------------------------------------------------------- one rank

def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def global_batch(step: int, seed: int, rows: int, tokens: int, vocab: int):
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    data = torch.randint(vocab, (rows, tokens + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def loss_fn(logits, y):
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def build_zeroshard(part, mesh, a):
    """The engine and a step function (x, y) -> loss or None, as the 3D API's docstring shows it."""
    import torch
    import zeroshard
    from torch.distributed.pipelining import Schedule1F1B
    from zeroshard.parallel import PipelineStage, parallelize_gpt

    parallelize_gpt(part, mesh)
    rows = a.rows // a.micro_batches if mesh.pp > 1 else a.rows
    config = {"zero_optimization": {"stage": a.stage}, "train_micro_batch_size_per_gpu": rows}
    if a.stage == 3:
        config["zero_optimization"]["stage3_wrap_classes"] = ["Block"]
    engine = zeroshard.initialize(part, torch.optim.AdamW(part.parameters(), lr=a.lr), config=config,
                                  mesh=mesh, tied=part.tied())
    if mesh.pp == 1:
        def step(x, y):
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()
            return loss.item()
        return step
    stage = PipelineStage(engine)
    sched = Schedule1F1B(stage, n_microbatches=a.micro_batches, loss_fn=loss_fn)
    return lambda x, y: stage.train_step(sched, x, y)


def build_fsdp2(part, mesh, a):
    """FSDP2 over dp composed with the same TP plan and torch's own pipeline stage."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.tensor.parallel import parallelize_module
    from zeroshard.parallel import gpt_tp_plan

    dm = mesh.device_mesh
    if mesh.tp > 1:
        parallelize_module(part, dm["tp"], gpt_tp_plan(part))
    reshard = a.stage == 3
    for block in part.blocks:
        fully_shard(block, mesh=dm["dp"], reshard_after_forward=reshard)
    fully_shard(part, mesh=dm["dp"], reshard_after_forward=reshard)
    opt = torch.optim.AdamW(part.parameters(), lr=a.lr)
    if mesh.pp == 1:
        def step(x, y):
            loss = loss_fn(part(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.item()
        return step
    pp_group = mesh.group("pp")
    stage = PipelineStage(part, mesh.rank("pp"), mesh.pp, torch.device("cpu"), group=pp_group)
    sched = Schedule1F1B(stage, n_microbatches=a.micro_batches, loss_fn=loss_fn)
    tie = part.wte.weight if part.first else part.head.weight  # pp=2: every stage is first or last

    def pipe_step(x, y):
        losses: list = []
        if part.first:
            sched.step(x)
        else:
            sched.step(target=y, losses=losses)
        # the tied embedding's copies: same dp shard on both stages, summed over pp (ranks that differ in pp only)
        dist.all_reduce(tie.grad.to_local(), group=pp_group)
        opt.step()
        opt.zero_grad()
        return sum(loss.item() for loss in losses) / len(losses) if losses else None
    return pipe_step


def train(a) -> dict:
    import torch
    from zeroshard.app.models import GPT, PRESETS, GPTStage
    from zeroshard.parallel import build_mesh

    pp, tp = MESHES[a.mesh]
    mesh = build_mesh(pp=pp, tp=tp)
    base = rss_mib()
    cfg = replace(PRESETS[a.size], vocab_size=a.vocab)
    torch.manual_seed(a.seed)
    gpt = GPT(cfg)
    num_params = gpt.num_params()
    part = GPTStage(gpt, mesh.rank("pp"), mesh.pp)
    del gpt
    step = (build_zeroshard if a.library == "zeroshard" else build_fsdp2)(part, mesh, a)
    dp_rank = mesh.rank("dp")
    times, cpu, losses = [], [], []
    for i in range(a.warmup + a.steps):
        x, y = global_batch(i, a.seed, a.rows * mesh.dp, cfg.block_size, cfg.vocab_size)
        mine = slice(dp_rank * a.rows, (dp_rank + 1) * a.rows)
        torch.distributed.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        losses.append(step(x[mine], y[mine]))
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)  # this process's threads (gloo's included)
    return {"rank": torch.distributed.get_rank(), "coordinate": mesh.coordinate, "num_params": num_params,
            "step_seconds": times, "cpu_seconds": cpu, "losses": losses, "base_rss_mib": base, "peak_rss_mib": rss_mib()}


def worker(rank: int, port: int, a, out_dir: str) -> None:
    import torch

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # 4 ranks share 2 cores
    sys.path.insert(0, str(REPO))
    try:
        result = train(a)
    except Exception as exc:  # noqa: BLE001 -- the variant's error is a result, reported in the table
        traceback.print_exc()
        result = {"rank": rank, "error": f"{type(exc).__name__}: {exc}"}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        os._exit(1)  # the other ranks may wait in a collective: the parent kills them
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


# ---------------------------------------------------------------- the parent

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_variant(a, mesh: str, library: str, stage: int) -> dict:
    """4 fresh ranks of one variant; the slowest rank per step, its median; RSS per rank."""
    import torch.multiprocessing as mp

    va = argparse.Namespace(**vars(a), mesh=mesh, library=library, stage=stage)
    load = os.getloadavg()[0]  # other jobs on the machine: wall times are only as good as this is low
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out_dir:
        port = free_port()
        procs = [ctx.Process(target=worker, args=(r, port, va, out_dir)) for r in range(WORLD)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + a.timeout
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        files = sorted(Path(out_dir).glob("rank*.json"))
        ranks = sorted((json.loads(f.read_text()) for f in files), key=lambda r: r["rank"])
    row = {"mesh": mesh, "library": library, "stage": stage, "load_at_start": load, "revision": revision()}
    errors = [r["error"] for r in ranks if "error" in r]
    if errors or len(ranks) != WORLD:
        return row | {"error": errors[0] if errors else f"{WORLD - len(ranks)} rank(s) gave no result (timeout?)"}
    steps = [max(t) for t in zip(*(r["step_seconds"] for r in ranks))][a.warmup:]
    cpu = [sum(c) for c in zip(*(r["cpu_seconds"] for r in ranks))][a.warmup:]
    loss_rank = next(r for r in ranks if r["losses"][0] is not None)
    return row | {"num_params": ranks[0]["num_params"], "step_s": statistics.median(steps), "steps_s": steps,
                  "cpu_s": statistics.median(cpu),
                  "peak_rss_mib": [r["peak_rss_mib"] for r in ranks], "base_rss_mib": [r["base_rss_mib"] for r in ranks],
                  "loss_first": loss_rank["losses"][0], "loss_last": loss_rank["losses"][-1]}


def run_all(a) -> list[dict]:
    """Every round runs every (mesh, stage) pair; which library goes first alternates by round and pair."""
    runs = []
    pairs = [(m, s) for m in a.meshes for s in a.stages]
    for rnd in range(a.rounds):
        for k, (mesh, stage) in enumerate(pairs):
            order = LIBRARIES if (rnd + k) % 2 == 0 else LIBRARIES[::-1]
            for lib in order:
                t0 = time.monotonic()
                r = run_variant(a, mesh, lib, stage) | {"round": rnd}
                runs.append(r)
                what = r.get("error") or (f"{r['step_s']:.3f} s/step, peak RSS "
                                          f"{'/'.join(f'{x:.0f}' for x in r['peak_rss_mib'])} MiB, "
                                          f"loss {r['loss_first']:.4f} -> {r['loss_last']:.4f}")
                print(f"round {rnd} {mesh} stage {stage} {lib}: {what} ({time.monotonic() - t0:.0f} s)", flush=True)
    return runs


def best(runs: list[dict], mesh: str, lib: str, stage: int) -> dict | None:
    """The fastest successful round (the machine's speed drifts); peak RSS is the largest round's."""
    mine = [r for r in runs if (r["mesh"], r["library"], r["stage"]) == (mesh, lib, stage)]
    ok = [r for r in mine if "error" not in r]
    if not ok:
        return mine[0] if mine else None
    top = min(ok, key=lambda r: r["step_s"])
    return top | {"peak_rss_mib": [max(x) for x in zip(*(r["peak_rss_mib"] for r in ok))],
                  "rounds_s": [r["step_s"] for r in ok]}


def table(runs: list[dict], a) -> str:
    lines = ["| mesh | ZeRO | variant | step s (median) | all rounds | CPU s/step (4 ranks) | peak RSS MiB per rank "
             "| RSS before model MiB | loss first → last | zeroshard / FSDP2: step time | CPU time "
             "| peak RSS (max rank) |",
             "|---|---|---|---:|---|---:|---|---|---|---:|---:|---:|"]
    for mesh in a.meshes:
        for stage in a.stages:
            got = {lib: best(runs, mesh, lib, stage) for lib in LIBRARIES}
            zs, peer = got["zeroshard"], got["fsdp2"]
            both = zs and peer and "error" not in zs and "error" not in peer
            for lib in LIBRARIES:
                r = got[lib]
                name = "zeroshard" if lib == "zeroshard" else f"FSDP2 (reshard_after_forward={stage == 3})"
                if r is None:
                    continue
                if "error" in r:
                    lines.append(f"| {mesh} | {stage} | {name} | failed: `{r['error'][:200]}` | | | | | | | | |")
                    continue
                ratios = ["", "", ""]
                if both and lib == "zeroshard":
                    ratios = [f"{zs['step_s'] / peer['step_s']:.2f}x", f"{zs['cpu_s'] / peer['cpu_s']:.2f}x",
                              f"{max(zs['peak_rss_mib']) / max(peer['peak_rss_mib']):.2f}x"]
                lines.append(
                    f"| {mesh} | {stage} | {name} | {r['step_s']:.3f} | {' / '.join(f'{x:.3f}' for x in r['rounds_s'])}"
                    f" | {r['cpu_s']:.2f} | {' / '.join(f'{x:.0f}' for x in r['peak_rss_mib'])}"
                    f" | {' / '.join(f'{x:.0f}' for x in r['base_rss_mib'])}"
                    f" | {r['loss_first']:.4f} → {r['loss_last']:.4f} | {' | '.join(ratios)} |")
    return "\n".join(lines)


def revision() -> str:
    """HEAD's short hash, and whether zeroshard/ differs from it in the working tree."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True).stdout.strip()
    dirty = git("status", "--porcelain", "--", "zeroshard")
    return (git("rev-parse", "--short", "HEAD") or "unknown") + (" + uncommitted changes in zeroshard/" if dirty else "")


def machine() -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    import torch

    return f"{cpu}, nproc {os.cpu_count()}, Python {platform.python_version()}, torch {torch.__version__}"


def section(a, runs: list[dict], command: str) -> str:
    from zeroshard.app.models import PRESETS

    cfg = PRESETS[a.size]
    params = next((r["num_params"] for r in runs if "num_params" in r), None)
    size = f"{params / 1e6:.2f}M parameters" if params else a.size
    loads = [r["load_at_start"] for r in runs]
    revisions = list(dict.fromkeys(r["revision"] for r in runs))
    return f"""{HEADING}

- Date: {datetime.date.today()}
- Machine: {machine()}; CPU only, 4 ranks (gloo, 1 thread each, `torch.set_num_threads(1)`); 1-minute load average at the start of each variant {min(loads):.1f} to {max(loads):.1f} (about 4 is this benchmark's own ranks; more is other jobs)
- zeroshard: {", then ".join(revisions)}
- Workload: GPT {a.size} ({cfg.n_layer} layers, width {cfg.n_embd}, {cfg.n_head} heads, vocabulary {a.vocab}, {size}), fp32, {a.rows} sequences x {cfg.block_size} tokens per dp rank per step (global batch {a.rows * 2}), at pp=2 split into {a.micro_batches} micro-batches (`Schedule1F1B`); torch AdamW lr {a.lr}; the same seed, initial weights and batches in every variant
- Meshes (`build_mesh`, pipeline-major, tensor-minor): dp2xtp2 = pp 1 x dp 2 x tp 2; pp2xdp2 = pp 2 x dp 2 x tp 1 (2 blocks per stage)
- zeroshard: `zeroshard.initialize(part, AdamW, {{"zero_optimization": {{"stage": S}}, "train_micro_batch_size_per_gpu": rows}}, mesh=mesh, tied=part.tied())` (stage 3: `stage3_wrap_classes: ["Block"]`; every other key at its default), `parallelize_gpt`, at pp=2 `zeroshard.parallel.PipelineStage(engine)`
- FSDP2: the same `GPTStage` and `gpt_tp_plan` through `parallelize_module` over `device_mesh["tp"]`, `fully_shard(block, mesh=device_mesh["dp"], reshard_after_forward=S == 3)` per Block then on the root, torch's `PipelineStage(part, pp rank, 2, cpu, group=mesh.group("pp"))`, torch AdamW (default, non-foreach on CPU). Tied embedding at pp=2: the first stage's `wte.weight` and the last stage's `head.weight` start equal; after `schedule.step()` their gradients (dp shards of equal shape) are all-reduced over the pp group, which is what zeroshard's `tied=` does, so the comparison does the same work
- Timing: {a.warmup} warm-up steps, then {a.steps} timed steps (forward + backward + optimizer step, a barrier before each); step s = median over the timed steps of the slowest rank's step; {a.rounds} round(s), each variant a fresh 4-rank process tree, the library that goes first alternating by round and by (mesh, stage); fastest round shown, all rounds listed
- CPU s/step: `time.process_time()` over the step (every thread of the rank, gloo's included), summed over the 4 ranks, median over the timed steps (fastest round's): the work done, less sensitive than wall time to other load on the machine
- Memory: peak RSS = `getrusage(RUSAGE_SELF).ru_maxrss` of each rank at the end, ranks 0-3 (largest over rounds); RSS before model = the same after imports and the process group, before the model is built. The ratio uses the largest rank
- Loss: the loss of dp rank 0's rows (rank 0 at pp=1, the last stage's dp rank 0 at pp=2, mean over its micro-batches) at the first and last step: both libraries see the same data and should agree

Command:

```
{command}
```

{table(runs, a)}
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="4m", help="a GPT preset of zeroshard.app.models.PRESETS (n_layer even)")
    p.add_argument("--meshes", nargs="+", default=list(MESHES), choices=list(MESHES))
    p.add_argument("--stages", nargs="+", type=int, default=[2, 3], choices=[2, 3])
    p.add_argument("--rows", type=int, default=8, help="sequences per dp rank per step")
    p.add_argument("--micro-batches", type=int, default=4, help="pipeline micro-batches per step (pp=2)")
    p.add_argument("--vocab", type=int, default=65, help="vocabulary size (the preset's default: 65)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300, help="seconds per variant")
    p.add_argument("--out", type=Path, help="write the markdown section into this file")
    a = p.parse_args(argv)
    if a.rows % a.micro_batches:
        p.error(f"--rows {a.rows} must divide into --micro-batches {a.micro_batches}")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    sys.path.insert(0, str(REPO))
    command = "python benchmarks/parallel_3d.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    runs = run_all(a)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "parallel_3d.json"
    out.write_text(json.dumps({"command": command, "machine": machine(), "runs": runs}, indent=1))
    text = section(a, runs, command.rstrip())
    print("\n" + text)
    if a.out:
        write_section(a.out, text)
        print(f"section written into {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
