"""Logprobs in OpenAI's and vLLM's shapes, for the HTTP API: generated tokens (chat's
``content`` list, completions' parallel lists), the prompt's own tokens for completions'
``echo`` (the first token null, as vLLM and OpenAI's legacy API give it) and vLLM's
``prompt_logprobs`` extension. Prompt logprobs come from the engine's Score path
(``ScoredSequence``: the logprob of each prompt token after the ones before it, and the
top-n there)."""
from __future__ import annotations

from typing import Sequence

from .domain import ScoredSequence, TokenEvent


class Logprobs:
    def __init__(self, token_bytes):
        self.tb = token_bytes

    def token(self, i: int) -> tuple[str, list[int]]:
        b = bytes(self.tb[i])
        return b.decode("utf-8", errors="replace"), list(b)

    # --- generated tokens ----------------------------------------------------------------------
    def chat(self, evs: list[TokenEvent], want: bool) -> dict | None:
        if not want:
            return None
        content = []
        for ev in evs:
            if ev.special:
                continue
            tok, b = self.token(ev.token_id)
            tops = []
            if ev.top_ids is not None:
                for i, lp in zip(ev.top_ids.tolist(), ev.top_logprobs.tolist()):
                    t, tb = self.token(int(i))
                    tops.append({"token": t, "logprob": float(lp), "bytes": tb})
            content.append({"token": tok, "logprob": float(ev.logprob), "bytes": b,
                            "top_logprobs": tops})
        return {"content": content}

    def completion(self, evs: list[TokenEvent], want: bool, offset: int,
                   specials: bool = False) -> dict | None:
        """``specials``: the end token too (with ``echo``: lm-evaluation-harness reads the
        prompt's logprobs as all but the last entry, so the generated token must be there)."""
        if not want:
            return None
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                "text_offset": []}
        for ev in evs:
            if ev.special and not specials:
                continue
            out["tokens"].append(self.token(ev.token_id)[0])
            out["token_logprobs"].append(float(ev.logprob))
            tops = {}
            if ev.top_ids is not None:
                for i, lp in zip(ev.top_ids.tolist(), ev.top_logprobs.tolist()):
                    tops.setdefault(self.token(int(i))[0], float(lp))
            out["top_logprobs"].append(tops)
            out["text_offset"].append(offset)
            offset += len(ev.text)
        return out

    # --- the prompt ----------------------------------------------------------------------------
    def echo(self, ids: Sequence[int], scored: ScoredSequence | None, n_top: int) -> dict:
        """The prompt's part of a completion's logprobs (``echo`` with ``logprobs``): each
        prompt token, its logprob (the first null) and its top ``n_top`` with the token itself
        (vLLM's rule; the first null)."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                "text_offset": []}
        offset = 0
        for k, tid in enumerate(ids):
            text = self.token(tid)[0]
            out["tokens"].append(text)
            out["text_offset"].append(offset)
            offset += len(text)
            if k == 0 or scored is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            lp = float(scored.logprobs[k - 1])
            out["token_logprobs"].append(lp)
            tops: dict[str, float] = {}
            if n_top and scored.top_ids is not None:
                for i, v in zip(scored.top_ids[k - 1][:n_top].tolist(),
                                scored.top_logprobs[k - 1][:n_top].tolist()):
                    tops.setdefault(self.token(int(i))[0], float(v))
            tops.setdefault(text, lp)
            out["top_logprobs"].append(tops)
        return out

    def vllm_prompt(self, ids: Sequence[int], scored: ScoredSequence, n_top: int) -> list:
        """vLLM's ``prompt_logprobs``: per prompt token (the first None) a dict keyed by token
        id of {logprob, rank, decoded_token} for the top ``n_top`` and the prompt token itself.
        ``rank`` is 1-based in the model's distribution; null for a prompt token outside the
        top ``n_top`` (its rank is not computed)."""
        out: list = [None]
        for k in range(1, len(ids)):
            entry: dict[str, dict] = {}
            if n_top and scored.top_ids is not None:
                for r, (i, v) in enumerate(zip(scored.top_ids[k - 1][:n_top].tolist(),
                                               scored.top_logprobs[k - 1][:n_top].tolist())):
                    entry[str(int(i))] = {"logprob": float(v), "rank": r + 1,
                                          "decoded_token": self.token(int(i))[0]}
            tid = int(ids[k])
            entry.setdefault(str(tid), {"logprob": float(scored.logprobs[k - 1]), "rank": None,
                                        "decoded_token": self.token(tid)[0]})
            out.append(entry)
        return out
