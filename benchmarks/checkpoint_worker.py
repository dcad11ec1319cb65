"""One rank of the checkpoint benchmark: write a checkpoint or read one, and write its measurements.

Started by `checkpoint.py` through `launch.py` (one process per rank), never by hand.

- `--role write`: build the variant as `worker.py` does, train `--train-steps`
  steps (so the optimizer holds state), fingerprint the full weights, then
  save `--rounds` times into `--dir`/round<r>, timing each save and reading
  the RSS high-water mark around it. Every round but the last is deleted
  once measured; the last is left for the readers.
- `--role read`: `--rounds` times, build the variant afresh (another seed, no
  training) and load `--dir` into it, timing the load; then fingerprint the
  loaded weights.

The fingerprint is a SHA-256 per tensor of the full state dict, gathered on
rank 0 (`full_state` below); the parent compares the writer's and the
readers', so a checkpoint counts as reloaded exactly only if every tensor's
bytes are equal.
"""

from __future__ import annotations

import abc
import argparse
import gc
import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from variants import BUILDERS, Settings, StepFn  # noqa: E402 (after the path set-up)
from worker import build_model, load_corpus, model_config, run_rank, train_steps  # noqa: E402

from zeroshard.app.models.gpt import GPTConfig  # noqa: E402

TAG = "ckpt"  # the tag (DeepSpeed, zeroshard) or directory name (DCP) of the checkpoint in each round directory


# -- each variant's save, load and full weights ---------------------------------------


class Checkpointer(abc.ABC):
    """How one variant saves, loads and shows its full weights. Every rank calls every method."""

    def __init__(self, step: StepFn):
        self.step = step

    @abc.abstractmethod
    def save(self, directory: Path, client_state: dict) -> None:
        """Save weights, optimizer state and `client_state` into `directory`."""

    @abc.abstractmethod
    def load(self, directory: Path) -> dict:
        """Load the checkpoint in `directory` (weights and optimizer state); returns the client state."""

    @abc.abstractmethod
    def full_state(self) -> dict[str, torch.Tensor]:
        """The model's full state dict on rank 0 (other ranks may get an empty dict)."""


class ZeroshardCheckpointer(Checkpointer):
    def save(self, directory, client_state):
        self.step.engine.save_checkpoint(directory, tag=TAG, client_state=client_state)

    def load(self, directory):
        _, client_state = self.step.engine.load_checkpoint(directory, tag=TAG)
        return client_state

    def full_state(self):
        return self.step.engine.full_state_dict(rank0_only=True)


class DeepSpeedCheckpointer(Checkpointer):
    def save(self, directory, client_state):
        self.step.engine.save_checkpoint(str(directory), tag=TAG, client_state=client_state)

    def load(self, directory):
        path, client_state = self.step.engine.load_checkpoint(str(directory), tag=TAG)
        if path is None:  # DeepSpeed warns and returns (None, None) when it finds no checkpoint
            raise RuntimeError(f"DeepSpeed load_checkpoint found no checkpoint '{TAG}' in {directory}")
        return client_state

    def full_state(self):
        engine = self.step.engine
        if engine.zero_optimization_stage() < 3:
            return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
        import deepspeed

        params = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


