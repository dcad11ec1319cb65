"""Ψ and the largest stage-3 unit of a model, counted on the model itself, built on the meta device.

`zeroshard estimate --model` takes a demo preset, a `transformers` model type
("llama": that type's default config), a config.json file, or a directory
written by `save_pretrained`. The model is instantiated under
`torch.device("meta")`: nothing is allocated and nothing is downloaded, so any
architecture the installed transformers knows is counted exactly. Ψ is every
parameter once (tied weights once, as `model.parameters()` yields them). The
largest unit is what stage 3 would gather at once: the engine's own rule,
`zeroshard.stage3.wrapping` (`unit_modules`, then `plan_units`), with the
config's `stage3_wrap_classes` and `stage3_auto_wrap_min_params`.

The flat buffers stage 3 would build from that plan (`plan_flats`, the
split of `stage3.unit.build_units`) let the estimator count stage 3's
collectives exactly; `stage3_flats` reads the same list off an engine's
built units, so a test can hold the measured `comm_stats()` against it.
`flat_shapes` gives each trained flat buffer's param group and tensor
shapes, at stages 1-2 or 3, for param groups the caller chooses (an
optimizer mix's: `optimizer_mix.py` prices tensors owned whole by shape).

On a pp x dp x tp mesh (`count_parts`, `part_numels`) the built-in GPT is
split as training splits it: `GPTStage` per pp rank, then `gpt_tp_plan`'s
rule applied by module name (`tp_split_dims`), each tensor's local size by
DTensor's chunk rule, without a process group or `parallelize_module`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from zeroshard.app.demo.config import DEMO_CONFIG
from zeroshard.app.models import GPT, PRESETS, GPTConfig, GPTStage
from zeroshard.config.schema import ZeroConfig
from zeroshard.core.bucketing import bucket_params
from zeroshard.estimate import FROZEN, PERSISTENT, SHARDED, Flat
from zeroshard.estimate.parallel import tp_shard_numel
from zeroshard.stage3.wrapping import UnitPlan, flat_parts, plan_units, unit_modules

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

# The engine's defaults, where the caller gives no wrapping rule.
AUTO_WRAP_MIN_PARAMS: int = ZeroConfig.model_fields["stage3_auto_wrap_min_params"].default
DEMO_WRAP: tuple[str, ...] = tuple(DEMO_CONFIG["zero_optimization"]["stage3_wrap_classes"])
PERSISTENCE_THRESHOLD: int = ZeroConfig.model_fields["stage3_param_persistence_threshold"].default
DEMO_PERSISTENCE_THRESHOLD: int = DEMO_CONFIG["zero_optimization"]["stage3_param_persistence_threshold"]
REDUCE_BUCKET_SIZE: int = min(ZeroConfig.model_fields["reduce_bucket_size"].default,
                              ZeroConfig.model_fields["allgather_bucket_size"].default)
DEMO_BUCKET_SIZE: int = min(DEMO_CONFIG["zero_optimization"]["reduce_bucket_size"],
                            DEMO_CONFIG["zero_optimization"]["allgather_bucket_size"])


@dataclass(frozen=True)
class ParamCount:
    """Ψ and the largest unit, in elements (parameters), of a named model."""

    name: str
    numel: int  # Ψ: every parameter once (tied weights count once)
    largest_unit: int  # elements of the largest stage-3 unit
    flats: tuple[Flat, ...] = ()  # stage 3's flat buffers under the same plan (`plan_flats`)
    buckets: tuple[int, ...] = ()  # stages 0-2's gradient buckets, elements each (`bucket_numels`)
    units: tuple[tuple[Flat, ...], ...] = ()  # `flats` by unit, in forward order, the root first
    largest_param: int = 0  # elements of the largest parameter


def count_module(name: str, model: torch.nn.Module, wrap: tuple[str, ...] = (),
                 min_numel: int = AUTO_WRAP_MIN_PARAMS,
                 persistence_threshold: int = PERSISTENCE_THRESHOLD,
                 bucket_size: int = REDUCE_BUCKET_SIZE) -> ParamCount:
    """Ψ of `model`, its largest unit and its flat buffers under stage 3's rule (`wrap`: class names;
    empty: by size), and its gradient buckets at stages 0-2 of at most `bucket_size` elements."""
    plans = plan_units(model, unit_modules(model, wrap, min_numel))
    largest = max((sum(p.numel() for p in plan.params) for plan in plans), default=0)
    units = tuple(tuple(plan_flats([plan], persistence_threshold)) for plan in plans)
    return ParamCount(name, sum(p.numel() for p in model.parameters()), largest,
                      tuple(f for unit in units for f in unit), tuple(bucket_numels(model, bucket_size)), units,
                      max((p.numel() for p in model.parameters()), default=0))


def bucket_numels(model: torch.nn.Module, bucket_size: int) -> list[int]:
    """Elements of each gradient bucket the engine builds at stages 0-2 (`bucket_params`, its own rule, with
    `bucket_size` = min(reduce_bucket_size, allgather_bucket_size)), with one param group as `plan_flats`."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [plan.numel for plan in bucket_params(model, [trainable], bucket_size)]


