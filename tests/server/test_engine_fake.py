"""The engine on a numpy fake model (tests/fake_lm.py): admission, continuous batching,
cancellation, stops and Score, fast and without torch or onnxruntime."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from fake_lm import FakeLM, engine_maker, word_token_bytes

from kvserve.model.sampling import SamplingParams, log_softmax
from kvserve.server.detok import TokenBytes
from kvserve.server.domain import (FinishReason, GenerateRequest, OutputParams, QueueFull,
                                   ScoreRequest, StopParams, TokenEvent)
from kvserve.server.engine import Engine

V = 64


def _token_bytes() -> TokenBytes:
    return word_token_bytes(V)


@pytest.fixture(params=[0.0, 0.05], ids=["woken-per-token", "staged"])
def make_engine(request):
    """Engines whose callers are woken for every token, or at most every 50 ms (the
    server's way: a plain greedy sequence then takes the engine's lean steps, its tokens'
    text and events made when its caller is woken)."""
    make, engines = engine_maker(V, request.param, lambda: FakeLM(V))
    yield make
    for e in engines:
        e.stop()


def _req(prompt, n, **stop):
    return GenerateRequest(prompt_ids=list(prompt), sampling=SamplingParams(),
                           stopping=StopParams(max_new_tokens=n, **stop), output=OutputParams())


def _collect(h):
    toks, fin = [], None
    for ev in h:
        if isinstance(ev, TokenEvent):
            toks.append(ev.token_id)
        else:
            fin = ev
    return toks, fin


def test_an_in_process_request_past_the_context_ends_at_it(make_engine):
    """The servers refuse prompt + max_new_tokens past the context; the engine's own callers
    get a sequence that ends there (LENGTH), never a call past the context that would fail
    the batch, and a prompt that fills the context is refused."""
    from kvserve.server.domain import InvalidArgument

    engine, lm = make_engine(max_batch=2)
    ctx = lm.cfg.max_seq_len
    toks, fin = _collect(engine.submit(_req([1, 2, 3], 10 * ctx)))
    assert fin.reason is FinishReason.LENGTH and len(toks) == ctx - 3
    assert toks == lm.reference([1, 2, 3], ctx - 3)
    with pytest.raises(InvalidArgument, match="context"):
        engine.submit(_req([1] * ctx, 1))


def test_concurrent_requests_share_decode_steps_and_match_the_reference(make_engine):
    engine, lm = make_engine(max_batch=4)
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [15]]
    handles = engine.submit_many([_req(p, 12) for p in prompts])
    for p, h in zip(prompts, handles):
        toks, fin = _collect(h)
        assert toks == lm.reference(p, 12) and fin.reason is FinishReason.LENGTH
    assert max(lm.decode_batches) == 4  # never more than max_batch slots in a step
    assert sum(lm.decode_batches) == 6 * 11  # every token after the first came from a step
    assert len(lm.decode_batches) < 6 * 11  # ... and steps were shared


def test_long_prompt_is_prefilled_in_chunks(make_engine):
    engine, lm = make_engine(score_chunk_floats=V * 8)  # 8 tokens per prefill chunk
    prompt = list(range(1, 30))
    toks, fin = _collect(engine.submit(_req(prompt, 5)))
    assert toks == lm.reference(prompt, 5)
    assert lm.calls["extend"] == 3  # 29 tokens: 8 prefilled, then 8 + 8 + 5


def test_prefill_chunks_where_only_last_rows_are_computed(make_engine):
    """A runner that returns the last row's logits only (fused) holds no chunk x vocab
    logits: its prompts are prefilled in chunks of prefill_chunk_tokens however small the
    logits cap makes Score's (8 tokens of a 2,048 vocabulary here), as long as the chunk's
    attention scores (chunk x heads x cache rows) stay under the same cap; a runner that
    returns every row keeps the logits-sized chunks."""
    big = 2048
    prompt = list(range(1, 30))
    lm = FakeLM(big)
    lm.last_rows = True
    engine, _ = make_engine(lm, score_chunk_floats=big * 8, prefill_chunk_tokens=16)
    assert engine.chunk_tokens == 8 and engine.prefill_tokens() == 16  # 16 x 2 x 128 rows
    toks, _ = _collect(engine.submit(_req(prompt, 5)))
    assert toks == lm.reference(prompt, 5)
    assert lm.calls["extend"] == 1  # 29 tokens: 16 prefilled, then 13
    # four 5-token prompts admitted together: 3 x 5 <= 16 share a prefill, then the fourth
    hs = engine.submit_many([_req([i + 1, 2, 3, 4, 5], 2) for i in range(4)])
    for i, h in enumerate(hs):
        assert _collect(h)[0] == lm.reference([i + 1, 2, 3, 4, 5], 2)
    assert lm.calls["prefill"] == 1 + 2

    capacity = engine.kv.capacity
    engine.kv.capacity = 2048  # 16 x 2 heads x 2048 rows would pass the cap: 8 again
    assert engine.prefill_tokens() == 8
    engine.kv.capacity = capacity

    engine, lm = make_engine(FakeLM(big), score_chunk_floats=big * 8,
                             prefill_chunk_tokens=16)  # all rows
    assert engine.prefill_tokens() == 8
    _collect(engine.submit(_req(prompt, 5)))
    assert lm.calls["extend"] == 3


def test_prefill_chunks_as_asked_below_the_logits_cap(make_engine):
    """``--prefill-chunk-tokens N`` below the logits cap's chunk is taken as asked (a long
    prompt's chunks, and so the other streams' pause, that small); 0 keeps the rule of up to
    ``AUTO_PREFILL_TOKENS``, never fewer than the cap's; a runner that returns every row's
    logits keeps the cap's chunk whatever is asked."""
    from kvserve.server.scheduler import AUTO_PREFILL_TOKENS

    big, cap = 2048, 64
    prompt = list(range(1, 30))
    lm = FakeLM(big)
    lm.last_rows = True
    engine, _ = make_engine(lm, score_chunk_floats=big * cap, prefill_chunk_tokens=8)
    assert engine.chunk_tokens == cap and engine.prefill_tokens() == 8
    toks, _ = _collect(engine.submit(_req(prompt, 3)))
    assert toks == lm.reference(prompt, 3)
    assert lm.calls["extend"] == 3  # 29 tokens: 8, then 8, 8 and 5
    lm = FakeLM(big)
    lm.last_rows = True
    engine, _ = make_engine(lm, score_chunk_floats=big * cap, prefill_chunk_tokens=0)
    by_scores = big * cap // (2 * engine.kv.capacity)  # (2 heads)
    assert engine.prefill_tokens() == max(cap, min(AUTO_PREFILL_TOKENS, by_scores))
    engine, _ = make_engine(FakeLM(big), score_chunk_floats=big * cap, prefill_chunk_tokens=8)
    assert engine.prefill_tokens() == cap  # all rows


