"""The root of zeroshard's documented errors: `except zeroshard.ZeroshardError` catches each of them.

A leaf module, so that every layer (the config at the bottom too) can derive from it.
"""


class ZeroshardError(Exception):
    """An error zeroshard raises on purpose; its message names the cause and the fix."""


class ModelError(ZeroshardError, ValueError):
    """A model that zeroshard cannot train as given (devices, dtypes, shared storage, meta device, units)."""


class OutOfMemoryError(ZeroshardError, MemoryError):
    """The model states cannot fit in the memory a node's ranks have (checked before any is made)."""


class StatesOffloadedError(ZeroshardError, RuntimeError):
    """A use of model states that `engine.offload_states()` moved off the device, before
    `engine.reload_states()` brought them back."""
