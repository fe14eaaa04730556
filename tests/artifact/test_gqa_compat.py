"""Fused artifacts on an onnxruntime whose GroupQueryAttention has no ``query_seqlens``
(before 1.32; ``artifact.gqa_compat``): the graph loses the input in memory only, and the
engine over such a runner (padding counted, multi-token calls with a past made a row at a
time) gives the tokens of the normal runner with every speed feature on. The runner tests
(``lm``'s ``fused-padding-counted``) cover the calls themselves."""
from __future__ import annotations

import hashlib

import numpy as np
import onnx
import pytest

from kvserve.artifact import gqa_compat
from kvserve.artifact.fused import FusedLM


def test_this_onnxruntime_takes_query_seqlens():
    """The project's pinned onnxruntime (>= 1.32) has the input: the normal path by default."""
    assert gqa_compat.gqa_takes_query_seqlens()


def test_the_graph_loses_the_input_in_memory_only(artifacts):
    path = artifacts["fused"] / "model.onnx"
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    model = onnx.load(str(path), load_external_data=False)
    gqa = [n for n in model.graph.node if n.op_type == gqa_compat.GQA]
    assert gqa and all(len(n.input) == 17 for n in gqa)
    assert gqa_compat.without_query_seqlens(model) == len(gqa)
    assert all(len(n.input) <= 16 and "query_seqlens" not in n.input for n in gqa)
    lm = FusedLM(artifacts["fused"], provider="cpu", threads=1, attention=False,
                 padding_counted=True)
    kv = lm.new_cache(1)
    assert lm.prefill(kv, 0, [[1, 2, 3]], last=True).logits[0].shape == (1, lm.cfg.vocab_size)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before


def test_the_engine_gives_the_normal_runners_tokens(artifact):
    """The CUDA check's workload (a shared prefix twice, repeating phrases, seeded sampling, a
    long prompt fed in chunks while two stream) on the tiny served artifact: the engine over a
    padding-counted runner, features on and off, against the normal runner with them off."""
    from kvserve.bench import cuda_engine as E

    cfg = artifact.cfg
    waves = E.workload(cfg.vocab_size, cfg.max_seq_len, chunk=64)
    assert any(w.get("long") for w in waves)
    out, counts = {}, None
    for name, on, counted in (("normal", False, False), ("counted-on", True, True),
                              ("counted-off", False, True)):
        e = E.engine(artifact.dir, "cpu", 1, on, chunk=64, padding_counted=counted)
        try:
            out[name] = E.run_workload(e, waves)
            if on:
                counts = E.counters(e)
        finally:
            e.stop()
    assert counts["cached_prompt_tokens"] > 0 and counts["accepted"] > 0, counts
    for name in ("counted-on", "counted-off"):
        res = E.compare(out[name], out["normal"])
        assert res["tokens_equal"] and not res["errors"], (name, res)
        assert res["max_abs_logprob"] <= E.LOGPROB_TOL, (name, res)


def test_a_ragged_verification_equals_the_normal_runners(artifacts):
    """Rows of 1-5 tokens after different pasts, in one call (normal) and a row at a time
    (padding counted): the same logits and rows."""
    a = FusedLM(artifacts["fused"], provider="cpu", threads=1, attention=False)
    b = FusedLM(artifacts["fused"], provider="cpu", threads=1, attention=False,
                padding_counted=True)
    V = a.cfg.vocab_size
    g = np.random.default_rng(4)
    prompts = [g.integers(0, V, n).tolist() for n in (7, 3, 12)]
    rows = [g.integers(0, V, n).tolist() for n in (5, 1, 3)]
    got = []
    for lm in (a, b):
        kv = lm.new_cache(3)
        lm.prefill(kv, 0, prompts, last=True)
        lm.prefill(kv, 0, [[5, 6], [7], [8, 9, 10]], last=True)  # (a past: row at a time)
        logits = lm.verify(kv, 3, rows).copy()
        got.append(([logits[i, :len(r)] for i, r in enumerate(rows)], kv.used[:3].copy()))
    assert list(got[0][1]) == list(got[1][1]) == [14, 5, 18]
    for x, y in zip(got[0][0], got[1][0]):
        assert np.abs(x - y).max() <= 1e-4


def test_a_failed_row_leaves_the_slots_as_they_were(artifacts, monkeypatch):
    """Calls made a row at a time are all or none: a failure on the second row puts back the
    first one's row count, as one call's failure leaves them; an empty prompt is refused
    before anything runs."""
    lm = FusedLM(artifacts["fused"], provider="cpu", threads=1, attention=False,
                 padding_counted=True)
    kv = lm.new_cache(2)
    lm.prefill(kv, 0, [[1, 2, 3], [4, 5]], last=True)
    for name in ("_run", "_verify"):
        real = getattr(lm, name)

        def second_fails(kv_, lo, *a, real=real, **kw):
            if lo == 1:
                raise RuntimeError("injected")
            return real(kv_, lo, *a, **kw)
        monkeypatch.setattr(lm, name, second_fails)
    with pytest.raises(RuntimeError, match="injected"):
        lm.prefill(kv, 0, [[6, 7], [8, 9, 10]], last=True)
    assert list(kv.used[:2]) == [3, 2]
    with pytest.raises(RuntimeError, match="injected"):
        lm.verify(kv, 2, [[6, 7], [8, 9]])
    assert list(kv.used[:2]) == [3, 2]
    with pytest.raises(ValueError, match="non-empty prompt"):
        lm.prefill(kv, 0, [[6], []], last=True)
    assert list(kv.used[:2]) == [3, 2]


def test_a_cache_the_device_cannot_attend_over_is_refused_saying_why(artifacts, monkeypatch):
    """Where onnxruntime reads the KV inputs somewhere other than the provider's device (a
    float32 cache on onnxruntime-gpu 1.31.1: no CUDA GroupQueryAttention for it), the runner
    refuses at load, naming the way out, and ``kvserve serve``'s loader reports it as an
    artifact it cannot load (one line, exit 1)."""
    import kvserve.artifact.fused as F
    from kvserve.server.app import App, ArtifactError
    from kvserve.server.config import ServerConfig

    monkeypatch.setattr(F, "device_of", lambda providers: "cuda")
    monkeypatch.setattr(F, "input_homes", lambda sess, device: {
        i.name: "cpu" for i in sess.get_inputs()})
    with pytest.raises(RuntimeError, match="no cuda GroupQueryAttention kernel for its "
                                           "float32 cache.*on CUDA: --precision fp16, or "
                                           "--portable for fp32"):
        FusedLM(artifacts["fused"], provider="cpu", threads=1, attention=False)
    app = App(str(artifacts["fused"]), ServerConfig(provider="cpu", threads=1))
    with pytest.raises(ArtifactError, match="cannot load .*GroupQueryAttention kernel"):
        app.load()
