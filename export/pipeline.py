"""``export_artifacts``: checkpoint -> verified artifact directory, or an exception and nothing.

Steps: fp32 graphs (the fused graph built op by op, or with ``portable`` the torch-exported
standard-ops graphs, one function per spec) -> parity gate against torch -> optional precision
transform (fp16 / int8 / int4) with its own measurements -> manifest (with the ``runtime`` entry
the runtime reads) -> verify -> atomic rename into place. A failed gate leaves no artifact
behind. A config the fused graph cannot express is exported portable, and the manifest says
why.
"""
from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import platform
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import torch
from tqdm import tqdm

import kvserve
from kvserve.artifact.loader import load_lm
from kvserve.artifact.manifest import MANIFEST, sha256_file, write_manifest
from kvserve.artifact.spec import (ALL_SPECS, DECODE, FUSED, OPSET, PORTABLE, PREFILL, FusedSpec,
                                   runtime_section)
from kvserve.artifact.verify import verify_artifacts
from kvserve.model.checkpoint import CONFIG, SIDE_FILES, TOKENIZER, WEIGHTS, load_model

from . import fused
from . import precision as prec
from .parity import FP32_TOLERANCE, gate, measure, parity_prompts

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "fp16", "int8", "int4")


def export_artifacts(ckpt: str | Path, out: str | Path, *, precision: str = "fp32",
                     attention: bool = True, portable: bool = False, parity_steps: int = 64,
                     eval_text: str | Path | None = None, max_ppl_increase: float = 0.10,
                     optimize: bool = False, overwrite: bool = False, progress: bool = True,
                     threads: int | None = None, int4_block: int | None = None,
                     int8_block: int | None = None, paired: bool = False) -> Path:
    """``int4_block``: weights per block of an int4 export (None: ``precision.INT4_BLOCK``);
    ``int8_block``: an int8 export in 8-bit MatMulNBits blocks of that many weights (None:
    per-row int8 in standard ops); ``paired``: the fused graph's attention on one path for
    every row (``FusedSpec.paired``: the prefix cache and speculation exact on quantized
    artifacts, for a step's price)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    block = prec.block_size(precision, int4_block, int8_block)
    ckpt, out = Path(ckpt), Path(out)
    _check_args(ckpt, out, overwrite, eval_text, parity_steps, max_ppl_increase)
    model = load_model(ckpt)
    cfg = model.cfg
    kind, why_portable = _graph_kind(cfg, portable, precision, block, paired)
    specs = _specs(kind, attention, paired)
    transformed = precision != "fp32" or optimize
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    work = tmp / "_fp32"  # the graphs as exported; the gate always runs on these
    work.mkdir(parents=True)
    steps = len(specs) + 3 + (len(specs) + 1 if transformed else 0)
    bar = tqdm(total=steps, desc="export", unit="step", disable=not progress, leave=True)
    try:
        _write_graphs(model, kind, specs, work, bar)
        _graphs_manifest(work, cfg, kind, specs)
        for name in (CONFIG, *SIDE_FILES):  # tokenizer, chat template, generation config
            if (ckpt / name).is_file():
                shutil.copy(ckpt / name, tmp / name)
        shutil.copy(ckpt / CONFIG, work / CONFIG)

        bar.set_description("parity fp32")
        prompts = parity_prompts(cfg.vocab_size)
        parity_steps = _parity_steps(cfg, prompts, parity_steps)
        lm32 = load_lm(work, provider="cpu", threads=threads, attention=attention)
        report32 = measure(model, lm32, prompts, parity_steps, attention=attention)
        gate(report32, FP32_TOLERANCE)
        bar.update()
        parity = {"fp32": report32.to_dict()}
        eval_ids, eval_source = _gate_ids(ckpt, eval_text, model, precision)
        ppl = {"fp32": prec.perplexity(lm32, eval_ids, cfg.max_seq_len)} if eval_ids else {}
        del lm32

        machine = _transform(kind, specs, work, tmp, precision, optimize, bar, block)
        shutil.rmtree(work)

        if transformed:
            label = precision + ("+optimized" if optimize else "")
            bar.set_description(f"parity {label}")
            parity[label], got = _gate_transformed(model, tmp, kind, specs, precision, prompts,
                                                   parity_steps, eval_ids, threads, attention)
            if got is not None:
                _perplexity_gate(ppl, label, got, max_ppl_increase)
            bar.update()

        bar.set_description("manifest")
        content = _manifest_content(ckpt, cfg, kind, specs, precision, parity, ppl,
                                    (eval_ids, eval_source),
                                    prec.quantization(precision, block, tmp / specs[0].filename))
        if why_portable:
            content["runtime"]["portable_because"] = why_portable
        if machine is not None:
            content["optimized_for"] = machine
        readable_modes(tmp)  # before hashing: the manifest lists what is served
        write_manifest(tmp, content)
        verify_artifacts(tmp)
        bar.update()
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
        bar.set_description("done")
        bar.update()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        bar.close()
    return out


def _graph_kind(cfg, portable: bool, precision: str, block: int | None, paired: bool
                ) -> tuple[str, list[str]]:
    """The graph to export (fused or portable) and why it is portable where the fused graph
    cannot express the model; raises where the options need the fused graph."""
    why_portable = [] if portable else fused.unsupported(cfg)
    kind = PORTABLE if portable or why_portable else FUSED
    if why_portable:
        log.warning("exporting the portable graphs: the fused graph cannot express this model "
                    "(%s)", "; ".join(why_portable))
    portable_because = f"this export is portable ({'; '.join(why_portable) or '--portable'})"
    if kind == PORTABLE and block is not None:
        what = "--precision int4" if precision == "int4" else "--int8-block-size"
        raise ValueError(f"{what} needs the fused graph (MatMulNBits); {portable_because}")
    if paired and kind == PORTABLE:
        raise ValueError(f"paired attention needs the fused graph (GroupQueryAttention); "
                         f"{portable_because}")
    if paired and not prec.pairing_helps(precision, block):
        log.warning("paired attention on %s in blocks of %s: the matmul of a single row takes "
                    "another kernel there, so rows may still differ between calls (the "
                    "server's startup check then keeps the speed features off)", precision,
                    block)
    return kind, why_portable


def _gate_transformed(model, tmp: Path, kind: str, specs, precision: str, prompts,
                      parity_steps: int, eval_ids, threads, attention: bool
                      ) -> tuple[dict, float | None]:
    """The parity gate of the transformed graphs in ``tmp`` (another precision, or optimized
    offline), on the prompts the fp32 graphs were measured on: (its report, their perplexity
    on ``eval_ids``, None without them)."""
    _graphs_manifest(tmp, model.cfg, kind, specs, kv_dtype=_kv_dtype(kind, precision))
    lm = load_lm(tmp, provider="cpu", threads=threads, attention=attention)
    report = measure(model, lm, prompts, parity_steps,
                     attention=attention and precision == "fp32")
    if precision == "fp32":
        gate(report, FP32_TOLERANCE)
    elif precision == "fp16":
        gate(report, prec.FP16_TOLERANCE, require_tokens=False)
    return report.to_dict(), (prec.perplexity(lm, eval_ids, model.cfg.max_seq_len)
                              if eval_ids else None)


def _check_args(ckpt: Path, out: Path, overwrite: bool, eval_text, parity_steps: int,
                max_ppl_increase: float) -> None:
    """``out`` may be replaced only with ``overwrite``, and never when it is (or holds) the
    checkpoint being exported, or is not a directory; ``eval_text`` needs a tokenizer; the
    gate's bounds are in range."""
    if parity_steps < 64:
        raise ValueError("the parity gate runs at least 64 decode steps")
    if not 0.0 <= max_ppl_increase < float("inf"):
        raise ValueError(f"--max-ppl-increase is a fraction >= 0 (0.10: at most 10% above "
                         f"fp32), got {max_ppl_increase}")
    if eval_text is not None and not (ckpt / TOKENIZER).is_file():
        raise ValueError(f"--eval-text needs the checkpoint's {TOKENIZER} to tokenize it")
    c, o = ckpt.resolve(), out.resolve()
    if o == c or o in c.parents:
        raise ValueError(f"--out {out} is (or contains) the checkpoint {ckpt}; choose another "
                         f"directory")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass --overwrite to replace it")


