"""Reading a local Hugging Face directory: config.json, safetensors weights (never pickle),
generation_config.json and the tokenizer files a model ships."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from kvserve.model.checkpoint import SIDE_FILES

from .common import HFImportError

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
GENERATION_CONFIG = "generation_config.json"
# Copied into the checkpoint (and by export into the artifact) when the model ships them.
TOKENIZER_FILES = SIDE_FILES
MAX_SIDE_FILE = 256 << 20  # bytes: real tokenizer.json files are tens of MB
# generation_config.json keys recorded as the model's documented sampling defaults
SAMPLING_KEYS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "typical_p",
                 "repetition_penalty", "max_new_tokens", "max_length")


def check_dir(hf_dir: str | Path) -> Path:
    p = Path(hf_dir)
    if not p.exists():
        raise HFImportError(f"{hf_dir}: no such directory (import-hf only reads local "
                            f"directories; download with `huggingface-cli download` first)")
    if not p.is_dir():
        raise HFImportError(f"{hf_dir}: not a directory")
    if not (p / "config.json").is_file():
        raise HFImportError(f"{hf_dir}: no config.json; not a Hugging Face model directory")
    return p


def read_hf_config(hf_dir: Path) -> dict[str, Any]:
    try:
        cfg = json.loads((hf_dir / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise HFImportError(f"{hf_dir / 'config.json'}: invalid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise HFImportError(f"{hf_dir / 'config.json'}: expected a JSON object")
    return cfg


def weight_files(hf_dir: Path) -> list[Path]:
    """The safetensors files holding the weights; refuses pickle-only directories."""
    index = hf_dir / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise HFImportError(f"{index}: malformed safetensors index ({e})") from None
        names = sorted(set(weight_map.values()))
        for n in names:
            if not isinstance(n, str) or "/" in n or "\\" in n or n in (".", ".."):
                raise HFImportError(f"{index}: refusing shard name {n!r} (must be a plain file "
                                    f"name inside the directory)")
            if not (hf_dir / n).is_file():
                raise HFImportError(f"{index}: shard {n} is missing from {hf_dir}")
        return [hf_dir / n for n in names]
    if (hf_dir / SINGLE).is_file():
        return [hf_dir / SINGLE]
    found = sorted(hf_dir.glob("*.safetensors"))
    if found:
        return found
    pickles = sorted(p.name for p in hf_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise HFImportError(
            f"{hf_dir}: only pickle weights found ({', '.join(pickles)}); import-hf reads "
            f"safetensors only, because loading pickle can run arbitrary code. Convert them "
            f"first in an environment you trust, e.g. `python -c \"from transformers import "
            f"AutoModelForCausalLM as A; A.from_pretrained('DIR').save_pretrained('DIR', "
            f"safe_serialization=True)\"`")
    raise HFImportError(f"{hf_dir}: no weights (expected {SINGLE} or {INDEX} with its shards)")


def read_tensors(files: list[Path]) -> tuple[dict[str, torch.Tensor], str]:
    """All tensors of all files (duplicates are an error) and their dtype(s) as a string."""
    out: dict[str, torch.Tensor] = {}
    dtypes: set[str] = set()
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as st:
                for k in st.keys():
                    if k in out:
                        raise HFImportError(f"tensor {k} appears in more than one file "
                                            f"({f.name})")
                    t = st.get_tensor(k)
                    dtypes.add(str(t.dtype).removeprefix("torch."))
                    out[k] = t
        except SafetensorError as e:
            raise HFImportError(f"{f}: not a readable safetensors file ({e})") from None
    return out, ",".join(sorted(dtypes))




def side_files(hf_dir: Path) -> dict[str, bytes]:
    """The tokenizer and generation files present, by name; JSON ones must parse."""
    out: dict[str, bytes] = {}
    for name in TOKENIZER_FILES:
        p = hf_dir / name
        if not p.is_file():
            continue
        if p.stat().st_size > MAX_SIDE_FILE:
            raise HFImportError(f"{p}: larger than {MAX_SIDE_FILE >> 20} MiB")
        data = p.read_bytes()
        if name.endswith(".json"):
            try:
                json.loads(data)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise HFImportError(f"{p}: invalid JSON: {e}") from None
        out[name] = data
    return out


def _ids(v: Any) -> list[Any]:
    if v is None:
        return []
    return list(v) if isinstance(v, list) else [v]


def generation_settings(hf: dict[str, Any], gen: dict[str, Any] | None,
                        vocab: int) -> tuple[list[int], dict[str, Any]]:
    """(every EOS id: generation_config.json's when it lists any (as transformers' generate
    uses them), else config.json's; the documented sampling defaults of
    generation_config.json)."""
    gen = gen or {}
    eos: list[int] = []
    for v in _ids(gen.get("eos_token_id")) or _ids(hf.get("eos_token_id")):
        if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < vocab:
            if v not in eos:
                eos.append(v)
        else:
            log.warning("eos_token_id %r is outside the vocabulary [0, %d); ignored", v, vocab)
    defaults = {k: gen[k] for k in SAMPLING_KEYS
                if isinstance(gen.get(k), (int, float)) and not isinstance(gen.get(k), bool)
                or (k == "do_sample" and isinstance(gen.get(k), bool))}
    return eos[:64], defaults


def read_generation_config(hf_dir: Path) -> dict[str, Any] | None:
    p = hf_dir / GENERATION_CONFIG
    if not p.is_file():
        return None
    try:
        gen = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFImportError(f"{p}: invalid JSON: {e}") from None
    if not isinstance(gen, dict):
        raise HFImportError(f"{p}: expected a JSON object")
    return gen
