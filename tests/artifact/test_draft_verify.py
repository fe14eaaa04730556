"""``verify`` and ``truncate`` on both runners (``lm``: fused and portable ``llama``, fp32):
teacher-forced logits through one verification call equal plain decode steps within 1e-4,
rows with different draft lengths in one call, truncation, left-over rows never leaking, and
greedy generation through n-gram drafts identical to plain greedy decoding."""
from __future__ import annotations

import numpy as np
import pytest
from export_matrix import LOGIT_TOL
from spec_testing import check_greedy_speculation, check_verify_teacher_forced, plain_logits


def test_verify_equals_plain_decode_steps(lm):
    assert lm.supports_verify
    worst = max(check_verify_teacher_forced(lm, LOGIT_TOL, seed) for seed in range(3))
    print(f"{lm.kind}: verify vs plain steps, max relative |Δlogit| {worst:.2e}")


def test_left_over_rows_never_leak(main_model, lm):
    """A 12-token draft of one token id written and dropped (truncate to the fed token),
    then a different 3-token verification whose padding sits on those rows, then plain steps:
    the logits are those of a cache that never saw the dropped rows. Slot 1's rows around it
    are untouched by slot 0's padding."""
    V = lm.cfg.vocab_size
    g = np.random.default_rng(21)
    prompts = [g.integers(0, V, 6).tolist(), g.integers(0, V, 4).tolist()]
    kv = lm.new_cache(2)
    lm.prefill(kv, 0, prompts, last=True)
    used = kv.used[:2].copy()
    lm.verify(kv, 2, [[7] * 13, [8]])
    kv.truncate(0, int(used[0]) + 1)  # keeps the fed 7 only
    kv.truncate(1, int(used[1]) + 1)
    hist = [prompts[0] + [7], prompts[1] + [8]]
    rows = [[1], [2, 3, 4]]  # slot 0 padded to 3: its padding rows land on the dropped ones
    logits = lm.verify(kv, 2, rows).copy()
    for b in range(2):
        want = plain_logits(lm, hist[b], rows[b])
        assert np.abs(logits[b, :len(rows[b])] - want).max() <= LOGIT_TOL, b
        hist[b] += rows[b]
    kv.truncate(0, len(hist[0]))
    kv.truncate(1, len(hist[1]))
    for step in range(3):
        toks = [5 + step, 9 + step]
        out, _ = lm.decode(kv, 2, toks)
        for b in range(2):
            want = plain_logits(lm, hist[b], [toks[b]])[0]
            assert np.abs(out[b] - want).max() <= LOGIT_TOL, (step, b)
            hist[b].append(toks[b])


def test_greedy_through_ngram_drafts_is_the_plain_output(lm):
    """A repetitive prompt (the drafts are often accepted): 40 greedy tokens through
    verification equal 40 plain greedy steps."""
    prompt = [3, 4, 5, 6, 7, 8] * 5 + [3, 4]
    check_greedy_speculation(lm, prompt, 40)


def test_truncate_bounds(lm):
    kv = lm.new_cache(2)
    lm.prefill(kv, 0, [[1, 2, 3]], last=True)
    with pytest.raises(ValueError, match="it has 3"):
        kv.truncate(0, 4)
    with pytest.raises(ValueError, match="truncate"):
        kv.truncate(0, -1)
    kv.truncate(0, 3)
    assert kv.used[0] == 3
    with pytest.raises(ValueError, match="non-empty row per slot"):
        lm.verify(kv, 2, [[1], []])


def test_rows_and_their_padding_past_the_context_are_refused(lm):
    """A row may end exactly at the model's context; one past it is refused, and so is a short
    row near the context's end padded past it to a longer row's length (its padding positions
    would be looked up in the graph's position tables: learned and sinusoidal ones fail the
    call; the engine cuts the drafts to what the context leaves). Within it, the rows give the
    plain path's logits."""
    if lm.kind != "fused":
        return
    M, V = lm.cfg.max_seq_len, lm.cfg.vocab_size
    g = np.random.default_rng(9)
    p0, p1 = g.integers(0, V, M - 3).tolist(), g.integers(0, V, 10).tolist()
    kv = lm.new_cache(2)
    lm.prefill(kv, 0, [p0, p1], last=True)
    for rows in ([[3, 4, 5, 6], [5]], [[3], [4, 5, 6, 7]]):
        with pytest.raises(ValueError, match=f"context of {M} tokens"):
            lm.verify(kv, 2, rows)
        assert list(kv.used[:2]) == [M - 3, 10]
    rows = [[3], [4, 5, 6]]  # slot 0 padded to 3 rows: its last padding position is M - 1
    logits = lm.verify(kv, 2, rows).copy()
    for b, p in enumerate((p0, p1)):
        want = plain_logits(lm, p, rows[b])
        assert np.abs(logits[b, :len(rows[b])] - want).max() <= LOGIT_TOL


def test_a_prefill_whose_padding_would_pass_the_context_is_refused(lm):
    """A prefill of slots past different rows (restored prefixes admitted together) pads each
    row to the longest: a slot near the context's end beside a longer row is refused, as in
    ``verify`` (the engine feeds such rows a slot at a time), and the slots' rows stay."""
    if lm.kind != "fused":
        return
    M, V = lm.cfg.max_seq_len, lm.cfg.vocab_size
    g = np.random.default_rng(10)
    kv = lm.new_cache(2)
    lm.prefill(kv, 0, [g.integers(0, V, M - 3).tolist(), g.integers(0, V, 10).tolist()],
               last=True)
    with pytest.raises(ValueError, match=f"context of {M} tokens"):
        lm.prefill(kv, 0, [[1], [2, 3, 4, 5]], last=True)
    assert list(kv.used[:2]) == [M - 3, 10]
    lm.prefill(kv, 0, [[1], [2, 3, 4]], last=True)  # its last padding position is M - 1
    assert list(kv.used[:2]) == [M - 2, 13]
