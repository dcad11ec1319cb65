"""Rank processes kept alive across test cases, one pool per world size (tests/distributed.py's run_ranks).

Spawning a rank costs seconds (Python, torch, zeroshard, the test module
and what it imports); many cases cost less. Ranks are forked from a fork
server that imported what every rank imports (PRELOAD) once, and a pool
keeps the N ranks of a world size between cases, and tests: each case gets
a new TCPStore, so a new process group whose collectives cannot meet
another case's, and each rank puts its process back as a fresh one would be
(rank_state.py) before the next case.

A pool is ended, and the next case of its size spawns new ranks, after a
case that failed (an error on a rank, a rank that died, a timeout, or an
exception in the parent, such as pytest-timeout's), after a case that left
a rank with something it cannot undo in place (the rank's reasons), when
the parent's environment or sys.path changed since the spawn (a spawned
rank inherits both, and libraries read some variables once, at import;
PER_CASE_ENV, such as PYTEST_CURRENT_TEST which pytest rewrites at every
test, is not a change: each case sets the parent's values on the ranks),
when it is the least recently used and keeping another pool would hold more
than MAX_POOLED_RANKS idle processes, and at exit. `fresh=True`, or
ZEROSHARD_TEST_POOL=0 for every case, runs a case on ranks spawned for it
alone, through the same code.
"""

from __future__ import annotations

import atexit
import io
import logging
import os
import sys
import time
from dataclasses import dataclass
from multiprocessing import forkserver, reduction
from multiprocessing.connection import wait

import torch
import torch._dynamo  # noqa: F401  (its import sets TORCHINDUCTOR_CACHE_DIR: before _SESSION_ENV is taken)
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.rank_worker import serve

log = logging.getLogger(__name__)

