"""Resuming a Generate stream that was cut after tokens were delivered (docs/failover.md).

A stream cut by a replica's death or drain (UNAVAILABLE, RESOURCE_EXHAUSTED, a proxy's stream
reset: INTERNAL "Stream removed" / RST_STREAM, a broken connection) is called again with the
same request and ``GenerateRequest.resume.token_ids`` = the tokens delivered so far; the
server prefills them and goes on exactly where the cut call would have (greedy and seeded
sampling are reproducible). The caller sees one stream: no index repeated or skipped.

What this needs from the request: a sampled request (temperature > 0) without a seed gets a
seed chosen here (63 random bits from the operating system), so that its continuation draws
the same random numbers; a caller's own seed is kept. The request also carries an empty
``resume`` from the first attempt on: it tells a draining server that this client resumes,
so the server moves the stream at once instead of letting it run out its grace.

``StreamResume`` is the bookkeeping of one call across attempts, shared by the blocking and
the asyncio client: the request of each attempt, the delivered ids, and the check that every
chunk continues the stream (a server that restarted the stream instead, an older one that
ignores ``resume``, sends indices already delivered: those are checked to be the same tokens
and skipped).
"""
from __future__ import annotations

import random

import grpc

from kvserve.v1 import inference_pb2 as pb

from . import messages as M

# the sampling rule's greedy threshold (kvserve.model.sampling.GREEDY_BELOW_TEMPERATURE; the
# client does not import the model package)
GREEDY_BELOW_TEMPERATURE = 1e-5

# codes a started stream is resumed on; INTERNAL / UNKNOWN only with one of these details (a
# proxy's or the transport's stream reset: nginx's RST_STREAM reaches grpcio as INTERNAL
# "Stream removed")
RESUME_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})
_RESET_CODES = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})
_RESET_DETAILS = ("stream removed", "rst_stream", "connection reset", "socket closed",
                  "broken pipe", "end of stream")

_SEEDS = random.SystemRandom()


def resumable(code: grpc.StatusCode, details: str) -> bool:
    """A started stream that ended with ``code`` / ``details`` may be resumed elsewhere."""
    if code in RESUME_CODES:
        return True
    low = (details or "").lower()
    return code in _RESET_CODES and any(s in low for s in _RESET_DETAILS)


class ResumeError(Exception):
    """A resumed call did not continue the stream (a different token at a delivered index,
    or an index skipped)."""


class StreamResume:
    """One Generate call's resume state across attempts. ``enabled`` False: the request is
    sent as given and nothing is resumed (a started stream's error is raised)."""

    def __init__(self, req: pb.GenerateRequest, enabled: bool):
        self.enabled = enabled
        if enabled:
            req = _copy(req)
            s = req.sampling
            if s.temperature >= GREEDY_BELOW_TEMPERATURE and not s.HasField("seed"):
                s.seed = _SEEDS.getrandbits(63)
            req.resume.SetInParent()  # present, empty: "this client resumes"
        self.base = req
        self.ids: list[int] = []  # the ids delivered to the caller, index 0 onwards

    def request(self) -> pb.GenerateRequest:
        """The request of the next attempt: the base one, with the delivered ids."""
        if not self.ids:
            return self.base
        r = _copy(self.base)
        r.resume.token_ids.extend(self.ids)
        return r

    def accept(self, index: int, token_id: int) -> bool:
        """True: token ``index`` is the stream's next one (now delivered); False: a token
        already delivered, sent again (the same id), to skip. Raises ``ResumeError``
        otherwise."""
        i, n = index, len(self.ids)
        if i == n:
            self.ids.append(token_id)
            return True
        if i < n and self.ids[i] == token_id:
            return False
        what = f"token {token_id} at index {i}, delivered {self.ids[i]}" if i < n else \
            f"index {i} after {n} tokens"
        raise ResumeError(f"the resumed stream does not continue the one delivered ({what})")

    def events(self, msg: pb.GenerateResponse, logprobs: bool) -> tuple[list, bool]:
        """The caller's events of one stream message (tokens sent again by a server that
        restarted the stream are skipped) and whether a new token came (progress: the retry
        budget starts again)."""
        out, progress = [], False
        for ev in M.generate_events(msg, logprobs):
            if isinstance(ev, M.TokenEvent):
                if not self.accept(ev.index, ev.id):
                    continue
                progress = True
            out.append(ev)
        return out, progress

    def may_resume(self, code: grpc.StatusCode, details: str) -> bool:
        """This error is resumed (after tokens were delivered; else it is raised) or, before
        any, retried like UNAVAILABLE."""
        return self.enabled and resumable(code, details)


def _copy(req: pb.GenerateRequest) -> pb.GenerateRequest:
    r = pb.GenerateRequest()
    r.CopyFrom(req)
    return r
