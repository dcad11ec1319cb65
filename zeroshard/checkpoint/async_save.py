"""An asynchronous save: the rank's state staged to host memory at the save's step, written in the background.

`engine.save_checkpoint(..., asynchronous=True)` (or config
`checkpoint.async_save`) runs `begin` as a synchronous save does (every
check, rank 0's state.pt and manifest of this step, the partial directory),
then copies every tensor of the rank's file into new host memory (CPU
tensors too: a training step changes them in place, so only a copy is a
snapshot of the step) and returns. A thread per rank writes the copies to
the rank file while training goes on, at the lowest CPU priority so that it
takes the time the steps leave idle, not theirs; the copies are freed once
written.

Publishing needs every rank (rank 0 renames the tag into place only once
every rank's file is complete), so it happens at a step boundary, where the
ranks meet anyway: `poll` (the engine calls it at the end of each optimizer
step while a save is in flight) gathers each rank's outcome, one small
object per rank; once every rank's file is written, rank 0 checks it sees
them all (sizes), writes state.pt and the manifest, and points `latest` at
the tag; until then the previous checkpoint stays `latest`. A rank whose
write failed (a full disk) makes every rank raise the same
`CheckpointError` at that boundary, naming the rank and the cause; the
previous checkpoints are left as they were. `wait` blocks until this
rank's write is done and publishes (a second save, a load, the end of the
run): the process does not end with a save neither landed nor failed
(the writer thread is not a daemon; a save never published is logged as
an error at exit).

With offload to disk (nvme) an asynchronous save is refused: it would stage
the whole disk tier in host memory, which is what that tier is there to
avoid; the synchronous save streams it a sub-group at a time.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import sys
import threading
from contextlib import closing
from pathlib import Path

import torch

from zeroshard.checkpoint.checks import as_error
from zeroshard.checkpoint.files import CheckpointError, rank_file
from zeroshard.checkpoint.protocol import Checkpointable
from zeroshard.checkpoint.saving import Began, attempt, begin, publish, windows_of
from zeroshard.checkpoint.turns import Turns
from zeroshard.checkpoint.writer import write_tensors
from zeroshard.comm import Comm
from zeroshard.comm.agreement import agree, as_said, barrier

log = logging.getLogger(__name__)


def save_async(trainer: Checkpointable, save_dir: str | Path, tag: str | int | float | None = None,
               client_state: dict | None = None, save_latest: bool = True,
               exclude_frozen_parameters: bool = False) -> "AsyncSave":
    """Begin a save of the trainer's state at this step and return once it is staged in host memory; the
    rank file is written by a background thread and the tag published at a later step boundary (`poll`).
    `exclude_frozen_parameters`: as `saving.save`'s."""
    _check_tiers(trainer)
    began = begin(trainer, save_dir, tag, client_state, exclude_frozen_parameters)
    staged: dict[str, torch.Tensor] = {}
    metadata: dict[str, str] = {}

    def stage() -> None:
        windows, runs = windows_of(trainer, began.held, began.surveyed)
        metadata.update(began.metadata(runs))
        with closing(Turns(trainer)) as turns:
            for key in sorted(windows, key=lambda k: (windows[k].turn, k)):
                if windows[key].turn >= 0:
                    turns.reach(windows[key].turn)
                staged[key] = _host_copy(windows[key].get())

    agree(trainer.comm, as_error(attempt(stage, "cannot stage its shard in host memory")))
    return AsyncSave(trainer.comm, began, staged, metadata, save_latest)


