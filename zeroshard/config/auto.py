"""Resolving `"auto"` values before a config is validated.

Hugging Face's Trainer fills DeepSpeed's `"auto"` values from its own
arguments. zeroshard fills them from what `zeroshard.initialize` is given,
summarised as `ConfigFacts` (world size, the model's dtype and hidden size,
the optimizer and LR scheduler passed in code). An `"auto"` nothing given
decides is an error naming the dotted key and what to put, never a silent
default; the one exception is a speed-only size (bucket sizes) on a model
without `config.hidden_size`, which takes zeroshard's default and says so.
Every resolution goes to the `LoadReport`, which rank 0 logs.

Plugging in a key: add one entry to `AUTO_RESOLVERS`, dotted key -> function
(raw config dict, facts) -> (value, from what), `(USE_DEFAULT, from what)`,
`DEFER` (only when `facts.deferred`), or raise `AutoError(what to put)`.
"section.params.*" covers every key of that object. The batch keys and the
blocks next to code objects are in batch.py and from_code.py.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

from zeroshard.config.batch import resolve_batch
from zeroshard.config.errors import AutoError
from zeroshard.config.from_code import OptimizerFacts, check_blocks_against_code, optimizer_value
from zeroshard.config.report import LoadReport
from zeroshard.config.values import AUTO
from zeroshard.dtypes import DTYPES, torch_name


@dataclass(frozen=True)
class ConfigFacts:
    """What `initialize` knows when it loads the config; None where it is not known."""

    world_size: int | None = None  # ranks in the data-parallel group
    param_dtype: str | None = None  # the trainable parameters' dtype, torch's name: "float32", "bfloat16", ...
    hidden_size: int | None = None  # the model's config.hidden_size (Hugging Face models), for size autos
    optimizer: OptimizerFacts | None = None  # the optimizer passed in code
    lr_scheduler: str | None = None  # the LR scheduler passed in code, described; None: none passed
    # `zeroshard config check`: no model or code objects exist; autos that need them are reported
    # as left to initialize (and their keys take the default only for the check).
    deferred: bool = False


USE_DEFAULT = object()  # drop the key, so the field's default applies
DEFER = object()  # config check: initialize resolves it
Resolver = Callable[[dict, ConfigFacts], Any]
_IN_CODE = "or pass the optimizer in code to zeroshard.initialize, which fills every optimizer.params \"auto\""


def _clipping(raw: dict, facts: ConfigFacts) -> Any:
    raise AutoError("put the maximum gradient norm, such as 1.0 (Hugging Face's Trainer default, "
                    "--max_grad_norm), or 0 for no clipping")


def _precision_enabled(section: str) -> Resolver:
    """`bf16.enabled` / `fp16.enabled`: whether the model was built in that dtype."""
    def resolve(raw: dict, facts: ConfigFacts) -> Any:
        if facts.param_dtype is None:
            if facts.deferred:
                return DEFER, "from the model's dtype"
            raise AutoError("put true or false (from the model's dtype, which is not known here)")
        return facts.param_dtype == torch_name(DTYPES[section]), f"the model's parameters are {facts.param_dtype}"
    return resolve


def _hidden_rule(name: str, rule: Callable[[int], int]) -> Resolver:
    """A speed-only size: Hugging Face's rule on the model's hidden size, else zeroshard's default."""
    def resolve(raw: dict, facts: ConfigFacts) -> Any:
        if facts.hidden_size is not None:
            return rule(facts.hidden_size), f"{name} with the model's hidden size {facts.hidden_size}"
        if facts.deferred:
            return DEFER, f"{name} with the model's config.hidden_size, else zeroshard's default"
        return USE_DEFAULT, "zeroshard's default (the model has no config.hidden_size)"
    return resolve


def _allgather_bucket(raw: dict, facts: ConfigFacts) -> Any:
    return USE_DEFAULT, "zeroshard's default (a speed-only size)"


def _optimizer_param(raw: dict, facts: ConfigFacts, key: str) -> Any:
    if facts.optimizer is not None:
        return optimizer_value(facts.optimizer, key)
    if facts.deferred:
        return DEFER, "from the optimizer passed in code (an error if none is passed)"
    raise AutoError(f"put a value (Hugging Face's Trainer fills it from its arguments), {_IN_CODE}")


