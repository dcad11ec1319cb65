"""Typed training config, read from DeepSpeed-style JSON.

`Config.load` is the entry point: it takes a dict, a path to a JSON file or a
`Config`, and returns a frozen `Config` or raises `ConfigError` with one line
per problem. Keys use DeepSpeed's JSON names. Nothing is silently ignored: an
unknown key, a DeepSpeed key zeroshard rejects (deepspeed_keys.py), an
"auto" nothing resolves and a bad value are each an error naming the dotted
key. DeepSpeed keys with no effect here are accepted and reported. Under
`"strict": false` the rejected DeepSpeed keys are ignored instead, each
reported and warned.

Loading runs in order: offload keys given elsewhere (DeepSpeed's other
names, `initialize(offload=...)`: offload_merge.py), key check (keys.py),
`"auto"` values and batch sizes (auto.py, from the `ConfigFacts` that
`initialize` passes), `initialize(wrap=...)` (wrap_merge.py), the `optimizer`
and `scheduler` blocks (blocks.py), then the typed fields.
`load_with_report` also returns what was decided (report.py).
"""

from __future__ import annotations

import copy
import json
from functools import partial
from pathlib import Path
from typing import Annotated, Any, Callable, Literal

from pydantic import BaseModel, BeforeValidator, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from zeroshard.config.activation import ActivationCheckpointingConfig
from zeroshard.config.auto import ConfigFacts, resolve_autos
from zeroshard.config.blocks import OptimizerBlock, SchedulerBlock, parse_block
from zeroshard.config.compression import CompressionConfig, compression_problems
from zeroshard.config.errors import ConfigError, ConfigWarning
from zeroshard.config.keys import key_problems, read_json
from zeroshard.config.offload import AioConfig, raise_problems, section as _section_or_null
from zeroshard.config.offload_merge import OffloadArg, merge_offload_argument, merge_other_names
from zeroshard.config.precision import Bf16Config, Fp16Config, NonFiniteConfig
from zeroshard.config.report import LoadReport
from zeroshard.config.values import FROZEN_STRICT as _FROZEN_STRICT
from zeroshard.config.wrap_merge import merge_wrap_argument
from zeroshard.config.values import (
    PositiveInt,
    StrictBool,
    any_case_choice,
    finite_number,
    optional_positive_int,
)
from zeroshard.config.values import describe as _describe
from zeroshard.config.values import invalid as _invalid
from zeroshard.config.values import non_negative_float as _non_negative_float
from zeroshard.config.zero import ZeroConfig
from zeroshard.dtypes import TRAINING_DTYPES, TrainingDtype

__all__ = ["ActivationCheckpointingConfig", "AioConfig", "Bf16Config", "CheckpointConfig", "Config", "ConfigError",
           "ConfigFacts", "ConfigWarning", "Fp16Config", "NonFiniteConfig", "ZeroConfig"]

# ---- value checks: each raises "<requirement>; got <value as JSON>[ <note>]" ----

# torch.distributed adds a timeout to the clock in 64-bit nanoseconds: from about 7.5e9 s on it
# overflows (with 8e9 s the store's connect times out at once; 5e9 s still works), and Python's
# timedelta stops at 8.6e13 s. 1e9 s (31 years) stays clear of both and means "no limit" in practice.
MAX_SECONDS = 1e9


def _positive_seconds(value: Any) -> float:
    seconds = finite_number(value, 0, False, noun="a number of seconds")
    if seconds > MAX_SECONDS:
        raise _invalid("must be at most 1e9 seconds (31 years; longer overflows torch.distributed's clocks): "
                       "use 1e9 for no practical limit", value)
    return seconds


def _clip_norm(value: Any) -> float:
    return _non_negative_float(value, " (0.0 turns clipping off)")


def _section(model: type[BaseModel], example: str) -> Callable[[Any], Any]:
    """A validator for a section: a JSON object (or the section's `model` itself), else "such as `example`"."""
    def check(value: Any) -> Any:
        if not isinstance(value, (dict, model)):
            raise _invalid(f"must be a JSON object such as {example}", value)
        return value
    return check


