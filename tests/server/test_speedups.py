"""The prefix cache and speculative decoding inside the engine, on the tiny fused artifact:
exact. Greedy and seeded outputs are token-identical with each feature on and off (alone and
in shared batches, woken per token and staged), the logits a verification or a restored
prefix yields are the plain path's within 1e-4, and both features actually engage (cache
hits, accepted drafts)."""
from __future__ import annotations

import time

import numpy as np
import pytest

from kvserve.model.sampling import SamplingParams
from kvserve.server.detok import TokenBytes
from kvserve.server.domain import GenerateRequest, OutputParams, StopParams, TokenEvent
from kvserve.server.engine import Engine

LOGIT_TOL = 1e-4
SHARED = [(7 * i) % 300 + 5 for i in range(40)]  # a 40-token prefix (two full blocks)
PROMPTS = [
    [11, 12, 13, 14] * 6,  # repeats itself: n-gram drafts from the prompt
    SHARED + [21, 22, 23],
    SHARED + [31, 32],
    [40, 41, 42, 43, 44, 40, 41, 42],
    SHARED + [21, 22, 23, 24, 25],
    list(range(50, 90)),
]
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234)
COLD = SamplingParams(temperature=0.2, seed=5)  # sampled, yet loops like greedy: drafts hit
PENALISED = SamplingParams(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5,
                           seed=7)


@pytest.fixture(scope="module")
def lm(artifact):
    from kvserve.artifact.loader import load_lm
    return load_lm(artifact.dir, provider="cpu", threads=1, attention=False)


def _engine(lm, prefix_mb: int, spec: int, stream_interval: float = 0.0) -> Engine:
    V = lm.cfg.vocab_size
    e = Engine(lm, TokenBytes.without_text(V), max_batch=4, max_queue=16,
               score_chunk_floats=64 * V, eos_id=None, prefix_cache_bytes=prefix_mb << 20,
               speculative_tokens=spec, stream_interval=stream_interval)
    e.start()
    return e


def _requests(sampling: SamplingParams, n: int = 24, logits: bool = False):
    return [GenerateRequest(list(p), SamplingParams(**{**sampling.__dict__,
                                                       "seed": None if sampling.seed is None
                                                       else sampling.seed + i}),
                            StopParams(max_new_tokens=n, ignore_eos=True),
                            OutputParams(return_logits=logits))
            for i, p in enumerate(PROMPTS)]


def _run(engine: Engine, reqs) -> list[list[TokenEvent]]:
    handles = engine.submit_many(reqs)
    return [[e for e in h if isinstance(e, TokenEvent)] for h in handles]


def _tokens(runs) -> list[list[int]]:
    return [[e.token_id for e in events] for events in runs]


@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED, COLD, PENALISED],
                         ids=["greedy", "seeded", "seeded-cold", "penalties"])
def test_outputs_identical_with_each_feature_on_and_off(lm, sampling):
    engines = {k: _engine(lm, *k) for k in [(0, 0), (64, 0), (0, 4), (64, 4)]}
    try:
        runs = {k: [_tokens(_run(e, _requests(sampling))) for _ in range(2)]
                for k, e in engines.items()}  # the second round meets a warm cache
        base = runs[(0, 0)][0]
        for k, rounds in runs.items():
            for r in rounds:
                assert r == base, f"prefix/spec {k}: outputs differ from the plain path"
        assert engines[(64, 0)].prefix.cached_blocks > 0
        both = engines[(64, 4)]
        if sampling.temperature < 0.5:  # a random model's (near-)greedy output loops
            assert both.spec.accepted > 0
    finally:
        for e in engines.values():
            e.stop()


def test_teacher_forced_logits_through_verification_and_cached_prefixes(lm):
    plain, fast = _engine(lm, 0, 0), _engine(lm, 64, 4)
    try:
        want = _run(plain, _requests(SamplingParams(), logits=True))
        for _ in range(2):
            got = _run(fast, _requests(SamplingParams(), logits=True))
            worst = max(float(np.abs(a.logits - b.logits).max())
                        for ra, rb in zip(want, got) for a, b in zip(ra, rb))
            assert [e.token_id for r in got for e in r] == [e.token_id for r in want for e in r]
            assert worst <= LOGIT_TOL, f"max |dlogit| {worst:.3g}"
        assert fast.spec.accepted > 0 and fast.prefix.cached_blocks > 0
    finally:
        plain.stop()
        fast.stop()


