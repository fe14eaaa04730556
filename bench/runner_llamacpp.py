"""llama.cpp as a peer (``llamacpp``, ``llamacpp_q8``, ``llamacpp_q4``): llama-cpp-python's
low-level API in-process on a GGUF of the same weights (``bench/gguf_convert.py``), greedy by
llama.cpp's own sampler (``llama_sampler_init_greedy``: the argmax in C).

A batch of B prompts is B sequences of one context (``n_seq_max`` = B, a unified KV cache:
what its server's parallel slots run): the prompts are prefilled together in one
``llama_decode`` (chunked by ``n_batch``), then every step decodes the B next tokens in one
call. Contexts are made once per batch size and reused, their memory cleared per call.

``lookup`` > 0: llama.cpp with prompt-lookup decoding, as llama-cpp-python ships it
(``llama_cpp.llama_speculative.LlamaPromptLookupDecoding``, its defaults: the first earlier
occurrence of the last 2 tokens, else of the last one, proposes up to ``lookup`` = 10 tokens;
llama.cpp's own ``llama-lookup`` example keeps n-gram statistics instead, not bound here),
each sequence's draft verified in the same ``llama_decode`` as the others' (ragged rows, one
logits row each), greedy: the agreeing draft tokens and the one after them are kept, the
rejected rows removed from the KV cache (``llama_memory_seq_rm``; a cache per sequence). The
output is the plain path's as far as llama.cpp's rows agree across call shapes (the bench
compares them).
Needs ``pip install 'kvserve[llamacpp]'`` (built without AMX on these machines:
docs/benchmarks.md says how).
"""
from __future__ import annotations

import time

import numpy as np

from .runner_base import Runner

N_BATCH = 512  # tokens per llama_decode call of a prefill


