"""DeepSpeed's `optimizer` and `scheduler` config blocks: their params, checks, and what they build.

A block is {"type": NAME, "params": {...}}. `parse_block` turns the JSON into
a frozen block whose params are complete (every default filled in), or
returns one line per problem. `build_optimizer` and `build_scheduler` make
the torch objects. Names and defaults follow DeepSpeed (deepspeed/runtime/
engine.py `_configure_basic_optimizer`, deepspeed/runtime/lr_schedules.py).
"""

from __future__ import annotations

import difflib
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, BeforeValidator, Field, SerializeAsAny, ValidationError

from zeroshard.config.errors import ConfigError
from zeroshard.config.lr_schedules import WarmupCosineLR, WarmupDecayLR, WarmupLR
from zeroshard.config.muon_block import MuonParams, build_muon
from zeroshard.config.values import (
    FROZEN_STRICT,
    Betas,
    NonNegativeFloat,
    PositiveInt,
    StrictBool,
    describe,
    invalid,
    non_negative_float,
    show,
)


def _warmup_type(value: Any) -> str:
    if value not in ("log", "linear"):
        raise invalid('must be "log" or "linear"', value)
    return value


def _last_batch_iteration(value: Any) -> int:
    # A resumed schedule restores its position from a checkpoint, not from the config.
    if value != -1 or isinstance(value, bool):
        raise invalid("must be -1 (the schedule starts at the beginning)", value)
    return -1


def _ratio(value: Any) -> float:
    value = non_negative_float(value)
    if value > 1:
        raise invalid("must be a number in [0, 1]", value)
    return value


WarmupType = Annotated[Literal["log", "linear"], BeforeValidator(_warmup_type)]
StartIteration = Annotated[int, BeforeValidator(_last_batch_iteration)]
Ratio = Annotated[float, BeforeValidator(_ratio)]


# ---- optimizer params ----

class AdamParams(BaseModel):
    """`optimizer.params` for type Adam or AdamW."""

    model_config = FROZEN_STRICT

    lr: NonNegativeFloat = Field(1e-3, description=(
        "Learning rate. DeepSpeed: optimizer.params.lr (default 1e-3)."))
    betas: Betas = Field((0.9, 0.999), description=(
        "Coefficients of the running averages of the gradient and its square. "
        "DeepSpeed: optimizer.params.betas (default [0.9, 0.999])."))
    eps: NonNegativeFloat = Field(1e-8, description=(
        "Term added to the denominator. DeepSpeed: optimizer.params.eps (default 1e-8)."))
    weight_decay: NonNegativeFloat = Field(0.0, description=(
        "Weight decay, decoupled (AdamW) unless type is Adam with adam_w_mode false (L2). "
        "DeepSpeed: optimizer.params.weight_decay (default 0.0, FusedAdam's)."))
    adam_w_mode: StrictBool = Field(True, description=(
        "For type Adam: true runs AdamW (decoupled weight decay), false classic Adam. "
        "DeepSpeed: optimizer.params.adam_w_mode (default true)."))
    torch_adam: StrictBool = Field(False, description=(
        "DeepSpeed picks torch's Adam over its FusedAdam kernel (same math); zeroshard always "
        "runs torch's, fused where the device has it. DeepSpeed: optimizer.params.torch_adam "
        "(default false)."))


class SGDParams(BaseModel):
    """`optimizer.params` for type SGD (torch.optim.SGD's arguments)."""

    model_config = FROZEN_STRICT

    lr: NonNegativeFloat = Field(1e-3, description="Learning rate. DeepSpeed: optimizer.params.lr.")
    momentum: NonNegativeFloat = Field(0.0, description=(
        "Momentum factor. DeepSpeed: optimizer.params.momentum (default 0)."))
    dampening: NonNegativeFloat = Field(0.0, description=(
        "Dampening of the momentum. DeepSpeed: optimizer.params.dampening (default 0)."))
    weight_decay: NonNegativeFloat = Field(0.0, description=(
        "L2 penalty. DeepSpeed: optimizer.params.weight_decay (default 0)."))
    nesterov: StrictBool = Field(False, description=(
        "Nesterov momentum (needs momentum > 0 and dampening 0). "
        "DeepSpeed: optimizer.params.nesterov (default false)."))


# ---- scheduler params ----

class _WarmupParams(BaseModel):
    """The warmup parameters every scheduler type shares."""

    model_config = FROZEN_STRICT

    warmup_num_steps: PositiveInt = Field(1000, description=(
        "Optimizer steps of warmup (at least 2 are used, as DeepSpeed). "
        "DeepSpeed: scheduler.params.warmup_num_steps (default 1000)."))
    warmup_type: WarmupType = Field("log", description=(
        'Warmup curve: "log" (rises as log(iteration + 1) / log(warmup_num_steps)) or "linear". '
        'DeepSpeed: scheduler.params.warmup_type (default "log").'))
    last_batch_iteration: StartIteration = Field(-1, description=(
        "Only -1 (start from the beginning). DeepSpeed: scheduler.params.last_batch_iteration."))


