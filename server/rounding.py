"""Which artifacts let the speed features change a row's logits beyond the 1e-4 they promise.

onnxruntime picks its kernels by the call's shape: a token computed in a one-token decode step
rounds differently (~1e-7 of the logits, fp32) from the same token computed in a call of
several (a prefill, a speculative verification, a constraint's forced run). In fp32 that is
all. Where activations are quantized (int8, int4's MatMulNBits) or held in half precision, a
rounding difference that moves a value across a quantization step grows through the layers:
measured on a d256, 2-layer random model, a verification's logits against one-token steps
differed by 1.6e-2 (int8 per row), 1.2e-2 (int4, blocks of 32) and 6.9e-4 (fp16) of the
largest logit, and rows of generated tokens (made by decode steps) restored into a chat's next
turn moved its logits as much (fp32: 1.8e-6). Greedy replies of 4-turn chats then differed
with the prefix cache on and off in 2-10 turns of 40 (int8 / int4).

So on those artifacts the engine runs, by default, only what stays within 1e-4: the prefix
cache with the rows prompts' prefills made (no generated rows; no last call of a single token
after others, whose one-row kernels differ for int4), no speculative verification or
constraint fast-forward, and a resumed stream's delivered tokens fed one step each
(``server.resume``). ``--inexact-speedups`` (``ServerConfig.inexact_speedups``) turns them on
anyway.
"""
from __future__ import annotations

EXACT_PRECISIONS = ("fp32",)


def shape_sensitive(lm) -> str:
    """Why ``lm``'s logits depend on the shape of the call that computes a row by more than
    1e-4 ("": they do not: fp32 graphs, or a runner without a manifest)."""
    precision = (getattr(lm, "manifest", None) or {}).get("precision", "fp32")
    if precision in EXACT_PRECISIONS:
        return ""
    return (f"an {precision} artifact: a row computed in a call of several tokens differs from "
            f"a one-token step's by up to ~1e-2 of the logits (onnxruntime's kernels by shape, "
            f"magnified by {'half precision' if precision == 'fp16' else 'quantization'}); "
            f"--inexact-speedups allows it")
