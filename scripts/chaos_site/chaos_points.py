"""Where a chaos run kills a rank: SIGKILL at the n-th call of one point of the training step or a save.

Points: "forward" (a transformer block's forward: mid-forward, between stage 3's gathers), "backward"
(a parameter's gradient handed to the engine: mid-backward, reductions in flight), "step" (the optimizer
update, after the gradient-norm agreement, before the all-gather), "save" (a synchronous save's rank file,
after its first tensor), "commit" (rank 0, every rank file and the manifest written, before the tag is
renamed into place and made 'latest'), "async_save" (an asynchronous save's background write, half a
second in, while training goes on). Each kill is logged (one JSON line) before it happens.
"""

from __future__ import annotations

import json
import os
import signal
import time


def install(kill: dict, log: str) -> None:
    calls = [0]

    def due() -> bool:
        calls[0] += 1
        return calls[0] == kill["after"]

    def die() -> None:
        with open(log, "a") as f:
            f.write(json.dumps(kill) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)

    def wrap(owner, name: str, action=None) -> None:
        """`owner.name` that, at its due call, runs `action(args)` (which dies) or dies at once."""
        real = getattr(owner, name)

        def wrapped(*args, **kwargs):
            if due():
                action(args) if action else die()
            return real(*args, **kwargs)

        setattr(owner, name, wrapped)

    point = kill["point"]
    if point == "forward":
        from zeroshard.app.models.gpt import Block
        wrap(Block, "forward")
    elif point == "backward":
        from zeroshard.engine.engine import Engine
        wrap(Engine, "_on_grad")
    elif point == "step":
        from zeroshard.engine.engine import Engine
        wrap(Engine, "_update")
    elif point == "save":
        from zeroshard.checkpoint import saving

        def fetch_then_die(args):  # write the first tensor, die when the second is asked for
            path, layout, fetch, metadata = args
            seen = []

            def dying_fetch(key):
                if seen:
                    die()
                seen.append(key)
                return fetch(key)

            real_streamed(path, layout, dying_fetch, metadata)

        real_streamed = saving.write_streamed
        wrap(saving, "write_streamed", fetch_then_die)
    elif point == "commit":
        from zeroshard.checkpoint import saving
        wrap(saving, "commit")
    elif point == "async_save":
        from zeroshard.checkpoint import async_save

        def sleep_then_die(args):
            time.sleep(0.5)
            die()

        wrap(async_save, "write_tensors", sleep_then_die)
    else:
        raise ValueError(f"unknown chaos point '{point}'")
