"""One user script for every stage (issue 28, acceptance 3): `meta_init`, `wrap=` and `init=pretrained(path)`
run at stages 0-3 with only the config changed, and train as single-process PyTorch does from the same weights.

Below stage 3, `wrap=` has no effect and the meta model is materialised whole by the same `init`; each says
so in one INFO line on rank 0.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from tests.distributed import run_ranks
from tests.hf.models import batch, config_of, train_lm

STEPS = 3


def _script(stage: int, path: Path, rank: int, device) -> list[float]:
    """The user's script; only the config depends on the stage."""
    import transformers as tf

    import zeroshard

    with zeroshard.meta_init():
        model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.from_pretrained(path))
    engine = zeroshard.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                  {"zero_optimization": {"stage": stage}, "gradient_clipping": 0.5},
                                  wrap=[tf.models.gpt2.modeling_gpt2.GPT2Block], init=zeroshard.pretrained(path))
    return train_lm(engine, rank, device, STEPS)


def _every_stage(rank, world, device, path: Path) -> dict:
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("zeroshard.config")
    logger.addHandler(handler)
    try:
        out = {stage: _script(stage, path, rank, device) for stage in range(4)}
    finally:
        logger.removeHandler(handler)
    return {"losses": out, "lines": lines}


def _reference(path: Path) -> list[float]:
    """Single-process PyTorch on the global batch (both ranks' micro-batches), from the same weights."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        ids = torch.cat([batch(10 * step + r) for r in range(2)])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_one_script_runs_at_every_stage(tmp_path):
    import transformers as tf

    config = config_of("gpt2")
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0  # the same function on every side
    torch.manual_seed(0)
    tf.GPT2LMHeadModel(config).save_pretrained(tmp_path / "start")
    results = run_ranks(_every_stage, 2, tmp_path / "start")
    want = _reference(tmp_path / "start")
    for stage in range(4):
        # each rank's loss is its own micro-batch's; their mean is the global batch's
        got = [sum(r["losses"][stage][i] for r in results) / 2 for i in range(STEPS)]
        assert all(abs(g - w) <= 2e-5 * w for g, w in zip(got, want)), (stage, got, want)
    lines = results[0]["lines"]
    for stage in range(3):
        assert f"wrap=['GPT2Block'] has no effect at stage {stage}: it chooses stage 3's units" in lines
        assert (f"stage {stage}: the model built on the meta device is materialised whole on every rank (only "
                "stage 3 materialises it shard by shard)") in lines
    assert sum("has no effect at stage" in line for line in lines) == 3  # none at stage 3
    assert sum("materialised whole" in line for line in lines) == 3
    assert not any("has no effect" in line for line in results[1]["lines"])  # rank 0 says it, once
