"""The speculation cell's model and text: the default trained model (``kvserve train`` with its
defaults, as ``scripts/main.sh`` trains it), cached in the bench cache so it is trained once,
and held-out standard-library files it continues.

Under ``<cache>/models/trained/``:
  ckpt/    ``kvserve train --out ...`` (trained into ``.ckpt-train`` and renamed when done,
           so a directory that exists holds a finished run)
  fp32/    ``export_artifacts(ckpt, precision="fp32")``
  hf/      the same weights as a transformers LlamaForCausalLM directory (``to_hf``; checked
           against the kvserve model's logits), for onnxruntime-genai's builder and llama.cpp
  genai/   onnxruntime-genai's builder on hf/

Held-out text: the documents of the default corpus that the trainer's split put in
validation (``model/data.py``: a hash of each file's text, ``--val-fraction`` 0.05): neither the
weights nor the tokenizer were trained on them. ``held_out_files`` picks them in the order of
that hash, so the choice is deterministic on a machine.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

N_FILES = 16  # held-out files the speculation cell continues
PROMPT_TOKENS = 384  # the opening of each file given as the prompt
DATA_DEFAULTS = {"val_fraction": 0.05, "text_field": "text"}  # kvserve train's defaults


# --- held-out files ----------------------------------------------------------------------------
def held_out_files(files: list[Path] | None = None, val_fraction: float = 0.05) -> list[Path]:
    """The validation-split documents of the default corpus (``files``: the corpus, default
    ``stdlib_sources()``), ordered by their split hash."""
    from kvserve.model import data as D
    from kvserve.model.corpus import stdlib_sources

    files = list(files) if files is not None else stdlib_sources()
    units = D.split_units(files, DATA_DEFAULTS["text_field"])
    is_val = D.assign_split(units, val_fraction)
    if len(units) == 1:
        raise ValueError("one document: the trainer holds out no whole file")
    return [f for _, f in sorted((u, f) for u, f, v in zip(units, files, is_val) if v)]


def code_prompts(tokenizer_json: Path, files: list[Path], n: int = N_FILES,
                 length: int = PROMPT_TOKENS) -> tuple[list[list[int]], list[str]]:
    """The first ``length`` tokens of the first ``n`` files long enough to have them (and as
    many again to continue into): (prompts, file names)."""
    from tokenizers import Tokenizer

    from kvserve.model.corpus import stdlib_root

    root = stdlib_root()
    tok = Tokenizer.from_file(str(tokenizer_json))
    prompts, names = [], []
    for f in files:
        ids = tok.encode(f.read_text(encoding="utf-8")).ids
        if len(ids) >= 2 * length:
            prompts.append(ids[:length])
            names.append(str(f.relative_to(root)) if f.is_relative_to(root) else f.name)
        if len(prompts) == n:
            break
    if len(prompts) < n:
        raise ValueError(f"only {len(prompts)} held-out files have {2 * length} tokens")
    return prompts, names


# --- the trained model -------------------------------------------------------------------------
def train(out: Path, threads: int | None = None) -> Path:
    """``kvserve train`` with its defaults into ``out`` (reused when it exists)."""
    if (out / "model.safetensors").is_file():
        return out
    work = out.with_name(".ckpt-train")
    cmd = [sys.executable, "-m", "kvserve.cli", "train", "--out", str(work)]
    if (work / "train_state.json").is_file():
        cmd.append("--resume")  # an interrupted run continues its schedule
    if threads:
        cmd += ["--threads", str(threads)]
    log.info("training the default model (kvserve train) into %s", work)
    r = subprocess.run(cmd)
    if r.returncode != 0 or not (work / "model.safetensors").is_file():
        raise RuntimeError(f"kvserve train failed ({r.returncode})")
    state = json.loads((work / "train_state.json").read_text())
    if state.get("step") != state.get("max_steps", state.get("step")):
        raise RuntimeError(f"kvserve train stopped at step {state.get('step')}")
    work.rename(out)
    return out


def hf_state(sd: dict, cfg) -> dict:
    """kvserve tensor names -> transformers Llama names (the inverse of
    ``model/hf/llama.py``'s ``llama_state``: the same rotary layout, no permutation)."""
    hd = cfg.explicit_head_dim or cfg.d_model // cfg.n_heads
    q, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd
    out = {"model.embed_tokens.weight": sd["tok_emb.weight"],
           "model.norm.weight": sd["norm_f.weight"]}
    for i in range(cfg.n_layers):
        h, o = f"model.layers.{i}.", f"layers.{i}."
        out[h + "input_layernorm.weight"] = sd[o + "norm1.weight"]
        out[h + "post_attention_layernorm.weight"] = sd[o + "norm2.weight"]
        wq, wk, wv = sd[o + "attn.qkv.weight"].split([q, kv, kv])
        out[h + "self_attn.q_proj.weight"] = wq
        out[h + "self_attn.k_proj.weight"] = wk
        out[h + "self_attn.v_proj.weight"] = wv
        out[h + "self_attn.o_proj.weight"] = sd[o + "attn.out.weight"]
        gate, up = sd[o + "ffn.w_in.weight"].chunk(2)
        out[h + "mlp.gate_proj.weight"] = gate
        out[h + "mlp.up_proj.weight"] = up
        out[h + "mlp.down_proj.weight"] = sd[o + "ffn.w_out.weight"]
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    return {k: v.contiguous().clone() for k, v in out.items()}


def to_hf(ckpt: Path, out: Path, atol: float = 1e-4) -> Path:
    """The checkpoint as a transformers Llama directory (weights + tokenizer); its logits on
    a sample are checked against the kvserve model's within ``atol``."""
    if (out / "config.json").is_file():
        return out
    import torch
    import transformers as tf

    from kvserve.model.checkpoint import load_model

    model = load_model(ckpt).eval()
    cfg = model.cfg
    plain = (cfg.positions == "rope" and cfg.norm == "rmsnorm" and cfg.ffn == "swiglu"
             and not (cfg.qkv_bias or cfg.out_bias or cfg.ffn_bias or cfg.rope_scaling
                      or cfg.sliding_window or cfg.qk_norm))
    if not plain:
        raise ValueError(f"{ckpt} is not a plain Llama shape")
    hcfg = tf.LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
                          intermediate_size=cfg.d_ff, num_hidden_layers=cfg.n_layers,
                          num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                          max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
                          rope_theta=cfg.rope_base, tie_word_embeddings=cfg.tie_embeddings,
                          hidden_act="silu", bos_token_id=cfg.eos_token_id,
                          eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id)
    hf = tf.LlamaForCausalLM(hcfg).float().eval()
    missing, unexpected = hf.load_state_dict(hf_state(model.state_dict(), cfg), strict=False)
    if unexpected or [m for m in missing if not (m == "lm_head.weight" and cfg.tie_embeddings)
                      and "rotary" not in m]:
        raise RuntimeError(f"HF state mismatch: missing {missing}, unexpected {unexpected}")
    if cfg.tie_embeddings:
        hf.tie_weights()
    x = torch.arange(2, 66)[None] % cfg.vocab_size
    with torch.no_grad():
        diff = (hf(x).logits - model(x).logits).abs().max().item()
    if diff > atol:
        raise RuntimeError(f"the HF copy's logits differ by {diff:.2e} (> {atol})")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    hf.save_pretrained(str(tmp), safe_serialization=True)
    tok = ckpt / "tokenizer.json"
    fast = tf.PreTrainedTokenizerFast(tokenizer_file=str(tok), eos_token="<|endoftext|>",
                                      bos_token="<|endoftext|>", pad_token="<|pad|>")
    fast.save_pretrained(str(tmp))
    shutil.copy(tok, tmp / "tokenizer.json")
    tmp.rename(out)
    log.info("HF copy of %s: logits within %.1e", ckpt, diff)
    return out