def plan_flats(plans: list[UnitPlan], persistence_threshold: int = PERSISTENCE_THRESHOLD) -> list[Flat]:
    """The flat buffers `build_units` makes of these plans (`flat_parts`, its own split), with one param
    group: every parameter that requires grad."""
    flats = []
    for plan in plans:
        group_of = {id(p): 0 for p in plan.params if p.requires_grad}
        for g, persistent, params in flat_parts(plan.params, group_of, 1, persistence_threshold):
            kind = FROZEN if g is None else PERSISTENT if persistent else SHARDED
            flats.append(Flat(sum(p.numel() for p in params), kind))
    return flats


def stage3_flats(units: Iterable) -> list[Flat]:
    """The flat buffers of an engine's stage-3 units (`zeroshard.stage3.unit.Unit`: `buckets`, whose
    `switches.shard_params` is False for persistent ones, and `frozen` flats), for the estimator."""
    return [Flat(b.flat.numel, SHARDED if b.switches.shard_params else PERSISTENT)
            for unit in units for b in unit.buckets] + [Flat(f.numel, FROZEN) for unit in units for f in unit.frozen]


def count_model(name: str, wrap: tuple[str, ...] | None = None, min_numel: int = AUTO_WRAP_MIN_PARAMS,
                persistence_threshold: int | None = None, bucket_size: int | None = None) -> ParamCount:
    """Count a preset, a transformers model type, a config.json or a save_pretrained directory.

    `wrap` None: the demo's wrap classes for a preset, the size rule for
    another model; `persistence_threshold` None: the demo's for a preset
    (0: nothing persistent), the engine's default for another model; `bucket_size` None: likewise, the
    demo's reduce_bucket_size or the engine's. Raises ValueError naming the cause when `name` is none of
    these or its config cannot be built.
    """
    built = build_model(name, wrap, min_numel, persistence_threshold, bucket_size)
    return count_module(built.name, built.model, built.wrap, built.min_numel, built.persistence_threshold,
                        built.bucket_size)


@dataclass(frozen=True)
class BuiltModel:
    """A model on the meta device and the engine settings its plan takes (the defaults `count_model` gives)."""

    name: str
    model: torch.nn.Module
    wrap: tuple[str, ...]
    min_numel: int
    persistence_threshold: int
    bucket_size: int


def build_model(name: str, wrap: tuple[str, ...] | None = None, min_numel: int = AUTO_WRAP_MIN_PARAMS,
                persistence_threshold: int | None = None, bucket_size: int | None = None) -> BuiltModel:
    """The model `name` names on the meta device, with the defaults `count_model` documents filled in."""
    if name in PRESETS:
        with torch.device("meta"):
            model = GPT(PRESETS[name])
        return BuiltModel(name, model, DEMO_WRAP if wrap is None else wrap, min_numel,
                          DEMO_PERSISTENCE_THRESHOLD if persistence_threshold is None else persistence_threshold,
                          DEMO_BUCKET_SIZE if bucket_size is None else bucket_size)
    model = build_hf_model(name)
    return BuiltModel(f"{type(model).__name__} ({name})", model, wrap or (), min_numel,
                      PERSISTENCE_THRESHOLD if persistence_threshold is None else persistence_threshold,
                      REDUCE_BUCKET_SIZE if bucket_size is None else bucket_size)


