"""Prometheus metrics of a serving process: requests by route template and status, latency histograms, and the
compute service (slots, computations completed / failed / cancelled / refused, cache bytes and hits) read at
scrape time. With `uvicorn --workers N`, `QKOV_METRICS_MULTIPROCESS=true` and PROMETHEUS_MULTIPROC_DIR aggregate
the request metrics of all workers; the compute and cache gauges stay per process (labelled by pid).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from app.registry import ModelRegistry
from app.scheduling.service import ComputeService

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServiceCollector(Collector):
    """Compute slots, cache and loaded models, read at scrape time from the app's objects."""

    def __init__(self, service: ComputeService, registry: ModelRegistry):
        self.service = service
        self.registry = registry

    def collect(self) -> Iterator[Any]:
        s, c, pid = self.service, self.service.cache, [str(os.getpid())]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["pid"])
            g.add_metric(pid, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            m = CounterMetricFamily(name, doc, labels=["pid"])
            m.add_metric(pid, value)
            return m

        yield gauge("qkov_compute_slots", "compute slots (concurrent torch computations)", s.slots.n)
        yield gauge("qkov_compute_slots_in_use", "compute slots running a computation", s.slots.in_use)
        yield gauge("qkov_compute_waiting", "computations waiting for a slot", s.slots.waiting)
        yield counter("qkov_compute_completed", "computations finished", s.stats.completed)
        yield counter("qkov_compute_failed", "computations that raised an error", s.stats.failed)
        yield counter("qkov_compute_cancelled", "computations stopped by their stop flag", s.stats.cancelled)
        yield counter(
            "qkov_compute_rejected", "requests refused with 503: no slot within slot_wait_s", s.stats.rejected_busy
        )
        yield counter("qkov_compute_shared", "requests that joined an identical computation in flight", s.stats.shared)
        yield counter("qkov_compute_seconds", "seconds spent computing", s.stats.compute_seconds)
        yield gauge("qkov_cache_bytes", "estimated bytes held by the result cache", c.bytes)
        yield gauge("qkov_cache_budget_bytes", "byte budget of the result cache", c.budget_bytes)
        yield gauge("qkov_cache_entries", "results in the cache", len(c))
        yield counter("qkov_cache_hits", "result cache hits", c.hits)
        yield counter("qkov_cache_misses", "result cache misses", c.misses)
        yield counter("qkov_cache_evictions", "results evicted to stay within the budget", c.evictions)
        yield gauge("qkov_cache_hit_ratio", "hits / (hits + misses) since start", c.hit_rate)
        if s.store is not None:
            yield counter("qkov_store_hits", "answers found in the shared result store", s.store.hits)
            yield counter("qkov_store_waited", "answers another process computed while this one waited", s.store.waited)
            yield counter("qkov_store_puts", "answers written to the shared result store", s.store.puts)
            yield counter(
                "qkov_store_errors", "result store operations that failed (the answer was computed)", s.store.errors
            )
        yield gauge("qkov_models_loaded", "models loaded in this process", len(getattr(self.registry, "_loaded", {})))


class Metrics:
    def __init__(self, service: ComputeService, registry: ModelRegistry, multiprocess: bool):
        self.multiprocess = multiprocess
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "qkov_http_requests",
            "HTTP requests by route template and status",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "qkov_http_request_duration_seconds",
            "HTTP request latency by route template",
            ["method", "route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.service_collector = ServiceCollector(service, registry)
        self.registry.register(self.service_collector)
        if not multiprocess:
            ProcessCollector(registry=self.registry)

    def render(self) -> bytes:
        if not self.multiprocess:
            return generate_latest(self.registry)
        from prometheus_client import multiprocess

        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged)
        merged.register(self.service_collector)
        return generate_latest(merged)
