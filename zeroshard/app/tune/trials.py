"""`zeroshard tune`'s trials: N ranks of a program, launched as torchrun would, under a memory limit and a deadline.

Each trial starts its ranks directly, with torchrun's environment (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), each in
its own session, so that:

- each rank runs under its own memory limit: a cgroup v1 memory group per
  rank (when this process is root and the memory controller is mounted; it
  counts what the rank really holds, and the kernel ends the rank at the
  limit), else RLIMIT_DATA set in the child before it executes (an
  allocation past it fails in the rank);
- the deadline kills every rank's process group (the rank and anything it
  started), and so does the first rank that fails: the others would wait for
  it in a collective until gloo's timeout;
- what happened is data: `TrialResult` says how the trial ended, why in one
  line (the zeroshard.OutOfMemoryError message, the allocator's, the kernel's
  kill, the last error line of the rank's log), each rank's peak memory and
  the seconds of each optimizer step (the demo's --log-csv).
"""

from __future__ import annotations

import csv
import enum
import os
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from zeroshard.app.resident import reset_high_water, status_bytes

CGROUP_V1 = Path("/sys/fs/cgroup/memory")
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
_POLL_SECONDS = 0.1
_GRACE_SECONDS = 3.0  # after a rank fails, the others' time to print their own error before they are killed
# Lines of a rank's log that say it ran out of memory: zeroshard's check, torch's CPU and CUDA allocators,
# Python's MemoryError, C++'s bad_alloc.
_OUT_OF_MEMORY = re.compile(r"OutOfMemoryError|can't allocate memory|Cannot allocate memory|MemoryError|"
                            r"bad_alloc|CUDA out of memory")
_ERROR = re.compile(r"Error|Exception|error\b|Traceback|terminate called")


class Outcome(enum.Enum):
    """How a trial ended."""

    OK = "ran"
    OUT_OF_MEMORY = "out of memory"
    FAILED = "failed"
    TIMED_OUT = "timed out"


@dataclass(frozen=True)
class TrialResult:
    outcome: Outcome
    reason: str  # one line: why it did not run ("" when it ran)
    step_seconds: tuple[float, ...]  # rank 0's seconds of each optimizer step, in order
    peak_bytes: tuple[int, ...]  # each rank's peak memory, as the limit counts it (see `Limit.peak`)
    seconds: float  # wall time of the whole trial, launch to exit

    @property
    def measured_step(self) -> float | None:
        """Seconds of a step: the median over the steps after the first (which warms up), or the only one."""
        if self.outcome is not Outcome.OK or not self.step_seconds:
            return None
        return statistics.median(self.step_seconds[1:] or self.step_seconds)

    def as_dict(self) -> dict:
        return {"outcome": self.outcome.value, "reason": self.reason, "step_seconds": list(self.step_seconds),
                "measured_step": self.measured_step, "peak_bytes": list(self.peak_bytes), "seconds": self.seconds}


@dataclass
class Limit:
    """The memory limit of each rank of a trial: `nbytes` (None: no limit, memory counted only) by `kind`.

    "cgroup": a v1 memory group per rank under `parent`, the rank moved into
    it before it executes; its peak is the group's max_usage_in_bytes (the
    memory the rank holds, page cache it read included). "rlimit":
    RLIMIT_DATA (the rank's private writable memory, VmData); its peak is
    the rank's maximum resident set (ru_maxrss).
    """

    kind: str
    nbytes: int | None
    parent: Path | None = None
    _groups: dict[int, Path] = field(default_factory=dict)

    def prepare(self, rank: int, tag: str) -> Callable[[], None]:
        """What the child of `rank` runs before it executes: join its group, or set its rlimit."""
        if self.kind == "rlimit":
            limit = self.nbytes

            def set_rlimit() -> None:
                if limit is not None:
                    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
            return set_rlimit
        group = self.parent / f"{tag}-rank{rank}"
        group.mkdir()
        if self.nbytes is not None:
            (group / "memory.limit_in_bytes").write_text(str(self.nbytes))
        self._groups[rank] = group
        procs = os.open(group / "cgroup.procs", os.O_WRONLY)  # opened here: the child only writes to it
        return lambda: os.write(procs, b"0")  # v1: "0" moves the writing process, the rank's child

    def peak(self, rank: int, usage: resource.struct_rusage | None) -> int:
        """The rank's peak memory in bytes, once it has exited."""
        if self.kind == "cgroup":
            return int((self._groups[rank] / "memory.max_usage_in_bytes").read_text())
        return 0 if usage is None else usage.ru_maxrss * 1024  # Linux: KiB

    def killed_at_limit(self, rank: int) -> bool:
        """Whether the kernel ended the rank for its group's limit."""
        if self.kind != "cgroup":
            return False
        control = dict(line.split() for line in (self._groups[rank] / "memory.oom_control").read_text().splitlines())
        return int(control.get("oom_kill", 0)) > 0

    def release(self) -> None:
        """Remove the rank groups (their ranks have exited)."""
        for group in self._groups.values():
            for _ in range(50):  # the kernel lets go of an exited task's group a moment after the exit
                try:
                    group.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)
        self._groups.clear()


