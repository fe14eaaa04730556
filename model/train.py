"""``kvserve train``: train a byte-level BPE and a causal transformer, with exact resume and DDP.

Batch definition
  per-rank micro-batch = --batch-size rows of --seq-len tokens
  global batch (one optimizer step) = batch_size * grad_accum * world_size rows; the rows of a
  step are a pure function of (seed, step) (``data.BatchSampler``), so 2 processes with
  --batch-size b see exactly the rows 1 process with --batch-size 2b sees.

Checkpoint directory (--out), replaced as a whole (written to a temp dir, then renamed):
  model.safetensors, config.json, tokenizer.json       (model/checkpoint.py)
  train_config.json                                    the TrainConfig (model/train_config.py)
  optimizer.safetensors                                AdamW state by parameter name + torch RNG
  train_state.json                                     step, tokens, schedule, data position, ...
  metrics.jsonl                                        one line per step and per evaluation
Never pickled. ``--resume`` restores all of it and continues the same loss curve.

The ``Trainer`` takes a ``TrainConfig``; ``kvserve train`` builds one from its flags.
"""
from __future__ import annotations

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
from .corpus import stdlib_sources  # noqa: E402
from .generate import generate  # noqa: E402
from .run_dir import STATE, swap_dir, write_text_atomic  # noqa: E402
from .tokenizer import Tokenizer, train_bpe  # noqa: E402
from .train_config import TRAIN_CONFIG, TrainConfig  # noqa: E402
from .transformer import Transformer  # noqa: E402

log = logging.getLogger(__name__)

