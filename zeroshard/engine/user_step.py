"""`optimizer.step()` in a loop written for DDP or FSDP2: it runs `engine.step()`.

The optimizer the script built is the one the engine steps, re-pointed at
the masters (their gradients exist only inside the engine's step). Called by
the script, its `step()` would update nothing; a step pre-hook turns that
call into `engine.step()`, after which the optimizer's own body finds no
gradient and changes nothing. The engine's own call (in state STEP) and the
copies a delayed update steps in the background are left alone.
"""

from __future__ import annotations

import torch

from zeroshard.engine.state import TrainingState


def route_user_step(engine) -> None:
    """Make the script's `engine.optimizer.step()` mean `engine.step()` (between a backward and the step)."""
    optimizer = engine.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):  # an engine that trains nothing
        return

    def before_step(stepped: torch.optim.Optimizer, args, kwargs) -> None:
        if stepped is optimizer and engine.state is not TrainingState.STEP:
            engine.step()

    optimizer.register_step_pre_hook(before_step)