def test_staged_callers_take_the_lean_path_through_verification(lm):
    """Streaming callers woken in rounds (their plain greedy tokens held, made into events
    later) get the same tokens and indices with speculation."""
    plain, fast = _engine(lm, 0, 0, 0.05), _engine(lm, 64, 4, 0.05)
    try:
        want = _run(plain, _requests(SamplingParams(), n=40))
        got = _run(fast, _requests(SamplingParams(), n=40))
        assert _tokens(got) == _tokens(want)
        for events in got:
            assert [e.index for e in events] == list(range(40))
        assert fast.spec.accepted > 0
    finally:
        plain.stop()
        fast.stop()


def test_a_stop_id_inside_an_accepted_draft_ends_the_staged_stream_where_plain_does(lm):
    """A held (quiet) row whose verified tokens hold a stop id, or reach max_new_tokens, is
    walked token by token: it ends at the same token as the plain path."""
    plain, fast = _engine(lm, 0, 0, 0.05), _engine(lm, 0, 4, 0.05)
    try:
        loose = _tokens(_run(plain, _requests(SamplingParams(), n=40)))
        reqs = _requests(SamplingParams(), n=37)
        for r, toks in zip(reqs, loose):
            r.stopping = StopParams(max_new_tokens=37, ignore_eos=True,
                                    stop_token_ids=(toks[25],))
        want = _tokens(_run(plain, reqs))
        got = _tokens(_run(fast, reqs))
        assert got == want
        assert all(len(t) <= 37 for t in got) and any(len(t) < 37 for t in got)
        assert fast.spec.accepted > 0
    finally:
        plain.stop()
        fast.stop()


def test_shared_prefix_admitted_together_is_computed_once(lm):
    """Three requests with the same 40-token prefix arrive together: the first prefills it,
    the others restore all 40 of its tokens from the cache (two whole blocks and 8 rows of the
    first's third)."""
    e = _engine(lm, 64, 0)
    try:
        reqs = [GenerateRequest(SHARED + tail, SamplingParams(), StopParams(max_new_tokens=4),
                                OutputParams()) for tail in ([1, 2], [3, 4, 5], [6])]
        seen = []
        orig = e.runner._prefill_cached

        def spy(group, *own):
            orig(group, *own)
            seen.extend(s.cached_tokens for s in group)
        e.runner._prefill_cached = spy
        _run(e, reqs)
        assert seen == [40, 40]
    finally:
        e.stop()


def test_a_chat_turn_takes_over_the_rows_its_slot_kept(lm):
    """A chat client sends the whole history each turn. The slot that served the last turn
    still holds it, prompt and reply (``server.slot_rows``), so the next turn prefills only
    its new tokens: more cached tokens than the prefix cache's whole blocks, across a growth of
    the KV buffers (turn 2), with the plain path's tokens and logits (1e-4)."""
    plain, fast = _engine(lm, 0, 0), _engine(lm, 64, 0)
    user = np.random.default_rng(3).integers(5, lm.cfg.vocab_size, (4, 40)).tolist()
    history = list(PROMPTS[5])
    try:
        for turn in range(4):
            def request():
                return GenerateRequest(list(history), SamplingParams(),
                                       StopParams(max_new_tokens=20, ignore_eos=True),
                                       OutputParams(return_logits=True))
            want = _run(plain, [request()])[0]
            h = fast.submit(request())
            events = list(h)
            got = [e for e in events if isinstance(e, TokenEvent)]
            assert [e.token_id for e in got] == [e.token_id for e in want]
            worst = max(float(np.abs(a.logits - b.logits).max()) for a, b in zip(want, got))
            assert worst <= LOGIT_TOL, f"turn {turn}: max |dlogit| {worst:.3g}"
            cached = events[-1].cached_tokens
            if turn:  # every row of the last turn: its prompt and its reply but the last token
                assert cached == previous - 1 > previous // 16 * 16, (turn, cached)
            history += [e.token_id for e in got]
            previous = len(history)
            history += user[turn]
        assert fast.kv.capacity == 256  # (the buffers grew under the kept rows)
    finally:
        plain.stop()
        fast.stop()