def choose_limit(kind: str, nbytes: int | None) -> Limit:
    """The limit to run trials under: `kind` "auto" takes "cgroup" when this process is root and the v1 memory
    controller is mounted and writable, else "rlimit". Raises ValueError for "cgroup" where it is not."""
    parent = own_cgroup()
    usable = os.geteuid() == 0 and parent is not None and os.access(parent, os.W_OK)
    if kind == "cgroup" and not usable:
        raise ValueError("--limit-with cgroup needs root and the cgroup v1 memory controller "
                         f"({CGROUP_V1}, writable); use --limit-with rlimit")
    if kind == "auto":
        kind = "cgroup" if usable else "rlimit"
    return Limit(kind, nbytes, parent if kind == "cgroup" else None)


def own_cgroup() -> Path | None:
    """This process's v1 memory group (trial groups go under it, inside whatever limits it), if mounted."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "memory" in controllers.split(","):
                group = CGROUP_V1 / path.lstrip("/")
                return group if (group / "cgroup.procs").is_file() else None
    except OSError:
        pass
    return None


def free_port() -> int:
    """A TCP port no process listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int, run_id: str) -> dict[str, str]:
    """The environment torchrun gives rank `rank` of `world` on one machine."""
    return os.environ | {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
        "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": run_id,
        # torchrun's launcher does this too (cli.run_train): ranks share the cores
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world))),
        # the ranks import the zeroshard this process runs, wherever they start
        "PYTHONPATH": os.pathsep.join(p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p),
    }


