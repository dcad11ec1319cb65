"""`on_zeroshard(cls)`: any subclass of transformers' `Trainer` or `TrainingArguments`, trained by zeroshard.

TRL's trainers, sentence-transformers', a project's own: they subclass
transformers' `Trainer` and their configs subclass `TrainingArguments`, so
what makes transformers' classes train on zeroshard (`trainer.py`,
`arguments.py`) is mixed in front of the class given, whatever it
overrides (`compute_loss`, `training_step`'s callers, its own `__init__`).
Works as a function or a class decorator; the class keeps its name.
"""

from __future__ import annotations

import functools

import transformers

from zeroshard.config import ConfigError
from zeroshard.hf.arguments import _ConfigKeptAside
from zeroshard.hf.trainer import _ZeroshardTraining


@functools.cache
def on_zeroshard(cls: type) -> type:
    """`cls` (a subclass of transformers' `Trainer` or `TrainingArguments`) with zeroshard mixed in front:
    the trainer trains through zeroshard's engine, the arguments take `deepspeed=` without the `deepspeed`
    package. The same class comes back for the same `cls`; a class already on zeroshard comes back as it is."""
    if not isinstance(cls, type):
        raise ConfigError(f"on_zeroshard takes a class (a Trainer or TrainingArguments subclass); got "
                          f"{type(cls).__name__}: pass the class, not an instance")
    if issubclass(cls, (_ZeroshardTraining, _ConfigKeptAside)):
        return cls
    if issubclass(cls, transformers.Trainer):
        mixin = _ZeroshardTraining
    elif issubclass(cls, transformers.TrainingArguments):
        mixin = _ConfigKeptAside
    else:
        raise ConfigError(f"on_zeroshard({cls.__name__}): {cls.__name__} subclasses neither transformers.Trainer "
                          "nor transformers.TrainingArguments; zeroshard.deepspeed.initialize builds an engine "
                          "for any other training loop")
    namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                 "__doc__": f"{cls.__name__} on zeroshard: `deepspeed=` a DeepSpeed config, trained by zeroshard."}
    if mixin is _ConfigKeptAside:  # transformers pickles the arguments beside each checkpoint
        namespace["__reduce__"] = lambda self: (_unpickled, (cls, self.__dict__))
    return type(cls.__name__, (mixin, cls), namespace)


def _unpickled(cls: type, state: dict):
    """Arguments of `on_zeroshard(cls)`, from their pickled state: pickle finds a class by its name, which is
    `cls`'s, so the made class is rebuilt from `cls` instead."""
    made = on_zeroshard(cls)
    arguments = made.__new__(made)
    arguments.__dict__.update(state)
    return arguments
