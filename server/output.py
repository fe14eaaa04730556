"""Output processing: a chosen token becomes the caller's event (text through the sequence's
detokenizer, end rules through ``stopping``), and callers are woken in rounds.

A caller is woken at most once per ``stream_interval`` seconds (0: for every token), and at
once for its first token and its end (``server.events``); N callers woken together wait N
intervals for the next round, up to ``stream_interval_max``: each wake-up costs a thread
switch and a message, so their rate stays ~1 / stream_interval in all.

A quiet token (``stopping.QuietRule``: a staged caller's plain greedy token that cannot end
the sequence) is only recorded (``hold``); its text, event and metrics are made when its
caller is next woken (``wake_staged``), in order, or before any other event of that sequence.
"""
from __future__ import annotations

import logging
import time

import numpy as np

from kvserve.model.sampling import token_logprobs

from .domain import FinishEvent, FinishReason, OutputParams, Timings, TokenEvent
from .constraints import ConstraintViolation
from .interfaces import EngineMetrics
from .sequence import Sequence
from .stopping import StopCheck, check_stop

log = logging.getLogger(__name__)

# what a request is told when its constraint cannot go on (only this request ends): the
# matcher's own reason, and the causes seen so far
CONSTRAINT_STUCK = ("the constraint cannot go on: its matcher refused a token its own mask "
                    "allowed ({reason}). Causes seen: text that is the content of one of the "
                    "tokenizer's added tokens (e.g. '<tool_call>'), which the matcher takes only "
                    "as that token (constrain with text the tokenizer spells out); a grammar "
                    "past the matcher's limits (e.g. a repetition count in the millions)")

CONSTRAINT_DEAD_END = ("the constraint allows no next token after the output so far: no "
                       "complete output satisfies it from here (e.g. a JSON schema property, "
                       "required or not, whose $ref leads only back to itself); fix the "
                       "constraint")

# the metrics' outcome of a finish that carries an error, where it differs from the reason's
_FAILED = {FinishReason.TIME_LIMIT: "queued_out",  # never left the queue
           FinishReason.CONSTRAINT: "constraint_failed"}  # stuck, or a dead end


def token_event(k: int, tok: int, raw: np.ndarray, attention, stop: StopCheck,
                out: OutputParams) -> TokenEvent:
    """The event of generated token ``k`` (``raw``: the model's logits row it was chosen
    from; ``attention``: its (layer, head, row) triples, when asked)."""
    ev = TokenEvent(index=k, token_id=tok, text=stop.text, special=stop.special)
    if out.logprobs or out.top_logprobs:
        ev.logprob, top_ids, top_lps = token_logprobs(raw, tok, out.top_logprobs)
        if out.top_logprobs:
            ev.top_ids, ev.top_logprobs = top_ids, top_lps
    if out.return_logits:
        ev.logits = np.array(raw, np.float32, copy=True)
    if attention:
        ev.attention = attention
    return ev


