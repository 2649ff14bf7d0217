"""The vLLM tier's I/O threads: each takes a batch of queued jobs and moves all their blocks
with one request to the service.

vLLM submits a step's jobs together (16 blocks each by default); a request per job costs the
same control work on both sides of the connection whatever its size, so a thread that wakes
takes the oldest job and, while more wait, its share of them (the queue split across the
threads that are free, at most ``max_keys()`` blocks, asked per batch: 0 runs every job
alone): fewer, larger requests, and every free thread still copying. ``on_idle`` runs when
the last busy thread finds the queue empty (the tier ends its deferred read leases there:
one request per burst of jobs).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

log = logging.getLogger(__name__)


class _Sized(Protocol):
    keys: list[bytes]


J = TypeVar("J", bound=_Sized)


class BatchWorkers(Generic[J]):
    """``threads`` daemon threads running ``run_batch(jobs)`` on batches of submitted jobs.

    Every job goes to exactly one ``run_batch`` call, which reports it; should that call
    raise (a bug: it catches its I/O errors itself), the error is logged and its jobs go to
    ``on_error``, so that none is lost (vLLM would wait on it forever).
    """

    def __init__(self, name: str, threads: int, max_keys: Callable[[], int],
                 run_batch: Callable[[list[J]], None], on_error: Callable[[list[J]], None],
                 on_idle: Callable[[], None] | None = None) -> None:
        self._queue: collections.deque[J] = collections.deque()
        self._cond = threading.Condition()
        self._max_keys = max_keys
        self._run_batch, self._on_error, self._on_idle = run_batch, on_error, on_idle
        self._threads_n = threads
        self._free = threads  # threads waiting for work
        self._ran = False  # a batch ran since the last idle work
        self._unfinished = 0  # queued + running jobs
        self._stop = False
        self._threads = [threading.Thread(target=self._loop, name=f"{name}-{i}", daemon=True)
                         for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, job: J) -> None:
        """Queue ``job``; a free thread takes it (with others queued by then)."""
        with self._cond:
            if self._stop:
                raise RuntimeError("submit after shutdown")
            self._queue.append(job)
            self._unfinished += 1
            self._cond.notify()

    @property
    def busy(self) -> bool:
        """Jobs queued or running."""
        return self._unfinished > 0

    def wait(self) -> None:
        """Block until every submitted job has been run."""
        with self._cond:
            self._cond.wait_for(lambda: self._unfinished == 0)

    def shutdown(self) -> None:
        """Run what is queued, then stop the threads."""
        self.wait()
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()

    def _take(self) -> list[J]:
        """The oldest job and, while more wait, this thread's share of them (called locked)."""
        share = -(-len(self._queue) // max(1, self._free))
        batch = [self._queue.popleft()]
        keys, limit = len(batch[0].keys), self._max_keys()
        while self._queue and len(batch) < share and \
                keys + len(self._queue[0].keys) <= limit:
            job = self._queue.popleft()
            batch.append(job)
            keys += len(job.keys)
        return batch

    def _loop(self) -> None:
        while True:
            with self._cond:
                # The last thread to go idle runs the idle work (once per burst of jobs,
                # never while another thread's request is in flight).
                if not self._queue and not self._stop and self._on_idle is not None and \
                        self._free == self._threads_n and self._ran:
                    self._ran = False
                    self._cond.release()  # idle work runs unlocked
                    try:
                        self._on_idle()
                    except Exception:  # the tier's own bug; the thread must live on
                        log.warning("vLLM tier idle hook failed", exc_info=True)
                    finally:
                        self._cond.acquire()
                self._cond.wait_for(lambda: self._stop or bool(self._queue))
                if not self._queue:
                    return
                batch = self._take()
                self._free -= 1
                self._ran = True
            try:
                self._run_batch(batch)
            except Exception:
                log.warning("vLLM tier: a batch of %d jobs failed", len(batch), exc_info=True)
                self._on_error(batch)
            finally:
                with self._cond:
                    self._free += 1
                    self._unfinished -= len(batch)
                    self._cond.notify_all()
