"""Typed configuration (pydantic) read from DeepSpeed-style JSON; imports nothing above it."""

from zeroshard.config.auto import ConfigFacts
from zeroshard.config.deepspeed_keys import RULES, Rule, Status
from zeroshard.config.errors import ConfigError, ConfigWarning
from zeroshard.config.report import LoadReport
from zeroshard.config.schema import (
    ActivationCheckpointingConfig,
    Bf16Config,
    CheckpointConfig,
    Config,
    Fp16Config,
    NonFiniteConfig,
    ZeroConfig,
)

__all__ = [
    "RULES", "ActivationCheckpointingConfig", "Bf16Config", "CheckpointConfig", "Config", "ConfigError", "ConfigFacts",
    "ConfigWarning", "Fp16Config", "LoadReport", "NonFiniteConfig", "Rule", "Status", "ZeroConfig",
]
