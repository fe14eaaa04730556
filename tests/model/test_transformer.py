"""The model's behaviour, asserted in numbers (tolerances stated per test)."""
from __future__ import annotations

import math

import pytest
import torch

from kvserve.model.attention import Attention
from kvserve.model.cache import KVCache
from kvserve.model.config import PRESETS, ModelConfig, preset
from kvserve.model.layers import rope_cos_sin, rope_inv_freq, sinusoidal_table
from kvserve.model.transformer import Block, Transformer, attention_allowed

CACHE_TOL = 1e-5  # cached incremental decoding vs full forward
PAD_TOL = 1e-5  # a left-padded row vs the same sequence alone
REF_TOL = 1e-5  # the module vs a textbook reference

# every option of the reference articles appears at least once
CONFIGS = {
    "rope-rms-pre-swiglu-gqa": dict(positions="rope", norm="rmsnorm", ffn="swiglu",
                                    n_heads=4, n_kv_heads=2),
    "learned-ln-pre-gelu-mha-bias": dict(positions="learned", norm="layernorm", ffn="gelu",
                                         n_heads=4, n_kv_heads=4, qkv_bias=True, out_bias=True,
                                         ffn_bias=True, tie_embeddings=False),
    "sinusoidal-ln-post-relu-mqa": dict(positions="sinusoidal", norm="layernorm", ffn="relu",
                                        norm_placement="post", final_norm=False, n_heads=4,
                                        n_kv_heads=1),
    "none-rms-pre-gelutanh-mha": dict(positions="none", norm="rmsnorm", ffn="gelu_tanh",
                                      n_heads=2, n_kv_heads=2, rope_base=500.0),
    "rope-base-1e6-rms-post": dict(positions="rope", rope_base=1e6, norm="rmsnorm",
                                   norm_placement="post", ffn="swiglu", n_heads=4, n_kv_heads=1),
}


def make(name: str, **kw) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=97, d_model=32, n_layers=2, d_ff=48, max_seq_len=64,
                      **{**CONFIGS[name], **kw})
    return Transformer(cfg).eval()


@pytest.mark.parametrize("name", CONFIGS)
def test_cached_decoding_equals_full_forward(name):
    model = make(name)
    ids = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        full = model(ids).logits  # (B, T, V)
        cache = KVCache(model.cfg, 2, capacity=12)
        out = model(ids[:, :5])
        cache.append(out.present)
        steps = [out.logits]
        for t in range(5, 12):
            out = model(ids[:, t:t + 1], past=cache.past())
            cache.append(out.present)
            steps.append(out.logits)
    assert (torch.cat(steps, 1) - full).abs().max().item() <= CACHE_TOL


@pytest.mark.parametrize("name", CONFIGS)
def test_left_padded_rows_equal_sequences_alone(name):
    model = make(name)
    seqs = [torch.randint(0, 97, (n,)) for n in (9, 4, 1)]
    T = 9
    ids = torch.zeros(3, T, dtype=torch.long)
    mask = torch.zeros(3, T, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, T - len(s):], mask[b, T - len(s):] = s, 1
    with torch.no_grad():
        batched = model(ids, mask).logits
        assert torch.isfinite(batched).all()  # pad rows: every key masked, still finite
        for b, s in enumerate(seqs):
            alone = model(s[None]).logits[0]
            assert (batched[b, T - len(s):] - alone).abs().max().item() <= PAD_TOL


def reference_attention(attn: Attention, x, n_heads, n_kv, causal=True):
    """Textbook multi-head attention: per head, softmax(QK^T / sqrt(d) + M) V, with each KV
    head explicitly repeated for its group of query heads."""
    B, T, C = x.shape
    D = C // n_heads
    q, k, v = attn.qkv(x).split((n_heads * D, n_kv * D, n_kv * D), dim=-1)
    outs = []
    for h in range(n_heads):
        kv_h = h // (n_heads // n_kv)
        qh = q[..., h * D:(h + 1) * D]  # (B, T, D)
        kh = k[..., kv_h * D:(kv_h + 1) * D]
        vh = v[..., kv_h * D:(kv_h + 1) * D]
        s = qh @ kh.transpose(1, 2) / math.sqrt(D)  # (B, T, T)
        if causal:
            s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        outs.append(torch.softmax(s, -1) @ vh)
    return attn.out(torch.cat(outs, -1))