class WarmupLRParams(_WarmupParams):
    """`scheduler.params` for WarmupLR: warm up, then hold warmup_max_lr."""

    warmup_min_lr: NonNegativeFloat = Field(0.0, description=(
        "Learning rate at the start of warmup. DeepSpeed: scheduler.params.warmup_min_lr (default 0)."))
    warmup_max_lr: NonNegativeFloat | None = Field(None, description=(
        "Learning rate at the end of warmup; null = the optimizer's lr (first param group). "
        "DeepSpeed: scheduler.params.warmup_max_lr (WarmupLR default: the optimizer's lr)."))


class WarmupDecayLRParams(WarmupLRParams):
    """`scheduler.params` for WarmupDecayLR: warm up, then decay linearly to 0 at total_num_steps."""

    warmup_max_lr: NonNegativeFloat | None = Field(0.001, description=(
        "Learning rate at the end of warmup; null = the optimizer's lr (first param group). "
        "DeepSpeed: scheduler.params.warmup_max_lr (WarmupDecayLR default 0.001)."))
    total_num_steps: PositiveInt = Field(description=(
        "Optimizer steps of the whole run (required). DeepSpeed: scheduler.params.total_num_steps."))


class WarmupCosineLRParams(_WarmupParams):
    """`scheduler.params` for WarmupCosineLR: a ratio of the optimizer's lr, warmup then cosine."""

    total_num_steps: PositiveInt = Field(description=(
        "Optimizer steps of the whole run (required). DeepSpeed: scheduler.params.total_num_steps."))
    warmup_min_ratio: Ratio = Field(0.0, description=(
        "Ratio of the optimizer's lr at the start of warmup. "
        "DeepSpeed: scheduler.params.warmup_min_ratio (default 0)."))
    cos_min_ratio: Ratio = Field(0.0001, description=(
        "Ratio of the optimizer's lr at total_num_steps. "
        "DeepSpeed: scheduler.params.cos_min_ratio (default 0.0001)."))


# Types by their DeepSpeed name. DeepSpeed lower-cases optimizer names but
# matches scheduler names exactly; zeroshard does the same.
OPTIMIZER_PARAMS: dict[str, type[BaseModel]] = {"Adam": AdamParams, "AdamW": AdamParams, "SGD": SGDParams,
                                                "Muon": MuonParams}
SCHEDULER_PARAMS: dict[str, type[BaseModel]] = {
    "WarmupLR": WarmupLRParams, "WarmupDecayLR": WarmupDecayLRParams, "WarmupCosineLR": WarmupCosineLRParams,
}
_SCHEDULE_CLASSES = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}


class OptimizerBlock(BaseModel):
    """The `optimizer` block, complete: builds the optimizer when `initialize` is given none."""

    model_config = FROZEN_STRICT

    type: str = Field(description=("Adam, AdamW, SGD or Muon (any case; Muon: Muon for the hidden matrices, "
                                   "AdamW for the rest). DeepSpeed: optimizer.type."))
    params: SerializeAsAny[BaseModel] = Field(description=(
        "The type's parameters, below; may be left out (all defaults). DeepSpeed: optimizer.params."))


class SchedulerBlock(BaseModel):
    """The `scheduler` block, complete: built on the optimizer, stepped at each optimizer step."""

    model_config = FROZEN_STRICT

    type: str = Field(description="WarmupLR, WarmupDecayLR or WarmupCosineLR. DeepSpeed: scheduler.type.")
    params: SerializeAsAny[BaseModel] = Field(description=(
        "The type's parameters, below; may be left out (all defaults). DeepSpeed: scheduler.params."))


_BLOCKS = {"optimizer": (OPTIMIZER_PARAMS, OptimizerBlock), "scheduler": (SCHEDULER_PARAMS, SchedulerBlock)}
_EXAMPLES = {"optimizer": '{"type": "AdamW", "params": {"lr": 0.001}}',
             "scheduler": '{"type": "WarmupLR", "params": {"warmup_num_steps": 100}}'}


def parse_block(key: str, value: Any) -> tuple[BaseModel | None, list[str]]:
    """The block at top-level `key` ("optimizer" or "scheduler") with defaults filled in, or its problems."""
    registry, block_class = _BLOCKS[key]
    if isinstance(value, block_class):
        return value, []
    if not isinstance(value, dict):
        return None, [f"{key} must be a JSON object such as {_EXAMPLES[key]}; got {show(value)}"]
    problems = [f"unknown key '{key}.{k}'; allowed keys in '{key}': params, type"
                for k in value if k not in ("type", "params")]
    kind = _type_name(key, value.get("type"), problems)
    params = value.get("params", {})
    if not isinstance(params, dict):
        problems.append(f"{key}.params must be a JSON object; got {show(params)}")
    if problems or kind is None:
        return None, problems
    model = registry[kind]
    problems = _param_key_problems(key, kind, params, model)
    if problems:
        return None, problems
    try:
        parsed = model.model_validate(_with_type_defaults(kind, params))
    except ValidationError as error:
        return None, [describe(detail, f"{key}.params.") for detail in error.errors()]
    problems = _combination_problems(key, kind, parsed)
    return (None, problems) if problems else (block_class(type=kind, params=parsed), [])


