"""The demo's engine settings, shared by `zeroshard train` and `zeroshard estimate` (its units), and its model."""

from __future__ import annotations

import argparse
import dataclasses

from zeroshard.app.models import PRESETS, GPTConfig
from zeroshard.config import Config

# The demo's settings where neither --config nor a flag gives one.
DEMO_CONFIG = {
    "train_micro_batch_size_per_gpu": 16,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    # Small buckets: reductions overlap with the rest of backward, and stage 2's staging
    # buffers (a few buckets in flight) stay small next to the gradient shard it saves.
    "zero_optimization": {
        "stage": 2, "reduce_bucket_size": 50_000, "allgather_bucket_size": 50_000,
        # Stage 3: each transformer block is a unit, and every parameter is sharded, so the
        # report's memory rows are exactly the formula's 4Ψ/N.
        "stage3_wrap_classes": ["Block"], "stage3_param_persistence_threshold": 0,
    },
}


def demo_model_config(args: argparse.Namespace, vocab_size: int) -> GPTConfig:
    """The GPT preset of --model sized to the corpus's alphabet. A --config file with an `activation_checkpointing`
    block checkpoints every block, through `zeroshard.deepspeed.checkpointing` so that the block's keys apply: as
    a Megatron-DeepSpeed model checkpoints when it is configured to (DeepSpeed's block itself only says how)."""
    configured = args.config is not None and \
        "activation_checkpointing" in Config.load(args.config).model_fields_set  # set in the file, not a default
    return dataclasses.replace(PRESETS[args.model], vocab_size=vocab_size,
                               checkpointing="deepspeed" if configured else "")
