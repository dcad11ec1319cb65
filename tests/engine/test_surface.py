"""The Engine's public surface: docs/engine.md lists exactly its public names, each documented; no mixin base
and no mutable state on the class; DeepSpeed's methods live on its subclass `DeepSpeedEngine` only."""

import inspect
import re
from pathlib import Path

import zeroshard
from zeroshard.deepspeed import DeepSpeedEngine
from zeroshard.engine import Engine

PAGE = Path(__file__).resolve().parents[2] / "docs" / "engine.md"
ROW = re.compile(r"^\| `(\w+)` \| ")


def documented() -> list[str]:
    """The names of docs/engine.md's table of methods and properties, in order."""
    text = PAGE.read_text(encoding="utf-8")
    section = text.split("## Methods and properties", 1)[1].split("\n## ", 1)[0]
    return [m.group(1) for line in section.splitlines() if (m := ROW.match(line))]


def public_names(cls: type) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")}


def test_the_documented_names_are_the_public_names():
    names = documented()
    assert len(names) == len(set(names)), "a name is listed twice"
    assert len(names) >= 20  # the table was found
    assert set(names) == public_names(Engine), (sorted(set(names) - public_names(Engine)),
                                                sorted(public_names(Engine) - set(names)))


def test_every_public_name_has_a_docstring():
    missing = [n for n in sorted(public_names(Engine)) if not getattr(Engine, n).__doc__]
    assert not missing, f"public names of Engine without a docstring: {missing}"
    ds_missing = [n for n in sorted(public_names(DeepSpeedEngine) - public_names(Engine))
                  if not getattr(DeepSpeedEngine, n).__doc__]
    assert not ds_missing, f"DeepSpeedEngine's names without a docstring: {ds_missing}"


def test_no_mixin_base_and_no_mutable_class_state():
    assert Engine.__bases__ == (object,)
    assert zeroshard.Engine is Engine
    allowed = (property, staticmethod, classmethod)
    state = {name: type(value).__name__ for name, value in vars(Engine).items()
             if not name.startswith("__") and not inspect.isfunction(value) and not isinstance(value, allowed)}
    assert not state, f"class attributes of Engine that are not methods or properties (state): {state}"


def test_deepspeed_engine_is_an_engine_with_deepspeeds_methods():
    assert issubclass(DeepSpeedEngine, Engine)
    deepspeeds = {"get_lr", "get_mom", "train_batch_size", "train_micro_batch_size_per_gpu",
                  "gradient_accumulation_steps", "zero_optimization_stage", "fp16_enabled", "bfloat16_enabled",
                  "was_step_applied", "global_rank", "local_rank", "world_size", "forward", "zero_grad",
                  "save_16bit_model", "get_global_grad_norm", "global_samples", "set_train_batch_size"}
    assert deepspeeds <= public_names(DeepSpeedEngine)
    assert not deepspeeds & public_names(Engine), sorted(deepspeeds & public_names(Engine))