class LlamaCppRunner(Runner):
    name = "llamacpp"

    def __init__(self, gguf: str, threads: int, max_tokens: int = 2048, lookup: int = 0):
        import llama_cpp as L

        self.L, self.threads, self.max_tokens = L, threads, max_tokens
        self.lookup = lookup
        self.drafted = self.accepted = 0  # prompt-lookup totals (``lookup``)
        L.llama_backend_init()
        L.llama_log_set(_quiet, None)
        mp = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(gguf.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        self.vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.sampler = L.llama_sampler_init_greedy()
        self.ctxs: dict[int, tuple] = {}  # batch -> (context, its tokens per sequence)

    def _ctx(self, batch: int, per_seq: int):
        have = self.ctxs.get(batch)
        if have is not None and have[1] >= per_seq:
            return have[0]
        if have is not None:
            self.L.llama_free(have[0])
        L = self.L
        cp = L.llama_context_default_params()
        n = max(256, -(-per_seq // 256) * 256)
        cp.n_ctx = n * batch
        cp.n_batch = cp.n_ubatch = N_BATCH
        cp.n_seq_max = batch
        # one cache for all sequences, as its server's parallel slots; with lookup one per
        # sequence: in a unified cache the rejected rows' removal leaves holes that the other
        # sequences' next rows fill, so a sequence's rows go out of position order and its sums
        # round differently from its plain path's (a review found 91% of the tokens the same
        # at batch 8 on 6M f32 where one cache per sequence kept all; its multi-token rows
        # still round differently from one-token steps: bench/results/lookup-peers.md)
        cp.kv_unified = not self.lookup
        cp.n_threads = cp.n_threads_batch = self.threads
        cp.no_perf = True
        ctx = L.llama_init_from_model(self.model, cp)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not make a context of {cp.n_ctx} tokens")
        self.ctxs[batch] = (ctx, n)
        return ctx

    def _decode(self, ctx, rows: list[tuple[int, int, int, bool]]) -> list[int]:
        """One llama_decode of (token, position, sequence, wants logits) rows; returns the
        batch indices of the rows with logits."""
        L = self.L
        b = L.llama_batch_init(len(rows), 0, 1)
        try:
            out = []
            for i, (tok, pos, seq, want) in enumerate(rows):
                b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
                b.seq_id[i][0] = seq
                b.logits[i] = want
                if want:
                    out.append(i)
            b.n_tokens = len(rows)
            rc = L.llama_decode(ctx, b)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            return out
        finally:
            L.llama_batch_free(b)

    def _prefilled(self, prompts: np.ndarray, rows: int):
        """A cleared context holding ``prompts`` (B, P) and room for ``rows`` per sequence:
        (context, each sequence's greedy first token)."""
        L = self.L
        B, P = prompts.shape
        ctx = self._ctx(B, rows)
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        feed = [(int(prompts[s, p]), p, s, p == P - 1) for s in range(B) for p in range(P)]
        for a in range(0, len(feed), N_BATCH):
            self._decode(ctx, feed[a:a + N_BATCH])
        return ctx, self._first_tokens(ctx, prompts)

    def generate(self, prompts, n, times: list | None = None):
        L = self.L
        prompts = np.asarray(prompts, np.int64)
        B, P = prompts.shape
        if self.lookup:
            return self._generate_lookup(prompts, n, times)
        ctx, first = self._prefilled(prompts, P + n + 1)
        out = np.empty((B, n), np.int64)
        out[:, 0] = first
        if times is not None:
            times.append(time.perf_counter())
        for k in range(1, n):
            idx = self._decode(ctx, [(int(out[s, k - 1]), P + k - 1, s, True) for s in range(B)])
            out[:, k] = [L.llama_sampler_sample(self.sampler, ctx, i) for i in idx]
            if times is not None:
                times.append(time.perf_counter())
        return out

    def _generate_lookup(self, prompts: np.ndarray, n: int, times: list | None) -> np.ndarray:
        """``generate`` with prompt-lookup drafts (see the module's docstring)."""
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        L, draft = self.L, LlamaPromptLookupDecoding.find_candidate_pred_tokens
        B, P = prompts.shape
        ctx, first = self._prefilled(prompts, P + n + self.lookup + 1)
        if times is not None:
            times.append(time.perf_counter())
        mem = L.llama_get_memory(ctx)
        seqs = [[*map(int, prompts[s]), first[s]] for s in range(B)]
        while True:
            rows, drafts = [], []
            for s, ids in enumerate(seqs):
                left = P + n - len(ids)  # tokens still to make (a draft makes one more)
                if left <= 0:
                    continue
                d = draft(np.asarray(ids, np.intc), 2, min(self.lookup, left - 1)).tolist() \
                    if left > 1 else []
                drafts.append((s, d, len(rows)))
                pos = len(ids) - 1  # the last token's row is fed now
                rows += [(t, pos + j, s, True) for j, t in enumerate([ids[-1], *d])]
            if not rows:
                break
            idx = self._decode(ctx, rows)
            for s, d, r0 in drafts:
                pos, k = len(seqs[s]) - 1, 0
                while True:  # the plain path's token at each row, while the draft agrees
                    tok = L.llama_sampler_sample(self.sampler, ctx, idx[r0 + k])
                    seqs[s].append(int(tok))
                    if k == len(d) or tok != d[k]:
                        break
                    k += 1
                self.drafted, self.accepted = self.drafted + len(d), self.accepted + k
                if k < len(d):  # the rejected draft tokens' rows leave the cache
                    L.llama_memory_seq_rm(mem, s, pos + 1 + k, -1)
            if times is not None:
                times.append(time.perf_counter())
        return np.array([ids[P:P + n] for ids in seqs], np.int64)

    def _first_tokens(self, ctx, prompts: np.ndarray) -> list[int]:
        """Greedy first tokens after a prefill: sequences whose last prompt row was not in the
        final chunk are re-read by decoding that row again (only when B × P > N_BATCH)."""
        L = self.L
        B, P = prompts.shape
        final_lo = ((B * P - 1) // N_BATCH) * N_BATCH  # the last chunk's first row
        toks: dict[int, int] = {}
        for s in range(B):  # first the final chunk's (the next decode overwrites its logits)
            r = s * P + P - 1
            if r >= final_lo:
                toks[s] = L.llama_sampler_sample(self.sampler, ctx, r - final_lo)
        for s in range(B):
            if s not in toks:
                L.llama_memory_seq_rm(L.llama_get_memory(ctx), s, P - 1, -1)
                (i,) = self._decode(ctx, [(int(prompts[s, P - 1]), P - 1, s, True)])
                toks[s] = L.llama_sampler_sample(self.sampler, ctx, i)
        return [toks[s] for s in range(B)]

    def timed(self, prompts, n):
        times: list[float] = []
        t0 = time.perf_counter()
        out = self.generate(prompts, n, times)
        return out, times[0] - t0, time.perf_counter() - t0

    def stream(self, prompt, n):
        times: list[float] = []
        self.generate(np.asarray(prompt)[None], n, times)
        return times

    def close(self):
        for ctx, _ in self.ctxs.values():
            self.L.llama_free(ctx)
        self.L.llama_sampler_free(self.sampler)
        self.L.llama_model_free(self.model)


def _quiet_log(level, text, user_data):  # llama.cpp's log lines: not on the runner's stderr
    return None


def _make_quiet():
    try:
        import llama_cpp

        return llama_cpp.llama_log_callback(_quiet_log)
    except (ImportError, AttributeError):
        return None


_quiet = _make_quiet()