def _type_name(key: str, given: Any, problems: list[str]) -> str | None:
    names = list(_BLOCKS[key][0])
    if given is None:
        problems.append(f"{key}.type is required: one of {', '.join(names)}")
        return None
    by_lower = {name.lower(): name for name in names}
    if key == "optimizer" and isinstance(given, str) and given.lower() in by_lower:
        return by_lower[given.lower()]
    if given in names:
        return given
    close = [by_lower[given.lower()]] if isinstance(given, str) and given.lower() in by_lower else []
    hint = f" (did you mean '{close[0]}'? DeepSpeed matches scheduler names exactly)" if close else ""
    instead = ("pass a torch optimizer to zeroshard.initialize" if key == "optimizer"
               else "build a torch LR scheduler on engine.optimizer and step it yourself")
    problems.append(f"{key}.type {show(given)} is not supported by zeroshard{hint}; use one of "
                    f"{', '.join(names)}, or {instead}")
    return None


def _param_key_problems(key: str, kind: str, params: dict, model: type[BaseModel]) -> list[str]:
    allowed = sorted(model.model_fields)
    problems = []
    for name in params:
        if name in model.model_fields:
            continue
        if name == "max_grad_norm":  # DeepSpeed rejects it too, pointing at gradient_clipping
            hint = " (clipping is the top-level key gradient_clipping)"
        else:
            close = difflib.get_close_matches(name, allowed, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
        problems.append(f"unknown key '{key}.params.{name}'{hint}; parameters of {kind}: {', '.join(allowed)}")
    problems += [f"{key}.params.{name} is required for {kind}" for name, field in model.model_fields.items()
                 if field.is_required() and name not in params]
    return problems


def _with_type_defaults(kind: str, params: dict) -> dict:
    # DeepSpeed with torch_adam builds torch.optim.AdamW from the params as given,
    # so an unset weight_decay takes torch's AdamW default, not FusedAdam's 0.0.
    adamw = kind == "AdamW" or (kind == "Adam" and params.get("adam_w_mode", True) is True)
    if kind in ("Adam", "AdamW") and params.get("torch_adam") is True and adamw and "weight_decay" not in params:
        return {**params, "weight_decay": 1e-2}
    return params


def _combination_problems(key: str, kind: str, params: BaseModel) -> list[str]:
    if kind == "AdamW" and not params.adam_w_mode:
        # DeepSpeed silently runs AdamW here; saying so is better than ignoring the flag.
        return [f"{key}.params.adam_w_mode is false but {key}.type is AdamW, which always decouples "
                "weight decay; use type Adam for Adam with L2 weight decay"]
    if kind == "SGD" and params.nesterov and (params.momentum <= 0 or params.dampening != 0):
        return [f"{key}.params.nesterov needs momentum > 0 and dampening 0; got momentum "
                f"{params.momentum} and dampening {params.dampening}"]
    return []


def build_optimizer(block: OptimizerBlock, over: torch.nn.Module | list, names: dict[int, str] | None = None
                    ) -> torch.optim.Optimizer | list[torch.optim.Optimizer]:
    """The torch optimizer the block describes, over all of a model's parameters in one group, or over
    a list of parameters or param-group dicts (DeepSpeed's model_parameters; a group's keys override).
    Muon: a list of two (`muon_block.py`), split by the parameters' `names`."""
    p = block.params
    parameters = list(over.parameters()) if isinstance(over, torch.nn.Module) else list(over)
    if block.type == "Muon":
        settings = sorted({k for item in parameters if isinstance(item, dict) for k in item if k != "params"})
        if settings:  # the block makes its own two groups: a group's keys would have no group to go to
            raise ConfigError(f"optimizer type Muon splits the parameters into its own Muon and AdamW groups, so "
                              f"model_parameters' group settings ({', '.join(settings)}) have nowhere to go; pass "
                              "model_parameters as parameters, or build the optimizers in code and pass them as a "
                              "list ([torch.optim.Muon(...), torch.optim.AdamW([...groups...])])")
        flat = [q for item in parameters for q in (item["params"] if isinstance(item, dict) else [item])]
        return build_muon(p, flat, names or {})
    if block.type == "SGD":
        return torch.optim.SGD(parameters, lr=p.lr, momentum=p.momentum, dampening=p.dampening,
                               weight_decay=p.weight_decay, nesterov=p.nesterov)
    # DeepSpeed: type AdamW, or type Adam with adam_w_mode true (its default), is AdamW;
    # only Adam with adam_w_mode false is classic (L2) Adam. torch_adam only picks the kernel.
    decoupled = block.type == "AdamW" or p.adam_w_mode
    optimizer_class = torch.optim.AdamW if decoupled else torch.optim.Adam
    return optimizer_class(parameters, lr=p.lr, betas=p.betas, eps=p.eps, weight_decay=p.weight_decay)


def build_scheduler(block: SchedulerBlock, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """The block's schedule on `optimizer`; it sets the first step's lr at once, as DeepSpeed's does."""
    kwargs = block.params.model_dump(exclude={"last_batch_iteration"})
    return _SCHEDULE_CLASSES[block.type](optimizer, **kwargs)


