"""The tiers' I/O, off the engine thread: one thread loads blocks for requests that wait to be
scheduled (latency-bound), another writes blocks down to the disk and the store (background).

A :class:`LoadJob` names the blocks a request could load past what the KV pool and host memory
(L2) hold: the load thread reads them in order, from the disk (L3) where it has them, else from
the shared store in batches, and stops at the first block no tier has, that fails its checks, or
that the cost model says is cheaper to recompute (``cost_model``). The engine thread picks up
finished jobs (:meth:`TierIO.finished`) and copies their blocks into the pool when the request is
admitted. So reading a long prefix from disk overlaps the forward passes of other requests
(chunk-wise, as HiCache prefetches), and a request whose load is slow only waits for itself.

Writes are copies of pool pages taken on the engine thread (the page may be reused at once),
queued up to ``write_budget_bytes``; past that a write is dropped and counted, never waited for.

``threaded=False`` runs every job inline, for deterministic model-free tests.

Counters (:class:`TierCounters`, one per tier) and KV events (:class:`EventLog`) are written by
both threads and the engine thread, under locks.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from splitserve.ipc.messages import KVEvent, TierStats
from splitserve.radix_cache.tiers.block_codec import BlockCorrupt
from splitserve.radix_cache.tiers.cost_model import LoadCostModel
from splitserve.radix_cache.tiers.disk_tier import DiskTier, TierWriteError
from splitserve.radix_cache.tiers.store_tier import (
    READ_BATCH,
    MooncakeStoreTier,
    StoreUnavailable,
)

logger = logging.getLogger(__name__)

TIERS = ("l1", "l2", "l3", "store")


@dataclass(slots=True)
class TierCounters:
    """What one tier did since start. Tokens, blocks, bytes, seconds."""

    hit_tokens: int = 0  # prompt tokens served from this tier (reported to clients)
    load_blocks: int = 0
    load_bytes: int = 0
    load_s: float = 0.0
    write_blocks: int = 0
    write_bytes: int = 0
    write_errors: int = 0  # writes that failed (disk full, store full or gone)
    dropped_writes: int = 0  # writes not queued: the write queue was over its budget
    corrupt_blocks: int = 0  # blocks that failed their checks when read (recomputed)
    unavailable: int = 0  # loads skipped because the tier did not answer (store gone)


class EventLog:
    """KV events not yet published (``ipc.messages.KVEvent``), in order; thread-safe."""

    def __init__(self) -> None:
        self._events: list[KVEvent] = []
        self._lock = threading.Lock()

    def add(self, kind: str, tier: str, keys: list[str], from_tier: str = "") -> None:
        if not keys:
            return
        with self._lock:
            last = self._events[-1] if self._events else None
            if last is not None and (last.kind, last.tier, last.from_tier) == (kind, tier,
                                                                                from_tier):
                last.keys.extend(keys)
            else:
                self._events.append(KVEvent(kind, tier, list(keys), from_tier))

    def drain(self) -> list[KVEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events


@dataclass(slots=True, eq=False)
class LoadJob:
    """Blocks one request may load, in chain order.

    Attributes:
        uid: the request's ``Req.uid``.
        keys: candidate block keys, consecutive in the request's chain.
        present: keys the host tier (L2) already holds: passed over, not loaded.
        blocks: what was loaded: ``(key, tier, fmt, payload)`` in order, the chain's blocks
            ``keys[:len(...)]`` less those in ``present``.
        loaded_len: how many leading ``keys`` the job covers (loaded or present).
        done: the job ended (the engine thread may read ``blocks``).
    """

    uid: int
    keys: list[str]
    present: frozenset[str] = frozenset()
    blocks: list[tuple[str, str, str, torch.Tensor]] = field(default_factory=list)
    loaded_len: int = 0
    done: bool = False
    cancelled: bool = False


class TierIO:
    """The load and write threads over the disk and store tiers.

    Args:
        disk, store: the tiers (None where not configured).
        cost: the measured rates; loads feed it and ask it.
        counters: per tier name, where results are counted.
        events: where stored/removed events of the disk and store go.
        max_job_bytes: the most bytes one job stages (its later blocks are recomputed).
        write_budget_bytes: the most bytes of writes queued at once.
        threaded: False runs jobs inline (tests).
    """

    def __init__(self, disk: DiskTier | None, store: MooncakeStoreTier | None,
                 cost: LoadCostModel, counters: dict[str, TierCounters], events: EventLog,
                 max_job_bytes: int = 1 << 30, write_budget_bytes: int = 256 << 20,
                 threaded: bool = True, clock: Callable[[], float] = time.perf_counter) -> None:
        self.disk, self.store, self.cost = disk, store, cost
        self.counters, self.events = counters, events
        self.max_job_bytes = max_job_bytes
        self.write_budget_bytes = write_budget_bytes
        self.threaded = threaded
        self.clock = clock
        self._lock = threading.Lock()
        self._done: list[LoadJob] = []
        self._pending_loads = 0
        self._pending_write_bytes = 0
        self._loads: queue.SimpleQueue = queue.SimpleQueue()
        self._writes: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        if threaded and (disk is not None or store is not None):
            for name, target in (("kv-tier-load", self._load_loop),
                                 ("kv-tier-write", self._write_loop)):
                t = threading.Thread(target=target, name=name, daemon=True)
                t.start()
                self._threads.append(t)

    # ---- the engine thread's side ----------------------------------------------------------

    def load(self, job: LoadJob) -> None:
        """Start ``job`` (inline when not threaded)."""
        with self._lock:
            self._pending_loads += 1
        if self._threads:
            self._loads.put(job)
        else:
            self._run_load(job)

    def write(self, key: str, fmt: str, payload: torch.Tensor, targets: tuple[str, ...]) -> None:
        """Write ``payload`` (``uint8 [n]``, a copy the caller no longer touches) as block
        ``key`` in format ``fmt`` to each of ``targets`` (``l3``, ``store``); dropped and
        counted when the queue is over budget."""
        size = payload.numel()
        with self._lock:
            if self._pending_write_bytes + size > self.write_budget_bytes:
                for t in targets:
                    self.counters[t].dropped_writes += 1
                return
            self._pending_write_bytes += size
        if self._threads:
            self._writes.put((key, fmt, payload, targets))
        else:
            self._run_write(key, fmt, payload, targets)

    def finished(self) -> list[LoadJob]:
        """Jobs that ended since the last call."""
        with self._lock:
            done, self._done = self._done, []
        return done

    @property
    def loading(self) -> bool:
        """Whether a job is queued or running."""
        return self._pending_loads > 0

    def drain_writes(self, timeout_s: float = 30.0) -> None:
        """Wait until every queued write is done (flush, shutdown, tests)."""
        deadline = time.monotonic() + timeout_s
        while self._pending_write_bytes > 0 and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self) -> None:
        """Finish queued writes, stop the threads."""
        if not self._threads:
            return
        self.drain_writes()
        self._loads.put(None)
        self._writes.put(None)
        for t in self._threads:
            t.join(timeout=10)
        self._threads = []

    # ---- the threads -----------------------------------------------------------------------

    def _load_loop(self) -> None:
        while (job := self._loads.get()) is not None:
            try:
                self._run_load(job)
            except Exception:  # a bug here must not stop later loads
                logger.exception("KV tier load failed")
                self._finish(job)

    def _write_loop(self) -> None:
        while (item := self._writes.get()) is not None:
            try:
                self._run_write(*item)
            except Exception:  # nor later writes
                logger.exception("KV tier write failed")

    def _finish(self, job: LoadJob) -> None:
        job.done = True
        with self._lock:
            self._pending_loads -= 1
            self._done.append(job)

    def _run_load(self, job: LoadJob) -> None:
        """Load ``job``'s blocks in order until one is missing, bad, or not worth loading."""
        staged = 0
        i, keys = 0, job.keys
        while i < len(keys) and not job.cancelled and staged < self.max_job_bytes:
            key = keys[i]
            if key in job.present:
                i += 1
                continue
            if self.disk is not None and self.disk.contains(key):
                got = self._read_disk(key)
                if got is None:
                    break
                job.blocks.append((key, "l3", *got))
                staged += got[1].numel()
                i += 1
                continue
            if self.store is None or not self.cost.worth_loading("store"):
                break
            run = []
            for k in keys[i:]:
                if k in job.present or (self.disk is not None and self.disk.contains(k)):
                    break
                run.append(k)
            got_run = self._read_store(run)
            for k, (fmt, payload) in zip(run, got_run):
                job.blocks.append((k, "store", fmt, payload))
                staged += payload.numel()
            i += len(got_run)
            if len(got_run) < min(len(run), READ_BATCH):
                break
        job.loaded_len = i
        self._finish(job)

    def _read_disk(self, key: str) -> tuple[str, torch.Tensor] | None:
        c = self.counters["l3"]
        if not self.cost.worth_loading("l3"):
            return None
        t0 = self.clock()
        try:
            got = self.disk.read(key)  # type: ignore[union-attr]
        except BlockCorrupt as exc:
            logger.warning("%s: recomputing", exc)
            c.corrupt_blocks += 1
            self.events.add("removed", "l3", [key])
            return None
        except OSError as exc:
            logger.warning("L3 read of block %s failed: %s", key, exc)
            c.unavailable += 1
            return None
        if got is None:  # deleted meanwhile (another process sharing the directory)
            self.events.add("removed", "l3", [key])
            return None
        fmt, view = got
        payload = torch.frombuffer(bytearray(view), dtype=torch.uint8)
        dt = self.clock() - t0
        self.cost.observe_load("l3", payload.numel(), dt)
        c.load_blocks += 1
        c.load_bytes += payload.numel()
        c.load_s += dt
        return fmt, payload

    def _read_store(self, keys: list[str]) -> list[tuple[str, torch.Tensor]]:
        c = self.counters["store"]
        t0 = self.clock()
        try:
            got = self.store.read_run(keys)  # type: ignore[union-attr]
        except StoreUnavailable:
            c.unavailable += 1
            return []
        except BlockCorrupt as exc:
            logger.warning("%s: recomputing", exc)
            c.corrupt_blocks += 1
            return []
        dt = self.clock() - t0
        nbytes = sum(p.numel() for _, p in got)
        if got:
            self.cost.observe_load("store", nbytes, dt)
        c.load_blocks += len(got)
        c.load_bytes += nbytes
        c.load_s += dt
        return got

    def _run_write(self, key: str, fmt: str, payload: torch.Tensor,
                   targets: tuple[str, ...]) -> None:
        view = memoryview(payload.numpy())
        try:
            for target in targets:
                tier = self.disk if target == "l3" else self.store
                c = self.counters[target]
                try:
                    evicted = tier.write(key, fmt, view)  # type: ignore[union-attr]
                except TierWriteError as exc:
                    c.write_errors += 1
                    logger.warning("%s", exc)
                    continue
                c.write_blocks += 1
                c.write_bytes += payload.numel()
                if evicted:
                    self.events.add("removed", target, evicted)
                self.events.add("stored", target, [key])
        finally:
            with self._lock:
                self._pending_write_bytes -= payload.numel()


def tier_stats(name: str, c: TierCounters, capacity_bytes: int, used_bytes: int, blocks: int,
               cost: LoadCostModel) -> TierStats:
    """One tier's row of ``WorkerStats.cache_tiers``."""
    rate = cost.loads.get(name)
    return TierStats(
        tier=name, capacity_bytes=capacity_bytes, used_bytes=used_bytes, blocks=blocks,
        hit_tokens=c.hit_tokens, load_blocks=c.load_blocks, load_bytes=c.load_bytes,
        load_s=c.load_s, write_blocks=c.write_blocks, write_bytes=c.write_bytes,
        write_errors=c.write_errors, dropped_writes=c.dropped_writes,
        corrupt_blocks=c.corrupt_blocks, unavailable=c.unavailable,
        skipped_slower=cost.skipped.get(name, 0),
        load_gbps=(rate.value or 0.0) / 1e9 if rate else 0.0,
    )
