"""Run a function on N ranks, each its own process, and collect what each returns.

Each case gets a TCPStore of its own, held by the parent on a free port
(port 0, so no races between tests); the ranks join it and form a gloo
group on CPU, or an NCCL group with one GPU per rank when enough GPUs are
present (ZEROSHARD_TEST_DEVICE=cpu forces CPU). The rank processes
themselves are kept from case to case in a pool per world size, put back
as fresh between cases, and replaced after a case that fails: see
rank_pool.py. Results travel back as torch.save bytes.
"""

from __future__ import annotations

import os
import signal

from tests.rank_pool import run_case
from tests.rank_worker import test_device

__all__ = ["RankFailure", "TIMEOUT_S", "run_ranks", "test_device"]

TIMEOUT_S = float(os.environ.get("ZEROSHARD_TEST_TIMEOUT", 300))


def run_ranks(fn, world_size: int, *args, timeout_s: float = TIMEOUT_S, collective_timeout_s: float = 120,
              fresh: bool = False):
    """`fn(rank, world_size, device, *args)` on each rank; returns the list of results by rank.

    `fn` must be a module-level function (it is pickled by name). If any rank
    raises, RankFailure carries every failing rank's message and traceback.
    A rank that does not finish within `timeout_s` is killed and named as
    hung. `fresh=True` runs the case on ranks spawned for it alone (for a case
    that changes its process in a way the pool cannot see or undo).
    """
    outcome = run_case(fn, world_size, args, timeout_s, collective_timeout_s, fresh)
    results = outcome.results
    errors = {r: res if res is not None else {"exitcode": outcome.exitcodes[r]}
              for r, res in enumerate(results) if res is None or "error" in res}
    if outcome.hung or errors:
        raise RankFailure(outcome.hung, errors)
    return [res["ok"] for res in results]


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
