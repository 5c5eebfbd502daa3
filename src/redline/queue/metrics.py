"""The queue's series for Prometheus, served by the daemon (``redline queue daemon --metrics-port``) beside the
monitor's exporter and named like its series (``redline_``): jobs by state, how long jobs waited, what each GPU
has reserved and the room left on it. Read from the store at each scrape: the figures are the daemon's own."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from redline.queue.spec import JobState
from redline.queue.store import Store

WAIT_BUCKETS_S = (1.0, 10.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 24 * 3600.0)


class QueueCollector(Collector):
    def __init__(self, store: Store, status: Callable[[], dict[str, Any]]) -> None:
        self.store = store
        self.status = status  # the daemon's `queue status` answer: its GPUs with their reservations
        self.lock = threading.Lock()  # prometheus_client serves scrapes on threads; the store takes one at a time

    def collect(self) -> Iterator[Any]:
        with self.lock:
            yield from self._collect()

    def _collect(self) -> Iterator[Any]:
        jobs = self.store.jobs()
        counts = GaugeMetricFamily("redline_queue_jobs", "Jobs in the queue by state.", labels=["state"])
        for state in JobState:
            counts.add_metric([state.value], sum(j.state == state for j in jobs))
        yield counts
        now = time.time()
        waiting = [now - j.submitted_at for j in jobs if j.state == JobState.QUEUED]
        yield GaugeMetricFamily(
            "redline_queue_oldest_wait_seconds",
            "How long the longest-waiting queued job has waited.",
            value=max(waiting, default=0.0),
        )
        waits = [j.started_at - j.submitted_at for j in jobs if j.started_at is not None]
        buckets = [(f"{edge:g}", sum(w <= edge for w in waits)) for edge in WAIT_BUCKETS_S]
        histogram = HistogramMetricFamily(
            "redline_queue_wait_seconds", "From submit to start, of every job that started (its latest attempt)."
        )
        histogram.add_metric([], [*buckets, ("+Inf", len(waits))], sum(waits))
        yield histogram
        yield CounterMetricFamily(
            "redline_queue_attempts", "Attempts started, retries included.", value=sum(j.attempt for j in jobs)
        )
        reserved = GaugeMetricFamily(
            "redline_queue_reserved_bytes", "GPU memory the running jobs reserved, per GPU.", labels=["gpu", "uuid"]
        )
        room = GaugeMetricFamily(
            "redline_queue_room_bytes", "GPU memory a new job may count on, per GPU.", labels=["gpu", "uuid"]
        )
        for gpu in self.status()["gpus"]:
            labels = [str(gpu["index"]), gpu["uuid"]]
            reserved.add_metric(labels, sum(j["reserved_bytes"] for j in gpu["jobs"]))
            room.add_metric(labels, max(gpu["room_bytes"], 0))
        yield reserved
        yield room
