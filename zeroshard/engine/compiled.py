"""torch.compile and the engine: a model compiled before `initialize`, and `engine.compile()` (DeepSpeed's).

Both ways end in the same place: `engine.module` is the user's own module
(its parameter names, units and checkpoint keys carry no `_orig_mod.`), and
its forward runs compiled in place, where `nn.Module.compile()` puts it. The
engine calls `engine.module(...)`, so buffers are kept in step and inputs
cast as in eager training. At stage 3 the hooks that gather and release units run
eagerly (`stage3/schedule.py`): the compiled graphs see whole parameters.

`torch.compile(engine.module)` after `initialize` also works when its result
is called directly, but `engine(...)` does not run through it; call
`engine.compile()` instead.
"""

from __future__ import annotations

import sys
from typing import Callable

import torch
import torch.nn as nn

from zeroshard.errors import ModelError


def uncompiled(model: nn.Module) -> tuple[nn.Module, Callable | None]:
    """The module inside `torch.compile(model)` and its call compiled the same way (None for any other module,
    returned as it is).

    The module is left untouched: the engine compiles it in place (`module._compiled_call_impl = call`) only
    once it is built, so an `initialize` that fails can be retried with the same `torch.compile(model)`.
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported yet: nothing was compiled
    if eval_frame is None or not isinstance(model, eval_frame.OptimizedModule):
        return model, None
    inner = model._orig_mod
    if isinstance(inner, eval_frame.OptimizedModule) or inner._compiled_call_impl is not None:
        raise ModelError("the model is compiled twice (torch.compile of a compiled model); compile it once")
    # `dynamo_ctx` holds torch.compile's backend and options; applied to a function it compiles that function.
    context = getattr(model, "dynamo_ctx", None)
    if not callable(context):
        raise ModelError(f"cannot take the module out of torch.compile(model) in torch {torch.__version__}; "
                         "pass the model uncompiled to zeroshard.initialize, then call engine.compile()")
    return inner, context(_traced_call(inner))


def _traced_call(module: nn.Module) -> Callable:
    """`module`'s call, in a frame dynamo traces.

    `nn.Module.compile()` compiles `module._call_impl` itself, a frame of torch.nn
    that dynamo skips: a model whose forward is torch.nn code too (an `nn.Sequential`)
    would run uncompiled. From this frame dynamo inlines the call, hooks and forward.
    """
    def call(*args, **kwargs):
        return module._call_impl(*args, **kwargs)
    return call


class CompiledForward:
    """Whether and how the engine's model runs compiled: DeepSpeed's `engine.compile()` and `is_compiled`."""

    def __init__(self, module: nn.Module, call: Callable | None):
        """`call`: the compiled call of `torch.compile(model)` passed to `initialize` (`uncompiled`), or None;
        set in place now that the engine is built."""
        self.module = module
        if call is not None:
            module._compiled_call_impl = call

    def compile(self, backend: str | Callable = "inductor", compile_kwargs: dict | None = None) -> None:
        """Compile the model's forward with `torch.compile(backend=backend, **compile_kwargs)`, in place.

        As DeepSpeed's `engine.compile()` (>= 0.14): `engine(...)` runs the compiled forward from now
        on. Compiling an engine that is compiled already (here, or by `torch.compile(model)` before
        `initialize`) is an error: the first compilation's options would silently stay.
        """
        if self.active:
            raise ModelError("the engine's model is compiled already (engine.compile() or torch.compile(model) "
                             "before zeroshard.initialize); compile it once")
        self.module._compiled_call_impl = torch.compile(_traced_call(self.module), backend=backend,
                                                        **(compile_kwargs or {}))

    @property
    def active(self) -> bool:
        """Whether the forward runs compiled (here, by `torch.compile` before `initialize`, or by
        `engine.module.compile()`)."""
        return self.module._compiled_call_impl is not None
