"""`kvserve generate` against a real server on loopback."""
from __future__ import annotations

import io
import json
import math
import struct

import pytest

from client_helpers import free_port, run_cli
from kvserve.clients import Client

PROMPT = "def add(a, b):"
ARGS = ("--max-new-tokens", "16", "--ignore-eos", "--greedy")


@pytest.fixture(scope="module")
def reference(target):
    with Client(target) as c:
        return c.generate(PROMPT, max_new_tokens=16, ignore_eos=True, top_logprobs=3)


class FlushCounter(io.StringIO):
    flushes = 0

    def flush(self):
        self.flushes += 1
        super().flush()


def test_streamed_text_equals_server_text(cli, target, reference, artifact, monkeypatch):
    rc, out, err = cli("generate", PROMPT, "--server", target, *ARGS)
    assert rc == 0, err
    assert reference.generated_tokens == 16
    assert reference.text == artifact.tokenizer.decode([t.id for t in reference.tokens])
    assert out == reference.text + ("" if reference.text.endswith("\n") else "\n")
    assert "finish: length" in err and "generated 16" in err
    # streamed: each non-empty delta is flushed as it arrives
    fake = FlushCounter()
    monkeypatch.setattr("sys.stdout", fake)
    from kvserve import cli as kvserve_cli
    assert kvserve_cli.main(["generate", PROMPT, "--server", target, *ARGS, "--quiet"]) == 0
    assert fake.getvalue() == out
    assert fake.flushes >= sum(1 for t in reference.tokens if t.text)


def test_json_events(cli, target, reference):
    rc, out, err = cli("generate", PROMPT, "--server", target, *ARGS, "--json", "--logprobs", "2")
    assert rc == 0, err
    events = [json.loads(line) for line in out.splitlines()]
    tokens, done = events[:-1], events[-1]
    assert [e["type"] for e in tokens] == ["token"] * 16 and done["type"] == "complete"
    assert [e["index"] for e in tokens] == list(range(16))
    assert [e["id"] for e in tokens] == [t.id for t in reference.tokens]
    assert "".join(e["text"] for e in tokens) == done["text"] == reference.text
    assert done["finish_reason"] == "length" and done["generated_tokens"] == 16
    assert all(len(e["top_logprobs"]) == 2 for e in tokens)
    for e, t in zip(tokens, reference.tokens):
        assert e["logprob"] == pytest.approx(t.logprob, abs=1e-6)


def test_logprobs_table(cli, target, reference):
    rc, out, err = cli("generate", PROMPT, "--server", target, *ARGS, "--logprobs", "3")
    assert rc == 0, err
    text, _, table = out.partition("\n\n")
    assert text + "\n" == reference.text + "\n" or text == reference.text
    lines = table.strip("\n").splitlines()
    assert lines[0].split()[:5] == ["#", "text", "id", "logprob", "prob"]
    assert len(lines) == 1 + 16
    for line, t in zip(lines[1:], reference.tokens):
        cells = line.split()
        assert int(cells[0]) == t.index
        lp = float(next(c for c in cells if c.startswith("-") and "." in c))
        assert lp == pytest.approx(t.logprob, abs=1e-4)
        assert len(t.top_logprobs) == 3
        # the alternatives' logprobs, most likely first, and the chosen one is not above them
        assert line.endswith(f"{t.top_logprobs[-1].logprob:.3f}")
        assert t.logprob <= t.top_logprobs[0].logprob + 1e-6
        assert math.exp(t.logprob) == pytest.approx(float(cells[cells.index(f"{lp:.4f}") + 1]),
                                                    abs=1e-3)


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_attention_png(cli, target, tmp_path, artifact):
    out_png = tmp_path / "att.png"
    rc, out, err = cli("generate", PROMPT, "--server", target, "--max-new-tokens", "6",
                       "--ignore-eos", "--attention", str(out_png))
    assert rc == 0, err
    data = out_png.read_bytes()
    w, h = _png_size(data)
    assert 300 <= w <= 6000 and 200 <= h <= 6000
    assert len(data) > 10_000
    import matplotlib.image
    img = matplotlib.image.imread(out_png)
    assert img.shape[:2] == (h, w) and img.std() > 0.05  # not blank


def test_attention_subset_of_layers_and_heads(cli, target, tmp_path):
    out_png = tmp_path / "att1.png"
    rc, _, err = cli("generate", PROMPT, "--server", target, "--max-new-tokens", "4",
                     "--attention", str(out_png), "--attention-layers", "1",
                     "--attention-heads", "0,2")
    assert rc == 0, err
    assert _png_size(out_png.read_bytes())[0] > 0


