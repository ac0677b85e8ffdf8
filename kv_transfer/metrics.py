"""Counters and a latency histogram for one worker's KV transfers, reported in ``WorkerStats``."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from splitserve.ipc.messages import WorkerStats

# Upper bounds (ms) of the latency histogram; a last bucket holds everything slower.
LATENCY_BUCKETS_MS = (0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)


@dataclass(slots=True)
class TransferMetrics:
    """Sender side: bytes/pages/messages sent and the time spent in ``send``. Receiver side:
    bytes/pages/messages installed and each message's latency from the sender's send call to
    the end of the install (both clocks are ``time.time()``: exact on one host)."""

    backend: str
    bytes_sent: int = 0
    pages_sent: int = 0
    messages_sent: int = 0
    send_s: float = 0.0
    bytes_received: int = 0
    pages_received: int = 0
    messages_received: int = 0
    latency_counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_MS) + 1))
    latency_s_sum: float = 0.0
    latency_bytes: int = 0  # bytes of the messages whose latency is in latency_s_sum

    def record_send(self, num_bytes: int, num_pages: int, seconds: float) -> None:
        self.bytes_sent += num_bytes
        self.pages_sent += num_pages
        self.messages_sent += 1
        self.send_s += seconds

    def record_install(self, num_bytes: int, num_pages: int, latency_s: float | None) -> None:
        self.bytes_received += num_bytes
        self.pages_received += num_pages
        self.messages_received += 1
        if latency_s is not None and latency_s >= 0:
            self.latency_counts[bisect.bisect_left(LATENCY_BUCKETS_MS, latency_s * 1e3)] += 1
            self.latency_s_sum += latency_s
            self.latency_bytes += num_bytes

    @property
    def gbps(self) -> float:
        """Achieved GB/s: received bytes over summed latency (receiver), else sent bytes over
        time spent sending (sender)."""
        if self.latency_s_sum > 0:
            return self.latency_bytes / self.latency_s_sum / 1e9
        return self.bytes_sent / self.send_s / 1e9 if self.send_s > 0 else 0.0

    def fill(self, stats: WorkerStats) -> WorkerStats:
        """Copy the metrics into ``stats`` (its ``kv_*`` fields)."""
        stats.kv_transfer = self.backend
        stats.kv_bytes_sent = self.bytes_sent
        stats.kv_pages_sent = self.pages_sent
        stats.kv_messages_sent = self.messages_sent
        stats.kv_send_s = self.send_s
        stats.kv_bytes_received = self.bytes_received
        stats.kv_pages_received = self.pages_received
        stats.kv_messages_received = self.messages_received
        stats.kv_latency_ms_buckets = list(LATENCY_BUCKETS_MS)  # counts has one more: slower
        stats.kv_latency_counts = list(self.latency_counts)
        stats.kv_latency_ms_sum = self.latency_s_sum * 1e3
        stats.kv_gbps = self.gbps
        return stats
