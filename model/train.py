"""``kvserve train``: train a byte-level BPE and a causal transformer, with exact resume and DDP.

Batch definition
  per-rank micro-batch = --batch-size rows of --seq-len tokens
  global batch (one optimizer step) = batch_size * grad_accum * world_size rows; the rows of a
  step are a pure function of (seed, step) (``data.BatchSampler``), so 2 processes with
  --batch-size b see exactly the rows 1 process with --batch-size 2b sees.

Checkpoint directory (--out), replaced as a whole (written to a temp dir, then renamed):
  model.safetensors, config.json, tokenizer.json       (model/checkpoint.py)
  optimizer.safetensors                                AdamW state by parameter name + torch RNG
  train_state.json                                     step, tokens, schedule, data position, ...
  metrics.jsonl                                        one line per step and per evaluation
Never pickled. ``--resume`` restores all of it and continues the same loss curve.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# On a shared machine OpenMP threads that spin while waiting starve each other (measured on 2
# busy cores: 8.5 s/step spinning vs 1.2 s passive). libgomp reads this
# once, when torch loads it, so it is set before the first torch import; the user's value wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from tqdm import tqdm  # noqa: E402
from tqdm.contrib.logging import logging_redirect_tqdm  # noqa: E402

from . import data as D  # noqa: E402
from .checkpoint import TOKENIZER, load_model, model_state, save_checkpoint  # noqa: E402
from .config import PRESETS, ModelConfig, preset  # noqa: E402
from .corpus import DEFAULT_MAX_BYTES, stdlib_sources  # noqa: E402
from .generate import generate  # noqa: E402
from .tokenizer import Tokenizer, train_bpe  # noqa: E402
from .transformer import Transformer  # noqa: E402

log = logging.getLogger(__name__)

OPTIMIZER = "optimizer.safetensors"
STATE = "train_state.json"
METRICS = "metrics.jsonl"
STATE_VERSION = 1
ERROR_MARK = "\0error:"

# Defaults, applied after parsing so that --resume can tell which flags were given.
DEFAULTS: dict[str, Any] = dict(
    preset="small", data=None, text_field="text", val_fraction=0.05, vocab_size=None,
    out="runs/default", cache_dir=None, corpus_bytes=DEFAULT_MAX_BYTES,
    max_steps=800, max_minutes=6.0, stop_at_step=None,
    batch_size=16, seq_len=128, grad_accum=1,
    lr=3e-3, min_lr=3e-4, warmup_steps=50, weight_decay=0.1, grad_clip=1.0,
    eval_every=200, eval_batches=8, seed=1337, threads=None, device="auto",
    sample_prompt="def fibonacci(n):\n", sample_tokens=64,
)
# Fixed for the life of a run: taken from train_state.json on --resume.
RUN_HPARAMS = ("preset", "data", "text_field", "val_fraction", "vocab_size", "corpus_bytes",
               "batch_size", "seq_len", "grad_accum", "lr", "min_lr", "warmup_steps",
               "weight_decay", "grad_clip", "eval_batches", "seed")


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    a = p.add_argument
    a("--preset", choices=sorted(PRESETS), help=f"model shape (default {d['preset']})")
    a("--data", nargs="+", metavar="PATH", help="text files, directories (recursive), globs or "
      "JSONL files (default: the Python stdlib sources of this machine)")
    a("--text-field", help=f"JSONL field holding the text (default {d['text_field']!r})")
    a("--val-fraction", type=float, help="fraction of documents held out for validation, "
      f"chosen by a hash of each document (default {d['val_fraction']})")
    a("--vocab-size", type=int, help="BPE vocabulary size (default: the preset's)")
    a("--out", help=f"checkpoint directory (default {d['out']})")
    a("--cache-dir", help="where tokenizers and token files are cached (default: "
      "<out>/../.kvserve-cache)")
    a("--corpus-bytes", type=int, help="cap on the default stdlib corpus (default "
      f"{d['corpus_bytes']})")
    a("--max-steps", type=int, help="optimizer steps of the run; the cosine schedule ends "
      f"here (default {d['max_steps']})")
    a("--max-minutes", type=float, help="wall-clock budget of this invocation, data prep "
      f"included; stops early and saves (default {d['max_minutes']})")
    a("--stop-at-step", type=int, help="stop this invocation at this step and save (the "
      "schedule still targets --max-steps; continue with --resume)")
    a("--batch-size", type=int, help=f"rows per micro-batch per process (default "
      f"{d['batch_size']})")
    a("--seq-len", type=int, help=f"tokens per row (default {d['seq_len']})")
    a("--grad-accum", type=int, help=f"micro-batches per step (default {d['grad_accum']})")
    a("--lr", type=float, help=f"peak learning rate (default {d['lr']})")
    a("--min-lr", type=float, help=f"final learning rate of the cosine (default {d['min_lr']})")
    a("--warmup-steps", type=int, help=f"linear warmup steps (default {d['warmup_steps']})")
    a("--weight-decay", type=float, help="AdamW weight decay on matrices (default "
      f"{d['weight_decay']}; none on norms, biases, embeddings)")
    a("--grad-clip", type=float, help=f"max global grad norm, 0 = off (default {d['grad_clip']})")
    a("--eval-every", type=int, help=f"steps between validation + checkpoint (default "
      f"{d['eval_every']})")
    a("--eval-batches", type=int, help=f"validation batches (default {d['eval_batches']})")
    a("--seed", type=int, help=f"seed of init and data order (default {d['seed']})")
    a("--resume", action="store_true", help="continue the run saved in --out")
    a("--threads", type=int, help="torch threads per process (default: cores / local procs)")
    a("--device", choices=("auto", "cpu", "cuda"), help="default auto (cuda when available)")
    a("--sample-prompt", help="prompt of the final greedy sample")
    a("--sample-tokens", type=int, help=f"tokens of the final sample, 0 = none (default "
      f"{d['sample_tokens']})")


def main(args: argparse.Namespace) -> int:
    try:
        return Trainer(args).run()
    except (ValueError, FileNotFoundError) as e:
        print(f"kvserve train: error: {e}", file=sys.stderr)
        return 2


# --- distributed ----------------------------------------------------------------------------
@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def on(self) -> bool:
        return self.world > 1

    def barrier(self) -> None:
        if self.on:
            dist.barrier()


def setup_distributed(device: str) -> Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    d = Dist(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")),
             int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if device == "cuda":
        torch.cuda.set_device(d.local_rank)
    dist.init_process_group(backend="nccl" if device == "cuda" else "gloo")
    log.info("DDP: rank %d of %d (local rank %d)", d.rank, d.world, d.local_rank)
    return d


def broadcast_text(text: str | None, d: Dist) -> str:
    """Rank 0's string on every rank, as bytes in tensors (no pickling)."""
    if not d.on:
        assert text is not None
        return text
    raw = text.encode() if d.main and text is not None else b""
    n = torch.tensor([len(raw)], dtype=torch.int64)
    dist.broadcast(n, 0)
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw \
        else torch.zeros(int(n.item()), dtype=torch.uint8)  # (n,)
    dist.broadcast(buf, 0)
    return bytes(buf.numpy()).decode()


