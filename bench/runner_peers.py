"""The peers kvserve is measured against: its torch model (``torch``), transformers
(``hf``) and onnxruntime-genai (``genai``), each on the same weights."""
from __future__ import annotations

import time

import numpy as np

from .runner_base import Runner, prompts_for


def _torch_score(torch, model, seqs) -> list[np.ndarray]:
    """Per-token logprobs of a batch of equal-length sequences by one full forward (any model
    whose output has ``.logits``: kvserve's and transformers')."""
    with torch.no_grad():
        x = torch.tensor(np.asarray(seqs, np.int64))
        lp = torch.log_softmax(model(x).logits.float(), -1)
        return list(lp[:, :-1].gather(-1, x[:, 1:, None])[..., 0].numpy())


class TorchRunner(Runner):
    """kvserve's torch model, eager, via model.generate (prefill + one step per token)."""
    name = "torch"
    has_score = True

    def __init__(self, ckpt: str, threads: int):
        import torch

        from kvserve.model.checkpoint import load_model

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = load_model(ckpt).eval()
        self.cfg = self.model.cfg

    def generate(self, prompts, n):
        from kvserve.model.generate import generate

        g = generate(self.model, prompts.tolist(), n, eos_id=None)
        return np.asarray(g.tokens, np.int64)

    def score(self, seqs):
        return _torch_score(self.torch, self.model, seqs)


class HFRunner(Runner):
    """transformers LlamaForCausalLM, eager attention, greedy generate."""
    name = "hf"
    has_score = True

    def __init__(self, hf_dir: str, threads: int):
        import torch
        import transformers as tf

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = tf.LlamaForCausalLM.from_pretrained(
            hf_dir, attn_implementation="eager", dtype=torch.float32).eval()

    def generate(self, prompts, n):
        x = self.torch.tensor(prompts)
        with self.torch.no_grad():
            out = self.model.generate(x, attention_mask=self.torch.ones_like(x),
                                      max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                      num_beams=1, pad_token_id=1, use_cache=True)
        return out[:, prompts.shape[1]:].numpy()

    def score(self, seqs):
        return _torch_score(self.torch, self.model, seqs)


class GenaiRunner(Runner):
    """onnxruntime-genai Generator API, greedy (its model builder's graph of the same HF dir)."""
    name = "genai"
    has_steps = True
    has_stream = True

    def __init__(self, genai_dir: str, threads: int, vocab: int):
        import onnxruntime_genai as og

        self.og, self.vocab = og, vocab
        self.model = og.Model(genai_dir)

    def _generator(self, batch, max_length):
        p = self.og.GeneratorParams(self.model)
        # min_length = max_length: no early EOS, every runner makes exactly n tokens
        p.set_search_options(batch_size=batch, max_length=max_length, min_length=max_length,
                             do_sample=False)
        return self.og.Generator(self.model, p)

    def generate(self, prompts, n, times: list | None = None):
        B, P = prompts.shape
        g = self._generator(B, P + n)
        g.append_tokens(prompts.astype(np.int32))
        while not g.is_done():
            g.generate_next_token()
            if times is not None:
                times.append(time.perf_counter())
        out = np.stack([g.get_sequence(b)[P:P + n] for b in range(B)]).astype(np.int64)
        del g
        return out

    def stream(self, prompt, n):
        times: list[float] = []
        self.generate(prompt[None], n, times)
        return times

    def timed(self, prompts, n):
        """Every call a new Generator: the whole prompt prefilled (genai keeps nothing across
        requests)."""
        times: list[float] = []
        t0 = time.perf_counter()
        out = self.generate(np.asarray(prompts, np.int64), n, times)
        return out, times[0] - t0, time.perf_counter() - t0

    def walker(self, position, steps, batch=1):
        prompt = prompts_for(batch, position, self.vocab, seed=7).astype(np.int32)
        g = self._generator(batch, position + steps + 2)
        g.append_tokens(prompt)
        g.generate_next_token()  # (the prefill's token: as the loop's start)

        def step() -> float:
            t0 = time.perf_counter()
            g.generate_next_token()
            return time.perf_counter() - t0
        return step