def _scheduler_param(raw: dict, facts: ConfigFacts, key: str) -> Any:
    # With a scheduler passed in code, from_code.py has already taken the block away.
    if key == "warmup_max_lr":
        return None, "null: the optimizer's lr (its first param group), read when the schedule is built"
    if facts.deferred:
        return DEFER, "satisfied by an lr_scheduler passed in code, else an error"
    if key == "total_num_steps":
        raise AutoError("put the number of optimizer steps of the run (Hugging Face's Trainer computes it "
                        "from epochs and data, which zeroshard.initialize does not see), or pass "
                        "lr_scheduler= to zeroshard.initialize")
    raise AutoError("put a value, or pass lr_scheduler= to zeroshard.initialize (a scheduler passed in "
                    "code satisfies a block whose params are all \"auto\")")


AUTO_RESOLVERS: dict[str, Resolver] = {
    "gradient_clipping": _clipping,
    # Hugging Face's rules (transformers' deepspeed integration): h*h, 0.9*h*h, 10*h.
    "zero_optimization.reduce_bucket_size": _hidden_rule("hidden_size^2", lambda h: h * h),
    "zero_optimization.stage3_prefetch_bucket_size": _hidden_rule("0.9 x hidden_size^2", lambda h: int(0.9 * h * h)),
    "zero_optimization.stage3_param_persistence_threshold": _hidden_rule("10 x hidden_size", lambda h: 10 * h),
    "zero_optimization.allgather_bucket_size": _allgather_bucket,
    # Mixed precision follows the dtype the model was built in (Hugging Face: its --bf16/--fp16).
    "bf16.enabled": _precision_enabled("bf16"),
    "fp16.enabled": _precision_enabled("fp16"),
}  # and every key of optimizer.params and scheduler.params: _optimizer_param, _scheduler_param


def resolve_autos(raw: dict, facts: ConfigFacts, report: LoadReport) -> tuple[dict, list[str]]:
    """A copy of `raw` with every "auto" resolved and the batch sizes derived; and the problems."""
    resolved = copy.deepcopy(raw)
    problems = check_blocks_against_code(resolved, facts, report)
    batch_autos = [key for key in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                   "gradient_accumulation_steps") if resolved.get(key) == AUTO]
    for key in batch_autos:
        del resolved[key]  # "auto" is as if the key were left out; resolve_batch derives it
    for path in _auto_paths(resolved):
        dotted = ".".join(path)
        parent = _parent(resolved, path)
        try:
            value, source = _resolve_one(resolved, facts, path)
        except AutoError as error:
            problems.append(f'{dotted} is "auto", which zeroshard cannot work out here; {error}')
            value, source = USE_DEFAULT, None  # reported once, not again as a bad value
        if value is DEFER:
            report.deferred.append((dotted, source))
        elif source is not None:
            report.resolved.append((dotted, "(default)" if value is USE_DEFAULT else value, source))
        if value is USE_DEFAULT or value is DEFER:
            del parent[path[-1]]
        else:
            parent[path[-1]] = value
    problems += resolve_batch(resolved, facts.world_size, batch_autos, report)
    return resolved, problems


def _resolve_one(raw: dict, facts: ConfigFacts, path: tuple[str, ...]) -> tuple[Any, str | None]:
    dotted = ".".join(path)
    if dotted in AUTO_RESOLVERS:
        return AUTO_RESOLVERS[dotted](raw, facts)
    wildcard = ".".join(path[:-1]) + ".*"
    if wildcard == "optimizer.params.*":
        return _optimizer_param(raw, facts, path[-1])
    if wildcard == "scheduler.params.*":
        return _scheduler_param(raw, facts, path[-1])
    raise AutoError("put a value (the keys with an \"auto\" rule are listed in docs/deepspeed-config.md)")


def _auto_paths(raw: dict, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths = []
    for key, value in raw.items():
        if isinstance(value, dict):
            paths += _auto_paths(value, (*prefix, str(key)))
        elif isinstance(value, str) and value == AUTO:
            paths.append((*prefix, str(key)))
    return paths


def _parent(raw: dict, path: tuple[str, ...]) -> dict:
    for key in path[:-1]:
        raw = raw[key]
    return raw