def test_unreachable_server_one_line_error():
    r = run_cli("generate", "hello", "--server", f"127.0.0.1:{free_port()}", "--retries", "1")
    assert r.returncode != 0
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("kvserve generate: UNAVAILABLE: ")
    assert "Traceback" not in r.stderr


def test_refused_request_one_line_error(cli, target):
    rc, out, err = cli("generate", PROMPT, "--server", target, "--top-p", "1.5")
    assert rc == 1 and out == ""
    assert err.strip().splitlines() == [
        "kvserve generate: INVALID_ARGUMENT: sampling.top_p is 1.5; it must be in (0, 1]"]


def test_stop_string_reported(cli, target, reference):
    stop = reference.tokens[5].text or reference.text[3:5]
    rc, out, err = cli("generate", PROMPT, "--server", target, *ARGS, "--stop", stop, "--json")
    assert rc == 0, err
    done = json.loads(out.splitlines()[-1])
    assert done["finish_reason"] == "stop_sequence" and done["stop_sequence"] == stop
    assert stop not in done["text"]


def test_tls_ca_and_token(cli, artifact, tmp_path):
    from kvserve_testing import running_app, self_signed

    self_signed(tmp_path)  # cert.pem, key.pem
    with running_app(artifact, tls_cert=str(tmp_path / "cert.pem"),
                     tls_key=str(tmp_path / "key.pem"), auth_token="s3cret") as app:
        server = f"localhost:{app.port}"
        args = ("generate", PROMPT, "--server", server, "--tls-ca", str(tmp_path / "cert.pem"),
                "--max-new-tokens", "3", "--ignore-eos", "--quiet")
        rc, out, err = cli(*args, "--token", "s3cret")
        assert rc == 0 and out.strip(), err
        rc, out, err = cli(*args)
        assert rc == 1 and err.strip().splitlines() == [
            "kvserve generate: UNAUTHENTICATED: missing credentials: send "
            "`authorization: Bearer <token>` (give --token or set KVSERVE_AUTH_TOKEN)"]
        rc, out, err = cli(*args[:4], "--max-new-tokens", "3", "--retries", "0")  # plaintext
        assert rc == 1 and len(err.strip().splitlines()) == 1 and "UNAVAILABLE" in err


def test_attention_without_matplotlib_fails_before_any_request(cli, monkeypatch, tmp_path):
    """No server listens at this address: the matplotlib check answers before any connection."""
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    rc, out, err = cli("generate", "x", "--server", f"127.0.0.1:{free_port()}", "--retries", "0",
                       "--attention", str(tmp_path / "a.png"))
    assert rc == 1 and out == ""
    assert err == "kvserve generate: --attention needs matplotlib: pip install 'kvserve[viz]'\n"
    assert not (tmp_path / "a.png").exists()


def test_default_samples_with_a_printed_seed_that_repeats_the_run(cli, target, reference):
    """No sampling flag: temperature 0.8 / top-k 40 / top-p 0.95 and a random seed, printed
    on stderr; --seed N with the same flags gives the same text, the seed's line is not
    repeated (the user chose it)."""
    import re

    args = ("generate", PROMPT, "--server", target, "--max-new-tokens", "16", "--ignore-eos")
    rc, out, err = cli(*args)
    assert rc == 0, err
    first = err.splitlines()[0]
    m = re.fullmatch(r"\[sampling: temperature 0\.8, top-k 40, top-p 0\.95, seed (\d+) "
                     r"\(--seed \1 repeats this run; --greedy for the most likely tokens\)\]",
                     first)
    assert m, err
    rc, again, err2 = cli(*args, "--seed", m[1])
    assert rc == 0 and again == out and "[sampling:" not in err2
    with Client(target) as c:
        want = c.generate(PROMPT, max_new_tokens=16, ignore_eos=True, temperature=0.8,
                          top_k=40, top_p=0.95, seed=int(m[1]))
    assert out == want.text + ("" if want.text.endswith("\n") else "\n")


def test_explicit_flags_keep_their_meaning(cli, target, reference):
    """--temperature 0 is greedy as before (no seed line); --greedy with a sampling flag is
    one line; --quiet prints no seed line."""
    base = ("generate", PROMPT, "--server", target, "--max-new-tokens", "16", "--ignore-eos")
    rc, out, err = cli(*base, "--temperature", "0")
    assert rc == 0 and "[sampling:" not in err
    assert out == reference.text + ("" if reference.text.endswith("\n") else "\n")
    rc, out, err = cli(*base, "--greedy", "--top-k", "5")
    assert rc == 1 and out == ""
    assert err.strip() == "kvserve generate: --greedy cannot be combined with --top-k"
    rc, out, err = cli(*base, "--quiet")
    assert rc == 0 and err == ""