def _perplexity_gate(ppl: dict, label: str, value: float, max_increase: float) -> None:
    """Record the transformed graphs' perplexity ``value`` and its change over fp32's in
    ``ppl``; raise when the change is above ``max_increase`` (or not finite)."""
    ppl[label] = value
    change = ppl["relative_change"] = value / ppl["fp32"] - 1.0
    if not np.isfinite(change) or change > max_increase:
        raise prec.PrecisionError(f"{label} raises validation perplexity by {change:+.1%} "
                                  f"(at most {max_increase:+.2%} allowed)")


def _parity_steps(cfg, prompts: list[list[int]], steps: int) -> int:
    """The gate's decode steps: as asked, or as many as the model's context leaves after the
    longest prompt (a model of 64 positions: 51)."""
    room = cfg.max_seq_len - max(map(len, prompts)) - 1
    if room < 8:
        raise ValueError(f"the model's context ({cfg.max_seq_len} positions) is too short for "
                         f"the parity gate (at least {max(map(len, prompts)) + 9})")
    if room < steps:
        log.info("parity gate: %d decode steps (the model's context is %d positions)", room,
                 cfg.max_seq_len)
    return min(steps, room)


SAMPLED_EVAL_TOKENS = 512


def _gate_ids(ckpt: Path, eval_text, model, precision: str) -> tuple[list[int] | None, str]:
    """(the perplexity figures' token ids, where they come from): the text, else (int8 and
    int4, which the figures gate, without a tokenizer) what the fp32 model samples."""
    ids = _eval_ids(ckpt, eval_text, model.cfg)
    if ids is None and precision in ("int8", "int4"):
        return _sampled_ids(model, model.cfg), "sampled by the fp32 model"
    return ids, "text"


