"""`kvserve score` against a real server: numbers vs the torch model, formats, resume, refused
texts, and a server restart in the middle of a run."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

TEXTS = {
    "code": "def add(a, b):\n    return a + b\n",
    2: "naïve café, 日本語のテキスト, emoji 😀🚀",
    "one": "x",
    "empty": "",
    "loop": "for i in range(10):\n    print(i * 2)\n" * 3,
    "cls": "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
}


@torch.no_grad()
def torch_scores(artifact, text: str) -> np.ndarray:
    """log p(ids[t] | ids[:t]) for t >= 1: log_softmax over the full forward (no cache)."""
    ids = artifact.tokenizer.encode(text)
    if len(ids) < 2:
        return np.zeros(0)
    logits = artifact.model(torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits, dim=-1)
    return lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()


def write_jsonl(path, items: dict) -> None:
    path.write_text("".join(json.dumps({"id": k, "text": v}, ensure_ascii=False) + "\n"
                            for k, v in items.items()), encoding="utf-8")


def read_records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_scores_match_torch(cli, target, artifact, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, TEXTS)
    rc, stdout, err = cli("score", str(inp), "--out", str(out), "--server", target,
                          "--per-token", "--batch-size", "2", "--concurrency", "2",
                          "--no-progress")
    assert rc == 0, err
    recs = {json.dumps(r["id"]): r for r in read_records(out)}
    assert sorted(recs) == sorted(json.dumps(k) for k in TEXTS)
    total_lp, total_n = 0.0, 0
    for key, text in TEXTS.items():
        r = recs[json.dumps(key)]
        ids = artifact.tokenizer.encode(text)
        ref = torch_scores(artifact, text)
        assert r["token_count"] == len(ids)
        assert r["scored_tokens"] == len(ref) == max(len(ids) - 1, 0)
        assert [t["id"] for t in r["tokens"]] == ids[1:]
        np.testing.assert_allclose([t["logprob"] for t in r["tokens"]], ref, rtol=1e-4,
                                   atol=1e-5)
        if len(ref):
            assert r["sum_logprob"] == pytest.approx(ref.sum(), rel=1e-4)
            assert r["mean_logprob"] == pytest.approx(ref.mean(), rel=1e-4)
            assert r["perplexity"] == pytest.approx(math.exp(-ref.mean()), rel=1e-4)
        total_lp += ref.sum()
        total_n += len(ref)
    assert recs['"one"']["perplexity"] == 1.0  # one token: nothing scored (server semantics)
    assert recs['"empty"']["token_count"] == 0 and recs['"empty"']["perplexity"] is None
    corpus = float(re.search(r"corpus perplexity ([0-9.]+)", err).group(1))
    assert corpus == pytest.approx(math.exp(-total_lp / total_n), rel=1e-4)
    assert f"{total_n} scored tokens" in err


def test_text_lines_autodetected(cli, target, artifact, tmp_path):
    inp, out = tmp_path / "in.txt", tmp_path / "out.jsonl"
    inp.write_text("def add(a, b):\n\n{not json}\nnaïve café\n", encoding="utf-8")
    rc, _, err = cli("score", str(inp), "--out", str(out), "--server", target, "--no-progress")
    assert rc == 0, err
    recs = read_records(out)
    assert sorted(r["id"] for r in recs) == [1, 3, 4]  # line numbers; blank lines skipped
    by_id = {r["id"]: r for r in recs}
    assert by_id[4]["sum_logprob"] == pytest.approx(
        torch_scores(artifact, "naïve café").sum(), rel=1e-4)
    assert "tokens" not in by_id[1]


def test_resume_skips_done_ids_and_truncates_a_partial_line(cli, target, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, TEXTS)
    done = {"id": "code", "token_count": 9, "scored_tokens": 8, "sum_logprob": -1.5,
            "mean_logprob": -0.1875, "perplexity": 1.2}  # not what the server would say
    out.write_text(json.dumps(done) + "\n" + '{"id": "loop", "token_c', encoding="utf-8")
    rc, _, err = cli("score", str(inp), "--out", str(out), "--server", target, "--no-progress")
    assert rc == 0, err
    recs = read_records(out)  # every line is whole JSON again
    assert sorted(json.dumps(r["id"]) for r in recs) == sorted(json.dumps(k) for k in TEXTS)
    assert recs[0] == done  # kept, not rescored
    assert f"scored {len(TEXTS) - 1} texts (1 already in" in err
    rc, _, err = cli("score", str(inp), "--out", str(out), "--server", target, "--no-progress")
    assert rc == 0 and f"scored 0 texts ({len(TEXTS)} already in" in err
    assert read_records(out) == recs


def test_refused_text_gets_an_error_record(cli, target, artifact, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    too_long = "def add(a, b):\n    return a + b\n" * 80  # > 256 tokens: over the context
    assert len(artifact.tokenizer.encode(too_long)) > 256
    write_jsonl(inp, {"a": "def add(a, b):", "long": too_long, "b": "naïve café"})
    rc, _, err = cli("score", str(inp), "--out", str(out), "--server", target, "--no-progress",
                     "--batch-size", "3")
    assert rc == 1
    recs = {r["id"]: r for r in read_records(out)}
    assert recs["long"]["error"].startswith("INVALID_ARGUMENT: ") and "context" in recs["long"][
        "error"]
    assert recs["a"]["scored_tokens"] > 0 and recs["b"]["scored_tokens"] > 0
    assert "1 refused" in err


def test_bad_input_is_a_one_line_error(cli, target, tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "text": "a"}\n{"id": 1, "text": "b"}\n')
    rc, _, err = cli("score", str(inp), "--out", str(tmp_path / "o.jsonl"), "--server", target)
    assert rc == 1 and len(err.strip().splitlines()) == 1 and "duplicate id 1" in err


@pytest.mark.parametrize("data, fmt, want", [
    (b'\xef\xbb\xbf{"id": "a", "text": "x"}\n{"id": "b", "text": "y"}\n', "jsonl", ["a", "b"]),
    (b'{"id": 1, "text": "\\ud800 abc"}\n', None, "is not valid Unicode"),
    (b"caf\xe9\n", None, "not UTF-8 text"),
], ids=["bom-jsonl", "lone-surrogate", "latin-1"])
def test_input_encodings(data, fmt, want, tmp_path):
    """A byte-order mark is not data; text UTF-8 cannot carry is a one-line input error."""
    from kvserve.clients.score import InputError, detect_format, read_items

    inp = tmp_path / "in.txt"
    inp.write_bytes(data)
    if isinstance(want, list):
        assert detect_format(inp) == fmt and [i.id for i in read_items(inp)] == want
    else:
        with pytest.raises(InputError, match=want):
            read_items(inp)


def test_server_restart_midway_every_id_exactly_once(serve_process, artifact, tmp_path, target):
    # score_chunk_floats = vocab: prefill one token, then one decode call per token, so a run
    # takes long enough to restart the server in the middle of it
    server = serve_process("--score-chunk-floats", str(artifact.cfg.vocab_size))
    base = list(TEXTS.values())
    items = {}
    for i in range(48):
        ids = artifact.tokenizer.encode((base[i % len(base)] + f" # {i}\n") * 4)[:200]
        items[f"t{i}"] = artifact.tokenizer.decode(ids)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, items)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve.cli", "score", str(inp), "--out", str(out), "--server",
         server.target, "--batch-size", "1", "--concurrency", "2", "--retries", "100",
         "--max-backoff", "0.3", "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while (not out.exists() or out.read_text().count("\n") < 6) and proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        server.stop()
        lines_at_stop = out.read_text().count("\n")
        time.sleep(0.3)  # the client sees the server gone and backs off
        server.start()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert 0 < lines_at_stop < len(items), "the restart did not happen in the middle of the run"
    recs = read_records(out)
    assert sorted(r["id"] for r in recs) == sorted(items)  # each id exactly once
    # and the numbers are right, whichever server instance scored them
    from kvserve.clients import Client
    with Client(target) as c:
        ref = c.score([items[r["id"]] for r in recs[:: 8]])
    for r, s in zip(recs[:: 8], ref):
        assert r["sum_logprob"] == pytest.approx(s.sum_logprob, rel=1e-4)


def _score_on_a_pty(target: str, inp, out, *extra: str) -> tuple[int, str]:
    """``kvserve score`` in a subprocess whose stderr is a terminal: (status, what it drew)."""
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import sys
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 100 columns
    try:
        p = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "score", str(inp), "--out",
                              str(out), "--server", target, "--batch-size", "2", *extra],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=slave,
                             env={**os.environ, "KVSERVE_LOG_LEVEL": "WARNING"})
        os.close(slave)
        chunks = []
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        rc = p.wait(timeout=60)
    finally:
        os.close(master)
    return rc, b"".join(chunks).decode(errors="replace")


def test_progress_bar_on_a_terminal_and_not_with_no_progress(target, tmp_path):
    inp = tmp_path / "texts.txt"
    inp.write_text("".join(f"x = {i}\n" for i in range(6)))
    rc, drawn = _score_on_a_pty(target, inp, tmp_path / "a.jsonl")
    assert rc == 0, drawn
    assert "6/6" in drawn and "text/s" in drawn  # tqdm's bar: n/total and the rate
    rc, drawn = _score_on_a_pty(target, inp, tmp_path / "b.jsonl", "--no-progress")
    assert rc == 0, drawn
    assert "6/6" not in drawn and drawn.startswith("scored 6 texts")