OPTIMIZER = "optimizer.safetensors"
METRICS = "metrics.jsonl"
STATE_VERSION = 1
ERROR_MARK = "\0error:"

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
    fresh = not any(k != "__rng__.torch" for k in tensors)  # saved before the first step
    for name, p in ([] if fresh else model.named_parameters()):
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
    def __init__(self, config: TrainConfig, resume: bool = False):
        """``config``: the invocation's (with ``resume``: its run hyperparameters already taken
        from the saved run, ``train_config.from_flags``)."""
        self.t0 = time.perf_counter()
        self.config = config
        self.out = Path(config.out)
        self.resume = resume
        self.saved: dict[str, Any] | None = None
        if resume:
            if not (self.out / STATE).is_file():
                raise FileNotFoundError(f"--resume: no {STATE} in {self.out}")
            self.saved = json.loads((self.out / STATE).read_text())
        self.cut: dict[str, Any] | None = None  # set when --max-minutes stops the run early
        if self.out.resolve() == Path.cwd().resolve():
            raise ValueError("--out must be a directory of its own, not the current directory")
        if not resume and (self.out / STATE).is_file():
            log.warning("%s holds a training run: it will be replaced (use --resume to "
                        "continue it)", self.out)

    # --- setup --------------------------------------------------------------------------
    def run(self) -> int:
        h = self.config
        if self.saved is not None and self.saved["step"] >= h.max_steps:
            done = self.saved["step"]
            print(f"kvserve train: the run in {self.out} has already reached step {done} of its "
                  f"planned {h.max_steps}; nothing to resume. To train further pass a larger "
                  f"--max-steps, e.g. kvserve train --out {self.out} --resume --max-steps "
                  f"{2 * done} (the cosine schedule is then stretched to end there)",
                  file=sys.stderr)
            return 0
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
        h, d = self.config, self.dist
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
        h = self.config
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
        h = self.config
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
        h, d = self.config, self.dist
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

    def _should_stop(self, deadline: float | None, tail_s: float) -> bool:
        """Done (--max-steps, --stop-at-step), or out of the --max-minutes budget; rank 0's
        clock decides for everyone. A budget stop is recorded in ``self.cut``."""
        h = self.config
        stop = self.step >= h.max_steps or (h.stop_at_step is not None
                                            and self.step >= h.stop_at_step)
        if deadline is None:
            return stop
        out_of_time = time.perf_counter() + tail_s > deadline
        if self.dist.on:
            flag = torch.tensor([int(out_of_time)], dtype=torch.int64)
            dist.broadcast(flag, 0)
            out_of_time = bool(flag.item())
        if out_of_time and not stop:
            self.cut = {"by": "max_minutes", "max_minutes": h.max_minutes,
                        "at_step": self.step, "planned_steps": h.max_steps}
            if self.dist.main:
                log.warning("--max-minutes %g CUT this run at step %d of %d: %d planned steps "
                            "not run, the learning-rate schedule is unfinished and the model is "
                            "not the one %d steps make; continue it with: %s", h.max_minutes,
                            self.step, h.max_steps, h.max_steps - self.step, h.max_steps,
                            self._resume_command())
        return stop or out_of_time

    def _resume_command(self) -> str:
        return f"kvserve train --out {self.out} --resume"

    def _train(self) -> None:
        h, d = self.config, self.dist
        deadline = None
        if h.max_minutes is not None:  # interpreter start-up is extra
            deadline = self.t0 + 0.98 * h.max_minutes * 60.0
        run_t0, run_step, run_tokens = time.perf_counter(), self.step, self.tokens_seen
        # time kept for the final evaluation + save; re-measured at each evaluation
        tail_s = min(5.0, 0.1 * (h.max_minutes or 0.0) * 60.0)
        if d.main:
            log.info("training steps %d -> %d (%d tokens per step)%s", self.step, h.max_steps,
                     self.sampler.global_rows * h.seq_len,
                     f"; wall-clock cap --max-minutes {h.max_minutes:g}" if deadline else "")
        # smoothing=0: the ETA is the remaining steps at the average pace of this run so far,
        # evaluations and saves included (the first, slow step is amortised, not extrapolated)
        bar = tqdm(total=h.max_steps, initial=self.step, disable=not d.main, unit="step",
                   dynamic_ncols=True, mininterval=1.0, smoothing=0, file=sys.stderr)
        last_eval = None
        while not self._should_stop(deadline, tail_s):
            loss = self._train_step()
            tps = (self.tokens_seen - run_tokens) / max(1e-9, time.perf_counter() - run_t0)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps:,.0f}", refresh=False)
            if self.step % h.eval_every == 0 and self.step < h.max_steps:
                te = time.perf_counter()
                self._eval_and_save(tps)
                last_eval = self.step
                eval_s = time.perf_counter() - te
                tail_s = (1.5 + (0.5 if h.sample_tokens else 0.0)) * eval_s + 2.0
        bar.close()
        tps = (self.tokens_seen - run_tokens) / max(1e-9, time.perf_counter() - run_t0)
        if last_eval != self.step:
            self._eval_and_save(tps)
        if d.main:
            self._report(tps, self.step - run_step)

    def _eval_and_save(self, tps: float) -> None:
        val = self.evaluate()
        recent = [m["loss"] for m in self.metrics[-self.config.eval_every:] if m["kind"] == "train"]
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
        h = self.config
        tmp = self.out.with_name(f".{self.out.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        state = {
            "version": STATE_VERSION, "step": self.step, "tokens_seen": self.tokens_seen,
            "hparams": h.run_hparams(),
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
            "time_cut": self.cut,
            "metrics": self.metrics,
        }
        metrics = "".join(json.dumps(m) + "\n" for m in self.metrics)
        save_checkpoint(tmp, self.model, self.tok.to_str(), extra_files={
            STATE: (json.dumps(state, indent=1) + "\n").encode(), METRICS: metrics.encode(),
            TRAIN_CONFIG: h.to_json().encode()})
        save_file(optimizer_tensors(self.model, self.opt), str(tmp / OPTIMIZER))
        self.out.parent.mkdir(parents=True, exist_ok=True)
        swap_dir(tmp, self.out)

    def _report(self, tps: float, steps_run: int) -> None:
        h = self.config
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
        if self.cut is not None:  # last, where it is seen
            print(f"WARNING: CUT SHORT by --max-minutes {h.max_minutes:g}: trained {self.step} "
                  f"of the planned {h.max_steps} steps ({h.max_steps - self.step} not run; the "
                  f"learning-rate schedule is unfinished, so this is not the model {h.max_steps} "
                  f"steps make). Continue the same schedule with: {self._resume_command()}")
        elif self.step < h.max_steps:
            print(f"stopped at --stop-at-step {self.step} of {h.max_steps}; continue with: "
                  f"{self._resume_command()}")
