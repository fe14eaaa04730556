"""What a training run is: one dataclass of hyperparameters and run options, its defaults and
bounds in one place; saved with every checkpoint (``train_config.json``, as the model's
``config.json``) and rebuilt from that file on ``--resume``.

No torch import: ``kvserve train --help`` reads the defaults from here. The flags are
``train_cli.py``, the trainer ``train.py``; neither is imported here.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import PRESETS, ModelConfig
from .corpus import DEFAULT_MAX_BYTES
from .run_dir import STATE, recover_checkpoint_dir

log = logging.getLogger(__name__)

TRAIN_CONFIG = "train_config.json"
MAX_STEPS_LIMIT = 100_000_000
MAX_MINUTES_LIMIT = 100_000
# Fixed for the life of a run: taken from the saved run on --resume (max_steps too, unless a
# new end is given).
RUN_HPARAMS = ("preset", "data", "text_field", "val_fraction", "vocab_size", "corpus_bytes",
               "batch_size", "seq_len", "grad_accum", "lr", "min_lr", "warmup_steps",
               "weight_decay", "grad_clip", "eval_batches", "seed")


@dataclass
class TrainConfig:
    # data and tokenizer
    preset: str = "small"
    data: list[str] | None = None  # None = the Python stdlib sources of this machine
    text_field: str = "text"
    val_fraction: float = 0.05
    vocab_size: int | None = None  # None = the preset's
    out: str = "runs/default"
    cache_dir: str | None = None  # None = <out>/../.kvserve-cache
    corpus_bytes: int = DEFAULT_MAX_BYTES
    # length of the run and of this invocation
    max_steps: int = 800
    max_minutes: float | None = None
    stop_at_step: int | None = None
    # batch and optimizer
    batch_size: int = 16
    seq_len: int = 128
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    # evaluation, machine, final sample
    eval_every: int = 200
    eval_batches: int = 8
    seed: int = 1337
    threads: int | None = None  # None = cores / local processes
    device: str = "auto"  # auto | cpu | cuda
    sample_prompt: str = "def fibonacci(n):\n"
    sample_tokens: int = 64

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the flag at fault."""
        for k in ("max_steps", "batch_size", "seq_len", "grad_accum", "eval_every",
                  "eval_batches"):
            if getattr(self, k) < 1:
                raise ValueError(f"--{k.replace('_', '-')} must be >= 1")
        if self.warmup_steps < 0 or self.lr <= 0 or self.min_lr < 0:
            raise ValueError("--warmup-steps/--min-lr must be >= 0; --lr > 0")
        if self.max_minutes is not None and not 0 < self.max_minutes <= MAX_MINUTES_LIMIT:
            raise ValueError(f"--max-minutes must be in (0, {MAX_MINUTES_LIMIT}]")
        if self.max_steps > MAX_STEPS_LIMIT:
            raise ValueError(f"--max-steps must be <= {MAX_STEPS_LIMIT:,}")
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose from {sorted(PRESETS)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device must be auto, cpu or cuda, not {self.device!r}")
        max_len = PRESETS[self.preset].get("max_seq_len", ModelConfig.max_seq_len)
        if self.seq_len > max_len:
            raise ValueError(f"--seq-len {self.seq_len} exceeds the model's max_seq_len "
                             f"{max_len}")

    # --- persistence ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown training config keys: {unknown}")
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "TrainConfig":
        return cls.from_dict(json.loads(Path(path).read_text()))

    def replace(self, **changes: Any) -> "TrainConfig":
        return TrainConfig.from_dict({**self.to_dict(), **changes})

    def run_hparams(self) -> dict[str, Any]:
        """What fixes the run (saved in train_state.json too): RUN_HPARAMS and max_steps."""
        return {k: getattr(self, k) for k in (*RUN_HPARAMS, "max_steps")}


FIELDS = tuple(f.name for f in dataclasses.fields(TrainConfig))


def saved_run_hparams(out: Path) -> dict[str, Any]:
    """The run hyperparameters of the checkpoint in ``out``: from its train_config.json, or
    from train_state.json's ``hparams`` for runs saved before that file existed. Restores a
    checkpoint an interrupted save left aside first."""
    recover_checkpoint_dir(out)
    if not (out / STATE).is_file():
        raise FileNotFoundError(f"--resume: no {STATE} in {out}")
    if (out / TRAIN_CONFIG).is_file():
        return TrainConfig.load(out / TRAIN_CONFIG).run_hparams()
    return json.loads((out / STATE).read_text())["hparams"]


def from_flags(given: dict[str, Any], resume: bool = False) -> TrainConfig:
    """The config of an invocation. ``given``: flag values by field name, None where the flag
    was not given (the default applies). With ``resume`` the run's own RUN_HPARAMS win over
    the flags (a WARNING names each flag ignored), and its max_steps unless one is given."""
    unknown = sorted(set(given) - set(FIELDS))
    if unknown:
        raise ValueError(f"unknown training config keys: {unknown}")
    values = {k: v for k, v in given.items() if v is not None}
    if resume:
        saved = saved_run_hparams(Path(values.get("out", TrainConfig.out)))
        for k in RUN_HPARAMS:
            if k in values and values[k] != saved[k]:
                log.warning("--resume: keeping %s=%r of the run (ignoring %r)", k, saved[k],
                            values[k])
            values[k] = saved[k]
        values.setdefault("max_steps", saved["max_steps"])
    return TrainConfig(**values)
