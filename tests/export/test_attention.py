"""The attention-diagnostics graphs: ``attn_weights.{i}`` equal torch's attention
probabilities to 1e-5, in prefill on a left-padded batch and in decode steps (buffer columns
mapped back to sequence positions), and asking for them changes no logits."""
from __future__ import annotations

import numpy as np
import torch
from export_matrix import ATTN_TOL, LOGIT_TOL

from kvserve.export.parity import parity_prompts
from kvserve.model.generate import generate, left_pad
from kvserve.server.runtime import KVBuffers


def test_prefill_attention_on_padded_batch(main_model, main_lm):
    cfg = main_model.cfg
    prompts = parity_prompts(cfg.vocab_size, batch=3, seed=11)
    ids, mask = left_pad(prompts)
    pre = main_lm.prefill(ids.numpy(), mask.numpy(), attention=True)
    plain = main_lm.prefill(ids.numpy(), mask.numpy())
    with torch.no_grad():
        ref = main_model(ids, mask, output_attentions=True)
    B, T = ids.shape
    assert len(pre.attentions) == cfg.n_layers
    for got, want in zip(pre.attentions, ref.attentions):
        assert got.shape == (B, cfg.n_heads, T, T)
        assert np.abs(got - want.numpy()).max() <= ATTN_TOL
    real = mask.numpy().astype(bool)
    for got in pre.attentions:
        for b in range(B):
            rows = got[b][:, real[b]]  # (H, real queries, T)
            np.testing.assert_allclose(rows.sum(-1), 1.0, atol=1e-5)
            assert np.abs(rows[..., ~real[b]]).max(initial=0.0) == 0.0  # pads get nothing
            assert np.abs(np.triu(rows[..., real[b]], k=1)).max(initial=0.0) == 0.0  # causal
    # the diagnostics graph computes the same logits and K/V as the plain one
    assert np.abs(pre.logits - plain.logits)[real].max() <= LOGIT_TOL
    for a, p in zip(pre.present, plain.present):  # (B, Hkv, T, D)
        assert np.abs(a - p).transpose(0, 2, 1, 3)[real].max() <= LOGIT_TOL


def test_decode_attention_matches_torch(main_model, main_lm):
    cfg = main_model.cfg
    prompts = parity_prompts(cfg.vocab_size, batch=3, seed=12)
    steps = 6
    ref = generate(main_model, prompts, steps + 1, keep_logits=True)
    ids, mask = left_pad(prompts)
    pre = main_lm.prefill(ids.numpy(), mask.numpy())
    B = len(prompts)
    kv = KVBuffers(cfg, B)
    for b, p in enumerate(prompts):
        kv.load_prompt(b, pre.present, b, len(p))
    positions = np.array([len(p) for p in prompts], dtype=np.int64)
    for step in range(steps):
        tokens = np.array([ref.tokens[b][step] for b in range(B)], dtype=np.int64)
        used_before = kv.used[:B].copy()
        with_attn = step % 2 == 0 or step == steps - 1  # plain and diagnostic steps interleave
        logits, attn = main_lm.decode(kv, B, tokens, positions, attention=with_attn)
        positions += 1
        for b in range(B):
            assert np.abs(logits[b] - ref.logits[b][step + 1]).max() <= LOGIT_TOL
        if not with_attn:
            assert attn is None
            continue
        C = kv.capacity
        for b in range(B):
            seq = list(prompts[b]) + ref.tokens[b][:step + 1]
            with torch.no_grad():
                full = main_model(torch.tensor([seq]), output_attentions=True)
            # buffer row j holds sequence position j (rows are filled without gaps); the new
            # token's own key is the extra column C
            cols = np.concatenate([np.arange(used_before[b]), [C]])
            assert len(cols) == len(seq)
            others = np.setdiff1d(np.arange(C + 1), cols)
            for layer in range(cfg.n_layers):
                got = attn[layer][b, :, 0]  # (H, C + 1)
                assert attn[layer].shape == (B, cfg.n_heads, 1, C + 1)
                want = full.attentions[layer][0, :, -1].numpy()  # (H, len(seq))
                assert np.abs(got[:, cols] - want).max() <= ATTN_TOL
                assert np.abs(got[:, others]).max() == 0.0