def test_rows_a_slot_kept_are_taken_only_by_their_own_prefix(lm, monkeypatch):
    """Rounds of 4 conversations (4 slots) and single requests: each request continues an
    earlier one (its prompt, all or part of its reply, new tokens) or starts afresh. In order
    with equal lengths each finds its own slot's rows; shuffled, with other lengths, sequences
    leave in another order than they came (compaction moves slots, dropping what they kept)
    and land in slots that kept all, part or none of their prefix: every output equals the
    plain path's (tokens; logits within 1e-4)."""
    import kvserve.server.engine as engine_module

    # (an idle engine moves the rows its free slots kept into the pool after a few ms: the
    # fast engine idles while the plain one runs each round, for longer on a busy machine)
    monkeypatch.setattr(engine_module, "SAVE_WHEN_IDLE_AFTER", 60.0)
    plain, fast = _engine(lm, 0, 0), _engine(lm, 64, 0)
    rng = np.random.default_rng(11)
    taken: list[int] = []
    take = fast.runner.slot_rows.take

    def spy(kv, slot, rows=0):
        taken.append(rows)
        take(kv, slot, rows)
    fast.runner.slot_rows.take = spy
    convos = [(list(p), []) for p in PROMPTS[:4]]  # (prompt, reply) of each conversation
    try:
        for round_ in range(8):
            kind = round_ % 4  # 0, 1: in order, equal lengths (no moves: each finds its slot)
            order = list(range(4)) if kind < 2 else rng.permutation(4).tolist()
            if kind == 3:
                order = order[:1]  # a single request: it lands in slot 0
            reqs = []
            for i in order:
                prompt, reply = convos[i]
                if rng.random() < 0.8 and len(prompt) < 150:
                    keep = len(reply) if kind < 2 else int(rng.integers(0, len(reply) + 1))
                    prompt = prompt + reply[:keep]
                else:
                    prompt = rng.integers(5, 300, int(rng.integers(17, 40))).tolist()
                prompt += rng.integers(5, 300, int(rng.integers(1, 9))).tolist()
                reqs.append((i, prompt, 8 if kind < 2 else int(rng.integers(1, 16))))

            def requests():
                return [GenerateRequest(list(p), SamplingParams(),
                                        StopParams(max_new_tokens=n, ignore_eos=True),
                                        OutputParams(return_logits=True)) for _, p, n in reqs]
            want = _run(plain, requests())
            got = _run(fast, requests())
            assert _tokens(got) == _tokens(want), round_
            worst = max(float(np.abs(a.logits - b.logits).max())
                        for ra, rb in zip(want, got) for a, b in zip(ra, rb))
            assert worst <= LOGIT_TOL, f"round {round_}: max |dlogit| {worst:.3g}"
            for (i, prompt, _), toks in zip(reqs, _tokens(got)):
                convos[i] = (prompt, toks)
        assert any(taken) and taken.count(0) > 0  # rows were taken over, and refused
    finally:
        plain.stop()
        fast.stop()


def test_a_turn_whose_blocks_left_the_pool_still_finds_its_slot_rows(lm):
    """The pool evicted every block of a conversation (its index emptied here, as eviction
    under pressure does), but the slot that served the last turn kept its rows: the next turn
    takes them over, with the plain path's tokens."""
    plain, fast = _engine(lm, 0, 0), _engine(lm, 64, 0)
    try:
        first = GenerateRequest(list(PROMPTS[5]), SamplingParams(),
                                StopParams(max_new_tokens=10, ignore_eos=True), OutputParams())
        reply = _tokens(_run(fast, [first]))[0]
        deadline = time.monotonic() + 30  # (its Finish comes before it leaves its slot)
        while (fast.load()["running"] or fast.runner.unsaved) and time.monotonic() < deadline:
            time.sleep(0.001)  # (and its rows copied into the pool: the engine's idle moment)
        fast.prefix.__init__(fast.prefix.pool)  # every block evicted
        prompt = list(PROMPTS[5]) + reply + [7, 8, 9]
        req = GenerateRequest(prompt, SamplingParams(),
                              StopParams(max_new_tokens=10, ignore_eos=True), OutputParams())
        events = list(fast.submit(req))
        assert events[-1].cached_tokens == len(PROMPTS[5]) + len(reply) - 1
        assert [e.token_id for e in events if isinstance(e, TokenEvent)] == \
            _tokens(_run(plain, [req]))[0]
    finally:
        plain.stop()
        fast.stop()


