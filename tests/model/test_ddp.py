"""DDP: 2 processes (torchrun, gloo on CPU) with per-rank batch b == 1 process with batch 2b.

Both ranks' weight digests are all-gathered at every checkpoint (the trainer raises if they
differ) and recorded in train_state.json; the loss curve must match the single-process run on
the same global batch within 1e-4 relative (float reduction order differs, nothing else).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from kvserve.cli import main as cli
from kvserve.model.checkpoint import load_model
from kvserve.model.train import STATE, weights_sha256

STEPS = 6
COMMON = ["--preset", "tiny", "--vocab-size", "320", "--val-fraction", "0.2", "--seq-len", "32",
          "--grad-accum", "2", "--max-steps", str(STEPS), "--eval-every", "3",
          "--eval-batches", "2", "--warmup-steps", "2", "--threads", "1",
          "--sample-tokens", "0"]


def losses(run) -> list[float]:
    st = json.loads((run / STATE).read_text())
    return [m["loss"] for m in st["metrics"] if m["kind"] == "train"]


@pytest.mark.slow
def test_two_ranks_match_one_process(tmp_path, tiny_corpus):
    cache = str(tmp_path / "cache")
    ddp_out, one_out = tmp_path / "ddp", tmp_path / "one"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KVSERVE_LOG_LEVEL": "WARNING"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", "-m", "kvserve.cli", "train", "--data", str(tiny_corpus), "--out", str(ddp_out),
           "--cache-dir", cache, "--batch-size", "2", *COMMON]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    assert cli(["train", "--data", str(tiny_corpus), "--out", str(one_out), "--cache-dir", cache,
                "--batch-size", "4", *COMMON]) == 0

    st = json.loads((ddp_out / STATE).read_text())
    assert st["world_size"] == 2 and st["global_batch_rows"] == 2 * 2 * 2
    # every rank ended with the same weights, and they are the saved ones
    shas = st["rank_weights_sha256"]
    assert len(shas) == 2 and shas[0] == shas[1] == st["weights_sha256"]
    assert st["weights_sha256"] == weights_sha256(load_model(ddp_out))

    a, b = losses(ddp_out), losses(one_out)
    assert len(a) == len(b) == STEPS
    assert a == pytest.approx(b, rel=1e-4)
    wa = load_file(str(ddp_out / "model.safetensors"))
    wb = load_file(str(one_out / "model.safetensors"))
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_input_error_on_rank0_stops_every_rank(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", "-m", "kvserve.cli", "train", "--data", str(bad), "--out", str(tmp_path / "o"),
           "--cache-dir", str(tmp_path / "cache"), "--batch-size", "2", *COMMON]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert proc.stderr.count("bad.jsonl:2: no 'text' field") == 2  # both ranks, no hang
    assert not (tmp_path / "o").exists()
