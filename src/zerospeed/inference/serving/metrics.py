"""Prometheus metrics of one server (``GET /metrics``), through ``prometheus_client``.

Decisions:

* Each server has its own ``CollectorRegistry``, so two servers in one process (tests, the Python
  API) never share or clash on metric names.
* Gauges and totals that the engine already keeps (running/waiting requests, KV blocks, generated
  tokens, preemptions) are read from the engine thread's latest :class:`EngineStats` snapshot at
  scrape time by a custom collector, never copied into a second set of counters that could drift.
* Latency histograms are observed in the engine thread when a step's outputs are handed out: time
  to first token from when the request reached the server, inter-token latency per generated token
  (a step that gives several tokens of one request splits the interval between them).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from zerospeed.inference.api import EngineStats

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)

PREFIX = "zerospeed"


class _EngineCollector:
    """Exports the latest engine snapshot and the server's queue counts."""

    def __init__(self, snapshot: Callable[[], tuple[EngineStats, int, int]]) -> None:
        self._snapshot = snapshot

    def collect(self):  # noqa: ANN201 - prometheus_client protocol
        stats, running, waiting = self._snapshot()
        used = stats.num_blocks_total - stats.num_blocks_free

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)

        yield gauge("requests_running", "Requests the engine is generating for.", running)
        yield gauge("requests_waiting", "Requests accepted but not yet running.", waiting)
        yield gauge("kv_blocks_used", "KV-cache blocks held by sequences.", used)
        yield gauge("kv_blocks_free", "KV-cache blocks on the free list.", stats.num_blocks_free)
        yield gauge("kv_blocks_total", "KV-cache blocks in all.", stats.num_blocks_total)
        yield gauge("kv_cache_bytes", "Bytes of the KV cache.", stats.kv_cache_bytes)
        yield counter("generation_tokens", "Tokens generated.", stats.num_generated_tokens)
        yield counter("prompt_tokens", "Prompt tokens processed.", stats.num_prompt_tokens)
        yield counter("preemptions", "Sequences preempted under KV-cache pressure.",
                      stats.num_preemptions)


class ServingMetrics:
    """The registry and the metrics the server and its engine thread record."""

    def __init__(self, snapshot: Callable[[], tuple[EngineStats, int, int]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(snapshot))
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                              "Seconds from arrival to the first generated token.",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds",
                             "Seconds between consecutive generated tokens of a request.",
                             buckets=ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram(f"{PREFIX}_request_latency_seconds",
                             "Seconds from arrival to the last token.",
                             buckets=E2E_BUCKETS, registry=self.registry)
        self.finished = Counter(f"{PREFIX}_requests_finished", "Requests finished, by reason.",
                                ["finish_reason"], registry=self.registry)
        self.rejected = Counter(f"{PREFIX}_requests_rejected",
                                "Requests refused before generation, by HTTP status.",
                                ["status"], registry=self.registry)
        self.disconnects = Counter(f"{PREFIX}_client_disconnects",
                                   "Requests whose client went away before the answer was complete.",
                                   registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
