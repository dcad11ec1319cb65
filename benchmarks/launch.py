"""Start one process per rank on a fresh port, wait for them, and leave nothing behind.

Each launch is a new process tree: the ranks are started directly (no
torchrun agent) from this small process, so their peak RSS counts only their
own memory, and each rank leads its own process group so that it and any
child it starts (DeepSpeed's JIT build) can be killed together.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    """A TCP port that no process listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Launch:
    returncodes: list[int]  # negative: killed by that signal
    timed_out: bool
    seconds: float
    logs: list[Path]

    @property
    def ok(self) -> bool:
        return all(rc == 0 for rc in self.returncodes)

    def results(self, result: Path) -> list[dict | None]:
        """Each rank's JSON, written to `result`.rank<r> (None for a rank that wrote none)."""
        files = [result.with_name(f"{result.name}.rank{r}") for r in range(len(self.returncodes))]
        return [json.loads(f.read_text()) if f.exists() else None for f in files]

    def error(self, rank_results: list[dict | None], timeout: float) -> str:
        """The first error a rank reported, else the last error-looking line of its log."""
        for r in rank_results:
            if r and "error" in r:
                return r["error"].splitlines()[0][:300] if r["error"] else "error"
        if self.timed_out:
            return f"timed out after {timeout:.0f} s"
        for log in self.logs:
            lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
            hits = [ln for ln in lines if "Error" in ln or "Exception" in ln]
            if hits or lines:
                return (hits or lines)[-1][:300]
        return "no output"


def _rank_env(rank: int, world: int, port: int, extra: dict[str, str]) -> dict[str, str]:
    return {
        **os.environ,
        **extra,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "OMP_NUM_THREADS": "1",
    }


def _kill_tree(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def launch(argv: list[str], world: int, log_prefix: Path, timeout_s: float, env: dict[str, str]) -> Launch:
    """Run `python argv...` as `world` ranks; stop them all once one fails or time runs out."""
    port = free_port()
    start = time.monotonic()
    procs, logs = [], []
    for rank in range(world):
        log = log_prefix.with_name(f"{log_prefix.name}.rank{rank}.log")
        with open(log, "w") as out:
            procs.append(
                subprocess.Popen(
                    [sys.executable, *argv],
                    env=_rank_env(rank, world, port, env),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        logs.append(log)
    timed_out = False
    try:
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs):
                break  # the survivors would wait in a collective until gloo's timeout
            if time.monotonic() - start > timeout_s:
                timed_out = True
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            _kill_tree(p)  # also reaps children the ranks left behind
            p.wait()
    return Launch([p.returncode for p in procs], timed_out, time.monotonic() - start, logs)
