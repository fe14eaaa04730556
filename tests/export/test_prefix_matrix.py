"""The prefix cache's exactness on every config of the export matrix (GQA, MHA, MQA; every
position kind; fp32, fp16, int8, int4), fused: a prompt whose first blocks are restored from
the pool into an empty slot, then the rest prefilled, gives the logits of prefilling the whole
prompt within 1e-4 and the same greedy tokens; so do the rests of several restored prefixes of
different lengths prefilled in one call (a burst admitted together). Sliding windows
(Mistral-style on every layer, Gemma 2-style on one with soft-capping) through both features: a
row depends on its prefix only, and the verification call's multi-token queries keep each
query's own window."""
from __future__ import annotations

import pytest
import torch
from export_matrix import BASE, CONFIGS, EXPORTS, LOGIT_TOL, THREADS
from spec_testing import check_batched_rests, check_burst_at_the_context_end, \
    check_cached_burst, check_greedy_speculation, check_prefix_restore, \
    check_verify_teacher_forced

from kvserve.artifact.fused import FusedLM
from kvserve.export.pipeline import export_artifacts
from kvserve.model.checkpoint import save_checkpoint
from kvserve.model.config import ModelConfig
from kvserve.model.transformer import Transformer
from kvserve.server.prefix_cache import prefix_cache_unsupported_reason

WINDOWED = {
    "mistral": dict(sliding_window=5),
    "gemma2": dict(embed_scale=8.0, norm_offset=1.0, ffn="geglu_tanh", sandwich_norm=True,
                   attn_scale=0.2, attn_softcap=2.0, final_softcap=3.0, sliding_window=4,
                   sliding_layers=[True, False]),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_restored_prefix_is_exact(store, name):
    precision, _ = EXPORTS[name]
    lm = FusedLM(store.artifact(name), provider="cpu", threads=THREADS, attention=False)
    assert prefix_cache_unsupported_reason(lm.cfg) is None
    worst = check_prefix_restore(lm, LOGIT_TOL, seed=len(name))
    rests = check_batched_rests(lm, LOGIT_TOL, seed=len(name))
    print(f"{name} ({precision}): restored prefix vs whole prefill {worst:.2e}, rests of "
          f"three restored prefixes in one call {rests:.2e}")


@pytest.mark.parametrize("portable", [False, True], ids=["fused", "portable"])
def test_bursts_on_a_shared_prefix_are_exact(store, portable):
    """Four requests sharing a prefix admitted together, twice: the fused runner prefills the
    rests after their restored prefixes in one call, the portable one a slot at a time."""
    from kvserve.artifact.loader import load_lm

    lm = load_lm(store.artifact("llama", portable=portable), provider="cpu", threads=THREADS,
                 attention=False)
    assert getattr(lm, "prefills_after_rows", False) is not portable
    assert all(n >= 32 for n in check_cached_burst(lm))


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_burst_at_the_context_end_stays_inside_it(store, name):
    """(gpt2: learned positions, whose table ends at the context)"""
    lm = FusedLM(store.artifact(name), provider="cpu", threads=THREADS, attention=False)
    check_burst_at_the_context_end(lm)


@pytest.mark.parametrize("name", list(WINDOWED))
def test_sliding_windows(tmp_path, tokenizer_json, name):
    base = {**BASE, **CONFIGS["llama"], **WINDOWED[name]}
    torch.manual_seed(77)
    model = Transformer(ModelConfig(**base)).eval()
    ckpt = save_checkpoint(tmp_path / "ckpt", model, tokenizer_json=tokenizer_json)
    art = export_artifacts(ckpt, tmp_path / "art", attention=False, progress=False,
                           threads=THREADS)
    lm = FusedLM(art, provider="cpu", threads=THREADS, attention=False)
    assert lm.cfg.sliding_window and prefix_cache_unsupported_reason(lm.cfg) is None
    a = max(check_prefix_restore(lm, LOGIT_TOL, seed=1),
            check_batched_rests(lm, LOGIT_TOL, seed=1))
    b = check_verify_teacher_forced(lm, LOGIT_TOL, seed=1)
    check_greedy_speculation(lm, [5, 6, 7, 8, 9] * 4 + [5, 6], 30)
    print(f"{name}: restored prefix {a:.2e}, verify {b:.2e}")
