"""Generate through a real gRPC server on loopback vs the torch reference (model/generate.py)."""
from __future__ import annotations

import concurrent.futures

import grpc
import numpy as np
import pytest
import torch

from kvserve_testing import collect, gen_request, to_params, torch_generate, torch_step_logits
from kvserve.model.sampling import log_softmax
from kvserve.v1 import inference_pb2 as pb

PROMPTS = ["def add(a, b):", "naïve café", "class Point:\n", "for i in range(10):\n    print("]


def test_stream_shape_and_greedy_matches_torch(stub, artifact):
    ids = artifact.tokenizer.encode(PROMPTS[0])
    chunks, done = collect(stub.Generate(gen_request(PROMPTS[0], 24)))
    assert [c.index for c in chunks] == list(range(24))
    assert [c.id for c in chunks] == torch_generate(artifact.model, ids, 24)
    assert done.finish_reason == pb.FINISH_REASON_LENGTH
    assert (done.prompt_tokens, done.generated_tokens) == (len(ids), 24)
    assert done.text == "".join(c.text for c in chunks)
    t = done.timings
    assert 0 <= t.queue_seconds <= t.time_to_first_token_seconds <= t.total_seconds


def test_token_id_prompt_equals_text_prompt(stub, artifact):
    ids = artifact.tokenizer.encode(PROMPTS[2])
    a, _ = collect(stub.Generate(gen_request(PROMPTS[2], 8)))
    b, _ = collect(stub.Generate(gen_request(ids, 8)))
    assert [c.id for c in a] == [c.id for c in b]


SAMPLINGS = [
    pb.SamplingOptions(),  # greedy
    pb.SamplingOptions(temperature=0.9, seed=7),
    pb.SamplingOptions(temperature=1.3, top_k=20, seed=11),
    pb.SamplingOptions(temperature=0.8, top_p=0.9, seed=3),
    pb.SamplingOptions(temperature=1.0, min_p=0.05, seed=5),
    pb.SamplingOptions(temperature=0.7, top_k=40, top_p=0.95, min_p=0.01,
                       repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3,
                       seed=123456789012345),
    pb.SamplingOptions(repetition_penalty=1.5, frequency_penalty=0.8),  # greedy + penalties
]


@pytest.mark.parametrize("i", range(len(SAMPLINGS)))
def test_sampling_alone_matches_torch(stub, artifact, i):
    s = SAMPLINGS[i]
    prompt = PROMPTS[i % len(PROMPTS)]
    ids = artifact.tokenizer.encode(prompt)
    chunks, _ = collect(stub.Generate(gen_request(prompt, 20, sampling=s)))
    assert [c.id for c in chunks] == torch_generate(artifact.model, ids, 20, to_params(s))


def test_busy_batch_each_request_matches_torch_alone(stub, artifact):
    """Requests with different prompts, lengths and params, all in flight together (more than
    max_batch, so some join while others decode): each equals its torch run alone."""
    jobs = []
    for k in range(10):
        s = SAMPLINGS[k % len(SAMPLINGS)]
        prompt = PROMPTS[k % len(PROMPTS)] * (1 + k % 3)
        jobs.append((prompt, s, 6 + 5 * (k % 4)))
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futs = [pool.submit(lambda j: collect(stub.Generate(gen_request(j[0], j[2],
                                                                        sampling=j[1]))), j)
                for j in jobs]
        results = [f.result(timeout=120) for f in futs]
    for (prompt, s, n), (chunks, done) in zip(jobs, results):
        ids = artifact.tokenizer.encode(prompt)
        assert [c.id for c in chunks] == torch_generate(artifact.model, ids, n, to_params(s))
        assert done.generated_tokens == n


def test_unseeded_sampling_runs(stub):
    chunks, done = collect(stub.Generate(gen_request(
        "x", 10, sampling=pb.SamplingOptions(temperature=1.0, top_k=5))))
    assert len(chunks) == 10 and done.finish_reason == pb.FINISH_REASON_LENGTH