class DcpCheckpointer(Checkpointer):
    """FSDP2 with torch.distributed.checkpoint: sharded state dicts, each rank writes its own shards."""

    def _state(self, client_state: dict) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.step.model, self.step.optimizer)
        return {"model": model_sd, "optim": optim_sd, "client": client_state}

    def save(self, directory, client_state):
        import torch.distributed.checkpoint as dcp

        dcp.save(self._state(client_state), checkpoint_id=directory / TAG)

    def load(self, directory):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._state({"step": None})
        dcp.load(state, checkpoint_id=directory / TAG)
        set_state_dict(self.step.model, self.step.optimizer,
                       model_state_dict=state["model"], optim_state_dict=state["optim"])
        return state["client"]

    def full_state(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # full tensors on rank 0 only
        return get_model_state_dict(self.step.model, options=options)


def checkpointer(variant: str, step: StepFn) -> Checkpointer:
    for prefix, cls in (("zeroshard_", ZeroshardCheckpointer), ("deepspeed_", DeepSpeedCheckpointer),
                        ("fsdp2", DcpCheckpointer)):
        if variant.startswith(prefix):
            return cls(step)
    raise ValueError(f"the checkpoint benchmark has no save/load for variant {variant!r}")


# -- measurements ---------------------------------------------------------------------


def fingerprint(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """SHA-256 of each tensor's dtype, shape and bytes, by state-dict key."""
    out = {}
    for key in sorted(state):
        t = state[key].detach().cpu().contiguous()
        h = hashlib.sha256(f"{t.dtype} {tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        out[key] = h.hexdigest()
    return out


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> int:
    """Reset this process's RSS high-water mark (VmHWM) to its current RSS; returns that RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak RSS (Linux >= 4.0)
        f.write("5")
    return _status_kib("VmRSS") * 1024


def peak_rss() -> int:
    """The RSS high-water mark since the last `reset_peak_rss`, in bytes."""
    return _status_kib("VmHWM") * 1024


def disk_usage(directory: Path) -> tuple[int, int]:
    """(bytes, files) of every file under `directory`: sizes as `ls -l` shows them."""
    sizes = [p.stat().st_size for p in directory.rglob("*") if p.is_file()]
    return sum(sizes), len(sizes)


def fsync_tree(directory: Path) -> None:
    """Flush every file and directory under `directory` to disk."""
    for p in [directory, *directory.rglob("*")]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def timed(action, *args) -> tuple[dict, object]:
    """Run `action(*args)` on every rank together: (its wall seconds, start and end, and this rank's RSS
    before and peak during it; what it returned). Start and end are `time.perf_counter()`, which on Linux
    is CLOCK_MONOTONIC, one clock for all the ranks of this machine."""
    gc.collect()
    before = reset_peak_rss()
    dist.barrier()
    start = time.perf_counter()
    out = action(*args)
    end = time.perf_counter()
    return {"seconds": end - start, "start": start, "end": end, "rss_before_bytes": before,
            "rss_peak_bytes": peak_rss()}, out


# -- the two roles ----------------------------------------------------------------------


def settings(args: argparse.Namespace) -> Settings:
    return Settings(mode=args.mode, lr=args.lr, micro_batch=args.micro_batch, bucket_elems=args.bucket_elems)


def setup(args: argparse.Namespace, cfg: GPTConfig, seed: int) -> tuple[StepFn, int]:
    """The variant built as `worker.py` builds it, on the GPT of `seed`; and the model's size."""
    model, num_params = build_model(args.variant, cfg, settings(args), seed)
    return BUILDERS[args.variant](model, settings(args)), num_params


def write(args: argparse.Namespace) -> dict:
    rank = dist.get_rank()
    corpus = load_corpus(args.corpus)
    cfg = model_config(args.size, corpus)
    step, num_params = setup(args, cfg, args.seed)
    _, losses = train_steps(step, corpus, cfg, settings(args), args.seed, range(args.train_steps))
    ck = checkpointer(args.variant, step)
    state = ck.full_state()  # a collective: every rank calls it
    weights = fingerprint(state) if rank == 0 else {}
    del state
    client_state = {"step": args.train_steps}
    rounds = []
    for r in range(args.rounds):
        directory = args.dir / f"round{r}"
        if rank == 0 and directory.exists():
            shutil.rmtree(directory)
        m, _ = timed(ck.save, directory, client_state)
        dist.barrier()  # every rank's save returned
        if rank == 0:  # then on disk: what a save is worth if the machine goes down right after
            fsync_tree(directory)
            m["durable_end"] = time.perf_counter()
            m["bytes"], m["files"] = disk_usage(directory)
            m["file_names"] = sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())
        dist.barrier()
        if rank == 0 and r < args.rounds - 1:
            shutil.rmtree(directory)  # one checkpoint on disk at a time
        rounds.append(m)
    return {"rank": rank, "num_params": num_params, "losses": losses, "fingerprint": weights,
            "rounds": rounds, "kept": str(args.dir / f"round{args.rounds - 1}")}


def read(args: argparse.Namespace) -> dict:
    rank = dist.get_rank()
    cfg = model_config(args.size, load_corpus(args.corpus))
    rounds, before, after, client_state = [], {}, {}, None
    for r in range(args.rounds):
        step, _ = setup(args, cfg, args.seed + 1)  # fresh weights that differ from the saved ones
        ck = checkpointer(args.variant, step)
        if r == 0:
            state = ck.full_state()
            before = fingerprint(state) if rank == 0 else {}
            del state
        m, client_state = timed(ck.load, args.dir)
        rounds.append(m)
        if r == args.rounds - 1:
            state = ck.full_state()
            after = fingerprint(state) if rank == 0 else {}
            del state
        del ck, step
        gc.collect()
    # DeepSpeed returns its whole checkpoint dict as the client state: look for the one key saved
    saved_step = client_state.get("step") if isinstance(client_state, dict) else None
    return {"rank": rank, "rounds": rounds, "fingerprint_before": before, "fingerprint": after,
            "client_state_ok": saved_step == args.train_steps}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=["write", "read"], required=True)
    p.add_argument("--variant", choices=sorted(BUILDERS), required=True)
    p.add_argument("--size", required=True)
    p.add_argument("--mode", choices=["plain", "fused"], default="plain")
    p.add_argument("--train-steps", type=int, default=3, help="write: steps before saving; read: the client "
                   "state's expected step")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--bucket-elems", type=int, default=25 * 2**20 // 4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus", type=Path, required=True)
    p.add_argument("--dir", type=Path, required=True, help="write: where the rounds go; read: the round to load")
    p.add_argument("--result", type=Path, required=True, help="where this rank writes its JSON; .rank<r> is appended")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    return run_rank(lambda: (write if args.role == "write" else read)(args), args.result)


if __name__ == "__main__":
    sys.exit(main())
