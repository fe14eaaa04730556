"""Constraints for requests: the server's one ``GuideTokenizer`` (llguidance's view of the
served tokenizer), built on the first request that asks for a constraint (1.6-3.9 s for a
151k vocabulary; nothing for servers whose clients never ask), and a fresh ``Constraint`` (one
matcher) per generated sequence. Shared by the gRPC servicer and the HTTP API."""
from __future__ import annotations

import threading
from typing import Sequence

from .constraints import Constraint, ConstraintSpec, GuideTokenizer
from .domain import FailedPrecondition


class Guides:
    def __init__(self, tokenizer_json: str | None, vocab_size: int, eos_ids: Sequence[int]):
        self._json, self.vocab_size, self.eos_ids = tokenizer_json, vocab_size, tuple(eos_ids)
        self._guide: GuideTokenizer | None = None
        self._lock = threading.Lock()

    @property
    def available(self) -> bool:
        return self._json is not None and bool(self.eos_ids)

    def guide(self) -> GuideTokenizer:
        if not self.available:
            raise FailedPrecondition("constrained decoding needs the model's tokenizer and an "
                                     "end-of-sequence token, and this model lacks one")
        with self._lock:
            if self._guide is None:
                self._guide = GuideTokenizer(self._json, self.vocab_size, self.eos_ids)
            return self._guide

    def constraint(self, spec: ConstraintSpec | None) -> Constraint | None:
        """A new matcher for one sequence (None: unconstrained). Errors name the field."""
        return None if spec is None else self.guide().constraint(spec)