def test_logprobs_top_n_and_logits_match_torch(stub, artifact):
    prompt = PROMPTS[1]
    ids = artifact.tokenizer.encode(prompt)
    s = pb.SamplingOptions(temperature=1.0, seed=42)
    chunks, _ = collect(stub.Generate(gen_request(prompt, 12, sampling=s, logprobs=True,
                                                  top_logprobs=5, return_logits=True)))
    ctx = list(ids)
    V = artifact.cfg.vocab_size
    for c in chunks:
        ref = torch_step_logits(artifact.model, ctx)
        np.testing.assert_allclose(np.array(c.logits, np.float32), ref, atol=1e-4)
        lp = log_softmax(ref)
        assert c.logprob == pytest.approx(float(lp[c.id]), abs=1e-4)
        assert len(c.top_logprobs) == 5
        top_lp = [t.logprob for t in c.top_logprobs]
        assert top_lp == sorted(top_lp, reverse=True)
        np.testing.assert_allclose(top_lp, np.sort(lp)[::-1][:5], atol=1e-4)
        for t in c.top_logprobs:
            assert 0 <= t.id < V and t.logprob == pytest.approx(float(lp[t.id]), abs=1e-4)
        ctx.append(c.id)


def test_attention_rows_match_torch(stub, artifact):
    prompt = PROMPTS[3]
    ids = artifact.tokenizer.encode(prompt)
    layers, heads = [0, 1], [0, 3]
    chunks, _ = collect(stub.Generate(gen_request(
        prompt, 6, attention=pb.AttentionOptions(layers=layers, heads=heads))))
    ctx = list(ids)
    for k, c in enumerate(chunks):
        with torch.no_grad():
            att = artifact.model(torch.tensor([ctx]), output_attentions=True).attentions
        got = {(a.layer, a.head): np.array(a.weights) for a in c.attention}
        assert set(got) == {(la, h) for la in layers for h in heads}
        for (la, h), row in got.items():
            assert row.shape == (len(ids) + k,)
            np.testing.assert_allclose(row, att[la][0, h, -1].numpy(), atol=1e-5)
        ctx.append(c.id)


def test_attention_all_heads_inside_a_busy_batch(stub, artifact):
    """An attention request batched with plain ones: rows still match, others unaffected."""
    prompt = PROMPTS[0]
    ids = artifact.tokenizer.encode(prompt)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        fa = pool.submit(lambda: collect(stub.Generate(gen_request(
            prompt, 5, attention=pb.AttentionOptions(layers=[1])))))
        fb = [pool.submit(lambda p=p: collect(stub.Generate(gen_request(p, 15))))
              for p in PROMPTS[1:3]]
        chunks, _ = fa.result(60)
        others = [f.result(60) for f in fb]
    ctx = list(ids)
    for c in chunks:
        assert len(c.attention) == artifact.cfg.n_heads
        with torch.no_grad():
            att = artifact.model(torch.tensor([ctx]), output_attentions=True).attentions[1]
        for a in c.attention:
            np.testing.assert_allclose(a.weights, att[0, a.head, -1].numpy(), atol=1e-5)
        ctx.append(c.id)
    for p, (oc, _) in zip(PROMPTS[1:3], others):
        assert [c.id for c in oc] == torch_generate(artifact.model,
                                                    artifact.tokenizer.encode(p), 15)


def _is_partial_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def test_utf8_deltas_never_split_a_character(stub, artifact, app):
    """Random sampling emits byte tokens that split characters: each delta is whole, and the
    deltas add up to the tokenizer's decode of all ids (no extra U+FFFD)."""
    seen_partial = False
    for seed in range(6):
        chunks, done = collect(stub.Generate(gen_request(
            "日本語 😀", 40, sampling=pb.SamplingOptions(temperature=1.5, seed=seed))))
        ids = [c.id for c in chunks]
        full = artifact.tokenizer.decode(ids)
        assert "".join(c.text for c in chunks) == full == done.text
        seen_partial |= any(_is_partial_utf8(app.token_bytes[i]) for i in ids)
    assert seen_partial, "the test never exercised a token that splits a character"


