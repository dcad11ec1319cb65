"""`optimizer.step()` in a loop written for DDP or FSDP2: it runs `engine.step()`.

The optimizer the script built is the one the engine steps, re-pointed at
the masters (their gradients exist only inside the engine's step). Called by
the script, its `step()` would update nothing; a step pre-hook turns that
call into `engine.step()` (which steps every optimizer of a list), after
which the optimizer's own body finds no gradient and changes nothing. Only a
call with a step due is turned: the engine's own (in state STEP), a call
with no backward since the last step, and the copies a delayed update steps
in the background run as they are. Its `zero_grad()` with a step due drops
the gradients of the backwards since the last step, as PyTorch's does (a
GAN's generator loss that reached the discriminator); after the step it
finds nothing to drop.
"""

from __future__ import annotations

import torch

from zeroshard.engine.state import TrainingState


def route_user_step(engine) -> None:
    """Make the script's `engine.optimizer.step()` mean `engine.step()` when a backward ran since the last."""
    optimizer = engine.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):  # an engine that trains nothing
        return
    own = [optimizer, *getattr(optimizer, "optimizers", [])]  # a list of optimizers: each member's step too

    def before_step(stepped: torch.optim.Optimizer, args, kwargs) -> None:
        if any(stepped is o for o in own) and engine.state is TrainingState.STEP_DUE:
            engine.step()

    for o in own:
        o.register_step_pre_hook(before_step)
        o.zero_grad = _zero_grad(engine, o.zero_grad)


def _zero_grad(engine, zero_grad):
    """The optimizer's `zero_grad`, which with a step due also drops the engine's pending gradients."""
    def zero_grad_and_drop(set_to_none: bool = True) -> None:
        if engine.state is TrainingState.STEP_DUE:
            engine._passes.drop()
        zero_grad(set_to_none)
    return zero_grad_and_drop
