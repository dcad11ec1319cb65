"""Chaos run: `zeroshard train --max-restarts N` with ranks killed by SIGKILL at random points, against the
run that was never interrupted.

For each configuration (dtype, stage, synchronous or asynchronous saves) it trains the demo's tiny GPT
twice on 2 ranks: once uninterrupted, once under torchrun restarts with one rank killed in each
generation of ranks until N kills are done, at a point drawn from the seed: inside a block's
forward, in backward, in the optimizer update, inside a synchronous save or its commit, or inside an
asynchronous save's background write (`chaos_site/chaos_points.py`). The restarted ranks resume from the
latest complete checkpoint. The final checkpoints of the two runs must hold the same tensors, bit for
bit (fp32 masters, optimizer state, frozen values), and the same counters, loss scale and LR schedule.

    PYTHONPATH=. python scripts/chaos.py                  # 6 configurations x 2 kills = 12 kills
    PYTHONPATH=. python scripts/chaos.py --kills 3 --configs bf16:3:async --steps 40 --seed 7

Exit status 0 when every run completed with every planned kill and matched its reference.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
SITE = Path(__file__).resolve().parent / "chaos_site"
CONFIGS = ("fp32:1:sync", "fp32:2:async", "fp32:3:sync", "bf16:1:async", "bf16:2:sync", "bf16:3:async")
WORLD = 2


def plan(rng: random.Random, kills: int, asynchronous: bool) -> list[dict]:
    """The kills in order, one per generation of ranks: (rank, point, the call of the point that dies).

    The counts stay within the steps a generation is sure to run (a restart resumes at most
    --save-every steps back, and at least that many remain), so every planned kill happens.
    """
    points = ["forward", "backward", "step"] + (["async_save"] if asynchronous else ["save", "commit"])
    out = []
    for _ in range(kills):
        point = rng.choice(points)
        after = {"forward": rng.randint(1, 12), "backward": rng.randint(1, 60), "step": rng.randint(1, 6)}.get(point, 1)
        rank = 0 if point == "commit" else rng.randrange(WORLD)  # rank 0 alone commits
        out.append({"rank": rank, "point": point, "after": after})
    return out


def train(workdir: Path, config: str, steps: int, save_every: int, kills: list[dict] | None,
          data: str | None = None, world: int = WORLD, flags: tuple[str, ...] = (), restarts: bool = True) -> Path:
    """One `zeroshard train` run on `world` ranks in `workdir` (on `data`, default the Bible); returns its save
    directory. With `kills`, they happen (and, with `restarts`, torchrun restarts the ranks after each)."""
    dtype, stage, mode = config.split(":")
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "zeroshard.app.cli", "train", "--nproc", str(world), "--model", "tiny",
           "--steps", str(steps), "--micro-batch", "2", "--stage", stage, "--dtype", dtype,
           "--save-every", str(save_every), "--save-dir", "ck", "--async-save", str(mode == "async").lower(),
           "--log-csv", "steps.csv", *flags]
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT), str(SITE)]), "OMP_NUM_THREADS": "1"}
    if data is not None:
        cmd += ["--data", data]
    if kills is not None:
        cmd += ["--max-restarts", str(len(kills) + 2 if restarts else 0)]  # 2 spare: a generation may fail otherwise
        env["ZEROSHARD_CHAOS"] = json.dumps({"kills": kills, "log": str(workdir / "kills.jsonl")})
    done = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=900)
    (workdir / "output.txt").write_text(done.stdout + done.stderr)
    if (done.returncode != 0) == restarts:
        raise RuntimeError(f"{config}: the run {'failed' if restarts else 'did not fail'} (exit {done.returncode}); "
                           f"see {workdir / 'output.txt'}")
    return workdir / "ck"


def shrink(workdir: Path, config: str, steps: int, save_every: int, kill: dict, data: str | None = None) -> list[str]:
    """Acceptance 2: 4 ranks, one killed (no restart), resumed on 2 ranks from the latest checkpoint; the final
    loss and weights against the uninterrupted 4-rank run's, within the parity bar (2e-5 loss, 1e-4 weights;
    not bitwise: the reduction order changes). Returns the problems."""
    reference = train(workdir / "reference", config, steps, save_every, None, data, world=4)
    train(workdir / "killed", config, steps, save_every, [kill], data, world=4, restarts=False)
    resumed = train(workdir / "killed", config, steps, save_every, None, data, world=2,
                    flags=("--resume", "ck", "--log-csv", "resumed.csv"))
    output = " ".join((workdir / "killed" / "output.txt").read_text().split())
    problems = [] if "gradient accumulation 1 -> 2" in output else ["the 2 ranks did not keep the global batch"]
    loss, resumed_loss = (_last_loss(workdir / where) for where in ("reference/steps.csv", "killed/resumed.csv"))
    if abs(resumed_loss - loss) > 2e-5 * abs(loss):
        problems.append(f"final loss {resumed_loss} against {loss} uninterrupted")
    tag = f"global_step{steps}"
    weights = [consolidate(where / tag) for where in (reference, resumed)]
    error = ((weights[0] - weights[1]).norm() / weights[0].norm()).item()
    return problems + ([f"final weights differ by {error:.2e} (relative)"] if error > 1e-4 else [])


def _last_loss(csv_path: Path) -> float:
    return float(csv_path.read_text().strip().splitlines()[-1].split(",")[1])


def consolidate(tag_dir: Path) -> torch.Tensor:
    """Every trained parameter's fp32 master, by name, in one vector (`zeroshard.checkpoint.consolidate`)."""
    from zeroshard.checkpoint.consolidate import consolidate as whole

    state = whole(tag_dir)
    return torch.cat([state[name].reshape(-1).float() for name in sorted(state)])


