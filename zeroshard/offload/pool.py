"""The worker threads of offload's asynchronous work: jobs split into chunks, urgent ones first, in order.

A job is one transfer: `count` chunks, each `run(i)` for i in range(count).
The pool's threads take one chunk at a time: from the oldest urgent job
(a read: training waits for it) if there is one, else from the oldest
other job (a write behind). So a 1 GiB write does not hold back a 1 MiB read
submitted after it for more than about one chunk per thread, and jobs of a
kind finish in the order they were submitted, which is the order they are
waited for (the units' shards written after a step, read by the next
forward in that order), instead of all near the end of the last one.

The first exception of a chunk becomes the job's error; the chunks not
started yet are skipped, and the job finishes only when no chunk is running,
so after `Job.wait` no thread touches the job's buffers any more.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable


class Job:
    """`count` chunks of work, `run(i)` each; finished when every chunk ran or was skipped after an error.

    `start_at` (time.monotonic() seconds) delays every chunk until then (the
    poison mode's delay). `urgent`: served before every job that is not.
    """

    def __init__(self, count: int, run: Callable[[int], None], start_at: float = 0.0, urgent: bool = False):
        self.count = count
        self.urgent = urgent
        self.start_at = start_at
        self.error: BaseException | None = None
        self._run: Callable[[int], None] | None = run
        self._next = 0  # the next chunk to hand out (under the pool's lock)
        self._left = count  # chunks not finished yet
        self._lock = threading.Lock()
        self._finished = threading.Event()
        if count == 0:
            self._finish()

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self) -> None:
        """Block until every chunk finished or was skipped; raise the first chunk's error."""
        self._finished.wait()
        if self.error is not None:
            raise self.error

    def run_chunk(self, i: int) -> None:
        try:
            if self.error is None and self._run is not None:
                delay = self.start_at - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                self._run(i)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter, which raises it
            with self._lock:
                if self.error is None:
                    self.error = exc
        finally:
            with self._lock:
                self._left -= 1
                last = self._left == 0
            if last:
                self._finish()

    def _finish(self) -> None:
        self._run = None  # drop the closure: the buffers it holds are free once the job is done
        self._finished.set()


class WorkerPool:
    """`threads` daemon threads serving jobs chunk by chunk, urgent jobs first, each kind in submission order."""

    def __init__(self, threads: int, name: str):
        if threads < 1:
            raise ValueError(f"{name}: threads must be >= 1, got {threads}")
        self._cv = threading.Condition()
        self._jobs: dict[bool, deque[Job]] = {True: deque(), False: deque()}  # urgent -> jobs with chunks left
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, job: Job) -> Job:
        with self._cv:
            if self._closed:
                raise RuntimeError("the offload worker pool is closed: this object was closed; create another")
            if job.count:
                self._jobs[job.urgent].append(job)
                self._cv.notify_all()
        return job

    def close(self) -> None:
        """Finish the jobs queued, then stop the threads; idempotent."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()

    def _take(self) -> tuple[Job, int] | None:
        with self._cv:
            while not any(self._jobs.values()) and not self._closed:
                self._cv.wait()
            jobs = self._jobs[True] or self._jobs[False]
            if not jobs:
                return None
            job = jobs[0]
            i, job._next = job._next, job._next + 1
            if job._next == job.count:
                jobs.popleft()
            return job, i

    def _work(self) -> None:
        while (item := self._take()) is not None:
            job, i = item
            job.run_chunk(i)
