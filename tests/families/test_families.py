"""Each Hugging Face family end to end: transformers model -> import-hf -> export (parity gate)
-> served over gRPC, against transformers itself.

Per family (see family_models.CASES for the options switched on): (1) the served artifact's
prefill and 64 decode steps on a left-padded batch reproduce transformers' logits, (2) greedy
Generate equals transformers' generate for 32 tokens, (3) Score's prompt logprobs equal
transformers', (4) generation stops on each of the generation config's EOS ids. Sliding-window
cases have a window of 6 positions; the prompts are up to 12 tokens and decode runs 64 steps.
"""
from __future__ import annotations

import json

import numpy as np
import torch

from family_models import PROMPT, hf_greedy  # noqa: I001
from kvserve.model.config import ModelConfig
from kvserve.v1 import inference_pb2 as pb
from kvserve_testing import collect, gen_request

TOL = 1e-4
PROMPTS = [PROMPT[:7], PROMPT[:3], PROMPT]  # different lengths, prefilled together


def test_import_records_generation_config_and_tokenizer_files(served):
    cfg = ModelConfig.load(served.artifact / "config.json")
    assert cfg.stop_ids == served.eos and cfg.eos_token_ids == served.eos
    assert cfg.extra["generation_defaults"] == {"do_sample": True, "temperature": 0.6,
                                                "top_p": 0.9}
    files = json.loads((served.artifact / "manifest.json").read_text())["files"]
    for name in ("tokenizer.json", "generation_config.json"):
        assert (served.artifact / name).read_bytes() == (served.hf_dir / name).read_bytes()
        assert name in files  # hashed, so verify() checks it
    # tokenizer_config.json: import-hf keeps what serving reads from it (the chat template,
    # wherever the model ships it, and the special-token strings)
    theirs = json.loads((served.hf_dir / "tokenizer_config.json").read_text())
    ours = json.loads((served.artifact / "tokenizer_config.json").read_text())
    assert "tokenizer_config.json" in files
    assert ours.get("chat_template") == theirs.get("chat_template")
    for key in ("bos_token", "eos_token"):
        want = theirs.get(key)
        want = want.get("content") if isinstance(want, dict) else want
        assert ours.get(key) == want, key
    assert "config.json" in files  # which holds eos_token_ids


def test_served_prefill_and_64_decode_steps_match_transformers(served):
    """The server's runner (``kvserve.artifact.load_lm``: fused or portable, as exported) on a
    batch of prompts of different lengths, teacher-forced with transformers' greedy tokens;
    the reference is transformers' cached generate per row."""
    from kvserve.artifact.loader import load_lm
    from kvserve.artifact.longrope import LongRopeSwitch

    lm = load_lm(served.artifact, provider="cpu", threads=1, attention=False)
    longrope = LongRopeSwitch.of(lm.cfg)  # phi3_longrope: each row crosses at its own step
    refs = [hf_greedy(served.hf, p, 65) for p in PROMPTS]
    kv = lm.new_cache(len(PROMPTS))
    pre = lm.prefill(kv, 0, PROMPTS)
    worst = 0.0
    for b, p in enumerate(PROMPTS):
        with torch.no_grad():
            want = served.hf(torch.tensor([p])).logits[0].numpy()
        worst = max(worst, float(np.abs(pre.logits[b] - want).max()))
    for step in range(64):
        tokens = np.array([r[0][step] for r in refs], np.int64)
        if longrope is not None:  # as the engine does before each decode step
            longrope.before_decode(lm, kv, len(PROMPTS),
                                   lambda b: PROMPTS[b] + refs[b][0][:step], chunk=8)
        logits, _ = lm.decode(kv, len(PROMPTS), tokens)
        for b, r in enumerate(refs):
            worst = max(worst, float(np.abs(logits[b] - r[1][step + 1].numpy()).max()))
    assert worst <= TOL, f"{served.name}: max |Δlogit| {worst:.3g}"