def _settled(engine: Engine) -> None:
    """Wait until the engine is idle with nothing left to copy into the prefix cache (its
    thread owns the cache: the test reads it only then)."""
    deadline = time.monotonic() + 30
    while (engine.load()["running"] or engine.runner.unsaved) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert not engine.runner.unsaved


def _pool_covers(engine: Engine, tokens: list[int]) -> int:
    blocks, n = engine.prefix.match(tokens + [0])  # (match leaves one token: add one)
    engine.prefix.release(blocks)
    return n


def test_a_leaving_sequences_rows_reach_the_pool_when_the_engine_is_idle(lm):
    """The copy of a finished request's rows into the pool waits for an idle moment (or the
    next admission); then the pool has every row of its prompt and reply."""
    fast = _engine(lm, 64, 0)
    try:
        req = GenerateRequest(list(PROMPTS[5]), SamplingParams(),
                              StopParams(max_new_tokens=30, ignore_eos=True), OutputParams())
        reply = _tokens(_run(fast, [req]))[0]
        _settled(fast)
        rows = len(PROMPTS[5]) + len(reply) - 1  # (the last token was never fed)
        assert _pool_covers(fast, list(PROMPTS[5]) + reply) == rows  # (to the token)
    finally:
        fast.stop()


def test_a_next_turn_takes_the_rows_before_they_are_copied(lm, monkeypatch):
    """A chat's next turn arrives before the idle moment: it takes its slot's rows over, no
    copy is made before its first token (its prompt, which begins with them, is cached after
    it), and the pool ends with every whole block of it. Another request arriving instead
    (its prompt is not their continuation) has them copied first: the pool keeps them."""
    import kvserve.server.engine as E

    monkeypatch.setattr(E, "SAVE_WHEN_IDLE_AFTER", 30.0)  # no idle save during the test
    plain, fast = _engine(lm, 0, 0), _engine(lm, 64, 0)
    inserts: list[int] = []  # (tokens of each sequence whose rows were copied)
    insert = fast.prefix.insert_many

    def spy(kv, items):
        inserts.extend(len(tokens) for _, tokens in items)
        return insert(kv, items)
    fast.prefix.insert_many = spy
    try:
        def request(prompt):
            return GenerateRequest(list(prompt), SamplingParams(),
                                   StopParams(max_new_tokens=12, ignore_eos=True),
                                   OutputParams())
        first = list(PROMPTS[5])
        reply = _tokens(_run(fast, [request(first)]))[0]
        assert inserts == [len(first)] and fast.runner.unsaved  # (the prompt's, at its start)
        turn = first + reply + [7, 8, 9]
        h = fast.submit(request(turn))
        events = list(h)
        assert events[-1].cached_tokens == len(first) + len(reply) - 1
        assert [e.token_id for e in events if isinstance(e, TokenEvent)] == \
            _tokens(_run(plain, [request(turn)]))[0]
        assert inserts == [len(first), len(turn)]  # the first turn's rows never copied alone
        other = [3] * 20  # not a continuation: the rows the slot kept go to the pool first
        _run(fast, [request(other)])
        assert inserts[2:4] == [len(turn) + 11, len(other)]  # (its rows: the last token had none)
        fast.stop()  # (the test reads the pool: the engine's thread owns it)
        assert _pool_covers(fast, turn) == len(turn)
    finally:
        plain.stop()
        fast.stop()


