"""LongRoPE (Phi-3 ``longrope``/``su``): a row that grows past
``original_max_position_embeddings`` while decoding is refilled once, with the long factors.

What transformers does (5.x, ``Phi3ForCausalLM``): the rotary frequencies are chosen per
forward call from the largest position in the call (``modeling_rope_utils.dynamic_rope_update``
-> ``longrope_frequency_update``: long factors when ``max(position_ids) + 1 >
original_max_position_embeddings``, short otherwise), and ``generate`` drops its cache the
first time the sequence reaches ``original_max_position_embeddings + 1`` tokens
(``Phi3ForCausalLM.prepare_inputs_for_generation``), recomputing every position with the long
factors. For one sequence that is the same as computing each step from scratch: short factors
everywhere while it has at most ``original_max_position_embeddings`` tokens, long factors
everywhere once it has more.

kvserve gives every row that meaning on its own (transformers' own batched generate decides over
the whole batch: its widest row switches every row, and rows' results depend on who shares the
batch; a server's requests are independent, so each row is computed as transformers computes
it alone). The graphs decide per row from the row's largest position id in the call (masked
columns included; ``model.layers.rope_cos_sin``); a row's cached keys are all short while it
is short. When a row's next token is at position ``original_max_position_embeddings``
(``crossing``), its cached tokens are run again from row 0 (``refill``: chunked ``extend``
calls asking for the factors of the longer sequence), and the decode step that follows sees a
row whose keys are all long, as transformers' recompute leaves it. A prompt (or a Score
sequence) longer than the limit and too long for one call is run in chunks that all ask for the
long factors (``extend``), as transformers' one forward over it uses them.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from kvserve.model.config import ModelConfig


class LongRopeSwitch:
    """The crossing check and refill of one LongRoPE model (``of(cfg)`` is None otherwise, so
    a caller pays one ``is None`` test per step for every other model)."""

    def __init__(self, limit: int):
        self.limit = limit  # original_max_position_embeddings

    @classmethod
    def of(cls, cfg: ModelConfig) -> "LongRopeSwitch | None":
        limit = cfg.longrope_limit
        return None if limit is None else cls(limit)

    def crossing(self, used: np.ndarray) -> np.ndarray:
        """Slots (indices into ``used``, the rows cached per slot) whose next token is the
        first past the limit: their cached rows are all short and must become long."""
        return np.flatnonzero(used == self.limit)

    def refill(self, lm, kv, slot: int, tokens: Sequence[int], chunk: int,
               length: int | None = None) -> np.ndarray:
        """Run ``tokens`` (the row's tokens, in order) into slot ``slot`` from row 0 with the
        factors of a ``length``-token sequence (default: one more, the next token's), in
        ``extend`` calls of at most ``chunk`` tokens. Returns the last token's logits (V,)."""
        kv.clear(slot)
        length = len(tokens) + 1 if length is None else length
        chunk = max(1, chunk)
        for a in range(0, len(tokens), chunk):
            last = lm.extend(kv, slot, np.asarray(tokens[a:a + chunk], np.int64),
                             rope_length=length, last=True)[-1]
        return last

    def extend(self, lm, kv, slot: int, ids: Sequence[int], start: int, chunk: int
               ) -> np.ndarray | None:
        """Chunked prefill of a prompt (``ids[:start]`` already in the slot): a prompt longer
        than the limit is long from its first token, so the slot is refilled from row 0 with
        the long factors; returns its last logits (V,). None: nothing to do differently."""
        if len(ids) <= self.limit or start > self.limit:  # already as transformers has it
            return None
        return self.refill(lm, kv, slot, ids, chunk, length=len(ids))

    def before_decode(self, lm, kv, n: int, tokens_of: Callable[[int], Sequence[int]],
                      chunk: int, before_refill: Callable[[], None] | None = None
                      ) -> list[int]:
        """Refill every slot of [0, n) that crosses at this step; ``tokens_of(slot)``: that
        row's tokens so far (its cached ones first; asked only of a crossing slot);
        ``before_refill()``: called once before the first refill. Returns the slots
        refilled."""
        slots = [int(i) for i in self.crossing(kv.used[:n])]
        if slots and before_refill is not None:
            before_refill()
        for i in slots:
            self.refill(lm, kv, i, list(tokens_of(i))[:int(kv.used[i])], chunk)
        return slots
