"""Soak: 10,000 mixed requests over loopback against a ``kvserve serve`` subprocess (the tiny
artifact), 16 client threads.

The mix: short streams (1-4 tokens, greedy and sampled, some with stop strings), Score, Tokenize,
Detokenize, ModelInfo, streams cancelled after their first token or before any, calls with a
deadline too short to finish, and bad inputs. Every status code is counted per request kind and
must be one that kind expects; the server's RSS (VmRSS of the process) after the warm-up (the
first 1,000 requests) may grow by less than 10% by the end; the server is SERVING at the end.

CI runs 10,000 requests and must finish them within 150 s (about 10 s on 2 shared cores).
A longer soak: ``KVSERVE_SOAK_REQUESTS=200000 KVSERVE_SOAK_SECONDS=3600 pytest
tests/hardening/test_soak.py``.
"""
from __future__ import annotations

import collections
import os
import random
import threading
import time

import grpc

from hardening_helpers import SERVING, gen_request, health, served, scrape

from kvserve.v1 import inference_pb2 as pb
from kvserve.v1 import inference_pb2_grpc as pb_grpc

REQUESTS = int(os.environ.get("KVSERVE_SOAK_REQUESTS", "10000"))
SECONDS = float(os.environ.get("KVSERVE_SOAK_SECONDS", "150"))
WARMUP = min(1000, REQUESTS // 10)
THREADS = 16
OK, C = grpc.StatusCode.OK, grpc.StatusCode
TEXTS = ["def add(a, b):", "naïve café", "日本語 😀", "for i in range(3):\n", "x", "class P:"]

EXPECTED = {
    "generate": {OK},
    "generate_stop": {OK},
    "score": {OK},
    "tokenize": {OK},
    "detokenize": {OK},
    "model_info": {OK},
    "cancel_after_first": {OK, C.CANCELLED},  # OK: the stream ended before the cancel
    "cancel_at_once": {OK, C.CANCELLED},
    "deadline": {OK, C.DEADLINE_EXCEEDED},
    "bad_generate": {C.INVALID_ARGUMENT},
    "bad_score": {C.INVALID_ARGUMENT},
    "bad_detokenize": {C.INVALID_ARGUMENT},
}
KINDS = list(EXPECTED)
WEIGHTS = [30, 6, 12, 10, 6, 3, 8, 4, 5, 8, 4, 4]


def _drain(call) -> int:
    n = 0
    for msg in call:
        n += msg.HasField("chunk")
    return n


def one(stub, kind: str, rnd: random.Random) -> grpc.StatusCode:
    text = rnd.choice(TEXTS)
    n = rnd.randint(1, 4)
    sampling = pb.SamplingOptions(temperature=rnd.choice([0.0, 0.8]), top_k=rnd.choice([0, 20]),
                                  seed=rnd.randrange(1 << 32))
    try:
        if kind == "generate":
            got = _drain(stub.Generate(gen_request(text, n, sampling=sampling), timeout=60))
            assert got == n, (got, n)
        elif kind == "generate_stop":
            _drain(stub.Generate(gen_request(text, n, sampling=sampling, stop=["\n", "a"]),
                                 timeout=60))
        elif kind == "score":
            r = stub.Score(pb.ScoreRequest(texts=[text, text + " x"][:rnd.randint(1, 2)],
                                           top_logprobs=rnd.choice([0, 2])), timeout=60)
            assert r.sequences
        elif kind == "tokenize":
            assert stub.Tokenize(pb.TokenizeRequest(texts=[text]), timeout=60).tokens
        elif kind == "detokenize":
            ids = [rnd.randrange(256) for _ in range(rnd.randint(1, 8))]
            stub.Detokenize(pb.DetokenizeRequest(token_ids=[pb.TokenIds(ids=ids)]), timeout=60)
        elif kind == "model_info":
            assert stub.ModelInfo(pb.ModelInfoRequest(), timeout=60).vocab_size
        elif kind == "cancel_after_first":
            call = stub.Generate(gen_request(text, 4), timeout=60)
            next(call)
            call.cancel()
            _drain(call)
        elif kind == "cancel_at_once":
            call = stub.Generate(gen_request(text, 4), timeout=60)
            call.cancel()
            _drain(call)
        elif kind == "deadline":
            _drain(stub.Generate(gen_request(text, 4), timeout=rnd.choice([0.0005, 0.002, 0.5])))
        elif kind == "bad_generate":
            bad = rnd.choice([dict(max_new_tokens=5000), dict(prompt=""),
                              dict(sampling=pb.SamplingOptions(top_p=float("nan"))),
                              dict(sampling=pb.SamplingOptions(temperature=-1)),
                              dict(prompt=[10**6])])
            req = gen_request(bad.get("prompt", text), bad.get("max_new_tokens", n),
                              sampling=bad.get("sampling"))
            _drain(stub.Generate(req, timeout=60))
        elif kind == "bad_score":
            stub.Score(pb.ScoreRequest(texts=["a"] * 40), timeout=60)
        elif kind == "bad_detokenize":
            stub.Detokenize(pb.DetokenizeRequest(token_ids=[pb.TokenIds(ids=[1 << 30])]),
                            timeout=60)
        return OK
    except grpc.RpcError as e:
        return e.code()


def test_soak_mixed_requests(artifact, tmp_path):
    with served(artifact.dir, tmp_path, "--metrics-port", "0",
                env={"KVSERVE_LOG_LEVEL": "WARNING"}) as s:
        stub = pb_grpc.InferenceStub(s.channel)
        lock = threading.Lock()
        state = {"next": 0, "done": 0, "rss_warm": None}
        codes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        failures: list[str] = []
        end = time.monotonic() + SECONDS

        def worker(w: int) -> None:
            while True:
                with lock:
                    i = state["next"]
                    if i >= REQUESTS or time.monotonic() > end:
                        return
                    state["next"] += 1
                rnd = random.Random(i)
                kind = rnd.choices(KINDS, WEIGHTS)[0]
                try:
                    code = one(stub, kind, rnd)
                except Exception as e:  # noqa: BLE001  (a wrong answer, not a status)
                    failures.append(f"{kind} #{i}: {type(e).__name__}: {e}")
                    code = None
                with lock:
                    codes[kind][code] += 1
                    state["done"] += 1
                    if state["done"] == WARMUP:
                        state["rss_warm"] = s.rss_kib()

        t0 = time.monotonic()
        threads = [threading.Thread(target=worker, args=(w,)) for w in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - t0
        rss_end = s.rss_kib()
        done = state["done"]
        summary = {k: {c.name if c else "wrong": n for c, n in v.items()}
                   for k, v in codes.items()}
        print(f"soak: {done} requests in {elapsed:.1f}s ({done / elapsed:.0f}/s), RSS after "
              f"warm-up {state['rss_warm']} KiB, at the end {rss_end} KiB; {summary}")
        assert not failures, failures[:5]
        assert done >= REQUESTS, f"only {done} of {REQUESTS} requests in {SECONDS:.0f} s"
        for kind, counter in codes.items():
            unexpected = set(counter) - EXPECTED[kind]
            assert not unexpected, (kind, summary[kind])
        assert set(codes) == set(KINDS)  # every kind ran
        assert rss_end < 1.10 * state["rss_warm"], (state["rss_warm"], rss_end)
        assert health(s.channel) == SERVING
        m = scrape(s.metrics_port)
        assert m["kvserve_running_sequences"] == 0 and m["kvserve_queue_size"] == 0
        assert s.proc.poll() is None
