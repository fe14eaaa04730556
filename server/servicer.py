"""The gRPC servicer: protobuf <-> domain types, domain errors -> status codes. Thin on purpose:
validation lives in ``validation``, the work in ``engine``.
"""
from __future__ import annotations

import json
import logging
import queue
import time

import grpc

from kvserve.v1 import inference_pb2 as pb
from kvserve.v1 import inference_pb2_grpc as pb_grpc

from . import request_map as RM
from . import resume
from . import validation as V
from .domain import (FailedPrecondition, FinishEvent, FinishReason, GenerateRequest,
                     InvalidArgument, QueueFull, ServingError, TokenEvent, Unavailable,
                     Unimplemented)
from .constraints import ConstraintSpec
from .guides import Guides
from .prompts import Prompts
from .state import ServingState

log = logging.getLogger(__name__)

_COALESCE_MAX = 64  # tokens in one coalesced Generate message

# what a draining server tells a stream whose client resumes (GenerateRequest.resume is set)
MOVING = "the server is draining: this stream moves to another replica (resume it there)"

MAX_TOKENIZE_TEXTS = 1024

_FINISH = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.EOS_TOKEN: pb.FINISH_REASON_EOS_TOKEN,
    FinishReason.STOP_SEQUENCE: pb.FINISH_REASON_STOP_SEQUENCE,
    FinishReason.STOP_TOKEN: pb.FINISH_REASON_STOP_TOKEN,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
    FinishReason.TIME_LIMIT: pb.FINISH_REASON_TIME_LIMIT,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
    FinishReason.CONSTRAINT: pb.FINISH_REASON_CONSTRAINT,
}

_STATUS = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    Unimplemented: grpc.StatusCode.UNIMPLEMENTED,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
}


def structured_spec(m: pb.Structured) -> ConstraintSpec:
    """``GenerateRequest.structured`` -> a checked ``ConstraintSpec`` (errors name the field)."""
    which = m.WhichOneof("kind")
    field = f"structured.{which}"
    if which == "json_schema":
        return ConstraintSpec.json_schema(m.json_schema, field)
    if which == "json_object":
        if not m.json_object:
            raise InvalidArgument("structured.json_object must be true (or leave structured "
                                  "unset)", field=field)
        return ConstraintSpec.json_object(field)
    if which == "regex":
        return ConstraintSpec.regex(m.regex, field)
    if which == "choice":
        return ConstraintSpec.choice(list(m.choice.choices), field)
    if which == "grammar":
        return ConstraintSpec.lark(m.grammar, field)
    raise InvalidArgument("structured is set but empty: set one of json_schema, json_object, "
                          "regex, choice, grammar", field="structured")


def _abort(context: grpc.ServicerContext, e: ServingError):
    context.abort(_STATUS.get(type(e), grpc.StatusCode.INTERNAL), str(e))