def test_engine_rows_and_chunked_prefill_match_transformers_alone(served):
    """Each family through the engine (chunks of 8 tokens): a batch of short prompts decoded
    64 steps plus a 21-token prompt prefilled in chunks (sliding windows reach back across
    chunks): every row's tokens and raw logits equal transformers' generate of that row alone,
    and a chunked Score of the long prompt equals transformers' forward. Phi-3 LongRoPE (limit
    20): the short rows pass original_max_position_embeddings at different steps (each
    refilled there with the long factors) and the long prompt is long from its first chunk."""
    from kvserve.artifact.loader import load_lm
    from kvserve.model.sampling import SamplingParams
    from kvserve.server.detok import TokenBytes
    from kvserve.server.domain import (GenerateRequest, OutputParams, ScoreRequest,
                                       StopParams, TokenEvent)
    from kvserve.server.engine import Engine

    lm = load_lm(served.artifact, provider="cpu", threads=1, attention=False)
    limit = lm.cfg.longrope_limit
    long = (PROMPT * 2)[:21]  # three chunks of 8; LongRoPE: past its limit of 20
    prompts, steps = [*PROMPTS, long], [64, 64, 64, 8]
    if limit is not None:
        assert len(long) == limit + 1
        assert all(len(p) < limit < len(p) + 64 for p in PROMPTS)  # every short row crosses
    V = lm.cfg.vocab_size
    engine = Engine(lm, TokenBytes.without_text(V), max_batch=4, max_queue=8,
                    score_chunk_floats=8 * V, eos_id=None)
    engine.start()
    try:
        handles = engine.submit_many([GenerateRequest(
            list(p), SamplingParams(), StopParams(max_new_tokens=n, ignore_eos=True),
            OutputParams(return_logits=True)) for p, n in zip(prompts, steps)])
        worst = 0.0
        for p, n, h in zip(prompts, steps, handles):
            events = [e for e in h if isinstance(e, TokenEvent)]
            toks, logits = hf_greedy(served.hf, p, n)
            assert [e.token_id for e in events] == toks
            worst = max(worst, max(float(np.abs(e.logits - r.numpy()).max())
                                   for e, r in zip(events, logits)))
        _, fut = engine.submit_score(ScoreRequest([long]))
        got = fut.result(timeout=60)[0].logprobs
    finally:
        engine.stop()
    assert worst <= TOL, f"max |Δlogit| {worst:.3g}"
    with torch.no_grad():
        lp = torch.log_softmax(served.hf(torch.tensor([long])).logits[0], -1).numpy()
    np.testing.assert_allclose(got, lp[np.arange(len(long) - 1), long[1:]], rtol=TOL,
                               atol=1e-6)


def test_greedy_generate_equals_transformers(served):
    for p in PROMPTS:
        want = hf_greedy(served.hf, p, 32)[0]
        chunks, done = collect(served.stub.Generate(gen_request(p, 32, ignore_eos=True)))
        assert [c.id for c in chunks] == want, served.name
        assert done.finish_reason == pb.FINISH_REASON_LENGTH


def test_score_logprobs_equal_transformers(served):
    seqs = [PROMPT + hf_greedy(served.hf, PROMPT, 20)[0], PROMPT[:5]]
    resp = served.stub.Score(pb.ScoreRequest(token_ids=[pb.TokenIds(ids=s) for s in seqs]))
    for s, ids in zip(resp.sequences, seqs):
        with torch.no_grad():
            lp = torch.log_softmax(served.hf(torch.tensor([ids])).logits[0], -1).numpy()
        want = lp[np.arange(len(ids) - 1), ids[1:]]
        np.testing.assert_allclose([t.logprob for t in s.tokens], want, rtol=TOL, atol=1e-6)


def test_generation_stops_on_every_eos_id(served):
    for e, k in served.eos_prefix.items():
        prompt = PROMPT[:k]  # the next greedy token is e
        chunks, done = collect(served.stub.Generate(gen_request(prompt, 8, ignore_eos=False)))
        assert done.finish_reason == pb.FINISH_REASON_EOS_TOKEN, (served.name, e)
        assert [c.id for c in chunks] == [e] and chunks[-1].special
        chunks, done = collect(served.stub.Generate(gen_request(prompt, 3, ignore_eos=True)))
        assert chunks[0].id == e and done.finish_reason == pb.FINISH_REASON_LENGTH
    # from the whole prompt, generation ends at the first EOS id transformers produces
    cont = hf_greedy(served.hf, PROMPT, 32)[0]
    hits = [i for i, t in enumerate(cont) if t in served.eos]
    chunks, done = collect(served.stub.Generate(gen_request(PROMPT, 32, ignore_eos=False)))
    assert [c.id for c in chunks] == (cont[:hits[0] + 1] if hits else cont)
    assert done.finish_reason == (pb.FINISH_REASON_EOS_TOKEN if hits
                                  else pb.FINISH_REASON_LENGTH)


def test_streamed_text_is_exact(served):
    """Byte-level BPE and SentencePiece (Metaspace + byte fallback) vocabularies alike: the
    streamed text is the tokenizer's decode of the continuation. (A random model's output may
    hold invalid UTF-8 byte runs: Python's decoder and tokenizers' ByteFallback replace those
    differently, so the comparison is made on the text the model produced as valid UTF-8.)"""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(served.tokenizer_json)
    text = "def add(a, b):"
    ids = tok.encode(text, add_special_tokens=False).ids
    chunks, done = collect(served.stub.Generate(gen_request(text, 16, ignore_eos=True)))
    gen = [c.id for c in chunks]
    assert done.text == "".join(c.text for c in chunks)
    full = tok.decode(ids + gen, skip_special_tokens=False)
    head = tok.decode(ids, skip_special_tokens=False)
    if "\ufffd" not in full + done.text:
        assert done.text == full[len(head):]
