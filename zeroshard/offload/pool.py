"""The worker threads of offload's asynchronous work: jobs split into chunks, served round robin.

A job is one transfer: `count` chunks, each `run(i)` for i in range(count).
The pool's threads take one chunk at a time from the job at the head of the
queue and move that job to the tail, so the chunks of concurrent jobs
interleave: a 1 GiB write does not hold back a 1 MiB read submitted after it
for the whole GiB, only for about one chunk per thread.

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
    poison mode's delay).
    """

    def __init__(self, count: int, run: Callable[[int], None], start_at: float = 0.0):
        self.count = count
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
    """`threads` daemon threads serving jobs chunk by chunk, round robin over the jobs."""

    def __init__(self, threads: int, name: str):
        if threads < 1:
            raise ValueError(f"{name}: threads must be >= 1, got {threads}")
        self._cv = threading.Condition()
        self._jobs: deque[Job] = deque()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, job: Job) -> Job:
        with self._cv:
            if self._closed:
                raise RuntimeError("the offload worker pool is closed: this object was closed; create another")
            if job.count:
                self._jobs.append(job)
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
            while not self._jobs and not self._closed:
                self._cv.wait()
            if not self._jobs:
                return None
            job = self._jobs[0]
            i, job._next = job._next, job._next + 1
            if job._next == job.count:
                self._jobs.popleft()
            else:
                self._jobs.rotate(-1)  # the head job goes to the tail: the next chunk is another job's
            return job, i

    def _work(self) -> None:
        while (item := self._take()) is not None:
            job, i = item
            job.run_chunk(i)
