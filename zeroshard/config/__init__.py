"""Typed configuration (pydantic) read from DeepSpeed-style JSON; imports nothing above it."""

from zeroshard.config.auto import ConfigFacts
from zeroshard.config.errors import ConfigError, ConfigWarning
from zeroshard.config.keys import UNSUPPORTED_TOP_LEVEL_KEYS, UNSUPPORTED_ZERO_KEYS
from zeroshard.config.schema import Bf16Config, Config, Fp16Config, NonFiniteConfig, ZeroConfig

__all__ = [
    "UNSUPPORTED_TOP_LEVEL_KEYS", "UNSUPPORTED_ZERO_KEYS", "Bf16Config", "Config", "ConfigError", "ConfigFacts",
    "ConfigWarning", "Fp16Config", "NonFiniteConfig", "ZeroConfig",
]
