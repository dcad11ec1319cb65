"""A trainer's frozen model at stage 3: the reference model of DPO and GRPO (and RLOO, KTO), sharded.

TRL builds these models whole on every rank and, under DeepSpeed, hands
them to `deepspeed.initialize` without an optimizer (`trl.models.
prepare_deepspeed`): at ZeRO-3 they are sharded like the policy and gathered
unit by unit for each forward; below stage 3 each rank keeps its copy. A
zeroshard trainer does the same with its own engine: each frozen model a
trainer holds (the attributes of `FROZEN_ROLES`) becomes, at stage 3, an
engine of its own with no optimizer state and no gradients (every parameter
frozen), its units the model's repeated blocks, in the policy's precision.

TRL's `DistillationTrainer` keeps its `teacher_model` whole on each rank:
it projects the teacher's hidden states through the teacher's head after
the teacher's forward has ended, where a stage-3 unit is a shard again.
"""

from __future__ import annotations


import torch.nn as nn

from zeroshard.config.frozen_optimizer import frozen_model_config

# The attributes under which transformers-based trainers hold a model that is run but not trained, and only
# inside its own forward.
FROZEN_ROLES = ("ref_model",)


def frozen_config(config: dict, model: nn.Module, block_classes: list[str]) -> dict:
    """The policy's filled config for a model that trains nothing: no optimizer, scheduler or optimizer
    offload (as `prepare_deepspeed` drops them), the model's own blocks as stage 3's units."""
    config = frozen_model_config(config)
    zero = config.setdefault("zero_optimization", {})
    zero.pop("stage3_wrap_classes", None)
    if block_classes:
        zero["stage3_wrap_classes"] = block_classes
    return config


def shard_frozen_models(trainer, config: dict, block_classes, initialize) -> list[str]:
    """At stage 3, replace each frozen model `trainer` holds by an engine over it built by
    `initialize(model=..., config=...)`; returns the roles replaced."""
    if config.get("zero_optimization", {}).get("stage") != 3:
        return []
    replaced = []
    for role in FROZEN_ROLES:
        model = getattr(trainer, role, None)
        if not isinstance(model, nn.Module) or model is trainer.model:
            continue
        model.requires_grad_(False)  # a reference is never trained: nothing to reduce, no state to keep
        engine, *_ = initialize(model=model, config=frozen_config(config, model, block_classes(model)))
        engine.eval()
        setattr(trainer, role, engine)
        replaced.append(role)
    return replaced
