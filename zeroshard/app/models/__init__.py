"""Models of the built-in demo. They are plain PyTorch and know nothing of sharding."""

from zeroshard.app.models.gpt import GPT, PRESETS, GPTConfig

__all__ = ["GPT", "GPTConfig", "PRESETS"]
