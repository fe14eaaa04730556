"""TrainConfig: one set of defaults, saved with the run and rebuilt from its file; the flag
values of ``kvserve train`` map onto it field by field; --resume keeps the run's own."""
from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys

import pytest

from kvserve.model import train_cli
from kvserve.model.run_dir import STATE
from kvserve.model.train_config import (FIELDS, RUN_HPARAMS, TRAIN_CONFIG, TrainConfig,
                                        from_flags)


def parsed(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    train_cli.add_arguments(p)
    return p.parse_args(list(argv))


def test_every_flag_maps_to_a_field_and_no_flag_has_its_own_default():
    args = vars(parsed())
    assert set(args) == set(FIELDS) | {"resume"}
    assert all(v is None for k, v in args.items() if k != "resume")
    assert train_cli.config_from_args(parsed()) == TrainConfig()
    c = train_cli.config_from_args(parsed("--preset", "tiny", "--lr", "1e-3", "--data", "a", "b",
                                          "--max-minutes", "2.5", "--seq-len", "64"))
    assert (c.preset, c.lr, c.data, c.max_minutes, c.seq_len) == ("tiny", 1e-3, ["a", "b"],
                                                                  2.5, 64)
    assert c.batch_size == TrainConfig.batch_size == 16 and c.max_steps == 800


def test_round_trip_through_its_file(tmp_path):
    c = TrainConfig(preset="tiny", data=["x.txt"], seq_len=32, max_minutes=1.5, threads=2)
    c.save(tmp_path / TRAIN_CONFIG)
    assert TrainConfig.load(tmp_path / TRAIN_CONFIG) == c
    assert json.loads((tmp_path / TRAIN_CONFIG).read_text())["seq_len"] == 32
    assert c.replace(lr=1e-4).lr == 1e-4 and c.lr == 3e-3
    with pytest.raises(ValueError, match=r"unknown training config keys: \['bogus'\]"):
        TrainConfig.from_dict({"bogus": 1})


@pytest.mark.parametrize("change, message", [
    (dict(max_steps=0), "--max-steps must be >= 1"),
    (dict(max_steps=100_000_001), "--max-steps must be <= 100,000,000"),
    (dict(eval_batches=0), "--eval-batches must be >= 1"),
    (dict(lr=0.0), "--lr > 0"),
    (dict(max_minutes=0.0), r"--max-minutes must be in \(0, 100000\]"),
    (dict(preset="nope"), "unknown preset 'nope'"),
    (dict(preset="tiny", seq_len=257), "--seq-len 257 exceeds the model's max_seq_len 256"),
    (dict(device="tpu"), "--device must be auto, cpu or cuda"),
])
def test_bounds_name_the_flag(change, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**change)


def test_resume_keeps_the_runs_hyperparameters(tmp_path, caplog):
    run = tmp_path / "run"
    run.mkdir()
    saved = TrainConfig(preset="tiny", out=str(run), seq_len=32, lr=1e-3, max_steps=10,
                        eval_every=5)
    saved.save(run / TRAIN_CONFIG)
    (run / STATE).write_text("{}")
    with caplog.at_level(logging.WARNING):
        c = from_flags({"out": str(run), "lr": 5e-3, "eval_every": 7}, resume=True)
    assert (c.lr, c.seq_len, c.preset, c.max_steps) == (1e-3, 32, "tiny", 10)
    assert c.eval_every == 7  # not a run hyperparameter: this invocation's
    assert any("keeping lr=0.001 of the run (ignoring 0.005)" in r.getMessage()
               for r in caplog.records)
    assert from_flags({"out": str(run), "max_steps": 20}, resume=True).max_steps == 20
    # a run saved before train_config.json existed: its train_state.json hparams
    (run / TRAIN_CONFIG).unlink()
    (run / STATE).write_text(json.dumps({"hparams": {**saved.run_hparams(), "lr": 2e-3}}))
    assert from_flags({"out": str(run)}, resume=True).lr == 2e-3
    assert set(saved.run_hparams()) == {*RUN_HPARAMS, "max_steps"}
    with pytest.raises(FileNotFoundError, match="--resume: no train_state.json in"):
        from_flags({"out": str(tmp_path / "none")}, resume=True)


def test_config_and_cli_import_no_torch():
    code = ("import sys, kvserve.model.train_cli, kvserve.model.train_config; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"
