"""When a sequence stops, as pure functions of its state (vLLM keeps this apart too): the
tokens it may not choose yet, and whether the token just chosen ends it (eos, a stop id, a stop
string, the length). The text side (detokenizer, stop-string matcher) is passed in."""
from __future__ import annotations

from dataclasses import dataclass

from .detok import IncrementalDetokenizer, StopMatcher
from .domain import FinishReason, StopParams


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
               detok: IncrementalDetokenizer, stopper: StopMatcher) -> StopCheck:
    """``tok`` was chosen as generated token number ``generated`` + 1 (so ``generated`` were
    before it). Pushes its text through the detokenizer and the stop matcher."""
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
