"""Models of the built-in demo. They are plain PyTorch and know nothing of sharding."""

from zeroshard.app.models.gpt import GPT, PRESETS, GPTConfig
from zeroshard.app.models.gpt_stages import GPTStage, lm_loss

__all__ = ["GPT", "GPTConfig", "GPTStage", "PRESETS", "lm_loss"]