def test_queue_full_and_cancellation(make_engine):
    engine, lm = make_engine(FakeLM(V, step_delay=0.002), max_batch=1, max_queue=1)
    first = engine.submit(_req([1], 1000))
    second = engine.submit(_req([2], 5))
    with pytest.raises(QueueFull):
        for _ in range(3):  # the first may already have a slot: the queue holds one more
            engine.submit(_req([3], 5))
    ev = first.events.get(timeout=5)
    assert isinstance(ev, TokenEvent)
    first.cancel()
    _, fin = _collect(first)
    assert fin.reason is FinishReason.CANCELLED and fin.generated_tokens < 1000
    toks, fin = _collect(second)
    assert toks == lm.reference([2], 5) and fin.reason is FinishReason.LENGTH


def test_a_queued_request_can_be_cancelled(make_engine):
    engine, _ = make_engine(FakeLM(V, step_delay=0.002), max_batch=1)
    running = engine.submit(_req([1], 1000))
    queued = engine.submit(_req([2], 5))
    queued.cancel()
    _, fin = _collect(queued)
    assert fin.reason is FinishReason.CANCELLED and fin.generated_tokens == 0
    running.cancel()
    assert _collect(running)[1].reason is FinishReason.CANCELLED


def test_stops_eos_stop_ids_strings_and_min_tokens(make_engine):
    lm = FakeLM(V)
    ref = lm.reference([7], 20)
    eos = ref[5]
    engine, _ = make_engine(lm, eos_id=eos)
    toks, fin = _collect(engine.submit(_req([7], 20)))
    first = ref.index(eos)
    assert toks == ref[:first + 1] and fin.reason is FinishReason.EOS_TOKEN
    toks, fin = _collect(engine.submit(_req([7], 20, ignore_eos=True, stop_token_ids=(ref[3],))))
    assert toks == ref[:ref.index(ref[3]) + 1] and fin.reason is FinishReason.STOP_TOKEN
    assert fin.stop_token_id == ref[3]
    stop = f"t{ref[2]} t{ref[3]}"
    _, fin = _collect(engine.submit(_req([7], 20, ignore_eos=True, stop=(stop,))))
    assert fin.reason is FinishReason.STOP_SEQUENCE and fin.stop_sequence == stop
    assert stop not in fin.text
    # min_new_tokens: the eos cannot be chosen before 8 tokens
    toks, fin = _collect(engine.submit(_req([7], 8, min_new_tokens=8)))
    assert len(toks) == 8 and eos not in toks and fin.reason is FinishReason.LENGTH


