"""The options of imported families (``ModelConfig``'s issue-13 fields) in the fused graph: each
config is exported fused (no ``portable_because``) and passes the unchanged parity gate (torch vs
onnxruntime, left-padded batch of 3, prefill + 64 decode steps, attention probabilities too),
read back from the manifest. The sliding windows (3 to 5 tokens) are far shorter than the gate's
sequences (prompts of 3-12 tokens, then 64 steps). LongRoPE, which switches its frequencies per
sequence, stays portable and the manifest says why."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from export_matrix import ATTN_RTOL, ATTN_TOL, LOGIT_TOL, THREADS

from kvserve.artifact.loader import load_lm
from kvserve.export import fused
from kvserve.export.parity import measure, parity_prompts
from kvserve.export.pipeline import export_artifacts
from kvserve.model.checkpoint import save_checkpoint
from kvserve.model.config import ModelConfig
from kvserve.model.transformer import Transformer

BASE = dict(vocab_size=300, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
            max_seq_len=512, init_std=0.1)  # head_dim 16 unless explicit
LLAMA3 = dict(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=16)
OPTIONS: dict[str, dict] = {
    # Gemma: sqrt(d) embeddings, (1 + w) norms, GeGLU-tanh, MQA, head_dim != d_model / heads
    "gemma": dict(embed_scale=8.0, norm_offset=1.0, ffn="geglu_tanh", n_kv_heads=1,
                  explicit_head_dim=32),
    # Gemma 2: sandwich norms, score scale and soft-capping, final soft-capping, a window on
    # the first of two layers
    "gemma2": dict(embed_scale=8.0, norm_offset=1.0, ffn="geglu_tanh", sandwich_norm=True,
                   attn_scale=0.2, attn_softcap=2.0, final_softcap=3.0, sliding_window=4,
                   sliding_layers=[True, False]),
    # Mistral: a window on every layer
    "mistral": dict(sliding_window=5),
    # Qwen3: per-head q/k RMSNorm, explicit head_dim, biases, a window on the second layer
    "qwen3": dict(qk_norm=True, explicit_head_dim=32, qkv_bias=True, out_bias=True,
                  sliding_window=3, sliding_layers=[False, True]),
    "llama3": dict(rope_scaling=LLAMA3, tie_embeddings=False),
    # SmolLM3: a layer without RoPE; SmolLM2-style linear scaling
    "smollm3": dict(rope_layers=[True, False], rope_scaling=dict(type="linear", factor=2.0)),
}
LONGROPE = dict(type="longrope", short_factor=[1.0, 1.0, 1.5, 2.0, 2.0, 2.5, 3.0, 3.0],
                long_factor=[1.0 + 0.5 * i for i in range(8)],
                original_max_position_embeddings=8, attention_factor=1.2)


def _config(**opts) -> ModelConfig:
    return ModelConfig(**{**BASE, **opts})


def _model(cfg: ModelConfig, seed: int) -> Transformer:
    """Random weights, norm gains and biases perturbed too (they start at 1 / 0), so a wrong
    mapping of any of them shows in the logits."""
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape) * 0.1)
    return model


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tokenizer_json):
    """name -> (model, artifact), exported lazily once per module."""
    root, done = tmp_path_factory.mktemp("fused-options"), {}

    def get(name: str):
        if name not in done:
            model = _model(_config(**OPTIONS[name]), 100 + sorted(OPTIONS).index(name))
            ckpt = save_checkpoint(root / "ckpt" / name, model, tokenizer_json=tokenizer_json)
            done[name] = model, export_artifacts(ckpt, root / "art" / name, attention=True,
                                                 progress=False, threads=THREADS)
        return done[name]
    return get


def test_options_cover_every_family_option():
    cfgs = [_config(**o) for o in OPTIONS.values()]
    defaults = ModelConfig(**BASE)
    for name in ("explicit_head_dim", "rope_scaling", "rope_layers", "qk_norm", "embed_scale",
                 "norm_offset", "sandwich_norm", "attn_scale", "attn_softcap", "final_softcap",
                 "sliding_window", "sliding_layers"):
        assert any(getattr(c, name) != getattr(defaults, name) for c in cfgs), name
    assert {c.rope_scaling["type"] for c in cfgs if c.rope_scaling} == {"linear", "llama3"}
    assert "geglu_tanh" in {c.ffn for c in cfgs}
    assert all(not fused.unsupported(c) for c in cfgs)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_option_exports_fused_and_passes_the_gate(exported, name):
    model, art = exported(name)  # export_artifacts raises ParityError if the gate fails
    m = json.loads((art / "manifest.json").read_text())
    assert m["kind"] == m["runtime"]["kind"] == "fused"
    assert "portable_because" not in m["runtime"]
    assert set(m["graphs"]) == {"model", "model_attn"}
    p = m["parity"]["fp32"]
    assert p["batch"] == 3 and p["decode_steps"] >= 64 and p["tolerance"] == LOGIT_TOL
    assert 0.0 <= p["max_abs_logit_prefill"] <= LOGIT_TOL
    assert 0.0 <= p["max_abs_logit_decode"] <= LOGIT_TOL
    assert p["greedy_tokens_equal"] is True and p["token_agreement"] == 1.0
    assert p["max_abs_attention"] is not None and p["max_abs_attention"] <= ATTN_TOL
    assert 0.0 <= p["max_rel_attention"] <= ATTN_RTOL


@pytest.mark.parametrize("name", list(OPTIONS))
def test_attention_nodes_carry_each_layers_options(exported, name):
    model, art = exported(name)
    cfg = model.cfg
    g = onnx.load(str(art / "model.onnx"), load_external_data=False).graph
    nodes = [n for n in g.node if n.op_type == "GroupQueryAttention"]
    assert len(nodes) == cfg.n_layers
    for i, node in enumerate(nodes):
        a = {x.name: onnx.helper.get_attribute_value(x) for x in node.attribute}
        assert a["local_window_size"] == (cfg.layer_window(i) or -1)
        assert a["do_rotary"] == int(cfg.layer_rope(i))
        assert bool(node.input[7]) == cfg.layer_rope(i)  # cos/sin tables only where rotary
        assert a["softcap"] == pytest.approx(cfg.attn_softcap or 0.0)
        want = cfg.attn_scale or 1.0 / np.sqrt(cfg.head_dim)
        assert a["scale"] == pytest.approx(want, rel=1e-6)
    assert sum(n.op_type == "Tanh" for n in g.node) == (cfg.final_softcap is not None)


@pytest.mark.parametrize("name", ["mistral", "gemma2", "qwen3"])
def test_the_gate_sees_the_window(exported, name):
    """The gate's sequences run past the window: the same artifact against torch with the window
    one token wider (an off-by-one in the graph), or with none, fails it."""
    model, art = exported(name)
    cfg = model.cfg
    assert cfg.sliding_window < 7  # shorter than two of the gate's prompts, before decoding
    lm = load_lm(art, provider="cpu", threads=THREADS, attention=False)
    prompts = parity_prompts(cfg.vocab_size)
    for other in (cfg.sliding_window + 1, None):
        wrong = Transformer(cfg.replace(sliding_window=other)).eval()
        wrong.load_state_dict(model.state_dict())
        r = measure(wrong, lm, prompts, 64)
        assert max(r.max_abs_logit_prefill, r.max_abs_logit_decode) > 100 * LOGIT_TOL, other


@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_windowed_chunked_prefill(exported, name):
    """A prompt prefilled in chunks (the server's chunked prefill / Score of long inputs): each
    chunk's queries see the window across the chunk boundary, as torch on the whole sequence."""
    model, art = exported(name)
    seq = np.random.default_rng(5).integers(0, model.cfg.vocab_size, 40).tolist()
    lm = load_lm(art, provider="cpu", threads=THREADS, attention=False)
    kv = lm.new_cache(1)
    got = [lm.prefill(kv, 0, [seq[:9]]).logits[0], lm.extend(kv, 0, seq[9:12]),
           lm.extend(kv, 0, seq[12:40])]
    with torch.no_grad():
        want = model(torch.tensor([seq])).logits[0].numpy()
    assert float(np.abs(np.concatenate(got) - want).max()) <= LOGIT_TOL


def test_longrope_stays_portable_with_a_reason(tmp_path, tokenizer_json):
    """LongRoPE picks short or long frequencies per sequence (GroupQueryAttention takes one
    cos/sin table): exported portable, the manifest says why, and it passes the gate."""
    cfg = _config(rope_scaling=LONGROPE)
    why = fused.unsupported(cfg)
    assert len(why) == 1 and "longrope" in why[0]
    with pytest.raises(ValueError, match="longrope"):
        fused.build_fused(cfg, {}, None)
    ckpt = save_checkpoint(tmp_path / "ckpt", _model(cfg, 7), tokenizer_json=tokenizer_json)
    art = export_artifacts(ckpt, tmp_path / "art", attention=False, progress=False,
                           threads=THREADS)
    m = json.loads((art / "manifest.json").read_text())
    assert m["kind"] == m["runtime"]["kind"] == "portable"
    assert m["runtime"]["portable_because"] == why
    p = m["parity"]["fp32"]
    assert max(p["max_abs_logit_prefill"], p["max_abs_logit_decode"]) <= LOGIT_TOL
    assert p["greedy_tokens_equal"] is True


@pytest.mark.parametrize("precision", ["fp16", "int4"])
def test_options_survive_the_precision_transforms(tmp_path, tokenizer_json, precision):
    """Gemma 2's options (sandwich norms, (1 + w) gains, embed scale, softcaps, a window) in an
    fp16 and an int4 artifact: still the fused graph, through the precision's own gate (fp16:
    a logit bound; int4: the perplexity change)."""
    from kvserve.export.precision import FP16_TOLERANCE

    model = _model(_config(**OPTIONS["gemma2"]), 7)
    ckpt = save_checkpoint(tmp_path / "ckpt", model, tokenizer_json=tokenizer_json)
    art = export_artifacts(ckpt, tmp_path / "art", attention=False, progress=False,
                           threads=THREADS, precision=precision)
    m = json.loads((art / "manifest.json").read_text())
    assert m["kind"] == "fused" and m["precision"] == precision
    q = m["parity"][precision]
    worst = max(q["max_abs_logit_prefill"], q["max_abs_logit_decode"])
    if precision == "fp16":
        assert worst <= FP16_TOLERANCE and q["token_agreement"] >= 0.95
    assert m["perplexity"]["relative_change"] <= 0.10
