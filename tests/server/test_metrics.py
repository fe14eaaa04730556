"""server/metrics.py on prometheus_client: the exposition's names and label order (what the
deploy's Prometheus and the tests scrape), counter values, process metrics, one registry per
instance, and the endpoint (GET /metrics, other paths 404)."""
from __future__ import annotations

import re
import urllib.error
import urllib.request

import pytest

from kvserve.server.metrics import Metrics, MetricsServer


def scrape(port: int, path: str = "/metrics", accept: str | None = None):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                 headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(req, timeout=5) as r:
        return r.headers["Content-Type"], r.read().decode()


def value(body: str, sample: str) -> float:
    m = re.search("^" + re.escape(sample) + r" (\S+)$", body, re.M)
    assert m, f"{sample} not in the exposition"
    return float(m.group(1))


@pytest.fixture
def served():
    m = Metrics()
    srv = MetricsServer(m, "127.0.0.1", 0)
    srv.start()
    yield m, srv
    srv.stop()


def test_hooks_render_the_same_names_and_labels(served):
    m, srv = served
    m.queue_depth(3)
    m.running(2)
    m.admitted(0.004, 7)
    m.admitted(0.2, 5)
    for first, dt in ((True, 0.03), (False, 0.002), (False, 0.002)):
        m.token(first, dt)
    m.finished("length", 3)
    m.finished("length", 1)
    m.finished("stop", 1)
    m.step(2, 0.002)
    m.requests.inc(rpc="Score", outcome="ok")
    m.malformed.inc(rpc="Generate")
    m.scored.inc(11)
    m.speculated(4, 3)
    m.speculated(0, 0)
    m.fast_forwarded(5)
    m.fast_forwarded(0)
    m.iteration_failed(3)
    m.iteration_failed(0)
    ctype, body = scrape(srv.port)
    assert ctype == "text/plain; version=0.0.4; charset=utf-8"
    assert value(body, "kvserve_queue_size") == 3
    assert value(body, "kvserve_running_sequences") == 2
    assert value(body, "kvserve_prompt_tokens_total") == 12
    assert value(body, "kvserve_generated_tokens_total") == 3
    assert value(body, "kvserve_scored_tokens_total") == 11
    assert value(body, "kvserve_spec_draft_tokens_total") == 4
    assert value(body, "kvserve_spec_accepted_tokens_total") == 3
    assert value(body, "kvserve_constraint_forced_tokens_total") == 5
    assert value(body, "kvserve_engine_iteration_failures_total") == 2
    assert value(body, "kvserve_restarted_requests_total") == 3
    assert value(body, 'kvserve_requests_total{outcome="length",rpc="Generate"}') == 2
    assert value(body, 'kvserve_requests_total{outcome="stop",rpc="Generate"}') == 1
    assert value(body, 'kvserve_requests_total{outcome="ok",rpc="Score"}') == 1
    assert value(body, 'kvserve_malformed_requests_total{rpc="Generate"}') == 1
    # histograms: cumulative buckets, count and sum
    assert value(body, 'kvserve_queue_time_seconds_bucket{le="0.005"}') == 1
    assert value(body, 'kvserve_queue_time_seconds_bucket{le="0.25"}') == 2
    assert value(body, 'kvserve_queue_time_seconds_bucket{le="+Inf"}') == 2
    assert value(body, "kvserve_queue_time_seconds_sum") == pytest.approx(0.204, abs=1e-12)
    assert value(body, "kvserve_time_to_first_token_seconds_count") == 1
    assert value(body, "kvserve_inter_token_latency_seconds_count") == 2
    assert value(body, "kvserve_decode_step_seconds_count") == 1
    # what prometheus_client brings: process and interpreter metrics
    assert value(body, "process_resident_memory_bytes") > 1e6
    assert value(body, "process_cpu_seconds_total") > 0
    assert 'python_info{implementation="CPython"' in body
    # the in-process reads the tests use
    assert m.requests.get(rpc="Generate", outcome="length") == 2
    assert m.requests.get(rpc="Generate", outcome="cancelled") == 0
    assert m.tokens_in.get() == 12


def test_instances_have_their_own_registry():
    a, b = Metrics(), Metrics()  # no "Duplicated timeseries" from a shared global registry
    a.finished("length", 1)
    assert a.requests.get(rpc="Generate", outcome="length") == 1
    assert b.requests.get(rpc="Generate", outcome="length") == 0


def test_endpoint_paths_and_openmetrics(served):
    m, srv = served
    m.finished("length", 1)
    _, body = scrape(srv.port, "/metrics?x=1")  # a query string is the same endpoint
    assert value(body, 'kvserve_requests_total{outcome="length",rpc="Generate"}') == 1
    with pytest.raises(urllib.error.HTTPError) as e:
        scrape(srv.port, "/")
    assert e.value.code == 404
    ctype, body = scrape(srv.port, accept="application/openmetrics-text; version=1.0.0")
    assert ctype.startswith("application/openmetrics-text")
    assert body.rstrip().endswith("# EOF")
