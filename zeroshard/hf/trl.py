"""`from zeroshard.hf.trl import SFTTrainer, SFTConfig, ...`: TRL's trainers and configs on zeroshard.

Each name is TRL's class through `on_zeroshard` (`adapter.py`): the same
arguments, `deepspeed=` a DeepSpeed config (its "auto" values filled as
transformers fills them), launched with torchrun; at stage 3 the reference
model (DPO, GRPO) is sharded too (`frozen_models.py`) and GRPO's rollouts
generate with every rank taking part. Needs the `trl` extra
(`pip install "zeroshard[trl]"`). docs/hugging-face.md.
"""

from __future__ import annotations

from zeroshard.hf.adapter import on_zeroshard

try:
    import trl
except ImportError as exc:  # an optional extra: say which
    raise ImportError('zeroshard.hf.trl needs TRL: pip install "zeroshard[trl]" (or pip install trl)') from exc

_NAMES = ("SFTTrainer", "SFTConfig", "DPOTrainer", "DPOConfig", "GRPOTrainer", "GRPOConfig", "RewardTrainer",
          "RewardConfig", "KTOTrainer", "KTOConfig", "RLOOTrainer", "RLOOConfig", "DistillationTrainer",
          "DistillationConfig")


def __getattr__(name: str):
    """TRL's `name` on zeroshard, made on first use (importing TRL's trainers is slow)."""
    if name not in _NAMES:
        raise AttributeError(f"zeroshard.hf.trl has no {name!r}; it offers {', '.join(_NAMES)}, and "
                             "zeroshard.hf.on_zeroshard(cls) for any other Trainer or TrainingArguments subclass")
    return on_zeroshard(getattr(trl, name))


def __dir__() -> list[str]:
    return sorted(_NAMES)
