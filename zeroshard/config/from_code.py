"""The config's optimizer and scheduler blocks next to an optimizer or LR scheduler passed in code.

DeepSpeed uses the optimizer passed in code and ignores the block; Hugging
Face's Trainer writes its own values into the block's "auto"s. zeroshard
accepts both together only when they agree: the block's type must be the
code optimizer's class, each value that is not "auto" must equal the code
optimizer's (in every param group), and each "auto" takes the code
optimizer's value. A scheduler passed in code satisfies a scheduler block
whose params are all "auto" (the block is then dropped: the code scheduler
is the schedule); a value that is not "auto" next to it is an error, since
zeroshard cannot read it back from an arbitrary scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zeroshard.config.errors import AutoError
from zeroshard.config.report import LoadReport
from zeroshard.config.values import AUTO, show


@dataclass(frozen=True)
class OptimizerFacts:
    """The optimizer passed in code: its class name and each param group's settings (lr, betas, ...)."""

    type_name: str  # "AdamW", "Adam", "SGD", or any other class name
    groups: tuple[dict[str, Any], ...]


def optimizer_facts(type_name: str, param_groups: list[dict]) -> OptimizerFacts:
    """Facts from `optimizer.param_groups` (the "params" lists left out; tuples for lists)."""
    def plain(value: Any) -> Any:
        return tuple(value) if isinstance(value, (list, tuple)) else value
    groups = []
    for g in param_groups:
        group = {k: plain(v) for k, v in g.items() if k not in ("params", "param_names", "initial_lr")}
        # A scheduler built on the optimizer has already set lr to its first value; the lr the
        # optimizer was built with (what the block's lr means) is kept as initial_lr.
        group["lr"] = g.get("initial_lr", g.get("lr"))
        groups.append(group)
    return OptimizerFacts(type_name, tuple(groups))


def _block_class(block: dict) -> str | None:
    """The torch class DeepSpeed builds for an optimizer block: AdamW, Adam or SGD (None if unknown)."""
    kind = block.get("type")
    if not isinstance(kind, str):
        return None
    params = block.get("params") if isinstance(block.get("params"), dict) else {}
    if kind.lower() == "adam":  # DeepSpeed: Adam with adam_w_mode true (the default) is AdamW
        return "Adam" if params.get("adam_w_mode", True) is False else "AdamW"
    return {"adamw": "AdamW", "sgd": "SGD"}.get(kind.lower())


def optimizer_value(facts: OptimizerFacts, key: str) -> tuple[Any, str]:
    """The code optimizer's value for `optimizer.params.<key>` = "auto", and where it comes from."""
    source = f"the optimizer passed in code ({facts.type_name})"
    if key == "adam_w_mode":
        return facts.type_name == "AdamW", source
    if key == "torch_adam":
        return False, f"{source}; zeroshard always runs torch's"
    values = [g[key] for g in facts.groups if key in g]
    if not values:
        raise AutoError(f"the optimizer passed in code ({facts.type_name}) has no setting '{key}'; "
                        "remove the key or put a value")
    value = list(values[0]) if isinstance(values[0], tuple) else values[0]
    if any(v != values[0] for v in values):
        return value, f"{source}, param group 0; its param groups differ, and each keeps its own"
    return value, source


def check_blocks_against_code(raw: dict, facts: Any, report: LoadReport) -> list[str]:
    """Check the blocks in `raw` against the code optimizer and scheduler in `facts`; problems.

    Drops a scheduler block that a code scheduler satisfies (in place).
    """
    problems: list[str] = []
    block = raw.get("optimizer")
    if facts.optimizer is not None and isinstance(block, dict):
        problems += _optimizer_problems(block, facts.optimizer)
    block = raw.get("scheduler")
    params = block.get("params") if isinstance(block, dict) and isinstance(block.get("params"), dict) else {}
    if facts.deferred and facts.lr_scheduler is None and any(
            v == AUTO for k, v in params.items() if k != "warmup_max_lr"):
        del raw["scheduler"]  # config check: whether a code scheduler satisfies it is known only at initialize
        report.deferred.append(("scheduler", "a block with \"auto\" params: satisfied by an lr_scheduler passed "
                                "in code, else each \"auto\" but warmup_max_lr is an error"))
    elif facts.lr_scheduler is not None and isinstance(block, dict):
        set_here = {k: v for k, v in params.items() if v != AUTO}
        problems += [f"scheduler.params.{k} is {show(v)} but an lr_scheduler ({facts.lr_scheduler}) is passed in code, "
                     "which decides the schedule; write \"auto\" there, or remove the scheduler block"
                     for k, v in set_here.items()]
        if not set_here:
            del raw["scheduler"]
            report.resolved.append(("scheduler", f"{block.get('type')} with params \"auto\"",
                                    f"satisfied by the lr_scheduler passed in code ({facts.lr_scheduler})"))
    return problems


def _optimizer_problems(block: dict, facts: OptimizerFacts) -> list[str]:
    kind = _block_class(block)
    if kind is None:
        return []  # an unknown type: the block's own check reports it
    if kind != facts.type_name:
        return [f"optimizer.type {block.get('type')!r} builds torch.optim.{kind}, but the optimizer passed in "
                f"code is {facts.type_name}; make them agree, or remove the optimizer block"]
    problems = []
    params = block.get("params") if isinstance(block.get("params"), dict) else {}
    for key, value in params.items():
        if value == AUTO or key in ("adam_w_mode", "torch_adam"):
            continue
        given = tuple(value) if isinstance(value, list) else value
        differ = [i for i, g in enumerate(facts.groups) if key in g and g[key] != given]
        if differ:
            code = facts.groups[differ[0]][key]
            problems.append(f"optimizer.params.{key} is {show(value)} but the optimizer passed in code has {show(code)} "
                            f"(param group {differ[0]}); make them agree, or write \"auto\" to take the code's")
    return problems