# --- small pure helpers ---------------------------------------------------------------------
def lr_at(step: int, lr: float, min_lr: float, warmup: int, total: int) -> float:
    """Linear warmup over ``warmup`` steps, then cosine from lr to min_lr at step ``total``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if step >= total:
        return min_lr
    progress = (step - warmup) / max(1, total - warmup)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():  # tied weights appear once
        (decay if p.dim() >= 2 and "emb" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def optimizer_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """AdamW state flattened by parameter name (``<name>.exp_avg`` ...) + the torch RNG."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        for key, v in opt.state.get(p, {}).items():
            t = v if torch.is_tensor(v) else torch.tensor(float(v))
            out[f"{name}.{key}"] = t.detach().reshape(-1).cpu().clone() if t.dim() == 0 \
                else t.detach().cpu().contiguous()
    out["__rng__.torch"] = torch.get_rng_state()
    return out


def load_optimizer_tensors(model: nn.Module, opt: torch.optim.Optimizer,
                           tensors: dict[str, torch.Tensor]) -> None:
    for name, p in model.named_parameters():
        st = {}
        for key in ("step", "exp_avg", "exp_avg_sq"):
            k = f"{name}.{key}"
            if k not in tensors:
                raise ValueError(f"optimizer state lacks {k}: checkpoint does not match model")
            t = tensors[k]
            st[key] = t.reshape(()) if key == "step" else t.to(p.device)
        opt.state[p] = st
    if "__rng__.torch" in tensors:
        torch.set_rng_state(tensors["__rng__.torch"])


