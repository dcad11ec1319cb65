"""The optimizer and LR scheduler as another trainer's loop holds them, when `engine.step()` steps them.

A front door (transformers' Trainer, Accelerate) hands the loop the
engine's optimizer and scheduler, and the loop calls their `step()` and
`zero_grad()` after each micro-batch, as it does under DDP. The engine has
already run both at the end of the accumulation window (inside the backward
the front door turned into `engine.backward` + `engine.step()`), so here
they do nothing; every other attribute is the object's own. It imports
nothing of any trainer, so each front door takes it without importing the
others' libraries.
"""

from __future__ import annotations


class SteppedByEngine:
    """A loop's view of the engine's optimizer or LR scheduler: `step()` and `zero_grad()` do nothing, since
    `engine.step()` ran them at the end of the window; everything else is the object's own."""

    def __init__(self, stepped):
        self.stepped = stepped

    def step(self, *args, **kwargs) -> None:
        """Done by `engine.step()` at the accumulation boundary."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The engine clears its gradient buffers itself."""

    def __getattr__(self, name: str):
        return getattr(self.stepped, name)
