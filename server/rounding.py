"""Which artifacts let the speed features change a row's logits beyond the 1e-4 they promise.

onnxruntime picks its kernels by the call's shape: a token computed in a one-token decode step
rounds differently (~1e-7 of the logits, fp32) from the same token computed in a call of
several (a prefill, a speculative verification, a constraint's forced run), and a prompt's
rows differ by ~1e-6 with where its prefill was split (whole, or its first blocks restored from
the prefix cache and the rest in one call). In fp32 that is all. Where activations are
quantized (int8, int4's MatMulNBits) or held in half precision, a rounding difference that
moves a value across a quantization step grows through the layers. Measured on a d256, 2-layer
random model (reviews, 2026-12-03): a verification's logits against one-token steps 1.6e-2
(int8 per row), 1.2e-2 (int4, blocks of 32) and 6.9e-4 (fp16) of the largest logit; rows of
generated tokens restored into a chat's next turn as much (2-10 of 40 greedy turns differed);
a prompt's first 16 or 32 rows restored and the rest prefilled in one call, 8.3e-3 (int4, 6 of
80 prompts); a resumed stream's delivered tokens prefilled, 9.0e-3 / 1.0e-2 (int8 / int4).

So on those artifacts the engine runs none of the features that change the calls (the prefix
cache, speculation, constraint fast-forward) and feeds a resumed stream's delivered tokens one
step each, as the earlier call did (``server.resume``), unless ``--inexact-speedups``
(``ServerConfig.inexact_speedups``).
"""
from __future__ import annotations

EXACT_PRECISIONS = ("fp32",)


def shape_sensitive(lm) -> str:
    """Why ``lm``'s logits depend on the shape of the call that computes a row by more than
    1e-4 ("": they do not: fp32 graphs, or a runner without a manifest)."""
    precision = (getattr(lm, "manifest", None) or {}).get("precision", "fp32")
    if precision in EXACT_PRECISIONS:
        return ""
    size = "~7e-4" if precision == "fp16" else "~1e-2"
    return (f"{precision} artifact: a row computed in calls of other shapes differs by up to "
            f"{size} of the logits (onnxruntime's kernels by shape, magnified by "
            f"{'half precision' if precision == 'fp16' else 'quantization'})")