def _sampled_ids(model, cfg) -> list[int]:
    """Evaluation ids for a checkpoint without a tokenizer: text the fp32 model samples itself
    (temperature 1, seed 0), so a quantized export is still gated on its perplexity."""
    from kvserve.model.generate import generate
    from kvserve.model.sampling import SamplingParams

    prompt = parity_prompts(cfg.vocab_size, batch=1)[0]
    n = min(SAMPLED_EVAL_TOKENS, cfg.max_seq_len - len(prompt))
    out = generate(model, [prompt], n, SamplingParams(temperature=1.0, seed=0)).tokens[0]
    log.info("no %s: the perplexity gate reads %d tokens the fp32 model sampled", TOKENIZER,
             len(out) + len(prompt))
    return [*prompt, *out]


def _specs(kind: str, attention: bool, paired: bool = False) -> tuple:
    if kind == FUSED:
        main = FusedSpec(paired=paired)
        return (main, FusedSpec(attention=True, paired=paired)) if attention else (main,)
    return ALL_SPECS if attention else (PREFILL, DECODE)


def _write_graphs(model, kind: str, specs, work: Path, bar) -> None:
    """The fp32 graphs into ``work``. Fused: the main graph, and the attention graph derived
    from it sharing its weights file."""
    if kind == FUSED:
        bar.set_description("build fused graph")
        weights = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
        fused.save(fused.build_fused(model.cfg, weights, specs[0]), work / specs[0].filename)
        bar.update()
        if len(specs) > 1:
            fused.save_attention_variant(work / specs[0].filename, work / specs[1].filename)
            bar.update()
        return
    from .onnx_export import export_graph  # torch.onnx: only the portable graphs need it

    for spec in specs:
        bar.set_description(f"export {spec.name}")
        export_graph(model, spec, work)
        bar.update()


def _transform(kind: str, specs, work: Path, tmp: Path, precision: str, optimize: bool,
               bar, block: int | None) -> dict | None:
    """Move (fp32) or convert the graphs from ``work`` into ``tmp``; optionally optimise."""
    machine = None
    first = specs[0]
    for spec in specs:
        src, dst = work / spec.filename, tmp / spec.filename
        if kind == FUSED and spec is not first:  # derived again from the converted main graph
            fused.save_attention_variant(tmp / first.filename, dst)
        elif precision == "fp32":
            for p in work.glob(spec.filename + "*"):
                p.rename(tmp / p.name)
        else:
            bar.set_description(f"{precision} {spec.name}")
            prec.convert(src, dst, precision, block)
        if optimize:
            bar.set_description(f"optimize {spec.name}")
            machine = prec.optimize_offline(dst)
        if precision != "fp32" or optimize:
            bar.update()
    return machine