def _allreduce_op(value: Any) -> str:
    if value not in ("mean", "sum"):
        raise _invalid('must be "mean" or "sum"', value)
    return value


def _divide_factor(value: Any) -> float | None:
    return None if value is None else finite_number(value, 0, False, noun="a divide factor")


def _communication_dtype(value: Any) -> str | None:
    if value is not None and value not in TRAINING_DTYPES:
        raise _invalid(f"must be one of {', '.join(map(json.dumps, TRAINING_DTYPES))} or null", value)
    return value


class CheckpointConfig(BaseModel):
    """The `checkpoint` section: how save_checkpoint treats the tags the ranks pass."""

    model_config = _FROZEN_STRICT

    tag_validation: Annotated[Literal["Warn", "Ignore", "Fail"], BeforeValidator(
        # DeepSpeed upper-cases the value before checking it, so "WARN" and "warn" mean "Warn".
        partial(any_case_choice, choices=("Warn", "Ignore", "Fail")))] = Field(
        "Warn", description=(
            "What save_checkpoint does when the ranks pass different tags: \"Warn\" warns and writes rank 0's "
            "tag, \"Ignore\" writes rank 0's tag silently, \"Fail\" raises on every rank. Any case is "
            "accepted and stored as written here. DeepSpeed: checkpoint.tag_validation (default \"Warn\")."))
    async_save: StrictBool = Field(False, description=(
        "true: save_checkpoint returns once the state of the step is copied to host memory and writes it in a "
        "background thread; the tag becomes 'latest' at a later step once every rank's file is complete, and a "
        "failed write raises on every rank at that step (docs/fault-tolerance.md). Not with offload device "
        "\"nvme\" or on a mesh. save_checkpoint(asynchronous=) overrides it. DeepSpeed: none (zeroshard only)."))


