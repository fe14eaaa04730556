"""The parity gate: torch vs onnxruntime on a left-padded batch, prefill + N decode steps.

The ONNX side runs exactly the server's path (the artifact's runner, ``FusedLM`` or
``PortableLM``, with its KV cache).
Decode is teacher-forced with torch's greedy tokens, so every step compares logits for the
same context, and the ONNX argmax must pick torch's token at every step.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from kvserve.artifact.longrope import LongRopeSwitch
from kvserve.model.generate import generate, left_pad
from kvserve.model.transformer import Transformer

FP32_TOLERANCE = 1e-4  # max |Δlogit|, the optimum exporters' ATOL
ATTENTION_TOLERANCE = 1e-5  # max |Δp| of attention probabilities


class ParityError(RuntimeError):
    pass


@dataclass
class ParityReport:
    max_abs_logit_prefill: float
    max_abs_logit_decode: float
    decode_steps: int
    batch: int
    greedy_tokens_equal: bool
    token_agreement: float
    max_abs_attention: float | None
    tolerance: float | None

    def to_dict(self) -> dict:
        return asdict(self)


def parity_prompts(vocab_size: int, batch: int = 3, seed: int = 0) -> list[list[int]]:
    """Prompts of different lengths (so the batch is left-padded), from a fixed seed."""
    g = np.random.default_rng(seed)
    lengths = [7, 3, 12, 5][:batch]
    return [g.integers(0, vocab_size, n).tolist() for n in lengths]


def measure(model: Transformer, lm, prompts: list[list[int]], steps: int = 64,
            attention: bool = False) -> ParityReport:
    """``lm``: FusedLM or PortableLM. Torch runs the left-padded batch; the runner its own
    layout (right-padded slots, or left-padded prefill); real positions are compared."""
    B = len(prompts)
    ref = generate(model, prompts, steps + 1, keep_logits=True)  # greedy, torch
    ids, mask = left_pad(prompts, model.cfg.pad_token_id or 0)
    kv = lm.new_cache(B)
    pre = lm.prefill(kv, 0, prompts, attention=attention)
    with torch.no_grad():
        t_out = model(ids, mask, output_attentions=attention)
    T = ids.shape[1]
    d_prefill = max(float(np.abs(pre.logits[b] - t_out.logits[b, T - len(p):].numpy()).max())
                    for b, p in enumerate(prompts))
    d_attn = None
    if attention:
        d_attn = max(float(np.abs(pre.attention[b][layer]
                                  - t[b, :, T - len(p):, T - len(p):].numpy()).max())
                     for b, p in enumerate(prompts) for layer, t in enumerate(t_out.attentions))

    d_decode, agree = 0.0, 0
    longrope = LongRopeSwitch.of(model.cfg)  # rows crossing its limit: refilled, as torch does
    for step in range(steps):
        tokens = np.array([ref.tokens[b][step] for b in range(B)], dtype=np.int64)
        if longrope is not None:
            longrope.before_decode(lm, kv, B, lambda b: list(prompts[b]) + ref.tokens[b][:step],
                                   chunk=64)
        logits, attn = lm.decode(kv, B, tokens, attention=attention and step < 4)
        for b in range(B):
            want = ref.logits[b][step + 1]
            d_decode = max(d_decode, float(np.abs(logits[b] - want).max()))
            agree += int(np.argmax(logits[b]) == ref.tokens[b][step + 1])
        if attn is not None:
            d_attn = max(d_attn, _decode_attention_diff(model, prompts, ref.tokens, step, attn))
    total = steps * B
    return ParityReport(d_prefill, d_decode, steps, B, agree == total, agree / total, d_attn,
                        None)


def _decode_attention_diff(model, prompts, tokens, step, attn) -> float:
    """Torch attention of the token fed at ``step`` vs the runner's row (L, H, T_b) per
    sequence: the sequence's tokens in order, the new one last."""
    worst = 0.0
    for b, p in enumerate(prompts):
        seq = list(p) + tokens[b][:step + 1]
        with torch.no_grad():
            out = model(torch.tensor([seq]), output_attentions=True)
        for layer, t in enumerate(out.attentions):
            want = t[0, :, -1].numpy()  # (H, S)
            worst = max(worst, float(np.abs(attn[b][layer] - want).max()))
    return worst


def gate(report: ParityReport, tolerance: float, require_tokens: bool = True) -> None:
    """Raise ParityError unless the figures hold. Never a warning only."""
    report.tolerance = tolerance
    worst = max(report.max_abs_logit_prefill, report.max_abs_logit_decode)
    problems = []
    if not np.isfinite(worst) or worst > tolerance:
        problems.append(f"max |Δlogit| {worst:.3g} > tolerance {tolerance:.3g} (prefill "
                        f"{report.max_abs_logit_prefill:.3g}, decode "
                        f"{report.max_abs_logit_decode:.3g})")
    if require_tokens and not report.greedy_tokens_equal:
        problems.append(f"greedy tokens differ (agreement {report.token_agreement:.4f})")
    if report.max_abs_attention is not None and report.max_abs_attention > ATTENTION_TOLERANCE:
        problems.append(f"attention max |Δ| {report.max_abs_attention:.3g} > "
                        f"{ATTENTION_TOLERANCE:.0e}")
    if problems:
        raise ParityError("parity gate failed: " + "; ".join(problems))
