"""Every family case (also phi3_longrope_short, not served in test_families) imported and run
in torch against transformers: left-padded prefill and 40 cached greedy decode steps past the
sliding windows (phi3_longrope: past its original_max_position_embeddings). Cheap (no export);
the served checks are in test_families."""
from __future__ import annotations

import pytest
import torch

from family_models import CASES, PROMPT, build, hf_greedy, save
from kvserve.model.checkpoint import load_model
from kvserve.model.generate import generate
from kvserve.model.hf_import import import_hf

TOL = 1e-4


@pytest.mark.parametrize("name", list(CASES))
def test_torch_model_matches_transformers(name, tmp_path):
    hf = build(name)
    kv = load_model(import_hf(save(hf, tmp_path / "hf"), tmp_path / "ckpt"))
    prompts = [PROMPT[:7], PROMPT[:3], PROMPT]
    gen = generate(kv, prompts, max_new_tokens=40, keep_logits=True)  # left-padded, KV cache
    for b, p in enumerate(prompts):
        toks, logits = hf_greedy(hf, p, 40)
        assert gen.tokens[b] == toks, name
        worst = max(float((torch.from_numpy(g) - r).abs().max())
                    for g, r in zip(gen.logits[b], logits))
        assert worst <= TOL, (name, worst)