class Config(BaseModel):
    """The whole training config. Build it with `Config.load`; it is immutable."""

    model_config = _FROZEN_STRICT

    train_micro_batch_size_per_gpu: Annotated[
        int | None, BeforeValidator(optional_positive_int)] = Field(None, description=(
            "Samples per rank per forward/backward (micro-batch); null = not set. "
            "DeepSpeed: train_micro_batch_size_per_gpu."))
    train_batch_size: Annotated[
        int | None, BeforeValidator(optional_positive_int)] = Field(None, description=(
            "Samples per optimizer step over all ranks = micro-batch x accumulation steps x ranks: "
            "checked, or used to derive the one of the three left out; null = not set. "
            "DeepSpeed: train_batch_size."))
    gradient_accumulation_steps: PositiveInt = Field(1, description=(
        "Micro-batches (count) accumulated before each optimizer step. "
        "DeepSpeed: gradient_accumulation_steps (default 1)."))
    gradient_clipping: Annotated[float, BeforeValidator(_clip_norm)] = Field(0.0, description=(
        "Maximum global L2 norm of the gradients (unitless); 0.0 = no clipping. "
        "DeepSpeed: gradient_clipping (default 0.0)."))
    gradient_allreduce_op: Annotated[Literal["mean", "sum"], BeforeValidator(_allreduce_op)] = Field(
        "mean", description=(
            "How the ranks' gradients combine: \"mean\" divides their sum by the ranks, \"sum\" does not (a loss "
            "normalised by a global count, such as the tokens of every rank's micro-batch); either way the "
            "window's micro-steps are averaged (engine.backward(loss, scale_wrt_gas=False) turns that off "
            "for one backward). DeepSpeed: gradient_allreduce_op (default \"mean\")."))
    gradient_divide_factor: Annotated[float | None, BeforeValidator(_divide_factor)] = Field(None, description=(
        "The number the window's summed gradients (over ranks and micro-steps) are divided by, in place of "
        "ranks x gradient_accumulation_steps; 1.0: the plain sum, for a loss normalised by the global "
        "token count. null = the mean. engine.set_gradient_divide_factor changes it between steps. "
        "DeepSpeed: none (FSDP2's set_gradient_divide_factor)."))
    collective_timeout: Annotated[float, BeforeValidator(_positive_seconds)] = Field(1800.0, description=(
        "Seconds a collective may wait for the other ranks before the engine stops with an error "
        "that says which collective, unit and step each rank was at (at most 1e9). DeepSpeed: none "
        "(deepspeed.init_distributed(timeout=...), default 30 minutes)."))
    # 20 s: a rank silent that long (in a barrier, exited) is not coming; collective_timeout is for slow ones.
    rank_check_timeout: Annotated[float, BeforeValidator(_positive_seconds)] = Field(20.0, description=(
        "Seconds the ranks wait for each other at the entry of a call every rank must make "
        "(save_checkpoint, load_checkpoint, save_pretrained, save_16bit_model; at stage 3 full_state_dict, "
        "the model's state_dict() and gathered_parameters) before every rank that entered raises an error "
        "naming the call, the ranks missing and where they are; sooner once a missing rank is known to be "
        "elsewhere (in a collective, or in another such call). A "
        "collective that has waited min(5, rank_check_timeout / 4) s (gloo) also looks at where the "
        "other ranks are, and stops with an error once one is known to be elsewhere (in such a call, or "
        "at another step or micro-step). At most 1e9. DeepSpeed: none (zeroshard only)."))
    zero_optimization: Annotated[ZeroConfig, BeforeValidator(_section(ZeroConfig, '{"stage": 2}'))] = Field(
        default_factory=ZeroConfig,
        description="ZeRO settings (see ZeroConfig). DeepSpeed: zero_optimization.")
    optimizer: OptimizerBlock | None = Field(None, description=(
        "Builds the optimizer when zeroshard.initialize is given none (over model_parameters when given); "
        "next to an optimizer passed in code it must agree with it, and its \"auto\" values take the code "
        "optimizer's; null = none. DeepSpeed: optimizer."))
    scheduler: SchedulerBlock | None = Field(None, description=(
        "Builds the LR schedule on the optimizer, as engine.lr_scheduler, stepped at each "
        "optimizer step; an lr_scheduler passed in code replaces a block whose params are all \"auto\"; "
        "null = none. DeepSpeed: scheduler."))
    dataloader_drop_last: StrictBool = Field(False, description=(
        "true: the DataLoader zeroshard.deepspeed.initialize builds from training_data drops the last "
        "incomplete batch. DeepSpeed: dataloader_drop_last (default false)."))
    checkpoint: Annotated[CheckpointConfig, BeforeValidator(
        _section(CheckpointConfig, '{"tag_validation": "Warn"}'))] = Field(
        default_factory=CheckpointConfig,
        description="Checkpoint settings (see CheckpointConfig). DeepSpeed: checkpoint.")
    strict: StrictBool = Field(True, description=(
        "false: DeepSpeed keys zeroshard rejects (status error or not yet in docs/deepspeed-config.md) are "
        "ignored instead, each listed at start-up and warned; unknown keys, bad values and an \"auto\" "
        "nothing resolves stay errors. DeepSpeed: none (zeroshard only)."))
    bf16: Annotated[Bf16Config, BeforeValidator(_section(Bf16Config, '{"enabled": true}'))] = Field(
        default_factory=Bf16Config,
        description="bfloat16 mixed precision (see Bf16Config). DeepSpeed: bf16 (default disabled).")
    fp16: Annotated[Fp16Config, BeforeValidator(_section(Fp16Config, '{"enabled": true}'))] = Field(
        default_factory=Fp16Config,
        description="float16 mixed precision with loss scaling (see Fp16Config). DeepSpeed: fp16 "
                    "(default disabled).")
    communication_data_type: Annotated[
        TrainingDtype | None, BeforeValidator(_communication_dtype)] = Field(
            None, description=(
                "dtype of gradient reductions: \"fp32\", or the training dtype (\"bf16\" or \"fp16\"); "
                "null = the training dtype. DeepSpeed: communication_data_type (default null)."))
    communication_compression: Annotated[CompressionConfig, BeforeValidator(
        _section(CompressionConfig, '{"gradients": {"codec": "int8"}}'))] = Field(
        default_factory=CompressionConfig,
        description="Codecs for the gradient reductions and parameter gathers (see CompressionConfig, "
                    "docs/compression.md). DeepSpeed: none (zeroshard only).")
    non_finite: Annotated[NonFiniteConfig, BeforeValidator(_section(NonFiniteConfig, '{"action": "skip"}'))] = Field(
        default_factory=NonFiniteConfig,
        description="What a step whose gradients hold inf or nan does, in fp32 and bf16 (see "
                    "NonFiniteConfig). DeepSpeed: none.")
    aio: Annotated[AioConfig, BeforeValidator(_section_or_null(AioConfig, '{"block_size": 1048576}'))] = Field(
        default_factory=AioConfig,
        description="Disk reads and writes of offload to \"nvme\" (see AioConfig); read only then. null = the "
                    "defaults. DeepSpeed: aio.")
    activation_checkpointing: Annotated[ActivationCheckpointingConfig, BeforeValidator(_section(
        ActivationCheckpointingConfig, '{"partition_activations": true}'))] = Field(
        default_factory=ActivationCheckpointingConfig,
        description="How zeroshard.deepspeed.checkpointing.checkpoint keeps the checkpointed inputs (see "
                    "ActivationCheckpointingConfig). DeepSpeed: activation_checkpointing.")

    @model_validator(mode="after")
    def _one_precision(self) -> Config:
        if self.bf16.enabled and self.fp16.enabled:
            raise PydanticCustomError("zeroshard", "bf16.enabled and fp16.enabled are both true; enable "
                                      "one of them (bf16 needs no loss scaling where the hardware has it)")
        wire = self.communication_data_type
        if wire not in (None, "fp32", self.training_dtype):
            raise PydanticCustomError(
                "zeroshard", "communication_data_type \"{wire}\" needs {wire}.enabled: gradients are "
                "reduced in fp32 or in the training dtype (here \"{training}\")",
                {"wire": wire, "training": self.training_dtype})
        if self.gradient_divide_factor is not None and self.gradient_allreduce_op == "sum":
            raise PydanticCustomError(
                "zeroshard", "gradient_divide_factor with gradient_allreduce_op \"sum\": the factor replaces the "
                "whole divisor (ranks x accumulation steps) already; give one of the two")
        if self.fp16.enabled and self.non_finite.action == "error":
            raise PydanticCustomError(
                "zeroshard", "non_finite.action \"error\" does not apply with fp16.enabled: fp16's loss scaler "
                "overflows by design while it finds its scale, and skips those steps itself (LossScaleError at "
                "min_loss_scale). Remove non_finite.action, or train in bf16 to stop at the first inf or nan")
        return self

    @model_validator(mode="after")
    def _compression_fits(self) -> Config:
        zero = self.zero_optimization
        zeropp = {"zero_quantized_gradients": zero.zero_quantized_gradients,
                  "zero_quantized_weights": zero.zero_quantized_weights}
        problems = compression_problems(self.communication_compression, zero.stage, zero.reduce_scatter, zeropp,
                                        zero.offload_param.device != "none")
        raise_problems("Config", [(("communication_compression",), problem) for problem in problems])
        return self

    @model_validator(mode="after")
    def _async_save_fits(self) -> Config:
        zero = self.zero_optimization
        if self.checkpoint.async_save and "nvme" in (zero.offload_optimizer.device, zero.offload_param.device):
            raise PydanticCustomError(
                "zeroshard", "checkpoint.async_save with offload device \"nvme\": an asynchronous save would stage "
                "the whole disk tier in host memory, which that tier is there to avoid. Set async_save to false "
                "(the synchronous save streams the tier a sub-group at a time), or offload to \"cpu\"")
        return self

    @property
    def training_dtype(self) -> TrainingDtype:
        """The dtype of parameters in forward and backward: "bf16", "fp16" or "fp32"."""
        return "bf16" if self.bf16.enabled else "fp16" if self.fp16.enabled else "fp32"

    @property
    def stage(self) -> int:
        """The ZeRO stage, `zero_optimization.stage`."""
        return self.zero_optimization.stage

    @classmethod
    def load(cls, source: dict[str, Any] | str | Path | Config, facts: ConfigFacts | None = None,
             offload: OffloadArg = None) -> Config:
        """Build a config from a dict, a path to a JSON file, or a `Config`.

        `facts` (world size, the model's dtype, the optimizer passed in code, ...) resolve `"auto"` values and
        the batch sizes; `zeroshard.initialize` passes them. `offload`: initialize's argument, written into the
        offload blocks (offload_merge.py). A `Config` without facts or offload is returned as is; with them it
        is checked again. Raises `ConfigError` for an unreadable file, invalid JSON, unknown or rejected keys,
        an "auto" nothing resolves, or bad values; the message lists every problem.
        """
        return cls.load_with_report(source, facts, offload)[0]

    @classmethod
    def load_with_report(cls, source: dict[str, Any] | str | Path | Config, facts: ConfigFacts | None = None,
                         offload: OffloadArg = None, wrap: tuple[str, ...] = ()) -> tuple[Config, LoadReport]:
        """`load`, and what it decided ("auto" resolutions, derived batch keys, no-effect keys); wrap: wrap_merge.py."""
        report, given = LoadReport(), None
        if isinstance(source, Config):
            if facts is None and offload is None and not wrap:
                return source, report
            # every key is in to_dict(); the keys set explicitly decide what offload= may fill in
            raw, origin, given = source.to_dict(), "Config", source.model_dump(mode="json", exclude_unset=True)
        elif isinstance(source, (str, Path)):
            raw, origin = read_json(Path(source)), f"file '{source}'"
        elif isinstance(source, dict):
            raw, origin = source, "dict"
        else:
            raise ConfigError("Config.load expects a dict, a path to a JSON file or a Config; "
                              f"got {type(source).__name__}")
        raw = copy.deepcopy(raw)  # strict=false and "auto" change it; the caller's dict stays as it was
        problems = merge_other_names(raw, report)
        problems += merge_offload_argument(raw, offload, report, given)
        problems += key_problems(raw, cls, report)
        if not problems:
            raw, problems = resolve_autos(raw, facts or ConfigFacts(), report)
            merge_wrap_argument(raw, wrap)
            raw, block_problems = _parse_blocks(raw)
            problems += block_problems
            try:
                config = cls.model_validate(raw)
            except ValidationError as error:
                problems += [_describe(detail) for detail in error.errors()] + _rules_between_sections(cls, raw, error)
            if not problems:
                return config, report
        lines = "\n".join(f"  - {problem}" for problem in problems)
        raise ConfigError(f"invalid zeroshard config ({origin}):\n{lines}")

    def to_dict(self) -> dict[str, Any]:
        """The effective config with DeepSpeed key names, JSON-serialisable.

        Every key is present, defaults included, so ranks can compare configs.
        """
        return self.model_dump(mode="json")


def _rules_between_sections(cls: type[Config], raw: dict[str, Any], error: ValidationError) -> list[str]:
    """The rules between sections (bf16 with fp16, ...), which pydantic checks only once every field is valid:
    checked again without the sections that failed, so that one error names every mistake at once."""
    failed = {detail["loc"][0] for detail in error.errors() if detail["loc"]}
    rest = {key: value for key, value in raw.items() if key not in failed}
    if not failed or len(rest) == len(raw):
        return []  # the failure is one of these rules itself, or in no section of raw
    try:
        cls.model_validate(rest)
    except ValidationError as again:
        return [_describe(detail) for detail in again.errors() if not detail["loc"]]
    return []


def _parse_blocks(raw: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """`raw` with the optimizer and scheduler blocks parsed (None where they have problems)."""
    problems: list[str] = []
    parsed = dict(raw)
    for key in ("optimizer", "scheduler"):
        if raw.get(key) is not None:
            parsed[key], block_problems = parse_block(key, raw[key])
            problems += block_problems
    return parsed, problems