MAX_POOLED_RANKS = 8  # idle rank processes kept in all (each holds torch and the test modules' imports)
CLOSE_S = 10.0  # how long a rank gets to exit after its pool is closed, before it is killed
# Variables the parent rewrites during the session that nothing reads at a process's start: pytest's current test
# (at every test phase), and the address inductor writes before each load of a compiled kernel (an in-process
# torch.compile). A change keeps the pool; each case sets the parent's values on the ranks, as a spawn at that
# moment would have them.
PER_CASE_ENV = ("PYTEST_CURRENT_TEST", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR")
OUTPUT_FDS = (1, 2)  # the parent's stdout and stderr, sent with each case: a rank writes its output there


# What every rank imports (torch's optimizers import torch._dynamo when the first one is made): a fork server
# imports them once, and a rank forked from it starts with them imported, as a spawned rank comes to have them.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "zeroshard", "tests.distributed"]


def _lasting_env() -> dict[str, str]:
    """The parent's environment, less PER_CASE_ENV: what ranks spawned now would start with and keep."""
    return {k: v for k, v in os.environ.items() if k not in PER_CASE_ENV}


_SESSION_ENV = _lasting_env()  # at the tests' import, before a test changed it: the fork server's


def _context():
    """How ranks start: forked from the fork server while the parent's environment is the one the server
    started with (a forked rank has the server's, which the preloaded modules read at import); spawned when a
    test changed it, and where a GPU is (CUDA's state must not be forked)."""
    if _lasting_env() != _SESSION_ENV or torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()  # now, under _SESSION_ENV, if it is not running yet
    return ctx


@dataclass
class Outcome:
    """A case's end, as a spawned rank's results directory and exit codes told it."""

    results: list  # by rank: the rank's result dict, or None if it sent none
    hung: list[int]  # the ranks still busy at the timeout (killed)
    exitcodes: list  # by rank: the process's exit code; None while it runs


class RankPool:
    """`world_size` started ranks (rank_worker.serve), each with a pipe to this process."""

    def __init__(self, world_size: int):
        ctx = _context()
        self.world_size = world_size
        self.env, self.path = _lasting_env(), list(sys.path)  # what the ranks inherited
        self.reusable = True
        self.conns, self.procs = [], []
        for rank in range(world_size):
            conn, child = ctx.Pipe()
            proc = ctx.Process(target=serve, args=(rank, world_size, child), name=f"zeroshard-test-rank{rank}")
            proc.start()
            child.close()  # the rank's end lives in the rank only: a rank that dies reads as EOF here
            self.conns.append(conn)
            self.procs.append(proc)

    def matches(self) -> bool:
        """Whether a rank spawned now would inherit what these ranks did."""
        return (self.reusable and self.env == _lasting_env() and self.path == sys.path
                and all(p.is_alive() for p in self.procs))

    def run(self, fn, args: tuple, timeout_s: float, collective_timeout_s: float) -> Outcome:
        """One case on every rank; ends the pool's use (reusable=False) unless every rank ended it cleanly."""
        store = dist.TCPStore("127.0.0.1", 0, self.world_size + 1, is_master=True, wait_for_workers=False)
        try:
            for conn, proc in zip(self.conns, self.procs):
                conn.send((fn, args, store.port, collective_timeout_s, os.getcwd(),
                           {k: os.environ.get(k) for k in PER_CASE_ENV}))
                for fd in OUTPUT_FDS:  # where this test's output goes now (pytest's capture), as a spawn inherits
                    reduction.send_handle(conn, fd, proc.pid)
            results, done, reasons = self._collect(time.monotonic() + timeout_s)
        except BaseException:  # a pickling error, KeyboardInterrupt, pytest-timeout: the ranks' state is unknown
            self.close(kill=True)
            raise
        hung = [r for r in range(self.world_size) if not done[r]]
        for r in hung:
            self.procs[r].kill()
        reasons += [f"rank {r}: hung" for r in hung] + [f"rank {r}: {'exited' if res is None else 'raised'}"
                                                        for r, res in enumerate(results) if not res or "ok" not in res]
        if reasons:
            log.info("ending the pool of %d ranks: %s", self.world_size, "; ".join(reasons))
        self.reusable = not reasons and all(p.is_alive() for p in self.procs)
        return Outcome(results, hung, [p.exitcode for p in self.procs])

    def _collect(self, deadline: float) -> tuple[list, list[bool], list[str]]:
        """Each rank's result and its "ready" (or its death), until the deadline."""
        n = self.world_size
        results, done, reasons = [None] * n, [False] * n, []
        by_handle = {h: r for r in range(n) for h in (self.conns[r], self.procs[r].sentinel)}
        while not all(done):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for handle in wait([h for h, r in by_handle.items() if not done[r]], left):
                r = by_handle[handle]
                done[r] = done[r] or self._read(r, results, reasons)
        for r in range(n):  # a rank that died as the deadline passed
            done[r] = done[r] or (not self.procs[r].is_alive() and self._read(r, results, reasons))
        return [_load(res) for res in results], done, reasons

    def _read(self, rank: int, results: list, reasons: list[str]) -> bool:
        """Take what the rank has sent; whether it is done with the case (ready, or gone)."""
        conn = self.conns[rank]
        try:
            while conn.poll():
                kind, payload = conn.recv()
                if kind == "result":
                    results[rank] = payload
                else:
                    reasons += [f"rank {rank}: {why}" for why in payload]
                    return True
        except (EOFError, OSError):  # the process ended
            self.procs[rank].join(CLOSE_S)
            return True
        return not self.procs[rank].is_alive() and not conn.poll()

    def close(self, kill: bool = False) -> None:
        """End the ranks: ask them to exit (their atexit work runs, as at the end of a spawned rank), or kill."""
        for conn, proc in zip(self.conns, self.procs):
            if proc.is_alive() and not kill:
                try:
                    conn.send(None)
                except OSError:  # it is exiting already
                    pass
        for proc in self.procs:
            if kill:
                proc.kill()
            proc.join(CLOSE_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        self.reusable = False


def _load(data: bytes | None):
    return None if data is None else torch.load(io.BytesIO(data), weights_only=False)


_pools: dict[int, RankPool] = {}  # by world size, least recently used first


def run_case(fn, world_size: int, args: tuple, timeout_s: float, collective_timeout_s: float,
             fresh: bool) -> Outcome:
    """The case on the pool of its world size (or, `fresh`, on ranks of its own), then keep or end the pool."""
    if fresh or os.environ.get("ZEROSHARD_TEST_POOL") == "0":
        pool = RankPool(world_size)
        try:
            return pool.run(fn, args, timeout_s, collective_timeout_s)
        finally:
            pool.close()
    pool = _pools.pop(world_size, None)
    if pool is not None and not pool.matches():
        pool.close()
        pool = None
    if pool is None:
        pool = RankPool(world_size)
    outcome = pool.run(fn, args, timeout_s, collective_timeout_s)
    if pool.reusable:
        _make_room(world_size)
        _pools[world_size] = pool
    else:
        pool.close()
    return outcome


def _make_room(world_size: int) -> None:
    """End the least recently used pools until `world_size` more idle ranks fit under MAX_POOLED_RANKS. Only a
    pool that is kept makes room: a case of many ranks whose pool is then ended ends no other."""
    while _pools and sum(p.world_size for p in _pools.values()) + world_size > MAX_POOLED_RANKS:
        oldest = next(iter(_pools))
        log.info("ending the pool of %d ranks: the least recently used, to keep one of %d", oldest, world_size)
        _pools.pop(oldest).close()


@atexit.register  # before multiprocessing's own atexit, which would wait for these non-daemon ranks forever
def close_pools() -> None:
    while _pools:
        _pools.popitem()[1].close()