def flat_shapes(built: BuiltModel, groups: list[list[torch.nn.Parameter]], stage: int
                ) -> list[tuple[int, list[tuple[str, tuple[int, ...]]]]]:
    """(param group, (name, shape) of each tensor in the buffer's order) of every trained flat buffer the
    engine builds at `stage` with these param groups, in build order: `bucket_params`' buckets at stages
    1-2, each unit's `flat_parts` at stage 3 (persistent ones included: their optimizer state is sharded
    as a stage-2 bucket's)."""
    names = {id(p): n for n, p in built.model.named_parameters()}
    described = lambda params: [(names[id(p)], tuple(p.shape)) for p in params]
    if stage < 3:
        return [(b.group, described(b.params)) for b in bucket_params(built.model, groups, built.bucket_size)]
    group_of = {id(p): g for g, params in enumerate(groups) for p in params if p.requires_grad}
    flats = []
    for plan in plan_units(built.model, unit_modules(built.model, built.wrap, built.min_numel)):
        for g, _, params in flat_parts(plan.params, group_of, len(groups), built.persistence_threshold):
            if g is not None:  # frozen flats: no optimizer state
                flats.append((g, described(params)))
    return flats


def count_parts(model: str | GPTConfig, pp: int = 1, tp: int = 1, wrap: tuple[str, ...] | None = None,
                min_numel: int = AUTO_WRAP_MIN_PARAMS) -> dict[tuple[int, int], ParamCount]:
    """Each part (pp_rank, tp_rank) of the built-in GPT on a mesh: its trained local elements and its
    largest stage-3 unit in local elements (`wrap` None: the demo's wrap classes).

    `model`: a preset name or a `GPTConfig`. Raises ValueError when the GPT
    does not split so: pp over its blocks, tp over its heads.
    """
    if isinstance(model, str) and model not in PRESETS:
        raise ValueError(f"'{model}' is not a preset ({', '.join(sorted(PRESETS))}); give one, or a GPTConfig")
    cfg = PRESETS[model] if isinstance(model, str) else model
    name = model if isinstance(model, str) else "GPT"
    if cfg.n_head % tp:
        raise ValueError(f"tp={tp} does not divide the {cfg.n_head} heads of {name}: each tp rank computes "
                         "whole heads; give a tp that divides n_head")
    wrap = DEMO_WRAP if wrap is None else wrap
    parts = {}
    for p in range(pp):
        with torch.device("meta"):
            stage = GPTStage(GPT(cfg), p, pp)  # stage_layers' ValueError for pp > n_layer
        dims = tp_split_dims(stage, _tp_plan(stage)) if tp > 1 else {}  # tp 1: nothing split
        plans = plan_units(stage, unit_modules(stage, wrap, min_numel))
        for t in range(tp):
            local = {id(param): local_numel(param.shape, dims.get(n), tp, t)
                     for n, param in stage.named_parameters() if param.requires_grad}
            largest = max((sum(local.get(id(q), 0) for q in plan.params) for plan in plans), default=0)
            parts[p, t] = ParamCount(f"{name} pp{p}-tp{t}", sum(local.values()), largest)
    return parts


def part_numels(model: str | GPTConfig, pp: int = 1, tp: int = 1) -> dict[tuple[int, int], int]:
    """(pp_rank, tp_rank) -> the trained local elements of that part of the built-in GPT: the sum of
    local numel over the parameters an engine of that part flattens (a tied head copy included)."""
    return {key: counted.numel for key, counted in count_parts(model, pp, tp).items()}