def differences(a: Path, b: Path) -> list[str]:
    """Where two checkpoints' tensors and training state differ (save ids aside); empty when bitwise equal."""
    found = []
    for name in sorted(p.name for p in a.glob("rank_*.safetensors")):
        left, right = load_file(a / name), load_file(b / name)
        found += [f"{name}: {key} differs" for key in sorted(left.keys() | right.keys())
                  if key not in left or key not in right or not torch.equal(left[key], right[key])]
    left, right = (torch.load(p / "state.pt", weights_only=True) for p in (a, b))
    for key in sorted(left.keys() | right.keys()):
        if key != "save_id" and not _same(left.get(key), right.get(key)):
            found.append(f"state.pt: {key} differs")
    return found


def _same(x, y) -> bool:
    if torch.is_tensor(x) or torch.is_tensor(y):
        return torch.is_tensor(x) and torch.is_tensor(y) and x.dtype == y.dtype and torch.equal(x, y)
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return len(x) == len(y) and all(_same(i, j) for i, j in zip(x, y))
    return x == y


def chaos(workdir: Path, config: str, steps: int, save_every: int, kills: list[dict],
          data: str | None = None) -> list[str]:
    """The reference and the chaos run of one configuration; returns the problems (none: a pass)."""
    reference = train(workdir / "reference", config, steps, save_every, None, data)
    killed = train(workdir / "chaos", config, steps, save_every, kills, data)
    log = workdir / "chaos" / "kills.jsonl"
    happened = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    problems = [] if len(happened) == len(kills) else [f"{len(happened)} of {len(kills)} planned kills happened"]
    output = (workdir / "chaos" / "output.txt").read_text()
    others = output.count("failed (exitcode: ") - output.count("failed (exitcode: -9)")
    if others:  # a generation that failed for another reason (torchrun restarted it too): shown, not hidden
        print(f"{workdir.name}: {others} generation(s) of ranks failed for another reason; see {workdir / 'chaos'}")
    tag = f"global_step{steps}"
    return problems + differences(reference / tag, killed / tag)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help="dtype:stage:sync|async, comma-separated (default: %(default)s)")
    parser.add_argument("--kills", type=int, default=2, help="kills per configuration (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run (default: %(default)s)")
    parser.add_argument("--save-every", type=int, default=10, help="(default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="draws the kill points (default: %(default)s)")
    parser.add_argument("--workdir", default=None, help="where the runs go (default: a temporary directory)")
    parser.add_argument("--shrink", action="store_true",
                        help="instead: 4 ranks, one killed, resumed on 2 ranks (global batch kept), against the "
                             "uninterrupted 4-rank run within the parity bar")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="zeroshard-chaos-"))
    if args.shrink:
        # In an optimizer update after the first checkpoint, so that there is one to resume from.
        kill = {"rank": rng.randrange(4), "point": "step", "after": args.save_every + rng.randint(1, args.save_every - 1)}
        problems = shrink(workdir / "shrink", args.configs.split(",")[0], args.steps, args.save_every, kill)
        print(f"4 ranks -> 2: kill {kill['point']}@rank{kill['rank']}: {'; '.join(problems) or 'within the parity bar'}")
        return 1 if problems else 0
    failed, total = 0, 0
    for i, config in enumerate(args.configs.split(",")):
        kills = plan(rng, args.kills, config.endswith(":async"))
        problems = chaos(workdir / f"{i}-{config.replace(':', '-')}", config, args.steps, args.save_every, kills)
        total += len(kills)
        failed += bool(problems)
        where = ", ".join(f"{k['point']}@rank{k['rank']}" for k in kills)
        print(f"{config:14} kills: {where:50} {'bitwise equal' if not problems else '; '.join(problems[:3])}")
    print(f"{total} kills over {len(args.configs.split(','))} runs; {failed} run(s) differ from the uninterrupted "
          f"run; runs in {workdir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
