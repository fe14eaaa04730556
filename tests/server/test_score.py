"""Score, Tokenize, Detokenize, ModelInfo against torch / the tokenizer."""
from __future__ import annotations

import json

import grpc
import numpy as np
import pytest

from kvserve_testing import collect, gen_request, running_app, torch_generate, torch_logprobs, torch_step_logits
from kvserve.model.sampling import log_softmax
from kvserve.v1 import inference_pb2 as pb
from kvserve.v1 import inference_pb2_grpc as pb_grpc

TEXTS = ["def add(a, b):\n    return a + b\n", "naïve café 日本語", "x"]


def check_scores(resp, artifact, seqs, top_n=0):
    assert len(resp.sequences) == len(seqs)
    for s, ids in zip(resp.sequences, seqs):
        assert s.token_count == len(ids)
        assert [t.id for t in s.tokens] == list(ids[1:])
        ref = torch_logprobs(artifact.model, ids) if len(ids) > 1 else np.zeros(0)
        np.testing.assert_allclose([t.logprob for t in s.tokens], ref, atol=1e-4)
        assert s.sum_logprob == pytest.approx(float(ref.sum()), abs=1e-3)
        if len(ids) > 1:
            assert s.mean_logprob == pytest.approx(float(ref.mean()), abs=1e-4)
            assert s.perplexity == pytest.approx(float(np.exp(-ref.mean())), rel=1e-4)
        if top_n:
            import torch
            with torch.no_grad():
                lp = log_softmax(artifact.model(torch.tensor([list(ids)])).logits[0].numpy())
            for j, t in enumerate(s.tokens):
                assert len(t.top_logprobs) == top_n
                np.testing.assert_allclose([x.logprob for x in t.top_logprobs],
                                           np.sort(lp[j])[::-1][:top_n], atol=1e-4)


def test_score_texts_vs_torch(stub, artifact):
    resp = stub.Score(pb.ScoreRequest(texts=TEXTS, top_logprobs=3))
    check_scores(resp, artifact, [artifact.tokenizer.encode(t) for t in TEXTS], top_n=3)


def test_score_token_ids_vs_torch(stub, artifact):
    seqs = [[5, 9, 13, 200, 7], list(range(40, 120))]
    resp = stub.Score(pb.ScoreRequest(token_ids=[pb.TokenIds(ids=s) for s in seqs]))
    check_scores(resp, artifact, seqs)


@pytest.mark.parametrize("req,msg", [
    # the other cases are in tests/hardening/test_bad_input.py (the full matrix)
    (pb.ScoreRequest(token_ids=[pb.TokenIds(ids=[1, 10**6])]), "vocabulary"),
    (pb.ScoreRequest(token_ids=[pb.TokenIds(ids=[1] * 300)]), "limit"),
    (pb.ScoreRequest(texts=["a"] * 100), "sequences"),
    (pb.ScoreRequest(texts=["ab"], top_logprobs=999), "top_logprobs"),
])
def test_score_invalid(stub, req, msg):
    with pytest.raises(grpc.RpcError) as e:
        stub.Score(req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert msg in e.value.details()


def test_chunked_prefill_for_score_and_generate(artifact):
    """With a logits cap of 8 tokens x vocab (and generation prefill chunks of 8), Score and
    Generate prefill 8 tokens and feed the rest in chunks of 8 through the decode graph: same
    numbers as torch, never a (T, V) array beyond the cap."""
    V = artifact.cfg.vocab_size
    with running_app(artifact, score_chunk_floats=8 * V, prefill_chunk_tokens=8) as app:
        assert app.engine.chunk_tokens == app.engine.prefill_tokens() == 8
        ch = grpc.insecure_channel(f"127.0.0.1:{app.port}")
        stub = pb_grpc.InferenceStub(ch)
        seqs = [list(range(3, 60)), [7, 8, 9], list(range(100, 120))]
        resp = stub.Score(pb.ScoreRequest(token_ids=[pb.TokenIds(ids=s) for s in seqs],
                                          top_logprobs=2))
        check_scores(resp, artifact, seqs, top_n=2)
        prompt = list(range(10, 40))
        chunks, done = collect(stub.Generate(gen_request(prompt, 10, logprobs=True)))
        assert [c.id for c in chunks] == torch_generate(artifact.model, prompt, 10)
        ref = log_softmax(torch_step_logits(artifact.model, prompt))
        assert chunks[0].logprob == pytest.approx(float(ref[chunks[0].id]), abs=1e-4)
        assert done.prompt_tokens == 30
        ch.close()


def test_tokenize_detokenize_roundtrip(stub, artifact):
    texts = ["hello naïve 😀", "", "def f():\n\treturn 1"]
    toks = stub.Tokenize(pb.TokenizeRequest(texts=texts)).tokens
    assert [list(t.ids) for t in toks] == [artifact.tokenizer.encode(t) for t in texts]
    back = stub.Detokenize(pb.DetokenizeRequest(token_ids=toks)).texts
    assert list(back) == texts
    with pytest.raises(grpc.RpcError) as e:
        stub.Detokenize(pb.DetokenizeRequest(token_ids=[pb.TokenIds(ids=[10**6])]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_model_info(stub, artifact):
    info = stub.ModelInfo(pb.ModelInfoRequest())
    assert json.loads(info.config_json) == artifact.cfg.to_dict()
    assert (info.vocab_size, info.n_layers, info.n_heads) == (
        artifact.cfg.vocab_size, artifact.cfg.n_layers, artifact.cfg.n_heads)
    assert info.eos_token_id == artifact.cfg.eos_token_id
    assert info.provider == "CPUExecutionProvider"
    assert set(info.graphs) == {"model", "model_attn"}
    assert len(info.manifest_sha256) == 64 and info.attention_available
    assert info.limits.max_context == artifact.cfg.max_seq_len
    assert info.limits.max_batch == 4
