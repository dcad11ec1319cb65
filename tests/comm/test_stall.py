"""Ranks that run different units in one step stop with an error that says where, instead of hanging.

The reference is the control flow the test itself sets up: rank 1 skips the
second block in step 2, so the ranks' gathers disagree from that block on.
"""

import pytest
import torch

from tests.distributed import RankFailure, run_ranks
from tests.recipes import GPT_CFG, Case, micro_batch
from zeroshard.app.models import GPT

TIMEOUT_S = 3.0
DIVERGE_AT = 2


class SkippingGPT(GPT):
    """On rank 1, from step DIVERGE_AT on, the second block is skipped."""

    skip = False

    def run_blocks(self, x):
        for i, block in enumerate(self.blocks):
            if not (self.skip and i == 1):
                x = block(x)
        return x


def _diverge(rank, world, device):
    import zeroshard
    from zeroshard.app.models.gpt import Block

    case = Case(stage=3)
    torch.manual_seed(0)
    model = SkippingGPT(GPT_CFG).to(device)
    config = case.config() | {"collective_timeout": TIMEOUT_S}
    engine = zeroshard.initialize(model, torch.optim.AdamW(model.parameters()), config, wrap=[Block])
    for step in range(4):
        model.skip = rank == 1 and step >= DIVERGE_AT
        x, y = (t.to(device) for t in micro_batch(step, case, world, rank, 0))
        engine.backward(engine(x, y))
        engine.step()
    return step


def test_divergent_ranks_stop_with_an_error_naming_step_rank_and_unit(monkeypatch):
    # gloo, also where GPUs exist: the explained timeout is gloo's (NCCL's watchdog reports its own).
    monkeypatch.setenv("ZEROSHARD_TEST_DEVICE", "cpu")
    with pytest.raises(RankFailure) as failure:
        run_ranks(_diverge, 2, timeout_s=120)
    # Both ranks ended by themselves (run_ranks killed none at its 120 s), each with zeroshard's error,
    # and it came from the ranks' agreement on the collective, not from waiting out a timeout.
    assert failure.value.hung == []
    messages = failure.value.messages()
    assert len(messages) == 2, messages  # both ranks raised; neither hung
    for message in messages:
        assert "CollectiveError" in message
        assert f"step {DIVERGE_AT}" in message
        assert "unit 'blocks.1'" in message
        assert "the ranks first differ at collective #" in message, message
        assert "rank 0:" in message and "rank 1:" in message
        assert "did not complete" not in message, message  # no collective timed out first


def test_a_dead_peer_is_named_as_gone_with_the_restart_advice():
    # Rank 1 was killed: gloo says the connection was reset, and rank 1 never posts its trace.
    import torch.distributed as dist

    from zeroshard.comm.stall import Trace, explain

    trace = Trace(micro_step=7, global_step=7)
    trace.note("all_gather")
    error = RuntimeError("[gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:40302: Connection reset by peer")
    message = explain(0, 2, trace, 0, error, timeout_s=0.2, store=dist.HashStore())
    assert "rank 1 is gone: the connection reported \"Connection reset by peer\"" in message, message
    assert "--max-restarts" in message and "control flow" not in message, message
    diverged = explain(0, 2, trace, 0, RuntimeError("Timed out waiting 3000ms"), timeout_s=0.2, store=dist.HashStore())
    assert "control flow" in diverged and "is gone" not in diverged, diverged  # a timeout alone: the old advice
