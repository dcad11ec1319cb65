"""Run a function on N ranks, each its own process, and collect what each returns.

The parent holds a TCPStore on a free port (port 0, so no races between
tests); ranks join it and form a gloo group on CPU, or an NCCL group with
one GPU per rank when enough GPUs are present (ZEROSHARD_TEST_DEVICE=cpu
forces CPU). Results travel back through files written with torch.save.
"""

from __future__ import annotations

import os
import signal
import tempfile
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = float(os.environ.get("ZEROSHARD_TEST_TIMEOUT", 300))


def test_device(world_size: int) -> torch.device:
    """cuda:<rank> when every rank can have its own GPU, else cpu (set per rank by the worker)."""
    if os.environ.get("ZEROSHARD_TEST_DEVICE") != "cpu" and torch.cuda.device_count() >= world_size:
        return torch.device("cuda")
    return torch.device("cpu")


def _worker(rank, world_size, port, fn, args, out_dir, collective_timeout_s):
    torch.set_num_threads(1)  # ranks share the machine's cores
    device = test_device(world_size)
    if device.type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                          timeout=timedelta(seconds=collective_timeout_s))
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=collective_timeout_s))
    try:
        result = {"ok": fn(rank, world_size, device, *args)}
    except BaseException as exc:  # sent to the parent, which raises it with the rank's traceback
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout_s: float = TIMEOUT_S, collective_timeout_s: float = 120):
    """`fn(rank, world_size, device, *args)` on each rank; returns the list of results by rank.

    `fn` must be a module-level function (it is pickled by name). If any rank
    raises, RankFailure carries every failing rank's message and traceback.
    """
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, store.port, fn, args, out_dir, collective_timeout_s))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        results = [_load(Path(out_dir) / f"rank{r}.pt") for r in range(world_size)]
    errors = {r: res if res is not None else {"exitcode": procs[r].exitcode}
              for r, res in enumerate(results) if res is None or "error" in res}
    if hung or errors:
        raise RankFailure(hung, errors)
    return [res["ok"] for res in results]


def _load(path: Path):
    return torch.load(path, weights_only=False) if path.exists() else None


class RankFailure(AssertionError):
    def __init__(self, hung: list[int], errors: dict):
        self.hung, self.errors = hung, errors
        lines = [f"ranks {hung} did not finish within the timeout"] if hung else []
        for rank, res in errors.items():
            if "exitcode" in res:
                lines.append(f"rank {rank}: exited without a result ({_exit(res['exitcode'])})")
            else:
                lines.append(f"rank {rank}: {res['error']}\n{res['traceback']}")
        super().__init__("\n".join(lines))

    def messages(self) -> list[str]:
        return [res["error"] for res in self.errors.values() if "error" in res]


def _exit(code: int | None) -> str:
    """How a process ended: a negative exit code is the signal that killed it (SIGILL: see conftest.py)."""
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"