@pytest.mark.parametrize("n_kv", [4, 2, 1])  # MHA, GQA, MQA
def test_attention_matches_textbook_reference(n_kv):
    torch.manual_seed(1)
    cfg = ModelConfig(vocab_size=11, d_model=32, n_heads=4, n_kv_heads=n_kv, positions="none")
    attn = Attention(cfg).eval()
    x = torch.randn(2, 7, 32)
    allowed = attention_allowed(torch.ones(2, 7, dtype=torch.long), 7)
    with torch.no_grad():
        got, _, probs = attn(x, allowed, None, None, need_weights=True)
        want = reference_attention(attn, x, 4, n_kv)
    assert (got - want).abs().max().item() <= REF_TOL
    assert probs.shape == (2, 4, 7, 7)
    assert torch.allclose(probs.sum(-1), torch.ones(2, 4, 7), atol=1e-6)
    assert probs.triu(1).abs().max().item() == 0.0  # causal: nothing from the future


def test_gqa_with_all_kv_heads_is_mha_with_the_same_weights():
    torch.manual_seed(2)
    mha = Attention(ModelConfig(d_model=32, n_heads=4, positions="none")).eval()
    gqa = Attention(ModelConfig(d_model=32, n_heads=4, n_kv_heads=4, positions="none")).eval()
    gqa.load_state_dict(mha.state_dict())
    x = torch.randn(1, 5, 32)
    allowed = attention_allowed(torch.ones(1, 5, dtype=torch.long), 5)
    with torch.no_grad():
        a = mha(x, allowed, None, None)[0]
        b = gqa(x, allowed, None, None)[0]
        ref = reference_attention(mha, x, 4, 4)
    assert torch.equal(a, b)
    assert (a - ref).abs().max().item() <= REF_TOL


