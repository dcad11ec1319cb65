"""One agreement (comm/agreement.py): a failure on some ranks is raised alike on every rank, on 2 and 4 gloo ranks.

Each scenario sets which ranks fail with which error class and message; the reference is that
setting itself (the lowest failed rank's class and message, its rank in front), and
`torch.distributed.all_gather_object` of the same values for what `agree` returns when no rank fails.
The asynchronous half runs with an all-reduce posted between its two halves (checked against the sum
of the ranks' tensors); the named barrier is left waiting by one rank, and the other's error names it.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_ranks
from zeroshard.checkpoint import CheckpointError
from zeroshard.comm import Comm, CommRecorder, CollectiveError, all_reduce
from zeroshard.comm.agreement import Agreement, agree, barrier
from zeroshard.errors import ZeroshardError


class _SiteError(ZeroshardError, KeyError):
    """An error class of the test's own: it travels by its import path like any other."""

    def __str__(self) -> str:  # KeyError would quote its message
        return str(self.args[0])


# scenario -> {failing rank: (class, message)}; ranks not listed are ok
SCENARIOS = {
    "none": {},
    "last": {-1: (CheckpointError, "cannot write its shard (disk full)")},
    "two": {1: (_SiteError, "rank one's own words"), 3: (ValueError, "a later rank's")},
    "all_alike": {r: (ValueError, "the same mistake") for r in range(-4, 0)},
}


def _problems(world: int, scenario: str) -> dict[int, tuple[type, str]]:
    return {r % world: failure for r, failure in SCENARIOS[scenario].items() if -world <= r < world}


def _expected(world: int, scenario: str) -> tuple[str, str] | None:
    """What every rank must raise: the lowest failed rank's class and message, its rank in front."""
    problems = _problems(world, scenario)
    if not problems:
        return None
    rank = min(problems)
    kind, message = problems[rank]
    return kind.__name__, f"rank {rank}: {message}"


def _outcome(fn) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return None


def _scenarios(rank: int, world: int, device) -> dict:
    comm = Comm.create(dist.group.WORLD, CommRecorder())
    out = {}
    for scenario in SCENARIOS:
        kind, message = _problems(world, scenario).get(rank, (None, None))
        problem = None if kind is None else kind(message)
        value = {"rank": rank, "names": ["w"] * (rank + 2)}
        reference = [None] * world
        dist.all_gather_object(reference, value)
        returned = []
        out["sync", scenario] = _outcome(lambda: returned.append(agree(comm, problem, value=value)))
        out["values", scenario] = returned[0] == reference if returned else None
        out["async", scenario] = _outcome(lambda: _async(comm, problem, rank, world, device))
    before = comm.recorder.snapshot()["fault_check"].calls
    barrier(comm, "every rank is here")
    out["barrier_calls"] = comm.recorder.snapshot()["fault_check"].calls - before
    return out


def _async(comm: Comm, problem, rank: int, world: int, device) -> None:
    """The flags sent, an all-reduce posted and waited for while they are in flight, then `settle()`."""
    agreement = Agreement(comm, problem, "the test's check", device)
    tensor = torch.full((3,), float(rank + 1), device=device)
    all_reduce(comm, tensor).wait()
    assert torch.equal(tensor, torch.full((3,), float(world * (world + 1) // 2), device=device)), tensor
    agreement.settle()


@pytest.fixture(scope="module", params=[2, 4])
def runs(request):
    return request.param, run_ranks(_scenarios, request.param)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_rank_raises_the_lowest_failed_ranks_error(runs, scenario):
    world, per_rank = runs
    want = _expected(world, scenario)
    if scenario == "all_alike":  # `first` names the rank even when every rank failed alike
        assert want == ("ValueError", "rank 0: the same mistake")
    for rank, out in enumerate(per_rank):
        assert out["sync", scenario] == want, (world, rank, out["sync", scenario])
        assert out["async", scenario] == want, (world, rank, out["async", scenario])
        if want is None:
            assert out["values", scenario] is True, (world, rank)  # equal to torch's own all_gather_object


def test_a_barrier_every_rank_reaches_is_one_flag_gather(runs):
    world, per_rank = runs
    assert [out["barrier_calls"] for out in per_rank] == [1] * world


def _barrier_left(rank: int, world: int, device) -> tuple[str, str] | None:
    group = dist.new_group(list(range(world)), backend="gloo", timeout=timedelta(seconds=15))
    comm = Comm.create(group, CommRecorder(), timeout_s=3.0, rank_check_timeout_s=2.0)
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:  # never comes: waits until rank 0 has given up
        store.wait(["test/barrier_done"], timedelta(seconds=120))
        return None
    outcome = _outcome(lambda: barrier(comm, "the writers have ended"))
    store.set("test/barrier_done", "1")
    return outcome


def test_a_barrier_left_waiting_names_itself():
    r0, r1 = run_ranks(_barrier_left, 2, fresh=True, timeout_s=150)
    assert r1 is None
    assert r0 is not None and r0[0] == CollectiveError.__name__, r0
    assert "the barrier 'the writers have ended'" in r0[1], r0[1]
