"""``kvserve import-hf HF_DIR --out CKPT``: convert a local Hugging Face directory into a kvserve
checkpoint.

Only local directories are accepted (nothing is downloaded), weights are read with safetensors
only (never pickle: a directory with only ``pytorch_model.bin`` is refused), and
``transformers`` is not needed: the importer reads ``config.json`` and the safetensors files
directly. Anything the kvserve model cannot reproduce exactly is refused with a message naming
the option; see ``SUPPORTED`` (also printed by ``kvserve import-hf --help``). Each family's
mapping lives in its own module under ``kvserve.model.hf``; this module is the shared driver.

``generation_config.json`` gives every EOS id (``ModelConfig.eos_token_ids``) and the model's
documented sampling defaults (``extra["generation_defaults"]``); the tokenizer files the model
ships (tokenizer.json, tokenizer_config.json, special_tokens_map.json, chat template,
generation_config.json) are copied into the checkpoint.

After conversion every Hugging Face tensor must have been consumed (known buffers such as
rotary ``inv_freq`` and GPT-2's ``attn.bias`` masks excepted), and the written checkpoint is
loaded back and compared tensor by tensor with what was converted.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch

from .checkpoint import CONFIG, TOKENIZER_CONFIG, WEIGHTS, load_model, model_state, save_checkpoint
from .config import ModelConfig
from .hf import FAMILIES
from .hf.common import (HFImportError, Source, Support, UnsupportedModelError,  # noqa: F401
                        common_checks)
from .hf_support import SUPPORTED, supported_table  # noqa: F401 (re-exported)
from .hf.files import (check_dir, generation_settings, read_generation_config,  # noqa: F401
                       read_hf_config, read_tensors, side_files, weight_files)
from .transformer import Transformer

log = logging.getLogger(__name__)

_BY_ARCH = {s.architecture: s for s in SUPPORTED}
_BY_TYPE = {s.model_type: s for s in SUPPORTED}


def identify(hf: dict[str, Any]) -> Support:
    archs = hf.get("architectures")
    model_type = hf.get("model_type")
    if archs is None:
        if model_type not in _BY_TYPE:
            raise UnsupportedModelError(f"unsupported model_type {model_type!r} (and no "
                                        f"architectures); supported: {sorted(_BY_ARCH)}")
        log.warning("config.json lists no architectures; assuming %s from model_type %s",
                    _BY_TYPE[model_type].architecture, model_type)
        return _BY_TYPE[model_type]
    if not isinstance(archs, list) or len(archs) != 1:
        raise UnsupportedModelError(f"architectures={archs!r}: expected exactly one")
    arch = archs[0]
    if arch not in _BY_ARCH:
        raise UnsupportedModelError(f"unsupported architecture {arch!r}; supported: "
                                    f"{sorted(_BY_ARCH)}")
    s = _BY_ARCH[arch]
    if model_type != s.model_type:
        raise UnsupportedModelError(f"{arch} with model_type {model_type!r} (expected "
                                    f"{s.model_type!r})")
    return s


def map_config(hf: dict[str, Any], allow_unknown_keys: bool = False,
               generation: dict[str, Any] | None = None) -> ModelConfig:
    s = identify(hf)
    family = FAMILIES[s.family]
    common_checks(hf, s.architecture, family.KEYS[s.model_type], allow_unknown_keys)
    extra: dict[str, Any] = {"imported_from": s.model_type, "hf_architecture": s.architecture}
    if "transformers_version" in hf:
        extra["hf_transformers_version"] = hf["transformers_version"]
    try:
        cfg = family.config(hf, s, extra)
        vocab = cfg.vocab_size
        eos, defaults = generation_settings(hf, generation, vocab)
        if defaults:
            extra["generation_defaults"] = defaults
        if eos:
            cfg = cfg.replace(eos_token_id=eos[0], eos_token_ids=eos if len(eos) > 1 else None)
        return cfg
    except ValueError as e:
        if isinstance(e, HFImportError):
            raise
        raise HFImportError(f"{s.architecture}: the kvserve config cannot express this model: "
                            f"{e}") from None


# --- the model ------------------------------------------------------------------------------
def build_model(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> Transformer:
    """A kvserve Transformer holding exactly ``sd`` (shapes and key sets checked)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_embeddings:
        expected.pop("lm_head.weight")
    missing, extra = sorted(set(expected) - set(sd)), sorted(set(sd) - set(expected))
    if missing or extra:
        raise HFImportError(f"converted weights do not fit the kvserve model: missing={missing},"
                            f" unexpected={extra}")
    bad = [f"{k}: {tuple(sd[k].shape)} != {expected[k]}" for k in expected
           if tuple(sd[k].shape) != expected[k]]
    if bad:
        raise HFImportError("converted weights have the wrong shapes: " + "; ".join(bad))
    model.load_state_dict(sd, strict=False, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.tok_emb.weight
    still_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if still_meta:
        raise HFImportError(f"kvserve tensors left unset: {still_meta}")
    return model.eval()


# --- chat template and generation settings ----------------------------------------------------
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                   "mask_token")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        v = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise HFImportError(f"{path.name} is not valid JSON ({e})") from None
    return v if isinstance(v, dict) else {}


