"""`kvserve train`: exact resume, checkpoint layout, learning, schedule, errors."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvserve.cli import main as cli
from kvserve.model import run_dir as R
from kvserve.model import train as T
from kvserve.model.checkpoint import load_model
from kvserve.model.tokenizer import Tokenizer
from kvserve.model.train_config import TRAIN_CONFIG, TrainConfig

TINY = ["--preset", "tiny", "--vocab-size", "320", "--val-fraction", "0.2", "--batch-size", "4",
        "--seq-len", "32", "--eval-every", "5", "--eval-batches", "2", "--warmup-steps", "3",
        "--lr", "3e-3", "--min-lr", "3e-4", "--threads", "1", "--sample-tokens", "8"]


def train(tmp_path: Path, data, out: str, *extra: str) -> int:
    return cli(["train", "--data", str(data), "--out", str(tmp_path / out),
                "--cache-dir", str(tmp_path / "cache"), *TINY, *extra])


def state(run: Path) -> dict:
    return json.loads((run / T.STATE).read_text())


def train_losses(run: Path) -> list[float]:
    return [m["loss"] for m in state(run)["metrics"] if m["kind"] == "train"]


def test_resume_continues_the_same_curve(tmp_path, tiny_corpus, capsys):
    n = 6
    assert train(tmp_path, tiny_corpus, "straight", "--max-steps", str(2 * n),
                 "--grad-accum", "2") == 0
    assert train(tmp_path, tiny_corpus, "split", "--max-steps", str(2 * n), "--grad-accum", "2",
                 "--stop-at-step", str(n)) == 0
    assert state(tmp_path / "split")["step"] == n
    assert train(tmp_path, tiny_corpus, "split", "--resume") == 0
    a, b = train_losses(tmp_path / "straight"), train_losses(tmp_path / "split")
    assert len(a) == len(b) == 2 * n
    assert a == pytest.approx(b, abs=1e-6, rel=0)
    wa = load_file(str(tmp_path / "straight" / "model.safetensors"))
    wb = load_file(str(tmp_path / "split" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    oa = load_file(str(tmp_path / "straight" / T.OPTIMIZER))
    ob = load_file(str(tmp_path / "split" / T.OPTIMIZER))
    assert all(torch.equal(oa[k], ob[k]) for k in oa)
    sa, sb = state(tmp_path / "straight"), state(tmp_path / "split")
    assert sa["tokens_seen"] == sb["tokens_seen"] == 2 * n * 4 * 2 * 32
    assert sa["weights_sha256"] == sb["weights_sha256"]


def test_checkpoint_layout_and_learning(tmp_path, tiny_corpus, capsys):
    assert train(tmp_path, tiny_corpus, "run", "--max-steps", "40", "--eval-every", "20") == 0
    run = tmp_path / "run"
    names = {p.name for p in run.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", T.OPTIMIZER, T.STATE,
            T.METRICS, TRAIN_CONFIG} <= names
    tc = TrainConfig.load(run / TRAIN_CONFIG)  # the run's config, rebuilt from its file
    assert (tc.preset, tc.max_steps, tc.eval_every, tc.seq_len, tc.out) == (
        "tiny", 40, 20, 32, str(run))
    assert not list(tmp_path.glob(".run.*"))  # no temp/old dirs left behind
    tok = Tokenizer.from_file(run / "tokenizer.json")
    model = load_model(run)
    cfg = model.cfg
    assert cfg.vocab_size == tok.vocab_size == 320
    assert (cfg.eos_token_id, cfg.pad_token_id) == (tok.eos_id, tok.pad_id)
    # a trained model can chat: ChatML's template, <|im_end|> its end of turn
    chat = json.loads((run / "tokenizer_config.json").read_text())
    assert chat == tok.chat_config() and chat["eos_token"] == "<|im_end|>"
    st = state(run)
    assert st["step"] == 40 and st["weights_sha256"] == T.weights_sha256(model)
    evals = [json.loads(line) for line in (run / T.METRICS).read_text().splitlines()]
    evals = [m for m in evals if m["kind"] == "eval"]
    assert [m["step"] for m in evals] == [20, 40]
    last = evals[-1]
    assert last["val_ppl"] == pytest.approx(math.exp(last["val_loss"]))
    # learns: clearly below the unigram baseline of the validation split
    assert last["val_loss"] < st["unigram_val_entropy"] - 0.3
    out = capsys.readouterr().out
    assert "unigram baseline" in out and "sample (greedy):" in out
    assert "def fibonacci(n):" in out


def test_jsonl_data_and_text_field(tmp_path, tiny_jsonl, capsys):
    assert train(tmp_path, tiny_jsonl, "j", "--max-steps", "2", "--sample-tokens", "0") == 0
    assert state(tmp_path / "j")["data"]["n_docs"] == 48
    rc = train(tmp_path, tiny_jsonl, "j2", "--max-steps", "2", "--text-field", "body")
    assert rc == 2
    err = capsys.readouterr().err
    assert "docs.jsonl:1: no 'body' field" in err and "Traceback" not in err


@pytest.mark.parametrize("data, message", [
    ("missing", "training data not found"),
    ("empty.txt", "no text found"),
    ("binary.txt", "is not valid UTF-8"),
])
def test_cli_errors_are_clear(tmp_path, capsys, data, message):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "binary.txt").write_bytes(b"\x80\x81\x82")
    assert train(tmp_path, tmp_path / data, "e", "--max-steps", "1") == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "e").exists()


def test_resume_without_checkpoint_and_bad_flags(tmp_path, tiny_corpus, capsys):
    assert train(tmp_path, tiny_corpus, "none", "--resume") == 2
    assert "no train_state.json" in capsys.readouterr().err
    assert train(tmp_path, tiny_corpus, "x", "--seq-len", "1000", "--max-steps", "1") == 2
    assert "exceeds the model's max_seq_len" in capsys.readouterr().err


def test_lr_schedule():
    lrs = [T.lr_at(s, 1.0, 0.1, 10, 110) for s in range(120)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[10] == pytest.approx(1.0) and lrs[60] == pytest.approx(0.55)
    assert lrs[110] == pytest.approx(0.1) and lrs[119] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))


def test_optimizer_state_round_trip():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    opt = torch.optim.AdamW(T.param_groups(model, 0.1), lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    flat = T.optimizer_tensors(model, opt)
    assert "0.weight.exp_avg" in flat and "__rng__.torch" in flat
    opt2 = torch.optim.AdamW(T.param_groups(model, 0.1), lr=1e-2)
    T.load_optimizer_tensors(model, opt2, flat)
    for p in model.parameters():
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][k], opt2.state[p][k])


def test_atomic_swap_and_recovery(tmp_path):
    out = tmp_path / "ck"
    out.mkdir()
    (out / "model.safetensors").write_text("old")
    (out / "user-notes.txt").write_text("keep me")
    tmp = tmp_path / ".ck.tmp-1"
    tmp.mkdir()
    (tmp / "model.safetensors").write_text("new")
    R.swap_dir(tmp, out)
    assert (out / "model.safetensors").read_text() == "new"
    assert (out / "user-notes.txt").read_text() == "keep me"
    assert not tmp.exists() and not (tmp_path / ".ck.old").exists()
    # a crash between the two renames leaves only the old dir: it is restored
    out.rename(tmp_path / ".ck.old")
    R.recover_checkpoint_dir(out)
    assert (out / "model.safetensors").read_text() == "new"


def test_time_budget_cuts_loudly_and_resume_finishes_the_plan(tmp_path, tiny_corpus, capsys,
                                                             caplog):
    """--max-minutes stops early, says so (WARNING + the final summary), keeps the planned
    schedule; --resume after the time-cut run ends exactly where an uncut run does."""
    n = 8
    assert train(tmp_path, tiny_corpus, "straight", "--max-steps", str(n),
                 "--sample-tokens", "0") == 0
    assert train(tmp_path, tiny_corpus, "cut", "--max-steps", str(n), "--stop-at-step", "3",
                 "--sample-tokens", "0") == 0
    capsys.readouterr()
    # the budget is spent before the first step of this invocation: cut at step 3 of 8
    assert train(tmp_path, tiny_corpus, "cut", "--resume", "--max-minutes", "0.0001") == 0
    out = capsys.readouterr().out
    assert "CUT SHORT by --max-minutes 0.0001: trained 3 of the planned 8 steps" in out
    assert f"kvserve train --out {tmp_path / 'cut'} --resume" in out
    assert any(r.levelname == "WARNING" and "CUT this run at step 3 of 8" in r.getMessage()
               for r in caplog.records)
    st = state(tmp_path / "cut")
    assert st["step"] == 3 and st["hparams"]["max_steps"] == n
    assert st["schedule"]["total_steps"] == n
    assert st["time_cut"] == {"by": "max_minutes", "max_minutes": 0.0001, "at_step": 3,
                              "planned_steps": n}
    assert train(tmp_path, tiny_corpus, "cut", "--resume") == 0  # the plan, to step 8
    out = capsys.readouterr().out
    assert f"done: step {n}/{n} (5 this run)" in out and "CUT" not in out
    a, b = state(tmp_path / "straight"), state(tmp_path / "cut")
    assert b["time_cut"] is None and b["weights_sha256"] == a["weights_sha256"]
    assert train_losses(tmp_path / "cut") == pytest.approx(train_losses(tmp_path / "straight"),
                                                           abs=1e-6, rel=0)
    # a finished run: --resume says exactly what to pass instead of silently doing nothing
    assert train(tmp_path, tiny_corpus, "cut", "--resume") == 0
    err = capsys.readouterr().err
    assert "already reached step 8 of its planned 8" in err
    assert "--resume --max-steps 16" in err
    assert state(tmp_path / "cut")["step"] == n


def test_a_budget_cut_before_the_first_step_resumes(tmp_path, tiny_corpus, capsys):
    """A checkpoint saved at step 0 (no optimizer state yet) resumes from scratch."""
    assert train(tmp_path, tiny_corpus, "zero", "--max-steps", "3", "--max-minutes", "0.0001",
                 "--sample-tokens", "0") == 0
    assert state(tmp_path / "zero")["step"] == 0
    assert train(tmp_path, tiny_corpus, "zero", "--resume") == 0
    assert state(tmp_path / "zero")["step"] == 3