def _check_tiers(trainer: Checkpointable) -> None:
    zero = trainer.config.zero_optimization
    if "nvme" in (zero.offload_optimizer.device, zero.offload_param.device):
        raise CheckpointError("an asynchronous save stages the rank's whole state in host memory, and with offload "
                              "device \"nvme\" that state is on disk because it does not fit there: save "
                              "synchronously (asynchronous=False, config checkpoint.async_save false), which "
                              "streams the disk tier a sub-group at a time; nothing was written")


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` in host memory, its own storage (a CPU tensor is copied too: it changes in place)."""
    copy = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=tensor.is_cuda)
    copy.copy_(tensor.detach())  # from a GPU: a synchronous copy, so the snapshot is whole on return
    return copy


def _yield_to_training() -> None:
    """Give this thread (and the checksum thread it starts, which inherits it) the lowest CPU priority.

    Serializing, checksumming and copying into the page cache are CPU work: at the default priority the
    writer takes its share of cores the ranks' compute threads need, and the steps it overlaps slow down
    by about the write's own time. At nice 19 it runs on what the ranks leave idle (waits in collectives,
    the host while a GPU computes), so the write takes longer where every core is busy but the steps do
    not. Linux keeps a nice value per thread; elsewhere the call may apply to the process, so it is made
    only where it is per thread.
    """
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError as exc:  # a sandbox may refuse it: the write still lands, at the default priority
            log.info("the checkpoint writer keeps the default CPU priority (%s)", exc)


class AsyncSave:
    """One asynchronous save in flight, from its staged copies to its published tag."""

    def __init__(self, comm: Comm, began: Began, staged: dict[str, torch.Tensor], metadata: dict[str, str],
                 save_latest: bool):
        self._comm, self._began, self._save_latest = comm, began, save_latest
        self._entries: dict[str, dict] | None = None  # this rank's manifest entry, once written
        self._error: str | None = None  # why this rank's write failed
        # Not a daemon: an interpreter that exits still lets the write land.
        self._thread = threading.Thread(target=self._write, args=(staged, metadata), daemon=False,
                                        name=f"zeroshard checkpoint writer ({began.tag})")
        self._thread.start()
        atexit.register(self._unpublished_at_exit)  # non-daemon threads are joined before atexit handlers run

    @property
    def path(self) -> Path:
        """The tag's directory once published."""
        return self._began.save_dir / self._began.tag

    def _write(self, staged: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
        name = rank_file(self._comm.rank)
        _yield_to_training()
        try:
            self._entries = {name: write_tensors(self._began.partial / name, staged, metadata)}
        except Exception as exc:  # reported on every rank at the next step boundary (`poll`)
            self._error = f"cannot write its shard to {self._began.partial} ({type(exc).__name__}: {exc})"
        finally:
            staged.clear()  # the host copies go as soon as they are written

    def written(self) -> bool:
        """Whether this rank's write has ended (written or failed); no collective."""
        return not self._thread.is_alive()

    def poll(self) -> Path | None:
        """At a step boundary, on every rank: the tag's path once every rank's file is written and the tag is
        published; None while some rank is still writing. Raises `CheckpointError` on every rank if any
        rank's write failed (the save is abandoned, the earlier checkpoints intact)."""
        done = self.written()
        try:
            outcomes = agree(self._comm, self._failure(), value=(done, self._entries if done else None), word=as_said)
        except CheckpointError:
            atexit.unregister(self._unpublished_at_exit)
            self._abandon()
            raise
        if not all(done for done, _ in outcomes):
            return None
        atexit.unregister(self._unpublished_at_exit)
        return publish(self._comm, self._began, [entries for _, entries in outcomes], self._save_latest)

    def _failure(self) -> CheckpointError | None:
        """This rank's failed write as the error every rank raises, or None."""
        if self._error is None:
            return None
        return CheckpointError(f"the asynchronous save of '{self._began.tag}' failed: rank {self._comm.rank} "
                               f"{self._error}. The save was abandoned and the previous checkpoint is still "
                               "'latest'; free space (or fix the cause) and save again")

    def wait(self) -> Path | None:
        """Block until this rank's write ends, then publish (every rank must call it); returns the tag's path."""
        self._thread.join()
        return self.poll()  # every rank's writer has ended: it publishes, or raises the failure

    def _unpublished_at_exit(self) -> None:
        """The process ends with the save written (or failed) but never published: say so, loudly."""
        outcome = f"failed ({self._error})" if self._error else "was written"
        log.error("the asynchronous save of '%s' %s but never became 'latest': the process ended without "
                  "engine.wait_for_checkpoint() (or a later step or save) on every rank; %s stays as it was "
                  "and the partial directory %s is removed by the next save", self._began.tag, outcome,
                  self._began.save_dir, self._began.partial)

    def _abandon(self) -> None:
        """Remove the partial directory (rank 0), once every rank's writer has stopped writing into it."""
        self._thread.join()
        barrier(self._comm, "every rank's checkpoint writer has ended")
        if self._comm.rank == 0:
            shutil.rmtree(self._began.partial, ignore_errors=True)
        barrier(self._comm, "the abandoned save's partial directory is removed")
