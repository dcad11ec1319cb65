"""The config's defaults for the sizes the plan's rules take, read from the schema, never copied.

The engine passes its validated config's values; a caller without a config
(the estimator, `zeroshard estimate`) takes these, so a default changed in
the schema changes the estimate with it.
"""

from __future__ import annotations

from zeroshard.config.compression import GradientCompression
from zeroshard.config.offload import OffloadOptimizerConfig, OffloadParamConfig
from zeroshard.config.zero import ZeroConfig


def _default(block, key: str):
    return block.model_fields[key].default


# Stage 3's gathers (elements): the live limit, the largest unit prefetched, the reuse distance.
MAX_LIVE_NUMEL: int = _default(ZeroConfig, "stage3_max_live_parameters")
PREFETCH_NUMEL: int = _default(ZeroConfig, "stage3_prefetch_bucket_size")
MAX_REUSE_DISTANCE: int = _default(ZeroConfig, "stage3_max_reuse_distance")
# Offload's blocks: sub-groups of the disk tier (elements), its read buffers, the parameter buffers.
SUB_GROUP_SIZE: int = _default(ZeroConfig, "sub_group_size")
BUFFER_COUNT: int = _default(OffloadOptimizerConfig, "buffer_count")
PARAM_BUFFER_COUNT: int = _default(OffloadParamConfig, "buffer_count")
PARAM_BUFFER_SIZE: int = _default(OffloadParamConfig, "buffer_size")
MAX_IN_CPU: int = _default(OffloadParamConfig, "max_in_cpu")
# ZeRO++'s codecs: elements per quantization block, and qgZ's gradient bits.
ZEROPP_BLOCK_SIZE: int = _default(ZeroConfig, "zeropp_block_size")
ZEROPP_GRADIENT_BITS: int = _default(ZeroConfig, "zeropp_gradient_bits")
# A gradient codec's elements per quantization block (communication_compression.gradients.block_size).
CODEC_BLOCK_SIZE: int = _default(GradientCompression, "block_size")