def test_a_turn_taking_part_of_the_rows_leaves_the_rest_to_the_pool(lm, monkeypatch):
    """A request that takes over only part of the rows a finished one left in its slot (its
    prompt parts from them inside the last, unfinished block) has all of them copied into the
    pool first: a later continuation of the finished request finds every row there."""
    import kvserve.server.engine as E

    monkeypatch.setattr(E, "SAVE_WHEN_IDLE_AFTER", 30.0)  # no idle save during the test
    fast = _engine(lm, 64, 0)
    try:
        def request(prompt, n=12):
            return GenerateRequest(list(prompt), SamplingParams(),
                                   StopParams(max_new_tokens=n, ignore_eos=True),
                                   OutputParams())
        first = list(PROMPTS[5])
        history = first + _tokens(_run(fast, [request(first)]))[0]
        rows = len(history) - 1  # 51: three whole blocks and 3 rows (the last token: none)
        part = history[:49] + [history[49] ^ 1, 3, 4]  # takes 49 rows over: all whole blocks
        (h,) = fast.submit_many([request(part, 2)])
        assert list(h)[-1].cached_tokens == 49
        fast.stop()  # (the test reads the pool: the engine's thread owns it; the finished
        # request's rows were copied at the second one's admission, not at an idle moment)
        assert _pool_covers(fast, history[:rows]) == rows
    finally:
        fast.stop()


def test_a_turn_in_another_slot_finds_the_rows_its_last_one_left(lm, monkeypatch):
    """Two conversations end together and their rows wait in their slots for the pool; the
    second one's next turn is admitted into the first one's slot. The rows its own last turn
    left in the other slot are copied into the pool first, so it restores all of them (not
    only what its prompt put there), with the plain engine's tokens."""
    import kvserve.server.engine as E

    monkeypatch.setattr(E, "SAVE_WHEN_IDLE_AFTER", 30.0)  # no idle save during the test
    plain, fast = _engine(lm, 0, 0), _engine(lm, 64, 0)
    try:
        def request(prompt):
            return GenerateRequest(list(prompt), SamplingParams(),
                                   StopParams(max_new_tokens=12, ignore_eos=True),
                                   OutputParams())
        a, b = list(PROMPTS[5]), [x + 3 for x in PROMPTS[5]]
        replies = _tokens(_run(fast, [request(a), request(b)]))
        assert sorted(fast.runner._unsaved) == [0, 1]  # (both wait: no idle moment)
        turn = b + replies[1] + [7, 8, 9]
        (h,) = fast.submit_many([request(turn)])
        events = list(h)
        assert events[-1].cached_tokens == len(b) + len(replies[1]) - 1
        assert [e.token_id for e in events if isinstance(e, TokenEvent)] == \
            _tokens(_run(plain, [request(turn)]))[0]
    finally:
        plain.stop()
        fast.stop()


def test_rows_cached_at_one_step_are_one_device_copy(lm):
    """The prompts of a batched prefill go into the pool in one copy (after their first
    tokens), and so do the rows of sequences that leave at the same step: two short requests
    ending together beside two long ones, then the long ones (at the idle moment). The
    tokens are the plain engine's, and the pool ends with every row of each."""
    plain, fast = _engine(lm, 0, 0), _engine(lm, 64, 0)
    copies: list[list[int]] = []  # the slots of each device copy's blocks
    save = fast.prefix.pool.save

    def spy(kv, blocks, ids):
        copies.append(sorted({slot for slot, _ in blocks}))
        return save(kv, blocks, ids)
    fast.prefix.pool.save = spy
    try:
        # (one block each: the four fit one prefill call of the test engine's 64 tokens)
        prompts = [list(range(50 * i, 50 * i + 16)) for i in range(1, 5)]
        reqs = [GenerateRequest(p, SamplingParams(), StopParams(max_new_tokens=n,
                                                               ignore_eos=True), OutputParams())
                for p, n in zip(prompts, (20, 20, 40, 40))]
        got = _tokens(_run(fast, reqs))
        assert got == _tokens(_run(plain, reqs))
        _settled(fast)
        assert copies == [[0, 1, 2, 3], [0, 1], [0, 1]]
        fast.stop()  # (the test reads the pool: the engine's thread owns it)
        for p, toks in zip(prompts, got):
            rows = len(p) + len(toks) - 1  # (the last token was never fed)
            assert _pool_covers(fast, p + toks) == rows
    finally:
        plain.stop()
        fast.stop()


