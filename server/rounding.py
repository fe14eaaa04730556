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

The one-token path is GroupQueryAttention's (a call feeding a row one token rounds its
attention differently from one feeding it several; the other ops compute a row alike in
calls of any shape here, except the matmuls named below). A **paired** fused graph
(``FusedSpec.paired``, ``kvserve export --paired-attention``) feeds that op one more query row
per row, so every row takes the multi-token path: a token's logits are then the same, bit for
bit, from a one-token step, a verification, a prompt split anywhere or a restored prefix,
wherever the matmuls compute a row alike at every batch size too (on this bench machine: int8
per row and in blocks of 32 and 64, int4 in blocks of 16 and 32; not int4 in blocks of 64 or
more, nor int8 in blocks of 128, whose one-row matmul rounds apart: the 6M bench model's
exports, 2026-12-04; bench/results/paired-attention.md for 100M). Which kernels a machine
picks is its CPU's and onnxruntime's business, so the engine does not go by a table:
``rows_differ`` computes the same rows through those calls once at startup, and the features
are exact where they agree bit for bit.

kvserve's native CPU attention kernel (``artifact.native_attention``) computes a query's
attention the same in calls of any shape (its arithmetic depends on the query's position, its
window and fixed key tiles alone), so a graph whose every attention runs on it needs no pairing:
the same startup check decides (on the bench machine, 2026-12-04: fp32 and int8 in blocks of 64
bit for bit; int4 in blocks of 64 not, its one-row matmul again).

So on the other artifacts the engine runs none of the features that change the calls (the
prefix cache, speculation, constraint fast-forward) and feeds a resumed stream's delivered
tokens one step each, as the earlier call did (``server.resume``), unless
``--inexact-speedups`` (``ServerConfig.inexact_speedups``).
"""
from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger(__name__)

EXACT_PRECISIONS = ("fp32",)


def _manifest(lm) -> dict:
    return getattr(lm, "manifest", None) or {}  # (a runner without one: taken as fp32)


def shape_sensitive(lm) -> str:
    """Why ``lm``'s logits depend on the shape of the call that computes a row by more than
    1e-4 ("": they do not: fp32 graphs, or a runner without a manifest)."""
    manifest = _manifest(lm)
    precision = manifest.get("precision", "fp32")
    if precision in EXACT_PRECISIONS:
        return ""
    paired = manifest.get("runtime", {}).get("paired_attention")
    if (paired or getattr(lm, "row_invariant_attention", False)) and \
            getattr(lm, "supports_verify", False):
        what = "its paired graph" if paired else "its graph (on the native attention kernel)"
        try:
            worst = rows_differ(lm)
        except Exception as e:  # (a check must not keep the server from starting)
            log.warning("the startup check of %s's rows failed: %s", what, e)
            worst = float("nan")
        if worst == 0.0:
            return ""
        return (f"{precision} artifact: {what} computes a row differently in calls of other "
                f"shapes on this machine (by {worst:.1e} of the logits, checked at startup)")
    size = "~7e-4" if precision == "fp16" else "~1e-2"
    return (f"{precision} artifact: a row computed in calls of other shapes differs by up to "
            f"{size} of the logits (onnxruntime's kernels by shape, magnified by "
            f"{'half precision' if precision == 'fp16' else 'quantization'})")


def diagnostics_apart(lm) -> bool:
    """Whether the attention-diagnostics graph (its GroupQueryAttention also returning the
    probabilities, another code path) moves a row's logits beyond 1e-4: quantized and fp16
    artifacts, paired or not (int4: 1.4e-2), so such requests run in batches of their own."""
    return _manifest(lm).get("precision", "fp32") not in EXACT_PRECISIONS


def rows_differ(lm, seed: int = 0) -> float:
    """The largest difference, over the largest logit, between the same tokens' logits
    computed by one-token steps, by a verification (batch 1 and 2; in batch 2 a row of one
    token padded beside a row of three), by a prompt's prefill whole and in two calls, and by
    steps after a padded batch-3 prefill against one prefill of it all (up to 99 positions).
    0.0: they agree bit for bit. A few calls on caches of their own (~20 ms on the 6M bench
    model, ~0.4 s on 100M)."""
    V = lm.cfg.vocab_size
    if lm.cfg.max_seq_len < 16:
        raise ValueError(f"a context of {lm.cfg.max_seq_len} positions is too short to check")
    g = np.random.default_rng(seed)
    prompts = [g.integers(1, V, n).tolist() for n in (7, 5)]
    new = [g.integers(1, V, 3).tolist() for _ in prompts]
    worst = 0.0

    def diff(a, b) -> None:
        nonlocal worst
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        worst = max(worst, float(np.abs(a - b).max() / max(float(np.abs(b).max()), 1e-30)))

    for n in (1, 2):
        kv = lm.new_cache(n, 64)
        lm.prefill(kv, 0, prompts[:n], last=True)
        before = kv.used[:n].copy()
        steps = [lm.decode(kv, n, [t[j] for t in new[:n]])[0].copy() for j in range(3)]
        kv.used[:n] = before
        rows = lm.verify(kv, n, [new[0], new[1][:1]][:n]).copy()  # (n, 3, V)
        for j in range(3):
            diff(rows[0, j], steps[j][0])
        if n == 2:
            diff(rows[1, 0], steps[0][1])
    whole = lm.prefill(lm.new_cache(1, 64), 0, [prompts[0] + new[0]], last=True).logits[0]
    kv = lm.new_cache(1, 64)
    lm.prefill(kv, 0, [prompts[0][:4]], last=True)
    diff(lm.prefill(kv, 0, [prompts[0][4:] + new[0]], last=True).logits[0], whole)
    long = g.integers(1, V, min(96, lm.cfg.max_seq_len - 8)).tolist()
    kv = lm.new_cache(3)
    lm.prefill(kv, 0, [prompts[0], long, prompts[1]], last=True)
    for j in range(3):
        step = lm.decode(kv, 3, [new[0][j], new[1][j], new[0][j]])[0][1].copy()
    diff(step, lm.prefill(lm.new_cache(1), 0, [long + new[1]], last=True).logits[0])
    return worst
