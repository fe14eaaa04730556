"""``kvserve train`` flags and entry point. Light on purpose: torch is imported only when the
command runs (``kvserve train --help`` answers at once); the trainer is ``model/train.py``.

Length of a run: ``--max-steps`` (default 800) optimizer steps, the end of the cosine schedule.
A run always trains by step count, so the default model does not depend on how busy the
machine is. ``--max-minutes`` is an explicit wall-clock cap on one invocation: when it cuts the
run short, the checkpoint is saved at the step reached, a WARNING and the final summary say
how many of the planned steps were not run, and ``--resume`` continues the same schedule.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

from .config import PRESETS
from .train_config import FIELDS, TrainConfig, from_flags

# Every flag parses to None when not given: the defaults (TrainConfig's) are applied after
# parsing, so that --resume can tell which flags were given.
DEFAULTS: dict[str, Any] = TrainConfig().to_dict()


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig of a parsed ``kvserve train`` command line (with --resume: the saved
    run's hyperparameters win, see ``train_config.from_flags``)."""
    return from_flags({k: getattr(args, k, None) for k in FIELDS},
                      resume=bool(getattr(args, "resume", False)))


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
      f"here (default {d['max_steps']}; with --resume: the run's own, or a new end)")
    a("--max-minutes", type=float, help="optional wall-clock cap on this invocation, data "
      "prep included: when it is reached the run stops early, saves, and says how many planned "
      "steps it cut (the schedule is unchanged: continue with --resume). Default: none")
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
    a("--resume", action="store_true", help="continue the run saved in --out: its planned "
      "schedule, to its --max-steps (pass a larger --max-steps to extend a finished run)")
    a("--threads", type=int, help="torch threads per process (default: cores / local procs)")
    a("--device", choices=("auto", "cpu", "cuda"), help="default auto (cuda when available)")
    a("--sample-prompt", help="prompt of the final greedy sample")
    a("--sample-tokens", type=int, help=f"tokens of the final sample, 0 = none (default "
      f"{d['sample_tokens']})")


def main(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        from .train import Trainer  # torch

        return Trainer(config, resume=bool(getattr(args, "resume", False))).run()
    except (ValueError, FileNotFoundError) as e:
        print(f"kvserve train: error: {e}", file=sys.stderr)
        return 2
