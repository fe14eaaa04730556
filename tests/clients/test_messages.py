"""The clients' request building and reply parsing (``clients/messages.py``), the pure
functions ``Client`` and ``AsyncClient`` share: requests from keyword options, stream
messages into typed events, replies into results. No server, no grpc."""
from __future__ import annotations

import math
import sys

import pytest

from kvserve.clients import messages as M
from kvserve.clients.generate import summary_line
from kvserve.v1 import inference_pb2 as pb


def test_generate_request_prompt_kinds_and_unset_optionals():
    r = M.generate_request("hi", temperature=0.5, top_k=3, max_new_tokens=7, stop=["\n"],
                           top_logprobs=2, attention_layers=[1], request_id="r1")
    assert r.text == "hi" and r.request_id == "r1"
    assert (r.sampling.temperature, r.sampling.top_k) == (0.5, 3)
    assert not r.sampling.HasField("top_p") and not r.sampling.HasField("seed")
    assert not r.sampling.HasField("repetition_penalty")
    assert r.stopping.max_new_tokens == 7 and list(r.stopping.stop) == ["\n"]
    assert r.response.logprobs and r.response.top_logprobs == 2  # top_logprobs implies them
    assert list(r.response.attention.layers) == [1] and r.response.coalesce
    ids = M.generate_request([5, 6, 7], top_p=0.9, seed=0, repetition_penalty=1.1)
    assert list(ids.token_ids.ids) == [5, 6, 7]
    assert ids.sampling.HasField("seed") and ids.sampling.seed == 0
    assert ids.sampling.top_p == pytest.approx(0.9)
    chat = M.generate_request([{"role": "user", "content": "yo"}])
    assert [(m.role, m.content) for m in chat.chat.messages] == [("user", "yo")]
    assert M.as_generate_request(r, {}) is r
    assert M.as_generate_request("x", {"top_k": 2}).sampling.top_k == 2


def test_generate_request_prediction():
    assert not M.generate_request("hi").HasField("prediction")
    assert M.generate_request("hi", prediction="def f():").prediction.text == "def f():"
    r = M.generate_request([1, 2], prediction=[5, 6, 7])
    assert list(r.prediction.token_ids.ids) == [5, 6, 7]


def test_score_tokenize_detokenize_requests():
    assert list(M.score_request(["a", "b"], top_logprobs=1).texts) == ["a", "b"]
    r = M.score_request(token_ids=[[1, 2], [3]], request_id="s")
    assert [list(t.ids) for t in r.token_ids] == [[1, 2], [3]] and r.request_id == "s"
    for texts, ids in ((None, None), (["a"], [[1]])):
        with pytest.raises(ValueError, match="exactly one"):
            M.score_request(texts, ids)
    assert list(M.tokenize_request(("a", "b")).texts) == ["a", "b"]
    assert [list(t.ids) for t in M.detokenize_request([(1, 2)]).token_ids] == [[1, 2]]


def _chunk(i: int, **kw) -> pb.TokenChunk:
    return pb.TokenChunk(index=i, id=10 + i, text=f"t{i}", **kw)


