"""Prometheus metrics through ``prometheus_client``, served over HTTP on their own port.

Names follow what serving stacks use (vLLM / TGI): queue size, running sequences, time to first
token and inter-token latency histograms, requests by outcome, tokens in and out. Each
``Metrics`` has its own ``CollectorRegistry`` (several servers in one process, as the tests make
them, do not collide in the global one), with the process, platform and GC collectors on it:
``process_cpu_seconds_total``, ``process_resident_memory_bytes``, ``python_info``, ...
"""
from __future__ import annotations

import http.server
import logging
import threading
from urllib.parse import urlparse

from prometheus_client import (CollectorRegistry, Counter, Gauge, GCCollector, Histogram,
                               MetricsHandler, PlatformCollector, ProcessCollector)

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0)


class LabelledCounter:
    """A ``prometheus_client.Counter`` called as ``inc(amount, **labels)`` / ``get(**labels)``.

    The servers count with ``metrics.requests.inc(rpc=..., outcome=...)``; labels are declared
    up front, in the order the exposition lists them (``outcome`` before ``rpc``)."""

    def __init__(self, registry: CollectorRegistry, name: str, doc: str,
                 labelnames: tuple[str, ...] = ()):
        self.counter = Counter(name, doc, labelnames, registry=registry)
        self.sample_name = name if name.endswith("_total") else name + "_total"

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        (self.counter.labels(**labels) if labels else self.counter).inc(amount)

    def get(self, **labels: str) -> float:
        """The current value for these labels; 0 for a label set never counted."""
        for metric in self.counter.collect():
            for s in metric.samples:
                if s.name == self.sample_name and s.labels == labels:
                    return s.value
        return 0.0


class Metrics:
    """The server's metrics; the engine calls the hook methods (interfaces.EngineMetrics)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        p = "kvserve_"
        self.requests = LabelledCounter(r, p + "requests_total",
                                        "finished requests by RPC and outcome", ("outcome", "rpc"))
        self.queue = Gauge(p + "queue_size", "Generate requests waiting for a batch slot",
                           registry=r)
        self.running_g = Gauge(p + "running_sequences", "sequences in the decode batch",
                               registry=r)
        hist = lambda name, doc: Histogram(p + name, doc, buckets=LATENCY_BUCKETS,  # noqa: E731
                                           registry=r)
        self.queue_time = hist("queue_time_seconds", "submitted -> admitted")
        self.ttft = hist("time_to_first_token_seconds", "submitted -> first token")
        self.itl = hist("inter_token_latency_seconds", "between consecutive tokens")
        self.step_time = hist("decode_step_seconds", "one batched decode step")
        self.tokens_in = LabelledCounter(r, p + "prompt_tokens_total", "prompt tokens admitted")
        self.tokens_out = LabelledCounter(r, p + "generated_tokens_total", "tokens generated")
        self.scored = LabelledCounter(r, p + "scored_tokens_total", "tokens scored by Score")
        self.malformed = LabelledCounter(
            r, p + "malformed_requests_total",
            "requests whose bytes are not the request message, by RPC", ("rpc",))
        self.prefix_hits = LabelledCounter(r, p + "prefix_cache_hit_tokens_total",
                                           "prompt tokens whose KV rows came from the prefix "
                                           "cache (a resumed stream's delivered tokens and "
                                           "Score's included)")
        self.prefix_bytes = Gauge(p + "prefix_cache_bytes",
                                  "memory of the prefix cache's block pool", registry=r)
        self.spec_drafted = LabelledCounter(r, p + "spec_draft_tokens_total",
                                            "speculative draft tokens verified")
        self.spec_accepted = LabelledCounter(r, p + "spec_accepted_tokens_total",
                                             "speculative draft tokens accepted")
        self.forced_tokens = LabelledCounter(r, p + "constraint_forced_tokens_total",
                                             "tokens a constraint forced, fed as a draft and "
                                             "accepted (no decode step of their own)")
        self.failures = LabelledCounter(r, p + "engine_iteration_failures_total",
                                        "engine iterations that raised (the log has each "
                                        "traceback)")
        self.restarts = LabelledCounter(r, p + "restarted_requests_total",
                                        "requests re-admitted from their delivered tokens "
                                        "after a failed engine iteration")

    # engine hooks
    def queue_depth(self, n: int) -> None:
        self.queue.set(n)

    def running(self, n: int) -> None:
        self.running_g.set(n)

    def admitted(self, queue_seconds: float, prompt_tokens: int) -> None:
        self.queue_time.observe(queue_seconds)
        self.tokens_in.inc(prompt_tokens)

    def token(self, first: bool, seconds: float) -> None:
        (self.ttft if first else self.itl).observe(seconds)
        self.tokens_out.inc()

    def finished(self, reason: str, generated: int) -> None:
        self.requests.inc(rpc="Generate", outcome=reason)

    def step(self, batch: int, seconds: float) -> None:
        self.step_time.observe(seconds)

    def prefix_hit(self, tokens: int) -> None:
        if tokens:
            self.prefix_hits.inc(tokens)

    def speculated(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.spec_drafted.inc(drafted)
            self.spec_accepted.inc(accepted)

    def fast_forwarded(self, tokens: int) -> None:
        if tokens:
            self.forced_tokens.inc(tokens)

    def iteration_failed(self, restarted: int) -> None:
        self.failures.inc()
        if restarted:
            self.restarts.inc(restarted)


class MetricsServer:
    """GET /metrics on its own port, in a daemon thread (other paths: 404). The body is the
    text format 0.0.4 by default, OpenMetrics when the scraper asks for it."""

    def __init__(self, metrics: Metrics, host: str, port: int):
        base = MetricsHandler.factory(metrics.registry)

        class Handler(base):
            def do_GET(self):  # noqa: N802
                if urlparse(self.path).path != "/metrics":
                    self.send_error(404)
                    return
                super().do_GET()

        self.httpd = http.server.ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="kvserve-metrics",
                                       daemon=True)

    def start(self) -> None:
        self.thread.start()
        log.info("metrics on http://%s:%d/metrics", self.httpd.server_address[0], self.port)

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