def test_utf8_text_is_not_corrupted_when_split(stub, artifact, app):
    """Feed a prompt, then check the deltas of tokens decoded one by one never contain a
    replacement character that the full decode does not."""
    for seed in range(6):
        chunks, _ = collect(stub.Generate(gen_request(
            "naïve 日本", 30, sampling=pb.SamplingOptions(temperature=1.2, seed=100 + seed))))
        full = artifact.tokenizer.decode([c.id for c in chunks])
        assert sum(c.text.count("\ufffd") for c in chunks) == full.count("\ufffd")


def test_stop_string_across_token_boundaries(stub, artifact, app):
    s = pb.SamplingOptions(temperature=1.0, seed=9)
    chunks, done = collect(stub.Generate(gen_request("def add(a, b):", 40, sampling=s)))
    text = done.text
    # token boundaries in character offsets (only where the prefix decodes cleanly)
    spans, pos = [], 0
    for c in chunks:
        spans.append((pos, pos + len(c.text)))
        pos += len(c.text)
    stop = None
    for a in range(1, len(text) - 3):
        cand = text[a:a + 3]
        if "\ufffd" in cand or text.find(cand) != a:
            continue
        if not any(lo <= a and a + 3 <= hi for lo, hi in spans):  # spans >1 token
            stop = cand
            break
    assert stop is not None
    chunks2, done2 = collect(stub.Generate(gen_request("def add(a, b):", 40, sampling=s,
                                                       stop=["@@never@@", stop])))
    assert done2.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE
    assert done2.stop_sequence == stop
    assert done2.text == "".join(c.text for c in chunks2) == text[:text.find(stop)]
    assert [c.id for c in chunks2] == [c.id for c in chunks][:len(chunks2)]


def test_stop_token_and_min_new_tokens(stub, artifact):
    prompt = PROMPTS[0]
    ids = artifact.tokenizer.encode(prompt)
    s = pb.SamplingOptions(temperature=1.0, seed=5)
    ref = torch_generate(artifact.model, ids, 20, to_params(s))
    target = ref[4]
    k = ref.index(target)
    chunks, done = collect(stub.Generate(gen_request(prompt, 20, sampling=s,
                                                     stop_token_ids=[target])))
    assert done.finish_reason == pb.FINISH_REASON_STOP_TOKEN
    assert done.stop_token_id == target and chunks[-1].special
    assert [c.id for c in chunks] == ref[:k + 1]
    # min_new_tokens: the stop token cannot end the stream before it
    chunks, done = collect(stub.Generate(gen_request(prompt, 20, sampling=s,
                                                     stop_token_ids=[target],
                                                     min_new_tokens=k + 3)))
    assert done.generated_tokens >= k + 3
    assert all(c.id != target for c in chunks[:k + 3])


def test_eos_ends_the_stream_unless_ignored(stub, artifact):
    """Find a seed whose sampling draws EOS (tiny vocab, high temperature)."""
    eos = artifact.cfg.eos_token_id
    for seed in range(200):
        s = pb.SamplingOptions(temperature=3.0, seed=seed)
        chunks, done = collect(stub.Generate(gen_request("x", 30, sampling=s,
                                                         ignore_eos=False)))
        if done.finish_reason == pb.FINISH_REASON_EOS_TOKEN:
            # EOS adds no text; an incomplete UTF-8 character sampled before it is flushed
            # with it as U+FFFD
            assert chunks[-1].id == eos and chunks[-1].special
            assert chunks[-1].text.strip("\ufffd") == "", chunks[-1].text
            ids = artifact.tokenizer.encode("x")
            assert [c.id for c in chunks] == torch_generate(
                artifact.model, ids, 30, to_params(s))[:len(chunks)]
            _, done2 = collect(stub.Generate(gen_request("x", 30, sampling=s)))
            assert done2.finish_reason == pb.FINISH_REASON_LENGTH
            return
    pytest.fail("no seed produced EOS")


