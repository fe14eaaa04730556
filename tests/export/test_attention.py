"""Attention diagnostics (the fused graph's ``qk_output`` variant): equal torch's attention
probabilities to 1e-5, in prefill on a batch of different lengths and in decode steps (per
sequence, over its own tokens), and asking for them changes no logits."""
from __future__ import annotations

import numpy as np
import torch
from export_matrix import ATTN_TOL, LOGIT_TOL

from kvserve.export.parity import parity_prompts
from kvserve.model.generate import generate, left_pad


def test_prefill_attention_on_padded_batch(main_model, main_lm):
    cfg = main_model.cfg
    prompts = parity_prompts(cfg.vocab_size, batch=3, seed=11)
    pre = main_lm.prefill(main_lm.new_cache(3), 0, prompts, attention=True)
    plain_kv = main_lm.new_cache(3)
    plain = main_lm.prefill(plain_kv, 0, prompts)
    ids, mask = left_pad(prompts)
    with torch.no_grad():
        ref = main_model(ids, mask, output_attentions=True)
    T = ids.shape[1]
    for b, p in enumerate(prompts):
        n = len(p)
        got = pre.attention[b]  # (L, H, n, n)
        assert got.shape == (cfg.n_layers, cfg.n_heads, n, n)
        for layer, want in enumerate(ref.attentions):
            assert np.abs(got[layer] - want[b, :, T - n:, T - n:].numpy()).max() <= ATTN_TOL
        np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-5)
        assert np.abs(np.triu(got, k=1)).max(initial=0.0) == 0.0  # causal
        # the diagnostics graph computes the same logits as the plain one
        assert np.abs(pre.logits[b] - plain.logits[b]).max() <= LOGIT_TOL


def test_decode_attention_matches_torch(main_model, main_lm):
    cfg = main_model.cfg
    prompts = parity_prompts(cfg.vocab_size, batch=3, seed=12)
    steps = 6
    ref = generate(main_model, prompts, steps + 1, keep_logits=True)
    B = len(prompts)
    kv = main_lm.new_cache(B)
    main_lm.prefill(kv, 0, prompts)
    for step in range(steps):
        tokens = np.array([ref.tokens[b][step] for b in range(B)], dtype=np.int64)
        with_attn = step % 2 == 0 or step == steps - 1  # plain and diagnostic steps interleave
        logits, attn = main_lm.decode(kv, B, tokens, attention=with_attn)
        for b in range(B):
            assert np.abs(logits[b] - ref.logits[b][step + 1]).max() <= LOGIT_TOL
        if not with_attn:
            assert attn is None
            continue
        for b in range(B):
            seq = list(prompts[b]) + ref.tokens[b][:step + 1]
            with torch.no_grad():
                full = main_model(torch.tensor([seq]), output_attentions=True)
            assert attn[b].shape == (cfg.n_layers, cfg.n_heads, len(seq))
            for layer in range(cfg.n_layers):
                want = full.attentions[layer][0, :, -1].numpy()  # (H, len(seq))
                assert np.abs(attn[b][layer] - want).max() <= ATTN_TOL