def weights_sha256(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model_state(model).items()):
        h.update(name.encode())
        h.update(t.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _old_dir(out: Path) -> Path:
    return out.with_name(f".{out.name}.old")


def recover_checkpoint_dir(out: Path) -> None:
    """A crash between the two renames of ``swap_dir`` leaves only ``.<out>.old``: restore it."""
    old = _old_dir(out)
    if old.is_dir() and not out.exists():
        log.warning("restoring the previous checkpoint from %s (interrupted save)", old)
        os.rename(old, out)


def swap_dir(tmp: Path, out: Path) -> None:
    """Make ``tmp`` the checkpoint at ``out``; foreign files in ``out`` are carried over."""
    if out.is_dir():
        for entry in out.iterdir():
            if not (tmp / entry.name).exists():
                os.rename(entry, tmp / entry.name)
        old = _old_dir(out)
        shutil.rmtree(old, ignore_errors=True)
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)


class LossModel(nn.Module):
    """What DDP wraps: tokens in, mean next-token cross-entropy out."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # x, y: (B, T)
        logits = self.model(x).logits  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())  # ()


# --- the trainer ----------------------------------------------------------------------------
class Trainer:
    def __init__(self, args: argparse.Namespace):
        self.t0 = time.perf_counter()
        self.args = args
        given = {k: getattr(args, k, None) for k in DEFAULTS}
        self.out = Path(given["out"] or DEFAULTS["out"])
        self.resume = bool(getattr(args, "resume", False))
        self.saved: dict[str, Any] | None = None
        if self.resume:
            recover_checkpoint_dir(self.out)
            if not (self.out / STATE).is_file():
                raise FileNotFoundError(f"--resume: no {STATE} in {self.out}")
            self.saved = json.loads((self.out / STATE).read_text())
        hp = {k: (v if v is not None else DEFAULTS[k]) for k, v in given.items()}
        if self.saved is not None:
            for k in RUN_HPARAMS:
                old = self.saved["hparams"][k]
                if given[k] is not None and given[k] != old:
                    log.warning("--resume: keeping %s=%r of the run (ignoring %r)", k, old,
                                given[k])
                hp[k] = old
            if given["max_steps"] is None:
                hp["max_steps"] = self.saved["hparams"]["max_steps"]
        self.hp = argparse.Namespace(**hp)
        self._validate()

    def _validate(self) -> None:
        h = self.hp
        for k in ("max_steps", "batch_size", "seq_len", "grad_accum", "eval_every",
                  "eval_batches"):
            if getattr(h, k) < 1:
                raise ValueError(f"--{k.replace('_', '-')} must be >= 1")
        if h.warmup_steps < 0 or h.lr <= 0 or h.min_lr < 0 or h.max_minutes <= 0:
            raise ValueError("--warmup-steps/--min-lr must be >= 0; --lr, --max-minutes > 0")
        max_len = PRESETS[h.preset].get("max_seq_len", ModelConfig.max_seq_len)
        if h.seq_len > max_len:
            raise ValueError(f"--seq-len {h.seq_len} exceeds the model's max_seq_len {max_len}")
        if self.out.resolve() == Path.cwd().resolve():
            raise ValueError("--out must be a directory of its own, not the current directory")
        if not self.resume and (self.out / STATE).is_file():
            log.warning("%s holds a training run: it will be replaced (use --resume to "
                        "continue it)", self.out)

    # --- setup --------------------------------------------------------------------------
    def run(self) -> int:
        h = self.hp
        device = h.device if h.device != "auto" else ("cuda" if torch.cuda.is_available()
                                                      else "cpu")
        self.device = torch.device(device)
        self.dist = setup_distributed(device)
        try:
            threads = h.threads or max(1, len(os.sched_getaffinity(0)) // self.dist.local_world)
            torch.set_num_threads(threads)
            self._setup_data()
            self._setup_model()
            with logging_redirect_tqdm() if self.dist.main else contextlib.nullcontext():
                self._train()
        finally:
            if self.dist.on:
                dist.destroy_process_group()
        return 0

    def _setup_data(self) -> None:
        h, d = self.hp, self.dist
        files = D.resolve_inputs(h.data) if h.data else stdlib_sources(h.corpus_bytes)
        cache = Path(h.cache_dir) if h.cache_dir else self.out.parent / ".kvserve-cache"
        fp = D.fingerprint(files, h.text_field, h.val_fraction)
        vocab = h.vocab_size or PRESETS[h.preset]["vocab_size"]
        tok_path = (self.out / TOKENIZER) if self.resume else cache / f"tok-{fp}-{vocab}.json"
        tok_json = None
        if d.main:
            try:
                if not tok_path.is_file():
                    cache.mkdir(parents=True, exist_ok=True)
                    log.info("training a byte-level BPE (vocab %d) on %d file(s)", vocab,
                             len(files))
                    docs = D.train_documents(files, h.text_field, h.val_fraction)
                    write_text_atomic(tok_path, train_bpe(docs(), vocab).to_str())
                tok_json = tok_path.read_text()
            except (ValueError, FileNotFoundError) as e:
                tok_json = ERROR_MARK + str(e)  # tell the other ranks instead of hanging them
        tok_json = broadcast_text(tok_json, d)
        if tok_json.startswith(ERROR_MARK):
            raise ValueError(tok_json[len(ERROR_MARK):])
        self.tok = Tokenizer.from_str(tok_json).require_special_tokens()
        tok_id = hashlib.sha256(self.tok.to_str().encode()).hexdigest()[:12]
        tok_dir = cache / f"tokens-{fp}-{tok_id}"
        failed = ""
        if d.local_rank == 0:  # one tokenization per machine (deterministic: same files)
            try:
                D.build_tokens(files, self.tok, tok_dir, h.text_field, h.val_fraction)
            except (ValueError, FileNotFoundError) as e:
                failed = str(e)
        if d.on:
            flag = torch.tensor([int(bool(failed))])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() and not failed:
                failed = "tokenization failed on another rank (see its log)"
        if failed:
            raise ValueError(failed)
        self.data = D.open_tokens(tok_dir)
        self.data_fp, self.n_files = fp, len(files)
        self.sampler = D.BatchSampler(self.data.train, h.batch_size, h.seq_len, h.seed,
                                      h.grad_accum, d.world, d.rank)
        n_eval_rows = h.eval_batches * h.batch_size * d.world
        self.eval_rows = D.eval_starts(len(self.data.val), h.seq_len, n_eval_rows)
        self.unigram = D.unigram_entropy(self.data.val, self.tok.vocab_size)
        if d.main:
            log.info("data: %d train / %d validation tokens; unigram baseline of the validation "
                     "split: %.4f nats/token (ppl %.1f)", len(self.data.train),
                     len(self.data.val), self.unigram, D.perplexity(self.unigram))

    def _setup_model(self) -> None:
        h = self.hp
        if self.resume:
            self.model = load_model(self.out, device=str(self.device)).train()
            if self.model.cfg.vocab_size != self.tok.vocab_size:
                raise ValueError("checkpoint config and tokenizer disagree on the vocabulary")
        else:
            cfg = preset(h.preset, vocab_size=self.tok.vocab_size, eos_token_id=self.tok.eos_id,
                         pad_token_id=self.tok.pad_id)
            torch.manual_seed(h.seed)
            self.model = Transformer(cfg).to(self.device).train()
        cfg: ModelConfig = self.model.cfg
        if h.seq_len > cfg.max_seq_len:
            raise ValueError(f"--seq-len {h.seq_len} exceeds the model's max_seq_len "
                             f"{cfg.max_seq_len}")
        self.opt = torch.optim.AdamW(param_groups(self.model, h.weight_decay), lr=h.lr,
                                     betas=(0.9, 0.95), eps=1e-8)
        self.step, self.tokens_seen, self.metrics, self.elapsed_before = 0, 0, [], 0.0
        if self.saved is not None:
            load_optimizer_tensors(self.model, self.opt,
                                   load_file(str(self.out / OPTIMIZER)))
            s = self.saved
            self.step, self.tokens_seen = s["step"], s["tokens_seen"]
            self.metrics, self.elapsed_before = s["metrics"], s["elapsed_s"]
            if s["world_size"] != self.dist.world:
                log.warning("--resume with %d processes (run started with %d): the global "
                            "batch changes", self.dist.world, s["world_size"])
            if s["data"]["fingerprint"] != self.data_fp:
                log.warning("--resume: the training data changed since the run started")
            log.info("resumed %s at step %d (%d tokens seen)", self.out, self.step,
                     self.tokens_seen)
        self.lm = LossModel(self.model)
        if self.dist.on:
            self.lm = nn.parallel.DistributedDataParallel(
                self.lm, device_ids=[self.dist.local_rank] if self.device.type == "cuda"
                else None)
        if self.dist.main:
            log.info("model: preset %s, %.2fM parameters, vocab %d; global batch %d x %d "
                     "tokens (%d per process x %d accum x %d processes)", h.preset,
                     self.model.num_parameters() / 1e6, cfg.vocab_size,
                     self.sampler.global_rows, h.seq_len, h.batch_size, h.grad_accum,
                     self.dist.world)

    # --- loop ---------------------------------------------------------------------------
    def _train_step(self) -> float:
        h = self.hp
        lr = lr_at(self.step, h.lr, h.min_lr, h.warmup_steps, h.max_steps)
        for g in self.opt.param_groups:
            g["lr"] = lr
        loss_sum = torch.zeros((), dtype=torch.float64)
        for m in range(h.grad_accum):
            x, y = self.sampler.micro_batch(self.step, m)  # (B, T), (B, T)
            x, y = x.to(self.device), y.to(self.device)
            sync = (not self.dist.on or m == h.grad_accum - 1)
            with (contextlib.nullcontext() if sync else self.lm.no_sync()):
                loss = self.lm(x, y)  # ()
                (loss / h.grad_accum).backward()
            loss_sum += loss.detach().double().cpu()
        if h.grad_clip > 0:
            nn.utils.clip_grad_norm_(self.model.parameters(), h.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        step_loss = loss_sum / h.grad_accum
        if self.dist.on:  # the mean over the global batch (equal rows per rank)
            dist.all_reduce(step_loss)
            step_loss /= self.dist.world
        self.step += 1
        self.tokens_seen += self.sampler.global_rows * h.seq_len
        self.metrics.append({"kind": "train", "step": self.step, "loss": float(step_loss),
                             "lr": lr, "tokens": self.tokens_seen})
        return float(step_loss)

    @torch.no_grad()
    def evaluate(self) -> float:
        h, d = self.hp, self.dist
        self.model.eval()
        mine = self.eval_rows[d.rank::d.world]
        tot = torch.zeros(2, dtype=torch.float64)  # (sum of losses, tokens)
        for i in range(0, len(mine), h.batch_size):
            x, y = D.windows(self.data.val, mine[i:i + h.batch_size], h.seq_len)  # (B, T)
            logits = self.model(x.to(self.device)).logits  # (B, T, V)
            tot[0] += F.cross_entropy(logits.flatten(0, 1).float(), y.to(self.device).flatten(),
                                      reduction="sum").double().cpu()
            tot[1] += y.numel()
        if d.on:
            dist.all_reduce(tot)
        self.model.train()
        return float(tot[0] / tot[1])

    def _should_stop(self, deadline: float, tail_s: float, horizon: int | None) -> bool:
        """Rank 0's clock decides for everyone: out of time, and a shortened horizon."""
        h = self.hp
        out_of_time = time.perf_counter() + tail_s > deadline
        if self.dist.on:
            flags = torch.tensor([int(out_of_time), horizon or 0], dtype=torch.int64)
            dist.broadcast(flags, 0)
            out_of_time, horizon = bool(flags[0]), int(flags[1]) or None
        if horizon is not None and horizon < h.max_steps:
            log.warning("at %.2f s/step the %.1f-minute budget ends near step %d, not %d: the "
                        "cosine schedule now ends there (recorded in %s)", self._sps,
                        h.max_minutes, horizon, h.max_steps, STATE)
            h.max_steps = horizon
        stop = self.step >= h.max_steps or (h.stop_at_step is not None
                                            and self.step >= h.stop_at_step)
        if out_of_time and not stop:
            log.warning("--max-minutes %.1f reached at step %d of %d: stopping early",
                        h.max_minutes, self.step, h.max_steps)
        return stop or out_of_time

    def _fit_horizon(self, deadline: float, tail_s: float, t_first: float, n_timed: int,
                     eval_s: float) -> int | None:
        """The step the budget reaches at the measured pace, if it is before --max-steps, so
        that the learning-rate schedule still completes (only ever shortens; rank 0)."""
        h = self.hp
        if not self.dist.main or n_timed < 5:
            return None
        now = time.perf_counter()
        self._sps = (now - t_first) / n_timed
        left = h.max_steps - self.step
        evals_left = left // h.eval_every
        if now + left * self._sps + evals_left * eval_s + tail_s <= deadline:
            return None
        usable = max(0.0, deadline - now - tail_s) * 0.95
        steps = int(usable / (self._sps + eval_s / h.eval_every))
        return max(self.step + 1, self.step + steps)

    def _train(self) -> None:
        h, d = self.hp, self.dist
        deadline = self.t0 + 0.98 * h.max_minutes * 60.0  # interpreter start-up is extra
        run_t0, run_step, run_tokens = time.perf_counter(), self.step, self.tokens_seen
        # time kept for the final evaluation + save; re-measured at each evaluation
        tail_s = min(5.0, 0.1 * h.max_minutes * 60.0)
        eval_s, t_first, self._sps = 2.0, None, 0.0
        bar = tqdm(total=h.max_steps, initial=self.step, disable=not d.main, unit="step",
                   dynamic_ncols=True, mininterval=1.0, file=sys.stderr)
        last_eval, horizon = None, None
        while not self._should_stop(deadline, tail_s, horizon):
            bar.total = h.max_steps
            loss = self._train_step()
            tps = (self.tokens_seen - run_tokens) / max(1e-9, time.perf_counter() - run_t0)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps:,.0f}", refresh=False)
            horizon = None
            if self.step % h.eval_every == 0 and self.step < h.max_steps:
                te = time.perf_counter()
                self._eval_and_save(tps)
                last_eval = self.step
                eval_s = time.perf_counter() - te
                tail_s = (1.5 + (0.5 if h.sample_tokens else 0.0)) * eval_s + 2.0
                t_first, n_timed = time.perf_counter(), 0  # re-measure the pace after saving
            elif t_first is None:
                t_first, n_timed = time.perf_counter(), 0  # after the first (slow) step
            else:
                n_timed += 1
                if n_timed in (10, 50) or n_timed % 100 == 0:
                    horizon = self._fit_horizon(deadline, tail_s, t_first, n_timed, eval_s)
        bar.close()
        tps = (self.tokens_seen - run_tokens) / max(1e-9, time.perf_counter() - run_t0)
        if last_eval != self.step:
            self._eval_and_save(tps)
        if d.main:
            self._report(tps, self.step - run_step)

    def _eval_and_save(self, tps: float) -> None:
        val = self.evaluate()
        recent = [m["loss"] for m in self.metrics[-self.hp.eval_every:] if m["kind"] == "train"]
        rec = {"kind": "eval", "step": self.step, "tokens": self.tokens_seen,
               "val_loss": val, "val_ppl": D.perplexity(val),
               "train_loss": float(np.mean(recent)) if recent else None,
               "tokens_per_s": tps, "elapsed_s": self._elapsed()}
        self.metrics.append(rec)
        sha = weights_sha256(self.model)
        shas = self._gather_sha(sha)
        if self.dist.main:
            log.info("step %d: val loss %.4f (ppl %.2f), train loss %s, %.0f tokens/s",
                     self.step, val, rec["val_ppl"], f"{rec['train_loss']:.4f}"
                     if recent else "-", tps)
            self._save(sha, shas)
        self.dist.barrier()

    def _gather_sha(self, sha: str) -> list[str]:
        """Every rank's weight digest; raises if DDP replicas diverged."""
        if not self.dist.on:
            return [sha]
        mine = torch.tensor(list(bytes.fromhex(sha)), dtype=torch.int64)  # (32,)
        all_ = [torch.zeros_like(mine) for _ in range(self.dist.world)]
        dist.all_gather(all_, mine)
        shas = [bytes(t.tolist()).hex() for t in all_]
        if len(set(shas)) != 1:
            raise RuntimeError(f"DDP replicas diverged at step {self.step}: {shas}")
        return shas

    def _elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.t0

    def _save(self, sha: str, rank_shas: list[str]) -> None:
        h = self.hp
        tmp = self.out.with_name(f".{self.out.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        state = {
            "version": STATE_VERSION, "step": self.step, "tokens_seen": self.tokens_seen,
            "hparams": {k: getattr(h, k) for k in (*RUN_HPARAMS, "max_steps")},
            "schedule": {"kind": "linear-warmup-cosine", "lr": h.lr, "min_lr": h.min_lr,
                         "warmup_steps": h.warmup_steps, "total_steps": h.max_steps},
            "rng": {"init_seed": h.seed, "data_seed": h.seed,
                    "torch_rng": f"{OPTIMIZER}:__rng__.torch"},
            "data": {"sampler": "random-windows numpy.default_rng([seed, step])",
                     "next_step": self.step, "fingerprint": self.data_fp,
                     "n_files": self.n_files, **self.data.meta},
            "world_size": self.dist.world, "global_batch_rows": self.sampler.global_rows,
            "unigram_val_entropy": self.unigram, "elapsed_s": self._elapsed(),
            "weights_sha256": sha, "rank_weights_sha256": rank_shas,
            "metrics": self.metrics,
        }
        metrics = "".join(json.dumps(m) + "\n" for m in self.metrics)
        save_checkpoint(tmp, self.model, self.tok.to_str(), extra_files={
            STATE: (json.dumps(state, indent=1) + "\n").encode(), METRICS: metrics.encode()})
        save_file(optimizer_tensors(self.model, self.opt), str(tmp / OPTIMIZER))
        self.out.parent.mkdir(parents=True, exist_ok=True)
        swap_dir(tmp, self.out)

    def _report(self, tps: float, steps_run: int) -> None:
        h = self.hp
        ev = [m for m in self.metrics if m["kind"] == "eval"][-1]
        print(f"unigram baseline (validation token entropy): {self.unigram:.4f} nats/token "
              f"(ppl {D.perplexity(self.unigram):.1f})")
        print(f"done: step {self.step}/{h.max_steps} ({steps_run} this run), "
              f"{self.tokens_seen:,} tokens, {tps:,.0f} tokens/s, wall "
              f"{time.perf_counter() - self.t0:.1f} s")
        print(f"validation loss {ev['val_loss']:.4f} (ppl {ev['val_ppl']:.2f}) vs unigram "
              f"{self.unigram:.4f}; checkpoint: {self.out}")
        if h.sample_tokens > 0:
            self.model.eval()
            prompt = self.tok.encode(h.sample_prompt)
            gen = generate(self.model, [prompt], h.sample_tokens, eos_id=self.tok.eos_id)
            print("sample (greedy):")
            print(self.tok.decode(prompt + gen.tokens[0]))
