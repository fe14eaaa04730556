"""`kvserve import-hf`: exact parity with transformers (float32, eval) and clear refusals."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from hf_fixtures import VOCAB, build_hf, edit_config, save_hf, write_config_only  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from kvserve.cli import main as cli_main  # noqa: E402
from kvserve.model.checkpoint import load_model  # noqa: E402
from kvserve.model.generate import generate  # noqa: E402
from kvserve.model.hf_import import (HFImportError, UnsupportedModelError,  # noqa: E402
                                     import_hf, map_config)

LOGIT_TOL = 1e-4  # max |Δlogit| between kvserve and transformers, float32

# name -> (family, overrides); each is imported once per session (module fixture below)
CASES = {
    "gpt2_tied": ("gpt2", {}),
    "gpt2_untied_relu": ("gpt2", dict(tie_word_embeddings=False, activation_function="relu",
                                      n_inner=96)),
    "llama_gqa_tied": ("llama", dict(tie_word_embeddings=True, rope_theta=500000.0)),
    "llama_untied": ("llama", dict(tie_word_embeddings=False)),
    "llama_mha_bias": ("llama", dict(num_key_value_heads=4, attention_bias=True, mlp_bias=True,
                                     eos_token_id=[2, 3])),
    "mistral_mqa": ("mistral", dict(num_key_value_heads=1, sliding_window=4096)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True)),
}


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """name -> (hf_model, hf_dir, kvserve_model); built lazily, cached for the module."""
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            family, overrides = CASES[name]
            root = tmp_path_factory.mktemp(name)
            hf = build_hf(family, **overrides)
            hf_dir = save_hf(hf, root / "hf")
            out = import_hf(hf_dir, root / "ckpt")
            cache[name] = (hf, hf_dir, load_model(out))
        return cache[name]

    return get


def _batch(seed: int = 0, B: int = 3, T: int = 12) -> tuple[torch.Tensor, torch.Tensor,
                                                            torch.Tensor]:
    """Left-padded ids, mask and position ids (cumsum(mask) - 1, clamped at 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    for b, pad in enumerate(range(0, B * 4, 4)):  # row b has 4*b pads on the left
        mask[b, :min(pad, T - 1)] = 0
    ids = ids.masked_fill(mask == 0, 0)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos


@torch.no_grad()
def _max_diff(hf, kv, ids, mask=None, pos=None) -> float:
    ref = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    got = kv(ids, mask, pos).logits
    assert ref.shape == got.shape
    if mask is None:
        return (ref - got).abs().max().item()
    real = mask.bool()
    return (ref[real] - got[real]).abs().max().item()


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(imported, name):
    hf, _, kv = imported(name)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    assert _max_diff(hf, kv, ids) <= LOGIT_TOL


@pytest.mark.parametrize("name", ["gpt2_tied", "llama_gqa_tied", "llama_mha_bias", "qwen2"])
def test_left_padded_batch_matches(imported, name):
    hf, _, kv = imported(name)
    ids, mask, pos = _batch()
    assert mask[0].all() and not mask[-1].all()
    assert _max_diff(hf, kv, ids, mask, pos) <= LOGIT_TOL


@torch.no_grad()
def _hf_greedy(hf, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Ground truth without HF's generate/cache machinery: full recompute each step."""
    ids, toks, logits = list(prompt), [], []
    for _ in range(steps):
        last = hf(input_ids=torch.tensor([ids])).logits[0, -1]
        logits.append(last)
        toks.append(int(last.argmax()))
        ids.append(toks[-1])
    return toks, logits


@pytest.mark.parametrize("name", ["gpt2_tied", "llama_gqa_tied", "mistral_mqa"])
def test_cached_greedy_decode_matches(imported, name):
    hf, _, kv = imported(name)
    prompts = [[5, 17, 42, 99, 7, 3, 250], [11, 12, 13]]  # left-padded together by generate()
    steps = 6
    gen = generate(kv, prompts, max_new_tokens=steps, keep_logits=True)
    for b, prompt in enumerate(prompts):
        toks, ref_logits = _hf_greedy(hf, prompt, steps)
        assert gen.tokens[b] == toks
        for got, ref in zip(gen.logits[b], ref_logits):
            assert abs(torch.from_numpy(got) - ref).max().item() <= LOGIT_TOL


def test_config_mapping_and_provenance(imported):
    _, _, gpt2 = imported("gpt2_tied")
    c = gpt2.cfg
    assert (c.positions, c.norm, c.ffn, c.tie_embeddings, c.max_seq_len) == (
        "learned", "layernorm", "gelu_tanh", True, 128)
    assert c.qkv_bias and c.out_bias and c.ffn_bias
    assert (c.bos_token_id, c.eos_token_id) == (VOCAB - 1, VOCAB - 1)
    assert c.extra["imported_from"] == "gpt2" and c.extra["hf_architecture"] == "GPT2LMHeadModel"

    _, _, llama = imported("llama_gqa_tied")
    c = llama.cfg
    assert (c.positions, c.rope_base, c.norm, c.ffn, c.n_kv_heads, c.d_ff) == (
        "rope", 500000.0, "rmsnorm", "swiglu", 2, 160)
    assert not (c.qkv_bias or c.out_bias or c.ffn_bias) and c.tie_embeddings

    _, _, bias = imported("llama_mha_bias")
    assert bias.cfg.eos_token_id == 2 and bias.cfg.stop_ids == [2, 3]
    assert bias.cfg.qkv_bias and bias.cfg.out_bias and bias.cfg.ffn_bias

    _, _, qwen = imported("qwen2")
    assert qwen.cfg.qkv_bias and not qwen.cfg.out_bias


def test_sharded_checkpoint_matches_single_file(imported, tmp_path):
    hf, _, kv = imported("llama_untied")
    sharded = save_hf(hf, tmp_path / "hf", max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    got = load_model(import_hf(sharded, tmp_path / "ckpt"))
    for k, v in kv.state_dict().items():
        assert torch.equal(got.state_dict()[k], v), k


def test_gpt2_original_layout_with_buffers_and_head(imported, tmp_path):
    """The hub's gpt2 layout: no `transformer.` prefix, attn.bias mask buffers, and a (tied)
    lm_head.weight stored anyway."""
    hf, hf_dir, _ = imported("gpt2_tied")
    sd = load_file(str(hf_dir / "model.safetensors"))
    sd = {k.removeprefix("transformer."): v for k, v in sd.items()}
    sd["lm_head.weight"] = sd["wte.weight"].clone()
    for i in range(2):
        sd[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 128, 128))
    out = tmp_path / "hf"
    out.mkdir()
    save_file(sd, str(out / "model.safetensors"))
    (out / "config.json").write_text((hf_dir / "config.json").read_text())
    kv = load_model(import_hf(out, tmp_path / "ckpt"))
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(2))
    assert _max_diff(hf, kv, ids) <= LOGIT_TOL


def _rewrite_weights(hf_dir: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    sd = edit(load_file(str(hf_dir / "model.safetensors")))
    save_file(sd, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((hf_dir / "config.json").read_text())
    return dst


def test_unconsumed_tensor_is_an_error(imported, tmp_path):
    _, hf_dir, _ = imported("llama_untied")
    bad = _rewrite_weights(hf_dir, tmp_path / "hf",
                           lambda sd: {**sd, "model.layers.0.self_attn.q_norm.weight":
                                       torch.ones(16)})
    with pytest.raises(HFImportError, match=r"not consumed.*q_norm"):
        import_hf(bad, tmp_path / "ckpt")


def test_missing_tensor_and_tie_mismatch_are_errors(imported, tmp_path):
    _, hf_dir, _ = imported("llama_untied")
    no_head = _rewrite_weights(hf_dir, tmp_path / "a",
                               lambda sd: {k: v for k, v in sd.items() if k != "lm_head.weight"})
    with pytest.raises(HFImportError, match="lm_head.weight is missing"):
        import_hf(no_head, tmp_path / "ca")
    tied_but_differs = edit_config(_rewrite_weights(hf_dir, tmp_path / "b", lambda sd: sd),
                                   tie_word_embeddings=True)
    with pytest.raises(HFImportError, match="differs from the token embedding"):
        import_hf(tied_but_differs, tmp_path / "cb")


def test_tokenizer_json_is_copied(imported, tmp_path):
    from tokenizers import Tokenizer, models

    _, hf_dir, _ = imported("gpt2_tied")
    src = _rewrite_weights(hf_dir, tmp_path / "hf", lambda sd: sd)
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).to_str()
    (src / "tokenizer.json").write_text(tok)
    out = import_hf(src, tmp_path / "ckpt")
    assert (out / "tokenizer.json").read_text() == tok
    with pytest.raises(HFImportError, match="--overwrite"):
        import_hf(src, out)
    import_hf(src, out, overwrite=True)
    with pytest.raises(HFImportError, match="must differ"):
        import_hf(src, src, overwrite=True)


# --- refusals ----------------------------------------------------------------------------------
LLAMA_CFG = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=300,
                 hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                 rms_norm_eps=1e-5, hidden_act="silu",
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
GPT2_CFG = dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", vocab_size=300,
                n_embd=64, n_layer=2, n_head=4, n_positions=128,
                activation_function="gelu_new")


def test_base_configs_map():
    assert map_config(LLAMA_CFG).rope_base == 10000.0
    legacy = {**LLAMA_CFG, "rope_parameters": None, "rope_theta": 1e6, "rope_scaling": None}
    assert map_config(legacy).rope_base == 1e6
    assert map_config(GPT2_CFG).ffn == "gelu_tanh"
    assert map_config({**GPT2_CFG, "activation_function": "gelu"}).ffn == "gelu"


def test_longrope_limit_is_the_top_level_one_as_transformers_has_it():
    """transformers' Phi3Config gives a top-level original_max_position_embeddings priority over
    rope_scaling's, and defaults it to 4096 (measured: Phi3Config(...).rope_parameters)."""
    rp = {"rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 20,
          "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    phi3 = {**LLAMA_CFG, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
            "max_position_embeddings": 8192, "rope_parameters": rp}
    assert map_config({**phi3, "original_max_position_embeddings": 32}).longrope_limit == 32
    assert map_config(phi3).longrope_limit == 4096
    llama = {**LLAMA_CFG, "rope_parameters": rp}
    assert map_config(llama).longrope_limit == 20


@pytest.mark.parametrize("cfg, pattern", [
    ({**LLAMA_CFG, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
    ({**LLAMA_CFG, "rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 8.0}},
     "rope_type.*yarn"),
    ({**LLAMA_CFG, "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ({**LLAMA_CFG, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
     "rope_scaling.high_freq_factor"),
    ({**LLAMA_CFG, "hidden_act": "gelu"}, "hidden_act"),
    ({**LLAMA_CFG, "quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ({**LLAMA_CFG, "logit_scale": 0.5}, "logit_scale"),
    ({**LLAMA_CFG, "architectures": ["LlamaForSequenceClassification"]}, "unsupported arch"),
    ({**LLAMA_CFG, "architectures": ["BertForMaskedLM"], "model_type": "bert"},
     "unsupported architecture 'BertForMaskedLM'"),
    ({**LLAMA_CFG, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
      "use_sliding_window": True, "sliding_window": 8, "layer_types": ["chunked"] * 2},
     "layer_types"),
    ({**LLAMA_CFG, "architectures": ["GemmaForCausalLM"], "model_type": "gemma",
      "use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({**GPT2_CFG, "scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ({**GPT2_CFG, "reorder_and_upcast_attn": True}, "reorder_and_upcast_attn"),
    ({**GPT2_CFG, "scale_attn_weights": False}, "scale_attn_weights"),
    ({**GPT2_CFG, "activation_function": "gelu_fast"}, "activation_function"),
    ({**GPT2_CFG, "add_cross_attention": True}, "add_cross_attention"),
])
def test_unsupported_configs_are_refused(cfg, pattern):
    with pytest.raises(UnsupportedModelError, match=pattern):
        map_config(cfg)


def test_unknown_keys_can_be_allowed():
    assert map_config({**LLAMA_CFG, "some_new_knob": 1}, allow_unknown_keys=True).d_model == 64


def _cli(capsys, *argv: str) -> tuple[int, str]:
    rc = cli_main(["import-hf", *argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err


def test_refusals_via_cli(tmp_path, capsys):
    out = str(tmp_path / "ckpt")
    rc, err = _cli(capsys, str(tmp_path / "nope"), "--out", out)
    assert rc != 0 and "no such directory" in err

    pickled = write_config_only(tmp_path / "bin", LLAMA_CFG)
    (pickled / "pytorch_model.bin").write_bytes(b"not loaded")
    rc, err = _cli(capsys, str(pickled), "--out", out)
    assert rc != 0 and "pytorch_model.bin" in err and "safetensors" in err

    (pickled / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!")
    rc, err = _cli(capsys, str(pickled), "--out", out)
    assert rc != 0 and "not a readable safetensors file" in err

    unknown = write_config_only(tmp_path / "bert", {"architectures": ["BertForMaskedLM"],
                                                    "model_type": "bert"})
    rc, err = _cli(capsys, str(unknown), "--out", out)
    assert rc != 0 and "unsupported architecture" in err

    scaled = write_config_only(tmp_path / "scaled", {**LLAMA_CFG, "rope_scaling": {
        "rope_type": "dynamic", "factor": 2.0}})
    rc, err = _cli(capsys, str(scaled), "--out", out)
    assert rc != 0 and "rope_scaling" in err
    assert not Path(out).exists()


def test_cli_success_and_help(imported, tmp_path, capsys):
    _, hf_dir, kv = imported("qwen2")
    rc = cli_main(["import-hf", str(hf_dir), "--out", str(tmp_path / "ckpt")])
    assert rc == 0
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["extra"][
        "hf_architecture"] == "Qwen2ForCausalLM"
    with pytest.raises(SystemExit):
        cli_main(["import-hf", "--help"])
    out = capsys.readouterr().out
    for arch in ("GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                 "Qwen3ForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM", "Phi3ForCausalLM",
                 "SmolLM3ForCausalLM"):
        assert arch in out
    assert out.count("maps to:") == out.count("refused:") == 9


def test_chat_template_and_eos_ids_are_carried(imported, tmp_path):
    """tokenizer_config.json's chat_template (chat_template.jinja wins, as in transformers) and
    the special-token strings go into the checkpoint's slim tokenizer_config.json;
    generation_config.json's EOS ids become the model's."""
    import json

    from kvserve.model.checkpoint import TOKENIZER_CONFIG
    from kvserve.model.config import ModelConfig

    _, hf_dir, _ = imported("llama_mha_bias")
    src = _rewrite_weights(hf_dir, tmp_path / "hf", lambda sd: sd)
    (src / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": "{{ messages }}", "bos_token": {"content": "<s>", "special": True},
        "eos_token": "</s>", "model_max_length": 10 ** 30}))
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 10 ** 9]}))
    out = import_hf(src, tmp_path / "ckpt")
    tc = json.loads((out / TOKENIZER_CONFIG).read_text())
    assert tc == {"chat_template": "{{ messages }}", "bos_token": "<s>", "eos_token": "</s>"}
    # generation_config's EOS ids (out-of-vocabulary ones dropped) are the model's stop ids
    assert ModelConfig.load(out / "config.json").stop_ids == [2, 7]
    (src / "chat_template.jinja").write_text("J{{ bos_token }}")
    out = import_hf(src, tmp_path / "ckpt2")
    assert json.loads((out / TOKENIZER_CONFIG).read_text())["chat_template"] == "J{{ bos_token }}"
    no_template = _rewrite_weights(hf_dir, tmp_path / "hf3", lambda sd: sd)
    assert not (import_hf(no_template, tmp_path / "ckpt3") / TOKENIZER_CONFIG).exists()
