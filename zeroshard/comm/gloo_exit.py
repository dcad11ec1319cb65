"""At exit, gloo's worker threads get the GIL to drop their last works (see `_let_gloo_workers_finish`)."""

from __future__ import annotations

import atexit
import time

_GLOO_EXIT_DRAIN_S = 0.05  # how long the main thread lets go of the GIL at exit, for gloo's worker threads
_gloo_exit_drain_registered = False


def _let_gloo_workers_finish() -> None:
    """At exit, before the interpreter finalizes: give gloo's worker threads the GIL to drop their last works.

    A gloo worker thread (`ProcessGroupGloo::runLoop`) destroys each work it ran, and with it the work's
    tensors; when the Python side has already dropped its handle (any `async_op=False` collective, such as
    `generate(synced_gpus=True)`'s all_reduce), that destruction releases the tensors' Python objects and
    takes the GIL on the worker thread. If the script ends just after its last collective, the worker
    waits for the GIL while the main thread goes on into interpreter finalization; CPython (3.11) then
    ends the worker with pthread_exit inside `~AsyncWork`, a noexcept destructor, and the process aborts
    with "terminate called without an active exception" (exit code -6, no Python frame). Destroying the
    group would join the workers, but the engine's comms keep a reference to it, so
    `dist.destroy_process_group()` alone does not. Sleeping releases the GIL: a worker waiting for it
    takes it, drops its work, and goes back to waiting for work, before finalization starts.
    """
    time.sleep(_GLOO_EXIT_DRAIN_S)


def drain_gloo_at_exit() -> None:
    """Register `_let_gloo_workers_finish` once per process (a comm over a gloo group calls it)."""
    global _gloo_exit_drain_registered
    if not _gloo_exit_drain_registered:
        _gloo_exit_drain_registered = True
        atexit.register(_let_gloo_workers_finish)