def test_rows_left_beside_decoding_sequences_are_copied_at_the_next_step(lm, monkeypatch):
    """A sequence that leaves the last slot while others go on decoding: no idle moment is
    coming, so its rows go into the pool at the next iteration, while the others decode."""
    import kvserve.server.engine as E

    monkeypatch.setattr(E, "SAVE_WHEN_IDLE_AFTER", 30.0)  # (an idle save would hide it)
    fast = _engine(lm, 64, 0)
    seen: list[tuple[int, int]] = []  # (tokens inserted, sequences active then)
    insert = fast.prefix.insert_many

    def spy(kv, items):
        seen.extend((len(tokens), len(fast.sched.active)) for _, tokens in items)
        return insert(kv, items)
    fast.prefix.insert_many = spy
    try:
        long_ = GenerateRequest(list(PROMPTS[5]), SamplingParams(),
                                StopParams(max_new_tokens=40, ignore_eos=True), OutputParams())
        short = GenerateRequest(list(range(100, 140)), SamplingParams(),
                                StopParams(max_new_tokens=4, ignore_eos=True), OutputParams())
        _run(fast, [long_, short])  # (the short one in slot 1, the last)
        assert (40 + 4 - 1, 1) in seen  # its rows, copied while the long one decoded
    finally:
        fast.stop()


def test_the_backoff_charges_a_verification_with_the_drafting_before_it(lm):
    """Speculation's own cost against a plain step includes the lookups and the weighing that
    made the step's drafts: each verification the ``Backoff`` weighs is charged at least the
    time ``drafts`` took (here made 20 ms longer), while the step costs are the call's and
    its tokens' alone."""
    fast = _engine(lm, 0, 8)
    spec = fast.runner.spec
    drafts, verify = spec.drafts, spec.backoff.verify_step
    slow, charged, measured = 0.02, [], []

    def slow_drafts(active):
        out = drafts(active)
        if out is not None:
            time.sleep(slow)
        return out

    def spy(n, seconds, tokens):
        charged.append(seconds)
        return verify(n, seconds, tokens)
    costs_verify = fast.runner.costs.verify_step

    def costs_spy(n, S, seconds, once=False):
        measured.append(seconds)
        return costs_verify(n, S, seconds, once=once)
    spec.drafts, spec.backoff.verify_step = slow_drafts, spy
    fast.runner.costs.verify_step = costs_spy
    try:
        _run(fast, [GenerateRequest(list(PROMPTS[0]), SamplingParams(),
                                    StopParams(max_new_tokens=48, ignore_eos=True),
                                    OutputParams())])
    finally:
        fast.stop()
    assert charged and len(charged) == len(measured)  # (the prompt repeats: drafts were used)
    assert all(c >= slow for c in charged)
    assert all(m < slow for m in measured)


def test_an_idle_engine_makes_the_pools_next_blocks_resident(lm, monkeypatch):
    """Idle, the engine writes the never-used pool blocks ahead of use (a piece at a time,
    looking for requests in between), so that a prompt's insert later pays no page faults;
    a request's insert takes blocks from among them, and the engine warms ahead again."""
    import kvserve.server.engine as E
    import kvserve.server.prefix_cache as PCM

    monkeypatch.setattr(E, "SAVE_WHEN_IDLE_AFTER", 0.001)
    monkeypatch.setattr(PCM, "WARM_CHUNK_BYTES", 1)  # (a block a piece: many pieces)
    fast = _engine(lm, 1, 0)
    prefix = fast.prefix
    try:
        deadline = time.monotonic() + 30
        while prefix.warm_pending and time.monotonic() < deadline:
            time.sleep(0.01)
        window = min(prefix._ahead, len(prefix._free))  # (this 1 MB pool: all its blocks)
        assert not prefix.warm_pending and len(prefix._warm) == window > 1
        ahead = set(prefix._warm)
        _run(fast, [GenerateRequest(list(PROMPTS[5]), SamplingParams(),
                                    StopParams(max_new_tokens=4, ignore_eos=True),
                                    OutputParams())])
        taken = set(prefix._blocks)
        assert taken and taken <= ahead  # its blocks were written before it needed them
        while prefix.warm_pending and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not prefix.warm_pending
        assert len(prefix._warm) == min(prefix._ahead, len(prefix._free))
        assert not set(prefix._blocks) & prefix._warm  # (a cached block is never written)
    finally:
        fast.stop()


