"""The `communication_compression` section: codecs for what the data-parallel group sends.

Two places take a codec (int8, int4, fp8_e4m3, fp8_e5m2: per block, an fp32
scale a block, comm/compress/quantize.py):

- `gradients`: the gradient reduction at every stage (the all-reduce at
  stages 0-1 without reduce-scatter, the reduce-scatter otherwise), flat or
  over the node topology (`hierarchical`, ZeRO++'s qgZ), with error feedback
  by default; or `powersgd` (low rank, stages 0-1);
- `parameters`: the parameter all-gathers (after the step at stages 1-2,
  every unit's gathers at stage 3); the fp32 masters stay exact.

ZeRO++'s `zero_quantized_gradients` and `zero_quantized_weights` are the
same machinery under DeepSpeed's names; a config sets a part one way only.
docs/compression.md says what each codec costs and when it pays.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field, model_validator
from pydantic_core import PydanticCustomError

from zeroshard.config.offload import section as _section
from zeroshard.config.values import FROZEN_STRICT as _FROZEN_STRICT
from zeroshard.config.values import NonNegativeInt, PositiveInt, StrictBool
from zeroshard.dtypes import WIRE_FORMATS

CODECS = WIRE_FORMATS  # int8, int4, fp8_e4m3, fp8_e5m2
Codec = Literal["none", "int8", "int4", "fp8_e4m3", "fp8_e5m2"]
_POWERSGD_KEYS = ("rank", "start_step", "warm_start")
_CODEC_KEYS = ("block_size", "hadamard", "hierarchical")  # error_feedback serves both kinds


class _CodecFields(BaseModel):
    """What every codec place has: the codec, its block and its rotation."""

    model_config = _FROZEN_STRICT

    # 128: int8 then costs 0.258x of fp32 (int4 0.133x) with one fp32 scale a block; larger blocks save
    # little more and lose more to outliers (the same choice as zeropp_block_size).
    block_size: PositiveInt = Field(128, description=(
        "Elements per quantization block, one fp32 scale each. DeepSpeed: none (zeroshard only)."))
    # Off, even for int4: on the demo (300 steps, AdamW, 2 ranks) int4 with the rotation ended 17% above the
    # exact run's loss and 1% below it without (docs/compression.md). A rotated block of a sparse gradient
    # (embedding rows no token reached) sends noise to every element, which Adam scales up into full-size
    # steps; unrotated, zeros travel as zeros.
    hadamard: StrictBool = Field(False, description=(
        "Rotate each block by the Walsh-Hadamard matrix before quantizing (block_size must be a power of "
        "two): an outlier spreads over its block, which lowers int4's error on dense heavy-tailed values but "
        "spreads sparse gradients' noise over their zeros. DeepSpeed: none (zeroshard only)."))

    def _check_block(self) -> None:
        codec, block = getattr(self, "codec"), self.block_size
        if codec in CODECS and self.hadamard and block & (block - 1):
            raise PydanticCustomError("zeroshard", "the Hadamard rotation needs a power-of-two block_size, not {block}: use 64, 128, 256, ... or set "
                                      "hadamard false", {"block": block})
        if codec == "int4" and block % 2:
            raise PydanticCustomError("zeroshard", "int4 packs two values a byte, so block_size must be even, not {block}",
                                      {"block": block})


class GradientCompression(_CodecFields):
    """`communication_compression.gradients`: how gradient reductions travel."""

    codec: Literal["none", "int8", "int4", "fp8_e4m3", "fp8_e5m2", "powersgd"] = Field("none", description=(
        "\"int8\", \"int4\", \"fp8_e4m3\" or \"fp8_e5m2\": each rank's gradients travel quantized and are "
        "summed in fp32, at every stage; \"powersgd\": a rank-`rank` approximation of each matrix "
        "(stages 0-1); \"none\": exact. DeepSpeed: none (its 1-bit optimizers do not run with ZeRO)."))
    # On: round-to-nearest leaves each element's error in the same direction step after step; fed back, what
    # one step leaves out is sent with the next, so the applied updates track the exact ones.
    error_feedback: StrictBool = Field(True, description=(
        "Add what each quantized message left out to the next one (per rank, 4 bytes per padded gradient "
        "element it sends, counted in memory_stats() as error_feedback and saved in checkpoints). With powersgd: "
        "each rank's own error over its buckets, 4 bytes per gradient element, counted in memory_stats() as "
        "compression and saved in checkpoints. DeepSpeed: none (zeroshard only)."))
    hierarchical: StrictBool = Field(False, description=(
        "Reduce in two hops, inside each node then across nodes (ZeRO++'s qgZ topology; nodes from "
        "zero_optimization.zeropp_ranks_per_node or LOCAL_WORLD_SIZE). DeepSpeed: none (zeroshard only)."))
    rank: PositiveInt = Field(4, description=(
        "PowerSGD: the rank r of each matrix's approximation. A tensor, viewed as a matrix (its first "
        "dimension n, the product of the others m), is sent as (n + m) x min(n, m, r) fp32 values when that "
        "at least halves its n x m, as torch's hook decides; the others (biases, norms) are all-reduced exactly. "
        "DeepSpeed: none (torch's PowerSGDState.matrix_approximation_rank)."))
    start_step: NonNegativeInt = Field(10, description=(
        "PowerSGD: optimizer steps whose gradients are all-reduced exactly before compression starts (its "
        "warm-up; 0: compress from the first step). DeepSpeed: none (torch's PowerSGDState.start_powerSGD_iter)."))
    warm_start: StrictBool = Field(True, description=(
        "PowerSGD: start each step's power iteration from the last step's Q. DeepSpeed: none (torch's "
        "PowerSGDState.warm_start)."))

    @model_validator(mode="after")
    def _keys_of_the_codec(self) -> "GradientCompression":
        fields = type(self).model_fields
        changed = [key for key in _POWERSGD_KEYS + _CODEC_KEYS + ("error_feedback",) if getattr(self, key) != fields[key].default]
        wrong = [key for key in changed if key != "error_feedback"
                 and (key in _POWERSGD_KEYS) != (self.codec == "powersgd")]
        if self.codec == "none":
            wrong = changed
        if wrong:
            raise PydanticCustomError("zeroshard", "{keys}: not a setting of codec '{codec}': remove them or "
                                      "choose a codec they configure",
                                      {"keys": ", ".join(wrong), "codec": self.codec})
        self._check_block()
        return self


class ParameterCompression(_CodecFields):
    """`communication_compression.parameters`: how parameter all-gathers travel."""

    codec: Codec = Field("none", description=(
        "\"int8\", \"int4\", \"fp8_e4m3\" or \"fp8_e5m2\": each rank's updated parameter shard travels "
        "quantized in the all-gathers (after the step at stages 1-2, every gather at stage 3) and every rank "
        "computes with the same dequantized values; the fp32 masters stay exact. \"none\": exact. "
        "DeepSpeed: none (zero_quantized_weights is int8 at stage 3)."))

    @model_validator(mode="after")
    def _keys_of_the_codec(self) -> "ParameterCompression":
        fields = type(self).model_fields
        changed = [key for key in ("block_size", "hadamard") if getattr(self, key) != fields[key].default]
        if self.codec == "none" and changed:
            raise PydanticCustomError("zeroshard", "{keys}: set while codec is 'none': remove them or choose a codec", {"keys": ", ".join(changed)})
        self._check_block()
        return self


class CompressionConfig(BaseModel):
    """The `communication_compression` section."""

    model_config = _FROZEN_STRICT

    gradients: Annotated[GradientCompression, BeforeValidator(_section(GradientCompression, '{"codec": "int8"}'))] = (
        Field(default_factory=GradientCompression, description=(
            "How gradient reductions travel (see GradientCompression). DeepSpeed: none (zeroshard only).")))
    parameters: Annotated[ParameterCompression, BeforeValidator(
        _section(ParameterCompression, '{"codec": "fp8_e4m3"}'))] = Field(
        default_factory=ParameterCompression, description=(
            "How parameter all-gathers travel (see ParameterCompression). DeepSpeed: none (zeroshard only)."))


def compression_problems(compression: CompressionConfig, stage: int, reduce_scatter: bool,
                         zeropp: dict[str, Any], offload_param: bool = False) -> list[str]:
    """What a stage, ZeRO++'s keys (`zeropp`: those set) and stage 3's parameter offload make impossible, in
    words with the fix."""
    grads, params, problems = compression.gradients, compression.parameters, []
    if grads.codec == "powersgd" and stage >= 2:
        problems.append(f"PowerSGD needs every rank to hold each matrix's whole gradient, which stage {stage} "
                        "never does (each rank gets only its shard): use stage 0 or 1 with powersgd, or a "
                        "quantizing codec (int8, int4, fp8_e4m3, fp8_e5m2) at stage 2-3")
    if grads.codec in CODECS and stage >= 1 and not reduce_scatter:
        problems.append(f"a compressed gradient reduction replaces the reduce-scatter, so it cannot run with "
                        f"zero_optimization.reduce_scatter false at stage {stage}: remove one of them")
    if params.codec != "none" and stage == 0:
        problems.append("stage 0 gathers no parameters, so communication_compression.parameters has nothing to "
                        "compress: use stage 1-3 or remove it")
    if params.codec != "none" and stage == 3 and offload_param:
        problems.append("stage 3's quantized gathers are not implemented for parameter shards in host memory or "
                        "on disk (zero_optimization.offload_param): remove communication_compression.parameters "
                        "or the parameter offload")
    for key, place, on in (("zero_quantized_gradients", "gradients", grads.codec != "none"),
                           ("zero_quantized_weights", "parameters", params.codec != "none")):
        if on and zeropp.get(key):
            problems.append(f"zero_optimization.{key} and communication_compression.{place} both set how "
                            f"{place} travel: keep one (qgZ/qwZ are the codecs int8 over the node topology)")
    return problems
