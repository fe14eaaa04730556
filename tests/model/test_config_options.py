"""ModelConfig's options for imported families: old configs load unchanged, bad values are
refused by name, and each option changes the model's function."""
from __future__ import annotations

import json

import pytest
import torch

from kvserve.model.checkpoint import load_model, save_checkpoint
from kvserve.model.config import ModelConfig, preset
from kvserve.model.generate import generate
from kvserve.model.transformer import Transformer

OLD = dict(vocab_size=300, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
           max_seq_len=64)


def test_old_config_json_loads_with_todays_behaviour(tmp_path):
    cfg = ModelConfig(**OLD)
    d = cfg.to_dict()
    for k in ("explicit_head_dim", "rope_scaling", "rope_layers", "qk_norm", "embed_scale",
              "norm_offset", "sandwich_norm", "attn_scale", "attn_softcap", "final_softcap",
              "sliding_window", "sliding_layers", "eos_token_ids"):
        d.pop(k)  # a config.json written before these options existed
    (tmp_path / "config.json").write_text(json.dumps(d))
    old = ModelConfig.load(tmp_path / "config.json")
    assert old == cfg and old.head_dim == 8 and old.stop_ids == []
    assert ModelConfig(**OLD, eos_token_id=3).stop_ids == [3]


@pytest.mark.parametrize("bad, msg", [
    (dict(rope_scaling={"type": "yarn", "factor": 2.0}), "rope_scaling type"),
    (dict(rope_scaling={"type": "linear"}), "needs \\['factor'\\]"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0, "beta": 1}), "unknown keys"),
    (dict(sliding_layers=[True]), "sliding_layers"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(eos_token_ids=[1, 300]), "eos_token_ids"),
    (dict(attn_softcap=-1.0), "attn_softcap"),
    (dict(explicit_head_dim=0), "explicit_head_dim"),
    (dict(qk_norm=True, norm="layernorm"), "qk_norm"),
])
def test_bad_options_are_refused(bad, msg):
    with pytest.raises(ValueError, match=msg):
        ModelConfig(**{**OLD, **bad})


OPTIONS = {
    "explicit_head_dim": dict(explicit_head_dim=6, n_heads=6, n_kv_heads=2),
    "rope_linear": dict(rope_scaling={"type": "linear", "factor": 4.0}),
    "rope_llama3": dict(rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8}),
    "rope_layers": dict(rope_layers=[True, False]),
    "qk_norm": dict(qk_norm=True),
    "embed_scale": dict(embed_scale=5.0),
    "norm_offset": dict(norm_offset=1.0),
    "sandwich": dict(sandwich_norm=True),
    "softcaps": dict(attn_softcap=0.5, final_softcap=0.5),
    "window": dict(sliding_window=3, sliding_layers=[True, False]),
    "geglu": dict(ffn="geglu_tanh"),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_each_option_round_trips_and_changes_the_model(name, tmp_path):
    torch.manual_seed(0)
    base = Transformer(ModelConfig(**OLD, init_std=0.3)).eval()
    cfg = ModelConfig(**{**OLD, "init_std": 0.3, **OPTIONS[name]})
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    with torch.no_grad():  # norm gains and head shapes may differ: perturb everything
        for p in model.parameters():
            p.add_(torch.randn(p.shape) * 0.1)
    ckpt = save_checkpoint(tmp_path / "c", model)
    again = load_model(ckpt)
    assert again.cfg == cfg
    ids = torch.randint(0, 300, (2, 12))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)
        if name != "explicit_head_dim":
            assert not torch.allclose(model(ids).logits, base(ids).logits)
    # the KV-cache path (decode one token at a time) equals the full forward
    prompts = [ids[0, :5].tolist(), ids[1, :2].tolist()]
    gen = generate(model, prompts, max_new_tokens=8, keep_logits=True)
    for b, p in enumerate(prompts):
        seq = p + gen.tokens[b]
        with torch.no_grad():
            full = model(torch.tensor([seq])).logits[0, len(p) - 1:-1]
        got = torch.stack([torch.from_numpy(x) for x in gen.logits[b]])
        assert (full - got).abs().max() <= 1e-5


def test_window_limits_attention_past_the_window():
    cfg = ModelConfig(**OLD, sliding_window=3)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    ids = torch.randint(0, 300, (1, 10))
    with torch.no_grad():
        out = model(ids, output_attentions=True)
    for a in out.attentions:  # (B, H, T, T): query t sees keys t-2..t only
        t = torch.arange(10)
        far = (t[None, :] <= t[:, None] - 3)
        assert float(a[0][:, far].abs().max()) == 0.0
    assert preset("tiny").sliding_window is None