def test_attention_rows_cover_the_sequence(make_engine):
    engine, lm = make_engine()
    req = GenerateRequest(prompt_ids=[1, 2, 3], sampling=SamplingParams(),
                          stopping=StopParams(max_new_tokens=4),
                          output=OutputParams(attention_layers=(1,), attention_heads=(0,)))
    evs = [ev for ev in engine.submit(req) if isinstance(ev, TokenEvent)]
    for k, ev in enumerate(evs):
        (layer, head, row), = ev.attention
        assert (layer, head) == (1, 0) and len(row) == 3 + k  # the tokens so far
        np.testing.assert_allclose(row, 1.0 / (3 + k))


def test_score_matches_the_model_and_interleaves_with_generation(make_engine):
    engine, lm = make_engine(score_chunk_floats=V * 16)
    g = np.random.default_rng(1)
    seqs = [g.integers(0, V, n).tolist() for n in (5, 40, 9)]  # 40 > 16: chunked
    gen = engine.submit(_req([3], 30))
    _, fut = engine.submit_score(ScoreRequest(sequences=seqs, top_logprobs=2))
    res = fut.result(timeout=10)
    for ids, r in zip(seqs, res):
        want = [float(log_softmax(lm.logits_at(ids[i], i))[ids[i + 1]])
                for i in range(len(ids) - 1)]
        np.testing.assert_allclose(r.logprobs, want, rtol=1e-5, atol=1e-6)
        assert r.top_ids.shape == (len(ids) - 1, 2)
    assert _collect(gen)[1].reason is FinishReason.LENGTH


def test_many_threads_submit_at_once(make_engine):
    engine, lm = make_engine(max_batch=3, max_queue=64)
    results, errors = {}, []

    def worker(i):
        try:
            results[i] = _collect(engine.submit(_req([i + 1], 6)))[0]
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(20)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors and time.monotonic() - t0 < 10
    for i in range(20):
        assert results[i] == lm.reference([i + 1], 6)


def test_every_eos_id_stops(make_engine):
    """A model with several EOS ids (Llama 3's generation config lists three): each one ends
    the sequence, and none can be chosen before min_new_tokens."""
    lm = FakeLM(V)
    ref = lm.reference([9], 30)
    firsts = sorted({ref.index(t) for t in ref[4:12]})[:3]
    ids = [ref[i] for i in firsts]
    engine, _ = make_engine(lm, eos_ids=ids)
    toks, fin = _collect(engine.submit(_req([9], 30)))
    assert toks == ref[:min(ref.index(t) for t in ids) + 1]
    assert fin.reason is FinishReason.EOS_TOKEN
    toks, fin = _collect(engine.submit(_req([9], 12, min_new_tokens=12)))
    assert len(toks) == 12 and not set(toks) & set(ids)


def test_the_batch_argmax_fast_path_picks_what_each_row_would_alone(make_engine):
    """Plain greedy rows take one argmax over the batch; rows with something banned (eos
    before min_new_tokens), penalties or sampling go through next_token. Side by side in one
    batch, every row gets what it gets alone."""
    lm = FakeLM(V)
    ref = lm.reference([7], 20)
    eos = ref[3]
    engine, _ = make_engine(lm, eos_id=eos, max_batch=4)

    def reqs():
        return [_req([7], 12),  # plain greedy: stops at eos
                _req([7], 12, min_new_tokens=6),  # eos banned for 6 tokens
                GenerateRequest(prompt_ids=[9, 3], sampling=SamplingParams(
                    repetition_penalty=1.3), stopping=StopParams(max_new_tokens=12),
                    output=OutputParams()),
                GenerateRequest(prompt_ids=[4], sampling=SamplingParams(
                    temperature=0.8, seed=11), stopping=StopParams(max_new_tokens=12),
                    output=OutputParams())]

    alone = [_collect(engine.submit(r)) for r in reqs()]
    together = [_collect(h) for h in engine.submit_many(reqs())]
    for (ta, fa), (tt, ft) in zip(alone, together):
        assert ta == tt and fa.reason is ft.reason
    assert alone[0][0] == ref[:ref.index(eos) + 1]
    assert alone[0][1].reason is FinishReason.EOS_TOKEN
    assert len(alone[1][0]) >= 6 and eos not in alone[1][0][:6]


