"""A decoding loop driven by a Constraint over random logits: the stand-in for a random-init
model (a constraint must make ANY logits produce valid output). The "model" leans towards
tokens that close things (quotes, brackets, parentheses, the end token) more with every step,
so that unbounded grammars (any JSON object, nested expressions) end in a bounded number of
steps; the mask alone decides what is valid."""
from __future__ import annotations

import functools

import numpy as np
from tokenizers import Tokenizer as HFTokenizer

CLOSERS = ('"', "}", "]", ")")


@functools.lru_cache(maxsize=8)
def _tokenizer(tokenizer_json: str):
    hf = HFTokenizer.from_str(tokenizer_json)
    closing = [i for i in range(hf.get_vocab_size())
               if any(c in (hf.id_to_token(i) or "") for c in CLOSERS)]
    return hf, tuple(closing)


class RandomModel:
    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids, seed: int,
                 lean: float = 0.08, scale: float = 3.0):
        self.hf, closing = _tokenizer(tokenizer_json)
        self.vocab, self.eos = vocab_size, tuple(eos_ids)
        self.rng = np.random.default_rng(seed)
        self.lean, self.scale = lean, scale
        self.closing = np.array(sorted(set(closing) | set(self.eos)), dtype=np.int64)

    def logits(self, step: int) -> np.ndarray:
        x = (self.rng.standard_normal(self.vocab) * self.scale).astype(np.float32)
        x[self.closing] += self.lean * step
        return x

    def pick(self, logits: np.ndarray, greedy: bool) -> int:
        if greedy:
            return int(np.argmax(logits))
        p = np.exp(logits - logits.max())
        p /= p.sum()
        return int(self.rng.choice(self.vocab, p=p))

    def text(self, ids) -> str:
        return self.hf.decode([i for i in ids if i not in self.eos], skip_special_tokens=False)


def generate(guide, spec, model: RandomModel, greedy: bool, fast_forward: bool = False,
             max_steps: int = 800):
    """(text, tokens, forced count): sample until the grammar stops (an end token taken, or
    nothing can follow what is written)."""
    c = guide.constraint(spec)
    out: list[int] = []
    n_forced = 0
    for step in range(max_steps):
        if c.done:
            break
        if fast_forward:
            ff = c.forced()
            if ff:
                c.consume_tokens(ff)
                out += ff
                n_forced += len(ff)
                continue
        logits = model.logits(step)
        c.apply(logits)
        assert np.isfinite(logits).any(), "the mask allowed no token"
        t = model.pick(logits, greedy)
        c.consume(t)
        out.append(t)
    assert c.done, f"no end after {max_steps} steps: {model.text(out)[:200]!r}"
    assert all(t not in guide.eos_ids for t in out[:-1])
    return model.text(out), out, n_forced