def run_trial(module_argv: list[str], ranks: int, limit: Limit, timeout: float, workdir: Path,
              steps_csv: Path | None = None) -> TrialResult:
    """Run `python -m MODULE ARGS` (`module_argv`) as `ranks` ranks under `limit`, for at most `timeout` seconds.

    Each rank's output goes to `workdir`/rank<r>.log. `steps_csv`: the CSV of
    per-step seconds rank 0 writes (the demo's --log-csv), read once it ends.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    if steps_csv is not None:
        steps_csv.unlink(missing_ok=True)  # the demo appends to an existing file
    port, start, run_id = free_port(), time.monotonic(), workdir.name
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(ranks):
            with open(workdir / f"rank{rank}.log", "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", *module_argv], env=rank_env(rank, ranks, port, run_id), stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True,  # a process group to kill as one
                    preexec_fn=limit.prepare(rank, f"zeroshard-tune-{os.getpid()}-{run_id}")))
        codes, usages, failed, timed_out = _wait(procs, start + timeout)
        peaks = tuple(limit.peak(rank, usages[rank]) for rank in range(ranks))
        outcome, reason = _verdict(codes, failed, [workdir / f"rank{r}.log" for r in range(ranks)], limit,
                                   timed_out, timeout)
        steps = read_step_seconds(steps_csv) if steps_csv is not None else ()
        return TrialResult(outcome, reason, steps, peaks, time.monotonic() - start)
    finally:
        for proc in procs:
            if proc.returncode is None:  # only when this function itself was interrupted
                _kill(proc)
                proc.wait()
        limit.release()


def _wait(procs: list[subprocess.Popen], deadline: float):
    """Reap the ranks as they exit; kill every one at `deadline`, and the rest a moment after the first failure.

    Returns (exit codes, negative for a signal; each rank's rusage; the ranks that failed, in the order they
    failed, those killed here last; whether the deadline was reached).
    """
    codes: list[int | None] = [None] * len(procs)
    usages: list[resource.struct_rusage | None] = [None] * len(procs)
    failed: list[int] = []
    failed_at, timed_out = None, False
    while None in codes:
        for rank, proc in enumerate(procs):
            if codes[rank] is None:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:  # reaped here, with its rusage: Popen must not wait for it again
                    codes[rank] = proc.returncode = os.waitstatus_to_exitcode(status)
                    usages[rank] = usage
                    if codes[rank] != 0:
                        failed.append(rank)
                        failed_at = failed_at or time.monotonic()
        now = time.monotonic()
        stop = now >= deadline or (failed_at is not None and now >= failed_at + _GRACE_SECONDS)
        if stop and None in codes:
            timed_out = now >= deadline and failed_at is None
            for rank, proc in enumerate(procs):
                if codes[rank] is None:
                    _kill(proc)
                    _, status, usages[rank] = os.wait4(proc.pid, 0)
                    codes[rank] = proc.returncode = os.waitstatus_to_exitcode(status)
                    failed.append(rank)
        time.sleep(_POLL_SECONDS if None in codes else 0)
    return codes, usages, failed, timed_out


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the rank leads its own group (start_new_session)
    except ProcessLookupError:
        pass


def _verdict(codes: list[int], failed: list[int], logs: list[Path], limit: Limit, timed_out: bool,
             timeout: float) -> tuple[Outcome, str]:
    """(how the trial ended, why in one line)."""
    if timed_out:
        return Outcome.TIMED_OUT, f"timed out after {timeout:g} s: every rank's process group killed"
    if not failed:
        return Outcome.OK, ""
    # The rank that failed first on its own, not one that failed after it (a peer gone) or was killed here.
    texts = [log.read_text(errors="replace") for log in logs]
    for rank in failed:
        if limit.killed_at_limit(rank):
            return Outcome.OUT_OF_MEMORY, (f"rank {rank} killed by the kernel at its memory limit of "
                                           f"{limit.nbytes:,} bytes (memory cgroup)")
    for rank in failed:
        line = _last_line(texts[rank], _OUT_OF_MEMORY)
        if line:
            return Outcome.OUT_OF_MEMORY, f"rank {rank}: {line}"
    for rank in failed:
        line = _last_line(texts[rank], _ERROR)
        if line:
            return Outcome.FAILED, f"rank {rank} exited with {_exit(codes[rank])}: {line}"
    return Outcome.FAILED, f"rank {failed[0]} exited with {_exit(codes[failed[0]])} and printed no error"


def _last_line(text: str, pattern: re.Pattern) -> str:
    lines = [line.strip() for line in text.splitlines() if pattern.search(line)]
    return lines[-1] if lines else ""


def _exit(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def read_step_seconds(path: Path) -> tuple[float, ...]:
    """The step_seconds column of the demo's --log-csv (empty if the run wrote none)."""
    try:
        with open(path, newline="", encoding="utf-8") as file:
            return tuple(float(row["step_seconds"]) for row in csv.DictReader(file))
    except FileNotFoundError:
        return ()


def held_now(measure: str) -> int:
    """Bytes this process holds as a trial's limit counts them: "cgroup", its v1 memory group's usage; "rlimit",
    its private writable memory (VmData, what RLIMIT_DATA bounds)."""
    if measure == "cgroup":
        group = own_cgroup()
        if group is None:
            raise RuntimeError("this process is in no v1 memory cgroup: measure with rlimit")
        return int((group / "memory.usage_in_bytes").read_text())
    return status_bytes("VmData")["VmData"]


def reset_peak(measure: str) -> int:
    """Start a new high-water mark of this process's memory; returns what it holds now. "cgroup": its memory
    group's usage (max_usage_in_bytes reset to it); "rlimit": its resident set (VmHWM reset to VmRSS)."""
    if measure == "cgroup":
        (own_cgroup() / "memory.max_usage_in_bytes").write_text("0")  # v1: "0" resets it to the usage now
        return held_now("cgroup")
    reset_high_water()
    return status_bytes("VmRSS")["VmRSS"]


def peak_since_reset(measure: str) -> int:
    """The high-water mark of this process's memory since `reset_peak`, bytes."""
    if measure == "cgroup":
        return int((own_cgroup() / "memory.max_usage_in_bytes").read_text())
    return status_bytes("VmHWM")["VmHWM"]