def test_stream_messages_become_events_and_a_completion():
    first = pb.GenerateResponse(chunk=_chunk(0, logprob=-0.5, top_logprobs=[
        pb.TopLogprob(id=3, logprob=-1.0, text="x")], logits=[0.1, 0.2],
        attention=[pb.AttentionRow(layer=1, head=0, weights=[0.25, 0.75])]),
        more=[_chunk(1, special=True)])
    evs = M.generate_events(first, logprobs=True)
    assert [(e.index, e.id, e.text) for e in evs] == [(0, 10, "t0"), (1, 11, "t1")]
    assert evs[0].logprob == -0.5 and evs[0].top_logprobs == [M.TopLogprob(3, -1.0, "x")]
    assert evs[0].logits == pytest.approx([0.1, 0.2]) and evs[1].logits is None
    assert evs[0].attention == [M.AttentionRow(1, 0, [0.25, 0.75])] and evs[1].special
    assert M.generate_events(first, logprobs=False)[0].logprob is None
    end = pb.GenerateResponse(complete=pb.Complete(
        finish_reason=pb.FINISH_REASON_STOP_TOKEN, stop_token_id=4, prompt_tokens=3,
        generated_tokens=2, text="t0", request_id="r", cached_prompt_tokens=1,
        accepted_prediction_tokens=5, rejected_prediction_tokens=3,
        timings=pb.Timings(queue_seconds=0.5, total_seconds=2.0)))
    (done,) = M.generate_events(end, logprobs=True)
    assert (done.finish_reason, done.stop_token_id, done.text) == ("stop_token", 4, "t0")
    assert (done.cached_prompt_tokens, done.accepted_prediction_tokens,
            done.rejected_prediction_tokens) == (1, 5, 3)
    assert "5 of 8 drafted from the prediction accepted" in summary_line(done)
    assert done.timings == M.Timings(0.5, 0.0, 2.0) and done.tokens == []
    length = M.completion(pb.Complete(finish_reason=pb.FINISH_REASON_LENGTH, stop_token_id=4))
    assert length.finish_reason == "length" and length.stop_token_id is None
    collect = M.Collector()
    assert [collect.add(e) for e in evs] == [None, None]
    got = collect.add(done)
    assert got.tokens == evs and got.text == "t0" and got.request_id == "r"


def test_replies_become_results():
    resp = pb.ScoreResponse(sequences=[pb.SequenceScore(
        token_count=3, tokens=[pb.ScoredToken(id=5, logprob=-1.0),
                               pb.ScoredToken(id=6, logprob=-2.0)],
        sum_logprob=-3.0, mean_logprob=-1.5, perplexity=math.exp(1.5))])
    (s,) = M.score_results(resp)
    assert s.scored_tokens == 2 and s.logprobs == [-1.0, -2.0] and s.token_count == 3
    assert M.tokenized(pb.TokenizeResponse(tokens=[pb.TokenIds(ids=[1, 2])])) == [[1, 2]]
    assert M.detokenized(pb.DetokenizeResponse(texts=["ab"])) == ["ab"]
    info = M.model_info(pb.ModelInfoResponse(vocab_size=9, eos_token_id=-1, provider="cpu"))
    assert info.eos_token_id is None and info.vocab_size == 9 and info.provider == "cpu"
    assert info.limits == {f.name: 0 for f in pb.Limits.DESCRIPTOR.fields}
    assert "max_context" in info.limits
    assert M.model_info(pb.ModelInfoResponse(eos_token_id=2)).eos_token_id == 2
    assert M.corpus_perplexity(-3.0, 2) == pytest.approx(math.exp(1.5))
    assert math.isnan(M.corpus_perplexity(0.0, 0))


def test_messages_do_not_import_grpc():
    import subprocess

    out = subprocess.run([sys.executable, "-c", "import sys, kvserve.clients.messages; "
                          "print('grpc' in sys.modules)"], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("field, value", [
    ("max_new_tokens", -1), ("top_k", -5), ("seed", -1), ("seed", 1 << 64),
    ("top_logprobs", 1 << 32), ("stop_token_ids", [3, -3])])
def test_unsigned_fields_name_themselves(field, value):
    with pytest.raises(ValueError, match=f"^{field}(\\[1\\])? must be in \\[0, "):
        M.generate_request("x", **{field: value})


@pytest.mark.parametrize("flag", ["--max-new-tokens", "--top-k", "--seed", "--logprobs"])
def test_cli_unsigned_flags_name_themselves(flag, capsys):
    from kvserve.cli import main

    with pytest.raises(SystemExit) as e:
        main(["generate", "x", flag, "-1"])
    assert e.value.code == 2 and f"argument {flag}: must be in [0, " in capsys.readouterr().err


def test_cli_attention_choices_need_attention(capsys):
    from kvserve.cli import main

    assert main(["generate", "x", "--attention-layers", "0", "--server", "127.0.0.1:9"]) == 1
    assert "give --attention" in capsys.readouterr().err