def test_a_row_at_the_context_end_beside_a_long_draft(lm, monkeypatch):
    """A request running to the model's context (prompt + new tokens = max_seq_len) shares
    verification calls with a row drafting 8 tokens at every step: the call pads the near-full
    row to the longest, so the drafts are cut to what the context leaves (else the padding's
    positions pass the graph's tables: learned and sinusoidal ones fail the call and the whole
    batch with it; found by a review on a GPT-2-style model). Outputs are the plain path's."""
    M = lm.cfg.max_seq_len
    g = np.random.default_rng(3)
    reqs = [GenerateRequest(g.integers(5, 300, M - 12).tolist(), SamplingParams(),
                            StopParams(max_new_tokens=12, ignore_eos=True), OutputParams()),
            GenerateRequest(list(PROMPTS[0]), SamplingParams(),
                            StopParams(max_new_tokens=40, ignore_eos=True), OutputParams())]
    plain = _engine(lm, 0, 0)
    try:
        want = _tokens(_run(plain, reqs))
    finally:
        plain.stop()
    forced = _engine(lm, 0, 8)
    spec, calls = forced.runner.spec, []
    verify = lm.verify

    def spy(kv, n, rows):
        calls.append(max(kv.used[:n]) + max(map(len, rows)))
        return verify(kv, n, rows)
    # every row that may draft offers 8 tokens at every step (wrong ones mostly: rejected)
    spec.drafts = lambda active: [[7] * 8 if s.drafting is not None else [] for s in active]
    monkeypatch.setattr(lm, "verify", spy)
    try:
        got = _tokens(_run(forced, reqs))
    finally:
        forced.stop()
    assert got == want
    assert calls and max(calls) == M  # verification ran up to the context's end, not past


def test_lookup_ids_are_drafted_from_and_leave_the_output_alone(lm):
    """A request's ``lookup_ids`` (OpenAI's ``prediction``) are a source of n-gram drafts: a
    prediction equal to the reply (a seeded sampled one, which does not repeat itself) is
    drafted from (most of the reply accepted from it), a wrong one is rejected; the tokens are
    those without it."""
    g = np.random.default_rng(4)
    prompt = g.integers(5, 300, 24).tolist()

    def run(lookup):
        e = _engine(lm, 0, 8)
        # the drafts weighed with fixed step costs and never paused: the acceptance is the
        # drafts' own, not this machine's load (a busy machine paused them: 16 of 40 accepted)
        e.spec.backoff.allow = lambda n, **_: True
        e.costs.relatives = lambda n, top: [1.0 + 0.1 * (S - 1) for S in range(1, top + 1)]
        try:
            h, = e.submit_many([GenerateRequest(list(prompt),
                                                SamplingParams(temperature=1.0, seed=7),
                                                StopParams(max_new_tokens=40, ignore_eos=True),
                                                OutputParams(), lookup_ids=tuple(lookup))])
            evs = list(h)
            toks = [ev.token_id for ev in evs if isinstance(ev, TokenEvent)]
            fin = evs[-1]  # its usage: the drafted tokens copied from the lookup ids
            return toks, e.spec.accepted, (fin.accepted_prediction_tokens,
                                           fin.rejected_prediction_tokens)
        finally:
            e.stop()
    plain, alone, none = run(())
    right, accepted, used = run(plain)
    wrong, _, missed = run(g.integers(5, 300, 40).tolist())
    assert right == plain and wrong == plain
    print(f"accepted: {alone} without, {accepted} with the reply as lookup ids; "
          f"prediction tokens accepted/rejected {used}, a wrong one's {missed}")
    assert accepted >= len(plain) // 2 > alone, (accepted, alone)
    # the usage counts the drafts copied from the prediction alone: none without one, most
    # of the reply from the right one (no more than the engine accepted in all), next to
    # nothing accepted from the wrong one (its n-grams rarely match; the prompt's and the
    # reply's own, more recent, win where they do)
    assert none == (0, 0)
    assert len(plain) // 2 <= used[0] <= accepted, (used, accepted)
    assert missed[0] <= 2, missed