def test_gqa_equals_mha_with_repeated_kv_weights():
    """GQA(kv=2) == MHA whose K/V projections repeat each KV head for its group."""
    torch.manual_seed(3)
    H, Hkv, D, C = 4, 2, 8, 32
    gqa = Attention(ModelConfig(d_model=C, n_heads=H, n_kv_heads=Hkv, positions="none")).eval()
    mha = Attention(ModelConfig(d_model=C, n_heads=H, positions="none")).eval()
    wq, wk, wv = gqa.qkv.weight.split((H * D, Hkv * D, Hkv * D))
    rep = lambda w: w.view(Hkv, D, C).repeat_interleave(H // Hkv, 0).reshape(H * D, C)  # noqa
    with torch.no_grad():
        mha.qkv.weight.copy_(torch.cat([wq, rep(wk), rep(wv)]))
        mha.out.weight.copy_(gqa.out.weight)
        x = torch.randn(2, 6, C)
        allowed = attention_allowed(torch.ones(2, 6, dtype=torch.long), 6)
        diff = (gqa(x, allowed, None, None)[0] - mha(x, allowed, None, None)[0]).abs().max()
    assert diff.item() <= REF_TOL


def _zero_branches(block: Block) -> None:
    with torch.no_grad():
        for lin in (block.attn.out, block.ffn.w_out):
            lin.weight.zero_()
            if lin.bias is not None:
                lin.bias.zero_()


def test_pre_norm_block_with_zero_branches_is_identity_post_norm_is_not():
    torch.manual_seed(4)
    x = torch.randn(2, 5, 32) * 3 + 1
    allowed = attention_allowed(torch.ones(2, 5, dtype=torch.long), 5)
    results = {}
    for placement in ("pre", "post"):
        block = Block(ModelConfig(d_model=32, n_heads=4, norm="layernorm",
                                  norm_placement=placement, positions="none")).eval()
        _zero_branches(block)
        with torch.no_grad():
            results[placement] = block(x, allowed, None, None, False)[0]
    assert torch.equal(results["pre"], x)  # the residual path carries the input through
    assert (results["post"] - x).abs().max().item() > 0.5  # Post-Norm normalises it away


def test_without_positions_self_attention_is_permutation_equivariant():
    torch.manual_seed(5)
    attn = Attention(ModelConfig(d_model=32, n_heads=4, n_kv_heads=2, positions="none")).eval()
    x = torch.randn(1, 6, 32)
    perm = torch.randperm(6)
    everything = torch.ones(1, 1, 6, 6, dtype=torch.bool)  # no causal mask
    with torch.no_grad():
        y = attn(x, everything, None, None)[0]
        y_perm = attn(x[:, perm], everything, None, None)[0]
    assert (y[:, perm] - y_perm).abs().max().item() <= 1e-6


def test_rope_scores_depend_only_on_relative_offset():
    torch.manual_seed(6)
    D = 16
    q, k = torch.randn(1, 1, 1, D), torch.randn(1, 1, 1, D)

    def score(m: int, n: int) -> float:
        from kvserve.model.layers import apply_rope
        cq, sq = rope_cos_sin(torch.tensor([[m]]), rope_inv_freq(D, 10000.0, None))
        ck, sk = rope_cos_sin(torch.tensor([[n]]), rope_inv_freq(D, 10000.0, None))
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum().item()

    base = score(7, 3)
    for shift in (1, 10, 100, 1000):
        assert abs(score(7 + shift, 3 + shift) - base) <= 1e-4
    assert abs(score(8, 3) - base) > 1e-3  # a different offset gives a different score


def test_sinusoidal_table_matches_the_formula():
    D = 16
    pos = torch.arange(50)[None]
    table = sinusoidal_table(pos, D)[0]  # (50, D)
    for p in (0, 1, 7, 49):
        for i in range(D // 2):
            angle = p / 10000 ** (2 * i / D)
            assert abs(table[p, 2 * i].item() - math.sin(angle)) <= 1e-5
            assert abs(table[p, 2 * i + 1].item() - math.cos(angle)) <= 1e-5


def test_fully_masked_row_is_finite():
    model = make("rope-rms-pre-swiglu-gqa")
    ids = torch.randint(0, 97, (1, 4))
    with torch.no_grad():
        out = model(ids, torch.zeros(1, 4, dtype=torch.long), output_attentions=True)
    assert torch.isfinite(out.logits).all()
    assert all(torch.isfinite(a).all() for a in out.attentions)


def test_attention_probabilities_only_when_asked():
    model = make("learned-ln-pre-gelu-mha-bias")
    ids = torch.randint(0, 97, (2, 5))
    with torch.no_grad():
        assert model(ids).attentions is None
        out = model(ids, output_attentions=True)
    assert len(out.attentions) == 2
    assert out.attentions[0].shape == (2, 4, 5, 5)  # (B, H, Tq, Tk)


def test_tied_and_untied_output_embedding():
    tied = make("rope-rms-pre-swiglu-gqa")
    untied = make("learned-ln-pre-gelu-mha-bias")
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert untied.lm_head.weight is not untied.tok_emb.weight


def test_config_round_trip_and_validation(tmp_path):
    cfg = preset("small")
    cfg.save(tmp_path / "config.json")
    assert ModelConfig.load(tmp_path / "config.json") == cfg
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="n_kv_heads"):
        ModelConfig(d_model=32, n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="positions"):
        ModelConfig(positions="alibi")
    with pytest.raises(ValueError, match="unknown model config keys"):
        ModelConfig.from_dict({"d_model": 32, "bogus": 1})


@pytest.mark.parametrize("name,params", [("gpt2", 124_439_808), ("llama-1b", 1_100_048_384)])
def test_presets_hold_real_checkpoint_shapes(name, params):
    with torch.device("meta"):  # no memory: only shapes
        model = Transformer(preset(name))
    assert model.num_parameters() == params  # GPT-2 small, TinyLlama-1.1B


def test_every_preset_builds():
    for name in PRESETS:
        preset(name)
    tiny = Transformer(preset("tiny"))
    assert tiny.num_parameters() < 500_000


def test_checkpoint_round_trip(tmp_path):
    from kvserve.model.checkpoint import load_model, save_checkpoint
    for name in ("rope-rms-pre-swiglu-gqa", "learned-ln-pre-gelu-mha-bias"):
        model = make(name)
        save_checkpoint(tmp_path / name, model)
        loaded = load_model(tmp_path / name)
        ids = torch.randint(0, 97, (1, 6))
        with torch.no_grad():
            assert torch.equal(model(ids).logits, loaded(ids).logits)
        assert loaded.cfg == model.cfg
