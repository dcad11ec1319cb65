"""Ranks that run different collectives stop with an error that names the first one, on every rank, not a hang.

The reference is the control flow each test sets up itself. At stage 3,
ranks that run different units (rank 1 skips the second block in step 2,
or runs the two blocks in the other order) agree on them and train
(stage3/agreement.py, tests/stage3/test_divergence.py for the values):
checked here to end without an error, with the same weights on both ranks.
Collectives no agreement can pair (other buffers, or a wait no other rank
joins) stop: each rank's running checksum of its collectives, published
when a collective stalls and compared at the step check, finds the
difference, and the ranks' rings of recent collectives, compared through
the store, name it.
"""

from datetime import timedelta

import torch
import torch.distributed as dist

from tests.distributed import run_ranks
from tests.recipes import GPT_CFG, Case, micro_batch
from zeroshard.app.models import GPT

TIMEOUT_S = 3.0
DIVERGE_AT = 2


class DivergingGPT(GPT):
    """On rank 1, from step DIVERGE_AT on, the blocks run as `order` says (indices into `blocks`)."""

    order: tuple[int, ...] | None = None

    def run_blocks(self, x):
        for i in self.order or range(len(self.blocks)):
            x = self.blocks[i](x)
        return x


def _diverge(rank, device, order, zero: dict) -> dict:
    import zeroshard
    from zeroshard.app.models.gpt import Block

    case = Case(stage=3)
    torch.manual_seed(0)
    model = DivergingGPT(GPT_CFG).to(device)
    group = dist.new_group([0, 1], backend="gloo", timeout=timedelta(seconds=15))  # one per scenario
    config = case.config() | {"collective_timeout": TIMEOUT_S, "rank_check_timeout": 2.0}  # a look after 0.5 s
    config["zero_optimization"] |= zero
    engine = zeroshard.initialize(model, torch.optim.AdamW(model.parameters()), config, wrap=[Block], group=group)
    for step in range(4):
        model.order = order if rank == 1 and step >= DIVERGE_AT else None
        x, y = (t.to(device) for t in micro_batch(step, case, 2, rank, 0))
        engine.backward(engine(x, y))
        engine.step()
    return {"weights": torch.cat([v.reshape(-1).cpu() for v in engine.full_state_dict().values()])}


def _scenarios(rank, world, device):
    # Swapped, with no prefetch: each gather is the one the block needs.
    no_prefetch = {"stage3_prefetch_bucket_size": 1}
    return {"skip": _diverge(rank, device, (0,), {}), "swap": _diverge(rank, device, (1, 0), no_prefetch)}


def test_ranks_that_skip_or_swap_units_at_stage_3_agree_on_them_and_train():
    ranks = run_ranks(_scenarios, 2, timeout_s=120)  # a hang fails here
    for scenario in ("skip", "swap"):
        assert torch.equal(ranks[0][scenario]["weights"], ranks[1][scenario]["weights"]), scenario


def _other_collectives_of_the_same_size(rank, world, device) -> dict:
    """Rank 0 sums bucket 'a', rank 1 bucket 'b' (the same size): the sums land, wrongly paired."""
    from zeroshard.comm import CollectiveError, Comm, CommRecorder, all_reduce
    from zeroshard.core.grad_norm import check_step

    comm = Comm.create(dist.group.WORLD, CommRecorder())
    all_reduce(comm, torch.ones(8, device=device), async_op=False, what="bucket 'common'")
    all_reduce(comm, torch.ones(8, device=device), async_op=False, what=f"bucket '{'ab'[rank]}'")
    try:
        check_step([torch.ones((), device=device)], comm, 0, 1)
    except CollectiveError as error:
        return {"error": str(error), "step_checks": comm.recorder.snapshot()["step_check"].calls}
    return {"error": None}


def test_a_step_check_tells_apart_ranks_that_ran_other_collectives_of_the_same_size():
    for result in run_ranks(_other_collectives_of_the_same_size, 2):
        message = result["error"]
        assert message is not None and result["step_checks"] == 1  # the one collective of the check
        assert "at the step check the ranks found that they ran different collectives" in message, message
        assert ("the ranks first differ at collective #2 of step 0 (micro-step 0): rank 0: all_reduce of 32 bytes "
                "for bucket 'a', rank 1: all_reduce of 32 bytes for bucket 'b'") in message, message


def test_a_dead_peer_is_named_as_gone_with_the_restart_advice():
    # Rank 1 was killed: gloo says the connection was reset, and rank 1 never posts its trace.
    import torch.distributed as dist

    from zeroshard.comm.watch.stall import Trace, explain

    trace = Trace(micro_step=7, global_step=7)
    trace.note("all_gather")
    error = RuntimeError("[gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:40302: Connection reset by peer")
    message = explain(0, 2, trace, 0, error, timeout_s=0.2, store=dist.HashStore())
    assert "rank 1 is gone: the connection reported \"Connection reset by peer\"" in message, message
    assert "--max-restarts" in message and "control flow" not in message, message
    diverged = explain(0, 2, trace, 0, RuntimeError("Timed out waiting 3000ms"), timeout_s=0.2, store=dist.HashStore())
    assert "control flow" in diverged and "is gone" not in diverged, diverged  # a timeout alone: the old advice


def _diverge_inside_a_shared_wait(rank, world, device) -> dict:
    """Two gathers waited together (`wait_all`, one job of the waiting thread): the first is the same on both
    ranks, the second differs in size (rank 1 gathers another buffer). Only the second stalls."""
    import time

    from zeroshard.comm import CollectiveError, Comm, CommRecorder, all_gather, wait_all

    comm = Comm.create(dist.group.WORLD, CommRecorder(), timeout_s=600.0, rank_check_timeout_s=2.0)
    first = all_gather(comm, torch.zeros(8, device=device), what="buffer 'common'")
    second = all_gather(comm, torch.zeros(8 + 2 * rank, device=device), what=f"buffer '{'ab'[rank]}'")
    start = time.monotonic()
    try:
        wait_all([first, second])
    except CollectiveError as error:
        return {"error": str(error), "seconds": time.monotonic() - start}
    return {"error": None}


def test_ranks_that_differ_inside_a_shared_wait_are_told_apart_long_before_the_timeout():
    # The collective timeout is 600 s; the stall is looked at after a grace of 0.5 s (a quarter of the
    # rank-check timeout), and the ranks' records, compared there, name the second gather.
    for result in run_ranks(_diverge_inside_a_shared_wait, 2, timeout_s=120):
        assert result["error"] is not None and result["seconds"] < 60, result
        assert "buffer 'a'" in result["error"] and "buffer 'b'" in result["error"], result["error"]
