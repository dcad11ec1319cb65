"""`optimizer.step()` in a loop written for DDP or FSDP2: it runs `engine.step()`.

The optimizer the script built is the one the engine steps, re-pointed at
the masters (their gradients exist only inside the engine's step). Called by
the script, its `step()` would update nothing; a step pre-hook turns that
call into `engine.step()`, after which the optimizer's own body finds no
gradient and changes nothing. Only a call with a step due is turned: the
engine's own (in state STEP), a call with no backward since the last step,
and the copies a delayed update steps in the background run as they are.
"""

from __future__ import annotations

import torch

from zeroshard.engine.state import TrainingState


def route_user_step(engine) -> None:
    """Make the script's `engine.optimizer.step()` mean `engine.step()` when a backward ran since the last."""
    optimizer = engine.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):  # an engine that trains nothing
        return

    def before_step(stepped: torch.optim.Optimizer, args, kwargs) -> None:
        if stepped is optimizer and engine.state is TrainingState.STEP_DUE:
            engine.step()

    optimizer.register_step_pre_hook(before_step)
