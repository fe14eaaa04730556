"""Prometheus metrics in the text exposition format (0.0.4), served over HTTP. No dependency.

Names follow what serving stacks use (vLLM / TGI): queue size, running sequences, time to first
token and inter-token latency histograms, requests by outcome, tokens in and out.
"""
from __future__ import annotations

import bisect
import http.server
import logging
import threading

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0)


def _labels(d: dict[str, str]) -> str:
    if not d:
        return ""
    inner = ",".join(f'{k}="{_esc(v)}"' for k, v in sorted(d.items()))
    return "{" + inner + "}"


def _esc(v: str) -> str:
    return str(v).replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


class _Metric:
    kind = ""

    def __init__(self, name: str, help_: str):
        self.name, self.help = name, help_
        self.lock = threading.Lock()

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help_: str):
        super().__init__(name, help_)
        self.values: dict[tuple, float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self.lock:
            self.values[key] = self.values.get(key, 0.0) + amount

    def get(self, **labels: str) -> float:
        return self.values.get(tuple(sorted(labels.items())), 0.0)

    def render(self) -> list[str]:
        with self.lock:
            items = list(self.values.items()) or [((), 0.0)]
        return self.header() + [f"{self.name}{_labels(dict(k))} {v:g}" for k, v in items]


class Gauge(_Metric):
    kind = "gauge"

    def __init__(self, name: str, help_: str):
        super().__init__(name, help_)
        self.value = 0.0

    def set(self, v: float) -> None:
        self.value = float(v)

    def render(self) -> list[str]:
        return self.header() + [f"{self.name} {self.value:g}"]


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help_: str, buckets=LATENCY_BUCKETS):
        super().__init__(name, help_)
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        with self.lock:
            self.counts[bisect.bisect_left(self.buckets, v)] += 1
            self.sum += v
            self.count += 1

    def render(self) -> list[str]:
        with self.lock:
            counts, s, c = list(self.counts), self.sum, self.count
        out, acc = self.header(), 0
        for b, n in zip(self.buckets, counts):
            acc += n
            out.append(f'{self.name}_bucket{{le="{b:g}"}} {acc}')
        out.append(f'{self.name}_bucket{{le="+Inf"}} {c}')
        out += [f"{self.name}_sum {s:g}", f"{self.name}_count {c}"]
        return out


class Metrics:
    """The server's metrics; the engine calls the hook methods (interfaces.EngineMetrics)."""

    def __init__(self) -> None:
        p = "kvserve_"
        self.requests = Counter(p + "requests_total", "finished requests by RPC and outcome")
        self.queue = Gauge(p + "queue_size", "Generate requests waiting for a batch slot")
        self.running_g = Gauge(p + "running_sequences", "sequences in the decode batch")
        self.queue_time = Histogram(p + "queue_time_seconds", "submitted -> admitted")
        self.ttft = Histogram(p + "time_to_first_token_seconds", "submitted -> first token")
        self.itl = Histogram(p + "inter_token_latency_seconds", "between consecutive tokens")
        self.step_time = Histogram(p + "decode_step_seconds", "one batched decode step")
        self.tokens_in = Counter(p + "prompt_tokens_total", "prompt tokens admitted")
        self.tokens_out = Counter(p + "generated_tokens_total", "tokens generated")
        self.scored = Counter(p + "scored_tokens_total", "tokens scored by Score")
        self.malformed = Counter(p + "malformed_requests_total",
                                 "requests whose bytes are not the request message, by RPC")
        self.all = [self.requests, self.queue, self.running_g, self.queue_time, self.ttft,
                    self.itl, self.step_time, self.tokens_in, self.tokens_out, self.scored,
                    self.malformed]

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

    def render(self) -> str:
        lines: list[str] = []
        for m in self.all:
            lines += m.render()
        return "\n".join(lines) + "\n"


class MetricsServer:
    """GET /metrics on its own port, in a daemon thread."""

    def __init__(self, metrics: Metrics, host: str, port: int):
        m = metrics

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404)
                    return
                body = m.render().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):  # quiet
                pass

        self.httpd = http.server.ThreadingHTTPServer((host, port), H)
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