def _tp_plan(stage: GPTStage) -> dict:
    from zeroshard.parallel.plans import gpt_tp_plan  # torch.distributed.tensor: imported when tp > 1

    return gpt_tp_plan(stage)


def tp_split_dims(model: torch.nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, int]:
    """Parameter name -> the dimension a tensor-parallel plan splits (absent: replicated), by DTensor's
    styles: ColwiseParallel splits a Linear's weight and bias by output features, RowwiseParallel its
    weight by input features (the bias stays whole); on an Embedding the other way round."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    modules = dict(model.named_modules())
    dims = {}
    for module_name, style in plan.items():
        module = modules[module_name]
        if not isinstance(style, (ColwiseParallel, RowwiseParallel)) or \
                not isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            raise ValueError(f"{module_name}: only ColwiseParallel and RowwiseParallel on Linear or Embedding "
                             f"are counted; got {type(style).__name__} on {type(module).__name__}")
        colwise = isinstance(style, ColwiseParallel)
        linear = isinstance(module, torch.nn.Linear)
        dims[f"{module_name}.weight"] = 0 if colwise == linear else 1
        if colwise and linear and module.bias is not None:
            dims[f"{module_name}.bias"] = 0
    return dims


def local_numel(shape: torch.Size, dim: int | None, tp: int, tp_rank: int) -> int:
    """Elements tp rank `tp_rank` holds of a tensor of `shape` split along `dim` (None: whole)."""
    numel = shape.numel()
    if dim is None or numel == 0:
        return numel
    return numel // shape[dim] * tp_shard_numel(shape[dim], tp, tp_rank)


def build_hf_model(name: str, device: str = "meta") -> torch.nn.Module:
    """The transformers model `name` describes, on `device` (default meta; see `hf_config` and `model_class`)."""
    config = hf_config(name)
    cls = model_class(config)
    with torch.device(device):
        return cls.from_config(config) if cls.__name__.startswith("Auto") else cls(config)


def hf_config(name: str):
    """The `PretrainedConfig` of a config.json file, a save_pretrained directory or a model type name."""
    transformers = _transformers()
    path = Path(name)
    try:
        if path.is_dir():
            return transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        if path.is_file():
            values = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(values, dict) or "model_type" not in values:
                raise ValueError(f"'{path}' holds no \"model_type\": it is not a Hugging Face config.json")
            return transformers.AutoConfig.for_model(values.pop("model_type"), **values)
        known = transformers.CONFIG_MAPPING  # model types this transformers knows
        if name in known:
            return transformers.AutoConfig.for_model(name)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError, TypeError) as error:
        raise ValueError(f"cannot read '{name}' as a Hugging Face config ({str(error).splitlines()[0]})") from None
    raise ValueError(f"'{name}' is neither a preset ({', '.join(sorted(PRESETS))}), a config.json file or "
                     "save_pretrained directory, nor a model type of the installed transformers (such as "
                     "gpt2, bert, llama); give one of those, or the count itself with --params")


def model_class(config):
    """The class the config names in `architectures`; else, by its type: the sequence-to-sequence LM
    (t5), the masked LM (bert), the causal LM (gpt2, llama), or the base model, the first that exists."""
    transformers = _transformers()
    for architecture in config.architectures or ():
        cls = getattr(transformers, architecture, None)
        if cls is not None:
            return cls
    for mapping, auto in (("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING", "AutoModelForSeq2SeqLM"),
                          ("MODEL_FOR_MASKED_LM_MAPPING", "AutoModelForMaskedLM"),
                          ("MODEL_FOR_CAUSAL_LM_MAPPING", "AutoModelForCausalLM")):
        if type(config) in getattr(transformers, mapping):
            return getattr(transformers, auto)
    return transformers.AutoModel


def _transformers():
    try:
        import transformers  # only here: the rest of zeroshard runs without it
    except ImportError:
        raise ValueError("counting a Hugging Face model needs transformers: pip install 'zeroshard[hf]'") from None
    return transformers