def test_admission_reserves_each_requests_rows(make_engine):
    """A request's prompt and new tokens are reserved when it is admitted (the fused cache
    grows once instead of copying its buffers mid-decode), capped by the context; a shrink
    after a request leaves keeps the rows the others still may fill (with none left, the rows
    the leaving ones had: the next request of a sequential client finds the same room)."""
    engine, lm = make_engine(FakeLM(V, step_delay=0.002), max_batch=2)  # 200 steps: 0.4 s
    long_h = engine.submit(_req([1, 2, 3], 200))
    assert next(iter(long_h)).index == 0  # admitted
    short = _collect(engine.submit(_req([4, 5], 10)))
    assert short[1].reason is FinishReason.LENGTH
    _collect(long_h)
    kv = engine.kv
    assert kv.reserved[0] == 3 + 200 + 1 and kv.reserved[1] == 3 + 200 + 1  # both admitted
    assert 3 + 200 + 1 in kv.kept  # the short one left: the long one's rows kept
    assert kv.kept[-1] == 3 + 200 + 1  # the last one left: an emptied batch keeps its room
    capped = engine.submit(_req([1], 10_000))  # more than the context (256) allows
    assert next(iter(capped)).index == 0  # admitted: its reservation is made
    capped.cancel()  # (the engine trusts the request mapping's context check: left to run,
    _collect(capped)  # the fake model would make all 10,000 tokens, 20 s of steps)
    assert kv.reserved[-1] == 256 + 1


def test_lean_steps_give_the_same_events_as_the_per_token_path():
    """A staged caller's plain greedy sequence takes the lean steps (the token recorded, its
    text and event made at the next wake-up). Its events (ids, indices, text deltas) and its
    end (reason, text, counts) equal those of the per-token path, with tokens whose bytes split
    UTF-8 characters (and some invalid bytes), with eos, stop ids, min_new_tokens and a cancel
    in the middle of held tokens."""
    lm = FakeLM(V, step_delay=0.0005)
    tb = _token_bytes()
    frags = [b"\xc3", b"\xa9", b"\xe2\x82", b"\xac", b"a", b"\xf0\x9f", b"\x98\x80", b"\xff"]
    tb.table = [frags[i % len(frags)] for i in range(V)]
    ref = lm.reference([7], 40)
    cases = [dict(), dict(ignore_eos=True, stop_token_ids=(ref[9],)),
             dict(min_new_tokens=30), dict(ignore_eos=True)]

    def run(interval):
        engine = Engine(lm, tb, max_batch=4, max_queue=16, score_chunk_floats=V * 64,
                        eos_id=ref[12], stream_interval=interval)
        engine.start()
        try:
            out = []
            for stop in cases:
                evs = list(engine.submit(_req([7], 40, **stop)))
                out.append(([(e.index, e.token_id, e.text) for e in evs[:-1]],
                            (evs[-1].reason, evs[-1].text, evs[-1].generated_tokens)))
            h = engine.submit(_req([7], 10_000, ignore_eos=True))  # cancelled mid-stream
            got = [h.events.get(timeout=5) for _ in range(3)]
            h.cancel()
            evs = got + list(h)
            toks = [e for e in evs if isinstance(e, TokenEvent)]
            assert [e.index for e in toks] == list(range(len(toks)))
            assert evs[-1].reason is FinishReason.CANCELLED
            assert evs[-1].text == "".join(e.text for e in toks)
            assert evs[-1].generated_tokens == len(toks) >= 3
            return out
        finally:
            engine.stop()

    per_token, lean = run(0.0), run(0.05)
    assert lean == per_token
    for events, (reason, text, n) in lean:
        assert [i for i, _, _ in events] == list(range(n))
        assert text == "".join(t for _, _, t in events)
    assert [r for _, (r, _, _) in lean] == [FinishReason.EOS_TOKEN, FinishReason.STOP_TOKEN,
                                            FinishReason.EOS_TOKEN, FinishReason.LENGTH]
    text = lean[3][1][1]  # characters assembled across tokens, and replaced invalid bytes
    assert "\ufffd" in text and any(ord(c) > 127 and c != "\ufffd" for c in text), text