def _kv_dtype(kind: str, precision: str) -> str:
    return "float16" if kind == FUSED and precision == "fp16" else "float32"


def _graphs_manifest(root: Path, cfg, kind: str, specs, kv_dtype: str = "float32") -> None:
    """The runtime finds graphs through the manifest; a provisional one serves until the end."""
    (root / MANIFEST).write_text(json.dumps({"graphs": _graph_entries(cfg, specs, kv_dtype),
                                             "runtime": _runtime(cfg, kind, specs, kv_dtype)}))


def _runtime(cfg, kind: str, specs, kv_dtype: str) -> dict:
    if kind == FUSED:
        graphs = {"main": specs[0].filename}
        if len(specs) > 1:
            graphs["attention"] = specs[1].filename
    else:
        graphs = {s.name: s.filename for s in specs}
    return runtime_section(kind, cfg, graphs, kv_dtype,
                           paired=kind == FUSED and specs[0].paired)


def _graph_entries(cfg, specs, kv_dtype: str = "float32") -> dict:
    def io(s):
        return s.io_shapes(cfg, kv_dtype) if isinstance(s, FusedSpec) else s.io_shapes(cfg)

    return {s.name: {"file": s.filename, "inputs": s.input_names(cfg),
                     "outputs": s.output_names(cfg), "io": io(s)} for s in specs}


def _eval_ids(ckpt: Path, eval_text, cfg) -> list[int] | None:
    """Token ids for the perplexity figures: --eval-text, else a fixed stdlib source file."""
    if not (ckpt / TOKENIZER).is_file():
        return None
    from tokenizers import Tokenizer

    if eval_text is None:
        import sysconfig
        eval_text = Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py"
        if not eval_text.is_file():
            return None
    text = Path(eval_text).read_text(encoding="utf-8", errors="replace")
    ids = Tokenizer.from_file(str(ckpt / TOKENIZER)).encode(text).ids
    ids = [i for i in ids if i < cfg.vocab_size][:4096]
    return ids if len(ids) >= 16 else None


def _manifest_content(ckpt, cfg, kind, specs, precision, parity, ppl, evaluated,
                      quant: dict | None) -> dict:
    """``evaluated``: (the perplexity figures' token ids, their source)."""
    kv_dtype = _kv_dtype(kind, precision)
    content = {
        "producer": {"kvserve": kvserve.__version__, "torch": torch.__version__,
                     "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__,
                     "python": platform.python_version()},
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "precision": precision,
        "kind": kind,
        "opset": OPSET,
        "runtime": _runtime(cfg, kind, specs, kv_dtype),
        "model": {"n_layers": cfg.n_layers, "n_heads": cfg.n_heads,
                  "n_kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
                  "vocab_size": cfg.vocab_size, "max_seq_len": cfg.max_seq_len,
                  "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id},
        "graphs": _graph_entries(cfg, specs, kv_dtype),
        "parity": parity,
        "source": {"checkpoint": ckpt.name, "weights_sha256": sha256_file(ckpt / WEIGHTS)},
    }
    if ppl:
        content["perplexity"] = {**ppl, "eval_tokens": len(evaluated[0]),
                                 "eval_source": evaluated[1]}
    if quant is not None:
        content["quantization"] = quant
    return content


def readable_modes(root: Path) -> None:
    """Give every file under ``root`` the mode a plain ``open()`` gives: 0666 less the umask
    (0644 under 022). ``onnx.save`` writes external data (``model.onnx.data``) 0600, which a
    server running as another user (a container's uid 10001 on a mounted host export) cannot
    read."""
    mask = os.umask(0o077)
    os.umask(mask)
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink():
            p.chmod(0o666 & ~mask)