class OutputProcessor:
    def __init__(self, eos_ids: frozenset[int], metrics: EngineMetrics,
                 stream_interval: float = 0.0, stream_interval_max: float | None = None):
        self.eos_ids = eos_ids
        self.metrics = metrics
        self.stream_interval = stream_interval
        self.stream_interval_max = stream_interval if stream_interval_max is None \
            else max(stream_interval, stream_interval_max)
        self._interval = stream_interval  # until the next round: after one of N callers
        self._staged: set = set()  # the callers' sinks holding events back
        self._holding: list[Sequence] = []  # sequences with held (quiet) tokens
        self._woken = 0.0  # when the staged callers were last woken

    # --- tokens --------------------------------------------------------------------------------
    def hold(self, seq: Sequence, tok: int, now: float) -> None:
        """Record a quiet token (its event is made when the caller is next woken)."""
        if not seq.held:
            self._holding.append(seq)
        seq.held.append((tok, now))
        seq.generated.append(tok)
        seq.feed = tok

    def accept(self, seq: Sequence, tok: int, raw: np.ndarray, attention) -> StopCheck:
        """``tok`` was chosen from ``raw`` as ``seq``'s next token: its text, stop checks and
        event (and the sequence's end, when it ends it). Returns the stop check."""
        self.release(seq)  # its earlier tokens first, through the same detokenizer
        req = seq.req
        k = len(seq.generated)
        complete = False
        if req.constraint is not None:
            if (why := req.constraint.error) is not None:  # (the end token its mask allowed
                # would finish the request as if its output were complete)
                log.info("request %s: its constraint has no way on after %d tokens (%s)",
                         seq.handle.request_id, len(seq.generated), why)
                self.finish(seq, FinishReason.CONSTRAINT, error=CONSTRAINT_DEAD_END)
                return StopCheck("", FinishReason.CONSTRAINT)
            try:
                req.constraint.consume(tok)
            except ConstraintViolation as e:  # (its own mask allowed it: llguidance corners)
                log.warning("request %s: the constraint refused token %d that its mask allowed "
                            "(%s)", seq.handle.request_id, tok, e)
                self.finish(seq, FinishReason.CONSTRAINT,
                            error=CONSTRAINT_STUCK.format(reason=e))
                return StopCheck("", FinishReason.CONSTRAINT)
            complete = req.constraint.done
        seq.generated.append(tok)
        seq.feed = tok
        stop = check_stop(tok, k, req.stopping, self.eos_ids, seq.detok, seq.stopper, complete)
        self._emit(seq, token_event(k, tok, raw, attention, stop, req.output))
        if stop.finish is not None:
            self.finish(seq, stop.finish, stop_sequence=stop.stop_sequence,
                        stop_token=tok if stop.finish is FinishReason.STOP_TOKEN else None)
        return stop

    def release(self, seq: Sequence) -> None:
        """``seq``'s held tokens, if any, become events now."""
        if seq.held:
            self._release(seq)

    def _release(self, seq: Sequence) -> None:
        """Make the events of ``seq``'s held tokens (text through its detokenizer, in order)
        and stage them for its caller."""
        held, seq.held = seq.held, []
        k = len(seq.generated) - len(held)
        for j, (tok, t) in enumerate(held):  # (never the first token: that one is put at once)
            self._emit(seq, TokenEvent(index=k + j, token_id=tok, text=seq.detok.push(tok)), t)

    def _emit(self, seq: Sequence, ev: TokenEvent, now: float | None = None) -> None:
        """Hand ``ev`` to the caller (staged, or put at once); ``now``: when its token was
        chosen (a held token's step), by default now."""
        if now is None:
            now = time.monotonic()
        # (a resumed stream's first new token too; not a restarted one's: its caller has had
        # tokens from this server already)
        first = ev.index == seq.first_index and not seq.first_token
        self.metrics.token(first, now - (seq.submitted if first else seq.last_token))
        if first:
            seq.first_token = now
        seq.last_token = now
        seq.text.append(ev.text)
        box = seq.handle.events
        if first or not seq.staged:
            box.put(ev)  # (a sink with put alone gets every event at once)
        else:
            box.stage(ev)
            self._staged.add(box)

    # --- waking --------------------------------------------------------------------------------
    @property
    def pending(self) -> bool:
        """Some caller has events staged or tokens held."""
        return bool(self._staged or self._holding)

    def due(self, now: float) -> bool:
        """The staged callers' next round is due."""
        return bool(self._staged or self._holding) and now - self._woken >= self._interval

    def wake_staged(self) -> None:
        for seq in self._holding:
            self.release(seq)
        self._holding.clear()
        for box in self._staged:
            box.wake()
        self._interval = min(self.stream_interval * max(1, len(self._staged)),
                             self.stream_interval_max)
        self._staged.clear()
        self._woken = time.monotonic()

    # --- the end -------------------------------------------------------------------------------
    def finish(self, seq: Sequence, reason: FinishReason, stop_sequence: str = "",
               stop_token: int | None = None, error: str = "") -> None:
        self.release(seq)  # (held: cancelled, timed out or failed between two wake-ups)
        seq.done = True
        now = time.monotonic()
        t = Timings(queue=(seq.admitted or now) - seq.submitted,
                    ttft=(seq.first_token - seq.submitted) if seq.first_token else 0.0,
                    total=now - seq.submitted)
        ev = FinishEvent(reason=reason, prompt_tokens=len(seq.req.prompt_ids),
                         generated_tokens=len(seq.generated), text="".join(seq.text),
                         timings=t, stop_sequence=stop_sequence, stop_token_id=stop_token,
                         error=error, cached_tokens=seq.cached_tokens,
                         accepted_prediction_tokens=seq.prediction_accepted,
                         rejected_prediction_tokens=seq.prediction_rejected)
        self.metrics.finished(_FAILED.get(reason, reason.value) if error else reason.value,
                              len(seq.generated))
        log.info("request %s finished: %s, prompt %d, generated %d, queue %.3fs, ttft %.3fs, "
                 "total %.3fs", seq.handle.request_id, reason.value, ev.prompt_tokens,
                 ev.generated_tokens, t.queue, t.ttft, t.total)
        self._staged.discard(seq.handle.events)  # the put hands over what it held back
        seq.handle.events.put(ev)
