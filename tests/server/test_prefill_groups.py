"""How the scheduler groups the prompts admitted together into prefill calls
(``Scheduler.prefill_groups``): shortest first, B x T under the chunk, and a prompt joins a
group only where the padding it adds to the others costs less than a call of its own."""
from __future__ import annotations

from fake_lm import FakeCache

from kvserve.model.sampling import SamplingParams
from kvserve.server.domain import GenerateRequest, OutputParams, StopParams
from kvserve.server.output import OutputProcessor
from kvserve.server.scheduler import PAD_TOKENS, Scheduler
from kvserve.server.sequence import Handle, Sequence


def _sched(chunk: int = 512) -> Scheduler:
    return Scheduler(FakeCache(8, 128), max_batch=8, max_queue=8, max_seq_len=4096, n_heads=1,
                     vocab_size=1, score_chunk_floats=chunk, prefill_chunk_tokens=None,
                     output=OutputProcessor(frozenset(), None, 0.0))


def _seqs(*lengths: int) -> list[Sequence]:
    return [Sequence(GenerateRequest([1] * n, SamplingParams(), StopParams(max_new_tokens=1),
                                     OutputParams()), Handle(f"r{i}", lambda: None), submitted=0.0)
            for i, n in enumerate(lengths)]


def _lengths(groups) -> list[list[int]]:
    return [[len(s.prefill_ids) for s in g] for g in groups]


def test_prompts_of_like_lengths_go_in_one_call_shortest_first():
    assert _lengths(_sched().prefill_groups(_seqs(9, 3, 5, 7))) == [[3, 5, 7, 9]]


def test_a_prompt_that_would_pad_the_others_past_a_call_of_its_own_starts_a_group():
    # 16-47 tokens, as eight chat requests arriving together: one call padded every row to
    # 47 (376 tokens for 282); three calls pad 35
    groups = _lengths(_sched().prefill_groups(_seqs(47, 16, 33, 22, 41, 18, 38, 27)))
    assert groups == [[16, 18, 22], [27, 33, 38, 41], [47]]
    for g in groups:
        assert all(len(g[:i]) * (b - a) <= PAD_TOKENS for i, (a, b) in
                   enumerate(zip(g, g[1:]), 1))


def test_the_chunk_still_caps_rows_times_tokens():
    assert _lengths(_sched(chunk=64).prefill_groups(_seqs(20, 20, 20, 20))) == \
        [[20, 20, 20], [20]]


def test_the_tokens_to_prefill_after_a_cached_prefix_are_what_is_grouped():
    seqs = _seqs(40, 41, 70)
    todo = {id(seqs[0]): 8, id(seqs[1]): 9, id(seqs[2]): 70}  # two after 32 cached tokens
    groups = _sched().prefill_groups(seqs, lambda s: todo[id(s)])
    assert _lengths(groups) == [[40, 41], [70]]


def test_the_padding_rule_is_the_cpu_providers():
    """Measured on CPU only: on another device a group pads up to the chunk, as before."""
    from fake_lm import FakeLM

    from kvserve.server.detok import TokenBytes
    from kvserve.server.engine import Engine

    lm = FakeLM()
    for device, pad in (("cpu", PAD_TOKENS), ("cuda", None)):
        lm.device = device
        e = Engine(lm, TokenBytes.without_text(lm.cfg.vocab_size), max_batch=4, max_queue=4,
                   score_chunk_floats=64 * lm.cfg.vocab_size, eos_id=None)
        assert e.sched.pad_tokens == pad
    s = _sched()
    s.pad_tokens = None
    assert _lengths(s.prefill_groups(_seqs(47, 16, 33))) == [[16, 33, 47]]
