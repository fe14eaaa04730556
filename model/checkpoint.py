"""Checkpoints are directories: model.safetensors + config.json (+ tokenizer.json, train state).

Never pickle: weights go through safetensors, everything else is JSON.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .config import ModelConfig
from .tokenizer import Tokenizer
from .transformer import Transformer

log = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
# the chat template and the special-token strings it uses (import-hf copies the model's; a
# checkpoint saved with a kvserve-trained tokenizer gets ChatML's; export copies it)
TOKENIZER_CONFIG = "tokenizer_config.json"
# files a checkpoint may carry beside the weights and that export copies into the artifact
# (import-hf copies the ones a Hugging Face model ships)
SIDE_FILES = (TOKENIZER, TOKENIZER_CONFIG, "special_tokens_map.json",
              "chat_template.jinja", "chat_template.json", "generation_config.json")


def model_state(model: Transformer) -> dict[str, torch.Tensor]:
    """State dict without the tied lm_head alias (safetensors refuses shared storage)."""
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.cfg.tie_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def save_checkpoint(out: str | Path, model: Transformer, tokenizer_json: str | None = None,
                    extra_files: dict[str, bytes] | None = None) -> Path:
    """``tokenizer_json``: a kvserve tokenizer (``tokenizer.json``; with ChatML's tokens it also
    writes the ChatML ``tokenizer_config.json``); ``extra_files``: name -> bytes, written as given
    (they win over both)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # Each file is written beside its final name and renamed into place: a crash never leaves
    # a half-written file (trainers that need all-or-nothing swap whole directories).
    tmp = out / (WEIGHTS + ".tmp")
    save_file(model_state(model), str(tmp), metadata={"format": "pt", "producer": "kvserve"})
    tmp.replace(out / WEIGHTS)
    files = {CONFIG: json.dumps(model.cfg.to_dict(), indent=2, sort_keys=True).encode() + b"\n"}
    if tokenizer_json is not None:
        files[TOKENIZER] = tokenizer_json.encode()
        chat = Tokenizer.from_str(tokenizer_json).chat_config()
        if chat is not None:  # the tokenizer reserves ChatML's tokens: the model can chat
            files[TOKENIZER_CONFIG] = json.dumps(chat, indent=2).encode() + b"\n"
    files.update(extra_files or {})
    for name, data in files.items():
        part = out / (name + ".tmp")
        part.write_bytes(data)
        part.replace(out / name)
    return out


def load_model(ckpt: str | Path, device: str = "cpu", dtype=torch.float32) -> Transformer:
    ckpt = Path(ckpt)
    if not (ckpt / CONFIG).is_file() or not (ckpt / WEIGHTS).is_file():
        raise FileNotFoundError(f"{ckpt} is not a kvserve checkpoint (needs {CONFIG} and "
                                f"{WEIGHTS})")
    cfg = ModelConfig.load(ckpt / CONFIG)
    model = Transformer(cfg)
    sd = load_file(str(ckpt / WEIGHTS), device=device)
    if cfg.tie_embeddings:
        sd["lm_head.weight"] = sd["tok_emb.weight"]
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise ValueError(f"checkpoint {ckpt} does not match its config: missing={missing}, "
                         f"unexpected={unexpected}")
    return model.to(device=device, dtype=dtype).eval()
