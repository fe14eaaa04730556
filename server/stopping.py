"""When a sequence stops, as pure functions of its state (vLLM keeps this apart too): the
tokens it may not choose yet, and whether the token just chosen ends it (eos, a stop id, a stop
string, the length). The text side (detokenizer, stop-string matcher) is passed in.

Every end rule lives here, the engine's short paths included: ``argmax_from`` (from which
token a plain argmax is the token ``next_token`` would pick) and ``QuietRule`` (which tokens
of a lean step cannot end the sequence, known from the id alone)."""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.model.sampling import SamplingParams

from .detok import IncrementalDetokenizer, StopMatcher
from .domain import FinishReason, OutputParams, StopParams


def banned_ids(st: StopParams, eos_ids: frozenset[int], generated: int) -> list[int]:
    """Ids that cannot be chosen at generated-token index ``generated`` (the stops, before
    ``min_new_tokens``). ``eos_ids``: every id that ends a sequence (Llama 3 lists three)."""
    if generated >= st.min_new_tokens:
        return []
    banned = list(st.stop_token_ids)
    if not st.ignore_eos:
        banned.extend(eos_ids)
    return banned


@dataclass
class StopCheck:
    text: str  # the text this token releases
    finish: FinishReason | None = None
    special: bool = False  # the token is an eos / stop id (its text is not emitted)
    stop_sequence: str = ""


def check_stop(tok: int, generated: int, st: StopParams, eos_ids: frozenset[int],
               detok: IncrementalDetokenizer, stopper: StopMatcher,
               complete: bool = False) -> StopCheck:
    """``tok`` was chosen as generated token number ``generated`` + 1 (so ``generated`` were
    before it). Pushes its text through the detokenizer and the stop matcher. ``complete``:
    the sequence's constraint can take nothing after ``tok`` (it ends, unless an eos or stop
    ended it first)."""
    armed = generated >= st.min_new_tokens
    if armed and tok in eos_ids and not st.ignore_eos:
        r = StopCheck("", FinishReason.EOS_TOKEN, special=True)
    elif armed and tok in st.stop_token_ids:
        r = StopCheck("", FinishReason.STOP_TOKEN, special=True)
    else:
        m = stopper.push(detok.push(tok), armed)
        r = StopCheck(m.text)
        if m.stop is not None:
            r.finish, r.stop_sequence = FinishReason.STOP_SEQUENCE, m.stop
    if r.finish is None and complete:
        r.finish = FinishReason.CONSTRAINT
    if r.finish is None and generated + 1 >= st.max_new_tokens:
        r.finish = FinishReason.LENGTH
    if r.finish is not None and r.finish is not FinishReason.STOP_SEQUENCE:
        # the end: release what the detokenizer and the matcher still hold
        m = stopper.push(detok.flush(), armed)
        r.text += m.text
        if m.stop is not None:
            r.finish, r.stop_sequence = FinishReason.STOP_SEQUENCE, m.stop
        else:
            r.text += stopper.flush()
    return r


def argmax_from(p: SamplingParams, st: StopParams, eos_ids: frozenset[int],
                constrained: bool = False) -> int | None:
    """The generated-token index from which a plain argmax of the row is the token
    ``next_token`` would pick: greedy without penalties or a constraint's mask, once no id is
    banned any more (stop ids and eos are banned before ``min_new_tokens``, see
    ``banned_ids``). None: never."""
    if not p.greedy or p.has_penalties or constrained:
        return None
    banned = st.stop_token_ids or (eos_ids and not st.ignore_eos)
    return st.min_new_tokens if banned else 0


@dataclass(frozen=True, slots=True)
class QuietRule:
    """From generated-token index ``start`` on, a token not in ``ends`` that leaves room for
    another (``k + 1 < max_new_tokens``) cannot end the sequence: ``check_stop`` would find no
    eos, no stop id, no length, and (no stop strings) no stop string. Such a token needs no
    text at once: the engine records it and makes its text and event later, in order."""
    start: int
    ends: frozenset
    max_new_tokens: int

    def quiet(self, tok: int, k: int) -> bool:
        """Token ``tok`` chosen as generated-token index ``k`` goes on quietly."""
        return k >= self.start and tok not in self.ends and k + 1 < self.max_new_tokens


def quiet_rule(p: SamplingParams, st: StopParams, out: OutputParams, eos_ids: frozenset[int],
               staged: bool, constrained: bool = False) -> QuietRule | None:
    """The sequence's ``QuietRule``, or None where every token needs its text and event at
    once: not a plain argmax (``argmax_from``), a caller woken per token, stop strings (their
    matching needs each token's text) or per-token outputs. The first token is never quiet."""
    first = argmax_from(p, st, eos_ids, constrained)
    if first is None or not staged or any(st.stop) or out.logprobs or out.top_logprobs \
            or out.return_logits or out.attention:
        return None
    ends = frozenset(st.stop_token_ids) | (frozenset() if st.ignore_eos else eos_ids)
    return QuietRule(max(first, st.min_new_tokens, 1), ends, st.max_new_tokens)
