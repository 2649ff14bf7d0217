"""``TierStoreTier``: a vLLM secondary offloading tier whose blocks live in ``tierstore serve``.

vLLM's tiering manager calls it on the scheduler thread, under its lock; nothing here waits on
the network there. ``lookup`` reads a presence cache that a probe thread refreshes in batches;
``submit_store`` / ``submit_load`` hand a job to the tier's own store / load threads, which
take the queued jobs in batches (one request per batch, see ``workers.py``) and copy each
block between its row of vLLM's primary (CPU) memory and the service: straight into / out of
the service's shared segment on the same host (a read's lease is ended with the next read's
request, or when the threads go idle), else over HTTP. Finished jobs
wait in a queue for ``get_finished_jobs``; a job that could not move every block is a failed
job (vLLM recomputes what it lacks), never wrong bytes.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from tierstore.integrations._io import ServiceIO
from tierstore.integrations._support import _Counters, _LogLimiter
from tierstore.integrations.vllm import _vllm
from tierstore.integrations.vllm.config import VllmTierConfig, block_key, block_namespace
from tierstore.integrations.vllm.metrics import TierMetrics, metric_definitions
from tierstore.integrations.vllm.presence import PresenceCache
from tierstore.integrations.vllm.workers import BatchWorkers

log = logging.getLogger(__name__)

_Base: Any = _vllm.SecondaryTierManager if _vllm.AVAILABLE else object


@dataclass
class _Job:
    """A submitted job as the worker threads see it."""

    job_id: int
    keys: list[bytes]
    chunk_ids: np.ndarray
    is_load: bool
    submitted: float = field(default_factory=time.perf_counter)


class TierStoreTier(_Base):
    """vLLM ``SecondaryTierManager`` over the storage API of a running ``tierstore serve``.

    Load it by module path (no registration)::

        {"type": "TierStoreTier", "module_path": "tierstore.integrations.vllm",
         "url": "http://127.0.0.1:8080"}

    Blocks are stored per (KV cache group, block hash) in a namespace carrying the model's
    layout fingerprint; the service folds in the tenant of the bearer token. A block's value
    is its whole primary row, byte for byte; a value of any other length is never loaded.
    """

    # The service answers from its host memory or from Redis/Valkey (possibly filled by
    # another engine) and does not say which per block: "external", not HOST or DISK.
    medium: ClassVar[Any] = None
    cache_hit_source: ClassVar[Any] = (
        _vllm.CacheHitSource.EXTERNAL_UNSPECIFIED if _vllm.AVAILABLE else None)

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, **options: Any) -> None:
        if not _vllm.AVAILABLE:
            raise ImportError("TierStoreTier needs vLLM 0.33: pip install --no-deps "
                              "vllm==0.33.0 && pip install 'tierstore[vllm]'"
                              ) from _vllm.IMPORT_ERROR
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.config = VllmTierConfig.from_options(options)
        if self.config.locality is not None:
            self.locality = _vllm.Locality(self.config.locality)
        # One uint8 row per primary chunk, sharing vLLM's memory (no copy).
        self._rows = np.asarray(primary_kv_view).view(np.uint8)
        assert self._rows.ndim == 2 and self._rows.shape[1] == self.block_size_bytes, (
            f"primary view of shape {self._rows.shape} does not hold rows of "
            f"{self.block_size_bytes} bytes")
        self.namespace = block_namespace(self.config.namespace, offloading_spec,
                                         self.block_size_bytes)
        self._log = _LogLimiter(self.config.log_interval_s)
        self._io = ServiceIO(self.config.service_io_config(), _Counters(False), self._log)
        # Requests stay within the service's own batch limit, which ServiceIO learns at start,
        # on reconnect and from a 413 naming it (the refused request is resent split).
        self.metrics = TierMetrics()
        self.presence = PresenceCache(self._probe, present_ttl_s=self.config.present_ttl_s,
                                      absent_ttl_s=self.config.absent_ttl_s,
                                      batch=self.config.probe_batch)
        self._finished: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._loads: BatchWorkers[_Job] = BatchWorkers(
            "tierstore-vllm-load", self.config.load_threads, self._batch_keys,
            self._run, self._fail, self._end_leases)
        self._stores: BatchWorkers[_Job] = BatchWorkers(
            "tierstore-vllm-store", self.config.store_threads, self._batch_keys,
            self._run, self._fail)
        log.info("tierstore vLLM tier %r at %s (%s), namespace %s, %d-byte blocks",
                 tier_type, self.config.url, self._io.mode, self.namespace,
                 self.block_size_bytes)

    # ------------------------------------------------------------------ scheduler thread
    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        """The tier's own Prometheus metrics (vLLM registers them per engine)."""
        return metric_definitions()

    @property
    def transport(self) -> str:
        """``shm`` while blocks move through the service's shared segment, else ``http``."""
        return self._io.mode

    def on_new_request(self, req_context: Any) -> Any:
        """Chunk-level offloading: the tier takes what vLLM cascades to it, block by block."""
        return _vllm.RequestOffloadingContext()

    def lookup(self, key: Any, req_context: Any) -> Any:
        """HIT / MISS from a fresh presence verdict; RETRY (and a queued probe) otherwise.
        Never a request on this thread."""
        verdict = self.presence.verdict(bytes(key))
        self.metrics.lookup(verdict)
        if verdict == "present":
            return _vllm.LookupResult.HIT
        if verdict == "absent":
            return _vllm.LookupResult.MISS
        return _vllm.LookupResult.RETRY

    def submit_store(self, job_metadata: Any) -> None:
        """Queue a store of the job's primary rows; blocks the presence cache already
        holds as stored are not sent again."""
        keys = [bytes(k) for k in job_metadata.keys]
        chunk_ids = np.asarray(job_metadata.chunk_ids, dtype=np.int64)
        todo = [i for i, k in enumerate(keys) if not self.presence.is_present(k)]
        self._stores.submit(_Job(job_metadata.job_id, [keys[i] for i in todo],
                                 chunk_ids[todo], False))

    def submit_load(self, job_metadata: Any) -> None:
        """Queue a load of the job's blocks into its primary rows."""
        self._loads.submit(_Job(job_metadata.job_id, [bytes(k) for k in job_metadata.keys],
                                np.asarray(job_metadata.chunk_ids, dtype=np.int64), True))

    def get_finished_jobs(self) -> Iterable[Any]:
        """Every job that finished since the last call (loads and stores)."""
        out = []
        while True:
            try:
                out.append(self._finished.get_nowait())
            except queue.Empty:
                return out

    def has_pending_work(self) -> bool:
        """Jobs in flight (vLLM keeps stepping until they report)."""
        return self._loads.busy or self._stores.busy

    def drain_jobs(self) -> None:
        """Wait until every submitted job has finished and is queued for
        ``get_finished_jobs`` (a copy in progress is never cut short)."""
        self._loads.wait()
        self._stores.wait()

    def get_stats(self) -> Any:
        """The tier's counters since the last call, as vLLM's offloading stats (None when
        nothing happened)."""
        return self.metrics.take(_vllm.OffloadingConnectorStats, self._io.mode,
                                 self.presence)

    def config_info(self) -> dict[str, str | int | float | bool]:
        return {}

    def shutdown(self) -> None:
        """Finish jobs in flight, stop the threads, unmap the segment, close the client."""
        self._loads.shutdown()
        self._stores.shutdown()
        self.presence.close()
        self._io.close()
        # Drop the export of vLLM's primary memory, so that vLLM can unmap it.
        self._rows = np.empty((0, self.block_size_bytes), dtype=np.uint8)

    # ------------------------------------------------------------------ worker threads
    def _batch_keys(self) -> int:
        """Blocks one request may take from several queued jobs: through the segment a
        request costs the same control work whatever its size, so jobs go together (up to
        ``max_batch`` and the service's own limit); over HTTP the bytes travel in the
        request, and parallel requests of one job each pipeline better (measured ~1.5x)
        than one large one."""
        return 0 if self._io.transport() is None else self._io.max_batch

    def _run(self, jobs: list[_Job]) -> None:
        """Move a batch of jobs' blocks with one call; report every job exactly once,
        whatever happens."""
        keys = [k for job in jobs for k in job.keys]
        chunk_ids = np.concatenate([job.chunk_ids for job in jobs])
        try:
            done = (self._load if jobs[0].is_load else self._store)(keys, chunk_ids)
        except Exception:  # a bug must not lose the jobs: vLLM would wait on them forever
            self._log.warning("tierstore vLLM tier: %d jobs failed", len(jobs), exc_info=True)
            done = [False] * len(keys)
        start = 0
        for job in jobs:
            self._report(job, done[start:start + len(job.keys)])
            start += len(job.keys)

    def _fail(self, jobs: list[_Job]) -> None:
        for job in jobs:
            self._report(job, [False] * len(job.keys))

    def _report(self, job: _Job, done: Sequence[bool]) -> None:
        """Queue the job's result for ``get_finished_jobs``; a load that moved only some
        blocks is a failed job naming those that arrived."""
        ok = [k for k, d in zip(job.keys, done, strict=True) if d]
        failed = [k for k, d in zip(job.keys, done, strict=True) if not d]
        if ok:
            self.presence.mark(ok, True)
        if failed and job.is_load:  # a block that would not load is a miss from now on
            self.presence.mark(failed, False)
        seconds = time.perf_counter() - job.submitted
        nbytes = len(ok) * self.block_size_bytes
        self.metrics.job("load" if job.is_load else "store", len(ok), len(failed))
        success = not failed
        successful: Sequence[bytes] | None = None
        if job.is_load and not success and ok:
            successful = tuple(ok)
        self._finished.put(_vllm.JobResult(
            job_id=job.job_id, success=success,
            successful_keys=successful, transfer_time=seconds,
            transfer_bytes=nbytes or None))

    def _store(self, keys: list[bytes], cids: np.ndarray) -> list[bool]:
        rows = self._rows
        if not keys:
            return []

        def fill(i: int, view: torch.Tensor) -> None:
            np.copyto(view.numpy(), rows[cids[i]])

        def blob(i: int) -> memoryview:
            return memoryview(rows[cids[i]])

        names = [block_key(k) for k in keys]
        return self._io.write(self.namespace, names, [self.block_size_bytes] * len(names),
                              fill, blob)

    def _load(self, keys: list[bytes], cids: np.ndarray) -> list[bool]:
        rows, size = self._rows, self.block_size_bytes
        shm = self._io.transport()
        if shm is not None:  # this tier's own transport: its threads end the leases
            shm.defer_release = True

        def take(i: int, value: torch.Tensor) -> bool:
            if value.numel() != size:  # another layout's value, or a torn one: never served
                self._log.warning("tierstore vLLM tier: a %d-byte value for a %d-byte block; "
                                  "treated as a miss", value.numel(), size)
                return False
            np.copyto(rows[cids[i]], value.numpy())  # one memcpy, GIL released
            return True

        names = [block_key(k) for k in keys]
        return self._io.read(self.namespace, names, [size] * len(names), take)

    def _end_leases(self) -> None:
        """Load threads going idle: end the read leases deferred so far (one request)."""
        shm = self._io.transport()
        if shm is not None:
            shm.release_pending()

    def _probe(self, keys: Sequence[bytes]) -> list[bool] | None:
        """Per key whether the service holds it (probe thread); None when it could not say."""
        names = [block_key(k) for k in keys]
        # One request (parts the service takes, if it takes fewer): the probe is a batch.
        got = self._io.exists_each(self.namespace, names, len(names))
        return None if None in got else [bool(v) for v in got]