def chat_config(src_dir: Path) -> dict[str, Any] | None:
    """The chat template (chat_template.jinja > chat_template.json > tokenizer_config.json's
    chat_template, as transformers loads them) and the special-token strings the template
    may use, as a slim tokenizer_config.json; None when the model has no template."""
    tc = _read_json(src_dir / "tokenizer_config.json")
    template: Any = tc.get("chat_template")
    if (src_dir / "chat_template.json").is_file():
        template = _read_json(src_dir / "chat_template.json").get("chat_template", template)
    if (src_dir / "chat_template.jinja").is_file():
        template = (src_dir / "chat_template.jinja").read_text(encoding="utf-8")
    if not template:
        return None
    stm = _read_json(src_dir / "special_tokens_map.json")
    out: dict[str, Any] = {"chat_template": template}
    for name in _SPECIAL_TOKENS:
        v = tc.get(name, stm.get(name))
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            out[name] = v
    return out


# --- the import --------------------------------------------------------------------------------
def import_hf(hf_dir: str | Path, out_dir: str | Path, overwrite: bool = False,
              allow_unknown_keys: bool = False) -> Path:
    """Convert the local Hugging Face directory ``hf_dir`` into a kvserve checkpoint at
    ``out_dir`` (float32 weights). Raises ``HFImportError`` on anything not imported exactly."""
    src_dir = check_dir(hf_dir)
    out = Path(out_dir)
    if out.resolve() == src_dir.resolve():
        raise HFImportError("--out must differ from the Hugging Face directory (both use "
                            "config.json)")
    if not overwrite and ((out / CONFIG).exists() or (out / WEIGHTS).exists()):
        raise HFImportError(f"{out} already holds a checkpoint; pass --overwrite to replace it")

    hf = read_hf_config(src_dir)
    cfg = map_config(hf, allow_unknown_keys=allow_unknown_keys,
                     generation=read_generation_config(src_dir))
    files = weight_files(src_dir)
    tensors, dtypes = read_tensors(files)
    family = FAMILIES[_BY_ARCH[cfg.extra["hf_architecture"]].family]
    src = Source(tensors, family.PREFIX)
    sd = family.state(src, cfg)
    unused = src.unused()
    if unused:
        raise HFImportError(f"{len(unused)} Hugging Face tensors were not consumed, so the "
                            f"model has parts kvserve would drop: {unused[:20]}"
                            + (" ..." if len(unused) > 20 else ""))
    cfg.extra.update(hf_dtype=dtypes, hf_weight_files=[f.name for f in files],
                     hf_config_sha256=hashlib.sha256((src_dir / "config.json").read_bytes())
                     .hexdigest())
    model = build_model(cfg, sd)

    extra_files = side_files(src_dir)
    if "tokenizer.json" not in extra_files:
        log.warning("%s has no tokenizer.json; the checkpoint works with token ids only",
                    src_dir)
    chat = chat_config(src_dir)
    if chat is None:
        log.info("%s has no chat template; chat requests to the served model will be refused",
                 src_dir)
    else:  # the template wherever the model ships it, with the special-token strings it uses
        extra_files[TOKENIZER_CONFIG] = (json.dumps(chat, indent=2, sort_keys=True)
                                         + "\n").encode()
    save_checkpoint(out, model, extra_files=extra_files)

    # Verify: the written checkpoint loads into the kvserve model and holds exactly what
    # was converted.
    written = model_state(load_model(out))
    want = model_state(model)
    diff = sorted(k for k in want if k not in written or not torch.equal(written[k], want[k]))
    if diff or set(written) != set(want):
        raise HFImportError(f"checkpoint verification failed for {sorted(set(diff))}")
    log.info("imported %s (%s, %d tensors from %d file(s), %.1fM parameters) -> %s",
             src_dir, cfg.extra["hf_architecture"], len(tensors), len(files),
             model.num_parameters() / 1e6, out)
    return out
