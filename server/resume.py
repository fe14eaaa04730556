"""Resuming a cut stream: a request that carries the tokens an earlier call of it delivered
(``GenerateRequest.resume``) goes on exactly as the uninterrupted call would have.

At admission (``restore``, called once from ``Engine._admit``) the delivered tokens are
replayed through the sequence's detokenizer and stop matcher without making events, so that a
stop string spanning the boundary is still found and text the matcher held back comes out
where it would have; they become the sequence's ``generated`` tokens (penalties,
``min_new_tokens``, ``max_new_tokens`` and token indices count them: a sampled step's draw
depends on its seed and position only, ``model.sampling``); and the engine's usual prefill
path feeds prompt + delivered tokens (``Sequence.prefill_ids``): one prefill of the delivered
tokens, no other work. On unpaired int8, int4 and fp16 artifacts a prefill makes a token's
rows differently from the one-token steps that made them in the earlier call
(``server.rounding``; paired ones compute them alike): there the delivered tokens are fed one
step each after the prompt's prefill (``Sequence.replay``), a step per delivered token before
the first new one.

Nothing about the draws is carried: position n's draw is the same whatever came before it,
so the next token is drawn as the uninterrupted call would have drawn it. A sampled request
without a seed (the server picks a random one) cannot be continued identically and is
refused.

``check`` runs in the caller's thread before submission (INVALID_ARGUMENT for tokens that run
past the end of the stream they claim to continue); ``restore`` in the engine's.

The engine uses the same path after one of its iterations failed (an unexpected exception:
the KV cache it was writing is dropped): ``restart`` makes each request in flight a resumed
one from the tokens its caller has had, on the same handle, so its stream goes on with the
tokens it would have had instead of ending in an error. Each request is restarted once
(``MAX_RESTARTS``): a request whose own tokens make an iteration fail every time fails there,
with the requests restarted beside it, at the second failure.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence as Seq

from .detok import IncrementalDetokenizer, StopMatcher, TokenBytes
from .domain import FinishReason, GenerateRequest, InvalidArgument, StopParams
from .sequence import Sequence
from .stopping import StopCheck, check_stop

MAX_RESTARTS = 1  # times a request in flight is re-admitted after a failed engine iteration


def _replay(tokens: Seq[int], st: StopParams, eos_ids: frozenset[int],
            detok: IncrementalDetokenizer, stopper: StopMatcher,
            texts: list[str], matcher=None) -> tuple[int, StopCheck | None]:
    """Push ``tokens`` (generated indices 0..) through the detokenizer and stop matcher as
    the output processor did when it emitted them, and through the constraint's ``matcher``
    (llguidance's; None: unconstrained), whose completion ends a stream as it did then; each
    token's released text goes to ``texts``. Returns how many were replayed and, when one
    ended the stream, its check (the replay stops there). A token the matcher refuses raises
    ``InvalidArgument``."""
    for k, tok in enumerate(tokens):
        complete = False
        if matcher is not None:
            if not matcher.consume_token(int(tok)):
                raise InvalidArgument(f"resume.token_ids: token {k} ({int(tok)}) is not allowed "
                                      f"by the request's constraint at that point; these are "
                                      f"not the tokens this request delivered",
                                      field="resume.token_ids")
            complete = matcher.is_stopped()
        stop = check_stop(tok, k, st, eos_ids, detok, stopper, complete)
        texts.append(stop.text)
        if stop.finish is not None:
            return k + 1, stop
    return len(tokens), None


def check(req: GenerateRequest, token_bytes: TokenBytes, eos_ids: frozenset[int]) -> None:
    """Refuse a resume the server cannot continue identically: a sampled request without a
    seed, more tokens than ``max_new_tokens``, tokens after one that ended the stream (its
    constraint's completion included), tokens its constraint does not allow (checked on a
    copy of its matcher: the request's own is brought along in ``restore``)."""
    n = len(req.resume)
    if not n:
        return
    if not req.sampling.greedy and req.sampling.seed is None:
        raise InvalidArgument("resume.token_ids of a sampled request needs its sampling.seed "
                              "(a resumed stream continues the same random sequence)",
                              field="resume.token_ids")
    if n > req.stopping.max_new_tokens:
        raise InvalidArgument(f"resume.token_ids has {n} tokens; max_new_tokens is "
                              f"{req.stopping.max_new_tokens}", field="resume.token_ids")
    matcher = req.constraint.matcher.deep_copy() if req.constraint is not None else None
    done, stop = _replay(req.resume, req.stopping, eos_ids, IncrementalDetokenizer(token_bytes),
                         StopMatcher(req.stopping.stop), [], matcher)
    if done < n:
        raise InvalidArgument(f"resume.token_ids: token {done - 1} ended the stream "
                              f"({stop.finish.value}); nothing can follow it",
                              field="resume.token_ids")


def restore(seq: Sequence, eos_ids: frozenset[int], output, step: bool = False) -> bool:
    """Bring a resumed ``seq`` (its detokenizer and stop matcher made fresh) to
    where the earlier call left it. Returns True when the delivered tokens had ended the
    stream already: ``output`` (the OutputProcessor) has then finished it and it needs no
    prefill. ``step``: the delivered tokens are fed one decode step each after the prompt
    (``Sequence.replay``), as the earlier call made their rows, instead of prefilled with it
    (artifacts whose rows depend on the call's shape: ``server.rounding``)."""
    req = seq.req
    # (its matcher is brought to where the delivered tokens left it, ``check`` having
    # replayed them on a copy: a refusal here would be a server bug, failing this request)
    try:
        done, stop = _replay(req.resume, req.stopping, eos_ids, seq.detok, seq.stopper,
                             seq.text, req.constraint.matcher if req.constraint else None)
    except InvalidArgument:
        output.finish(seq, FinishReason.ERROR, error="internal error")
        return True
    seq.generated.extend(req.resume[:done])
    seq.first_index = done
    if step:
        seq.replay = list(seq.generated)
    else:
        seq.prefill_ids = [*req.prompt_ids, *seq.generated]
    if stop is None:
        return False
    output.finish(seq, stop.finish, stop_sequence=stop.stop_sequence,
                  stop_token=seq.generated[-1] if stop.finish is FinishReason.STOP_TOKEN
                  else None)
    return True


def restart(seq: Sequence, output) -> Sequence | None:
    """``seq``'s request again after a failed engine iteration dropped its KV rows: a new
    sequence on the same handle that resumes from the tokens its caller has had (``restore``
    at its admission), with the seed it drew with and a fresh constraint matcher; its tokens
    chosen but not yet sent are sent first (``output.release``). None where it is not
    restarted: cancelled, or restarted ``MAX_RESTARTS`` times already."""
    if seq.restarts >= MAX_RESTARTS or seq.handle.cancelled:
        return None
    output.release(seq)
    req = seq.req
    had = tuple(seq.generated[:len(seq.text)])  # what its caller has had (its events' tokens,
    # the resumed ones restored at admission among them) ...
    if len(had) < len(req.resume):  # ... unless the failure came before its admission
        had = req.resume  # restored them
    sampling = req.sampling if seq.seed is None else dataclasses.replace(req.sampling,
                                                                          seed=seq.seed)
    again = dataclasses.replace(
        req, sampling=sampling, resume=had,
        constraint=None if req.constraint is None else req.constraint.fresh())
    return Sequence(again, seq.handle, submitted=seq.submitted, admitted=seq.admitted,
                    first_token=seq.first_token, last_token=seq.last_token,
                    restarts=seq.restarts + 1, prediction_accepted=seq.prediction_accepted,
                    prediction_rejected=seq.prediction_rejected)
