"""A numpy language model with the runners' interface (``new_cache`` / ``prefill`` / ``extend``
/ ``decode``, as ``kvserve.artifact``'s FusedLM and PortableLM): the engine's admission,
batching, cancellation, stop and score logic tested fast and without torch or onnxruntime.

The "model": logits of a position = ``W[token] + b[position % 5]`` (a bigram table with a
position term), so the next token depends on the whole cache state through the position; the
"KV cache" keeps the tokens of each slot. Attention: uniform over the sequence so far.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy as np

from kvserve.model.config import ModelConfig
from kvserve.model.sampling import log_softmax

_GEN = itertools.count(1)


@dataclass
class Prefilled:
    logits: list
    attention: list | None


class FakeCache:
    def __init__(self, max_batch: int, capacity: int = 128):
        self.max_batch, self.capacity = max_batch, capacity
        self.used = np.zeros(max_batch, np.int64)
        self.retained = np.zeros(max_batch, np.int64)
        self.tokens = [[] for _ in range(max_batch)]
        self.generation = next(_GEN)
        self.moves = 0
        self.reserved: list[int] = []  # rows asked for by each reserve, in order
        self.kept: list[int] = []  # keep_rows of each shrink_to_fit

    def ensure_capacity(self, needed: int) -> None:
        while needed > self.capacity:
            self.capacity += 128

    def reserve(self, rows: int) -> None:
        self.reserved.append(rows)
        self.ensure_capacity(rows)

    def shrink_to_fit(self, n: int, keep_rows: int = 0) -> None:
        self.kept.append(keep_rows)
        self.used[n:] = 0
        for b in range(n, self.max_batch):
            self.tokens[b] = self.tokens[b][:self.retained[b]]

    def move(self, src: int, dst: int) -> None:
        if src != dst:
            self.tokens[dst] = list(self.tokens[src])
            self.used[dst] = self.used[src]
            self.retained[src] = self.retained[dst] = 0
            self.moves += 1

    def retain(self, slot: int, rows: int) -> None:
        self.retained[slot] = min(rows, int(self.used[slot]))

    def reuse(self, slot: int, rows: int) -> None:
        assert 0 <= rows <= self.retained[slot]
        self.tokens[slot] = self.tokens[slot][:rows]
        self.used[slot] = rows
        self.retained[slot] = 0


class FakeLM:
    kind = "fake"
    log_softmax = staticmethod(log_softmax)  # the runners' (onnxruntime's) over rows (T, V)
    has_attention = True
    attention_ready = True
    provider = "numpy"
    last_rows = False  # as a portable runner (a test may set it: chunks sized as for fused)

    def __init__(self, vocab_size: int = 64, n_layers: int = 2, n_heads: int = 2,
                 max_seq_len: int = 256, eos_token_id: int | None = None, seed: int = 0,
                 step_delay: float = 0.0):
        self.step_delay = step_delay  # seconds per decode step (a slow model)
        self.cfg = ModelConfig(vocab_size=vocab_size, d_model=16, n_layers=n_layers,
                               n_heads=n_heads, max_seq_len=max_seq_len,
                               eos_token_id=eos_token_id)
        g = np.random.default_rng(seed)
        self.W = (3.0 * g.standard_normal((vocab_size, vocab_size))).astype(np.float32)
        self.bias = g.standard_normal((5, vocab_size)).astype(np.float32)
        self.calls = {"prefill": 0, "decode": 0, "extend": 0}
        self.decode_batches: list[int] = []

    # --- the model --------------------------------------------------------------------------
    def logits_at(self, token: int, position: int) -> np.ndarray:
        return self.W[token] + self.bias[position % 5]

    def reference(self, prompt: list[int], n: int) -> list[int]:
        """Greedy continuation of ``prompt`` (what the engine must produce)."""
        seq, out = list(prompt), []
        for _ in range(n):
            tok = int(np.argmax(self.logits_at(seq[-1], len(seq) - 1)))
            out.append(tok)
            seq.append(tok)
        return out

    def _attn(self, T: int, rows: int) -> np.ndarray:
        a = np.zeros((self.cfg.n_layers, self.cfg.n_heads, rows, T), np.float32)
        for r in range(rows):
            q = T - rows + r
            a[:, :, r, :q + 1] = 1.0 / (q + 1)
        return a

    # --- the runner interface -----------------------------------------------------------------
    def new_cache(self, max_batch: int, capacity: int = 128) -> FakeCache:
        return FakeCache(max_batch, capacity)

    def _feed(self, kv: FakeCache, slot: int, tokens) -> np.ndarray:
        start = int(kv.used[slot])
        kv.ensure_capacity(start + len(tokens))
        kv.tokens[slot] = kv.tokens[slot][:start] + [int(t) for t in tokens]
        kv.used[slot] = start + len(tokens)
        return np.stack([self.logits_at(int(t), start + i) for i, t in enumerate(tokens)])

    def prefill(self, kv: FakeCache, lo: int, prompts, attention: bool = False,
                last: bool = False) -> Prefilled:
        self.calls["prefill"] += 1
        logits = [self._feed(kv, lo + b, p)[-1 if last else 0:] for b, p in enumerate(prompts)]
        attn = [self._attn(int(kv.used[lo + b]), len(p)) for b, p in enumerate(prompts)] \
            if attention else None
        return Prefilled(logits, attn)

    def extend(self, kv: FakeCache, slot: int, tokens, last: bool = False) -> np.ndarray:
        self.calls["extend"] += 1
        return self._feed(kv, slot, tokens)[-1 if last else 0:]

    def decode(self, kv: FakeCache, n: int, tokens, attention: bool = False):
        self.calls["decode"] += 1
        self.decode_batches.append(n)
        if self.step_delay:
            time.sleep(self.step_delay)
        logits = np.stack([self._feed(kv, b, [tokens[b]])[0] for b in range(n)])
        attn = [self._attn(int(kv.used[b]), 1)[:, :, 0] for b in range(n)] if attention \
            else None
        return logits, attn


# --- shared by the fake-model engine tests (test_engine_fake, test_resume, test_events) -------
def word_token_bytes(vocab_size: int):
    """A word-level vocabulary for the fake model: token i is the text "t{i} " (stop strings
    can match)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from kvserve.server.detok import TokenBytes

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tb = TokenBytes(tok, vocab_size)
    tb.table = [f"t{i} ".encode() for i in range(vocab_size)]
    return tb


def engine_maker(vocab_size: int, stream_interval: float, default_lm):
    """(make, engines): ``make(lm=None, **engine_kwargs)`` starts an Engine on ``lm`` (default
    ``default_lm()``) with small limits and returns (engine, lm); the caller stops ``engines``.
    ``stream_interval`` 0: callers woken for every token; > 0: the server's staged way (plain
    greedy sequences take the engine's lean steps)."""
    from kvserve.server.engine import Engine

    engines = []

    def make(lm=None, **kw):
        lm = lm or default_lm()
        args = dict(max_batch=4, max_queue=16, score_chunk_floats=vocab_size * 64, eos_id=None,
                    stream_interval=stream_interval)
        args.update(kw)
        e = Engine(lm, word_token_bytes(vocab_size), **args)
        e.start()
        engines.append(e)
        return e, lm
    return make, engines