class InferenceServicer(pb_grpc.InferenceServicer):
    def __init__(self, engine, tokenizer, token_bytes, limits: V.Limits, state: ServingState,
                 metrics=None, prompts: Prompts | None = None, guides: Guides | None = None):
        self.engine, self.tok, self.tb = engine, tokenizer, token_bytes
        self.lim, self.state, self.metrics = limits, state, metrics
        self.prompts = prompts or Prompts(tokenizer, limits)
        self.guides = guides or Guides(None, limits.vocab_size, ())

    # --- helpers -------------------------------------------------------------------------------
    def _gate(self) -> None:
        self.state.gate()

    def _prompt_ids(self, text: str | None, ids) -> list[int]:
        if text is not None:
            return self.prompts.text(text)  # (refused there when the model has no tokenizer)
        return self.prompts.ids(ids)

    @staticmethod
    def _deadline(context) -> float | None:
        rem = context.time_remaining()
        return None if rem is None else time.monotonic() + max(0.0, rem)

    def _count(self, rpc: str, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.requests.inc(rpc=rpc, outcome=outcome)

    # --- Generate ------------------------------------------------------------------------------
    def _generate_request(self, r: pb.GenerateRequest, context) -> GenerateRequest:
        which = r.WhichOneof("prompt")
        if which is None:
            raise InvalidArgument("the prompt is empty: set text or token_ids")
        if which == "chat":
            ids = self._chat_ids(r.chat)
        else:
            ids = self._prompt_ids(r.text if which == "text" else None,
                                   r.token_ids.ids if which == "token_ids" else None)
        s, st, o = r.sampling, r.stopping, r.response
        if st.stop:
            self.prompts.need_tokenizer("a stop string (use stop_token_ids)")
        sampling = RM.sampling_params(RM.from_grpc(s), self.lim)
        stopping = V.stop_params(prompt_len=len(ids), max_new_tokens=st.max_new_tokens,
                                 min_new_tokens=st.min_new_tokens, stop=list(st.stop),
                                 stop_token_ids=list(st.stop_token_ids),
                                 ignore_eos=st.ignore_eos, lim=self.lim)
        output = V.output_params(prompt_len=len(ids), max_new_tokens=stopping.max_new_tokens,
                                 logprobs=o.logprobs, top_logprobs=o.top_logprobs,
                                 return_logits=o.return_logits,
                                 attention_layers=list(o.attention.layers),
                                 attention_heads=list(o.attention.heads),
                                 attention_available=self.engine.lm.has_attention, lim=self.lim)
        delivered = V.check_ids("resume.token_ids", r.resume.token_ids, self.lim,
                                max_len=stopping.max_new_tokens)
        spec = structured_spec(r.structured) if r.HasField("structured") else None
        req = GenerateRequest(ids, sampling, stopping, output,
                              request_id=V.check_request_id(r.request_id),
                              deadline=self._deadline(context), resume=tuple(delivered),
                              constraint=self.guides.constraint(spec),
                              lookup_ids=self._prediction(r.prediction))
        resume.check(req, self.tb, self.engine.eos_ids)
        return req

    def _prediction(self, p: pb.Prediction) -> tuple[int, ...]:
        which = p.WhichOneof("content")
        if which is None:
            return ()
        return self.prompts.prediction(p.text if which == "text" else None,
                                       p.token_ids.ids if which == "token_ids" else None,
                                       f"prediction.{which}")

    def _chat_ids(self, chat: pb.ChatPrompt) -> list[int]:
        cont = chat.continue_final_message
        agp = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else not cont
        kwargs = None
        if chat.chat_template_kwargs:
            try:
                kwargs = json.loads(chat.chat_template_kwargs)
            except RecursionError:
                raise InvalidArgument("chat.chat_template_kwargs nests too deeply") from None
            except ValueError:
                raise InvalidArgument("chat.chat_template_kwargs is not a JSON object") from None
        return self.prompts.chat([(m.role, m.content) for m in chat.messages], agp, cont,
                                 template_kwargs=kwargs)

    def _chunk(self, ev: TokenEvent) -> pb.GenerateResponse:
        return pb.GenerateResponse(chunk=self._token(pb.TokenChunk, ev))

    def _token(self, make, ev: TokenEvent) -> pb.TokenChunk:
        """``ev`` as a ``TokenChunk`` made by ``make`` (the message class, or a repeated field's
        ``add``: a coalesced token is written into its message, not copied into it)."""
        c = make(index=ev.index, id=ev.token_id, text=ev.text, special=ev.special)
        if ev.logprob is not None:
            c.logprob = ev.logprob
        if ev.top_ids is not None:
            c.top_logprobs.extend(
                pb.TopLogprob(id=int(i), logprob=float(lp), text=self._token_text(int(i)))
                for i, lp in zip(ev.top_ids, ev.top_logprobs))
        if ev.logits is not None:
            c.logits.extend(ev.logits.tolist())
        for layer, head, row in ev.attention:
            c.attention.add(layer=layer, head=head, weights=row.tolist())
        return c

    def _token_text(self, i: int) -> str:
        return self.tb[i].decode("utf-8", errors="replace")

    def Generate(self, request, context):  # noqa: N802
        with self.state.call():
            yield from self._generate(request, context)

    def _generate(self, request, context):
        try:
            self._gate()
            req = self._generate_request(request, context)
            handle = self.engine.submit(req)
        except ServingError as e:
            self._count("Generate", type(e).__name__)
            _abort(context, e)
        context.add_callback(handle.cancel)  # client gone / deadline: free the slot
        rid = handle.request_id
        coalesce = request.response.coalesce
        # a client that resumes: a drain moves its stream at once (the tokens it has, it keeps)
        movable = request.HasField("resume")
        held = None  # an event taken while coalescing, handled next
        while True:
            try:
                ev = held or handle.events.get(timeout=0.25 if movable else 1.0)
                held = None
            except queue.Empty:
                if not context.is_active():
                    handle.cancel()
                elif movable and self.state.draining:
                    self._move(handle, context)
                continue
            if isinstance(ev, TokenEvent):
                if movable and self.state.draining:
                    self._move(handle, context)
                msg = self._chunk(ev)
                more = msg.more
                while coalesce and len(more) < _COALESCE_MAX:
                    try:  # tokens that are ready already ride along
                        nxt = handle.events.get_nowait()
                    except queue.Empty:
                        break
                    if not isinstance(nxt, TokenEvent):
                        held = nxt
                        break
                    self._token(more.add, nxt)
                yield msg
                continue
            assert isinstance(ev, FinishEvent)
            if ev.reason is FinishReason.TIME_LIMIT:
                rem = context.time_remaining()
                if rem is not None and rem <= 0.05:
                    context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  f"deadline exceeded after {ev.generated_tokens} tokens")
                if ev.error:  # the server's time limit passed while it was still queued
                    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, ev.error)
            if ev.reason is FinishReason.CONSTRAINT and ev.error:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, ev.error)
            if ev.reason is FinishReason.CANCELLED and ev.error:
                context.abort(grpc.StatusCode.UNAVAILABLE, ev.error)
            yield pb.GenerateResponse(complete=pb.Complete(
                finish_reason=_FINISH[ev.reason], stop_sequence=ev.stop_sequence,
                stop_token_id=ev.stop_token_id or 0, prompt_tokens=ev.prompt_tokens,
                generated_tokens=ev.generated_tokens, request_id=rid, text=ev.text,
                error=ev.error, cached_prompt_tokens=ev.cached_tokens,
                accepted_prediction_tokens=ev.accepted_prediction_tokens,
                rejected_prediction_tokens=ev.rejected_prediction_tokens,
                timings=pb.Timings(queue_seconds=ev.timings.queue,
                                   time_to_first_token_seconds=ev.timings.ttft,
                                   total_seconds=ev.timings.total)))
            if ev.reason is FinishReason.ERROR:
                context.abort(grpc.StatusCode.INTERNAL, "generation failed (internal error); "
                                                        f"request {rid}")
            return

    def _move(self, handle, context) -> None:
        """End a resumable stream of a draining server: UNAVAILABLE, on which its client
        resumes it elsewhere with the tokens it got (the event in hand was not sent)."""
        handle.cancel()
        context.abort(grpc.StatusCode.UNAVAILABLE, MOVING)

    # --- Score ---------------------------------------------------------------------------------
    def Score(self, request, context):  # noqa: N802
        with self.state.call():
            return self._score(request, context)

    def _score(self, request, context):
        try:
            self._gate()
            if request.texts and request.token_ids:
                raise InvalidArgument("give texts or token_ids, not both")
            for name in ("texts", "token_ids"):
                n = len(getattr(request, name))
                if n > self.lim.cfg.max_score_sequences:
                    raise InvalidArgument(f"{name} has {n} sequences; the limit is "
                                          f"{self.lim.cfg.max_score_sequences} per call")
            if request.texts:
                seqs = self._score_texts(request.texts)
            else:  # lengths first: no id becomes a Python int before they pass
                V.score_lengths([len(s.ids) for s in request.token_ids], self.lim)
                seqs = [list(s.ids) for s in request.token_ids]
            req = V.score_request(seqs, request.top_logprobs, request.request_id, self.lim)
            req.deadline = self._deadline(context)
            handle, fut = self.engine.submit_score(req)
        except ServingError as e:
            self._count("Score", type(e).__name__)
            _abort(context, e)
        context.add_callback(handle.cancel)
        try:
            results = fut.result()
        except Exception as e:  # noqa: BLE001
            if fut.cancelled():
                rem = context.time_remaining()
                if rem is not None and rem <= 0.05:
                    context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
                context.abort(grpc.StatusCode.CANCELLED, "cancelled")
            if isinstance(e, ServingError):
                _abort(context, e)
            log.error("score %s failed: %s", handle.request_id, e)
            context.abort(grpc.StatusCode.INTERNAL, "scoring failed (internal error)")
        out = pb.ScoreResponse()
        for r in results:
            s = out.sequences.add(token_count=r.token_count, sum_logprob=r.sum,
                                  mean_logprob=r.mean, perplexity=r.perplexity)
            for j, (tid, lp) in enumerate(zip(r.ids.tolist(), r.logprobs.tolist())):
                t = s.tokens.add(id=tid, logprob=lp)
                if r.top_ids is not None:
                    t.top_logprobs.extend(
                        pb.TopLogprob(id=int(i), logprob=float(v), text=self._token_text(int(i)))
                        for i, v in zip(r.top_ids[j], r.top_logprobs[j]))
        if self.metrics is not None:
            self.metrics.scored.inc(sum(r.token_count for r in results))
        self._count("Score", "ok")
        return out

    def _score_texts(self, texts) -> list[list[int]]:
        """Characters checked before anything is tokenized; tokenized one text at a time,
        stopping as soon as the call is over its token budget."""
        self.prompts.need_tokenizer("a text prompt")
        texts = V.check_texts(texts, V.score_chars(self.lim.cfg), self.lim,
                              name=lambda i: "text", what="texts: ")
        budget, seqs, total = self.lim.cfg.max_score_tokens, [], 0
        for i, t in enumerate(texts):
            seqs.append(self.prompts.text(t, "text"))  # BOS as transformers adds it
            total += len(seqs[-1])
            if total > budget:
                raise InvalidArgument(f"the texts have {total} tokens in all after {i + 1} of "
                                      f"{len(texts)}; the limit is {budget} per call")
        return seqs

    # --- tokenizer -----------------------------------------------------------------------------
    def Tokenize(self, request, context):  # noqa: N802
        try:
            self._gate()
            self.prompts.need_tokenizer("Tokenize")
            if len(request.texts) > MAX_TOKENIZE_TEXTS:
                raise InvalidArgument(f"at most {MAX_TOKENIZE_TEXTS} texts per call")
            # checked and tokenized as transformers' AutoTokenizer (BOS/EOS per the
            # tokenizer's post-processor)
            ids = self.prompts.texts(request.texts, V.tokenize_chars(self.lim.cfg)) \
                if request.texts else []
        except ServingError as e:
            _abort(context, e)
        return pb.TokenizeResponse(tokens=[pb.TokenIds(ids=x) for x in ids])

    def Detokenize(self, request, context):  # noqa: N802
        try:
            self._gate()
            self.prompts.need_tokenizer("Detokenize")
            if len(request.token_ids) > MAX_TOKENIZE_TEXTS:
                raise InvalidArgument(f"at most {MAX_TOKENIZE_TEXTS} sequences per call")
            total = sum(len(s.ids) for s in request.token_ids)
            if total > V.detokenize_ids(self.lim.cfg):
                raise InvalidArgument(f"{total} token ids in all; the limit is "
                                      f"{V.detokenize_ids(self.lim.cfg)} per call")
            seqs = [V.check_ids(f"token_ids[{i}]", s.ids, self.lim,
                                max_len=self.lim.cfg.max_score_tokens)
                    for i, s in enumerate(request.token_ids)]
        except ServingError as e:
            _abort(context, e)
        return pb.DetokenizeResponse(texts=[self.tok.decode(s) for s in seqs])

    def ModelInfo(self, request, context):  # noqa: N802
        try:
            self._gate()
        except ServingError as e:
            _abort(context, e)
        return self.state.info["model_info"]


