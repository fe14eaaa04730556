"""server/constraint_masks.py: a batch's masks computed in parallel equal the per-row ones;
free rows are untouched; the background start/wait gives the same masks; a batched decode of
mixed constrained and free rows gives valid outputs."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from decoding import RandomModel
from kvserve.server.constraint_masks import MaskBatch
from kvserve.server.constraints import ConstraintSpec

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 999},
                                           "s": {"type": "string", "maxLength": 6}},
          "required": ["n", "s"], "additionalProperties": False}


def _specs():
    return {0: ConstraintSpec.json_schema(SCHEMA), 2: ConstraintSpec.regex("[a-c]{2,5}x"),
            3: ConstraintSpec.choice(["alpha", "beta"]), 5: ConstraintSpec.json_object()}


def test_parallel_masks_equal_single_ones_and_free_rows_stay_open(bpe, bpe_guide):
    rows = [(i, bpe_guide.constraint(s)) for i, s in _specs().items()]
    batch = MaskBatch(bpe.vocab_size, max_rows=6, threads=2)
    mask = batch.fill(rows).copy()
    for i, c in rows:
        one = np.zeros_like(mask[i])
        c.fill(one)
        np.testing.assert_array_equal(mask[i], one)
    assert (mask[[1, 4]] == -1).all()
    logits = np.random.default_rng(1).standard_normal((6, bpe.vocab_size)).astype(np.float32)
    before = logits.copy()
    batch.apply(logits, rows)
    np.testing.assert_array_equal(logits[[1, 4]], before[[1, 4]])
    for i, _ in rows:
        assert np.isneginf(logits[i]).sum() > bpe.vocab_size // 2
    # a later step with fewer rows resets the rows no longer listed
    batch.fill(rows[:1])
    assert (batch.mask[1:] == -1).all()
    batch.close()


def test_background_fill_gives_the_same_masks(bpe, bpe_guide):
    rows = [(i, bpe_guide.constraint(s)) for i, s in _specs().items()]
    batch = MaskBatch(bpe.vocab_size, max_rows=6)
    ref = batch.fill(rows).copy()
    batch.start(rows)
    with pytest.raises(RuntimeError, match="already in flight"):
        batch.start(rows)
    np.testing.assert_array_equal(batch.wait(), ref)
    with pytest.raises(RuntimeError, match="no mask computation in flight"):
        batch.wait()
    with pytest.raises(ValueError, match="distinct"):
        batch.fill([rows[0], (0, rows[1][1])])
    with pytest.raises(ValueError, match=r"in \[0, 6\)"):
        batch.fill([(6, rows[0][1])])
    batch.close()


@pytest.mark.parametrize("background", [False, True])
def test_batched_decode_mixed_rows_is_valid(bpe, bpe_guide, background):
    """The engine's order per step: masks (maybe while the model runs) -> sample -> consume;
    a row whose grammar is done leaves the batch; free rows sample unmasked."""
    specs = _specs()
    model = RandomModel(bpe.to_str(), bpe.vocab_size, bpe_guide.eos_ids, seed=3)
    live = {i: bpe_guide.constraint(s) for i, s in specs.items()}
    out = {i: [] for i in range(6)}
    batch = MaskBatch(bpe.vocab_size, max_rows=6)
    for step in range(600):
        if not live:
            break
        rows = sorted(live.items())
        if background:
            batch.start(rows)
        logits = np.stack([model.logits(step) for _ in range(6)])  # "the model runs"
        batch.wait() if background else batch.fill(rows)
        batch.apply(logits, rows)
        for i in range(6):
            if i in specs and i not in live:
                continue  # finished
            t = model.pick(logits[i], greedy=step % 2 == 0)
            out[i].append(t)
            if i in live:
                live[i].consume(t)
                if live[i].done:
                    del live[i]
    batch.close()
    assert not live
    text = {i: model.text(out[i]) for i in specs}
    assert set(json.loads(text[0])) == {"n", "s"}
    assert re.fullmatch("[a-c]{2,5}x", text[2])
    assert text[3] in ("alpha", "beta")
    assert isinstance(json.loads(text[5]), dict)
    # the free rows sampled every step, unmasked (their text is anything)
    assert len(out[1]) == len(out[4]) == max(len(out[i]) for i in specs)
