"""Ranks that run different units in one step stop with an error that says where, instead of hanging.

The reference is the control flow the test itself sets up: rank 1 skips the
second block in step 2, so the ranks' gathers disagree from that block on.
"""

import time

import pytest
import torch

from tests.distributed import RankFailure, run_ranks
from tests.recipes import Case, GPT_CFG, micro_batch
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
    start = None
    for step in range(4):
        model.skip = rank == 1 and step >= DIVERGE_AT
        start = time.monotonic()
        x, y = (t.to(device) for t in micro_batch(step, case, world, rank, 0))
        engine.backward(engine(x, y))
        engine.step()
    return time.monotonic() - start


def test_divergent_ranks_stop_with_an_error_naming_step_rank_and_unit(monkeypatch):
    # gloo, also where GPUs exist: the explained timeout is gloo's (NCCL's watchdog reports its own).
    monkeypatch.setenv("ZEROSHARD_TEST_DEVICE", "cpu")
    start = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        run_ranks(_diverge, 2, timeout_s=120)
    elapsed = time.monotonic() - start
    messages = failure.value.messages()
    assert len(messages) == 2, messages  # both ranks raised; neither hung
    for message in messages:
        assert "CollectiveError" in message
        assert f"step {DIVERGE_AT}" in message
        assert "unit 'blocks.1'" in message
        assert "the ranks first differ at collective #" in message, message
        assert "rank 0:" in message and "rank 1:" in message
    assert elapsed < 60  # within the timeout and the peer wait, not the test's 120 s