@pytest.mark.parametrize("req,field", [
    # the other cases are in tests/hardening/test_bad_input.py (the full matrix)
    (gen_request("x", 4, sampling=pb.SamplingOptions(top_k=10**6)), "top_k"),
    (gen_request("x", 4, sampling=pb.SamplingOptions(frequency_penalty=1e6)), "frequency"),
    (gen_request("x", 4, stop=["a"] * 100), "stop"),
    (gen_request("x", 4, stop=["a" * 1000]), "stop"),
    (gen_request("x", 4, top_logprobs=1000), "top_logprobs"),
    (gen_request("x", 4, attention=pb.AttentionOptions(layers=[9])), "layers"),
    (gen_request("x", 4, attention=pb.AttentionOptions(layers=[0], heads=[99])), "heads"),
])
def test_invalid_requests_are_invalid_argument(stub, req, field):
    with pytest.raises(grpc.RpcError) as e:
        collect(stub.Generate(req))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details()


def test_request_id_is_echoed(stub):
    r = gen_request("x", 2)
    r.request_id = "client-req-42"
    _, done = collect(stub.Generate(r))
    assert done.request_id == "client-req-42"


def test_coalesced_stream_carries_every_token_once(app, stub, artifact):
    """ResponseOptions.coalesce: tokens that are ready together (here: all but the first, held
    back by a long stream interval until the end) come in fewer messages
    (GenerateResponse.more), the same tokens in the same order; without it, one per message."""
    plain = list(stub.Generate(gen_request(PROMPTS[3], 48, logprobs=True)))
    assert all(len(m.more) == 0 for m in plain)
    want = [m.chunk for m in plain if m.HasField("chunk")]
    before, app.engine.stream_interval = app.engine.stream_interval, 60.0
    try:
        msgs = list(stub.Generate(gen_request(PROMPTS[3], 48, logprobs=True, coalesce=True)))
    finally:
        app.engine.stream_interval = before
    got = [c for m in msgs if m.HasField("chunk") for c in (m.chunk, *m.more)]
    assert [(c.index, c.id, c.text) for c in got] == [(c.index, c.id, c.text) for c in want]
    assert [c.logprob for c in got] == pytest.approx([c.logprob for c in want], abs=1e-5)
    assert msgs[-1].HasField("complete") and len(msgs) < len(plain)
    assert any(len(m.more) > 0 for m in msgs)


def test_a_prediction_leaves_the_output_alone(stub, app):
    """GenerateRequest.prediction (text or token ids: OpenAI's predicted outputs, an n-gram
    draft source) gives the same tokens; a seeded sampled output given as its own prediction
    is drafted from (accepted drafts counted); bad ones are INVALID_ARGUMENT naming the
    field."""
    req = gen_request("def add(a, b):", 24,
                      sampling=pb.SamplingOptions(temperature=1.0, seed=17))
    plain = [c.id for c in collect(stub.Generate(req, timeout=60))[0]]
    before = app.metrics.spec_accepted.get()
    with_ids = pb.GenerateRequest()
    with_ids.CopyFrom(req)
    with_ids.prediction.token_ids.ids.extend(plain)
    assert [c.id for c in collect(stub.Generate(with_ids, timeout=60))[0]] == plain
    assert app.metrics.spec_accepted.get() - before >= len(plain) // 2
    with_text = pb.GenerateRequest()
    with_text.CopyFrom(req)
    with_text.prediction.text = "    return a + b\n"
    assert [c.id for c in collect(stub.Generate(with_text, timeout=60))[0]] == plain
    bad = pb.GenerateRequest()
    bad.CopyFrom(req)
    bad.prediction.token_ids.ids.extend([1, 10 ** 6])
    with pytest.raises(grpc.RpcError) as e:
        collect(stub.Generate(bad, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prediction.token_ids" in e.value.details()