def model_info(lm, limits: V.Limits, manifest_sha256: str, eos_id: int | None,
               version: str, eos_ids=(), chat: bool = False) -> pb.ModelInfoResponse:
    c, cfg = lm.cfg, limits.cfg
    lim = pb.Limits(
        max_context=limits.max_context, max_new_tokens=cfg.max_new_tokens,
        max_batch=cfg.max_batch, max_queue=cfg.max_queue, max_stop_strings=cfg.max_stop_strings,
        max_stop_string_chars=cfg.max_stop_string_chars,
        max_stop_token_ids=cfg.max_stop_token_ids, max_top_logprobs=cfg.max_top_logprobs,
        max_logits_floats=cfg.max_logits_floats, max_attention_floats=cfg.max_attention_floats,
        max_prompt_chars=cfg.max_prompt_chars, max_score_sequences=cfg.max_score_sequences,
        max_score_tokens=cfg.max_score_tokens, max_temperature=cfg.max_temperature,
        max_repetition_penalty=cfg.max_repetition_penalty,
        max_abs_presence_frequency_penalty=cfg.max_abs_penalty,
        max_chat_messages=cfg.max_chat_messages, max_chat_chars=cfg.max_chat_chars)
    return pb.ModelInfoResponse(
        config_json=json.dumps(c.to_dict(), sort_keys=True), vocab_size=c.vocab_size,
        n_layers=c.n_layers, n_heads=c.n_heads, n_kv_heads=c.n_kv_heads,
        max_seq_len=c.max_seq_len, eos_token_id=-1 if eos_id is None else eos_id,
        provider=lm.provider,
        graphs={k: v.get("file", "") for k, v in lm.manifest.get("graphs", {}).items()},
        manifest_sha256=manifest_sha256, attention_available=lm.has_attention, limits=lim,
        version=version, chat_template_available=chat, eos_token_ids=sorted(eos_ids))

