"""The `zero_optimization` section: the ZeRO stage, its buckets and units, offload, and ZeRO++.

ZeRO++ (stage 3) is three switches with DeepSpeed's names,
`zero_quantized_weights` (qwZ), `zero_hpz_partition_size` (hpZ) and
`zero_quantized_gradients` (qgZ), and zeroshard keys for what DeepSpeed
leaves implicit: the quantization block, the gradient bits, the Hadamard
rotation and the ranks per node. Their defaults come from
benchmarks/quantize_error.py (docs/zeropp.md has the figures). The offload
blocks and their checks are in offload.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field, model_validator
from pydantic_core import PydanticCustomError

from zeroshard.config.offload import OffloadOptimizerConfig, OffloadParamConfig, offload_problems, raise_problems
from zeroshard.config.offload import section as _section
from zeroshard.config.values import FROZEN_STRICT as _FROZEN_STRICT
from zeroshard.config.values import NonNegativeInt, PositiveInt, StrictBool
from zeroshard.config.values import invalid as _invalid
from zeroshard.config.values import positive_int as _positive_int
from zeroshard.dtypes import WireFormat

_SUPPORTED_STAGES = (0, 1, 2, 3)
ZEROPP_KEYS = ("zero_quantized_weights", "zero_hpz_partition_size", "zero_quantized_gradients")


# A key whose default (null) resolves to on or off may also be switched off without its part of ZeRO++.
_OFF = {"zeropp_compile_quantizers": False}


def _optional_positive_int(value: Any) -> int | None:
    return None if value is None else _positive_int(value)


def _bits(value: Any) -> int:
    if isinstance(value, bool) or value not in (4, 8):
        raise _invalid("must be 4 or 8", value)
    return value


def _stage(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value not in _SUPPORTED_STAGES:
        stages = ", ".join(str(stage) for stage in _SUPPORTED_STAGES)
        raise _invalid(f"must be one of {stages}", value)
    return value


def _names(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):  # DeepSpeed takes one name for a list of one
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise _invalid("must be a list of names", value)
    return tuple(value)


class LeafModules(BaseModel):
    """Stage 3: modules gathered whole, with everything inside them, as one unit (DeepSpeed's leaf modules)."""

    model_config = _FROZEN_STRICT
    classes: Annotated[tuple[str, ...], BeforeValidator(_names)] = Field((), description=(
        "Module classes, by name (\"MixtralSparseMoeBlock\") or import path (\"transformers.models.mixtral."
        "modeling_mixtral.MixtralSparseMoeBlock\")."))
    names: Annotated[tuple[str, ...], BeforeValidator(_names)] = Field((), description=(
        "Qualified module names (\"model.layers.0.mlp\")."))
    name_suffixes: Annotated[tuple[str, ...], BeforeValidator(_names)] = Field((), description=(
        "Endings of qualified module names (\"mlp\")."))

    @property
    def given(self) -> bool:
        return bool(self.classes or self.names or self.name_suffixes)


def _class_names(value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise _invalid('must be a list of module class names such as ["Block"]', value)
    return tuple(value)


class ZeroConfig(BaseModel):
    """The `zero_optimization` section: which model states are sharded, and how."""

    model_config = _FROZEN_STRICT

    stage: Annotated[Literal[0, 1, 2, 3], BeforeValidator(_stage)] = Field(0, description=(
        "ZeRO stage: 0 = plain data parallel, 1 = shard optimizer states, "
        "2 = also shard gradients, 3 = also shard parameters (gathered per unit on demand). "
        "DeepSpeed: zero_optimization.stage (default 0)."))
    reduce_scatter: StrictBool = Field(True, description=(
        "true: gradients are reduce-scattered (each rank receives only its shard); "
        "false: all-reduce then slice, for comparison. "
        "DeepSpeed: zero_optimization.reduce_scatter (default true)."))
    reduce_once_per_window: StrictBool = Field(False, description=(
        "Stages 2-3: true: the micro-steps before a window's last keep their gradients whole on each rank "
        "(autograd's .grad, in the parameter dtype: stage 1's gradient memory) and the last one's backward "
        "reduces them all, once per window (as engine.no_sync() around those micro-steps, or FSDP2's "
        "set_requires_gradient_sync(False)); stage 3 keeps its parameters sharded. Stages 0-1 reduce once "
        "per window already. DeepSpeed: none."))
    # Not DeepSpeed's 5e8: at stage 2 a 5e8-element staging bucket would hold the
    # whole gradient of any model under 500M parameters, undoing stage 2's saving.
    reduce_bucket_size: PositiveInt = Field(25_000_000, description=(
        "Gradient elements reduced per bucket, per rank (bytes = elements x dtype size). "
        "DeepSpeed: zero_optimization.reduce_bucket_size (default 5e8)."))
    # Not DeepSpeed's 5e8, for the same reason: the gather buffer would be a full
    # replica of the parameters of most models.
    allgather_bucket_size: PositiveInt = Field(25_000_000, description=(
        "Parameter elements all-gathered per bucket after the step, per rank. "
        "DeepSpeed: zero_optimization.allgather_bucket_size (default 5e8)."))
    # DeepSpeed defaults to false for stages 1-2; we overlap because it is faster
    # and the extra buffers are accounted in the memory report.
    overlap_comm: StrictBool = Field(True, description=(
        "true: bucket reductions run asynchronously during backward. "
        "DeepSpeed: zero_optimization.overlap_comm (default false for stages 1-2)."))
    # Megatron-LM's name and default. Off: with it on, code that reads parameters itself right after a step
    # (11 tests of the suite did) reads values still in flight unless it calls engine.wait_for_params() first
    # (core/param_gather.py). benchmarks/bench.py's zeroshard_s1_overlap and zeroshard_s2_overlap measure it.
    overlap_param_gather: StrictBool = Field(False, description=(
        "Stages 1-2: true: the all-gather of the updated parameters after each step runs during the next "
        "forward, each bucket waited for at the first use of its parameters (a forward pre-hook per module), "
        "with the same values; code that reads parameters itself between engine.step() and the next forward "
        "calls engine.wait_for_params() first. DeepSpeed: none (Megatron-LM: overlap_param_gather)."))
    stage3_wrap_classes: Annotated[tuple[str, ...], BeforeValidator(_class_names)] = Field((), description=(
        "Stage 3: module class names whose instances each form a unit, gathered together "
        "(e.g. [\"Block\"]); empty = by size (stage3_auto_wrap_min_params). Same as "
        "initialize(..., wrap=[Block]). DeepSpeed: none (it gathers module by module)."))
    leaf_module: LeafModules = Field(default_factory=LeafModules, description=(
        "Stage 3: modules that form one unit each, gathered whole with whatever runs inside them (an MoE block "
        "with all its experts): no unit is made inside them. {classes, names, name_suffixes}; each must match "
        "a module. DeepSpeed: zero_optimization.leaf_module (and deepspeed.utils.set_z3_leaf_modules, which "
        "zeroshard.deepspeed.utils provides)."))
    stage3_auto_wrap_min_params: PositiveInt = Field(1_000_000, description=(
        "Stage 3 without wrap classes: a module that runs becomes a unit once it holds this many parameter "
        "elements outside inner units (a container that reaches it, such as a ModuleList, makes units of its "
        "children that run). DeepSpeed: none (FSDP's size_based_auto_wrap_policy)."))
    stage3_param_persistence_threshold: NonNegativeInt = Field(100_000, description=(
        "Stage 3: parameters with fewer elements stay whole on every rank (gathered after each "
        "step, like stage 2), saving many small gathers; 0 = shard every parameter. "
        "DeepSpeed: zero_optimization.stage3_param_persistence_threshold (default 1e5)."))
    stage3_max_live_parameters: PositiveInt = Field(1_000_000_000, description=(
        "Stage 3: prefetching stops when it would bring the gathered elements over this number "
        "(a unit that forward or backward needs now is always gathered). "
        "DeepSpeed: zero_optimization.stage3_max_live_parameters (default 1e9)."))
    stage3_max_reuse_distance: NonNegativeInt = Field(0, description=(
        "Stage 3: a unit whose parameters the step uses again within this many elements of other units' "
        "parameters (after its forward, before its backward) stays whole between the two, so backward does not "
        "gather it again; the units kept hold at most stage3_max_live_parameters together. 0 (the default): "
        "every unit is released after its forward and gathered again in backward (ZeRO's 3 gathers of Ψ a "
        "step, FSDP's reshard_after_forward); 1: only units with no other unit's parameters used between their "
        "forward's end and their backward stay whole (a root unit, as FSDP keeps its root). DeepSpeed: "
        "zero_optimization.stage3_max_reuse_distance (default 1e9, which keeps every unit of a model under 1e9 "
        "elements whole from forward to backward: faster, with the memory of stage 2's parameters)."))
    stage3_prefetch_bucket_size: PositiveInt = Field(50_000_000, description=(
        "Stage 3: the largest unit (elements) that is gathered ahead of its use. "
        "DeepSpeed: zero_optimization.stage3_prefetch_bucket_size (default 5e7)."))

    # ---- offload (offload.py) ----
    offload_optimizer: Annotated[OffloadOptimizerConfig, BeforeValidator(
        _section(OffloadOptimizerConfig, '{"device": "cpu"}'))] = Field(
        default_factory=OffloadOptimizerConfig, description=(
            "The fp32 master shard and optimizer state in host memory or on disk, stepped on the CPU (see "
            "OffloadOptimizerConfig); stages 1-3. null = disabled. DeepSpeed: zero_optimization.offload_optimizer "
            "(default disabled)."))
    offload_param: Annotated[OffloadParamConfig, BeforeValidator(
        _section(OffloadParamConfig, '{"device": "cpu"}'))] = Field(
        default_factory=OffloadParamConfig, description=(
            "Stage 3's parameter shards in host memory or on disk until their gather (see OffloadParamConfig). "
            "null = disabled. DeepSpeed: zero_optimization.offload_param (default disabled)."))
    sub_group_size: PositiveInt = Field(1_000_000_000, description=(
        "Elements of the optimizer stepped together when the optimizer state is on disk (offload_optimizer."
        "device \"nvme\"): each sub-group is read, stepped and written back in turn; read only then. "
        "DeepSpeed: zero_optimization.sub_group_size (default 1e9)."))

    # ---- ZeRO++ (stage 3) ----
    zero_quantized_weights: StrictBool = Field(False, description=(
        "ZeRO++ qwZ: stage 3's parameter all-gathers send each shard as int8, one fp32 scale per "
        "zeropp_block_size elements, dequantized into the compute dtype; master weights stay exact. "
        "DeepSpeed: zero_optimization.zero_quantized_weights (default false)."))
    zero_hpz_partition_size: PositiveInt = Field(1, description=(
        "ZeRO++ hpZ: > 1 keeps, after a unit's forward gather, a secondary shard over the node's ranks "
        "(this many; it must be the ranks per node), so later gathers until the step stay inside the node. "
        "1 = off. DeepSpeed: zero_optimization.zero_hpz_partition_size (default 1)."))
    zero_quantized_gradients: StrictBool = Field(False, description=(
        "ZeRO++ qgZ: stage 3's gradient reduce-scatter becomes a two-hop all-to-all of quantized "
        "gradients (inside the node, then across nodes), reduced in fp32 to the exact mean. "
        "DeepSpeed: zero_optimization.zero_quantized_gradients (default false)."))
    # 128, not larger: int8 weights cost 0.516 of 16-bit and int4 gradients 0.266 (the paper's 0.5 and 0.25
    # plus one fp32 scale a block); larger blocks save little more and lose more to outliers.
    zeropp_block_size: PositiveInt = Field(128, description=(
        "ZeRO++: elements per quantization block (one fp32 scale each), for qwZ and qgZ. DeepSpeed: "
        "none (zeroshard only; DeepSpeed's groups are per tensor)."))
    # int8, not the paper's int4: its error per shard is 15x smaller (benchmarks/quantize_error.py), and on the
    # demo (200 steps, bf16, 2 nodes x 2) all three parts ended 1.0% above plain stage 3's loss with int8 and 2.1%
    # with int4 (docs/zeropp.md); int4 remains the choice for the slowest links.
    zeropp_gradient_bits: Annotated[Literal[4, 8], BeforeValidator(_bits)] = Field(8, description=(
        "ZeRO++ qgZ: bits per gradient value on the wire, 8 or 4 (the paper's: half the bytes, about 15 "
        "times the error). DeepSpeed: none (zeroshard only; DeepSpeed sends int4)."))
    zeropp_gradient_hadamard: StrictBool | None = Field(None, description=(
        "ZeRO++ qgZ: rotate each block by the Walsh-Hadamard matrix before quantizing gradients "
        "(zeropp_block_size must be a power of two); it halves int4's error on heavy-tailed gradients. "
        "null = on with 4 bits, off with 8. DeepSpeed: none (zeroshard only)."))
    zeropp_compile_quantizers: StrictBool | None = Field(None, description=(
        "ZeRO++: run the quantizers as kernels torch.compile generates (the same values; on CPU about 10x "
        "faster, after seconds of compiling per process at the first gathers). null: on where torch.compile "
        "can build them (a C++ compiler for the CPU, Triton for CUDA), else off with a log line saying why; "
        "a compile that fails falls back to the same arithmetic eagerly, with a warning. "
        "DeepSpeed: none (zeroshard only; DeepSpeed's are CUDA kernels)."))
    zeropp_ranks_per_node: Annotated[int | None, BeforeValidator(_optional_positive_int)] = Field(
        None, description=(
            "Data-parallel ranks per node, for hpZ and qgZ and for bytes by scope in comm_stats(); "
            "null = zero_hpz_partition_size when > 1, else torchrun's LOCAL_WORLD_SIZE. Set it to "
            "emulate nodes on one machine. DeepSpeed: none (zeroshard only)."))

    @property
    def zeropp(self) -> bool:
        """Whether any part of ZeRO++ is on."""
        return self.zero_quantized_weights or self.zero_hpz_partition_size > 1 or self.zero_quantized_gradients

    def _check_codec_keys_used(self) -> None:
        """A ZeRO++ setting changed for a part that is off would promise what nothing does."""
        needs = {"zeropp_block_size": ("zero_quantized_weights or zero_quantized_gradients",
                                       self.zero_quantized_weights or self.zero_quantized_gradients),
                 "zeropp_gradient_bits": ("zero_quantized_gradients", self.zero_quantized_gradients),
                 "zeropp_gradient_hadamard": ("zero_quantized_gradients", self.zero_quantized_gradients),
                 "zeropp_compile_quantizers": ("zero_quantized_weights or zero_quantized_gradients",
                                               self.zero_quantized_weights or self.zero_quantized_gradients)}
        fields = type(self).model_fields
        unused = [f"{key} (needs {part})" for key, (part, on) in needs.items()  # defaults: a to_dict() round trip
                  if not on and getattr(self, key) not in (fields[key].default, _OFF.get(key))]
        if unused:
            raise PydanticCustomError("zeroshard", "{keys} changed from its default, but the part of ZeRO++ it configures is off: "
                                      "switch that part on or remove the key", {"keys": "; ".join(unused)})

    @property
    def gradient_format(self) -> WireFormat:
        """qgZ's codec format (comm/compress/quantize.py) for zeropp_gradient_bits: "int8" or "int4"."""
        return "int8" if self.zeropp_gradient_bits == 8 else "int4"

    @property
    def gradient_hadamard(self) -> bool:
        """Whether qgZ rotates its blocks: as configured, else with int4 only (where it pays off)."""
        if self.zeropp_gradient_hadamard is not None:
            return self.zeropp_gradient_hadamard
        return self.zeropp_gradient_bits == 4

    @property
    def ranks_per_node(self) -> int | None:
        """The configured ranks per node (None: torchrun's LOCAL_WORLD_SIZE decides)."""
        if self.zeropp_ranks_per_node is not None:
            return self.zeropp_ranks_per_node
        return self.zero_hpz_partition_size if self.zero_hpz_partition_size > 1 else None

    @model_validator(mode="after")
    def _zeropp_combinations(self) -> "ZeroConfig":
        on = [key for key, value in zip(ZEROPP_KEYS, (self.zero_quantized_weights, self.zero_hpz_partition_size > 1,
                                                      self.zero_quantized_gradients)) if value]
        if on and self.stage != 3:
            raise PydanticCustomError("zeroshard", "{keys} (ZeRO++) need stage 3, not stage {stage}: set "
                                      "zero_optimization.stage to 3 or remove them", {"keys": ", ".join(on),
                                                                                     "stage": self.stage})
        if self.zero_quantized_gradients and not self.reduce_scatter:
            raise PydanticCustomError("zeroshard", "zero_quantized_gradients replaces the reduce-scatter, so it "
                                      "cannot run with reduce_scatter false: remove one of them")
        self._check_codec_keys_used()
        block = self.zeropp_block_size
        if self.zero_quantized_gradients and self.gradient_hadamard and block & (block - 1):
            raise PydanticCustomError("zeroshard", "zeropp_gradient_hadamard needs a power-of-two "
                                      "zeropp_block_size, not {block}: use 64, 128, 256, ... or set "
                                      "zeropp_gradient_hadamard false", {"block": block})
        if self.zero_quantized_gradients and self.zeropp_gradient_bits == 4 and block % 2:
            raise PydanticCustomError("zeroshard", "int4 gradients pack two values a byte, so zeropp_block_size "
                                      "must be even, not {block}", {"block": block})
        hpz, rpn = self.zero_hpz_partition_size, self.zeropp_ranks_per_node
        if hpz > 1 and rpn is not None and hpz != rpn:
            raise PydanticCustomError("zeroshard", "zero_hpz_partition_size {hpz} differs from zeropp_ranks_per_node "
                                      "{rpn}: hpZ's secondary shards span one node; set both to the ranks per node",
                                      {"hpz": hpz, "rpn": rpn})
        return self

    @model_validator(mode="after")
    def _offload_combinations(self) -> "ZeroConfig":
        zeropp_weights = {key: value for key, value in (("zero_quantized_weights", self.zero_quantized_weights),
                                                        ("zero_hpz_partition_size", self.zero_hpz_partition_size))
                          if value is True or (value is not False and value > 1)}
        raise_problems("ZeroConfig", offload_problems(self.stage, self.offload_optimizer, self.offload_param,
                                                      zeropp_weights))
        return self