def snapshot(run: Path, cache: Path) -> tuple[Path, Path, str]:
    """A checkpoint of a ``kvserve train`` run (finished or not: ``--trained-ckpt``) copied
    into the cache by its step: (root, ckpt, what it is)."""
    state = json.loads((run / "train_state.json").read_text())
    step, planned = state["step"], state["hparams"]["max_steps"]
    root = cache / "models" / f"trained-step{step}"
    ckpt = root / "ckpt"
    if not (ckpt / "model.safetensors").is_file():
        tmp = root / f".ckpt.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for name in ("model.safetensors", "config.json", "tokenizer.json", "train_state.json"):
            shutil.copy(run / name, tmp / name)
        tmp.rename(ckpt)
    return root, ckpt, f"step {step} of {planned}"


def build_trained(cache: Path, *, genai: bool = True, threads: int = 2,
                  ckpt: Path | None = None):
    """Train (once), export, and convert the default model; returns a ``build.Built``.
    ``ckpt``: a checkpoint of a default run to use instead (``--trained-ckpt``: an
    unfinished run's last save, labelled with its step)."""
    from .build import Built, Size, build_artifacts, build_genai

    secs = {}
    if ckpt is not None:
        root, ckpt, what = snapshot(Path(ckpt), cache)
    else:
        root = cache / "models" / "trained"
        root.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        ckpt = train(root / "ckpt")
        secs["train"] = round(time.perf_counter() - t0, 1)
        what = "finished"
    cfg = json.loads((ckpt / "config.json").read_text())
    size = Size(name="trained", vocab=cfg["vocab_size"], d_model=cfg["d_model"],
                n_layers=cfg["n_layers"], n_heads=cfg["n_heads"],
                n_kv_heads=cfg["n_kv_heads"] or cfg["n_heads"], d_ff=cfg["d_ff"],
                max_seq_len=cfg["max_seq_len"], tie=cfg["tie_embeddings"],
                label=f"default trained model (kvserve train: d{cfg['d_model']}, "
                      f"{cfg['n_layers']}L, V{cfg['vocab_size']}; {what})")
    fp32 = build_artifacts(ckpt, root / "fp32", "fp32", threads)
    hf = to_hf(ckpt, root / "hf")
    g = build_genai(hf, root / "genai", threads) if genai else None
    return Built(size, root, hf, ckpt, fp32, None, g, secs)
